"""Apply a mutant to a copy of the package and run the tests that must kill it.

Shared by the hand-written protocol mutants (``tests/test_mutations.py``) and the CI
sample of mutmut's mutants (``tests/test_mutation_sample.py``). A mutant is a
source edit: the original text, which must occur exactly once in its file, and
its replacement. A kill counts only when a test fails: a run that times out is
inconclusive (a loaded machine must not turn into a fake kill), and so is a run
that collects nothing or errors before a test ran.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from .mutation_timeout import TIMEOUT_EXIT_CODE
from .tiers import TIER_VARIABLES

ROOT = Path(__file__).resolve().parent.parent

PER_TEST_TIMEOUT_S = 120  # inside the mutant's run; generous for a loaded machine
RUN_TIMEOUT_S = 900


@dataclass(frozen=True)
class Mutant:
    """One source edit of ``file`` (relative to the checkout) and the tests that kill it."""

    file: str
    old: str
    new: str
    tests: tuple[str, ...]

    def occurrences(self, root: Path = ROOT) -> int:
        return (root / self.file).read_text().count(self.old)

    def apply(self, root: Path) -> None:
        path = root / self.file
        text = path.read_text()
        assert text.count(self.old) == 1, f"{self.file}: the mutated text is not there once"
        path.write_text(text.replace(self.old, self.new))


def copy_package(tmp_path: Path) -> Path:
    """A copy of the package, its tests and specs under ``tmp_path``; checks that a
    process started with ``run_suite``'s environment imports the copy."""
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


def run_suite(root: Path, tests: list[str] | tuple[str, ...]) -> tuple[int, str]:
    """Run ``tests`` against the copy at ``root``: the fast tier, stopping at the
    first failure; a test past ``PER_TEST_TIMEOUT_S`` ends the run with
    ``TIMEOUT_EXIT_CODE``. Returns pytest's exit code and its output."""
    env = dict(os.environ, PYTHONPATH=str(root), HYPOTHESIS_PROFILE="mutation")
    for var in TIER_VARIABLES:  # the fast tier suffices to kill; keeps the check short
        env.pop(var, None)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
           "-p", "tests.mutation_timeout", "-o", f"timeout={PER_TEST_TIMEOUT_S}", *tests]
    try:
        out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                             timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        return TIMEOUT_EXIT_CODE, f"the run took over {RUN_TIMEOUT_S} s: {exc}"
    return out.returncode, out.stdout + out.stderr


def assert_killed(name: str, mutant: Mutant, root: Path) -> None:
    """Apply ``mutant`` at ``root`` and require one of its tests to fail."""
    mutant.apply(root)
    code, output = run_suite(root, mutant.tests)
    if code == TIMEOUT_EXIT_CODE:
        pytest.fail(f"{name}: inconclusive, a test timed out:\n{output[-3000:]}")
    assert code == 1 and " failed" in output, (
        f"{name} SURVIVED {list(mutant.tests)} (exit code {code}):\n{output[-3000:]}")


def assert_control_passes(tests: tuple[str, ...], root: Path) -> None:
    """The command the mutants of ``tests`` run, on the unmutated copy, passes: each
    kill is then the mutation's doing."""
    code, output = run_suite(root, tests)
    assert code == 0, output[-3000:]
