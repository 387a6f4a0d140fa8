"""Keep the benchmark scripts alive: one quick smoke run, no timing assertion."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(900)  # every benchmark once, on a machine that may be busy
def test_bench_quick_runs_and_writes_results() -> None:
    out = subprocess.run([sys.executable, "benchmarks/run_all.py", "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    for name in ("core_overhead", "packing", "learner_overhead", "learner_loop",
                 "interference", "cost_model", "checkpoint"):
        data = json.loads((ROOT / "benchmarks/results" / f"{name}-quick.json").read_text())
        assert data["quick"] and data["figures"] and data["machine"]["torch"]
    assert "synchronous sampling" in out.stdout
    loop = json.loads((ROOT / "benchmarks/results/learner_loop-quick.json").read_text())
    for regime in ("compute-bound", "balanced", "data-bound"):
        columns = loop["figures"][regime]["columns"]
        assert set(columns) == {"load0", "load1"}
        assert "bare double buffer (floor)" in columns["load0"]  # the co-run floor
    assert loop["figures"]["verdicts"]  # the budget's claims are checked, pass or not


def test_readme_performance_section_is_generated_from_the_json() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import readme_perf
    finally:
        sys.path.pop(0)
    readme = (ROOT / "README.md").read_text()
    assert readme_perf.section() in readme
    assert readme_perf.checkpoint_section() in readme
