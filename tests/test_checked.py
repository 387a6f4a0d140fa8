"""Checked mode trips on each overlap it exists to catch: INV-HOST-WAR and
INV-DEVICE-WAR through a pipeline whose backend breaks them (INV-RAW:
tests/test_pipeline_edges.py), and every check of ``Checker`` on states no correct
pipeline reaches. Each violation fails the pipeline first, then raises."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from replay_fsm import Pipeline, PipelineFailed, ReplayBuffer
from replay_fsm.runtime.checked import CheckedModeViolation, Checker
from replay_fsm.spec import SlotState
from replay_fsm.transfer.manual import ManualBackend
from replay_fsm.wire import PackDone

from .drive import complete_copies_for
from .support import MARGIN_S

N = 8  # rows per batch


def buffer(rows: int = 80) -> ReplayBuffer:
    rb = ReplayBuffer(rows, 3, 2)
    rb.add_packed(torch.arange(rows * rb.width, dtype=torch.float32).view(rows, -1))
    return rb


class IgnoresRelease(ManualBackend):
    """A copy engine that does not wait for the learner's reads of the slot's previous
    HOT period (a CUDA copy stream that skips the release event)."""

    def complete(self, slot: int) -> None:
        with self._cv:
            del self._submitted[slot]
        self.copy_now(slot)
        self.on_complete(slot)


class CopiesTwice(ManualBackend):
    """A copy engine that copies a slot again once it reported it complete (a retry
    of a copy that had succeeded)."""

    def complete(self, slot: int) -> None:
        super().complete(slot)
        self.copy_now(slot)


def failed_with(pipe: Pipeline, violation: CheckedModeViolation) -> None:
    with pytest.raises(PipelineFailed) as info:
        pipe.start_prepare(5, N)
    assert info.value.__cause__ is violation


def test_a_copy_into_a_slot_the_learner_still_reads_is_an_inv_device_war_violation(
        ) -> None:
    backend = IgnoresRelease(hold_reads=True)  # reads stay in flight after release
    with Pipeline(buffer(), sample_count=N, backend=backend, checked=True,
                  liveness_timeout=MARGIN_S) as pipe:
        pipe.start_prepare(0, N)
        complete_copies_for(pipe, 0)
        pipe.sample_large_batch(0, N)
        pipe.after_tick()  # slot 0 released, its reads not finished
        pipe.start_prepare(1, N)
        complete_copies_for(pipe, 1)
        pipe.sample_large_batch(1, N)
        pipe.start_prepare(2, N)  # slot 0 again
        assert backend.wait_submitted(0, timeout=MARGIN_S)
        with pytest.raises(CheckedModeViolation) as info:
            backend.complete(0)
        assert str(info.value) == ("INV-DEVICE-WAR: copy into G[0] started while the "
                                   "learner's reads of it were in flight")
        failed_with(pipe, info.value)


def test_the_same_backend_with_the_reads_finished_passes() -> None:
    """The control: the violation above is the reads in flight, not the backend."""
    backend = IgnoresRelease(hold_reads=True)
    with Pipeline(buffer(), sample_count=N, backend=backend, checked=True,
                  liveness_timeout=MARGIN_S) as pipe:
        for tick in range(4):
            pipe.start_prepare(tick, N)
            complete_copies_for(pipe, tick)
            pipe.sample_large_batch(tick, N)
            pipe.after_tick()
            backend.finish_reads(tick % 2)
        assert pipe.statistics().checks == 4 * 4


def test_a_copy_from_a_slot_that_is_not_submitted_is_an_inv_host_war_violation() -> None:
    backend = CopiesTwice()
    with Pipeline(buffer(), sample_count=N, backend=backend, checked=True,
                  liveness_timeout=MARGIN_S) as pipe:
        pipe.start_prepare(0, N)
        assert backend.wait_submitted(0, timeout=MARGIN_S)
        with pytest.raises(CheckedModeViolation) as info:
            backend.complete(0)  # complete, READY, then copied again
        assert str(info.value) == "INV-HOST-WAR: copy from H[0] started in state READY"
        failed_with(pipe, info.value)


class Seen:
    """The pipeline's side of a ``Checker``: slot states set by the test, failures
    recorded."""

    def __init__(self, *states: SlotState) -> None:
        self.states = list(states)
        self.failures: list[BaseException] = []
        self.reads_pending = [False] * len(states)
        self.slots = [torch.zeros(2, 3) for _ in states]

    def checker(self) -> Checker:
        return Checker(len(self.states), state_of=self.states.__getitem__,
                       fail=self.failures.append, device_slot=self.slots.__getitem__,
                       reads_pending=self.reads_pending.__getitem__)


def done(slot: int = 0, pack_start_ns: int = 100) -> PackDone:
    return PackDone(tick=7, slot=slot, generation=1, seed=7, sample_count=2,
                    snapshot_ptr=2, snapshot_size=2, pack_start_ns=pack_start_ns,
                    pack_end_ns=pack_start_ns + 1)


def raises(seen: Seen, message: str, call: Any, *args: Any) -> None:
    with pytest.raises(CheckedModeViolation) as info:
        call(*args)
    assert str(info.value) == message
    assert seen.failures == [info.value]  # the pipeline was failed with it first


@pytest.mark.parametrize("state", [SlotState.IDLE, SlotState.SUBMITTED, SlotState.READY,
                                   SlotState.HOT])
def test_a_pack_into_a_slot_that_is_not_requested_is_refused(state: SlotState) -> None:
    seen = Seen(state, SlotState.IDLE)
    raises(seen, f"INV-HOST-WAR: packer wrote H[0] while it was {state.name}",
           seen.checker().pack_done, done())


def test_a_pack_while_a_copy_from_the_slot_is_in_flight_is_refused() -> None:
    seen = Seen(SlotState.REQUESTED, SlotState.IDLE)
    checker = seen.checker()
    checker.copy_open[0] = True  # a copy reported complete before it finished
    raises(seen, "INV-HOST-WAR: packer wrote H[0] (tick 7) while a copy from it was in "
           "flight", checker.pack_done, done())


def test_a_pack_that_began_before_the_last_copy_from_the_slot_ended_is_refused() -> None:
    seen = Seen(SlotState.REQUESTED, SlotState.IDLE)
    checker = seen.checker()
    checker.copy_end_ns[0] = 101  # the copy ended after the pack began (at 100)
    raises(seen, "INV-HOST-WAR: packer wrote H[0] (tick 7) while a copy from it was in "
           "flight", checker.pack_done, done(pack_start_ns=100))
    ok = Seen(SlotState.REQUESTED, SlotState.IDLE)
    checker = ok.checker()
    checker.copy_end_ns[0] = 100  # ended as the pack began: no overlap
    checker.pack_done(done(pack_start_ns=100))
    assert ok.failures == [] and checker.checks == 1


@pytest.mark.parametrize("how", ["acquired", "reads_pending"])
def test_a_copy_into_a_slot_being_read_is_refused(how: str) -> None:
    seen = Seen(SlotState.SUBMITTED, SlotState.IDLE)
    checker = seen.checker()
    if how == "acquired":
        checker.acquiring(0)  # the learner reads G[0] (not released)
    else:
        seen.reads_pending[0] = True  # released, its kernels still queued
    raises(seen, "INV-DEVICE-WAR: copy into G[0] started while the learner's reads of "
           "it were in flight", checker.copy_started, 0)


@pytest.mark.parametrize("state", [SlotState.IDLE, SlotState.REQUESTED, SlotState.READY,
                                   SlotState.HOT])
def test_a_copy_from_a_slot_that_is_not_submitted_is_refused(state: SlotState) -> None:
    seen = Seen(state, SlotState.IDLE)
    raises(seen, f"INV-HOST-WAR: copy from H[0] started in state {state.name}",
           seen.checker().copy_started, 0)


@pytest.mark.parametrize("state", [SlotState.FAILED, SlotState.CLOSED])
def test_a_copy_draining_after_the_end_is_not_checked(state: SlotState) -> None:
    seen = Seen(state, SlotState.IDLE)
    checker = seen.checker()
    checker.copy_started(0)
    assert seen.failures == [] and checker.checks == 0 and checker.copy_open[0]


def test_a_refused_sample_leaves_the_backend_and_the_checker_as_they_were() -> None:
    """INV-STICKY's "an illegal call changes nothing": sampling tick 1 while tick 0
    is pending is refused, and neither the backend's read fence (before_read) nor the
    checker's record of the slot being read was set for it (helper-72)."""
    from replay_fsm import ProtocolError

    with Pipeline(buffer(), sample_count=N, backend="manual", ring_depth=3,
                  checked=True) as pipe:
        backend = pipe.backend
        assert isinstance(backend, ManualBackend) and pipe._checker is not None
        for tick in (0, 1):
            pipe.start_prepare(tick, N)
            assert backend.wait_submitted(tick, timeout=MARGIN_S)
            backend.complete(tick)
        with pytest.raises(ProtocolError):
            pipe.sample_large_batch(1, N)
        assert not backend.reads_pending(1) and not pipe._checker.reading[1]
        assert list(pipe.pending) == [(0, 0), (1, 1)] and pipe.hot is None
        pipe.sample_large_batch(0, N)  # the legal one, as before
        assert pipe._checker.reading[0] and pipe.hot == (0, 0)


class Cancelled(BaseException):
    """asyncio's CancelledError, gevent's Timeout, trio's Cancelled: a BaseException
    that is no interrupt (a KeyboardInterrupt closes the pipeline)."""


class CancelledInBeforeRead(ManualBackend):
    """The first before_read raises ``Cancelled`` before it marks the slot read."""

    def __init__(self) -> None:
        super().__init__()
        self.cut = False

    def before_read(self, slot: int) -> None:
        if not self.cut:
            self.cut = True
            raise Cancelled()
        super().before_read(slot)


def test_an_acquire_whose_hooks_were_cut_short_runs_them_when_sampled_again() -> None:
    """A BaseException inside before_read (not an interrupt, which closes the
    pipeline): 32f7b37 ran the core's acquire before the hooks, which left the slot
    HOT, and the same tick sampled again went out at once, with no fence and no
    reading mark (helper-75). The slot turns HOT only after its hooks now."""
    rb = buffer()
    backend = CancelledInBeforeRead()
    pipe = Pipeline(rb, sample_count=8, backend=backend, checked=True)
    try:
        pipe.start_prepare(0, 8)
        assert backend.wait_submitted(0, MARGIN_S)
        backend.complete(0)
        with pytest.raises(Cancelled):
            pipe.sample_large_batch(0, 8)
        pipe.sample_large_batch(0, 8)
        assert backend.reads_pending(0), "the batch went out with no read fence"
        assert pipe._checker is not None and pipe._checker.reading[0]
        pipe.after_tick()
        assert pipe.hot is None
    finally:
        pipe.close()
