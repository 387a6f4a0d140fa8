"""Process bodies for spawn-based tests (importable by the child interpreter)."""

from __future__ import annotations

import torch

from replay_fsm.data.buffer import ReplayBuffer
from replay_fsm.data.packer import Packer, PackerHandle


def constant_rows(rb: ReplayBuffer, first_id: int, n: int) -> torch.Tensor:
    ids = torch.arange(first_id, first_id + n, dtype=torch.float32)
    return ids[:, None].expand(n, rb.width).contiguous()


def write_ids(rb: ReplayBuffer, batches: int, batch: int, first_id: int = 1) -> None:
    """Writer: every column of a row carries the row's id."""
    for k in range(batches):
        rb.add_packed(constant_rows(rb, first_id + k * batch, batch))


def serve(handle: PackerHandle, rb: ReplayBuffer, count: int) -> None:
    """A collector that attaches a packer and serves ``count`` batches."""
    packer = Packer.attach(handle, rb)
    served = 0
    while served < count and not packer.closed:
        served += packer.service(timeout=0.05)


def fill_and_serve(handle: PackerHandle, rb: ReplayBuffer, rows: int) -> None:
    """A collector that adds data itself, then serves until closed."""
    write_ids(rb, 1, rows)
    packer = Packer.attach(handle, rb)
    while not packer.closed:
        packer.service(timeout=0.05)


def seed_style_collector(rb: ReplayBuffer, requests, ready, slots) -> None:  # type: ignore[no-untyped-def]
    """A collector loop written for the seed: dict requests in, dict readies out."""
    while (req := requests.get()) is not None:
        size = rb.size
        gen = torch.Generator().manual_seed(int(req["sample_seed"]))
        idx = torch.randint(0, size, (int(req["sample_count"]),), generator=gen)
        torch.index_select(rb.storage, 0, idx, out=slots[int(req["shared_slot"])])
        ready.put({
            "tick_id": req["tick_id"], "snapshot_ptr": rb.ptr, "snapshot_size": size,
            "sample_seed": req["sample_seed"], "sample_count": req["sample_count"],
            "shared_slot": req["shared_slot"], "target_gpu_slot": req["target_gpu_slot"],
        })
