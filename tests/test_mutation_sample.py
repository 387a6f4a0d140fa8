"""CI's bounded mutation check (slow tier): a fixed sample of mutmut's mutants, one or
two per mutated module, each applied to a copy of the package as a source edit and
killed by the tests named for it.

The full run is ``make mutation`` (hours; specs/MUTATION.md). This sample keeps CI
from losing the kills that matter most without running it: a test removed or
weakened so that its mutant lives fails here. Each entry is keyed by the mutant's
mutmut name (``mutmut show NAME`` prints the same change); the edit is written out
here so that CI needs no mutmut. ``replay_fsm.core.x__guard__mutmut_1`` is one that
mutmut's own run cannot judge (the code runs at import): this is where it is checked.
A run that times out is inconclusive and fails the check (``tests/mutant_copies.py``).
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

SAMPLE: dict[str, Mutant] = {
    # core: a copy that does not wait for the release of the slot's last HOT period
    # (INV-DEVICE-WAR), and the guard registry filled with None at import.
    "replay_fsm.core.xǁCoreǁpacked__mutmut_17": Mutant(
        "replay_fsm/core.py", "after_release=slot.last_release)", "after_release=None)",
        ("tests/test_core_table.py::test_copy_order_names_the_previous_release",)),
    "replay_fsm.core.x__guard__mutmut_1": Mutant(
        "replay_fsm/core.py", "GUARDS[name] = fn", "GUARDS[name] = None",
        ("tests/test_core_table.py::"
         "test_every_guard_name_of_the_table_resolves_to_one_core_predicate",)),
    # pipeline: the watchdog's verdict ignored (INV-LIVE); ticks() prefetching past stop.
    "replay_fsm.runtime.pipeline.xǁPipelineǁ_judge_locked__mutmut_23": Mutant(
        "replay_fsm/runtime/pipeline.py",
        "failure = self._watchdog.verdict(tick, slot, state, waited_s, owed, now)",
        "failure = None",
        ("tests/test_liveness.py::test_a_copy_that_never_completes_raises_transfer_failed",)),
    "replay_fsm.runtime.pipeline.xǁPipelineǁticks__mutmut_17": Mutant(
        "replay_fsm/runtime/pipeline.py",
        "for ahead in range(tick, min(tick + self.ring_depth - 1, stop - 1) + 1):",
        "for ahead in range(tick, min(tick + self.ring_depth - 1, stop + 1) + 1):",
        ("tests/test_pipeline.py::"
         "test_ticks_requests_nothing_past_stop_and_passes_min_snapshot_ptr",)),
    # sampling: an empty batch instead of an error for sample_count 0.
    "replay_fsm.data.sampling.x_sample_indices__mutmut_10": Mutant(
        "replay_fsm/data/sampling.py", "if sample_count <= 0:", "if sample_count < 0:",
        ("tests/test_packer.py::test_sample_count_must_be_positive",)),
    # packer: a zombie learner taken for a live one.
    "replay_fsm.data.packer.x_process_alive__mutmut_20": Mutant(
        "replay_fsm/data/packer.py",
        'return f.read().rsplit(")", 1)[1].split()[0] != "Z"',
        'return f.read().rsplit(")", 1)[1].split()[0] != "z"',
        ("tests/test_packer.py::"
         "test_process_alive_tells_running_exited_and_zombie_processes_apart",)),
    # wire: a ready dict whose host slot is not its device slot taken for a good one.
    "replay_fsm.wire.xǁSeedReadyǁfrom_dict__mutmut_25": Mutant(
        "replay_fsm/wire.py", "if ready.shared_slot != ready.target_gpu_slot:",
        "if ready.shared_slot == ready.target_gpu_slot:",
        ("tests/test_compat_wire.py::"
         "test_a_ready_dict_whose_slots_differ_raises_the_seeds_runtime_error",)),
    # compat: the seed's collector taken for dead while it runs, for alive once it exits.
    "replay_fsm.compat.link.xǁSlotHoldersǁdead__mutmut_1": Mutant(
        "replay_fsm/compat/link.py", "if not proc.is_alive():", "if proc.is_alive():",
        ("tests/test_compat_link.py::"
         "test_the_collector_that_exits_is_reported_with_its_name_pid_and_code",)),
    # checkpoint: a file that ends early taken for a full read.
    "replay_fsm.data.checkpoint.x__readinto_all__mutmut_4": Mutant(
        "replay_fsm/data/checkpoint.py", "            return False\n",
        "            return True\n",
        ("tests/test_checkpoint.py::"
         "test_a_file_that_shrinks_while_it_is_read_is_reported_truncated",)),
}


def test_every_sampled_mutant_still_applies() -> None:
    """Fast tier: each sampled edit is still in the source, exactly once."""
    assert 8 <= len(SAMPLE) <= 12 and DEEP <= SAMPLE.keys()
    for name, mutant in SAMPLE.items():
        assert mutant.occurrences() == 1, f"{name} no longer applies; pick its successor"


# Killed only once its test's liveness bound runs out (about 30 s of CI's time): the
# deep tier's, with make verify.
DEEP = {"replay_fsm.runtime.pipeline.xǁPipelineǁ_judge_locked__mutmut_23"}


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.deep)
                                  if name in DEEP else name for name in SAMPLE])
def test_sampled_mutant_is_killed(name: str, tmp_path: Path) -> None:
    assert_killed(name, SAMPLE[name], copy_package(tmp_path))


CONTROLS = sorted({m.tests for m in SAMPLE.values()})


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_the_sampled_tests_pass_unmutated(tmp_path: Path) -> None:
    """Every test the sample names, in one run on the unmutated copy: each kill above
    is then the mutation's doing."""
    assert_control_passes(tuple(t for tests in CONTROLS for t in tests),
                          copy_package(tmp_path))
