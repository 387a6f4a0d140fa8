"""Refinement between the SPIN model and the real Core (replay_fsm.verify.refinement):
equal projected state sets, the same answer to every learner step offered in every
state, figures recorded in specs/INVARIANTS.md; broken cores are caught."""

from __future__ import annotations

import functools

import pytest

from replay_fsm.core import Core
from replay_fsm.spec import SlotState
from replay_fsm.verify.explore import explore
from replay_fsm.verify.refinement import (
    CoreStates,
    Projection,
    Report,
    compare,
    core_states,
    model_states,
)
from replay_fsm.wire import PackRequest

# needs_spin skips without spin, and test_spin.py fails to import where CI requires it.
from .test_spin import needs_spin

# (depth, ticks, faults) -> (projected states, pan states stored, core worlds,
# steps offered). Recorded from this model and this core; specs/INVARIANTS.md has
# the same table.
RECORDED = {
    (2, 5, False): (75, 4080, 317, 1937),
    (2, 5, True): (146, 31379, 1366, 8313),
    (3, 7, False): (289, 57673, 2785, 20259),
    (3, 7, True): (420, 506641, 12185, 88067),
}


@functools.cache
def real_core(depth: int, ticks: int, faults: bool) -> CoreStates:
    return core_states(depth, ticks, faults=faults)


def refinement(depth: int, ticks: int, faults: bool, backend: str | None = None) -> Report:
    defines = [*([backend] if backend else []), *(["FAULTS"] if faults else [])]
    model = model_states(depth, ticks, defines=defines)
    return compare(model, real_core(depth, ticks, faults), depth=depth, ticks=ticks,
                   faults=faults, backend=backend)


@needs_spin
@pytest.mark.parametrize("depth,ticks,faults", [
    (2, 5, False), (2, 5, True), (3, 7, False),
    pytest.param(3, 7, True, marks=pytest.mark.deep)])
def test_the_model_and_the_core_reach_the_same_states_and_agree_on_every_step(
        depth: int, ticks: int, faults: bool) -> None:
    report = refinement(depth, ticks, faults)
    assert report.ok and report.equal, report.summary()
    recorded = (len(report.model.states), report.model.stored, report.core.worlds,
                report.core.steps_offered)
    assert recorded == RECORDED[(depth, ticks, faults)], report.summary()


@pytest.mark.parametrize("faults", [False, True])
def test_the_core_side_is_the_explorers_search(faults: bool) -> None:
    """Without the closing steps the model adds, the search reaches exactly the
    worlds replay_fsm.verify.explore counts."""
    assert real_core(2, 5, faults).explored_worlds == explore(2, 5, faults=faults).states


def two_submitted(p: Projection) -> bool:
    return p.states.count(SlotState.SUBMITTED) == 2


@needs_spin
@pytest.mark.parametrize("faults", [False, True])
@pytest.mark.parametrize("backend", ["CUDA", "ZEROCOPY", "MPS"])
def test_each_backend_model_reaches_only_states_of_the_core(backend: str,
                                                            faults: bool) -> None:
    """The backends allow fewer interleavings: a transfer thread that blocks in
    submit (CUDA, and the CPU's synchronous on_complete) never has two slots
    SUBMITTED; MPS, whose transfer thread only defers orders, reaches them all."""
    report = refinement(2, 5, faults, backend)
    assert report.ok and not report.only_in_model, report.summary()
    if backend == "MPS":
        assert report.equal, report.summary()
    else:
        assert report.only_in_core and all(map(two_submitted, report.only_in_core))
        assert not any(map(two_submitted, report.model.states))


class AcquiresWhileHot(Core):
    """Test-only: acquire skips the "no slot hot" check (it releases the hot batch
    itself), as if INV-HOT's guard were missing."""

    def acquire(self, tick: int) -> int:
        if self.hot_slot is not None and self.pending and self.pending[0][0] == tick:
            self.release()
        return super().acquire(tick)


class FillsSkippedTicks(Core):
    """Test-only: a request that skips a tick requests the skipped one first."""

    def request(self, tick: int, min_snapshot_ptr: int | None = None) -> PackRequest:
        if self.next_tick is not None and tick == self.next_tick + 1:
            super().request(self.next_tick, min_snapshot_ptr)
        return super().request(tick, min_snapshot_ptr)


@needs_spin
@pytest.mark.parametrize("broken,expected", [
    (AcquiresWhileHot, "acquire(1) is accepted by the core, refused by the model"),
    (FillsSkippedTicks, "request(2) is accepted by the core, refused by the model"),
])
def test_a_broken_core_fails_the_check(broken: type[Core], expected: str) -> None:
    model = model_states(2, 5)
    report = compare(model, core_states(2, 5, core_factory=broken), depth=2, ticks=5,
                     faults=False, backend=None)
    assert not report.ok
    assert any(expected in m for m in report.mismatches), report.summary()
