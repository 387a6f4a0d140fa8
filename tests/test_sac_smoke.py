"""A short SAC run on MuJoCo through the CLI, both samplings (slow tier)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest


@pytest.mark.slow
def test_replay_fsm_sac_on_halfcheetah_writes_results_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("mujoco")
    from replay_fsm.cli import main

    # 128 warm-up + 440 ticks x 2 vector steps: both envs finish a 1000-step episode.
    code = main(["sac", "--env", "HalfCheetah-v5", "--num-envs", "2", "--batch-size", "64",
                 "--updates-per-tick", "2", "--env-steps-per-tick", "2", "--ticks", "440",
                 "--warmup-steps", "256", "--hidden", "64", "--capacity", "4096",
                 "--sampling", "both", "--out", str(tmp_path), "--no-progress"])
    assert code == 0
    result = json.loads((tmp_path / "sac.json").read_text())
    assert result["bit_identical"] and result["speedup_vs_sync"] > 0
    pipe = result["runs"]["pipeline"]
    assert pipe["updates"] == 880 and pipe["pipeline"]["packs"] >= 440
    returns = [e["return"] for e in pipe["episodes"]]
    assert len(returns) == 2 and all(math.isfinite(r) for r in returns)
    assert [e["env_steps"] for e in pipe["episodes"]] == [2000, 2000]
    assert (tmp_path / "sac.png").stat().st_size > 10_000
