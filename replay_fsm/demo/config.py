"""What a demo run is: one frozen, picklable record for the CLI, the tests and the
distributed launcher (which derives each rank's copy with ``for_rank``)."""

from __future__ import annotations

import contextlib
import dataclasses
import signal
from dataclasses import dataclass
from pathlib import Path

from ..core import as_int, as_ring_depth, as_seconds, as_seed
from ..errors import setting
from ..signals import STOP_SIGNALS

# The longest peer_timeout: torch keeps a collective's timeout in nanoseconds (an int64,
# 292 years); one past that failed inside every rank once it had started (an
# OverflowError, or a "timed out after 10000000000000ms" at once).
MAX_PEER_TIMEOUT_S = 1e9


@dataclass(frozen=True)
class DemoConfig:
    """A demo run.

    The run: ``ticks``, ``device``, ``ring_depth``, ``collector`` ("process" or
    "thread"), ``out`` (the output folder), ``checked`` (checked mode),
    ``sample_count``, ``capacity`` (replay rows), ``envs`` (parallel environments),
    ``seed`` (environment and network seeds; a rank's environments take
    ``collector_seed``), ``progress`` (a tqdm bar),
    ``learner_threads`` (torch threads of the learner; 1 leaves the collector a core
    on a small machine, None keeps torch's default), ``liveness_timeout`` (the
    pipeline's: seconds the learner waits on a silent collector, or for rows that
    stopped coming, before the run fails).

    One rank of a multi-rank run: ``rank`` (None: a single-process run),
    ``base_seed`` (the batches' seed, default ``seed``; see
    ``replay_fsm.distributed.rank_seed``) and ``peer_timeout`` (seconds a rank waits
    in an all-reduce for the others before it fails: a rank stopped or stuck would
    otherwise hold the job for torch's 30 minutes).

    Checks and fault injection, for tests: ``collect_steps`` stops the collector
    stepping after that many steps (the storage then holds still) and
    ``verify_data`` checks every batch bit for bit (INV-DATA);
    ``kill_collector_at`` SIGKILLs the collector process at that tick, and
    ``freeze_collector_at`` SIGSTOPs it (a collector stuck for good);
    ``freeze_at`` SIGSTOPs this rank at that tick (a rank only: a stuck peer);
    ``interrupt_at`` sends ``interrupt_signal`` (SIGINT, Ctrl-C; SIGTERM, a
    scheduler's stop; or SIGHUP, a closed terminal) at that tick to this process, or
    for a rank, to its whole process group as a terminal or a batch scheduler does
    (start its launcher in a session of its own).

    Raises:
        TypeError, ValueError: a field of the wrong type or out of range (named as
            ``replay_fsm.errors.setting`` calls it, with the value).
    """

    ticks: int = 300
    device: str = "cpu"
    ring_depth: int = 2
    collector: str = "process"
    out: str | Path = "demo-out"
    checked: bool = False
    sample_count: int = 8192
    capacity: int = 200_000
    envs: int = 128
    seed: int = 0
    progress: bool = True
    learner_threads: int | None = 1
    rank: int | None = None
    base_seed: int | None = None
    collect_steps: int | None = None
    verify_data: bool = False
    kill_collector_at: int | None = None
    freeze_collector_at: int | None = None
    freeze_at: int | None = None
    peer_timeout: float = 120.0
    liveness_timeout: float = 30.0
    interrupt_at: int | None = None
    interrupt_signal: int = signal.SIGINT

    def __post_init__(self) -> None:
        # A count read from numpy is taken and kept as a plain int (the summary's JSON
        # holds some), as SACConfig keeps its own; a bool is refused.
        for name in ("ticks", "sample_count", "capacity", "envs", "learner_threads"):
            value = getattr(self, name)
            if value is None and name == "learner_threads":
                continue
            try:
                number = as_int(name, value)
            except TypeError:
                number = 0  # refused below, in the words the command line shows
            if number < 1:
                words = "None or an int" if name == "learner_threads" else "an int"
                raise ValueError(f"{setting(name)} must be {words} >= 1, got {value!r}")
            object.__setattr__(self, name, number)
        for name in ("seed", "rank", "base_seed", "collect_steps", "kill_collector_at",
                     "freeze_collector_at", "freeze_at", "interrupt_at"):
            value = getattr(self, name)  # checked where it is used
            if value is not None and type(value) is not int:
                with contextlib.suppress(TypeError):
                    object.__setattr__(self, name, as_int(name, value))
        # the seeds as the pipeline reads its base seed, here rather than once a run
        # has started (seed=-1 failed the run, naming base_seed)
        as_seed(self.seed, "seed")
        if self.base_seed is not None:
            as_seed(self.base_seed, "base_seed")
        if self.interrupt_signal not in STOP_SIGNALS:
            raise ValueError("interrupt_signal must be a stop signal ("
                             + ", ".join(signal.Signals(s).name for s in STOP_SIGNALS)
                             + f"), got {self.interrupt_signal!r}")
        # here, not in each rank of a launch
        object.__setattr__(self, "ring_depth", as_ring_depth(self.ring_depth))
        peer_timeout = as_seconds("peer_timeout", self.peer_timeout)
        if peer_timeout > MAX_PEER_TIMEOUT_S:
            raise ValueError(f"{setting('peer_timeout')} must be at most "
                             f"{MAX_PEER_TIMEOUT_S:g} s (about "
                             f"31 years; torch holds a collective's timeout in nanoseconds), "
                             f"got {self.peer_timeout!r}")
        # Kept as floats: a Decimal or a numpy number, taken as seconds, is no timedelta's
        # seconds, and no JSON number in a summary
        object.__setattr__(self, "peer_timeout", peer_timeout)
        object.__setattr__(self, "liveness_timeout",
                           as_seconds("liveness_timeout", self.liveness_timeout))
        if self.collector not in ("process", "thread"):
            raise ValueError(f"{setting('collector')} must be 'process' or 'thread', got "
                             f"{self.collector!r}")

    @property
    def batch_seed(self) -> int:
        """The base seed of the batches (INV-DATA)."""
        return self.seed if self.base_seed is None else self.base_seed

    @property
    def collector_seed(self) -> int:
        """The seed of the collector's environments: ``seed + rank`` for a rank, so
        each rank collects its own experience (the network's seed, ``seed``, is every
        rank's: data-parallel replicas start equal and, their gradients averaged,
        stay equal)."""
        return self.seed + (self.rank or 0)

    @property
    def suffix(self) -> str:
        """The file-name suffix of this rank's outputs ("" for a single run)."""
        return "" if self.rank is None else f"-rank{self.rank}"

    def for_rank(self, rank: int, base_seed: int, device: str) -> DemoConfig:
        """This run as rank ``rank`` of a multi-rank job: its own batches, environments
        (``collector_seed``) and device; the same network as every rank."""
        return dataclasses.replace(self, rank=rank, base_seed=base_seed,
                                   device=device, progress=False,
                                   collector="process")
