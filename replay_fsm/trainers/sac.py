"""Soft actor-critic: twin Q, tanh-Gaussian actor, automatic entropy tuning, target networks.

The learner half of the SAC trainer: torch only, no environment, no pipeline. Its
``train_tick`` takes one large batch (``updates * batch_size`` rows, the seed's
layout) and makes ``updates`` gradient updates on consecutive slices of it.

Determinism: every random number the learner draws (the actor's reparameterisation
noise) comes from its own ``torch.Generator``, never from torch's global one, so a
collector thread in the same process cannot shift it; the networks are initialised
inside ``torch.random.fork_rng`` from ``seed``.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0
_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def mlp(inputs: int, outputs: int, hidden: int) -> nn.Sequential:
    """Two hidden ReLU layers of ``hidden`` units."""
    return nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                         nn.ReLU(), nn.Linear(hidden, outputs))


class Actor(nn.Module):
    """A tanh-squashed Gaussian policy over actions in [-1, 1]."""

    def __init__(self, obs_dim: int, action_dim: int, hidden: int) -> None:
        super().__init__()
        self.net = mlp(obs_dim, 2 * action_dim, hidden)
        self.action_dim = action_dim

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and log standard deviation of the pre-tanh Gaussian."""
        mean, raw = self.net(obs).split(self.action_dim, dim=-1)
        # A smooth squash of log_std into its range keeps its gradient alive at the edges.
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (torch.tanh(raw) + 1)
        return mean, log_std

    def sample(self, obs: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reparameterised action and its log-probability, for standard normal ``noise``."""
        mean, log_std = self(obs)
        pre = mean + log_std.exp() * noise
        action = torch.tanh(pre)
        # log(1 - tanh(x)^2) = 2 (log 2 - x - softplus(-2x)), stable for large |x|.
        log_det = 2 * (math.log(2) - pre - nn.functional.softplus(-2 * pre))
        log_prob = (-0.5 * noise.pow(2) - log_std - _HALF_LOG_2PI - log_det).sum(-1)
        return action, log_prob

    @torch.no_grad()
    def act(self, obs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """An exploring action per row of ``obs`` (the collector's call)."""
        mean, log_std = self(obs)
        noise = torch.randn(mean.shape, generator=generator, device=mean.device)
        return torch.tanh(mean + log_std.exp() * noise)


class TwinQ(nn.Module):
    """Two independent Q networks; the target takes their minimum."""

    def __init__(self, obs_dim: int, action_dim: int, hidden: int) -> None:
        super().__init__()
        self.q1 = mlp(obs_dim + action_dim, 1, hidden)
        self.q2 = mlp(obs_dim + action_dim, 1, hidden)

    def forward(self, obs: torch.Tensor, act: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([obs, act], dim=-1)
        return self.q1(x).squeeze(-1), self.q2(x).squeeze(-1)


class SAC:
    """The SAC learner: networks, optimisers, the entropy temperature and its update.

    Args:
        obs_dim, action_dim: sizes of an observation and of an action in [-1, 1].
        hidden: units per hidden layer of every network.
        lr: Adam learning rate of the actor, the critics and the temperature.
        gamma: discount; tau: target-network averaging rate per update.
        device: where the networks live (the pipeline's device).
        seed: initialises the networks and the learner's noise generator.

    Raises:
        ValueError: a non-positive size or a rate outside its range.
    """

    def __init__(self, obs_dim: int, action_dim: int, *, hidden: int = 256, lr: float = 3e-4,
                 gamma: float = 0.99, tau: float = 0.005, device: str | torch.device = "cpu",
                 seed: int = 0) -> None:
        if min(obs_dim, action_dim, hidden) < 1:
            raise ValueError("obs_dim, action_dim and hidden must be >= 1")
        if not (0 < gamma <= 1 and 0 < tau <= 1 and lr > 0):
            raise ValueError("need 0 < gamma <= 1, 0 < tau <= 1 and lr > 0")
        self.device = torch.device(device)
        self.gamma, self.tau = gamma, tau
        with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG alone
            torch.manual_seed(seed)
            self.actor = Actor(obs_dim, action_dim, hidden).to(self.device)
            self.critic = TwinQ(obs_dim, action_dim, hidden).to(self.device)
        self.critic_target = TwinQ(obs_dim, action_dim, hidden).to(self.device)
        self.critic_target.load_state_dict(self.critic.state_dict())
        self.critic_target.requires_grad_(False)
        self.log_alpha = torch.zeros((), device=self.device, requires_grad=True)
        self.target_entropy = -float(action_dim)
        self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=lr)
        self.critic_opt = torch.optim.Adam(self.critic.parameters(), lr=lr)
        self.alpha_opt = torch.optim.Adam([self.log_alpha], lr=lr)
        self.generator = torch.Generator(self.device).manual_seed(seed + 1)
        # Losses of the latest update, as tensors: reading them forces no device sync.
        self.last: dict[str, torch.Tensor] = {}

    def _noise(self, like: torch.Tensor) -> torch.Tensor:
        shape = (like.shape[0], self.actor.action_dim)
        return torch.randn(shape, generator=self.generator, device=self.device)

    def update(self, batch: dict[str, torch.Tensor]) -> None:
        """One gradient update of critics, actor and temperature, then the targets.

        ``dones`` marks episode ends and ``truncated`` those cut by a time limit,
        which still bootstrap: only ``dones * (1 - truncated)`` is terminal.
        """
        # The batch is views of the hot slot; the layers may save them for backward: each
        # slot is its own tensor, so the next slot filling meanwhile does not disturb them.
        obs, act, next_obs = batch["obs"], batch["actions"], batch["next_obs"]
        terminal = batch["dones"] * (1 - batch["truncated"])
        alpha = self.log_alpha.detach().exp()
        with torch.no_grad():
            next_act, next_logp = self.actor.sample(next_obs, self._noise(next_obs))
            q1_t, q2_t = self.critic_target(next_obs, next_act)
            soft_v = torch.min(q1_t, q2_t) - alpha * next_logp
            target = batch["rewards"] + self.gamma * (1 - terminal) * soft_v
        q1, q2 = self.critic(obs, act)
        critic_loss = (q1 - target).pow(2).mean() + (q2 - target).pow(2).mean()
        self.critic_opt.zero_grad(set_to_none=True)
        critic_loss.backward()
        self.critic_opt.step()

        new_act, logp = self.actor.sample(obs, self._noise(obs))
        q_new = torch.min(*self.critic(obs, new_act))
        actor_loss = (alpha * logp - q_new).mean()
        self.actor_opt.zero_grad(set_to_none=True)
        actor_loss.backward()
        self.actor_opt.step()

        alpha_loss = -(self.log_alpha * (logp.detach() + self.target_entropy)).mean()
        self.alpha_opt.zero_grad(set_to_none=True)
        alpha_loss.backward()
        self.alpha_opt.step()

        with torch.no_grad():
            for p, tp in zip(self.critic.parameters(), self.critic_target.parameters(),
                             strict=True):
                tp.lerp_(p, self.tau)
        self.last = {"critic_loss": critic_loss.detach(), "actor_loss": actor_loss.detach(),
                     "alpha": alpha}

    def train_tick(self, large_batch: dict[str, torch.Tensor], updates: int,
                   batch_size: int) -> None:
        """``updates`` updates on consecutive ``batch_size``-row slices of one tick's batch.

        Raises:
            ValueError: the batch holds fewer than ``updates * batch_size`` rows.
        """
        rows = large_batch["obs"].shape[0]
        if rows < updates * batch_size:
            raise ValueError(f"a tick's batch has {rows} rows, fewer than updates * "
                             f"batch_size = {updates * batch_size}")
        for u in range(updates):
            s = u * batch_size
            self.update({k: v[s:s + batch_size] for k, v in large_batch.items()})

    def metrics(self) -> dict[str, float]:
        """The latest update's losses and temperature, as floats (a device sync)."""
        return {k: float(v) for k, v in self.last.items()}

    def actor_vector(self) -> torch.Tensor:
        """The actor's parameters as one flat CPU tensor (what the collector loads)."""
        return nn.utils.parameters_to_vector(self.actor.parameters()).detach().cpu()

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every learned tensor by name: actor, critics, targets, temperature."""
        named = {"log_alpha": self.log_alpha.detach()}
        for prefix, module in (("actor", self.actor), ("critic", self.critic),
                               ("critic_target", self.critic_target)):
            named.update({f"{prefix}.{k}": v.detach() for k, v in module.state_dict().items()})
        return named

    def digest(self) -> str:
        """SHA-256 of every learned tensor's bytes: equal digests, bit-identical learners."""
        h = hashlib.sha256()
        for name, value in sorted(self.tensors().items()):
            h.update(name.encode())
            h.update(value.cpu().contiguous().numpy().tobytes())
        return h.hexdigest()
