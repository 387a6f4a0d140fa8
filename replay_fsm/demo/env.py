"""The demo's environment: vectorised point masses in numpy."""

from __future__ import annotations

import numpy as np

OBS, ACT = 32, 2
DYN = 8  # dynamic state; the rest of the observation is sensor features of it


class PointMass:
    """N point masses pushed by 2-D forces toward the origin (numpy); each
    observation is the 8-D dynamic state plus fixed random sensor features of it."""

    def __init__(self, n: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.n = n
        self.state = self.rng.uniform(-1, 1, (n, DYN)).astype(np.float32)
        self.t = np.zeros(n, dtype=np.int64)
        self.sensors = self.rng.standard_normal((DYN, OBS - DYN)).astype(np.float32)

    def observe(self, state: np.ndarray) -> np.ndarray:
        return np.concatenate([state, np.tanh(state @ self.sensors)], axis=1)

    def step(self, action: np.ndarray) -> tuple[np.ndarray, ...]:
        s = self.state
        nxt = s.copy()
        nxt[:, 4:6] += 0.1 * np.clip(action, -1, 1)
        nxt[:, 6:8] = 0.9 * s[:, 6:8] + 0.1 * nxt[:, 4:6]
        nxt[:, 0:4] += 0.1 * np.concatenate([nxt[:, 4:6], nxt[:, 6:8]], axis=1)
        reward = -np.square(nxt[:, :4]).sum(1) - 0.01 * np.square(action).sum(1)
        self.t += 1
        done = np.abs(nxt[:, :4]).max(1) > 3.0
        truncated = (self.t >= 200) & ~done
        reset = done | truncated
        terminal = nxt.copy()
        if reset.any():
            nxt[reset] = self.rng.uniform(-1, 1, (int(reset.sum()), DYN))
            self.t[reset] = 0
        self.state = nxt
        return (self.observe(s), reward.astype(np.float32), self.observe(nxt), done,
                truncated, reset, self.observe(terminal))
