"""Mutation self-check (slow tier): each protocol mutation applied to a copy of the
package must be killed by the tests named for it. One test per mutant, each with
its own timeout; one control per distinct test list runs exactly the command the
mutants of that list run, on the unmutated copy, and must pass. A kill counts only
when a test fails: a run that ends in a timeout is inconclusive and fails the
check instead (a loaded machine must not turn into a fake kill)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# name -> (file, original text, mutated text, the tests that must kill it)
MUTATIONS = {
    "copy without waiting for release": (
        "replay_fsm/core.py", "after_release=slot.last_release)", "after_release=None)",
        ["tests/test_core_table.py", "tests/test_explore.py"]),
    "acquire without waiting for ready": (
        "replay_fsm/runtime/pipeline.py",
        "            self._wait_locked(tick, None)  # raises if the tick was never requested\n",
        "            pass\n", ["tests/test_pipeline.py"]),
    "swap before ready": (
        "replay_fsm/runtime/pipeline.py",
        "            if state in AVAILABLE:\n                break",
        "            if state in AVAILABLE | {SlotState.SUBMITTED}:\n                break",
        ["tests/test_pipeline.py"]),
    "pack into the hot slot": (
        "replay_fsm/data/packer.py", "out=self.handle.host_slots[request.slot])",
        "out=self.handle.host_slots[(request.slot - 1) % len(self.handle.host_slots)])",
        ["tests/test_packer.py", "tests/test_pipeline.py"]),
    "reuse the previous tick's seed": (
        "replay_fsm/core.py", "seed=self.base_seed + tick,", "seed=self.base_seed + tick - 1,",
        ["tests/test_pipeline.py"]),
    "ignore min_snapshot_ptr": (
        "replay_fsm/data/packer.py", "if self.replay_buffer.ptr < request.min_snapshot_ptr:",
        "if False:", ["tests/test_packer.py"]),
    "off-by-one ring index": (
        "replay_fsm/core.py", "tick=tick, slot=slot.index, generation=slot.generation,",
        "tick=tick, slot=(slot.index + 1) % self.ring_depth, generation=slot.generation,",
        ["tests/test_pipeline.py"]),
    "swallow a transfer exception": (
        "replay_fsm/runtime/worker.py",
        "        except BaseException as exc:  # noqa: BLE001 - reported to the learner\n"
        "            self._fail(exc)",
        "        except BaseException:  # noqa: BLE001\n            pass",
        ["tests/test_pipeline.py"]),
    "skip the liveness check": (
        "replay_fsm/runtime/pipeline.py",
        "failure = self._watchdog.verdict(tick, slot, state, (now - started) / 1e9)",
        "failure = None", ["tests/test_liveness.py"]),
}


PER_TEST_TIMEOUT_S = 120  # inside the mutant's run; generous for a loaded machine
RUN_TIMEOUT_S = 900


def run_suite(root: Path, tests: list[str]) -> tuple[int, str]:
    """Run ``tests`` against the copy at ``root``: the fast tier, stopping at the
    first failure. Returns pytest's exit code and its output."""
    env = dict(os.environ, PYTHONPATH=str(root), HYPOTHESIS_PROFILE="fast")
    env.pop("CI", None)  # the fast tier suffices to kill; keeps the check short
    env.pop("REPLAY_FSM_SLOW", None)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
           "-o", f"timeout={PER_TEST_TIMEOUT_S}", *tests]
    out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                         timeout=RUN_TIMEOUT_S)
    return out.returncode, out.stdout + out.stderr


@pytest.fixture
def copy_root(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for part in ("replay_fsm", "tests", "specs"):
        shutil.copytree(ROOT / part, root / part,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", root)
    probe = subprocess.run([sys.executable, "-c", "import replay_fsm; print(replay_fsm.__file__)"],
                           cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(root)),
                           capture_output=True, text=True, check=True).stdout
    assert probe.startswith(str(root)), f"the copy is not the package imported: {probe}"
    return root


def test_every_mutation_still_applies() -> None:
    """Fast tier: the mutated text is still in the source, exactly once."""
    assert len(MUTATIONS) >= 8
    for name, (rel, old, _new, _tests) in MUTATIONS.items():
        assert (ROOT / rel).read_text().count(old) == 1, f"{name!r} no longer applies"


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", list(MUTATIONS))
def test_mutant_is_killed(name: str, copy_root: Path) -> None:
    rel, old, new, tests = MUTATIONS[name]
    path = copy_root / rel
    path.write_text(path.read_text().replace(old, new))
    code, output = run_suite(copy_root, tests)
    assert "Timeout" not in output, f"{name}: inconclusive, a test timed out:\n{output}"
    assert code == 1 and " failed" in output, f"{name} SURVIVED {tests}:\n{output[-3000:]}"


CONTROLS = sorted({tuple(tests) for *_, tests in MUTATIONS.values()})


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("tests", CONTROLS, ids=[" ".join(t) for t in CONTROLS])
def test_the_control_run_passes(tests: tuple[str, ...], copy_root: Path) -> None:
    """The same command the mutants of this test list run, on the unmutated copy:
    it passes, so each kill is the mutation's doing."""
    code, output = run_suite(copy_root, list(tests))
    assert code == 0, output[-3000:]
