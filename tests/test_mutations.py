"""Mutation self-check (slow tier): each protocol mutation applied to a copy of the
package must be killed by the suite. The kill table is printed (pytest -s)."""

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
        "if self._core.state(slot) in (SlotState.READY, SlotState.HOT):\n                break",
        "if self._core.state(slot) in (SlotState.READY, SlotState.HOT, "
        "SlotState.SUBMITTED):\n                break", ["tests/test_pipeline.py"]),
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
        "replay_fsm/runtime/pipeline.py",
        "        except BaseException as exc:  # noqa: BLE001 - reported to the learner\n"
        "            self._fail(exc, Actor.TRANSFER)",
        "        except BaseException:  # noqa: BLE001\n            pass",
        ["tests/test_pipeline.py"]),
    "skip the liveness check": (
        "replay_fsm/runtime/pipeline.py", "    def _check_liveness(self, tick: int) -> None:\n",
        "    def _check_liveness(self, tick: int) -> None:\n        return\n",
        ["tests/test_pipeline.py"]),
}


def run_suite(root: Path, tests: list[str]) -> int:
    env = dict(os.environ, PYTHONPATH=str(root), HYPOTHESIS_PROFILE="fast")
    env.pop("CI", None)  # the fast tier suffices to kill; keeps the check short
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
           "-o", "timeout=20", *tests]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, timeout=900).returncode


def make_copy(tmp: Path) -> Path:
    root = tmp / "repo"
    for part in ("replay_fsm", "tests", "specs"):
        shutil.copytree(ROOT / part, root / part,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", root)
    return root


@pytest.mark.slow
def test_every_mutant_is_killed(tmp_path: Path) -> None:
    assert len(MUTATIONS) >= 8
    root = make_copy(tmp_path)
    probe = subprocess.run([sys.executable, "-c", "import replay_fsm; print(replay_fsm.__file__)"],
                           cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(root)),
                           capture_output=True, text=True, check=True).stdout
    assert probe.startswith(str(root)), f"the copy is not the package imported: {probe}"
    rows = []
    for name, (rel, old, new, tests) in MUTATIONS.items():
        path = root / rel
        source = path.read_text()
        assert source.count(old) == 1, f"mutation {name!r} no longer applies to {rel}"
        path.write_text(source.replace(old, new))
        try:
            code = run_suite(root, tests)
        finally:
            path.write_text(source)
        rows.append((name, "killed" if code != 0 else "SURVIVED", " ".join(tests)))
    width = max(len(r[0]) for r in rows)
    print("\nmutation kill table")
    for name, verdict, tests in rows:
        print(f"  {name.ljust(width)}  {verdict:8}  {tests}")
    survivors = [r[0] for r in rows if r[1] != "killed"]
    assert not survivors, f"mutants survived: {survivors}"


@pytest.mark.slow
def test_the_unmutated_copy_passes(tmp_path: Path) -> None:
    """The control: the same runs on the unmutated copy pass, so kills are real."""
    root = make_copy(tmp_path)
    tests = sorted({t for *_, ts in MUTATIONS.values() for t in ts})
    assert run_suite(root, tests) == 0
