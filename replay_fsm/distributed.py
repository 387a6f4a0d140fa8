"""One pipeline per rank under torch.distributed.

The pattern: every rank owns its replay buffer, its collector(s) and its
pipeline on its own device, and draws different but reproducible batches:

    base_seed_of_rank = base_seed + rank * RANK_SEED_STRIDE      (rank_seed)

with RANK_SEED_STRIDE = 2**24, so tick t of rank r samples with seed
``base_seed + r * 2**24 + t``. torch's CPU generator keeps only the low 32 bits of a
seed, so the stride must stay below 2**32: with 2**24, up to 256 ranks draw from
distinct seeds for their first 16,777,216 ticks each (a test checks that two ranks
draw different batches). Each rank's batches follow INV-DATA with its own base seed.
The device comes from the local rank (``local_device``). Gradients
are averaged across ranks with ``all_reduce``. On one node, ``launch`` starts the
ranks with torch's own elastic launcher (what ``torchrun`` uses); on several nodes run
``torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HOST:PORT
-m replay_fsm.distributed --ticks ...`` on each node, a collector per rank (or per
node, feeding its ranks through ``collector="external"`` handles).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import uuid
from pathlib import Path
from typing import Any

import torch

from .demo.config import DemoConfig

RANK_SEED_STRIDE = 1 << 24


def rank_seed(base_seed: int, rank: int) -> int:
    """The base seed of ``rank``'s pipeline (documented formula above)."""
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    return int(base_seed) + int(rank) * RANK_SEED_STRIDE


def local_device(local_rank: int, device: str = "auto") -> torch.device:
    """``cuda:<local_rank>`` when CUDA is there (or asked for), else ``device``/cpu."""
    if device in ("auto", "cuda"):
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        if device == "cuda":
            raise ValueError("device 'cuda' requested but CUDA is not available")
        return torch.device("cpu")
    return torch.device(device)


def _all_reduce_mean(tensors: list[torch.Tensor]) -> None:
    import torch.distributed as dist
    world = dist.get_world_size()
    for t in tensors:
        dist.all_reduce(t)
        t.div_(world)


def rank_main(config: DemoConfig, kill_rank: int | None = None) -> dict[str, Any]:
    """The body of one rank: ``config`` as this rank (its seeds and device), its
    collector, its pipeline, all-reduced gradients. ``config.kill_collector_at``
    applies only to ``kill_rank`` (fault injection for tests)."""
    import torch.distributed as dist

    from .demo import run
    from .errors import ReplayFSMError
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = local_device(local_rank, config.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    mine = config.for_rank(rank, rank_seed(config.seed, rank), str(device))
    if rank != kill_rank:
        mine = dataclasses.replace(mine, kill_collector_at=None)
    out = Path(mine.out)
    try:
        summary = run(mine, all_reduce=_all_reduce_mean)
    except ReplayFSMError as exc:
        (out / f"summary-rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "error": f"{type(exc).__name__}: {exc}"}, indent=2) + "\n")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return summary


def merge_traces(out: Path, nproc: int) -> Path:
    """One Perfetto trace with a process track per rank."""
    events: list[dict[str, Any]] = []
    for rank in range(nproc):
        path = out / f"trace-rank{rank}.json"
        if path.exists():
            events += json.loads(path.read_text())["traceEvents"]
    merged = out / "trace.json"
    merged.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return merged


def launch(nproc: int, config: DemoConfig, *, kill_rank: int | None = None
           ) -> dict[int, Any]:
    """Start ``nproc`` ranks of the demo ``config`` on this node with torch's elastic
    launcher; returns each rank's summary. If one rank fails, the launcher stops the
    others and raises."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    launch_config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                          run_id=f"replay_fsm-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",
                          max_restarts=0, monitor_interval=0.1, start_method="spawn",
                          # the launcher's per-rank logs: by default a new folder in
                          # the system's temp folder at every launch, never removed
                          logs_specs=DefaultLogsSpecs(log_dir=str(out / "launcher-logs")))
    try:
        results = elastic_launch(launch_config, rank_main)(config, kill_rank)
    finally:
        merge_traces(out, nproc)
    return dict(results)


def main(argv: list[str] | None = None) -> int:
    """``torchrun ... -m replay_fsm.distributed``: one rank of a multi-node run."""
    ap = argparse.ArgumentParser(prog="python -m replay_fsm.distributed")
    ap.add_argument("--ticks", type=int, default=100)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default="demo-out")
    ap.add_argument("--sample-count", type=int, default=2048)
    args = ap.parse_args(argv)
    rank_main(DemoConfig(ticks=args.ticks, device=args.device, out=args.out,
                         sample_count=args.sample_count, capacity=50_000, envs=64))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
