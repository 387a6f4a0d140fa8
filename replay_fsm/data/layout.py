"""The packed row: which columns of a replay buffer's float32 row hold which field.

Its own module so that the buffer, its checkpoints and the seed's adapter share it
without importing each other (``replay_fsm.data.buffer`` re-exports it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Layout:
    """Column slices of a packed row, in the seed's order."""

    obs: slice
    next_obs: slice
    actions: slice
    rewards: int
    dones: int
    truncated: int
    critic: slice | None
    next_critic: slice | None
    width: int

    @classmethod
    def build(cls, obs_dim: int, action_dim: int, critic_dim: int) -> Layout:
        o, a, c = obs_dim, action_dim, critic_dim
        base = 2 * o + a
        return cls(
            obs=slice(0, o), next_obs=slice(o, 2 * o), actions=slice(2 * o, base),
            rewards=base, dones=base + 1, truncated=base + 2,
            critic=slice(base + 3, base + 3 + c) if c else None,
            next_critic=slice(base + 3 + c, base + 3 + 2 * c) if c else None,
            width=base + 3 + 2 * c,
        )

    def views(self, packed: torch.Tensor) -> dict[str, torch.Tensor]:
        """The batch dict over a packed [n, width] tensor: views, no copies."""
        batch = {
            "obs": packed[:, self.obs],
            "next_obs": packed[:, self.next_obs],
            "actions": packed[:, self.actions],
            "rewards": packed[:, self.rewards],
            "dones": packed[:, self.dones],
            "truncated": packed[:, self.truncated],
        }
        if self.critic is not None and self.next_critic is not None:
            batch["critic"] = packed[:, self.critic]
            batch["next_critic"] = packed[:, self.next_critic]
        return batch

    def column_name(self, column: int) -> str:
        """The field a packed column belongs to, e.g. ``"next_obs[2]"`` or ``"rewards"``."""
        for name in ("obs", "next_obs", "actions", "critic", "next_critic"):
            cols = getattr(self, name)
            if cols is not None and cols.start <= column < cols.stop:
                return f"{name}[{column - cols.start}]"
        for name in ("rewards", "dones", "truncated"):
            if getattr(self, name) == column:
                return name
        raise IndexError(f"column {column} is outside a row of width {self.width}")

    def pack(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The inverse of ``views``: the packed [n, width] rows of a batch, on the CPU."""
        n = next(iter(batch.values())).shape[0]
        rows = torch.empty(n, self.width)
        for name, value in batch.items():
            rows[:, getattr(self, name)] = value.detach().cpu()
        return rows
