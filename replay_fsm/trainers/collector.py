"""The SAC collector: a vectorised gymnasium environment stepped in lock-step with the learner.

It runs in a spawned process (or a thread), adds every step to the shared replay
buffer and, when given a packer handle, serves the pipeline's pack requests between
steps, where the seed's collector serviced its queue. Phase 0 takes
``warmup_steps`` vector steps with uniform random actions; phase k >= 1 waits for
the learner's actor weights of version k and takes ``steps_per_phase`` vector steps
with them. Before a phase starts, every pack request the packer can already serve
is served, so no request sees rows of a later phase (the snapshots are pinned; see
``replay_fsm.trainers.run`` for the schedule and why it is deterministic).
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing as mp
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from replay_fsm import CollectorDied, Packer, PackerHandle, Pipeline, ReplayBuffer
from replay_fsm.errors import setting
from replay_fsm.looks import LookClock
from replay_fsm.signals import STOP_SIGNALS, end_worker, ignore, start_ignoring

from .sac import Actor
from .shared import EpisodeLog, StopFlag, WeightRing

_STOP_CHECK_S = 0.05  # the sync-mode collector's wait for weights, between stop checks
COLLECTOR_JOIN_S = 30.0  # how long a closed trainer waits for its collector to leave
AT_EXIT_JOIN_S = 5.0  # the same at the interpreter's exit, for a trainer never closed


@dataclass(frozen=True)
class CollectorSpec:
    """Everything the collector needs besides shared memory; picklable."""

    env_id: str
    num_envs: int
    seed: int
    warmup_steps: int  # vector steps of phase 0 (uniform random actions)
    steps_per_phase: int  # vector steps of each phase k >= 1 (actor version k)
    hidden: int
    threads: int | None = 1  # torch threads of a collector *process*


def _quiet_mujoco(env_id: str) -> None:
    """Drop MuJoCo's deprecation warning about gymnasium's model files; keep the rest."""
    import gymnasium

    if "mujoco" not in str(gymnasium.spec(env_id).entry_point):
        return
    import mujoco

    def warn(message: str) -> None:
        if "deprecated" not in message:
            print(f"MuJoCo warning: {message}", file=sys.stderr)

    mujoco.set_mju_user_warning(warn)


def make_env(env_id: str, num_envs: int) -> Any:
    """A synchronous gymnasium vector env that resets finished episodes in the same
    step and reports their last observation in ``info["final_obs"]``.

    Raises:
        ValueError: the env's spaces are not a flat Box of observations and a Box of
            actions (SAC's setting).
    """
    import gymnasium
    from gymnasium.vector import AutoresetMode

    _quiet_mujoco(env_id)
    envs = gymnasium.make_vec(env_id, num_envs=num_envs, vectorization_mode="sync",
                              vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP})
    obs_space, act_space = envs.single_observation_space, envs.single_action_space
    if not (isinstance(obs_space, gymnasium.spaces.Box) and len(obs_space.shape) == 1
            and isinstance(act_space, gymnasium.spaces.Box) and len(act_space.shape) == 1):
        envs.close()
        raise ValueError(f"{env_id}: SAC needs flat Box observations and actions, got "
                         f"{obs_space} and {act_space}")
    return envs


def env_dims(env_id: str) -> tuple[int, int]:
    """(obs_dim, action_dim) of ``env_id``."""
    envs = make_env(env_id, 1)
    try:
        return (int(envs.single_observation_space.shape[0]),
                int(envs.single_action_space.shape[0]))
    finally:
        envs.close()


def collect(spec: CollectorSpec, rb: ReplayBuffer, weights: WeightRing, episodes: EpisodeLog,
            handle: PackerHandle | None, stop: Any, in_process: bool = False) -> None:
    """The collector's body, until the pipeline closes (``handle``) or ``stop`` is set.

    In a process of its own (``in_process``) it ignores Ctrl-C and SIGTERM, which a
    terminal or a scheduler sends to every process of the job: the learner decides
    what they mean and stops it (``stop``), and a collector dead of one, inside an
    add perhaps, would fail the learner's wind-down instead (``WriterDied``)."""
    if in_process:
        ignore(STOP_SIGNALS)  # started ignoring them too: start_collector
        if spec.threads is not None:
            torch.set_num_threads(spec.threads)  # never in a thread: it is process-wide
    try:
        _Collector(spec, rb, weights, episodes, handle, stop).run()
    except KeyboardInterrupt:
        pass  # Ctrl-C reaches the whole process group; the learner side cleans up


class _Collector:
    def __init__(self, spec: CollectorSpec, rb: ReplayBuffer, weights: WeightRing,
                 episodes: EpisodeLog, handle: PackerHandle | None, stop: Any) -> None:
        self.spec, self.rb, self.weights, self.episodes, self.stop = (
            spec, rb, weights, episodes, stop)
        # A collector process outlives a killed learner unless it watches it.
        self.parent = mp.parent_process()
        self.envs = make_env(spec.env_id, spec.num_envs)
        space = self.envs.single_action_space
        self.low = space.low.astype(np.float32)
        self.span = (space.high - space.low).astype(np.float32)
        # Attached after the env exists: until then the learner watches the process only.
        self.packer = None if handle is None else Packer.attach(handle, rb)
        self.actor = Actor(rb.obs_dim, rb.action_dim, spec.hidden)
        self.flat = torch.nn.utils.parameters_to_vector(self.actor.parameters()).detach()
        self.noise = torch.Generator().manual_seed(spec.seed + 2)
        self.uniform = np.random.default_rng(spec.seed + 3)
        obs, _ = self.envs.reset(seed=spec.seed)
        self.obs = obs.astype(np.float32)  # MuJoCo observes in float64; the actor is float32
        self.ep_return = np.zeros(spec.num_envs)
        self.ep_length = np.zeros(spec.num_envs, dtype=np.int64)
        self.env_steps = 0

    @property
    def stopped(self) -> bool:
        return (self.stop.is_set() or (self.packer is not None and self.packer.closed)
                or (self.parent is not None and not self.parent.is_alive()))

    def run(self) -> None:
        n, a = self.spec.num_envs, self.rb.action_dim
        try:
            for _ in range(self.spec.warmup_steps):
                if self.stopped:
                    return
                self.step(self.uniform.uniform(-1, 1, (n, a)).astype(np.float32))
            version = 1
            while self.wait_for(version):
                self.weights.read(version, self.flat)
                torch.nn.utils.vector_to_parameters(self.flat, self.actor.parameters())
                for _ in range(self.spec.steps_per_phase):
                    action = self.actor.act(torch.from_numpy(self.obs), self.noise)
                    self.step(action.numpy())
                version += 1
        finally:
            self.envs.close()

    def wait_for(self, version: int) -> bool:
        """Wait for actor ``version``, serving pack requests meanwhile; then serve every
        request that can be served before this phase adds rows. False when stopped."""
        while self.weights.version < version:
            if self.stopped:
                return False
            if self.packer is None:
                self.weights.wait(version, timeout=_STOP_CHECK_S)
            else:
                self.packer.service(timeout=0.001)  # blocks on the request channel
        # Requests sent before this version was published are in the channel now:
        # the learner sends them first. Every one whose min_snapshot_ptr is reached
        # is served here, at the ptr it asked for, before this phase adds rows.
        if self.packer is not None:
            self.packer.serve_due()
        return not self.stopped

    def step(self, action: np.ndarray) -> None:
        """One vector step with normalised actions in [-1, 1]; adds it, then serves."""
        obs = self.obs
        nxt, reward, terminated, truncated, info = self.envs.step(self.low + (action + 1)
                                                                  * 0.5 * self.span)
        nxt = nxt.astype(np.float32)
        done = terminated | truncated
        final = nxt
        if done.any():
            final = nxt.copy()
            for i in np.flatnonzero(info["_final_obs"]):
                final[i] = info["final_obs"][i]
        self.env_steps += self.spec.num_envs
        self.ep_return += reward
        self.ep_length += 1
        if done.any():  # recorded before the rows are added: a learner that has seen
            # the rows of a step (``wait_rows``) sees the episodes it ended too
            idx = np.flatnonzero(done)
            self.episodes.record(self.env_steps, self.ep_return[idx].tolist(),
                                 self.ep_length[idx].tolist())
            self.ep_return[idx] = 0.0
            self.ep_length[idx] = 0
        # A time-limit cut still bootstraps; a true termination at the limit does not.
        self.rb.add(obs, action, reward, nxt, done, truncated & ~terminated,
                    terminal_mask=done, terminal_next_obs=final)
        self.obs = nxt
        if self.packer is not None:
            self.packer.service()


class ThreadProcess:
    """A collector thread seen as a process by ``Pipeline.watch`` (``is_alive``,
    ``pid``, ``exitcode``), keeping the exception that ended it in ``error``."""

    def __init__(self, target: Any, args: tuple[Any, ...]) -> None:
        self.error: BaseException | None = None
        self.pid = os.getpid()
        self._target, self._args = target, args
        self.thread = threading.Thread(target=self._run, name="sac-collector", daemon=True)

    def _run(self) -> None:
        try:
            self._target(*self._args)
        except BaseException as exc:  # noqa: BLE001 - reported to the learner
            self.error = exc

    @property
    def exitcode(self) -> str | None:
        return None if self.error is None else f"an exception ({self.error!r})"

    def start(self) -> None:
        self.thread.start()

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)


def end_collector(stop: Any, worker: Any, join_s: float, *, hung: bool = False) -> None:
    """Tell the collector to stop, and end it: a thread is joined within ``join_s``, a
    process joined and then SIGKILLed (it ignores SIGTERM); ``hung`` as
    ``end_worker``'s."""
    stop.set()
    end_worker(worker, join_s, hung=hung)


def start_collector(config: Any, rb: ReplayBuffer, weights: WeightRing, episodes: EpisodeLog,
                    pipe: Pipeline | None) -> tuple[Any, Any, Callable[[], None] | None]:
    """Start the collector of ``config`` (a ``SACConfig``) in a spawned process or a
    thread; the pipeline, if any, watches it. Returns (worker, stop event, the
    collector process's exit hook).

    The exit hook, registered with ``atexit`` before the process starts, ends the
    collector at the interpreter's exit if its trainer was never closed: it ignores
    SIGTERM, and multiprocessing's own clean-up, which runs after it, would send it
    that and wait for it for ever. The trainer's close unregisters it."""
    spec = CollectorSpec(config.env, config.num_envs, config.seed,
                         config.warmup_vector_steps, config.env_steps_per_tick, config.hidden)
    ctx = mp.get_context("spawn")
    stop = StopFlag()
    handle = None if pipe is None else pipe.packer_handle()
    worker: Any
    at_exit = None
    if config.collector == "process":
        worker = ctx.Process(target=collect,
                             args=(spec, rb, weights, episodes, handle, stop, True),
                             name="sac-collector", daemon=True)
        at_exit = functools.partial(end_collector, stop, worker, AT_EXIT_JOIN_S)
        atexit.register(at_exit)  # before the start: no Ctrl-C window leaves it out
        try:
            start_ignoring(worker, STOP_SIGNALS)  # ended by SIGKILL if it does not leave
        except BaseException:
            # A Ctrl-C that came during the start, raised as it returned (or a start
            # that failed): the caller gets no worker to end, so it is ended here, as
            # the trainer's close would, before the pipeline closes (the child, still
            # starting, opens the channels' semaphores by name).
            atexit.unregister(at_exit)
            end_collector(stop, worker, COLLECTOR_JOIN_S)
            raise
        if pipe is not None:
            pipe.watch(worker, "the SAC collector process")
        return worker, stop, at_exit
    worker = ThreadProcess(collect, (spec, rb, weights, episodes, handle, stop, False))
    worker.start()
    if pipe is not None:
        pipe.watch(worker, "the SAC collector thread")
    return worker, stop, at_exit


def wait_rows(rb: ReplayBuffer, ptr: int, worker: Any, timeout: float) -> None:
    """The synchronous trainer's wait for the collector to have written ``ptr`` rows:
    as long as rows keep coming (a long warm-up, a slow environment), as the
    pipeline's wait for rows does.

    Raises:
        CollectorDied: the collector exited, or added no row for ``timeout`` s (as its
            looks saw time pass: the whole job stopped with Ctrl-Z and resumed counts
            for at most half of it, ``replay_fsm.looks.LookClock``).
    """
    # Each look with this module's clock (``time.monotonic_ns``, which tests set).
    looks = LookClock(timeout / 2)
    seen, since = rb.ptr, looks.look(real_ns=time.monotonic_ns())
    while seen < ptr:
        if not worker.is_alive():  # worded as the pipeline's watch words it
            kind = "thread" if isinstance(worker, ThreadProcess) else "process"
            raise CollectorDied(f"the SAC collector {kind} (pid {worker.pid}) exited with "
                                f"code {worker.exitcode} while the learner waited for "
                                f"{ptr} rows")
        if looks.look(real_ns=time.monotonic_ns()) - since > timeout * 1e9:
            raise CollectorDied(f"the SAC collector added no row for {timeout:g} s "
                                f"({setting('liveness_timeout')}) while the learner "
                                f"waited for {ptr} "
                                f"rows (it has written {seen})")
        time.sleep(0.0005)  # rows usually exist already; this runs only on a stall
        if rb.ptr != seen:
            seen, since = rb.ptr, looks.look(real_ns=time.monotonic_ns())
