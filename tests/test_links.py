"""The learner side of an external collector, on a clock the test sets: the attach
deadline counts from the first request, only while a request waits; a packer that
attached is judged by its process and its heartbeat. (tests/test_liveness.py drives
the same verdicts through whole pipelines, with real processes and timeouts.)"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from replay_fsm.data.buffer import ReplayBuffer
from replay_fsm.runtime import links
from replay_fsm.runtime.links import ExternalCollector
from replay_fsm.wire import PackRequest

from .support import MARGIN_S, Exited, finishes_within

S = 1_000_000_000  # ns per second


class Clock:
    def __init__(self) -> None:
        self.ns = 1_000 * S

    def __call__(self) -> int:
        return self.ns

    def advance(self, seconds: float = 0.0, ns: int = 0) -> None:
        self.ns += int(seconds * S) + ns


def looked_over(link: links.CollectorLink, clock: Clock, seconds: float, *,
                step: float = 2.5, waiting: bool = True, timeout: float = 5.0
                ) -> links.Gone | None:
    """The first verdict of looks at ``link`` over ``seconds`` of ``clock``, one every
    ``step`` seconds (by default half the bound of 5 s: each stretch between two looks
    counts in full, ``looks.LookClock``); None if none came."""
    left = int(seconds * S)
    while left > 0:
        advance = min(left, int(step * S))
        clock.advance(ns=advance)
        left -= advance
        gone = link.liveness(waiting=waiting, timeout=timeout)
        if gone is not None:
            return gone
    return None


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(links.time, "monotonic_ns", c)
    return c


@pytest.fixture
def link() -> Iterator[ExternalCollector]:
    made = ExternalCollector(ReplayBuffer(64, 3, 2), 2, 4, attach_timeout=10.0)
    yield made
    made.stop(1.0)


def send(link: ExternalCollector, tick: int = 0) -> None:
    link.send(PackRequest(tick, tick % 2, 1, tick, 4, -1), snapshot=(64, 64), hot_slot=-1)


def test_the_attach_deadline_counts_from_the_first_request(
        link: ExternalCollector, clock: Clock) -> None:
    clock.advance(100)  # long before any request: nothing is owed yet
    assert link.liveness(waiting=True, timeout=5.0) is None
    send(link)
    assert looked_over(link, clock, 6) is None
    send(link, 1)  # a later request does not restart the count
    assert looked_over(link, clock, 4) is None  # 10 s: at the bound
    clock.advance(ns=1)  # one nanosecond past it
    gone = link.liveness(waiting=True, timeout=5.0)
    assert gone is not None and gone.reason == (
        "no collector called Packer.attach(pipe.packer_handle(), rb) within 10 s of the "
        "first request")
    # a request still waiting for its rows: no collector at all is no less a verdict
    assert link.liveness(waiting=False, timeout=5.0) == gone


def test_the_attach_deadline_counts_a_stretch_no_look_saw_for_half_of_it(
        link: ExternalCollector, clock: Clock) -> None:
    """attach_timeout 1 s under liveness_timeout 5 s: the deadline counted on the
    link's clock, whose cap is half of liveness_timeout, so one stop of 3 s after the
    first look judged the collector absent on its own (helper-87). Its own clock caps
    a stretch at half of attach_timeout."""
    link.attach_timeout = 1.0
    send(link)
    assert link.liveness(waiting=True, timeout=5.0) is None
    clock.advance(3)  # the whole job stopped
    assert link.liveness(waiting=True, timeout=5.0) is None  # 0.5 s of it counted
    assert looked_over(link, clock, 0.5, step=0.5) is None  # 1 s: at the bound
    clock.advance(ns=1)
    gone = link.liveness(waiting=True, timeout=5.0)
    assert gone is not None and gone.reason == (
        "no collector called Packer.attach(pipe.packer_handle(), rb) within 1 s of the "
        "first request")


def test_an_attached_collector_is_judged_by_its_process_and_heartbeat(
        link: ExternalCollector, clock: Clock) -> None:
    send(link)
    state = link.handle.packer_state
    state[0], state[1] = os.getpid(), clock.ns  # attached in this process: alive
    # long past the attach deadline: it no longer applies
    assert looked_over(link, clock, 60, waiting=False) is None
    gone = looked_over(link, clock, 10)
    # every look saw it silent: 60 s, then 2.5 s. An external collector serves between
    # its environment steps: its silence names those, not a pack (helper-95: a
    # collector asleep in its step was said "hung inside a pack?")
    assert gone is not None and gone.reason == (
        f"no heartbeat from the collector (pid {os.getpid()}) for 62.5 s (alive but no "
        "packer.service() call: an environment step longer than liveness_timeout, or "
        "hung in a step or a pack?)")
    state[1] = clock.ns - 4 * S  # beat 4 s ago, bound 5 s
    assert link.liveness(waiting=True, timeout=5.0) is None

    exited = subprocess.Popen(["true"])
    exited.wait()
    state[0] = exited.pid
    gone = link.liveness(waiting=False, timeout=5.0)
    assert gone is not None and gone.reason == (
        f"the collector process (pid {exited.pid}) is gone")


def test_a_watched_process_is_asked_first(link: ExternalCollector, clock: Clock) -> None:
    link.watch(Exited(), "the simulator")
    gone = link.liveness(waiting=False, timeout=5.0)
    assert gone is not None and gone.reason == "the simulator (pid 4242) exited with code -9"


class Dying:
    """A watched process killed with threads running: its pid shows it dead (a
    zombie) for a few ``is_alive`` calls before it can be reaped."""

    def __init__(self, pid: int, alive_calls: int) -> None:
        self.pid, self.calls, self.alive_calls = pid, 0, alive_calls

    def is_alive(self) -> bool:
        self.calls += 1
        return self.calls <= self.alive_calls

    @property
    def exitcode(self) -> int | None:
        return None if self.calls <= self.alive_calls else -9


@pytest.mark.parametrize("alive_calls,reaped", [(3, True), (10**9, False)])
def test_a_watched_collector_found_dead_by_its_pid_is_named_as_the_watch_names_it(
        link: ExternalCollector, clock: Clock, monkeypatch: pytest.MonkeyPatch,
        alive_calls: int, reaped: bool) -> None:
    """kill -9 of replay-fsm sac's collector said "the collector process (pid P) is
    gone" where the demo's said "the demo collector process (pid P) exited with code
    -9": the pid check saw the zombie before the watch could reap it. It now waits
    for the reap, up to REAP_WAIT_S, and words it as the watch does."""
    monkeypatch.setattr(links, "REAP_WAIT_S", 0.2, raising=False)
    exited = subprocess.Popen(["true"])
    exited.wait()
    send(link)
    state = link.handle.packer_state
    state[0], state[1] = exited.pid, clock.ns
    link.watch(Dying(exited.pid, alive_calls), "the SAC collector process")
    gone = link.liveness(waiting=False, timeout=5.0)
    assert gone is not None and gone.reason == (
        f"the SAC collector process (pid {exited.pid}) exited with code -9" if reaped else
        f"the collector process (pid {exited.pid}) is gone")


def test_a_stopped_link_has_no_verdict(link: ExternalCollector, clock: Clock) -> None:
    send(link)
    link.stop(1.0)
    clock.advance(60)
    assert link.liveness(waiting=True, timeout=5.0) is None


class FakeProcess:
    """Stands in for the packer process: alive until told otherwise; records joins."""

    def __init__(self, exits_on: str | None = None) -> None:
        self.pid, self.exitcode, self.exits_on = 4242, None, exits_on
        self.alive, self.calls = True, []  # type: bool, list[tuple[str, float | None]]

    def is_alive(self) -> bool:
        return self.alive

    def join(self, timeout: float | None = None) -> None:
        self.calls.append(("join", timeout))
        if self.exits_on == "close":
            self.alive = False

    def terminate(self) -> None:
        self.calls.append(("terminate", None))
        if self.exits_on == "terminate":
            self.alive = False

    def kill(self) -> None:
        self.calls.append(("kill", None))
        self.alive = False


@pytest.fixture
def process_link() -> Iterator[links.ProcessCollector]:
    made = links.ProcessCollector(ReplayBuffer(64, 3, 2), 2, 4)
    yield made
    made.stop(1.0)


def test_the_packer_process_is_a_spawned_daemon(process_link: links.ProcessCollector
                                               ) -> None:
    """Spawned (a fork of a learner running threads can deadlock), a daemon (it ends
    with a learner that exits without close), and named for ``ps`` and debuggers."""
    proc = process_link.process
    assert type(proc).__name__ == "SpawnProcess"
    assert proc.daemon is True and proc.name == "replay_fsm-packer"


def test_a_live_packer_process_is_judged_by_its_heartbeat(
        process_link: links.ProcessCollector, clock: Clock) -> None:
    fake = FakeProcess()
    process_link.process = fake
    state = process_link.handle.packer_state
    state[1] = clock.ns
    assert process_link.liveness(waiting=True, timeout=5.0) is None
    assert looked_over(process_link, clock, 4) is None
    assert looked_over(process_link, clock, 2, waiting=False) is None
    gone = process_link.liveness(waiting=True, timeout=5.0)
    assert gone is not None and gone.reason == (
        "no heartbeat from the packer process (pid 4242) for 6.0 s (alive but not serving: "
        "hung inside a pack?)")

    process_link.watch(Exited(7, 1), "the simulator")
    gone = process_link.liveness(waiting=False, timeout=5.0)
    assert gone is not None and gone.reason == "the simulator (pid 7) exited with code 1"
    fake.alive, fake.exitcode = False, -9
    gone = process_link.liveness(waiting=False, timeout=5.0)
    assert gone is not None and gone.reason == (
        "the packer process (pid 4242) exited with code -9")
    process_link.process = None  # nothing to stop: the fixture's stop skips it


@pytest.mark.parametrize("exits_on, forced", [
    ("close", []),
    ("terminate", ["terminate the packer process (pid 4242)"]),
    (None, ["terminate the packer process (pid 4242)", "kill the packer process (pid 4242)"]),
])
def test_stop_waits_then_terminates_then_kills_within_its_timeout(
        process_link: links.ProcessCollector, exits_on: str | None,
        forced: list[str]) -> None:
    """INV-CLOSE's bound: 0.6 of the timeout for the packer to see its closed channel
    and leave, then terminate and kill, 0.2 each: at most the timeout in all."""
    fake = FakeProcess(exits_on)
    process_link.process = fake
    process_link.handle.packer_state[0] = fake.pid  # attached: it owes a clean exit
    assert process_link.stop(10.0) == forced
    joins = [("join", 6.0), ("terminate", None), ("join", 2.0), ("kill", None),
             ("join", 2.0)]
    assert fake.calls == joins[:1 + 2 * len(forced)]
    assert process_link.process is None  # its handle let go
    assert process_link.stop(10.0) == []  # a second stop has nothing left to do


def test_a_packer_process_not_attached_yet_is_ended_at_once_handle_kept_until_then(
        process_link: links.ProcessCollector) -> None:
    """A packer process that has not attached (still starting) has nothing to finish:
    stop terminates it without waiting for its start, and that is not forced. The
    link keeps the handle until the process is gone: the child unpickles it and opens
    its semaphores by name, which go with the link's last reference."""
    held = []

    class Starting(FakeProcess):
        def join(self, timeout: float | None = None) -> None:
            held.append(process_link._handle is not None)
            super().join(timeout)

    fake = Starting(exits_on="terminate")
    process_link.process = fake
    assert process_link.stop(10.0) == []
    assert fake.calls == [("terminate", None), ("join", 6.0)]
    assert held == [True] and process_link._handle is None


def test_a_pipeline_closed_before_its_packer_process_attached_leaves_no_traceback(
        capfd: pytest.CaptureFixture[str]) -> None:
    """Closed at once, before the spawned packer has imported torch: the child must
    not print a traceback (it did when the semaphores went before it opened them)."""
    from replay_fsm import Pipeline
    pipe = Pipeline(ReplayBuffer(1000, 4, 2), sample_count=16, collector="process")
    proc = pipe.collector_process
    pipe.close()
    assert pipe.forced == [] and not proc.is_alive()
    assert "Traceback" not in capfd.readouterr().err


def test_a_packer_process_that_never_attaches_is_judged_by_the_attach_deadline(
        process_link: links.ProcessCollector, clock: Clock) -> None:
    """Alive but stopped, or blocked in its start, before it attached: it never beats,
    so the heartbeat bound never applied and a wait lasted for ever. The attach
    deadline counts from the first request, to the nanosecond; once attached, the
    heartbeat judges it."""
    process_link.process = FakeProcess()
    process_link.attach_timeout = 10.0
    clock.advance(100)  # no request yet: nothing owed
    assert process_link.liveness(waiting=True, timeout=5.0) is None
    send(process_link)  # type: ignore[arg-type]
    assert looked_over(process_link, clock, 10) is None  # at the bound
    clock.advance(ns=1)
    gone = process_link.liveness(waiting=True, timeout=5.0)
    assert gone is not None and gone.reason == (
        "the packer process (pid 4242) has not attached within 10 s of the first request "
        "(attach_timeout; 10.0 s): stopped, or blocked while starting (in code of "
        "__main__ it re-imports?)")
    state = process_link.handle.packer_state
    state[0], state[1] = 4242, clock.ns  # it attaches: from now on, its heartbeat
    assert process_link.liveness(waiting=True, timeout=5.0) is None
    process_link.process = None


def test_the_heartbeat_bound_is_exact_to_the_nanosecond(
        process_link: links.ProcessCollector, clock: Clock) -> None:
    process_link.process = FakeProcess()
    process_link.handle.packer_state[1] = clock.ns
    assert looked_over(process_link, clock, 5) is None  # at the bound
    clock.advance(ns=1)
    gone = process_link.liveness(waiting=True, timeout=5.0)
    assert gone is not None and gone.reason.startswith("no heartbeat from the packer")
    process_link.process = None


def test_a_stretch_no_look_saw_counts_for_half_the_bound_at_most(
        process_link: links.ProcessCollector, clock: Clock) -> None:
    """The whole job stopped (Ctrl-Z) and resumed (fg): the learner's first look after
    it came before the packer, stopped too, had beaten again, and judged it dead (a job
    stopped 1.2 s with a bound of 0.5 s failed in CollectorDied). A stretch no look saw
    counts for half the bound: one beat after it, and the packer is alive; silent at
    the looks after it, and it is judged."""
    process_link.process = FakeProcess()
    state = process_link.handle.packer_state
    state[1] = clock.ns
    assert process_link.liveness(waiting=True, timeout=5.0) is None
    clock.advance(3600)  # an hour stopped, learner and packer alike
    assert process_link.liveness(waiting=True, timeout=5.0) is None  # 2.5 s counted
    state[1] = clock.ns  # it beats again
    assert looked_over(process_link, clock, 5) is None  # silent 5 s: at the bound
    state[1] = clock.ns  # and again, right before the job stops once more
    clock.advance(3600)
    assert process_link.liveness(waiting=True, timeout=5.0) is None
    assert looked_over(process_link, clock, 2.5) is None  # 5 s: at the bound
    clock.advance(ns=1)
    gone = process_link.liveness(waiting=True, timeout=5.0)
    assert gone is not None and gone.reason.startswith(
        "no heartbeat from the packer process (pid 4242) for 5.0 s")
    process_link.process = None


def test_a_state_that_must_not_last_is_judged_by_looks_not_by_one_stretch(
        link: ExternalCollector, clock: Clock) -> None:
    """A pack-done record counted and not released: a live put and the transfer
    worker's get of the same record show the same position of the done channel, and
    two looks that landed on those two moments, further apart than the bound, judged a
    live collector dead (helper-85, shown in a simulation). A stretch no look saw
    counts for half the bound; the record must be seen held by looks after it."""
    state = link.handle.packer_state
    state[0], state[1] = os.getpid(), clock.ns  # attached, alive
    link.handle.done._counters[1] += 1  # counted, its item not released
    assert link.liveness(waiting=True, timeout=5.0) is None
    clock.advance(60)
    assert link.liveness(waiting=True, timeout=5.0) is None  # 2.5 s counted
    assert looked_over(link, clock, 2.5) is None  # 5 s: at the bound
    clock.advance(ns=1)
    gone = link.liveness(waiting=True, timeout=5.0)
    assert gone is not None and gone.reason.startswith(
        "a pack-done message has been counted in the done channel and not posted for "
        "5.0 s")
    link.handle.done._counters[1] -= 1


def test_an_external_collectors_silence_counts_over_the_looks_before_it_was_owed(
        link: ExternalCollector, clock: Clock) -> None:
    """The looks that saw an external collector silent before its rows were owed
    (``waiting`` False) count toward its silence once they are: its verdict comes at
    the first owed look past the bound, as on the monotonic clock (only the looks
    that judged it counted, and a pipeline waiting all along judged a collector
    silent since its attach at 1.5 times liveness_timeout, naming 1.0 s of it)."""
    state = link.handle.packer_state
    state[0], state[1] = os.getpid(), clock.ns  # attached in this process, never serving
    assert looked_over(link, clock, 5, step=0.05, waiting=False) is None
    gone = looked_over(link, clock, 0.05, step=0.05)  # owed now: silent 5.05 s
    assert gone is not None and gone.reason.startswith(
        f"no heartbeat from the collector (pid {os.getpid()}) for 5.0 s")


def test_an_unknown_collector_kind_is_named() -> None:
    with pytest.raises(ValueError) as info:
        links.make_link("procss", ReplayBuffer(64, 3, 2), 2, 4, packer_threads=None,
                        attach_timeout=1.0)
    assert str(info.value) == ("unknown collector 'procss'; supported: thread, process, "
                               "external, or a CollectorLink instance")


def test_each_kind_gets_its_link_with_the_callers_sizes() -> None:
    rb = ReplayBuffer(64, 3, 2)
    for kind, cls in (("thread", links.ThreadCollector), ("process", links.ProcessCollector),
                      ("external", links.ExternalCollector)):
        made = links.make_link(kind, rb, 3, 5, packer_threads=2, attach_timeout=7.0)
        try:
            assert type(made) is cls and made.kind == kind
            assert [tuple(h.shape) for h in made.host_slots] == [(5, rb.width)] * 3
            if kind == "external":
                assert made.attach_timeout == 7.0
        finally:
            made.stop(1.0)


def test_a_full_request_channel_fails_the_send_after_ten_seconds(
        link: ExternalCollector, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ring has one place per slot, so a full channel means a stuck packer: the
    send gives up after the 10 s its message names."""
    waited = []

    def put(values, text=None, timeout=None):  # type: ignore[no-untyped-def]
        waited.append(timeout)
        return False

    monkeypatch.setattr(link.handle.requests, "put", put)
    with pytest.raises(RuntimeError) as info:
        send(link)
    assert str(info.value) == "request channel stayed full for 10 s; the packer is stuck"
    assert waited == [10.0]


def test_a_request_channel_full_of_lost_places_fails_the_send_saying_so(
        link: ExternalCollector, monkeypatch: pytest.MonkeyPatch) -> None:
    """Collector processes killed inside their get, after counting a request read
    and before freeing its place, each left the channel a place short, and a restart
    that could not give them back let them add up: the send said "the packer is
    stuck" of a collector serving every request (helper-112). It says where the
    places went."""
    requests = link.handle.requests
    for _ in range(requests.capacity):  # every place taken, no record counted in it
        assert requests._spaces.acquire(timeout=1.0)

    def put(values, text=None, timeout=None):  # type: ignore[no-untyped-def]
        return False  # as the real one, after its 10 s

    monkeypatch.setattr(requests, "put", put)
    with pytest.raises(RuntimeError) as info:
        send(link)
    assert str(info.value) == (
        "request channel stayed full for 10 s: 4 of its 4 places were lost by "
        "collector processes killed (or stopped) inside their get, between counting "
        "a request read and freeing its place, and not given back by a restart "
        "(which gives them back only under a 64-bit x86 Python, where every "
        "collector process attached before it is surely gone)")


def test_receive_waits_no_longer_than_asked(link: ExternalCollector) -> None:
    finished, got = finishes_within(lambda: link.receive(0.01))
    link.stop(1.0)  # wakes a receive that waits on: it raises ChannelClosed in there
    assert finished and got == [None]


class Boom(Exception):
    pass


def test_a_packer_thread_that_raises_is_reported_with_its_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ran_in = []

    def service(self, timeout):  # type: ignore[no-untyped-def]
        ran_in.append(threading.current_thread())
        raise Boom("in the pack")

    monkeypatch.setattr(links.Packer, "service", service)
    made = links.ThreadCollector(ReplayBuffer(64, 3, 2), 2, 4)
    failures: list[BaseException] = []
    failed = threading.Event()
    made.start(lambda exc: (failures.append(exc), failed.set()))
    assert failed.wait(MARGIN_S)
    [thread] = ran_in  # named for debuggers, a daemon so it never holds up an exit
    assert thread.name == "replay_fsm-packer" and thread.daemon is True
    thread.join(MARGIN_S)
    gone = made.liveness(waiting=False, timeout=5.0)
    assert gone is not None and gone.reason == "the packer thread exited"
    assert isinstance(gone.cause, Boom) and failures == [gone.cause]
    assert made.stop(1.0) == []


def test_a_packer_thread_hung_inside_a_pack_is_left_behind_by_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    entered, release = threading.Event(), threading.Event()

    def service(self, timeout):  # type: ignore[no-untyped-def]
        entered.set()
        release.wait()

    monkeypatch.setattr(links.Packer, "service", service)
    made = links.ThreadCollector(ReplayBuffer(64, 3, 2), 2, 4)
    made.start(lambda exc: None)
    # Inside its pack before the stop (else it may see the stop first and end).
    assert entered.wait(MARGIN_S)
    assert made.liveness(waiting=False, timeout=5.0) is None  # alive, nothing waits
    # stop is bounded by its timeout even with the thread hung
    stopped, said = finishes_within(lambda: made.stop(0.05))
    try:
        assert stopped and said == [[
            "the packer thread did not stop within 0 s (hung inside a pack); it is a "
            "daemon thread and is left behind"]]
        # Stopped, still hung (until the release below): its silence is no verdict.
        assert made.liveness(waiting=True, timeout=5.0) is None
    finally:
        release.set()
        # Let it end before the test does: a daemon thread still in torch's code as
        # the interpreter exits aborted the process ("terminate called without an
        # active exception") when this test ran alone (helper-50: 5 runs of 20).
        made._thread.join(MARGIN_S)  # type: ignore[union-attr]


def test_a_packer_thread_that_ends_cleanly_reports_no_cause() -> None:
    made = links.ThreadCollector(ReplayBuffer(64, 3, 2), 2, 4)
    made.start(lambda exc: None)
    assert made.stop(MARGIN_S) == []
    gone = made.liveness(waiting=False, timeout=5.0)
    assert gone is not None and gone.cause is None


def test_the_packer_process_gets_the_callers_thread_count() -> None:
    made = links.make_link("process", ReplayBuffer(64, 3, 2), 2, 4, packer_threads=1,
                           attach_timeout=1.0)
    try:
        # serve_forever(handle, replay_buffer, poll_s, threads) in the spawned child
        assert made.process._args[3] == 1  # type: ignore[attr-defined]
    finally:
        made.stop(1.0)


def test_a_dead_external_collector_is_gone_even_behind_a_pack_done_it_half_posted() -> None:
    """A collector killed inside its put of a pack-done message, between counting the
    record and releasing its item (helper-74): the channel's backlog stays one for
    good, and the link, which took a backlog for a message waiting for the worker,
    never looked at the dead pid: the learner waited for ever."""
    with attached_and_dead() as (link, pid):
        link.handle.done._counters[1] += 1  # the record counted, its item never released
        assert link.handle.done.backlog == 1
        gone = link.liveness(True, 60.0)
        assert gone is not None and gone.reason == (
            f"the collector process (pid {pid}) is gone"), gone


def judged_within(link: links.ChannelLink, timeout: float, *, beat: bool = False
                  ) -> links.Gone | None:
    """The first verdict of ``link``'s looks (``liveness(True, timeout)``), one
    every 1.2 timeouts, within 100 timeouts; None if none came. ``beat``: the
    collector beats before each look (alive, serving)."""
    deadline, gone = time.monotonic() + 100 * timeout, None
    while gone is None and time.monotonic() < deadline:
        time.sleep(1.2 * timeout)
        if beat:
            link.handle.packer_state[1] = time.monotonic_ns()
        gone = link.liveness(True, timeout)
    return gone


@contextlib.contextmanager
def attached_and_dead() -> Iterator[tuple[ExternalCollector, int]]:
    """An external link whose attached collector's pid names an exited process."""
    link = ExternalCollector(ReplayBuffer(64, 3, 2), 2, 4, attach_timeout=10.0)
    dead = subprocess.Popen(["true"])
    dead.wait()  # exited and reaped: its pid names no process
    try:
        link.handle.packer_state[0] = dead.pid
        yield link, dead.pid
    finally:
        link.stop(1.0)


def test_a_pack_done_message_posted_before_its_collector_exited_waits_for_the_worker(
        ) -> None:
    """A collector that served its last request and exited (its pack-done message
    posted whole, waiting while the transfer worker is busy in a submit) is not
    reported gone before the worker takes the message: the learner's wait got the
    batch before ed7095e, and CollectorDied after it (helper-75). Once the message
    is taken, the dead collector is gone."""
    with attached_and_dead() as (link, pid):
        assert link.handle.done.put([0] * link.handle.done.width, timeout=1.0)
        assert link.liveness(True, 60.0) is None  # a message waits for the worker
        assert link.handle.done.get(timeout=1.0) is not None  # the worker took it
        gone = link.liveness(True, 60.0)
        assert gone is not None and gone.reason == (
            f"the collector process (pid {pid}) is gone"), gone


def test_a_pack_done_message_half_posted_by_a_dead_predecessor_fails_the_run(
        ) -> None:
    """The collector attached now lives (it beats); the one before it was killed
    inside its put of a pack-done message (counted, its item never released). No get
    takes that record until a later put's item, and the learner waiting for its tick
    waited for ever while the backlog of one said 'a message waits for the worker'
    (helper-75). Judged gone once it has stayed for the timeout."""
    with half_posted_by_a_dead_predecessor() as link:
        assert link.liveness(True, 0.05) is None  # a put under way, as far as it knows
        gone = judged_within(link, 0.05)
        assert gone is not None and "counted in the done channel and not posted" in (
            gone.reason), gone


@contextlib.contextmanager
def half_posted_by_a_dead_predecessor() -> Iterator[ExternalCollector]:
    """An external link whose attached collector lives, and the one before it, gone,
    was killed inside its put of a pack-done message (counted, never released)."""
    link = ExternalCollector(ReplayBuffer(64, 3, 2), 2, 4, attach_timeout=10.0)
    live = subprocess.Popen(["sleep", "60"])
    try:
        link.handle.packer_state[0] = live.pid
        link.handle.packer_state[7] = live.pid + 10**6  # the predecessor, gone
        link.handle.done._counters[1] += 1  # counted, its item never released
        assert link.handle.done.backlog == 1
        yield link
    finally:
        live.kill()
        live.wait()
        link.stop(1.0)


def test_a_request_answered_before_its_send_returned_is_not_left_to_look_after(
        ) -> None:
    """The learner's send records the request (``_sent``) after its put: a packer
    that packs and posts it, and a transfer worker that receives that message, before
    the learner's thread runs its next bytecodes (a GIL switch after the put's item
    release) left the entry for good. After a restart, liveness then found that
    request 'written whole, its pack-done message not come' and failed the run
    (helper-75). Interleaved here by hand, on one thread."""
    from replay_fsm.data.packer import Packer
    rb = ReplayBuffer(64, 3, 2)
    rb.add_packed(torch.randn(10, rb.width))
    link = ExternalCollector(rb, 2, 4, attach_timeout=10.0)
    packer = Packer.attach(link.handle, rb)
    put = link.handle.requests.put
    received = []

    def put_then_serve(*args: object, **kwargs: object) -> bool:
        ok = put(*args, **kwargs)  # type: ignore[arg-type]
        assert packer.service(timeout=1.0)  # packed and posted
        received.append(link.receive(1.0))  # the worker's receive
        return ok
    link.handle.requests.put = put_then_serve  # type: ignore[method-assign]
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        link.send(PackRequest(tick=0, slot=0, generation=1, seed=0, sample_count=4,
                              min_snapshot_ptr=0), snapshot=(0, 0), hot_slot=-1)
        assert received[0] is not None and received[0].tick == 0
        # A collector restarted since: the request was read before it attached.
        link.handle.packer_state[6] = link.handle.requests.taken
        link.handle.packer_state[7] = dead.pid
        assert link.liveness(False, 0.05) is None  # False: silence not judged
        time.sleep(0.1)
        assert link.liveness(False, 0.05) is None, "an answered request was judged lost"
    finally:
        link.stop(1.0)


def test_a_packer_stopped_inside_its_put_of_a_pack_done_message_is_silent() -> None:
    """A packer process stopped (SIGSTOP) between counting a pack-done record and
    releasing its item: the done channel's backlog of one is no message waiting for
    the worker (no get takes it until the packer goes on), so its silence counts.
    The link took the backlog for a message waiting, and the learner waited for as
    long as the process stayed stopped (helper-79; the external link judged it).
    Judged only once that state has persisted for the timeout: a live put, and the
    transfer worker's get between its acquire and its count, show it for a moment,
    and a packer blocked behind a worker stuck in a submit is silent then too
    (helper-82; the first look judged it)."""
    link = links.ThreadCollector(ReplayBuffer(64, 3, 2), 2, 4)  # not started
    try:
        link.handle.packer_state[1] = time.monotonic_ns() - 10 * S  # beat 10 s ago
        link.handle.done._counters[1] += 1  # counted, its item never released
        assert link.handle.done.backlog == 1
        assert link.liveness(True, 0.05) is None  # a put or get under way, so far
        gone = judged_within(link, 0.05)
        assert gone is not None and "no heartbeat from the packer thread" in gone.reason
        # Released since: the next look finds it no more, and starts afresh.
        link.handle.done._counters[1] -= 1
        assert link.liveness(True, 60.0) is None  # silent 10 s: under 60 s
        link.handle.done._counters[1] += 1
        assert link.liveness(True, 0.05) is None, "an earlier stretch counted"
        # A message posted whole waits for the worker: no verdict.
        link.handle.done._counters[1] -= 1
        assert link.handle.done.put([0] * link.handle.done.width, timeout=1.0)
        assert link.liveness(True, 5.0) is None
    finally:
        link.stop(1.0)


def _fresh_link(kind: str) -> links.ChannelLink:
    """A thread link, its packer silent 10 s (so the look's verdict rests on the record
    counted and not released), or an external link whose collector (this process)
    beats now."""
    rb = ReplayBuffer(64, 3, 2)
    if kind == "thread":
        link: links.ChannelLink = links.ThreadCollector(rb, 2, 4)  # not started
        link.handle.packer_state[1] = time.monotonic_ns() - 10 * S
    else:
        link = ExternalCollector(rb, 2, 4, attach_timeout=10.0)
        link.handle.packer_state[0] = os.getpid()
        link.handle.packer_state[1] = time.monotonic_ns()
    return link


@pytest.mark.parametrize("record", ["ring", "local"])
@pytest.mark.parametrize("kind", ["thread", "external"])
def test_a_record_counted_and_not_released_at_one_look_counts_not_for_a_later_one(
        kind: str, record: str) -> None:
    """A look finds a pack-done record counted and not released (the transfer worker's
    get between its acquire and its count, a put between its count and its release;
    a record of the learner's own pack, posted locally, taken by the worker); the
    message is taken, the slot fills, and the wait ends with no look after it. A
    later wait, past the timeout, finds a later record so for a moment: that is a
    fresh state, not one that persisted since the first look. The stretch counted
    from the first, and a live external collector was judged dead ('counted in the
    done channel and not posted'; seen end to end with a Python thread beside the
    learner's, helper-83), a thread packer silent then by its heartbeat. A record
    that stays so is still judged."""
    link = _fresh_link(kind)
    done = link.handle.done

    def half_taken() -> None:  # a record counted, its item not released (or taken)
        if record == "ring":
            done._counters[1] += 1  # counted by a put, not released yet
        else:
            done.post_local([0] * done.width)
            assert done._items.acquire(timeout=1.0)  # the worker's, before its count

    def taken() -> None:  # released and taken: the wait ends, no look sees it
        if record == "ring":
            done._counters[0] += 1
        else:
            done._local.popleft()
    try:
        half_taken()
        assert done.unreleased == 1
        assert link.liveness(True, 0.05) is None
        taken()
        time.sleep(0.2)  # the learner trains: 4 times the timeout
        if kind == "external":
            link.handle.packer_state[1] = time.monotonic_ns()  # it beats all along
        half_taken()  # a later record, for a moment
        assert link.liveness(True, 0.05) is None, "an earlier record's stretch counted"
        gone = judged_within(link, 0.05, beat=kind == "external")
        assert gone is not None, "a record that stays counted and not released"
    finally:
        link.stop(1.0)


def test_a_claim_lock_taken_at_one_look_counts_not_for_a_later_claim() -> None:
    """After a restart, a look finds the claim lock taken (the collector attached now
    is inside a claim, descheduled for a moment); a later look, past the timeout,
    finds it taken by a later claim. That is no lock held since the first look: it
    was judged 'stayed taken' (helper-83). A lock that stays taken is still judged."""
    link = _fresh_link("external")
    handle = link.handle
    handle.packer_state[7] = os.getpid() + 10**6  # a predecessor, gone

    def held_at_a_look(then: Any) -> Any:
        taken, free = threading.Event(), threading.Event()

        def hold() -> None:
            with handle.claim_lock:
                taken.set()
                free.wait(MARGIN_S)
        holder = threading.Thread(target=hold)
        holder.start()
        assert taken.wait(MARGIN_S)
        try:
            return then()
        finally:
            free.set()
            holder.join(MARGIN_S)
    try:
        assert held_at_a_look(lambda: link.liveness(True, 0.05)) is None
        assert handle.claim(0, 1, 64, 1.0) == 0  # the collector's next claim
        time.sleep(0.2)  # no look meanwhile: 4 times the timeout
        handle.packer_state[1] = time.monotonic_ns()
        assert held_at_a_look(lambda: link.liveness(True, 0.05)) is None, (
            "an earlier claim's hold counted")

        # The collector beats before each look: on a loaded machine a look more than
        # the timeout after the last beat found its silence first (2 of 6 under load).
        gone = held_at_a_look(lambda: judged_within(link, 0.05, beat=True))
        assert gone is not None and "claim lock has stayed taken" in gone.reason, gone
    finally:
        link.stop(1.0)


def test_a_record_half_posted_by_a_dead_predecessor_is_judged_once_no_later_one_comes(
        ) -> None:
    """The collector attached now puts later messages, and each carries the dead
    one's half-posted record through, one behind: the channel's position moves at
    every put, and no verdict comes while they flow (the run goes on, one behind, as
    the README says); the first stretch of the timeout with no later message is
    judged (helper-85)."""
    timeout = 0.1
    with half_posted_by_a_dead_predecessor() as link:
        handle, done = link.handle, link.handle.done
        start = time.monotonic()
        while time.monotonic() - start < 10 * timeout:  # later messages flow
            assert done.put([0] * done.width, timeout=1.0)
            assert done.get(timeout=1.0) is not None  # the worker's, one behind
            assert done.unreleased == 1
            handle.packer_state[1] = time.monotonic_ns()
            assert link.liveness(True, timeout) is None, "judged while messages flow"
            time.sleep(timeout / 4)
        gone = judged_within(link, timeout, beat=True)
        assert gone is not None and "counted in the done channel and not posted" in (
            gone.reason), gone


@contextlib.contextmanager
def taken_by_a_dead_predecessor() -> Iterator[ExternalCollector]:
    """An external link with one request sent, whose attached collector lives, and
    the one before it, gone, was killed inside its get of that request: its item
    taken, the record never counted taken."""
    link = ExternalCollector(ReplayBuffer(64, 3, 2), 2, 4, attach_timeout=10.0)
    live = subprocess.Popen(["sleep", "60"])
    try:
        link.handle.packer_state[0] = live.pid
        link.handle.packer_state[7] = live.pid + 10**6  # the predecessor, gone
        send(link)
        assert link.handle.requests._items.acquire(timeout=1.0)  # its get's acquire
        assert link.handle.requests.unreleased == 1
        yield link
    finally:
        live.kill()
        live.wait()
        link.stop(1.0)


def test_a_request_whose_item_a_dead_predecessor_took_fails_the_run() -> None:
    """The collector before the one attached now was killed inside its get, between
    taking the request's item and counting it taken. The one attached now reads that
    record with the next request's item, one behind, so the newest request is never
    taken while no later one comes: a learner waiting for it with nothing more to
    send waited for ever while the collector beat (helper-100: 1 of 1, learner_packs
    False, one request at a time). Judged once that has stayed for the timeout, and
    only while the request is owed (the rows are there)."""
    timeout = 0.1
    with taken_by_a_dead_predecessor() as link:
        link.handle.packer_state[1] = time.monotonic_ns()
        assert link.liveness(True, timeout) is None  # a get under way, as far as it knows
        time.sleep(2 * timeout)
        link.handle.packer_state[1] = time.monotonic_ns()
        assert link.liveness(False, timeout) is None, "judged while not owed"
        gone = judged_within(link, timeout, beat=True)
        assert gone is not None and gone.reason.startswith(
            "the request channel has held a request no get can take for "), gone
        assert f"the one before it pid {link.handle.predecessor[1]}" in gone.reason


def test_requests_flowing_one_behind_a_dead_predecessors_get_are_not_judged() -> None:
    """While the learner sends later requests, each carries the record before it
    through, one behind: the channel's position moves at every send, and no verdict
    comes (the run goes on, one behind); the first stretch of the timeout with no
    later request is judged."""
    timeout = 0.1
    with taken_by_a_dead_predecessor() as link:
        requests = link.handle.requests
        start, tick = time.monotonic(), 1
        while time.monotonic() - start < 10 * timeout:
            send(link, tick)
            assert requests.get(timeout=1.0) is not None  # the collector's, one behind
            assert requests.unreleased == 1
            link.handle.packer_state[1] = time.monotonic_ns()
            assert link.liveness(True, timeout) is None, "judged while requests flow"
            time.sleep(timeout / 4)
            tick += 1
        gone = judged_within(link, timeout, beat=True)
        assert gone is not None and "no get can take" in gone.reason, gone


def test_an_external_collector_whose_pid_names_another_process_since_is_gone() -> None:
    """The attached collector died and its pid was given to another process: the
    link asked only whether the pid named a live process, so the learner waited on
    for its rows (which only it made) until stall_timeout, for ever with
    stall_timeout None, and for its heartbeat only once they were owed
    (helper-100). The record its attach wrote (the pid's start time) tells."""
    from replay_fsm.data import owner
    link = ExternalCollector(ReplayBuffer(64, 3, 2), 2, 4, attach_timeout=10.0)
    other = subprocess.Popen(["sleep", "60"])
    try:
        _, pid_namespace, time_namespace = owner.me()
        started = owner._stat(other.pid)[2]
        state = link.handle.packer_state
        state[0], state[1] = other.pid, time.monotonic_ns()
        for start, alive in ((started, True), (started + 1, False)):
            state[3:6] = torch.tensor([other.pid | (start << owner.PID_BITS),
                                       pid_namespace, time_namespace])
            gone = link.liveness(False, 60.0)
            assert (gone is None) is alive, gone
        assert gone is not None and gone.reason == (
            f"the collector process (pid {other.pid}) is gone"), gone
    finally:
        other.kill()
        other.wait()
        link.stop(1.0)


@pytest.mark.parametrize("watched", [False, True])
def test_a_collector_gone_while_every_add_raises_writer_died_is_said_to_be(
        watched: bool) -> None:
    """A collector restarted after one killed inside an add exits on WriterDied at
    its first add: the learner said "the collector process (pid N) is gone" (or,
    watched, "exited with code 1"), the reason only on that process's standard
    error (helper-105: 1 of 1). The learner reads the buffer's write lock itself:
    the verdict says that every add raises WriterDied, which is its cause."""
    from replay_fsm.data import owner
    from replay_fsm.errors import WriterDied

    rb = ReplayBuffer(64, 3, 2)
    link = ExternalCollector(rb, 2, 4, attach_timeout=10.0)
    writer, collector = subprocess.Popen(["true"]), subprocess.Popen(["true"])
    writer.wait()  # the one killed inside its add: exited and reaped
    collector.wait()  # the restart, exited on WriterDied
    try:
        _, pid_namespace, time_namespace = owner.me()
        said = f"the collector process (pid {collector.pid}) is gone"
        if watched:
            link.watch(Exited(collector.pid, 1), "the collector process")
            said = f"the collector process (pid {collector.pid}) exited with code 1"
        link.handle.packer_state[0] = collector.pid
        gone = link.liveness(True, 60.0)
        assert gone is not None and gone.reason == said, gone  # no add fails
        rb._owner.words[:] = torch.tensor([writer.pid | 1 << owner.PID_BITS,
                                           pid_namespace, time_namespace])
        gone = link.liveness(True, 60.0)
        assert gone is not None and gone.reason.startswith(
            f"{said}, and every add to the replay buffer raises WriterDied: process "
            f"{writer.pid} died inside an add to this replay buffer"), gone
        assert isinstance(gone.cause, WriterDied)
        assert str(gone.cause) in gone.reason
    finally:
        rb._owner.words.zero_()
        link.stop(1.0)


def test_a_packer_thread_exited_while_every_add_raises_writer_died_is_said_to_be(
        ) -> None:
    """Every kind of collector's verdict says so when every add raises WriterDied,
    not only an external collector's "is gone": the thread collector's "the packer
    thread exited" said no more (the check ran in two of the verdicts of one kind)."""
    from replay_fsm.data import owner
    from replay_fsm.errors import WriterDied

    rb = ReplayBuffer(64, 3, 2)
    link = links.ThreadCollector(rb, 2, 4)
    writer = subprocess.Popen(["true"])
    writer.wait()  # killed inside its add: exited and reaped
    failed: list[BaseException] = []
    link.start(failed.append)
    try:
        link.handle.close()  # the packer thread sees it and returns
        thread = link._thread
        assert thread is not None
        thread.join(MARGIN_S)
        assert not thread.is_alive()
        assert link.liveness(True, 60.0) == links.Gone("the packer thread exited")
        _, pid_namespace, time_namespace = owner.me()
        rb._owner.words[:] = torch.tensor([writer.pid | 1 << owner.PID_BITS,
                                           pid_namespace, time_namespace])
        gone = link.liveness(True, 60.0)
        assert gone is not None and gone.reason.startswith(
            "the packer thread exited, and every add to the replay buffer raises "
            f"WriterDied: process {writer.pid} died inside an add"), gone
        assert isinstance(gone.cause, WriterDied)
    finally:
        rb._owner.words.zero_()
        link.stop(1.0)
    assert not failed
