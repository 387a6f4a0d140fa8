"""INV-LIVE at every state a learner can wait on: REQUESTED (a collector that died,
hangs inside a pack, or never attaches) and SUBMITTED (a copy that never completes,
a copy engine that dies). Each wait raises a named error, chained to the cause when
there is one; none hangs. Bounds are liveness_timeout plus a wide margin. Every wait
carries a timeout of that margin, so a pipeline without its watchdog fails these tests
(the wait returns False) instead of hanging them."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from replay_fsm import CollectorDied, DataStalled, Pipeline, PipelineFailed, ReplayBuffer
from replay_fsm.errors import TransferFailed
from replay_fsm.runtime.links import ThreadCollector
from replay_fsm.runtime.liveness import RowWatch
from replay_fsm.spec import SlotState
from replay_fsm.transfer.emulated import EmulatedBackend
from replay_fsm.transfer.manual import ManualBackend

from .support import MARGIN_S, finishes_within


def buffer() -> ReplayBuffer:
    rb = ReplayBuffer(256, 4, 2)
    rb.add_packed(torch.randn(100, rb.width))
    return rb


def test_a_copy_that_never_completes_raises_transfer_failed() -> None:
    with Pipeline(buffer(), sample_count=8, backend="manual", liveness_timeout=0.3) as pipe:
        pipe.start_prepare(0, 8)
        t0 = time.monotonic()
        with pytest.raises(TransferFailed, match="copy into slot 0 did not complete"):
            pipe.wait_until_ready(0, 8, timeout=MARGIN_S)  # the watchdog ends it first
        assert time.monotonic() - t0 < MARGIN_S
        with pytest.raises(TransferFailed):  # sticky
            pipe.sample_large_batch(0, 8)


@pytest.mark.parametrize("poll", ["batch_ready", "short waits"])
def test_a_learner_that_polls_learns_of_a_copy_that_never_completes(poll: str) -> None:
    """INV-LIVE for a learner that never waits long: a copy's bound counts from when
    the learner first found it pending, over every poll and wait (each poll answered
    False, and each wait shorter than liveness_timeout ran out, for ever)."""
    with Pipeline(buffer(), sample_count=8, backend="manual", liveness_timeout=0.3) as pipe:
        pipe.start_prepare(0, 8)
        slot = pipe.slot_of(0)
        assert slot is not None and pipe.backend.wait_submitted(slot, timeout=MARGIN_S)  # type: ignore[attr-defined]
        t0 = time.monotonic()
        with pytest.raises(TransferFailed, match="copy into slot 0 did not complete"):
            while time.monotonic() - t0 < MARGIN_S:
                if poll == "batch_ready":
                    assert not pipe.batch_ready(0, 8)
                else:
                    assert not pipe.wait_until_ready(0, 8, timeout=0.05)
        with pytest.raises(TransferFailed):  # sticky
            pipe.batch_ready(0, 8)


class SetClock:
    """Looks of ``Pipeline._judge_locked`` at set instants, in seconds from the
    clock's making: its clock counts a stretch between two looks in full up to half
    the bound (``looks.LookClock``), so these looks come at most that far apart."""

    def __init__(self, pipe: Pipeline) -> None:
        self.pipe, self.base = pipe, time.monotonic_ns()

    def judge(self, tick: int, slot: int, at_s: float, ns: int = 0) -> None:
        with self.pipe._lock:
            self.pipe._judge_locked(tick, slot, SlotState.SUBMITTED,
                                    self.base + int(at_s * 1e9) + ns, None)


@pytest.mark.parametrize("stall_timeout", [60.0, 0.02])
def test_a_copy_is_late_from_when_the_learner_first_found_it_pending(
        stall_timeout: float) -> None:
    """Pipeline._judge_locked on a set clock: the copy's bound counts from the first
    look that found it SUBMITTED (the bound inclusive), not from a wait's start, and
    anew for the slot's next request. Its clock is not stall_timeout's: a short one
    (0.02 s) made each stretch count 0.01 s, and the copy was judged late five times
    later than liveness_timeout in a wait (helper-86)."""
    rb = buffer()
    with Pipeline(rb, sample_count=8, backend="manual", liveness_timeout=1.0,
                  stall_timeout=stall_timeout) as pipe:
        backend = pipe.backend
        pipe.start_prepare(0, 8)
        assert backend.wait_submitted(0, timeout=MARGIN_S)  # type: ignore[attr-defined]
        clock = SetClock(pipe)
        for at_s in (5, 5.5, 6):  # first seen at 5 s; at 6 s exactly the bound
            clock.judge(0, 0, at_s)
        backend.complete(0)  # type: ignore[attr-defined]
        pipe.sample_large_batch(0, 8)
        pipe.after_tick()
        pipe.start_prepare(1, 8)
        pipe.start_prepare(2, 8)  # slot 0 again: its copy's count starts anew
        assert pipe.slot_of(2) == 0 and backend.wait_submitted(0, timeout=MARGIN_S)  # type: ignore[attr-defined]
        for at_s in (50, 50.5, 51):
            clock.judge(2, 0, at_s)
        with pytest.raises(TransferFailed, match="slot 0 did not complete within 1 s"):
            clock.judge(2, 0, 51, ns=1)


def test_a_stretch_no_look_saw_counts_for_half_the_bound_at_most() -> None:
    """The whole job stopped (Ctrl-Z) and resumed (fg), or a learner that polls
    seldom: the first look after the stretch is no sign of a copy that does not
    complete, the looks after it are. (Before, the first look after the learner's
    process was stopped longer than liveness_timeout judged a copy late that the copy
    engine, stopped too, had had no time to complete.)"""
    with Pipeline(buffer(), sample_count=8, backend="manual", liveness_timeout=1.0) as pipe:
        pipe.start_prepare(0, 8)
        assert pipe.backend.wait_submitted(0, timeout=MARGIN_S)  # type: ignore[attr-defined]
        clock = SetClock(pipe)
        for at_s in (5, 3605, 3605.5):  # an hour with no look: half a second counted
            clock.judge(0, 0, at_s)
        with pytest.raises(TransferFailed, match="slot 0 did not complete within 1 s"):
            clock.judge(0, 0, 3605.5, ns=1)


def test_a_copy_late_for_the_learners_own_reads_is_said_to_be_theirs() -> None:
    """A copy into a slot whose last batch the learner still reads on its device (a
    long step still queued behind after_tick: ``hold_reads``) waits for them
    (INV-DEVICE-WAR). Past liveness_timeout it still fails the wait (no hang on a
    learner's device work that never ends), but says whose time it was: before, a
    learner step longer than liveness_timeout was blamed on the copy (set clock)."""
    with Pipeline(buffer(), sample_count=8, backend="manual",
                  backend_options={"hold_reads": True}, liveness_timeout=1.0) as pipe:
        backend = pipe.backend
        pipe.start_prepare(0, 8)
        assert backend.wait_submitted(0, timeout=MARGIN_S)  # type: ignore[attr-defined]
        backend.complete(0)  # type: ignore[attr-defined]
        pipe.sample_large_batch(0, 8)
        pipe.after_tick()  # its reads stay in flight
        pipe.start_prepare(1, 8)
        pipe.start_prepare(2, 8)  # slot 0 again: its copy waits for tick 0's reads
        assert pipe.slot_of(2) == 0 and backend.wait_submitted(0, timeout=MARGIN_S)  # type: ignore[attr-defined]
        assert backend.copy_held(0)
        clock = SetClock(pipe)
        for at_s in (5, 5.5, 6):  # at 6 s exactly the bound
            clock.judge(2, 0, at_s)
        with pytest.raises(TransferFailed) as info:
            clock.judge(2, 0, 6, ns=1)
        assert str(info.value).startswith(
            "tick 2: the copy into slot 0 has waited 1.0 s (liveness_timeout 1 s) for the "
            "learner's own device work: the reads of the slot's last batch")
    with Pipeline(buffer(), sample_count=8, backend="manual",
                  liveness_timeout=1.0) as pipe:  # reads over: the copy's own time
        pipe.start_prepare(0, 8)
        assert pipe.backend.wait_submitted(0, timeout=MARGIN_S)  # type: ignore[attr-defined]
        assert not pipe.backend.copy_held(0)
        clock = SetClock(pipe)
        for at_s in (5, 5.5, 6):
            clock.judge(0, 0, at_s)
        with pytest.raises(TransferFailed, match="^tick 0: the copy into slot 0 did "
                                                 "not complete within 1 s"):
            clock.judge(0, 0, 6, ns=1)


def test_a_learner_step_longer_than_the_liveness_timeout_is_named_as_such() -> None:
    """End to end on the emulated device (its copy engine waits on the slot's release
    event, as CUDA's copy stream does): the learner's reads of each batch drain 3 s
    after release, the copies themselves take no time, liveness_timeout is 0.2 s."""
    rb = buffer()
    backend = EmulatedBackend(copy_delay=0.0, read_delay=3.0)
    with Pipeline(rb, sample_count=8, backend=backend, liveness_timeout=0.2) as pipe:
        with pytest.raises(TransferFailed, match="for the learner's own device work"):
            for _ in pipe.ticks(0, 4):
                pass


def test_a_backend_whose_copy_held_raises_fails_the_wait_chained() -> None:
    boom = RuntimeError("copy_held is broken")

    class Broken(ManualBackend):
        def copy_held(self, slot: int) -> bool:
            raise boom

    with Pipeline(buffer(), sample_count=8, backend=Broken(), liveness_timeout=0.2) as pipe:
        pipe.start_prepare(0, 8)
        with pytest.raises(TransferFailed, match="copy_held raised RuntimeError") as info:
            pipe.wait_until_ready(0, 8, timeout=MARGIN_S)
        assert info.value.__cause__ is boom


def test_a_copy_engine_that_raises_fails_the_learner_chained() -> None:
    boom = RuntimeError("DMA engine on fire")

    class Burning(EmulatedBackend):
        def _copy(self, order: object) -> None:
            raise boom

    with Pipeline(buffer(), sample_count=8, backend=Burning(), liveness_timeout=60) as pipe:
        pipe.start_prepare(0, 8)
        with pytest.raises(PipelineFailed) as info:
            pipe.sample_large_batch(0, 8)
        assert info.value.__cause__ is boom


def test_a_copy_engine_thread_that_is_gone_is_noticed() -> None:
    class Vanished(EmulatedBackend):
        def _run(self) -> None:
            return  # the engine thread ends at once, reporting nothing

    with Pipeline(buffer(), sample_count=8, backend=Vanished(), liveness_timeout=60) as pipe:
        pipe.start_prepare(0, 8)
        with pytest.raises(TransferFailed, match="copy engine thread exited"):
            pipe.wait_until_ready(0, 8, timeout=MARGIN_S)


def test_a_transfer_worker_that_meets_an_exception_fails_the_learner() -> None:
    boom = OSError("ready queue broken")

    class BrokenReceive(ThreadCollector):
        def receive(self, timeout: float) -> None:
            raise boom

    rb = buffer()
    with Pipeline(rb, sample_count=8, collector=BrokenReceive(rb, 2, 8),
                  liveness_timeout=60) as pipe:
        with pytest.raises(PipelineFailed) as info:
            pipe.start_prepare(0, 8)  # the worker may have failed the pipeline already
            pipe.wait_until_ready(0, 8, timeout=MARGIN_S)
        assert info.value.__cause__ is boom


class StuckBuffer(ReplayBuffer):
    """A gather that blocks until released: a packer alive but hung inside a pack."""

    release = threading.Event()

    def gather(self, indices: torch.Tensor, out: torch.Tensor, **kw: Any) -> torch.Tensor:
        self.release.wait(MARGIN_S)
        return super().gather(indices, out, **kw)


def test_a_packer_thread_hung_inside_a_pack_raises_collector_died() -> None:
    rb = StuckBuffer(256, 4, 2)
    rb.add_packed(torch.randn(100, rb.width))
    StuckBuffer.release.clear()
    pipe = Pipeline(rb, sample_count=8, collector="thread", liveness_timeout=0.5)
    try:
        pipe.start_prepare(0, 8)
        t0 = time.monotonic()
        with pytest.raises(CollectorDied, match="no heartbeat from the packer thread"):
            pipe.wait_until_ready(0, 8, timeout=MARGIN_S)
        assert time.monotonic() - t0 < MARGIN_S
    finally:
        StuckBuffer.release.set()  # let the thread finish its pack so close joins it
        pipe.close()
    assert pipe.forced == []


def test_an_external_collector_that_never_attaches_raises() -> None:
    with Pipeline(buffer(), sample_count=8, collector="external", attach_timeout=0.3,
                  liveness_timeout=60) as pipe:
        pipe.start_prepare(0, 8)
        with pytest.raises(CollectorDied, match="no collector called Packer.attach"):
            pipe.wait_until_ready(0, 8, timeout=MARGIN_S)


def test_a_packer_process_that_never_attaches_raises() -> None:
    """A packer process alive but stopped or blocked in its start never beats: the
    wait lasted for ever (learner packs off, or past the request backlog they allow)."""
    from replay_fsm.runtime.links import ProcessCollector

    class Alive:  # the packer process, never attaching
        pid, exitcode = 4242, None

        def is_alive(self) -> bool:
            return True

        def join(self, timeout: float | None = None) -> None:
            pass

        def terminate(self) -> None:
            pass

        kill = terminate

    class NeverAttaches(ProcessCollector):
        def start(self, fail: object) -> None:
            self.process = Alive()

    rb = buffer()
    with Pipeline(rb, sample_count=8, collector=NeverAttaches(rb, 2, 8, attach_timeout=0.3),
                  liveness_timeout=60, learner_packs=False) as pipe:
        pipe.start_prepare(0, 8)
        with pytest.raises(CollectorDied, match=r"^tick 0: the packer process \(pid 4242\) "
                                                r"has not attached within 0.3 s"):
            pipe.wait_until_ready(0, 8, timeout=MARGIN_S)


def test_a_slow_collector_that_still_beats_is_not_declared_dead() -> None:
    """Waiting for data (min_snapshot_ptr) is not death: the packer keeps beating while
    the request waits for its rows (seen to beat again and again), so each wait runs
    to its own timeout and returns False. With a 0.2 s bound it failed on a loaded
    machine (3 in 150 repeats, helper-42): a pause of the process stops a packer
    thread's beats too. The verdict on a beat older than the bound is tested on a set
    clock (test_pipeline.test_silent_packer_raises_after_the_liveness_timeout)."""
    with Pipeline(buffer(), sample_count=8, collector="thread",
                  liveness_timeout=MARGIN_S) as pipe:
        pipe.start_prepare(0, 8, min_snapshot_ptr=10**9)  # data that never comes
        handle = pipe.packer_handle()
        beats = {handle.heartbeat_ns}
        deadline = time.monotonic() + MARGIN_S
        while len(beats) < 5 and time.monotonic() < deadline:
            assert pipe.wait_until_ready(0, 8, timeout=0.05) is False
            beats.add(handle.heartbeat_ns)
        assert len(beats) >= 5, "the packer stopped beating while the request waited"
        assert not pipe.closed and pipe.statistics().stalls >= 1


def test_an_external_collector_silent_while_it_makes_the_rows_is_not_declared_dead(
        ) -> None:
    """An external collector calls Packer.service between its environment steps: while
    a step makes the rows a tick waits for (min_snapshot_ptr), it beats nothing, for
    longer than liveness_timeout. That wait is bounded by stall_timeout alone. The
    rows then come while no wait runs (the learner is busy), long after the last
    beat: the next wait does not count that silence at once (its timeout, shorter
    than the bound, ends it first: the verdict runs only before the deadline), and a
    later one, the collector still silent, counts it from then."""
    from replay_fsm.data.packer import Packer

    rb = buffer()
    with Pipeline(rb, sample_count=8, collector="external", liveness_timeout=0.5,
                  learner_packs=False) as pipe:
        packer = Packer.attach(pipe.packer_handle(), rb)
        assert packer.service(timeout=0) == 0  # one beat, then a long step
        pipe.start_prepare(0, 8, min_snapshot_ptr=rb.ptr + 16)
        assert pipe.wait_until_ready(0, 8, timeout=1.0) is False  # no CollectorDied
        rb.add_packed(torch.randn(16, rb.width))  # the step's rows; no service after
        assert pipe.wait_until_ready(0, 8, timeout=0.1) is False  # polled
        with pytest.raises(CollectorDied, match="no heartbeat from the collector"):
            pipe.wait_until_ready(0, 8, timeout=MARGIN_S)


def test_the_count_runs_over_every_wait_from_the_rows_seen_or_the_request() -> None:
    """Pipeline._owed on a set clock: for an external collector, not while the rows
    are missing; from the first time the learner saw them (over all waits, the bound
    inclusive), or from the request when they were there already. A packer thread
    beats while rows come: always."""
    s = 10**9
    rb = buffer()
    with Pipeline(rb, sample_count=8, collector="external", liveness_timeout=1.0) as pipe:
        pipe.start_prepare(0, 8, min_snapshot_ptr=rb.ptr + 1)
        slot = pipe.slot_of(0)
        assert slot is not None and pipe._owed_ns[slot] is None
        assert not pipe._owed(slot, False, 5 * s)
        assert not pipe._owed(slot, True, 7 * s)  # seen there: the count starts
        assert not pipe._owed(slot, False, 7 * s + 1)  # a wait that saw them missing
        assert not pipe._owed(slot, True, 8 * s)  # exactly the bound
        assert pipe._owed(slot, True, 8 * s + 1)  # a later wait: from 7 s still
        pipe.start_prepare(1, 8)  # its rows are there: counted from the request
        since = pipe._owed_ns[pipe.slot_of(1)]  # type: ignore[index]
        assert since is not None and since <= pipe._looks.look()  # the looks' clock
    with Pipeline(rb, sample_count=8, collector="thread") as pipe:
        assert pipe._owed(0, False, 0)


@pytest.mark.parametrize("collector", ["thread", "process"])
def test_a_wait_for_rows_that_stopped_coming_raises_data_stalled(collector: str) -> None:
    """The packer lives and beats, but the rows a request waits for never come (the
    process that adds them died): the wait without a timeout raises DataStalled once
    no row was added for stall_timeout, instead of waiting for ever."""
    with Pipeline(buffer(), sample_count=8, collector=collector, liveness_timeout=60,
                  stall_timeout=0.3) as pipe:
        pipe.start_prepare(0, 8, min_snapshot_ptr=500)  # the buffer has 100 rows
        ok, got = finishes_within(lambda: pytest.raises(DataStalled, pipe.sample_large_batch,
                                                        0, 8))
        assert ok, "sample_large_batch still waited for rows after MARGIN_S"
        got[0].match(r"^tick 0 waits for 500 rows \(min_snapshot_ptr\); the replay buffer "
                     r"has had 100 for \d+\.\d s \(stall_timeout\): is whatever adds "
                     r"the rows still running\?$")
        with pytest.raises(DataStalled):  # sticky, and still a DataStalled
            pipe.wait_until_ready(0, 8, timeout=0)


def test_a_stall_names_the_bound_and_the_rows_as_its_caller_calls_them() -> None:
    """The SAC trainer and the demo set stall_timeout from their liveness_timeout; their
    DataStalled said "(stall_timeout)", which their users have no setting for. The
    caller names the bound (``stall_timeout_name``), the pipeline knowing nothing of
    that layer (helper-104); and the rows its requests wait for, which it sets from a
    warm-up of its own, said "(min_snapshot_ptr)" (``min_snapshot_ptr_name``)."""
    with Pipeline(buffer(), sample_count=8, collector="thread", liveness_timeout=60,
                  stall_timeout=0.3, stall_timeout_name="liveness_timeout",
                  min_snapshot_ptr_name="the warm-up, warmup_steps") as pipe:
        assert pipe.stall_timeout_name == "liveness_timeout"
        assert pipe.min_snapshot_ptr_name == "the warm-up, warmup_steps"
        pipe.start_prepare(0, 8, min_snapshot_ptr=500)  # the buffer has 100 rows
        ok, got = finishes_within(lambda: pytest.raises(DataStalled, pipe.sample_large_batch,
                                                        0, 8))
        assert ok, "sample_large_batch still waited for rows after MARGIN_S"
        got[0].match(r"^tick 0 waits for 500 rows \(the warm-up, warmup_steps\); the "
                     r"replay buffer has had 100 for \d+\.\d s \(liveness_timeout\): is "
                     r"whatever adds the rows still running\?$")


def test_rows_still_coming_keep_a_wait_for_rows_going() -> None:
    """RowWatch on a set clock: each row added restarts the stall bound; the bound is
    inclusive; rows that are there, or no bound (None), never end the wait."""
    s = 10**9
    watch = RowWatch(1.0)
    assert watch.verdict(0, 100, 5, 0) is None
    assert watch.verdict(0, 100, 5, s) is None  # exactly stall_timeout: not yet
    assert watch.verdict(0, 100, 6, s + 1) is None  # a row came: the bound restarts
    assert watch.verdict(0, 100, 6, 2 * s + 1) is None
    stalled = watch.verdict(0, 100, 6, 2 * s + 2)
    assert isinstance(stalled, DataStalled)
    assert "waits for 100 rows (min_snapshot_ptr); the replay buffer has had 6 for 1.0 s" \
        in str(stalled)
    assert watch.verdict(0, 100, 100, 9 * s) is None  # the rows are there: packer's part
    assert watch.verdict(0, 100, 100, 11 * s) is None  # exactly all of them, for long
    assert watch.verdict(0, 200, 100, 12 * s) is None  # waiting for rows again: anew
    assert watch.verdict(0, 200, 100, 13 * s + 1) is not None
    forever = RowWatch(None)
    assert forever.verdict(0, 100, 5, 0) is None
    assert forever.verdict(0, 100, 5, 10**6 * s) is None


def test_a_silent_collector_whose_pack_is_done_is_not_blamed() -> None:
    """A slot stays REQUESTED after the packer posted its pack-done message until the
    transfer worker takes it (say it is blocked in a long submit). The collector then
    owes nothing, so its silence must not be read as death (found by the SPIN model):
    the verdict, once the submit has taken longer than liveness_timeout, is the copy
    side's (helper-48: before, there was none, and the wait had no bound)."""
    from replay_fsm.data.packer import Packer
    from replay_fsm.transfer.manual import ManualBackend

    slow_submit = threading.Event()

    class SlowSubmit(ManualBackend):
        def submit(self, order: object) -> None:
            slow_submit.wait(MARGIN_S)  # the worker is stuck here for a while
            super().submit(order)  # type: ignore[arg-type]

    rb = buffer()
    with Pipeline(rb, sample_count=8, collector="external", backend=SlowSubmit(),
                  liveness_timeout=0.3) as pipe:
        packer = Packer.attach(pipe.packer_handle(), rb)
        pipe.start_prepare(0, 8)
        pipe.start_prepare(1, 8)
        assert packer.service(timeout=MARGIN_S) and packer.service(timeout=MARGIN_S)
        # The worker took tick 0's message and blocks in its submit; tick 1's message
        # waits in the channel. The collector goes silent for good.
        try:
            with pytest.raises(TransferFailed) as info:  # not CollectorDied
                pipe.wait_until_ready(1, 8, timeout=MARGIN_S)
            assert "in one backend submit" in str(info.value)
        finally:
            slow_submit.set()
