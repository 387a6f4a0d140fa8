"""One pipeline per rank under torch.distributed (gloo on CPU)."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import pytest
import torch

from replay_fsm.demo import DemoConfig
from replay_fsm.distributed import RANK_SEED_STRIDE, launch, local_device, rank_seed


def test_rank_seed_formula_and_device_choice() -> None:
    assert rank_seed(7, 0) == 7 and rank_seed(7, 3) == 7 + 3 * RANK_SEED_STRIDE
    with pytest.raises(ValueError):
        rank_seed(0, -1)
    if not torch.cuda.is_available():
        assert local_device(1) == torch.device("cpu")
        with pytest.raises(ValueError, match="CUDA"):
            local_device(0, "cuda")


def options(out: Path, **extra: object) -> DemoConfig:
    return DemoConfig(**{"ticks": 8, "device": "cpu", "out": str(out), "sample_count": 256,
                         "capacity": 20_000, "envs": 32, "collect_steps": 40,
                         "verify_data": True, "seed": 5, **extra})  # type: ignore[arg-type]


@pytest.mark.slow
def test_two_ranks_draw_different_reproducible_batches(tmp_path: Path) -> None:
    temp = Path(tempfile.gettempdir())
    before = set(temp.glob("torchelastic_*"))
    results = launch(2, options(tmp_path))
    # the launcher's logs are the run's, not new folders left in the temp folder
    assert (tmp_path / "launcher-logs").is_dir()
    assert set(temp.glob("torchelastic_*")) <= before
    s0, s1 = results[0], results[1]
    assert (s0["rank"], s1["rank"]) == (0, 1)
    assert s0["base_seed"] == rank_seed(5, 0) and s1["base_seed"] == rank_seed(5, 1)
    # every batch of each rank checked bit for bit against its own seed (INV-DATA)
    assert s0["data_verified_ticks"] == s1["data_verified_ticks"] == 8
    assert s0["batch_fingerprint"] != s1["batch_fingerprint"]
    for rank in (0, 1):
        saved = json.loads((tmp_path / f"summary-rank{rank}.json").read_text())
        assert saved["rank"] == rank
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    names = {e["args"]["name"] for e in trace if e["name"] == "process_name"}
    assert {"rank 0 slots", "rank 1 slots", "rank 0 actors", "rank 1 actors"} <= names
    assert len({e["pid"] for e in trace}) == 4


@pytest.mark.slow
def test_a_rank_whose_collector_dies_ends_the_job(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(Exception) as info:
        launch(2, options(tmp_path, ticks=40, kill_collector_at=3, verify_data=False),
               kill_rank=1)
    assert "ChildFailedError" in type(info.value).__name__
    assert time.monotonic() - t0 < 120  # the other rank did not hang
    failed = json.loads((tmp_path / "summary-rank1.json").read_text())
    assert failed["rank"] == 1 and failed["error"].startswith("CollectorDied")
