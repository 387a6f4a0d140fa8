"""The demo trainer end to end (what `make demo` runs), kept small."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from replay_fsm.demo import DemoConfig, format_summary, run
from replay_fsm.verify.conformance import check, load


@pytest.mark.parametrize("collector", [
    "thread", pytest.param("process", marks=pytest.mark.slow)])
def test_demo_trains_and_writes_its_files(collector: str, tmp_path: Path) -> None:
    summary = run(DemoConfig(ticks=25, collector=collector, out=tmp_path, checked=True,
                             sample_count=512, capacity=20_000, envs=64, progress=False))
    assert summary["ticks"] == 25 and summary["trace_conforms"]
    assert summary["checked_mode_checks"] > 0 and summary["bytes_moved"] > 0
    for name in ("trace.json", "transitions.jsonl", "slot.mmd", "summary.json"):
        assert (tmp_path / name).exists(), name
    assert json.loads((tmp_path / "summary.json").read_text())["ticks"] == 25
    assert check(load(tmp_path / "transitions.jsonl")).ok
    assert "speed-up over synchronous" in format_summary(summary, tmp_path)


def test_ctrl_c_stops_cleanly_and_still_writes_the_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from replay_fsm.demo import Learner

    real_step = Learner.step
    calls = {"n": 0}

    def step(self: Learner, batch: dict, all_reduce: object = None) -> float:
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt  # what Ctrl-C raises in the learner's thread
        return real_step(self, batch, all_reduce)  # type: ignore[arg-type]

    monkeypatch.setattr(Learner, "step", step)
    summary = run(DemoConfig(ticks=50, collector="thread", out=tmp_path, sample_count=256,
                             capacity=10_000, envs=32, progress=False))
    assert summary["interrupted"] and summary["ticks"] == 5
    assert summary["trace_conforms"]
    for name in ("trace.json", "transitions.jsonl", "summary.json"):
        assert (tmp_path / name).exists(), name
