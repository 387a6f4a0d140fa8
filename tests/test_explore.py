"""Exhaustive exploration of the real core: zero violations, recorded state counts
(a change that shrinks the state space is noticed), deadlock freedom, and a
broken core caught with its shortest counterexample."""

from __future__ import annotations

import pytest

from replay_fsm.cli import main
from replay_fsm.core import Core
from replay_fsm.verify.explore import explore
from replay_fsm.wire import CopyOrder, PackDone

# (depth, ticks, faults) -> (states, transitions); ticks wrap the ring twice.
# Recorded from this implementation; see specs/INVARIANTS.md for SPIN's counts.
RECORDED = {
    (2, 5, False): (313, 697),
    (2, 5, True): (1015, 1801),
    (3, 7, False): (2777, 9134),
}


@pytest.mark.parametrize("depth,ticks,faults", [
    (2, 5, False), (2, 5, True), pytest.param(3, 7, False, marks=pytest.mark.slow)])
def test_every_interleaving_keeps_every_invariant(depth: int, ticks: int,
                                                  faults: bool) -> None:
    result = explore(depth, ticks, faults=faults)
    assert result.violation is None, result.summary()
    assert result.stuck == 0, "a state cannot reach completion (deadlock)"
    assert result.complete_states > 0
    assert (result.states, result.transitions) == RECORDED[(depth, ticks, faults)]


class SkipsReleaseDependency(Core):
    """Test-only: the seed's missing fence."""

    def packed(self, done: PackDone) -> CopyOrder:
        order = super().packed(done)
        return CopyOrder(order.tick, order.slot, order.generation, after_release=None)


def test_a_core_without_the_release_dependency_is_caught() -> None:
    result = explore(2, 4, core_factory=SkipsReleaseDependency)
    assert result.violation is not None and "INV-DEVICE-WAR" in result.violation
    steps = result.steps()
    assert steps[-1] == "copy_engine: copy_start(slot 0)"
    assert "learner: release(slot 0)" in steps and len(steps) == 12  # shortest: BFS
    # The emitted regression test passes on the real core and fails on the broken one.
    source = result.regression_test()
    namespace: dict[str, object] = {}
    exec(compile(source, "<explored>", "exec"), namespace)
    namespace["test_explored_counterexample"]()  # type: ignore[operator]
    import replay_fsm.core
    real = replay_fsm.core.Core
    replay_fsm.core.Core = SkipsReleaseDependency  # type: ignore[misc]
    try:
        with pytest.raises(AssertionError, match="INV-DEVICE-WAR"):
            namespace["test_explored_counterexample"]()  # type: ignore[operator]
    finally:
        replay_fsm.core.Core = real  # type: ignore[misc]


def test_cli_explore(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explore", "--depth", "2", "--ticks", "3"]) == 0
    out, err = capsys.readouterr()
    assert "no violation" in out
    assert err == ""  # fewer states than one step of the count: no bar at all


def test_explore_reports_its_progress_every_thousand_states() -> None:
    seen: list[int] = []
    result = explore(3, 6, progress=seen.append)
    assert result.ok and result.states > 2000
    assert seen == list(range(1000, result.states, 1000))


@pytest.mark.parametrize("flag", [[], ["--no-progress"]])
def test_cli_explore_counts_the_states_on_stderr_unless_told_not_to(
        capsys: pytest.CaptureFixture[str], flag: list[str]) -> None:
    assert main(["explore", "--depth", "3", "--ticks", "6", *flag]) == 0
    out, err = capsys.readouterr()
    assert "no violation" in out and "explored" not in out
    assert ("explored: " in err and " states" in err) is not bool(flag), err
    assert "explored: 0 states" not in err  # the first count shown is the first call's


def test_explore_refuses_to_run_without_asserts() -> None:
    """Its invariants are assert statements: under python -O it reported "no
    violation" for a core without the release dependency."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-O", "-m", "replay_fsm", "explore",
                           "--no-progress"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done
    assert "python -O" in done.stderr and "Traceback" not in done.stderr, done.stderr


class RowlessFail(Core):
    """Test-only: a table without READY's fail row, as the machine then answers."""

    def fail(self, error: BaseException, actor: object = None) -> None:
        from transitions import MachineError

        from replay_fsm.spec import SlotState
        if SlotState.READY in self.states:
            raise MachineError("Can't trigger event fail from state READY!")
        super().fail(error, actor)  # type: ignore[arg-type]


def test_a_step_the_table_has_no_row_for_is_a_violation_with_its_path() -> None:
    """fail and close fire on every slot without asking the table first: a missing row
    raised transitions' MachineError out of explore (the command's one-line error,
    no counterexample)."""
    result = explore(2, 3, faults=True, core_factory=RowlessFail)
    assert result.violation is not None and result.violation.startswith("MachineError")
    assert result.steps()[-1] == "any: fail()"
    compile(result.regression_test(), "<explored>", "exec")  # its quotes escaped
