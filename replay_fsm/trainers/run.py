"""The SAC trainer: a collector process steps a vector env, the learner takes large
batches through the pipeline (``sampling="pipeline"``) or samples them itself
(``sampling="sync"``, the baseline).

The schedule (lock-step, as the seed's ``sync_collection``): collection phase 0 is
the warm-up; phase k >= 1 uses actor weights version k, which the learner publishes
after tick k - 1. With ``lag = ring_depth - 1``, the batch of tick t is drawn from
the buffer as it stood after phase ``max(0, t - lag)``, i.e. at

    P(t) = (warmup_steps + max(0, t - lag) * env_steps_per_tick) * num_envs rows,

so collection of phase t runs while the learner trains on tick t. Each tick makes
``updates_per_tick`` SAC updates on consecutive ``batch_size`` slices of its batch.

Why the pipelined run is bit-identical to the synchronous one (``compare``):

- The snapshot of every tick is pinned. The learner requests tick t + lag with
  ``min_snapshot_ptr = P(t + lag)`` at the start of tick t, before it trains on t and
  publishes weights t + 1; the collector, before it adds the first row of phase
  t + 1, serves every request it can, so that request is packed at exactly
  P(t + lag) rows. The synchronous trainer samples the same snapshot size with
  ``replay_fsm.sampling.expected_batch`` (INV-DATA makes both the same rows).
- Collection is deterministic: phase k steps with weights version k exactly (the
  collector waits for them), env seeds are fixed, and the collector's action noise
  comes from its own ``torch.Generator``.
- The learner's noise comes from its own ``torch.Generator``, never torch's global
  one (which a collector thread shares); the networks are initialised from ``seed``.
- Thread counts are fixed: the learner runs on ``learner_threads`` (1 by default),
  a collector process on 1, so every kernel splits its work the same way.
- Both trainers see batches with the same layout (views of packed rows), and the
  synchronous one needs ``capacity`` to hold every row the run writes: it reads
  the storage while the collector appends, which is safe only until the ring wraps.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from replay_fsm import CollectorDied, Pipeline, ReplayBuffer  # the public API only
from replay_fsm.sampling import expected_batch

from .collector import CollectorSpec, collect, env_dims
from .sac import SAC
from .shared import EpisodeLog, WeightRing

SAMPLING = ("pipeline", "sync")
COLLECTORS = ("process", "thread")


@dataclass(frozen=True)
class SACConfig:
    """One SAC run. ``ring_depth`` also sets the data schedule (see the module doc),
    for the synchronous trainer too, so that both modes are comparable bit for bit."""

    env: str = "HalfCheetah-v5"
    num_envs: int = 8
    batch_size: int = 256
    updates_per_tick: int = 8
    env_steps_per_tick: int = 1  # vector steps per collection phase
    ticks: int = 5_000
    warmup_steps: int = 5_000  # transitions with uniform random actions, before learning
    capacity: int = 1_000_000
    device: str = "cpu"
    sampling: str = "pipeline"
    ring_depth: int = 2
    collector: str = "process"
    hidden: int = 256
    lr: float = 3e-4
    gamma: float = 0.99
    tau: float = 0.005
    seed: int = 0
    learner_threads: int | None = 1
    liveness_timeout: float = 30.0
    progress: bool = True

    @property
    def sample_count(self) -> int:
        return self.batch_size * self.updates_per_tick

    @property
    def warmup_vector_steps(self) -> int:
        return -(-self.warmup_steps // self.num_envs)

    def snapshot_ptr(self, tick: int) -> int:
        """P(tick): rows ever written when the batch of ``tick`` is drawn."""
        phase = max(0, tick - (self.ring_depth - 1))
        return (self.warmup_vector_steps + phase * self.env_steps_per_tick) * self.num_envs

    def validate(self) -> None:
        """Raises:
            ValueError: an option out of range, naming it and the fix."""
        positive = ("num_envs", "batch_size", "updates_per_tick", "env_steps_per_tick",
                    "ticks", "warmup_steps", "capacity", "hidden")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.sampling not in SAMPLING:
            raise ValueError(f"sampling must be one of {SAMPLING}, got {self.sampling!r}")
        if self.collector not in COLLECTORS:
            raise ValueError(f"collector must be one of {COLLECTORS}, got {self.collector!r}")
        if self.ring_depth < 2:
            raise ValueError(f"ring_depth must be >= 2, got {self.ring_depth}")
        written = self.snapshot_ptr(self.ticks + self.ring_depth)
        if self.sampling == "sync" and written > self.capacity:
            raise ValueError(f"sampling='sync' reads the storage while the collector "
                             f"appends, so the ring must not wrap: capacity "
                             f"{self.capacity} < {written} rows this run writes; raise "
                             "capacity or lower ticks")


class _ThreadProcess:
    """A collector thread seen as a process by ``Pipeline.watch`` (is_alive, pid,
    exitcode), keeping the exception that ended it."""

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


def _start_collector(config: SACConfig, rb: ReplayBuffer, weights: WeightRing,
                     episodes: EpisodeLog, pipe: Pipeline | None) -> tuple[Any, Any]:
    spec = CollectorSpec(config.env, config.num_envs, config.seed,
                         config.warmup_vector_steps, config.env_steps_per_tick, config.hidden)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    handle = None if pipe is None else pipe.packer_handle()
    worker: Any
    if config.collector == "process":
        worker = ctx.Process(target=collect,
                             args=(spec, rb, weights, episodes, handle, stop, True),
                             name="sac-collector", daemon=True)
    else:
        worker = _ThreadProcess(collect, (spec, rb, weights, episodes, handle, stop, False))
    worker.start()
    if pipe is not None:
        pipe.watch(worker, f"the SAC collector {config.collector}")
    return worker, stop


def _wait_rows(rb: ReplayBuffer, ptr: int, worker: Any, timeout: float) -> None:
    """The synchronous trainer's wait for the collector to have written ``ptr`` rows."""
    deadline = time.monotonic() + timeout
    while rb.ptr < ptr:
        if not worker.is_alive():
            raise CollectorDied(f"the SAC collector exited with {worker.exitcode} while "
                                f"the learner waited for {ptr} rows")
        if time.monotonic() > deadline:
            raise CollectorDied(f"no {ptr} rows after {timeout} s (ptr {rb.ptr})")
        time.sleep(0.0005)  # rows usually exist already; this runs only on a stall


def train(config: SACConfig) -> dict[str, Any]:
    """Run SAC as configured; returns the result (episodes, timings, learner digest).

    Raises:
        ValueError: a bad option (``SACConfig.validate``), or the env is not SAC's.
        CollectorDied: the collector died or fell silent.
        KeyboardInterrupt: after everything is stopped and joined.
    """
    config.validate()
    if config.learner_threads is not None:
        torch.set_num_threads(config.learner_threads)
    obs_dim, action_dim = env_dims(config.env)
    device = torch.device(config.device)
    rb = ReplayBuffer(config.capacity, obs_dim, action_dim)
    sac = SAC(obs_dim, action_dim, hidden=config.hidden, lr=config.lr, gamma=config.gamma,
              tau=config.tau, device=device, seed=config.seed)
    lag = config.ring_depth - 1
    weights = WeightRing(sac.actor_vector().numel(), slots=lag + 2)
    episodes = EpisodeLog()
    n = config.sample_count
    pipe = None
    if config.sampling == "pipeline":
        pipe = Pipeline(rb, device=device, sample_count=n, base_seed=config.seed,
                        ring_depth=config.ring_depth, collector="external",
                        liveness_timeout=config.liveness_timeout)
    t_start = time.monotonic()
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    worker, stop = _start_collector(config, rb, weights, episodes, pipe)
    tick_s: list[float] = []
    bar = _progress(config)
    t_loop = time.monotonic()
    try:
        for t in range(config.ticks):
            t0 = time.perf_counter()
            if pipe is not None:
                for ahead in range(t, min(t + config.ring_depth, config.ticks)):
                    pipe.start_prepare(ahead, n, min_snapshot_ptr=config.snapshot_ptr(ahead))
                batch = pipe.sample_large_batch(t, n)
            else:
                ptr = config.snapshot_ptr(t)
                _wait_rows(rb, ptr, worker, config.liveness_timeout)
                packed = expected_batch(rb.storage, min(ptr, rb.capacity), n, config.seed + t)
                batch = rb.layout.views(packed.to(device))
            sac.train_tick(batch, config.updates_per_tick, config.batch_size)
            if pipe is not None:
                pipe.after_tick()
            weights.publish(t + 1, sac.actor_vector())
            tick_s.append(time.perf_counter() - t0)
            if bar is not None:
                _show(bar, t, sac, episodes, pipe, time.monotonic() - t_loop)
        loop_s = time.monotonic() - t_loop
    except BaseException:
        if isinstance(worker, _ThreadProcess) and worker.error is not None:
            raise CollectorDied(f"the SAC collector thread failed: {worker.error!r}"
                                ) from worker.error
        raise
    finally:
        if bar is not None:
            bar.close()
        stats = pipe.statistics() if pipe is not None else None
        stop.set()
        if pipe is not None:
            pipe.close()
        worker.join(timeout=30)
    result = _result(config, sac, episodes, tick_s, loop_s, t_loop,
                     time.monotonic() - t_start, stats)
    result["machine"]["loadavg_start"] = load_start  # other users of the cores, if any
    return result


def _progress(config: SACConfig) -> Any:
    if not config.progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError as exc:  # tqdm is the demo extra, not a library dependency
        raise ImportError("progress bars need tqdm: pip install 'replay-fsm[demo]', or "
                          "pass progress=False") from exc
    return tqdm(total=config.ticks, unit="tick", dynamic_ncols=True,
                desc=f"SAC {config.env} ({config.sampling})")


def _show(bar: Any, tick: int, sac: SAC, episodes: EpisodeLog, pipe: Pipeline | None,
          elapsed: float) -> None:
    bar.update(1)
    if tick % 50 and tick != bar.total - 1:
        return
    recent = [r[2] for r in episodes.rows(max(0, len(episodes) - 10))]
    post = {"return": f"{np.mean(recent):.0f}" if recent else "-",
            "critic": f"{sac.metrics().get('critic_loss', float('nan')):.3f}"}
    if pipe is not None and elapsed > 0:
        post["stall"] = f"{100 * pipe.statistics().learner_wait_s / elapsed:.0f}%"
    bar.set_postfix(post)


def _result(config: SACConfig, sac: SAC, episodes: EpisodeLog, tick_s: list[float],
            loop_s: float, t_loop: float, total_s: float, stats: Any) -> dict[str, Any]:
    eps = [{"env_steps": s, "wall_s": round(t - t_loop, 4), "return": r, "length": n}
           for s, t, r, n in episodes.rows()]
    steady = np.asarray(tick_s[len(tick_s) // 10:])  # early ticks wait for warm-up data
    final = [e["return"] for e in eps[-2 * config.num_envs:]]
    result: dict[str, Any] = {
        "config": asdict(config), "machine": machine(),
        "ticks": len(tick_s), "updates": len(tick_s) * config.updates_per_tick,
        "env_steps": config.snapshot_ptr(len(tick_s) + config.ring_depth - 1),
        "loop_s": loop_s, "total_s": total_s,
        # Tick 0 waits for the collector to start and warm up: the same work in both modes.
        "startup_s": tick_s[0] if tick_s else None,
        "tick_ms": {"mean": 1e3 * float(steady.mean()), "p50": 1e3 * float(np.median(steady)),
                    "p99": 1e3 * float(np.percentile(steady, 99))},
        "updates_per_s": len(tick_s) * config.updates_per_tick / loop_s,
        "final_return": float(np.mean(final)) if final else None,
        "metrics": sac.metrics(), "digest": sac.digest(), "episodes": eps,
    }
    if stats is not None:
        result["pipeline"] = {"stalls": stats.stalls, "learner_wait_s": stats.learner_wait_s,
                              "packs": stats.packs}
    return result


def machine() -> dict[str, Any]:
    """The facts a timing needs beside it."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "loadavg": load}


def compare(config: SACConfig) -> dict[str, Any]:
    """The same run through the pipeline and sampled synchronously, one after the other
    on this machine: wall-clock speed-up at the same number of updates, and whether the
    two learners ended bit-identical."""
    runs = {mode: train(replace(config, sampling=mode)) for mode in SAMPLING}
    pipe, sync = runs["pipeline"], runs["sync"]
    return {"runs": runs, "bit_identical": pipe["digest"] == sync["digest"],
            "speedup_vs_sync": sync["loop_s"] / pipe["loop_s"],
            "speedup_after_startup": ((sync["loop_s"] - sync["startup_s"])
                                      / (pipe["loop_s"] - pipe["startup_s"])),
            "tick_mean_ratio": sync["tick_ms"]["mean"] / pipe["tick_ms"]["mean"]}


def write(result: dict[str, Any], out: str | Path) -> Path:
    """Write ``result`` as JSON to ``out`` (a directory gets ``sac.json``)."""
    path = Path(out)
    if path.suffix != ".json":
        path.mkdir(parents=True, exist_ok=True)
        path = path / "sac.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
