"""The transfer worker's thread and the watchdog's verdicts, each on its own: a
worker given plain callables, a watchdog given a link and a backend that answer
what the test says (no pipeline, no clock)."""

from __future__ import annotations

import threading

import pytest

from replay_fsm.errors import CollectorDied, TransferFailed
from replay_fsm.runtime.links import Gone
from replay_fsm.runtime.liveness import Watchdog
from replay_fsm.runtime.worker import POLL_S, TransferWorker
from replay_fsm.spec import SlotState

from .support import MARGIN_S


class Recorder:
    """The worker's four callables; ``receive`` records its timeouts and says when
    it was first called."""

    def __init__(self) -> None:
        self.timeouts: list[float] = []
        self.failures: list[BaseException] = []
        self.polled = threading.Event()

    def receive(self, timeout: float) -> None:
        self.timeouts.append(timeout)
        self.polled.set()
        return None

    def worker(self) -> TransferWorker:
        return TransferWorker(self.receive, lambda done: None, lambda order: None,
                              self.failures.append)


def test_the_transfer_thread_is_a_daemon_named_for_the_library() -> None:
    """A thread dump names it, and a learner that exits without close() is not kept
    alive by it. Kills xǁTransferWorkerǁ__init__ mutants 5, 6 and 8 to 12."""
    rec = Recorder()
    worker = rec.worker()
    worker.start()
    try:
        assert rec.polled.wait(MARGIN_S)
        # Running ones: a thread whose start() a Ctrl-C cut short before the system
        # started it (another test's) stays listed, never running.
        ours = [t for t in threading.enumerate()
                if t.name == "replay_fsm-transfer" and t.is_alive()]
        assert len(ours) == 1 and ours[0].daemon
    finally:
        assert worker.stop(MARGIN_S) == []
    assert not worker.is_alive() and rec.failures == []


def test_the_worker_polls_its_link_with_a_timeout() -> None:
    """Each receive waits at most POLL_S, so a stop is seen within a poll even on a
    link that nothing closes. Kills xǁTransferWorkerǁ_run mutant 3 (an untimed
    receive)."""
    rec = Recorder()
    worker = rec.worker()
    worker.start()
    assert rec.polled.wait(MARGIN_S)
    assert worker.stop(MARGIN_S) == []
    assert rec.timeouts and set(rec.timeouts) == {POLL_S}


def test_a_worker_stopped_before_it_started_has_nothing_to_join() -> None:
    """Kills xǁTransferWorkerǁstop mutant 1 (``or``: it would join a thread that
    never started, which raises)."""
    worker = Recorder().worker()
    assert worker.stop(MARGIN_S) == []
    assert not worker.is_alive()


class Link:
    def __init__(self, gone: Gone | None) -> None:
        self.gone = gone

    def liveness(self, waiting: bool, timeout: float) -> Gone | None:
        return self.gone


class Backend:
    def __init__(self, why: str | None) -> None:
        self.why = why

    def check_alive(self) -> str | None:
        return self.why

    def copy_held(self, slot: int) -> bool:
        return False


def watchdog(gone: Gone | None = None, why: str | None = None,
             timeout: float = 2.0, worker_alive: bool = True,
             busy_since: list[int | None] | None = None) -> Watchdog:
    """``busy_since``: a one-item list the test sets, the worker's busy episode."""
    episode = busy_since or [None]
    return Watchdog(timeout, Link(gone), Backend(why),  # type: ignore[arg-type]
                    lambda: worker_alive, lambda: episode[0])


def test_a_gone_collector_is_collector_died_chained_to_its_cause() -> None:
    """Kills xǁWatchdogǁverdict mutant 11 (the cause dropped)."""
    cause = OSError("pipe closed")
    failure = watchdog(Gone("the packer process (pid 7) exited", cause)).verdict(
        3, 0, SlotState.REQUESTED, 0.0)
    assert isinstance(failure, CollectorDied)
    assert str(failure) == "tick 3: the packer process (pid 7) exited"
    assert failure.__cause__ is cause


def test_a_dead_transfer_worker_is_transfer_failed_by_name() -> None:
    """A live collector, but nobody to take its pack-done message. Kills
    xǁWatchdogǁverdict mutant 13 (the message dropped)."""
    failure = watchdog(worker_alive=False).verdict(3, 0, SlotState.REQUESTED, 0.0)
    assert isinstance(failure, TransferFailed)
    assert str(failure) == "tick 3: the transfer worker thread exited"


def test_a_dead_copy_engine_is_transfer_failed_in_the_backends_words() -> None:
    failure = watchdog(why="the copy thread exited").verdict(3, 1, SlotState.SUBMITTED, 0.0)
    assert isinstance(failure, TransferFailed)
    assert str(failure) == "tick 3: the copy thread exited"


@pytest.mark.parametrize(("waited_s", "fails"), [(2.0, False), (2.000001, True)])
def test_a_copy_may_take_exactly_the_liveness_timeout(waited_s: float, fails: bool) -> None:
    """The bound is inclusive: a copy waited on for exactly ``liveness_timeout`` is
    still allowed. Kills xǁWatchdogǁverdict mutant 18 (``>=``)."""
    failure = watchdog(timeout=2.0).verdict(3, 1, SlotState.SUBMITTED, waited_s)
    assert (failure is not None) is fails
    if fails:
        assert str(failure) == ("tick 3: the copy into slot 1 did not complete within "
                                "2 s (liveness_timeout)")


def test_a_worker_stuck_in_a_submit_fails_a_wait_for_a_requested_tick() -> None:
    """A submit that never returns holds back the pack-done messages behind it: a
    tick waiting REQUESTED for one of them had no verdict at all (helper-48). On a set
    clock: the bound is liveness_timeout, inclusive, from when the learner first
    found the worker in that submit (as a copy's from its first sighting: a slow
    submit that returns is no failure, helper-49); another message starts anew."""
    s = 10**9
    episode: list[int | None] = [None]
    dog = watchdog(timeout=2.0, busy_since=episode)

    def verdict(now: int) -> object:
        return dog.verdict(3, 0, SlotState.REQUESTED, 0.0, now_ns=now)

    assert verdict(5 * s) is None  # waiting for a message
    episode[0] = 4 * s  # busy since before the learner looked: counts from the look
    assert verdict(6 * s) is None and verdict(8 * s) is None  # exactly the bound
    episode[0] = 7 * s  # that submit returned; the next message's
    assert verdict(9 * s) is None and verdict(11 * s) is None
    failure = verdict(11 * s + 1)
    assert isinstance(failure, TransferFailed)
    assert str(failure) == ("tick 3: the transfer worker has been in one backend submit "
                            "for 2.0 s since the learner first found it there "
                            "(liveness_timeout 2 s): it does not return")
    episode[0] = None  # it returned at last: no verdict, and a later one starts anew
    assert verdict(20 * s) is None
    episode[0] = 21 * s
    assert verdict(30 * s) is None


def test_the_worker_is_busy_from_a_message_to_the_end_of_its_submit() -> None:
    entered, release = threading.Event(), threading.Event()
    messages = [object()]

    def receive(timeout: float) -> object:
        return messages.pop() if messages else None

    def submit(order: object) -> None:
        entered.set()
        release.wait(MARGIN_S)

    worker = TransferWorker(receive, lambda done: done, submit,  # type: ignore[arg-type]
                            lambda exc: None)
    assert worker.busy_since_ns() is None
    worker.start()
    try:
        assert entered.wait(MARGIN_S)
        assert worker.busy_since_ns() is not None
    finally:
        release.set()
    assert worker.stop(MARGIN_S) == []
    assert worker.busy_since_ns() is None


def test_a_wait_behind_a_submit_that_never_returns_ends_in_transfer_failed() -> None:
    """The pipeline's wiring of the above: the backend hangs in tick 0's submit; tick
    1's pack-done message waits behind it, its slot REQUESTED, and the learner's wait
    for it raised nothing, for ever (helper-48)."""
    import torch

    from replay_fsm import Pipeline, ReplayBuffer
    from replay_fsm.transfer.cpu import CpuBackend

    release = threading.Event()

    class HangsOnTick0(CpuBackend):
        def submit(self, order):  # type: ignore[no-untyped-def]
            if order.tick == 0:
                release.wait(MARGIN_S * 4)  # a driver call that does not return
            super().submit(order)

    rb = ReplayBuffer(256, 3, 2)
    rb.add_packed(torch.randn(256, rb.width))
    pipe = Pipeline(rb, sample_count=16, backend=HangsOnTick0(), liveness_timeout=0.5,
                    learner_packs=False)
    try:
        pipe.start_prepare(0, 16)
        pipe.start_prepare(1, 16)
        with pytest.raises(TransferFailed, match="tick 1: the transfer worker has been "
                                                 "in one backend submit for"):
            pipe.wait_until_ready(1, 16, timeout=MARGIN_S)
    finally:
        release.set()
        pipe.close()
