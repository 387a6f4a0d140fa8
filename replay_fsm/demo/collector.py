"""The demo's collector: step, add, serve pack requests between steps (the seed's
pattern), in a spawned process or a thread."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..data.buffer import ReplayBuffer
from ..data.packer import Packer, PackerHandle
from ..signals import STOP_SIGNALS, ignore
from .env import ACT, OBS, PointMass


def collect(rb: ReplayBuffer, handle: PackerHandle, envs: int, seed: int,
            stop: Any = None, steps: int | None = None) -> None:
    """The collector: step, add, serve pack requests between steps, until closed.

    ``steps``: stop stepping after that many steps and only serve (tests use it to
    keep the storage still, so every batch can be checked bit for bit)."""
    try:
        _collect(rb, handle, envs, seed, stop, steps)
    except KeyboardInterrupt:
        pass  # Ctrl-C reaches the whole process group; the learner side cleans up


def collect_process(rb: ReplayBuffer, handle: PackerHandle, envs: int, seed: int,
                    steps: int | None = None) -> None:
    """``collect`` as the body of its own process. Ctrl-C, or a scheduler's SIGTERM,
    may reach the whole process group, this process too; the learner decides what it
    means (its ``close`` ends this loop), so this process ignores both: a rank
    waiting for rows must not see its collector die of the signal it is about to
    stop on. Start it with ``start_ignoring(process, STOP_SIGNALS)`` so that holds
    while it starts, too, and end it with SIGKILL if it does not leave."""
    ignore(STOP_SIGNALS)
    # One torch thread for its gathers: torch's default team spans the learner's core
    # too, and a pack then waited for it mid-gather (the learner's stall per tick went
    # from 0.04 ms to 1.2-1.6 ms when the packs were split in chunks).
    torch.set_num_threads(1)
    collect(rb, handle, envs, seed, None, steps)


def _collect(rb: ReplayBuffer, handle: PackerHandle, envs: int, seed: int, stop: Any,
             steps: int | None) -> None:
    env = PointMass(envs, seed)
    packer = Packer.attach(handle, rb)
    policy = np.random.default_rng(seed + 1).standard_normal((OBS, ACT)).astype(np.float32)
    taken = 0
    while not packer.closed and not (stop is not None and stop.is_set()):
        if steps is not None and taken >= steps:
            packer.service(timeout=0.05)
            continue
        action = -env.observe(env.state) @ policy * 0.5 + env.rng.normal(0, 0.3,
                                                                           (envs, ACT))
        obs, rew, nxt, done, trunc, reset, terminal = env.step(action.astype(np.float32))
        rb.add(obs, action, rew, nxt, done, trunc, terminal_mask=reset,
               terminal_next_obs=terminal)
        taken += 1
        packer.service(timeout=0.0)
        if rb.size == rb.capacity:
            packer.service(timeout=0.002)  # a full buffer: favour serving the learner
