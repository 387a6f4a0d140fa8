"""Process bodies for spawn-based tests (importable by the child interpreter)."""

from __future__ import annotations

import torch

from replay_fsm.buffer import ReplayBuffer
from replay_fsm.packer import Packer, PackerHandle


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
