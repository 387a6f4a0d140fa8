"""One view of the replay buffer a seed user passes: UniLab's or ours.

The pipeline reads four things of a buffer: ``ptr`` and ``size`` (ints), ``width``,
and ``layout`` (the column slices that turn a packed slot into the batch dict), and
checks for ``gather``. Our ``ReplayBuffer`` has them. UniLab's keeps them where the
seed read them: the rows in ``_storage``, the counters in one-element shared tensors
``ptr`` and ``size``, the columns in ``_obs_sl``, ``_rew_col``... This view reads
either in place; nothing is copied, so the collector's writes show through.
"""

from __future__ import annotations

from typing import Any

import torch

from ..data.buffer import Layout, ReplayBuffer

# Where UniLab's ReplayBuffer keeps its packed columns (critic ones only when
# critic_dim > 0): the names the seed's pipeline read, and the only way to its layout.
UNILAB_COLUMNS = {
    "obs": "_obs_sl", "next_obs": "_nobs_sl", "actions": "_act_sl", "rewards": "_rew_col",
    "dones": "_done_col", "truncated": "_trunc_col", "critic": "_critic_sl",
    "next_critic": "_ncritic_sl",
}
UNILAB_STORAGE = "_storage"
UNILAB_PACKED_FLAG = "_packed_cpu_storage"


class ReplayBufferView:
    """Reads ``ptr``, ``size``, ``width``, ``layout`` and ``storage`` of ``source``:
    a ``replay_fsm.ReplayBuffer`` or UniLab's ``ReplayBuffer``.

    Raises:
        ValueError: UniLab's buffer without packed storage (the seed's message).
        TypeError: ``source`` is neither kind of buffer.
    """

    def __init__(self, source: Any) -> None:
        self.source = source
        # UniLab's counters, read through numpy views of their shared memory (a
        # tensor index costs microseconds, and ptr is read at every request).
        self._counters: tuple[Any, Any] | None = None
        if isinstance(source, ReplayBuffer):
            self.storage: torch.Tensor = source.storage
            self.layout: Layout = source.layout
            return
        storage = getattr(source, UNILAB_STORAGE, None)
        ptr, size = getattr(source, "ptr", None), getattr(source, "size", None)
        if not (isinstance(storage, torch.Tensor) and isinstance(ptr, torch.Tensor)
                and isinstance(size, torch.Tensor)):
            raise TypeError(
                f"replay_buffer must be a replay_fsm.ReplayBuffer or a seed-style buffer "
                f"(UniLab's ReplayBuffer: rows in {UNILAB_STORAGE}, one-element ptr and size "
                f"tensors), got {type(source).__name__}")
        if not getattr(source, UNILAB_PACKED_FLAG, False):
            raise ValueError("pack_layout='packed' requires "
                             "ReplayBuffer(packed_cpu_storage=True)")
        self.storage = storage
        self._counters = (ptr.reshape(-1).numpy(), size.reshape(-1).numpy())
        columns: dict[str, Any] = {name: getattr(source, attr, None)
                                   for name, attr in UNILAB_COLUMNS.items()}
        self.layout = Layout(width=int(storage.shape[1]), **columns)

    @property
    def ptr(self) -> int:
        """Rows ever written, read now."""
        if self._counters is None:
            return int(self.source.ptr)
        return int(self._counters[0][0])

    @property
    def size(self) -> int:
        """Rows that hold data, read now."""
        if self._counters is None:
            return int(self.source.size)
        return int(self._counters[1][0])

    @property
    def width(self) -> int:
        return self.layout.width

    def gather(self, indices: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out[:] = storage[indices]``: torn-row free with our buffer (INV-ROW); with
        UniLab's, a plain gather, as its collector does."""
        if isinstance(self.source, ReplayBuffer):
            return self.source.gather(indices, out)
        return torch.index_select(self.storage, 0, indices, out=out)
