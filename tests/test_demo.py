"""The demo trainer end to end (what `make demo` runs), kept small."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from replay_fsm.conformance import check, load
from replay_fsm.demo import format_summary, run


@pytest.mark.parametrize("collector", [
    "thread", pytest.param("process", marks=pytest.mark.slow)])
def test_demo_trains_and_writes_its_files(collector: str, tmp_path: Path) -> None:
    summary = run(ticks=25, collector=collector, out=tmp_path, checked=True,
                  sample_count=512, capacity=20_000, envs=64, progress=False)
    assert summary["ticks"] == 25 and summary["trace_conforms"]
    assert summary["checked_mode_checks"] > 0 and summary["bytes_moved"] > 0
    for name in ("trace.json", "transitions.jsonl", "slot.mmd", "summary.json"):
        assert (tmp_path / name).exists(), name
    assert json.loads((tmp_path / "summary.json").read_text())["ticks"] == 25
    assert check(load(tmp_path / "transitions.jsonl")).ok
    assert "speed-up over synchronous" in format_summary(summary, tmp_path)
