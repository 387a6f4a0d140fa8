"""A process killed inside an add (SIGKILL, the OOM killer) never releases the buffer's
write lock, and the rows it was writing stay half written, their regions odd. Before,
every later add, pause and save waited for ever, and so did every gather of those rows:
the learner's own (it packs the chunks the packer has not reached) too, so even a
pipeline watching the collector hung instead of raising CollectorDied. Measured: a
collector SIGKILLed in a loop of adds died inside one at the first try, and the
learner's next sample hung, with the thread and the process collector.

Now each of them raises WriterDied, naming the pid. A writer that is alive, however
long it takes, is waited for; the record of who holds the lock is cleared on every
way out of an add but a kill.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from replay_fsm import Pipeline
from replay_fsm.data import owner
from replay_fsm.data.buffer import WRITER_CHECK_RETRIES, ReplayBuffer
from replay_fsm.errors import PipelineFailed, WriterDied

from .collectors import (
    AskThenStall,
    StallingBuffer,
    add_rows,
    constant_rows,
    gather_rows,
    hold_pause,
)
from .support import MARGIN_S, finishes_within

CAPACITY, REGION = 64, 8


def outcome(call: Callable[[], object]) -> tuple[str, object]:
    """What ``call`` did within MARGIN_S, on a thread of its own: ("returned", value),
    ("raised", exception), or ("waiting", None), the thread left waiting (daemon)."""
    def run() -> tuple[str, object]:
        try:
            return "returned", call()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            return "raised", exc
    finished, got = finishes_within(run)
    return got[0] if finished else ("waiting", None)


def stalled_writer(rb: StallingBuffer, first_id: int
                   ) -> tuple[mp.process.BaseProcess, Any]:
    """A spawned process inside an add of 8 rows to ``rb``, full: at rows 0..7, region
    0 odd, rows 0..3 written, waiting for the returned event."""
    ctx = mp.get_context("spawn")
    entered, go = ctx.Event(), ctx.Event()
    rb.stall = (entered, go)
    process = ctx.Process(target=add_rows, args=(rb, constant_rows(rb, first_id, 8)),
                          daemon=True)
    process.start()
    rb.stall = None  # this process's adds go straight through
    assert entered.wait(MARGIN_S), "the writer never reached its copy"
    return process, go


def filled(cls: type[StallingBuffer] = StallingBuffer) -> StallingBuffer:
    rb = cls(CAPACITY, 2, 1, region_rows=REGION)
    rb.add_packed(constant_rows(rb, 0, CAPACITY))  # full: the next add overwrites
    return rb


@pytest.fixture
def full() -> StallingBuffer:
    return filled()


@pytest.fixture
def killed(full: StallingBuffer) -> Iterator[tuple[StallingBuffer, int]]:
    process, _ = stalled_writer(full, 1000)
    assert process.pid is not None
    os.kill(process.pid, signal.SIGKILL)
    process.join()
    yield full, process.pid


ODD_ROWS = torch.arange(0, 8)  # region 0, which the killed add was writing
WHOLE_ROWS = torch.arange(8, CAPACITY)  # the other regions, whole


def test_the_killed_writer_leaves_its_region_odd_and_the_lock_held(
        killed: tuple[StallingBuffer, int]) -> None:
    """The setting of the tests below, as the kill leaves it."""
    rb, pid = killed
    assert (rb._seq & 1).nonzero().flatten().tolist() == [0]
    assert rb._owner.dead_holder() == pid
    assert rb.ptr == CAPACITY  # the counters move after the rows: never


@pytest.mark.parametrize("call", ["add_packed", "add", "adds_paused", "save",
                                  "adopt_rows"])
def test_calls_that_take_the_lock_raise_writer_died_instead_of_waiting(
        killed: tuple[StallingBuffer, int], tmp_path: Path, call: str) -> None:
    rb, pid = killed
    n = 2
    calls: dict[str, Callable[[], object]] = {
        "add_packed": lambda: rb.add_packed(torch.zeros(n, rb.width)),
        "add": lambda: rb.add(torch.zeros(n, 2), torch.zeros(n, 1), torch.zeros(n),
                              torch.zeros(n, 2), torch.zeros(n), torch.zeros(n)),
        "adds_paused": lambda: rb.adds_paused().__enter__(),
        "save": lambda: rb.save(tmp_path / "rb.ckpt"),
        "adopt_rows": lambda: rb.adopt_rows(10),
    }
    kind, exc = outcome(calls[call])
    assert kind == "raised" and isinstance(exc, WriterDied), (kind, exc)
    assert f"process {pid} died inside an add" in str(exc)
    assert "(0-7)" in str(exc) and f"{call.replace('add_packed', 'add')}()" in str(exc)
    assert not (tmp_path / "rb.ckpt").exists()
    assert rb.ptr == CAPACITY


def test_a_gather_of_the_half_written_rows_raises_and_of_others_returns_them(
        killed: tuple[StallingBuffer, int]) -> None:
    rb, pid = killed
    kind, exc = outcome(lambda: rb.gather(ODD_ROWS, torch.empty(8, rb.width)))
    assert kind == "raised" and isinstance(exc, WriterDied), (kind, exc)
    assert "a gather of 8 of them" in str(exc)
    rows = rb.gather(WHOLE_ROWS, torch.empty(len(WHOLE_ROWS), rb.width))
    assert (rows == WHOLE_ROWS[:, None].float()).all()


class LappedThenKilled(StallingBuffer):
    """Its gathers' first retry round sees region 0 written whole meanwhile (its number
    moves by 2): lapped, as by a writer adding back to back before it was killed."""

    rounds = 0

    def _rows_at(self, rows: torch.Tensor) -> torch.Tensor:
        self.rounds += 1
        if self.rounds == 1:
            self._seq[0] += 2
        return super()._rows_at(rows)


def test_a_lapped_gather_of_the_half_written_rows_raises_and_stops_asking() -> None:
    """A lapped gather of rows a dead writer left half written asks the adds to yield
    at each round, in vain (none can begin: the dead holds the lock), and raises
    WriterDied as any gather does, after WRITER_CHECK_RETRIES rounds: its ask cleared
    on the way out, and the lock, which it never took, still the dead writer's."""
    rb = filled(LappedThenKilled)
    process, _ = stalled_writer(rb, 1000)
    assert process.pid is not None
    os.kill(process.pid, signal.SIGKILL)
    process.join()
    kind, exc = outcome(lambda: rb.gather(ODD_ROWS, torch.empty(8, rb.width)))
    assert kind == "raised" and isinstance(exc, WriterDied), (kind, exc)
    assert "a gather of 8 of them" in str(exc) and rb.rounds == WRITER_CHECK_RETRIES
    assert not rb._asked_mv[0] and rb._owner.held


def test_a_reader_killed_while_it_asks_the_adds_to_yield_holds_none_off() -> None:
    """A reader process killed (SIGKILL, the OOM killer) in a lapped gather, its ask
    standing: adds wait for it LAPPED_HOLD_S at most, and ignore it once it is that
    old. A reader holding the write lock for its round (a fix tried first) left it
    held by a dead process, and every later add waited in the semaphore for ever
    (nothing records a reader as the holder)."""
    ctx = mp.get_context("spawn")
    rb = AskThenStall(CAPACITY, 2, 1, region_rows=REGION)
    rb.add_packed(constant_rows(rb, 0, CAPACITY))
    rb.stall = ctx.Event()
    process = ctx.Process(target=gather_rows, args=(rb, 4), daemon=True)
    process.start()
    assert rb.stall.wait(MARGIN_S), "the reader never asked"
    assert rb._asked_mv[0]
    assert process.pid is not None
    os.kill(process.pid, signal.SIGKILL)
    process.join()
    finished, got = finishes_within(
        lambda: [rb.add_packed(constant_rows(rb, 100, 8)) for _ in range(3)])
    assert finished and rb.ptr == CAPACITY + 24 and rb._asked_mv[0]  # stale, ignored
    assert not rb._owner.held and not (rb._seq & 1).any()


@pytest.mark.parametrize("collector", ["thread", "process"])
@pytest.mark.timeout(300)  # spawns a packer process
def test_the_learners_sample_fails_instead_of_hanging(
        killed: tuple[StallingBuffer, int], collector: str) -> None:
    """Unwatched: the gather's own check. (Watched, CollectorDied may come first.)"""
    rb, pid = killed
    pipe = Pipeline(rb, sample_count=CAPACITY, collector=collector)
    try:
        def sample() -> object:
            pipe.start_prepare(0, CAPACITY)  # every row: the odd region's among them
            return pipe.sample_large_batch(0, CAPACITY)
        kind, exc = outcome(sample)
        assert kind == "raised" and isinstance(exc, PipelineFailed), (kind, exc)
        assert "WriterDied" in str(exc) and f"process {pid}" in str(exc)
    finally:
        assert outcome(pipe.close)[0] == "returned"


class CountingChecks(StallingBuffer):
    """Sets ``checked[call]`` (the call's first word: a, save(), ...) after each of
    the checks of the writer a call makes, once it has found the writer alive."""

    checked: dict[str, threading.Event] = {}  # none until a test sets its own (read only)

    def _refuse_if_writer_died(self, call: str) -> None:
        super()._refuse_if_writer_died(call)
        event = self.checked.get(call.split()[0])
        if event is not None:
            event.set()


def test_a_live_writer_is_waited_for_however_long_it_takes() -> None:
    """A gather that checked the writer while it was alive, and an add that found the
    lock taken, wait; once the writer goes on, both finish, with whole rows."""
    rb = filled(CountingChecks)
    process, go = stalled_writer(rb, 1000)
    rb.checked = {"a": threading.Event()}  # after the spawn: an Event does not pickle
    try:
        assert rb._owner.held and rb._owner.dead_holder() is None
        results: dict[str, tuple[str, object]] = {}
        gather = threading.Thread(target=lambda: results.__setitem__(
            "gather", outcome(lambda: rb.gather(ODD_ROWS, torch.empty(8, rb.width)))))
        gather.start()
        assert rb.checked["a"].wait(MARGIN_S), "the gather never checked the writer"
        add = threading.Thread(target=lambda: results.__setitem__(
            "add", outcome(lambda: rb.add_packed(constant_rows(rb, 2000, 2)))))
        add.start()
    finally:
        go.set()
    process.join(MARGIN_S)
    gather.join()
    add.join()
    assert process.exitcode == 0
    kind, rows = results["gather"]
    assert kind == "returned", results
    assert isinstance(rows, torch.Tensor)
    assert (rows == torch.arange(1000, 1008)[:, None].float()).all()
    assert results["add"][0] == "returned", results
    assert rb.ptr == CAPACITY + 10 and not rb._owner.held


@pytest.mark.parametrize("call", ["save", "adds_paused", "adopt_rows"])
def test_a_call_waiting_for_an_add_raises_once_its_writer_is_killed(
        call: str, tmp_path: Path) -> None:
    """The learner's save (its final pass pauses the adds) found an add in progress,
    and was waiting for it when the collector was killed."""
    rb = filled(CountingChecks)
    process, _ = stalled_writer(rb, 1000)
    rb.checked = {f"{call}()": threading.Event()}
    calls: dict[str, Callable[[], object]] = {
        "save": lambda: rb.save(tmp_path / "rb.ckpt"),
        "adds_paused": lambda: rb.adds_paused().__enter__(),
        "adopt_rows": lambda: rb.adopt_rows(10),
    }
    results: list[tuple[str, object]] = []
    waiting = threading.Thread(target=lambda: results.append(outcome(calls[call])))
    waiting.start()
    assert rb.checked[f"{call}()"].wait(MARGIN_S), "the call never checked the writer"
    assert process.pid is not None
    os.kill(process.pid, signal.SIGKILL)
    process.join()
    waiting.join()
    kind, exc = results[0]
    assert kind == "raised" and isinstance(exc, WriterDied), (kind, exc)
    assert f"process {process.pid} died" in str(exc)
    assert not (tmp_path / "rb.ckpt").exists()


def test_the_holder_record_is_cleared_after_an_add_that_raised() -> None:
    rb = ReplayBuffer(CAPACITY, 2, 1, region_rows=REGION)
    rb.adopt_rows(ReplayBuffer.MAX_PTR)
    with pytest.raises(ValueError, match="the counters hold"):
        rb.add_packed(torch.zeros(1, rb.width))  # raised with the lock taken
    assert not rb._owner.held


def test_a_first_add_reads_its_identity_before_taking_the_lock(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A kill between taking the write lock and writing the holder record leaves the
    lock held with no record: every later add, pause and save waits for ever. A
    process's first add (and a forked child's) reads its identity from /proc; done
    under the lock, those reads made that window most of the add (126 of 200 random
    SIGKILLs of a writer whose every add was a first)."""
    rb = ReplayBuffer(CAPACITY, 2, 1, region_rows=REGION)
    owner.forget_me()  # as in a new process
    real, held = owner._stat, []

    def stat(pid: int | str) -> tuple[int, bytes, int]:
        held.append(rb._write_lock._semlock._is_mine())
        return real(pid)

    monkeypatch.setattr(owner, "_stat", stat)
    rb.add_packed(torch.zeros(1, rb.width))
    assert held == [False]
    assert rb.ptr == 1


# -- the liveness judgement itself, against a fake /proc ---------------------------

def stat_line(pid: int, state: str, start: int, command: str = "py) thon") -> str:
    # fields 3..21 after the command, the start time field 22
    return f"{pid} ({command}) {state} " + " ".join(["0"] * 18) + f" {start} 0 0\n"


@pytest.fixture
def proc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fake /proc holding this process as pid 77, started at tick 500, its pid and
    time namespaces two files' inodes."""
    root = tmp_path / "proc"
    (root / "self" / "ns").mkdir(parents=True)
    (root / "self" / "stat").write_text(stat_line(77, "R", 500))
    (root / "self" / "ns" / "pid").write_text("")
    (root / "self" / "ns" / "time").write_text("")
    monkeypatch.setattr(owner, "PROC", str(root))
    monkeypatch.setattr(owner, "_me", None)
    yield root
    owner.forget_me()


def holder(pid: int, start: int, namespaces: tuple[int, int] | None = None
           ) -> owner.Owner:
    """A record of ``pid`` holding the lock, of this process's namespaces unless
    ``namespaces`` (pid, time) says otherwise."""
    record = owner.Owner()
    record.words[1:] = torch.tensor(namespaces or owner.me()[1:])
    record.words[0] = pid | start << owner.PID_BITS
    return record


def reaped_pid() -> int:
    """The pid of a process that has exited and been reaped: none has it now."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def add_process(root: Path, pid: int, state: str, start: int) -> None:
    (root / str(pid)).mkdir()
    (root / str(pid) / "stat").write_text(stat_line(pid, state, start))


def test_me_reads_the_pid_start_time_and_namespaces(proc: Path) -> None:
    token, pid_namespace, time_namespace = owner.me()
    assert token == 77 | 500 << owner.PID_BITS
    assert pid_namespace == os.stat(proc / "self" / "ns" / "pid").st_ino
    assert time_namespace == os.stat(proc / "self" / "ns" / "time").st_ino
    assert pid_namespace != time_namespace


def test_a_kernel_without_time_namespaces_reads_as_time_namespace_0(proc: Path) -> None:
    (proc / "self" / "ns" / "time").unlink()
    assert owner.me()[0] and owner.me()[2] == 0


def test_a_failed_read_of_this_process_is_tried_again(
        proc: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of descriptors at the first add: not a process unknown for ever."""
    stat = owner._stat

    def out_of_descriptors(pid: int | str) -> tuple[int, bytes, int]:
        raise OSError(24, "Too many open files")
    monkeypatch.setattr(owner, "_stat", out_of_descriptors)
    assert owner.me() == owner.UNKNOWN
    monkeypatch.setattr(owner, "_stat", stat)
    assert owner.me()[0] == 77 | 500 << owner.PID_BITS


@pytest.mark.parametrize("state,start,dead", [
    ("S", 900, False),  # alive: the same process
    ("Z", 900, True),   # a zombie: dead, not reaped yet
    ("S", 901, True),   # the pid reused by another process
])
def test_a_holder_is_dead_when_a_zombie_or_its_pid_reused(
        proc: Path, state: str, start: int, dead: bool) -> None:
    add_process(proc, 1234, state, start)
    assert holder(1234, 900).dead_holder() == (1234 if dead else None)


def test_a_holder_without_an_entry_in_proc_is_dead_unless_it_answers_kill(
        proc: Path) -> None:
    """No entry: died and reaped, or hidden (``hidepid``: another user's process)."""
    gone = reaped_pid()
    assert holder(gone, 900).dead_holder() == gone
    assert holder(os.getppid(), 900).dead_holder() is None  # alive, not in the fake


@pytest.mark.parametrize("other", ["pid", "time"])
def test_a_holder_of_another_namespace_is_never_judged(proc: Path, other: str) -> None:
    """Another pid namespace: its pid names another process here. Another time
    namespace: /proc shows its start time shifted by this reader's offset."""
    pid_namespace, time_namespace = owner.me()[1:]
    shifted = ((pid_namespace + 1, time_namespace) if other == "pid"
               else (pid_namespace, time_namespace + 1))
    gone = reaped_pid()
    assert holder(gone, 900, shifted).dead_holder() is None
    assert holder(gone, 900).dead_holder() == gone  # the control


def test_nothing_is_judged_without_proc(proc: Path, monkeypatch: pytest.MonkeyPatch
                                        ) -> None:
    monkeypatch.setattr(owner, "PROC", str(proc / "absent"))
    monkeypatch.setattr(owner, "_me", None)
    assert owner.me() == owner.UNKNOWN
    assert holder(reaped_pid(), 900, (0, 0)).dead_holder() is None
    record = owner.Owner()
    record.hold()  # a process that cannot be judged writes nothing
    assert not record.held


def test_a_holder_that_released_and_then_exited_is_not_judged_dead(
        proc: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its token was read while it held the lock; it released (clearing the token) and
    exited before /proc was read."""
    gone = reaped_pid()
    record = holder(gone, 900)
    assert record.dead_holder() == gone  # the control: read before it released
    stat = owner._stat

    def released_then_gone(pid: int | str) -> tuple[int, bytes, int]:
        if pid == gone:
            record.release()
        return stat(pid)
    monkeypatch.setattr(owner, "_stat", released_then_gone)
    assert record.dead_holder() is None


def test_a_forked_child_names_itself() -> None:
    parent = owner.me()[0]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its token's pid, and leave at once
        os.write(write, str(owner.me()[0] & owner.PID_MASK).encode())
        os._exit(0)
    os.close(write)
    child = int(os.read(read, 64))
    os.close(read)
    os.waitpid(pid, 0)
    assert child == pid and parent & owner.PID_MASK == os.getpid()


def run_learner(script: str, *, kill: bool) -> tuple[int, int, str]:
    """Run ``script`` (a learner that prints its collector's pid) in a process of its
    own, SIGKILL it once it has printed where ``kill`` (else it ends itself), and
    wait until every process holding its standard error has exited: the collector,
    and the learner's resource tracker. Returns (learner pid, collector pid, its
    standard error); a collector still alive then is SIGKILLed."""
    import subprocess
    import sys
    import time

    from replay_fsm.data.packer import process_alive

    learner = subprocess.Popen([sys.executable, "-c", script],
                               cwd=Path(__file__).parent.parent, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    collector_pid = 0
    try:
        assert learner.stdout is not None
        collector_pid = int(learner.stdout.readline() or 0)
        assert collector_pid, learner.communicate(timeout=MARGIN_S)[1]
        if kill:
            learner.kill()
        _, err = learner.communicate(timeout=4 * MARGIN_S)
        # Its standard error closes before the collector has exited: the kernel
        # closes a process's files before it becomes a zombie, and on a loaded
        # machine it may wait between the two (the look below failed once in a CI
        # run beside two busy loops). Until it has, bounded.
        deadline = time.monotonic() + MARGIN_S
        while (collector_pid and process_alive(collector_pid)
               and time.monotonic() < deadline):
            time.sleep(0.01)
    finally:
        learner.kill()
        if collector_pid and process_alive(collector_pid):
            os.kill(collector_pid, signal.SIGKILL)
    return learner.pid, collector_pid, err


LEARNER_DIES_IN_A_PAUSE = r'''
import multiprocessing as mp, sys, time
from replay_fsm import Pipeline, ReplayBuffer
from tests.collectors import add_while_serving
if __name__ == "__main__":
    rb = ReplayBuffer(4096, 3, 2)
    pipe = Pipeline(rb, sample_count=64, collector="external")
    adds = mp.get_context("spawn").Array("q", 2, lock=False)  # begun, ended
    collector = mp.get_context("spawn").Process(
        target=add_while_serving, args=(pipe.packer_handle(), rb, adds))
    collector.start()
    deadline = time.monotonic() + 120
    with rb.adds_paused():  # as a save's last pass: an add in flight ended first
        while adds[0] == adds[1]:  # until the collector has begun its next add
            assert time.monotonic() < deadline, "the collector began no add"
            time.sleep(0.01)
        print(collector.pid, flush=True)
        time.sleep(3600)  # until the test kills this process
'''


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_collector_whose_learner_died_inside_a_pause_exits_instead_of_waiting_for_ever(
        ) -> None:
    """A pause (adds_paused, a save's last pass) records no holder: a learner killed
    inside one (SIGKILL, the OOM killer) left its collector process waiting in its
    next add for ever, orphaned, deaf to the stop signals it ignores (helper-66). The
    packer's watch thread now ends it once the learner is gone and the add has
    waited ORPHANED_ADD_S more, saying why."""
    from replay_fsm.data.packer import ORPHAN_EXIT_CODE, process_alive

    learner_pid, collector_pid, err = run_learner(LEARNER_DIES_IN_A_PAUSE, kill=True)
    assert not process_alive(collector_pid)
    assert (f"replay_fsm: the learner (pid {learner_pid}) is gone and an add of this "
            f"process (pid {collector_pid}) has waited") in err, err
    assert f"exiting with code {ORPHAN_EXIT_CODE}" in err


def test_add_waiting_s_counts_every_waiting_add_and_none_behind_this_process() -> None:
    """One record for every add of the process lost a thread's wait when another
    thread's add ended (Ctrl-C here, or got the lock): a collector then waited for
    ever behind a dead learner's pause, its watch thread told no add waits. And a wait
    behind a pause or add of this process's own (alive) is not counted: the watch
    thread ended a collector whose own thread saved under a pause (helper-70). The
    thread's wait is known to have begun once its record is seen; what is counted is
    checked against that instant, not against the Ctrl-C's timer (a thread that began
    its add 0.1 s late, on a loaded machine, failed a fixed threshold)."""
    import time

    ctx = mp.get_context("spawn")
    rb = ReplayBuffer(CAPACITY, 3, 2, region_rows=REGION)
    rows = constant_rows(rb, 1, 1)
    held, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=hold_pause, args=(rb, held, release), daemon=True)
    holder.start()
    try:
        assert held.wait(MARGIN_S)
        waiter = threading.Thread(target=rb.add_packed, args=(rows,), daemon=True)
        waiter.start()
        deadline = time.monotonic() + MARGIN_S
        while not rb._add_waits and time.monotonic() < deadline:
            time.sleep(0.001)  # a poll for the add's wait record, not a wait for the thread
        assert rb._add_waits, "the thread's add never began its wait"
        seen = time.monotonic_ns()  # the thread has waited since before this
        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            rb.add_packed(rows)  # waits beside the thread's add, until the Ctrl-C
        timer.join()
        at_least = (time.monotonic_ns() - seen) / 1e9  # over 0.3 s: the timer's
        assert waiter.is_alive() and rb.add_waiting_s() >= at_least > 0.3
    finally:
        release.set()
        holder.join(MARGIN_S)
    waiter.join(MARGIN_S)
    assert rb.add_waiting_s() == 0.0 and rb.ptr == 1
    # Behind this process's own pause: 0.0 (the pause is alive and ends).
    own, end = threading.Event(), threading.Event()
    pauser = threading.Thread(target=hold_pause, args=(rb, own, end), daemon=True)
    pauser.start()
    assert own.wait(MARGIN_S)
    adder = threading.Thread(target=rb.add_packed, args=(rows,), daemon=True)
    adder.start()
    deadline = time.monotonic() + MARGIN_S
    while not rb._add_waits and time.monotonic() < deadline:
        time.sleep(0.001)  # a poll for the add's wait record, not a wait for the thread
    try:
        assert rb._add_waits, "the add never began its wait"
        assert adder.is_alive() and rb.add_waiting_s() == 0.0
        # A child forked now holds no lock and has no add waiting.
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(write, b"1" if rb.add_waiting_s() == 0.0 else b"0")
            os._exit(0)
        os.close(write)
        child = os.read(read, 1)
        os.close(read)
        os.waitpid(pid, 0)
        assert child == b"1"
    finally:
        end.set()
    adder.join(MARGIN_S)
    assert rb.ptr == 2


LEARNER_DIES_BESIDE_A_COLLECTORS_PAUSE = r'''
import multiprocessing as mp, os, signal, sys
from replay_fsm import Pipeline, ReplayBuffer
from replay_fsm.data.packer import ORPHANED_ADD_S
from tests.collectors import add_beside_own_pause
if __name__ == "__main__":
    rb = ReplayBuffer(4096, 3, 2)
    pipe = Pipeline(rb, sample_count=64, collector="external")
    ctx = mp.get_context("spawn")
    attached, done = ctx.Event(), ctx.Event()
    collector = ctx.Process(target=add_beside_own_pause, args=(
        pipe.packer_handle(), rb, attached, ORPHANED_ADD_S + 3, done))
    collector.start()
    assert attached.wait(120), "the collector did not attach"
    print(collector.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # outside any pause
'''


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_collector_whose_learner_is_gone_lives_through_its_own_long_pause() -> None:
    """A collector whose learner is gone may save the buffer under a pause of its own
    for longer than ORPHANED_ADD_S while another of its threads adds: its watch thread
    ended it mid-save (exit code 70, helper-70). A pause of this process is alive."""
    _, _, err = run_learner(LEARNER_DIES_BESIDE_A_COLLECTORS_PAUSE, kill=False)
    assert "exiting with code" not in err, err
    assert "collector: its pause and its add ended" in err, err


def test_the_orphan_watch_ends_a_process_only_on_two_looks_in_a_row(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One look can fall between a pause of the collector's own ending and the add it
    held off taking the lock: that add then shows a long wait for an instant. The
    watch ended the process on that one look; it now needs two in a row."""
    from types import SimpleNamespace

    import replay_fsm.data.packer as packer_module
    from replay_fsm.data.packer import ORPHAN_EXIT_CODE, ORPHANED_ADD_S, LearnerWatch

    class Exited(Exception):
        pass

    def exit_(code: int) -> None:
        raise Exited(code)

    looks = [ORPHANED_ADD_S + 5, 0.0, ORPHANED_ADD_S + 5, 0.0, ORPHANED_ADD_S + 5,
             ORPHANED_ADD_S + 6, 0.0]
    rb = SimpleNamespace(add_waiting_s=lambda: looks.pop(0))
    now = [0]
    # The clock moves 60 s between two looks (the first look comes as the learner is
    # found gone, too early to judge).
    monkeypatch.setattr(packer_module.time, "monotonic_ns", lambda: now[0])
    monkeypatch.setattr(packer_module.time, "sleep",
                        lambda s: now.__setitem__(0, now[0] + int(60e9)))
    monkeypatch.setattr(packer_module.os, "_exit", exit_)
    monkeypatch.setattr(packer_module, "learner_lives", lambda pid, is_parent: False)
    with pytest.raises(Exited) as info:
        LearnerWatch(1, False, rb).run()  # type: ignore[arg-type]
    assert info.value.args == (ORPHAN_EXIT_CODE,) and looks == [0.0]
