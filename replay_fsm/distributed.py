"""One pipeline per rank under torch.distributed.

The pattern: every rank owns its replay buffer, its collector(s) and its
pipeline on its own device, and draws different but reproducible batches:

    base_seed_of_rank = base_seed + rank * RANK_SEED_STRIDE      (rank_seed)

with RANK_SEED_STRIDE = 2**24, so tick t of rank r samples with seed
``base_seed + r * 2**24 + t``. torch's CPU generator keeps only the low 32 bits of a
seed, so the stride must stay below 2**32: with 2**24, up to 256 ranks draw from
distinct seeds for their first 16,777,216 ticks each (a test checks that two ranks
draw different batches). Each rank's batches follow INV-DATA with its own base seed.
The device comes from the local rank (``local_device``). Gradients
are averaged across ranks with ``all_reduce``. On one node, ``launch`` starts the
ranks with torch's own elastic launcher (what ``torchrun`` uses); on several nodes run
``torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HOST:PORT
-m replay_fsm.distributed --ticks ...`` on each node, a collector per rank (or per
node, feeding its ranks through ``collector="external"`` handles).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import fcntl
import glob
import json
import os
import signal
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from .core import as_count, as_seed
from .demo.config import DemoConfig
from .errors import (
    RankFailed,
    ReplayFSMError,
    first_line,
    naming_settings,
    setting,
    setting_names,
)
from .files import write_text
from .signals import (
    STOP_SIGNALS,
    WAIT_STOPS,
    Interrupted,
    children_start_blocked,
    handling,
    keeping_handlers,
    parent_death_signal,
    set_parent_death_signal,
    stop_signals_taken,
    stop_when_parent_ends,
    unblock_stop_signals,
)
from .transfer import available_device
from .wire import MAX_SEED

RANK_SEED_STRIDE = 1 << 24
MAX_RANKS = (1 << 32) // RANK_SEED_STRIDE  # rank 256 would draw rank 0's batches
# what torchrun (and launch) set for each rank
RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# the signals torch's elastic launcher handles (and leaves handled) on POSIX
LAUNCHER_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def rank_seed(base_seed: int, rank: int) -> int:
    """The base seed of ``rank``'s pipeline (documented formula above).

    Raises:
        TypeError: ``base_seed`` or ``rank`` is not an integer (a bool, a float).
        ValueError: ``rank`` is negative or ``MAX_RANKS`` (256) or more: torch keeps
            32 bits of a seed, so such a rank would draw a lower rank's batches;
            ``base_seed`` is negative, or the rank's seed is 2**63 or more.
    """
    rank = as_count("rank", rank)
    if rank >= MAX_RANKS:
        raise ValueError(f"rank must be in [0, {MAX_RANKS}), got {rank}: ranks are "
                         f"{RANK_SEED_STRIDE} seeds apart within torch's 32-bit seeds, so "
                         f"rank {MAX_RANKS} would draw rank 0's batches")
    seed = as_seed(base_seed) + rank * RANK_SEED_STRIDE
    if seed > MAX_SEED:
        raise ValueError(f"base_seed {base_seed} is too large for rank {rank}: its seed "
                         f"base_seed + rank * 2**24 = {seed} is 2**63 or more")
    return seed


def local_device(local_rank: int, device: str = "auto") -> torch.device:
    """``cuda:<local_rank>`` when CUDA is there (or asked for), else ``device``/cpu.

    For "cuda", the local rank modulo the GPUs this rank sees: a scheduler that
    shows each rank its own GPU (CUDA_VISIBLE_DEVICES per task) gives every rank its
    cuda:0. ``launch`` makes sure its ranks, which see the same GPUs, have one each.

    Raises:
        ValueError: a device this machine lacks (``transfer.available_device``), a
            negative ``local_rank``.
    """
    local_rank = as_count("local_rank", local_rank, 0)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    chosen = available_device(device)  # the library's errors for one it lacks
    if device == "cuda":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return chosen


class AgreedInterrupt:
    """A stop signal in a multi-rank run, as one decision: every rank stops at the
    same step.

    A rank's stop signal (the terminal's Ctrl-C, a scheduler's SIGTERM, a hangup, or
    the launcher forwarding its own) only records the signal. Each step's all-reduce
    first sums the ranks' flags; when any is set, every rank raises
    KeyboardInterrupt at that same step, after the same collectives, so no rank is
    left waiting in a collective the others never join (the launcher would kill it
    after 30 s), and each writes its summary and trace as a single-process run does
    on Ctrl-C. Installs its handlers for the life of the with-block (main thread
    only). ``peer_timeout``: the bound the process group was made with, for the
    error of a collective that ran out of it.

    A rank that waits for its batch (a pipeline's wait: its collector slow, stuck or
    stopped) reaches the step's all-reduce only when that wait ends, up to
    ``liveness_timeout`` later, while the other ranks wait in the all-reduce and the
    launcher kills them all 30 s after it forwarded the signal. So a stop signal also
    ends this rank's next or current wait for a batch, and only that
    (``WAIT_STOPS``: a KeyboardInterrupt at the wait's start or next slice, before
    the step's all-reduce), and the rank then calls ``all_reduce_mean`` once more
    (with any tensors, none needed): it joins the all-reduce of the other ranks'
    flags for that step, which raises KeyboardInterrupt on every rank there.
    """

    def __init__(self, peer_timeout: float | None = None) -> None:
        self.signum: int | None = None  # the stop signal this rank got, if any
        self.peer_timeout = peer_timeout
        self.agreed = False  # the ranks' flags said stop: every rank raised at one step
        # The device of the process group's tensors (NCCL's are CUDA): the flags of an
        # all-reduce given no tensors (a rank joining the agreement) go there too.
        self.device: torch.device | None = None

    @property
    def requested(self) -> bool:
        """This rank got a stop signal."""
        return self.signum is not None

    def __enter__(self) -> AgreedInterrupt:
        self._handling = handling(stop_signals_taken(), self._on_signal)
        self._handling.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._handling.__exit__(None, None, None)
        WAIT_STOPS.clear()  # for no wait after the block

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum
        if not WAIT_STOPS:
            WAIT_STOPS.append(KeyboardInterrupt())

    def all_reduce_mean(self, tensors: list[torch.Tensor]) -> None:
        """Average ``tensors`` across ranks, unless a rank asked to stop. Called
        after the ranks agreed to stop, it raises KeyboardInterrupt again, with no
        collective.

        Raises:
            KeyboardInterrupt: some rank got a stop signal (every rank raises here).
            RuntimeError: a collective failed: a rank is gone, or stopped or stuck for
                longer than ``peer_timeout`` (torch's error chained).
        """
        import torch.distributed as dist
        if self.agreed:
            raise KeyboardInterrupt
        device = (tensors[0].device if tensors
                  else self.device if self.device is not None else torch.device("cpu"))
        flags = torch.tensor([float(self.requested)], device=device)
        try:
            dist.all_reduce(flags)
            if flags.item() > 0:
                self.agreed = True
                WAIT_STOPS.clear()  # agreed here: no wait is to raise it again
                raise KeyboardInterrupt
            world = dist.get_world_size()
            for t in tensors:
                dist.all_reduce(t)
                t.div_(world)
        except RuntimeError as exc:
            bound = "" if self.peer_timeout is None else f" for {self.peer_timeout:g} s"
            raise RuntimeError(f"an all-reduce across the ranks failed: a rank is gone, or "
                               f"did not join it{bound} ({setting('peer_timeout')}; stopped "
                               f"or stuck): {exc}") from exc


def rank_main(config: DemoConfig, kill_rank: int | None = None,
              settings: dict[str, str] | None = None) -> dict[str, Any]:
    """The body of one rank: ``config`` as this rank (its seeds and device), its
    collector, its pipeline, all-reduced gradients. ``config.kill_collector_at``,
    ``freeze_collector_at``, ``interrupt_at`` and ``freeze_at`` apply only to ``kill_rank``
    (fault injection for tests). Ctrl-C stops every rank at the same step
    (``AgreedInterrupt``), and so does the end of the rank's launcher (``launcher_pid``),
    however it ended, where Linux can tell (``signals.stop_when_parent_ends``: a SIGTERM
    then, as if the launcher had forwarded one; elsewhere the ranks of a launcher
    killed with SIGKILL run on). ``settings``: how the rank's messages name its settings
    (``errors.naming_settings``; ``launch`` passes its own process's, so that the
    ranks of a command name its options).

    Raises:
        RuntimeError: outside a rank (``RANK``, ``WORLD_SIZE``, ... not set).
    """
    if settings:
        with naming_settings(settings):
            return rank_main(config, kill_rank)
    import torch.distributed as dist

    from .demo import run
    missing = [name for name in RANK_ENV if name not in os.environ]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not set: rank_main is the body of a rank "
                           "that launch() or torchrun starts")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    launcher = launcher_pid()
    # put back at the end: rank_main called from Python leaves its caller's as it was
    death_signal = parent_death_signal()
    out = Path(config.out)
    try:
        with AgreedInterrupt(config.peer_timeout) as interrupt:
            # Until the ranks have joined, a stop signal ends this rank at once, as its
            # default does: nothing is written yet, and a rank waiting in the
            # rendezvous for one that died must not make the launcher wait its 30 s
            # (Python's handlers run only once torch's wait returns). One sent while
            # the rank started up (``launch`` starts it with them blocked) ends it
            # here: not inside torch's import (a traceback, or swallowed there).
            with handling(stop_signals_taken(), signal.SIG_DFL):
                # A launcher that is gone (SIGKILL, the OOM killer) forwards nothing:
                # its end sends SIGTERM here, a stop as if it had forwarded one.
                stop_when_parent_ends(launcher)
                unblock_stop_signals()
                device = local_device(local_rank, config.device)
                backend = "nccl" if device.type == "cuda" else "gloo"
                interrupt.device = device  # NCCL all-reduces CUDA tensors only
                if device.type == "cuda":
                    torch.cuda.set_device(device)
                # A bound on each collective: a peer stopped or stuck fails the job
                # after peer_timeout, not after torch's default of 30 minutes.
                try:
                    dist.init_process_group(
                        backend, timeout=datetime.timedelta(seconds=config.peer_timeout))
                except dist.DistError as exc:  # the store's, the network's: as a collective's
                    raise RuntimeError(
                        f"the ranks' rendezvous failed: a rank is gone, or did not join it "
                        f"for {config.peer_timeout:g} s ({setting('peer_timeout')}; "
                        f"stopped or stuck as it started): {exc}") from exc
            # From here a stop signal is recorded, and every rank stops at one step.
            mine = config.for_rank(rank, rank_seed(config.batch_seed, rank), str(device))
            if rank != kill_rank:
                mine = dataclasses.replace(mine, kill_collector_at=None, interrupt_at=None,
                                           freeze_at=None, freeze_collector_at=None)
            summary = run(mine, all_reduce=interrupt.all_reduce_mean)
        if interrupt.signum is not None:
            # This rank got a stop signal. A launcher that is stopping (the terminal's
            # Ctrl-C reached it too, or it forwarded its own) reads no result: a rank
            # that returned one would wait for that read until the launcher kills
            # it, 30 s on. One that is not stopping (the signal came to the ranks
            # alone) waits for every rank's result for ever, and torch takes a
            # KeyboardInterrupt for a clean exit without one. So the rank exits
            # with the shell's code for that signal: a failure either launcher ends
            # the job on. Its files are written. A rank that stopped only because
            # another asked (on another node, say) returns its summary as usual.
            raise SystemExit(128 + interrupt.signum)
    except ReplayFSMError as exc:
        if getattr(exc, "summary", None) is None:  # else run() wrote the run so far
            write_text(out / f"summary-rank{rank}.json", json.dumps(
                {"rank": rank, "error": f"{type(exc).__name__}: {exc}"}, indent=2) + "\n")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if death_signal is not None:
            set_parent_death_signal(death_signal)
    return summary


def launcher_pid() -> int:
    """The pid of the process that started this rank: the one that spawned it where
    multiprocessing did (``launch``'s ranks; known even where it has ended since),
    else this process's parent now (torchrun's: one that ended before this call goes
    unnoticed, as torchrun records no pid for its ranks to check). A rank that a
    forkserver started (``start_method="forkserver"``) has the forkserver for its
    parent while its spawner lives: the forkserver's pid then, which ends with the
    spawner (the spawner's own pid, never this process's parent, read as a launcher
    gone and the rank stopped itself as it started)."""
    import multiprocessing
    spawner = multiprocessing.parent_process()
    parent = os.getppid()
    if spawner is None or spawner.pid is None or spawner.pid == parent:
        return parent
    return parent if spawner.is_alive() else spawner.pid


# What each rank writes to the run's folder (``DemoConfig.suffix``).
RANK_FILES = ("trace-rank{rank}.json", "transitions-rank{rank}.jsonl",
              "summary-rank{rank}.json")


def merge_traces(out: Path, nproc: int) -> Path | None:
    """One Perfetto trace with a process track per rank; None, and no file, where no
    rank wrote its trace (a stop before they started)."""
    events: list[dict[str, Any]] = []
    written = [out / f"trace-rank{rank}.json" for rank in range(nproc)]
    written = [path for path in written if path.exists()]
    if not written:
        return None
    for path in written:
        events += json.loads(path.read_text())["traceEvents"]
    merged = out / "trace.json"
    write_text(merged, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return merged


def launch(nproc: int, config: DemoConfig, *, kill_rank: int | None = None
           ) -> dict[int, Any]:
    """Start ``nproc`` ranks of the demo ``config`` on this node with torch's elastic
    launcher; returns each rank's summary. If one rank fails, the launcher stops the
    others and raises. The ranks' messages name their settings as this process's do
    (``errors.setting_names``: a command's ranks name its options). The files an
    earlier run left in ``config.out`` for its ranks (``RANK_FILES``, whatever their
    number) and its merged trace are removed first, and the launcher folders of
    earlier launches whose launcher is gone (killed before it pruned them:
    ``prune_gone_launches``); this launch holds its lock file there (``launch_lock``)
    until it returns.
    The ranks start with the stop signals blocked: one sent while they start up ends
    them once they have, an interrupt with nothing written (``rank_main``); one that
    reaches the launcher while it starts them acts once it has started them all. A
    launcher killed with SIGKILL forwards nothing: on Linux its end is a SIGTERM to
    each rank (``rank_main``), which stop as for the launcher's own.

    Raises:
        replay_fsm.signals.Interrupted: a KeyboardInterrupt for the launcher's Ctrl-C,
            SIGTERM or SIGHUP (``signum`` says which), or for one sent to a rank alone;
            every rank stopped at the same step and wrote its summary and trace
            (``AgreedInterrupt``), and the traces are merged.
        RankFailed: a rank failed (its error, its collector's death, a signal that
            killed it); the launcher stopped the others.
        TypeError, ValueError: ``nproc`` is not an int in [1, 256], the last rank's
            seed is too large, or the device is one this machine lacks (before any
            rank starts).
        NotADirectoryError: ``config.out`` is a file (before any rank starts).
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig
    nproc = as_count("nproc", nproc, 1)
    if nproc > MAX_RANKS:
        raise ValueError(f"nproc must be in [1, {MAX_RANKS}], got {nproc}")
    rank_seed(config.batch_seed, nproc - 1)  # before any rank starts, not in the last one
    device = local_device(0, config.device)  # "cuda" without CUDA, the same
    if device.type == "cuda" and nproc > 1:  # ranks sharing a GPU: nccl refuses, in each
        if config.device not in ("auto", "cuda"):
            raise ValueError(f"device {config.device!r} would put all {nproc} ranks on one "
                             "GPU (nccl needs one per rank): --device cuda gives rank k "
                             "cuda:k")
        if nproc > torch.cuda.device_count():
            raise ValueError(f"{nproc} ranks on {torch.cuda.device_count()} GPUs: nccl needs "
                             "one per rank (fewer ranks, or --device cpu)")
    from .demo.runner import output_folder
    from .files import make_folder
    out = output_folder(config.out)
    make_folder(out)
    # An earlier run's files, which a rank that fails early (or a launcher killed
    # before it merges the traces) would leave looking current; an earlier run's
    # ranks past this run's too (they would read as this run's).
    (out / "trace.json").unlink(missing_ok=True)
    for name in RANK_FILES:
        prefix, suffix = name.split("{rank}")
        for path in out.glob(f"{prefix}*{suffix}"):
            if path.name[len(prefix):-len(suffix)].isdigit():
                path.unlink(missing_ok=True)
    run_id = f"replay_fsm-{uuid.uuid4().hex[:8]}"
    logs = out / "launcher-logs"
    prune_gone_launches(logs)  # a launcher killed (SIGKILL) never pruned its own
    with launch_lock(logs, run_id):
        return _launch(nproc, config, kill_rank, out, run_id, LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=run_id,
            rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",
            max_restarts=0, monitor_interval=0.1, start_method="spawn",
            # the launcher's per-rank logs: by default a new folder in the system's
            # temp folder at every launch, never removed
            logs_specs=DefaultLogsSpecs(log_dir=str(logs)),
            **_launcher_signals(LaunchConfig)))


def _launch(nproc: int, config: DemoConfig, kill_rank: int | None, out: Path, run_id: str,
            launch_config: Any) -> dict[int, Any]:
    """``launch``'s run of the ranks, once its checks are made and its lock is held."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    try:
        # torch's launcher installs handlers for these and leaves them: ours come back.
        # The ranks start with the stop signals blocked (rank_main unblocks them once
        # it has started up): one sent while they import torch waits for them.
        with keeping_handlers(LAUNCHER_SIGNALS), children_start_blocked(STOP_SIGNALS), \
                handling(stop_signals_taken(), _stop_launcher), \
                _stops_after_the_start(LocalElasticAgent):
            results = elastic_launch(launch_config, rank_main)(config, kill_rank,
                                                               setting_names())
    except SignalException as exc:
        if exc.sigval not in STOP_SIGNALS:
            raise
        # a stop signal: the launcher forwarded it, the ranks stopped together
        # and wrote their files (AgreedInterrupt), or ended before they had joined;
        # to the caller it is an interrupt.
        raise Interrupted(exc.sigval) from exc
    except ChildFailedError as exc:
        # rank_main's exit for a stop signal sent to that rank alone (every rank
        # stopped at the same step and wrote its files, as for the launcher's), or
        # the signal itself, before the ranks had joined (nothing written yet)
        stops = {code: s for s in STOP_SIGNALS for code in (128 + s, -s)}
        if all(f.exitcode in stops for f in exc.failures.values()):
            raise Interrupted(stops[exc.get_first_failure()[1].exitcode]) from exc
        # the first failure that is not a stop (torch stamps failures to the second)
        rank, failure = min(((r, f) for r, f in exc.failures.items()
                             if f.exitcode not in stops), key=lambda rf: rf[1].timestamp)
        # A rank stopped or stuck fails none of its own, and writes nothing: the
        # others' all-reduce ran out of peer_timeout, and its error names no peer.
        silent = tuple(r for r in range(nproc) if r not in exc.failures
                       and not (out / f"summary-rank{r}.json").exists())
        raise RankFailed(rank, failure.exitcode, failure_reason(failure), silent) from exc
    finally:
        merge_traces(out, nproc)
        prune_launcher_logs(out / "launcher-logs", run_id)
    return dict(results)


def prune_launcher_logs(folder: Path, run_id: str) -> None:
    """Remove the folders torch's launcher made in ``folder`` for the launch ``run_id``
    that hold no file (its ranks' folders hold an ``error.json`` only where a rank
    failed), and ``folder`` itself when that leaves it empty: a folder a launch, kept
    for ever, otherwise."""
    # escaped: a lock file named by hand, replay_fsm-*.lock say, named every launch's
    made = [p for p in folder.glob(f"{glob.escape(run_id)}_*")
            if p.is_dir() and not p.is_symlink()]
    for top in made:
        inner = sorted((p for p in top.rglob("*") if p.is_dir()),
                       key=lambda p: len(p.parts), reverse=True)
        for path in [*inner, top]:  # deepest first; a folder with a file stays
            with contextlib.suppress(OSError):
                path.rmdir()
    with contextlib.suppress(OSError):
        folder.rmdir()


LOCK_SUFFIX = ".lock"


@contextlib.contextmanager
def launch_lock(folder: Path, run_id: str) -> Iterator[Path]:
    """For the with-block, the launch ``run_id``'s lock file in ``folder`` (made with
    its missing parents), held locked (``flock``, exclusive); yields its path. The
    kernel lets the lock go when this process ends, however it ends (SIGKILL too),
    so a later launch can tell a launcher that is gone from one still running, where
    a pid can be reused and a folder's age says nothing (``prune_gone_launches``).
    A lock file a pruner removed between its making and its locking is made again,
    and ``folder`` with it: the pruner, or a launch ending, removes it where that
    empties it, as it may be while it is made or before our lock file is made in it.
    On the way out the file is removed, and ``folder`` too where that empties it.

    Raises:
        OSError: the lock file cannot be made, or ``folder`` is a file (as
            ``files.make_folder``).
    """
    from .files import make_folder
    path = folder / f"{run_id}{LOCK_SUFFIX}"
    while True:
        try:
            make_folder(folder)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except (FileExistsError, FileNotFoundError):
            if _removed_or_made(folder):
                continue  # emptied, removed by another launch as it was made, or after
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _names(path, fd):
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # a pruner took it for a gone launch's and removed it
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)
        with contextlib.suppress(OSError):
            folder.rmdir()


def _removed_or_made(folder: Path) -> bool:
    """Whether ``folder``, which could not be made or not hold a new file, is a folder
    (made again by another launch) or not there (removed by one, emptied): not a file
    or a link to nothing, which stay. One look: two (is it there, is it a folder)
    could see it removed, then made again, and take it for a file."""
    try:
        return stat.S_ISDIR(os.stat(folder).st_mode)
    except FileNotFoundError:
        return not os.path.islink(folder)


def _names(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def prune_gone_launches(folder: Path) -> list[str]:
    """Prune, as ``prune_launcher_logs`` does, the folders in ``folder`` of the launches
    whose launcher is gone: those whose lock file (``launch_lock``) no process holds.
    A launcher killed (SIGKILL, a crash) never pruned its own, and each launch added
    a folder per rank for ever. Their lock files are removed too. Returns their run
    ids, sorted. A launch still running holds its lock and is left alone; so are
    folders with no lock file (a launcher from before the locks, which may still
    run), and all of them where the file system cannot lock. None where ``folder``
    is removed while it is listed (emptied by a launch ending, or another pruner)."""
    gone: list[str] = []
    try:
        locks = sorted(folder.glob(f"replay_fsm-*{LOCK_SUFFIX}"))
    except FileNotFoundError:  # found, then gone before it was read: nothing to prune
        return gone
    for lock in locks:
        run_id = lock.name[:-len(LOCK_SUFFIX)]
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:  # removed meanwhile (by its launcher, or another pruner)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its launcher runs (or no locks here: cannot tell)
            os.close(fd)
            continue
        try:
            if _names(lock, fd):  # not a file its launcher has made again since
                prune_launcher_logs(folder, run_id)
                lock.unlink(missing_ok=True)
                gone.append(run_id)
        finally:
            os.close(fd)
    with contextlib.suppress(OSError):  # emptied: removed, as a launch's own pruning does
        folder.rmdir()
    return gone


def _launcher_signals(config_class: Any) -> dict[str, Any]:
    """The ``signals_to_handle`` argument of torch's ``LaunchConfig``: its default less
    the stop signals, which ``launch`` handles itself (``_stop_launcher``; SIGHUP not
    at all while this process ignores it, as ``nohup`` starts it: a handler for it
    would undo that, and the ranks, started with SIGHUP at its default, would take it
    as a stop). Empty where the class has no such field (torch before it, whose
    handlers then replace launch's as the ranks start)."""
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    if "signals_to_handle" not in fields:
        return {}
    names = [n.strip() for n in str(fields["signals_to_handle"].default).split(",")]
    ours = {signal.Signals(s).name for s in STOP_SIGNALS}
    return {"signals_to_handle": ",".join(n for n in names if n not in ours)}


def _stop_launcher(signum: int, frame: FrameType | None) -> None:
    """What torch's launcher's handler does for a stop signal: raise its
    ``SignalException``, on which it stops the ranks it started and ends."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    sigval = signal.Signals(signum)
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)


@contextlib.contextmanager
def _stops_after_the_start(agent_class: Any) -> Iterator[None]:
    """For the with-block, a stop signal that comes while the launcher (an
    ``agent_class``) starts the ranks is raised once they are all started and
    recorded. Raised inside that start, it left the ranks started so far unknown to
    the launcher, which stopped none of them and exited: its exit removed the
    semaphores they were still unpickling (a "FileNotFoundError" traceback from
    each), and a rank whose start it cut short read half its input ("EOFError").
    Raised after, the launcher stops them as it stops ranks it started. Nothing
    changes where the class has no such start (a torch that renamed it: the race
    is back there, not an error)."""
    start = getattr(agent_class, "_start_workers", None)
    if start is None:
        yield
        return

    def start_whole(*args: Any, **kwargs: Any) -> Any:
        taken: list[int] = []
        try:
            with handling(stop_signals_taken(), lambda signum, frame: taken.append(signum)):
                return start(*args, **kwargs)
        finally:
            if taken:
                _stop_launcher(taken[0], None)

    agent_class._start_workers = start_whole
    try:
        yield
    finally:
        agent_class._start_workers = start


def failure_reason(failure: Any) -> str:
    """The one-line error of a rank's ``ProcessFailure``: the message its error file
    holds (``Type: message``, recorded by torch's error handler for an exception that
    ended the rank; a plain string written by other code), else that none was (an exit
    or a signal: torch makes up a message of its own for those, not from the file)."""
    recorded = getattr(failure, "error_file_data", {}).get("message")
    if isinstance(recorded, dict):  # what torch's error handler records
        recorded = recorded.get("message")
    if isinstance(recorded, str) and recorded != "<NONE>":  # torch's mark for no file
        line = first_line(recorded)
        if line:
            return line
    return f"no error recorded (pid {failure.pid})"


def env_int(name: str) -> int:
    """The environment variable ``name`` (set by torchrun) as an int >= 0.

    Raises:
        ValueError: it is not one.
    """
    value = os.environ[name]
    try:
        return as_count(name, int(value))
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an int >= 0, got {value!r}") from None


def main(argv: list[str] | None = None) -> int:
    """``torchrun ... -m replay_fsm.distributed``: one rank of a multi-node run."""
    from .trainers.cli import add_demo_run_options, option_names
    ap = argparse.ArgumentParser(prog="python -m replay_fsm.distributed",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--ticks", type=int, default=100, help="learner ticks")
    ap.add_argument("--device", default="auto",
                    help="cpu, cuda (rank k of a node takes cuda:k), or auto")
    ap.add_argument("--out", default="demo-out", help="the ranks' output folder")
    ap.add_argument("--sample-count", type=int, default=2048, help="rows per batch")
    add_demo_run_options(ap)
    args = ap.parse_args(argv)
    with naming_settings(option_names(args)):  # in the rank's messages too
        return _rank_of_command(ap, args)


def _rank_of_command(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``main``'s rank, from its parsed options ``args`` (``ap``: their parser)."""
    from .trainers.cli import learner_threads
    missing = [name for name in RANK_ENV if name not in os.environ]
    if missing:
        ap.error(f"{', '.join(missing)} not set: this is one rank of a run that torchrun "
                 "starts (torchrun --nproc-per-node N -m replay_fsm.distributed ...); "
                 "on one node, replay-fsm demo --nproc N starts the ranks itself")
    try:  # what would fail in rank_main, before its rendezvous: a usage error here
        config = DemoConfig(ticks=args.ticks, device=args.device, out=args.out,
                            sample_count=args.sample_count, capacity=50_000, envs=64,
                            ring_depth=args.ring_depth, peer_timeout=args.peer_timeout,
                            liveness_timeout=args.liveness_timeout,
                            learner_threads=learner_threads(args.learner_threads))
        rank, local_rank, world = (env_int(name) for name in RANK_ENV[:3])
        if not 0 <= rank < world:
            raise ValueError(f"RANK {rank} is not in [0, WORLD_SIZE {world})")
        rank_seed(config.batch_seed, rank)
        local_device(local_rank, config.device)
        from .demo.runner import output_folder
        output_folder(config.out)  # an --out that is a file raises on, for torchrun
    except (TypeError, ValueError) as exc:  # DemoConfig's, env_int's, local_device's...
        ap.error(str(exc))
    summary = rank_main(config)
    # Another rank's stop signal (this rank's own exits in rank_main): Ctrl-C's code,
    # whichever signal it was (the ranks agree on a flag, not on the signal).
    return 130 if summary["interrupted"] else 0


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    # An error that ends the rank goes to torchrun's error file, so that torchrun's
    # report names it (else its "error_file: <N/A>").
    raise SystemExit(record(main)())
