"""The SAC trainer: a collector process steps a vector env, the learner takes large
batches through the pipeline (``sampling="pipeline"``) or samples them itself
(``sampling="sync"``, the baseline).

The schedule (lock-step, as the seed's ``sync_collection``): collection phase 0 is
the warm-up; phase k >= 1 uses actor weights version k, which the learner publishes
after tick k - 1. With ``lag = ring_depth - 1``, the batch of tick t is drawn from
the buffer as it stood after phase ``max(0, t - lag)``, i.e. at

    P(t) = (warmup_vector_steps + max(0, t - lag) * env_steps_per_tick) * num_envs

rows ever written, so collection of phase t runs while the learner trains on tick
t. Each tick makes ``updates_per_tick`` SAC updates on consecutive ``batch_size``
slices of its batch. ``train`` runs one configuration; ``compare`` runs it through
the pipeline and synchronously, interleaved in blocks of ticks on the same machine.

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

import atexit
import contextlib
import json
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from replay_fsm import (  # public API only
    MAX_RING_DEPTH,
    CollectorDied,
    DataStalled,
    Pipeline,
    ReplayBuffer,
)
from replay_fsm.core import as_int, as_seconds, as_seed, real_of, seconds_of
from replay_fsm.errors import setting
from replay_fsm.files import check_writable, make_folder, write_text
from replay_fsm.runtime.observers import steady_ticks
from replay_fsm.sampling import expected_batch
from replay_fsm.signals import Interrupted, signum_of
from replay_fsm.transfer import available_device
from replay_fsm.wire import MAX_SEED

from .collector import COLLECTOR_JOIN_S, end_collector, env_dims, start_collector, wait_rows
from .sac import SAC
from .shared import EpisodeLog, WeightRing

SAMPLING = ("pipeline", "sync")
COLLECTORS = ("process", "thread")

# SACConfig's fields that are counts (the seed, learner_threads also ints, checked on
# their own), and those that are real numbers (each with its range, as a test on the
# value and the words for it).
INT_FIELDS = ("num_envs", "batch_size", "updates_per_tick", "env_steps_per_tick", "ticks",
              "warmup_steps", "capacity", "ring_depth", "hidden")
REAL_FIELDS: dict[str, tuple[Callable[[float], bool], str]] = {
    "lr": (lambda x: 0 < x < math.inf, "> 0"),
    "gamma": (lambda x: 0 < x <= 1, "in (0, 1]"),  # as SAC itself takes it
    "tau": (lambda x: 0 < x <= 1, "in (0, 1]"),
}


def rows_name() -> str:
    """What a ``DataStalled`` calls the rows a tick waits for, P(t) of the module doc:
    the fields they come from, as ``errors.setting`` calls them."""
    return (f"the warm-up's {setting('warmup_steps')}, then "
            f"{setting('env_steps_per_tick')} x {setting('num_envs')} more a tick")


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
    # transitions with uniform random actions, before learning; >= 1: the first ticks
    # draw their batches from them (rounded up to whole vector steps)
    warmup_steps: int = 5_000
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

    def __post_init__(self) -> None:
        # A bound validate() takes (a Decimal, a numpy number) is kept as a float, and
        # a count as an int (a numpy integer): the trainer's waits compute with them,
        # and the result's JSON holds them (a numpy number is no JSON number). A bad
        # one stays as given, for validate() to name.
        seconds = seconds_of(self.liveness_timeout)
        if 0 < seconds < math.inf:
            object.__setattr__(self, "liveness_timeout", seconds)
        for name in (*INT_FIELDS, "seed", "learner_threads"):
            value = getattr(self, name)
            if value is not None and type(value) is not int:
                with contextlib.suppress(TypeError):
                    object.__setattr__(self, name, as_int(name, value))
        if isinstance(self.device, torch.device):
            object.__setattr__(self, "device", str(self.device))
        for name in REAL_FIELDS:
            value = getattr(self, name)
            number = real_of(value)  # as seconds are read: a Decimal too, no timedelta
            if type(value) is not float and number is not None:
                object.__setattr__(self, name, number)

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
            TypeError: an option of the wrong type (a count that is not an int, a
                rate that is not a real number, a flag that is not a bool), naming it
                (as ``replay_fsm.errors.setting`` calls it).
            ValueError: an option out of range, naming it and the fix."""
        for name in INT_FIELDS:
            as_int(name, getattr(self, name))  # the type: ranges below
        for name, (within, words) in REAL_FIELDS.items():
            value = getattr(self, name)
            if type(value) is not float:
                raise TypeError(f"{setting(name)} must be a real number {words}, got {value!r} "
                                f"of type {type(value).__name__}")
            if not within(value):
                raise ValueError(f"{setting(name)} must be {words}, got {value!r}")
        for name in ("env", "device", "sampling", "collector"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{setting(name)} must be a str, got {getattr(self, name)!r}")
        if not isinstance(self.progress, bool):
            raise TypeError(f"{setting('progress')} must be a bool, got {self.progress!r}")
        positive = ("num_envs", "batch_size", "updates_per_tick", "env_steps_per_tick",
                    "ticks", "warmup_steps", "capacity", "hidden")
        for name in positive:
            if getattr(self, name) < 1:
                why = (" (the first ticks' batches are drawn from the warm-up's rows: "
                       "with none there is nothing to sample)"
                       if name == "warmup_steps" else "")
                raise ValueError(f"{setting(name)} must be >= 1{why}, got "
                                 f"{getattr(self, name)}")
        if self.sampling not in SAMPLING:
            raise ValueError(f"{setting('sampling')} must be one of {SAMPLING}, got "
                             f"{self.sampling!r}")
        if self.collector not in COLLECTORS:
            raise ValueError(f"{setting('collector')} must be one of {COLLECTORS}, got "
                             f"{self.collector!r}")
        if not 2 <= self.ring_depth <= MAX_RING_DEPTH:
            raise ValueError(f"{setting('ring_depth')} must be between 2 and {MAX_RING_DEPTH}, got "
                             f"{self.ring_depth}")
        if self.ticks - 1 > MAX_SEED:  # no seed leaves room for them (seed + t < 2**63)
            raise ValueError(f"{setting('ticks')} must be at most 2**63, got {self.ticks}")
        try:
            seed = as_seed(self.seed, "seed")  # ints and numpy integers
        except (TypeError, ValueError):
            seed = -1  # refused below, with the bound the run's ticks set
        if not 0 <= seed <= MAX_SEED - (self.ticks - 1):
            raise ValueError(f"{setting('seed')} must be an int >= 0 and at most 2**63 minus "
                             f"the ticks to run ({setting('ticks')} {self.ticks}; tick t's "
                             f"batch is drawn with seed + t), got {self.seed!r}")
        as_seconds("liveness_timeout", self.liveness_timeout)
        available_device(self.device)  # the library's error, before anything starts
        if self.learner_threads is not None and as_int(
                "learner_threads", self.learner_threads) < 1:
            raise ValueError(f"{setting('learner_threads')} must be None or >= 1, got "
                             f"{self.learner_threads}")
        written = self.snapshot_ptr(self.ticks + self.ring_depth)
        if self.sampling == "sync" and written > self.capacity:
            capacity, ticks = setting("capacity"), setting("ticks")
            raise ValueError(f"{setting('sampling')}='sync' reads the storage while the "
                             f"collector appends, so the ring must not wrap: {capacity} "
                             f"{self.capacity} < {written} rows this run writes; raise "
                             f"{capacity} or lower {ticks}")


class RunInterrupted(Interrupted):
    """A stop signal (Ctrl-C; under the CLI's handlers SIGTERM or SIGHUP too) stopped
    a run (``signum`` says which) after everything was stopped and joined; ``result``
    is what it did until then, as ``train`` or ``compare`` would return it, with
    ``interrupted`` true and no speed-up. A KeyboardInterrupt: code that stops on
    Ctrl-C still does."""

    def __init__(self, signum: int, result: dict[str, Any]) -> None:
        super().__init__(signum)
        self.result = result

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.signum, self.result), vars(self)


class Trainer:
    """One SAC run that can advance a number of ticks at a time (``compare`` interleaves
    two). Its clock counts only the time spent inside ``run``.

    Raises:
        ValueError: a bad option (``SACConfig.validate``), or the env is not SAC's.
    """

    def __init__(self, config: SACConfig, bar_position: int = 0) -> None:
        config.validate()
        if config.learner_threads is not None:
            torch.set_num_threads(config.learner_threads)
        self.config = config
        obs_dim, action_dim = env_dims(config.env)
        self.device = torch.device(config.device)
        self.rb = ReplayBuffer(config.capacity, obs_dim, action_dim)
        self.sac = SAC(obs_dim, action_dim, hidden=config.hidden, lr=config.lr,
                       gamma=config.gamma, tau=config.tau, device=self.device,
                       seed=config.seed)
        self.weights = WeightRing(self.sac.actor_vector().numel(),
                                  slots=config.ring_depth + 1)
        self.episodes = EpisodeLog()
        self.pipe: Pipeline | None = None
        if config.sampling == "pipeline":
            self.pipe = Pipeline(self.rb, device=self.device,
                                 sample_count=config.sample_count, base_seed=config.seed,
                                 ring_depth=config.ring_depth, collector="external",
                                 liveness_timeout=config.liveness_timeout,
                                 # as the synchronous trainer's wait_rows: no row added
                                 # for liveness_timeout fails the run. A stall names
                                 # this config's fields (as errors.setting calls them)
                                 stall_timeout=config.liveness_timeout,
                                 stall_timeout_name=setting("liveness_timeout"),
                                 min_snapshot_ptr_name=rows_name())
        self.worker: Any = None
        self.stop: Any = None
        self._at_exit: Callable[[], None] | None = None  # ends the collector if never closed
        self.tick = 0
        self.tick_s: list[float] = []
        self.blocks: list[tuple[float, float]] = []  # monotonic (start, end) of each run
        self.load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
        self._bar = _progress(config, bar_position)

    @property
    def own_s(self) -> float:
        """Seconds spent inside ``run`` so far."""
        return sum(end - start for start, end in self.blocks)

    def run(self, ticks: int) -> None:
        """Advance ``ticks`` ticks (fewer at the end of the run).

        Raises:
            CollectorDied: the collector died or fell silent.
            KeyboardInterrupt: after everything is stopped and joined.
        """
        config, pipe, n = self.config, self.pipe, self.config.sample_count
        start = time.monotonic()
        if self.worker is None:  # the collector's start-up belongs to this trainer's time
            self.worker, self.stop, self._at_exit = start_collector(
                config, self.rb, self.weights, self.episodes, pipe)
        stop_at = min(self.tick + ticks, config.ticks)
        try:
            for t in range(self.tick, stop_at):
                t0 = time.perf_counter()
                if pipe is not None:
                    for ahead in range(t, min(t + config.ring_depth, config.ticks)):
                        pipe.start_prepare(ahead, n, min_snapshot_ptr=config.snapshot_ptr(ahead))
                    batch = pipe.sample_large_batch(t, n)
                else:
                    ptr = config.snapshot_ptr(t)
                    wait_rows(self.rb, ptr, self.worker, config.liveness_timeout)
                    packed = expected_batch(self.rb.storage, min(ptr, self.rb.capacity), n,
                                            config.seed + t)
                    batch = self.rb.layout.views(packed.to(self.device))
                self.sac.train_tick(batch, config.updates_per_tick, config.batch_size)
                if pipe is not None:
                    pipe.after_tick()
                self.weights.publish(t + 1, self.sac.actor_vector())
                self.tick_s.append(time.perf_counter() - t0)
                self.tick = t + 1
                if self._bar is not None:
                    _show(self._bar, t, self)
            if self.tick == config.ticks:
                # The last publish started the collection phase of version ``ticks``,
                # which ``env_steps`` counts: wait for it, so that both samplings end
                # with the same episodes (the pipeline's close used to stop it first).
                wait_rows(self.rb, config.snapshot_ptr(config.ticks + config.ring_depth - 1),
                          self.worker, config.liveness_timeout)
        except BaseException as exc:
            # A collector found dead (stopped, stuck) is not given time to leave.
            self.close(hung=isinstance(exc, (CollectorDied, DataStalled)))
            error = getattr(self.worker, "error", None)
            if error is not None:
                raise CollectorDied(f"the SAC collector thread failed: {error!r}") from error
            raise
        finally:
            self.blocks.append((start, time.monotonic()))

    def result(self, interrupted: bool = False) -> dict[str, Any]:
        """The run's figures, episodes and learner digest; ``interrupted``: the run
        stopped before its last tick."""
        stats = self.pipe.statistics() if self.pipe is not None else None
        result = _result(self, stats)
        result["interrupted"] = interrupted
        result["machine"]["loadavg_start"] = self.load_start  # other users of the cores
        return result

    def close(self, *, hung: bool = False) -> None:
        """Stop the collector and the pipeline; idempotent. The collector is told and
        ended even when a step before raised (a second Ctrl-C, say): a collector
        process ignores SIGTERM, so one left running would hang the interpreter's
        exit; it is SIGKILLed if it does not leave within COLLECTOR_JOIN_S, or at once
        when ``hung`` (the run found it dead or stalled: CollectorDied, DataStalled)."""
        try:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            if self.pipe is not None:
                self.pipe.close()
        finally:
            if self.worker is not None:
                end_collector(self.stop, self.worker, COLLECTOR_JOIN_S, hung=hung)
            if self._at_exit is not None:
                atexit.unregister(self._at_exit)
                self._at_exit = None

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def own_time(self, monotonic_s: float) -> float:
        """A monotonic instant as this trainer's clock: its time inside ``run`` before
        that instant (an instant between runs counts as the end of the previous one)."""
        own = 0.0
        for start, end in self.blocks:
            if monotonic_s <= start:
                break
            own += min(monotonic_s, end) - start
        return own


def train(config: SACConfig) -> dict[str, Any]:
    """Run SAC as configured, start to end; returns ``Trainer.result()``.

    Raises:
        ValueError: a bad option (``SACConfig.validate``), or the env is not SAC's.
        CollectorDied: the collector died or fell silent.
        RunInterrupted: a stop signal, after everything is stopped and joined;
            its ``result`` is the run so far.
        Any error after the first tick carries the run so far as its ``result``
        (``interrupted`` true, ``error`` naming it): see ``keep_result``.
    """
    with Trainer(config) as trainer:
        try:
            trainer.run(config.ticks)
        except KeyboardInterrupt as exc:
            raise RunInterrupted(signum_of(exc), trainer.result(interrupted=True)) from exc
        except Exception as exc:
            if trainer.tick:
                keep_result(exc, lambda: trainer.result(interrupted=True))
            raise
        return trainer.result()


def keep_result(error: Exception, result: Callable[[], dict[str, Any]]) -> None:
    """Give ``error``, which stopped a run after some ticks (the collector died, say),
    that run so far as ``error.result``, with ``"error"`` naming it, so that hours of
    training are not lost with it: the CLI writes it as an interrupted run's. Where
    ``result()`` itself fails, ``error`` goes on without one."""
    try:
        kept = result()
    except Exception:  # noqa: BLE001 - the error that stopped the run is the one to see
        return
    kept["error"] = f"{type(error).__name__}: {error}"
    with contextlib.suppress(AttributeError, TypeError):  # a frozen exception: none
        error.result = kept  # type: ignore[attr-defined]


def _progress(config: SACConfig, position: int) -> Any:
    if not config.progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError as exc:  # a dependency of replay-fsm's, removed since
        raise ImportError("progress bars need tqdm: pip install tqdm, or pass "
                          "progress=False") from exc
    return tqdm(total=config.ticks, unit="tick", dynamic_ncols=True, position=position,
                desc=f"SAC {config.env} ({config.sampling:8s})")


def _show(bar: Any, tick: int, trainer: Trainer) -> None:
    bar.update(1)
    if tick % 50 and tick != bar.total - 1:
        return
    episodes = trainer.episodes
    recent = [r[2] for r in episodes.rows(max(0, len(episodes) - 10))]
    post = {"return": f"{np.mean(recent):.0f}" if recent else "-",
            "critic": f"{trainer.sac.metrics().get('critic_loss', float('nan')):.3f}"}
    if trainer.pipe is not None:
        post["stall"] = f"{trainer.pipe.statistics().stalls} waits"
    bar.set_postfix(post)


def _result(trainer: Trainer, stats: Any) -> dict[str, Any]:
    config, tick_s = trainer.config, trainer.tick_s
    eps = [{"env_steps": s, "wall_s": round(trainer.own_time(t), 4), "return": r,
            "length": n} for s, t, r, n in trainer.episodes.rows()]
    steady = np.asarray(steady_ticks(tick_s))
    final = [e["return"] for e in eps[-2 * config.num_envs:]]
    loop_s = trainer.own_s
    result: dict[str, Any] = {
        "config": asdict(config), "machine": machine(),
        "ticks": len(tick_s), "updates": len(tick_s) * config.updates_per_tick,
        "env_steps": config.snapshot_ptr(len(tick_s) + config.ring_depth - 1),
        "loop_s": loop_s, "blocks": len(trainer.blocks),
        # Tick 0 waits for the collector to start and warm up: the same work in both modes.
        "startup_s": tick_s[0] if tick_s else None,
        # None with no tick done (a run interrupted at once): JSON has no NaN
        "tick_ms": {"mean": 1e3 * float(steady.mean()), "p50": 1e3 * float(np.median(steady)),
                    "p99": 1e3 * float(np.percentile(steady, 99))} if steady.size else
                   {"mean": None, "p50": None, "p99": None},
        "updates_per_s": len(tick_s) * config.updates_per_tick / loop_s if loop_s else None,
        "final_return": float(np.mean(final)) if final else None,
        "metrics": trainer.sac.metrics(), "digest": trainer.sac.digest(), "episodes": eps,
        "episodes_dropped": trainer.episodes.dropped,  # the oldest, past the log's capacity
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


def compare(config: SACConfig, block: int = 250) -> dict[str, Any]:
    """The same run through the pipeline and sampled synchronously, interleaved in blocks
    of ``block`` ticks on this machine (so that load from elsewhere hits both alike):
    the wall-clock speed-up at the same number of updates, the per-round ratios, and
    whether the two learners ended bit-identical.

    Raises:
        RunInterrupted: a stop signal; its ``result`` holds both runs so far and
            the rounds done, with no speed-up (the runs may stand at different ticks).
        Any error after the first tick carries the same as its ``result``, with
        ``error`` (``keep_result``).
    """
    with Trainer(replace(config, sampling="pipeline"), 0) as pipe, \
            Trainer(replace(config, sampling="sync"), 1) as sync:
        rounds: list[float] = []

        def so_far() -> dict[str, Any]:
            runs = {"pipeline": pipe.result(interrupted=True),
                    "sync": sync.result(interrupted=True)}
            return {"runs": runs, "interrupted": True, "block_ticks": block,
                    "round_ratios": rounds}
        try:
            for i, _ in enumerate(range(0, config.ticks, block)):
                order = (pipe, sync) if i % 2 == 0 else (sync, pipe)  # ABBA: no order bias
                took = {}
                for trainer in order:
                    before = trainer.own_s
                    trainer.run(block)
                    took[trainer.config.sampling] = trainer.own_s - before
                rounds.append(took["sync"] / took["pipeline"])
        except KeyboardInterrupt as exc:
            raise RunInterrupted(signum_of(exc), so_far()) from exc
        except Exception as exc:
            if pipe.tick or sync.tick:
                keep_result(exc, so_far)
            raise
        runs = {"pipeline": pipe.result(), "sync": sync.result()}
    return _comparison(runs, block, rounds)


def _comparison(runs: dict[str, dict[str, Any]], block: int, rounds: list[float]
                ) -> dict[str, Any]:
    """``compare``'s result from its two finished runs."""
    p, s = runs["pipeline"], runs["sync"]
    return {"runs": runs, "bit_identical": p["digest"] == s["digest"], "block_ticks": block,
            "speedup_vs_sync": s["loop_s"] / p["loop_s"],
            # None with one tick: nothing is left after tick 0 but noise.
            "speedup_after_startup": ((s["loop_s"] - s["startup_s"])
                                      / (p["loop_s"] - p["startup_s"])
                                      if min(p["ticks"], s["ticks"]) > 1 else None),
            "round_ratios": rounds, "round_ratio_median": float(np.median(rounds)),
            "interrupted": False}


def output_path(out: str | Path, *, before_run: bool = False) -> Path:
    """Where ``write`` puts a result for ``out``: ``out`` itself when it ends in
    .json (any case), else ``out/sac.json`` (``res.json/`` and ``res.json/.`` name a
    folder: the path would drop the slash, or the ``/.``, and write a file). Makes its folder and
    checks that a file can be written there, so a run finds out before it trains, not
    after; ``before_run`` also checks the paths written beside it (``write`` itself
    does not: a plot that cannot be drawn must not cost the result).

    Raises:
        OSError: the folder cannot be made, or is not writable.
        IsADirectoryError: the .json path is a folder, or (``before_run``) its plot's
            path (``<name>.png``) is.
        NotADirectoryError: the folder is a file.
        ValueError: ``out`` is empty (an unset shell variable, say; ``.`` names the
            current folder).
    """
    if str(out) == "":  # Path("") is ".": a wish for the current folder it is not
        raise ValueError("--out '' names no folder or file; write --out . for the "
                         "current folder")
    path = Path(out)
    # res.JSON is a file too, not a folder; res.json/ and res.json/. are folders (Path
    # drops a trailing slash and "/.": the last name as written says)
    if path.suffix.lower() != ".json" or os.path.basename(os.fspath(out)) in ("", "."):
        path = path / "sac.json"
    if path.parent.exists() and not path.parent.is_dir():
        raise NotADirectoryError(f"{path.parent} is a file, not a folder; --out names a "
                                 "folder or a .json file")
    make_folder(path.parent)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder, and an --out ending in .json names "
                                f"the result's file; write --out {path}/ to write into "
                                "the folder")
    plot = path.with_suffix(".png")
    if before_run and plot.is_dir():  # else found after the run
        raise IsADirectoryError(f"{plot} is a folder, where the run writes its plot")
    check_writable([path, plot] if before_run else [path])
    return path


def write(result: dict[str, Any], out: str | Path) -> Path:
    """Write ``result`` as JSON to ``output_path(out)``; returns that path. Whole or
    not at all (``replay_fsm.files``): a run stopped while it writes leaves the file
    there before.

    Raises:
        ValueError: ``out`` is empty (``"."`` names the current folder), as
            ``output_path`` says, with its other errors.
    """
    return write_text(output_path(out), json.dumps(result, indent=2) + "\n")
