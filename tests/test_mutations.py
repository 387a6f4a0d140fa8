"""Hand-written protocol mutants (slow tier): the changes mutmut cannot express.

mutmut (``make mutation``, specs/MUTATION.md) mutates code inside functions one
token at a time: it cannot edit the transition table (module-level data), remove
a statement, or change an expression into another one that is still plausible
(``tick - 1``, ``slot + 1``, a wider state set). Each mutant here is such a change,
applied to a copy of the package; the tests named for it, the ones that fail first when
their whole files run, must kill it. One control per distinct test list runs exactly
the command its mutants run, on the unmutated copy, and must pass. A run that ends in
a timeout is inconclusive and fails the check instead of counting as a kill
(``tests/mutant_copies.py``).

Mutants the tool does express were moved out: "copy without waiting for release"
is ``replay_fsm.core.xǁCoreǁpacked__mutmut_17`` and "skip the liveness check" is
``replay_fsm.runtime.pipeline.xǁPipelineǁ_judge_locked__mutmut_23`` (the verdict moved
there from ``_wait_locked``, mutant 30 before); both are killed in
the full run and sit in the CI sample (``tests/test_mutation_sample.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .mutant_copies import (
    RUN_TIMEOUT_S,
    Mutant,
    assert_control_passes,
    assert_killed,
    copy_package,
)

CORE_TABLE = "tests/test_core_table.py::"
DATA_EXACT = ("tests/test_pipeline.py::test_contract_inv_data_is_bit_exact",)

MUTATIONS: dict[str, Mutant] = {
    # -- the transition table (module-level data: out of mutmut's reach) --
    "acquire without its guard": Mutant(
        "replay_fsm/spec.py",
        "Actor.LEARNER,\n               guard=\"tick_is_next_to_acquire_and_no_slot_hot\"),",
        "Actor.LEARNER),", (CORE_TABLE + "test_ticks_must_be_consecutive_and_acquired_in_order",)),
    "release back to READY": Mutant(
        "replay_fsm/spec.py",
        "Transition(SlotState.HOT, Event.RELEASE, SlotState.IDLE, Actor.LEARNER),",
        "Transition(SlotState.HOT, Event.RELEASE, SlotState.READY, Actor.LEARNER),",
        (CORE_TABLE + "test_row_fires_through_core",)),
    "the transfer worker acquires": Mutant(
        "replay_fsm/spec.py",
        "Transition(SlotState.READY, Event.ACQUIRE, SlotState.HOT, Actor.LEARNER,",
        "Transition(SlotState.READY, Event.ACQUIRE, SlotState.HOT, Actor.TRANSFER,",
        (CORE_TABLE + "test_each_actor_may_take_its_own_steps",)),
    "a hot slot cannot fail": Mutant(
        "replay_fsm/spec.py",
        "*(Transition(s, Event.FAIL, SlotState.FAILED, None) for s in _LIVE),",
        "*(Transition(s, Event.FAIL, SlotState.FAILED, None) for s in _LIVE\n"
        "      if s is not SlotState.HOT),",
        (CORE_TABLE + "test_forbidden_pair_on_core_raises_and_changes_nothing",)),
    # -- expressions and statements the tool's operators do not produce --
    "acquire without waiting for ready": Mutant(
        "replay_fsm/runtime/pipeline.py",
        "            slot = self._wait_locked(tick, None)  # raises if the tick was never "
        "requested\n", "            slot = self._core.slot_of(tick)\n",
        DATA_EXACT),
    "swap before ready": Mutant(
        "replay_fsm/runtime/pipeline.py",
        "            if state in AVAILABLE:\n                break",
        "            if state in AVAILABLE | {SlotState.SUBMITTED}:\n                break",
        DATA_EXACT),
    "pack into the hot slot": Mutant(
        "replay_fsm/data/packer.py", "out, bounds = handle.host_slots[request.slot],",
        "out, bounds = handle.host_slots[(request.slot - 1) % len(handle.host_slots)],",
        ("tests/test_packer.py::test_a_steady_pack_allocates_nothing_on_either_side",)),
    "reuse the previous tick's seed": Mutant(
        "replay_fsm/core.py", "seed=self.base_seed + tick,", "seed=self.base_seed + tick - 1,",
        DATA_EXACT),
    "ignore min_snapshot_ptr": Mutant(
        "replay_fsm/data/packer.py", "if self.replay_buffer.ptr < request.min_snapshot_ptr:",
        "if False:",
        ("tests/test_packer.py::test_min_snapshot_ptr_keeps_the_request_pending",)),
    "off-by-one ring index": Mutant(
        "replay_fsm/core.py", "tick=tick, slot=slot.index, generation=slot.generation,",
        "tick=tick, slot=(slot.index + 1) % self.ring_depth, generation=slot.generation,",
        DATA_EXACT),
    "swallow a transfer exception": Mutant(
        "replay_fsm/runtime/worker.py",
        "        except BaseException as exc:  # noqa: BLE001 - reported to the learner\n"
        "            self._fail(exc)",
        "        except BaseException:  # noqa: BLE001\n            pass",
        ("tests/test_pipeline.py::test_transfer_exception_fails_the_pipeline_chained",)),
}


def test_every_mutation_still_applies() -> None:
    """Fast tier: the mutated text is still in the source, exactly once."""
    assert len(MUTATIONS) >= 8
    for name, mutant in MUTATIONS.items():
        assert mutant.occurrences() == 1, f"{name!r} no longer applies"


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", list(MUTATIONS))
def test_mutant_is_killed(name: str, tmp_path: Path) -> None:
    assert_killed(name, MUTATIONS[name], copy_package(tmp_path))


CONTROLS = sorted({m.tests for m in MUTATIONS.values()})


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("tests", CONTROLS, ids=[" ".join(t) for t in CONTROLS])
def test_the_control_run_passes(tests: tuple[str, ...], tmp_path: Path) -> None:
    """The same command the mutants of this test list run, on the unmutated copy:
    it passes, so each kill is the mutation's doing."""
    assert_control_passes(tests, copy_package(tmp_path))
