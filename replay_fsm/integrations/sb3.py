"""A Stable-Baselines3 replay buffer backed by replay_fsm.

``PipelineReplayBuffer`` is what SB3's off-policy algorithms (SAC, TD3, DQN, ...)
take through ``replay_buffer_class=``. Transitions go into a shared-memory
``replay_fsm.ReplayBuffer``; every ``sample`` returns SB3's ``ReplayBufferSamples``
and, before returning, asks the pipeline for the next gradient step's batch, so its
gather (and, on a GPU, its host-to-device copy) runs while SB3 computes this step.

The schedule, which makes runs reproducible: the batch of gradient step k is
``storage[randint(0, size, (batch_size,), seed=base_seed + k)]`` (INV-DATA), where
``size`` is the buffer size when gradient step ``k - (ring_depth - 1)`` sampled (for
the first ``ring_depth - 1`` steps after the pipeline starts, the size at the first
sample). ``add`` waits, if it must, until the prefetched batches are packed, so a
batch never sees a transition added after it was asked for. With SB3's usual
schedule (collect, then some gradient steps) the first ``ring_depth - 1`` gradient
steps of each ``train()`` sample the buffer as it was before the latest rollout; the
others sample what SB3's own buffer would. A Ctrl-C anywhere in ``sample`` or
``add`` leaves the buffer usable; a pipeline it closed is replaced at the next call.

    from stable_baselines3 import SAC
    from replay_fsm.integrations.sb3 import PipelineReplayBuffer

    model = SAC("MlpPolicy", "Pendulum-v1", replay_buffer_class=PipelineReplayBuffer,
                replay_buffer_kwargs={"ring_depth": 2})
    model.learn(10_000)
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from stable_baselines3.common.buffers import BaseBuffer, ReplayBuffer
from stable_baselines3.common.type_aliases import ReplayBufferSamples
from stable_baselines3.common.vec_env import VecNormalize

import replay_fsm
from replay_fsm.core import as_ring_depth, as_seconds, as_seed

# float32 holds every integer of at most this magnitude, and not every one past it.
EXACT_IN_FLOAT32 = 2**24


def _exact_in_float32(what: str, value: Any) -> None:
    """Raise where an integer array ``value`` holds a number the buffer's float32 rows
    would change (a Discrete(2**30) observation came back rounded, silently).

    Raises:
        ValueError: naming ``what`` and the first such number.
    """
    array = np.asarray(value)
    if array.dtype.kind not in "iu" or array.size == 0:
        return
    if array.max() > EXACT_IN_FLOAT32 or array.min() < -EXACT_IN_FLOAT32:
        wide = array[(array > EXACT_IN_FLOAT32) | (array < -EXACT_IN_FLOAT32)].flat[0]
        raise ValueError(f"{what} {wide} is past 2**24: the buffer's float32 rows cannot "
                         "hold it exactly; use SB3's own ReplayBuffer for such a space")


def _torch_dtype(dtype: Any) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype=dtype)).dtype


class PipelineReplayBuffer(ReplayBuffer):
    """SB3's ``ReplayBuffer`` interface over a shared replay_fsm buffer and a pipeline.

    Args:
        buffer_size, observation_space, action_space, device, n_envs,
        optimize_memory_usage, handle_timeout_termination: as SB3's ``ReplayBuffer``
            (what the algorithm passes). Episodes cut by a time limit
            (``info["TimeLimit.truncated"]``) are not terminal when
            ``handle_timeout_termination`` is set.
        ring_depth: pipeline slots; ``ring_depth - 1`` gradient steps are prefetched.
        base_seed: gradient step k samples with seed ``base_seed + k``; by default one
            drawn from numpy's global generator, which SB3's ``seed=`` sets.
        liveness_timeout: seconds a silent packer may keep ``sample`` waiting.

    Observations are stored as float32 rows (image observations take four times the
    memory SB3's uint8 arrays do; an integer past 2**24 is refused by ``add``) and
    come back in the observation space's dtype (normalised by a ``VecNormalize``: as
    SB3 normalises them).

    Raises:
        ValueError: ``optimize_memory_usage`` (rows hold next_obs explicitly), a Dict
            observation space (use SB3's ``DictReplayBuffer``), a bad ring depth,
            ``base_seed`` or ``liveness_timeout``.
        TypeError: a ring depth or ``base_seed`` that is not an integer.
    """

    # Set by __init__; these defaults serve a buffer pickled before add checked them.
    _integer_obs = _integer_action = True

    def __init__(self, buffer_size: int, observation_space: spaces.Space,
                 action_space: spaces.Space, device: torch.device | str = "auto",
                 n_envs: int = 1, optimize_memory_usage: bool = False,
                 handle_timeout_termination: bool = True, *, ring_depth: int = 2,
                 base_seed: int | None = None, liveness_timeout: float = 30.0) -> None:
        # SB3's ReplayBuffer.__init__ would allocate its numpy arrays: skip to the base.
        BaseBuffer.__init__(self, buffer_size, observation_space, action_space, device,
                            n_envs=n_envs)
        if optimize_memory_usage:
            raise ValueError("optimize_memory_usage is not supported: replay_fsm rows "
                             "store next_obs explicitly; pass optimize_memory_usage=False")
        if isinstance(observation_space, spaces.Dict):
            raise ValueError("Dict observation spaces are not supported; use SB3's "
                             "DictReplayBuffer")
        # Here, not at the first sample (after learning_starts steps), as the pipeline would.
        ring_depth = as_ring_depth(ring_depth)
        base_seed = None if base_seed is None else as_seed(base_seed)
        seconds = as_seconds("liveness_timeout", liveness_timeout)
        self.buffer_size = max(buffer_size // n_envs, 1)
        self.optimize_memory_usage = False
        self.handle_timeout_termination = handle_timeout_termination
        self.ring_depth = ring_depth
        self.base_seed = (int(np.random.randint(0, 2**31 - 1)) if base_seed is None
                          else base_seed)
        self.liveness_timeout = seconds
        # What add checks against float32's rounding: the integer spaces' values.
        self._integer_obs = np.dtype(observation_space.dtype).kind in "iu"
        self._integer_action = np.dtype(action_space.dtype).kind in "iu"
        self.obs_dim = int(np.prod(self.obs_shape))
        self.obs_dtype = _torch_dtype(observation_space.dtype)
        self.action_dtype = _torch_dtype(self._maybe_cast_dtype(action_space.dtype))
        self.replay = replay_fsm.ReplayBuffer(self.buffer_size * n_envs, self.obs_dim,
                                              self.action_dim)
        self._pipe: replay_fsm.Pipeline | None = None
        self._pipe_key: tuple[int, str] | None = None
        self._finalizer: weakref.finalize | None = None  # closes the pipeline at GC
        self._hot = False  # a batch of the pipeline's is taken and not yet released
        # Invariant: ticks [_next_tick, _requested) are requested and not yet sampled;
        # those below _settled are known to be packed.
        self._next_tick = 0
        self._requested = 0
        self._settled = 0

    # -- SB3's interface --------------------------------------------------------

    def add(self, obs: np.ndarray, next_obs: np.ndarray, action: np.ndarray,
            reward: np.ndarray, done: np.ndarray, infos: list[dict[str, Any]]) -> None:
        """Store one step of ``n_envs`` transitions (SB3's call, after each env step).

        Raises:
            ValueError: a field has the wrong size, or holds an integer float32 rows
                cannot hold exactly (past 2**24); nothing is added.
            CollectorDied, PipelineFailed: a prefetch this add waits for failed.
        """
        if self._integer_obs:
            _exact_in_float32("observation", obs)
            _exact_in_float32("next observation", next_obs)
        if self._integer_action:
            _exact_in_float32("action", action)
        n = self.n_envs
        truncated = np.array([info.get("TimeLimit.truncated", False) for info in infos],
                             dtype=np.float32)
        self._settle()  # the prefetched batches keep the buffer as it was when asked for
        self.replay.add(np.asarray(obs).reshape(n, self.obs_dim),
                        np.asarray(action).reshape(n, self.action_dim),
                        np.asarray(reward, dtype=np.float32).reshape(n),
                        np.asarray(next_obs).reshape(n, self.obs_dim),
                        np.asarray(done, dtype=np.float32).reshape(n), truncated)
        self.pos += 1
        if self.pos == self.buffer_size:
            self.full = True
            self.pos = 0

    def sample(self, batch_size: int, env: VecNormalize | None = None) -> ReplayBufferSamples:
        """The batch of the next gradient step; prefetches the ones after it.

        Raises:
            ValueError: the buffer is empty, or ``batch_size`` is not positive.
            CollectorDied, PipelineFailed: the pipeline failed.
        """
        if self.replay.size == 0:
            raise ValueError("cannot sample from an empty replay buffer: add transitions "
                             "first")
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        pipe = self._pipeline(batch_size)
        if self._hot:  # a sample interrupted before it released its batch (Ctrl-C)
            pipe.after_tick()
            self._hot = False
        tick = self._next_tick
        self._request_through(pipe, tick, batch_size)
        batch = pipe.sample_large_batch(tick, batch_size)
        # Taken: a sample interrupted from here on leaves the next one the next tick
        # (the invariant's, whatever raises; no call between these and the try).
        self._hot, self._next_tick = True, tick + 1
        try:
            samples = self._samples(batch, env)
        finally:
            pipe.after_tick()  # the samples are copies: the slot is free again
            self._hot = False
        self._request_through(pipe, tick + self.ring_depth - 1, batch_size)
        return samples

    def reset(self) -> None:
        """Forget every transition (a fresh shared buffer); the tick count goes on."""
        super().reset()
        self.close()
        self.replay = replay_fsm.ReplayBuffer(self.buffer_size * self.n_envs, self.obs_dim,
                                              self.action_dim)

    def close(self) -> None:
        """Stop the pipeline (idempotent); the next ``sample`` starts a new one."""
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._pipe is not None:
            # Forgotten only once closed: a close that a Ctrl-C cut short is finished
            # by the next call (Pipeline.close finishes it too).
            self._pipe.close()
        self._pipe, self._pipe_key, self._finalizer = None, None, None
        self._hot = False
        self._requested = self._settled = self._next_tick

    # -- pickling (SB3's save_replay_buffer / load_replay_buffer) -------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_pipe=None, _pipe_key=None, _finalizer=None, _hot=False)
        rb = self.replay
        rows = rb.storage[: rb.size]
        if rb.ptr > rb.capacity:  # oldest row first, so that it is overwritten first
            start = rb.ptr % rb.capacity
            rows = torch.cat([rb.storage[start:], rb.storage[:start]])
        state["replay"] = rows.clone()
        state["_requested"] = state["_settled"] = self._next_tick
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        rows = state.pop("replay")
        self.__dict__.update(state)
        self.replay = replay_fsm.ReplayBuffer(self.buffer_size * self.n_envs, self.obs_dim,
                                              self.action_dim)
        if rows.shape[0]:
            self.replay.add_packed(rows)

    # -- internals ----------------------------------------------------------------

    def _pipeline(self, batch_size: int) -> replay_fsm.Pipeline:
        key = (batch_size, str(self.device))
        # First use, a new size or device, or a pipeline closed by a Ctrl-C that landed
        # in one of its calls (a notebook's interrupt, then learn() again).
        if self._pipe is None or self._pipe_key != key or self._pipe.closed:
            self.close()
            # Held before it starts its threads, so that close() stops them whatever a
            # Ctrl-C interrupts (the result of Pipeline(...) could be lost on return).
            pipe = self._pipe = replay_fsm.Pipeline.__new__(replay_fsm.Pipeline)
            try:
                replay_fsm.Pipeline.__init__(
                    pipe, self.replay, device=self.device, sample_count=batch_size,
                    base_seed=self.base_seed, ring_depth=self.ring_depth,
                    collector="thread", liveness_timeout=self.liveness_timeout)
            except BaseException:
                # A constructor that raised closed what it had started; one that had
                # returned when a Ctrl-C landed here runs until closed now.
                self._pipe = None
                with contextlib.suppress(Exception):  # a half-built one: close what it can
                    pipe.close()
                raise
            self._pipe_key = key
            self._finalizer = weakref.finalize(self, self._pipe.close)
        return self._pipe

    def _request_through(self, pipe: replay_fsm.Pipeline, last: int, n: int) -> None:
        while self._requested <= last:
            pipe.start_prepare(self._requested, n)  # snapshot: the buffer as it is now
            self._requested += 1

    def _settle(self) -> None:
        """Wait until every requested batch is packed, before the buffer changes."""
        if self._pipe is None or self._settled >= self._requested:
            return
        if self._pipe.closed:  # by a Ctrl-C: its batches are dropped, none to wait for
            self.close()
            return
        n = self._pipe.sample_count
        for tick in range(max(self._settled, self._next_tick), self._requested):
            self._pipe.wait_until_ready(tick, n)
        self._settled = self._requested

    def _samples(self, batch: dict[str, torch.Tensor],
                 env: VecNormalize | None) -> ReplayBufferSamples:
        """SB3's samples as fresh tensors: the slot is released right after, and SB3
        keeps its samples beyond that (its own buffer returns copies too)."""
        n = batch["obs"].shape[0]
        shape = (n, *self.obs_shape)
        dones = batch["dones"]
        if self.handle_timeout_termination:
            dones = dones * (1 - batch["truncated"])  # a time-limit cut is not terminal
        rewards = batch["rewards"].reshape(n, 1)
        if env is None:
            obs = batch["obs"].reshape(shape).to(self.obs_dtype, copy=True)
            next_obs = batch["next_obs"].reshape(shape).to(self.obs_dtype, copy=True)
            rewards = rewards.clone()
        else:  # VecNormalize's statistics move: normalise when sampled, as SB3 does,
            # from the space's dtype, as SB3 stores them (norm_obs=False keeps it)
            obs, next_obs = (
                self.to_torch(np.asarray(self._normalize_obs(
                    batch[key].reshape(shape).to(self.obs_dtype).cpu().numpy(), env)))
                for key in ("obs", "next_obs"))
            rewards = self.to_torch(self._normalize_reward(rewards.cpu().numpy(), env))
        return ReplayBufferSamples(
            observations=obs,
            actions=batch["actions"].to(self.action_dtype, copy=True),
            next_observations=next_obs,
            dones=dones.reshape(n, 1).clone(),
            rewards=rewards)
