"""The demo's learner: a small critic trained by TD updates on each batch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .env import ACT, OBS


class Critic(nn.Module):
    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(OBS + ACT, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, obs: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([obs, act], dim=1)).squeeze(1)


@dataclass
class Learner:
    critic: Critic
    target: Critic
    opt: torch.optim.Optimizer
    policy: torch.Tensor

    @classmethod
    def create(cls, device: torch.device, seed: int) -> Learner:
        torch.manual_seed(seed)
        critic = Critic().to(device)
        target = Critic().to(device)
        target.load_state_dict(critic.state_dict())
        return cls(critic, target, torch.optim.Adam(critic.parameters(), lr=3e-4),
                   torch.randn(OBS, ACT, device=device) * 0.1)

    def step(self, batch: dict[str, torch.Tensor],
             all_reduce: Callable[[list[torch.Tensor]], None] | None = None) -> float:
        with torch.no_grad():
            next_act = torch.tanh(batch["next_obs"] @ self.policy)
            target = batch["rewards"] + 0.99 * (1 - batch["dones"]) * self.target(
                batch["next_obs"], next_act)
        loss = (self.critic(batch["obs"], batch["actions"]) - target).pow(2).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if all_reduce is not None:  # data-parallel ranks average their gradients
            all_reduce([p.grad for p in self.critic.parameters() if p.grad is not None])
        self.opt.step()
        with torch.no_grad():
            for p, tp in zip(self.critic.parameters(), self.target.parameters(), strict=True):
                tp.lerp_(p, 0.005)
        return float(loss.detach())
