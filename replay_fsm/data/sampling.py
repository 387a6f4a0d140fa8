"""The sampling contract (INV-DATA), in the one function every side uses."""

from __future__ import annotations

import torch


def sample_indices(snapshot_size: int, sample_count: int, seed: int, *,
                   out: torch.Tensor | None = None,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """Row indices of the batch: ``randint(0, snapshot_size, (sample_count,))`` drawn
    from a CPU generator seeded with ``seed`` (``base_seed + tick``).

    ``out`` and ``generator`` let a packer reuse its buffers; the values are the same.

    Raises:
        ValueError: the buffer is empty or ``sample_count`` is not positive.
    """
    if snapshot_size <= 0:
        raise ValueError("cannot sample from an empty replay buffer (size 0): add "
                         "transitions first, or pass min_snapshot_ptr (to start_prepare "
                         "or ticks) to wait for them")
    if sample_count <= 0:
        raise ValueError(f"sample_count must be positive, got {sample_count}")
    gen = torch.Generator() if generator is None else generator
    gen.manual_seed(int(seed))
    return torch.randint(0, int(snapshot_size), (int(sample_count),), generator=gen,
                         out=out)


def expected_batch(storage: torch.Tensor, snapshot_size: int, sample_count: int,
                   seed: int) -> torch.Tensor:
    """The reference batch: ``storage[indices]``; what every backend must match bit for bit."""
    return storage[sample_indices(snapshot_size, sample_count, seed)]
