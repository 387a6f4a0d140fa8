"""``replay-fsm demo``: a small off-policy trainer on an embedded default.

A vectorised point-mass control task in numpy steps in a collector (a spawned
process by default, or a thread), adds every step to the shared replay buffer and
serves pack requests between steps, exactly where the seed's collector serviced its
queue. The learner makes real gradient updates of a small critic through the
pipeline. At the end: a summary table, and an output folder with the Perfetto
trace, the transition log, the state diagram and ``summary.json``.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from ..data.buffer import ReplayBuffer
from ..errors import CollectorDied, DataStalled, setting
from ..files import check_writable, forget, make_folder, write_text
from ..runtime.observers import steady_ticks
from ..runtime.pipeline import Pipeline
from ..signals import STOP_SIGNALS, end_worker, raise_deferred, start_ignoring, step
from ..spec import INVARIANTS
from ..transfer import available_device
from ..verify import diagram
from ..verify.conformance import check, truncated
from .collector import collect, collect_process
from .config import DemoConfig
from .env import ACT, OBS
from .learner import Learner


def run(config: DemoConfig | None = None,
        all_reduce: Callable[[list[torch.Tensor]], None] | None = None) -> dict[str, Any]:
    """Run the demo; returns the summary (also written to ``<out>/summary.json``, or
    ``summary-rank<k>.json`` for a rank of a multi-rank run). ``all_reduce``
    averages gradients across ranks.

    A run stopped by Ctrl-C, SIGTERM or SIGHUP (under the CLI's handlers,
    ``sigterm_as_interrupt``), or by an error once its pipeline is made, still writes
    its files: its summary has ``interrupted`` true, and ``error`` names an error,
    which is then raised with that summary as its ``summary``. A stop that comes
    while the files are written waits for them, then is raised (a KeyboardInterrupt)
    with the summary as its ``summary``; the same signal again stops at once.

    Raises:
        CollectorDied, PipelineFailed: the collector or the pipeline failed.
        ValueError: ``interrupt_at`` with a signal this process has no handler for,
            or ``config.out`` is empty ("": ``"."`` names the current folder).
        NotADirectoryError: ``config.out`` is a file.
    """
    config = DemoConfig() if config is None else config
    if (config.interrupt_at is not None and config.rank is None
            and signal.getsignal(config.interrupt_signal) in (signal.SIG_DFL, None)):
        raise ValueError(f"interrupt_signal {signal.Signals(config.interrupt_signal).name} "
                         "would kill this process outright: it has no handler for it (run "
                         "the demo inside replay_fsm.signals.sigterm_as_interrupt(), as the "
                         "CLI does)")
    stop = threading.Event()
    worker: Any = None
    fingerprint: list[int] = []
    losses: list[float] = []
    tick_times: list[float] = []
    compare: dict[str, float] = {}
    done_ticks = 0
    interrupted: str | None = None  # where a stop signal ended it: "run", "comparison"
    error: Exception | None = None  # what ended it otherwise; raised once it is written
    bar = tqdm(total=config.ticks, disable=True)  # the real one once the loop starts
    out_dir, rb, pipe = _build(config)  # a stop taken inside waits for it: see below
    dev = pipe.device
    t_start = time.perf_counter()
    try:
        try:  # start-up too (the learner's first import takes seconds): Ctrl-C writes
            raise_deferred()  # a stop taken while _build ran: the files are written
            worker = _make_collector(config, rb, pipe, stop)
            _start_collector(pipe, worker)
            learner = Learner.create(dev, config.seed)
            warm = warm_up(config)[0]
            t_start = time.perf_counter()
            bar = tqdm(total=config.ticks, disable=not config.progress, unit="tick",
                       dynamic_ncols=True)
            pipe.start_prepare(0, config.sample_count, min_snapshot_ptr=warm)
            for tick in range(config.ticks):
                t0 = time.perf_counter()
                if config.kill_collector_at == tick and config.collector == "process":
                    worker.kill()  # fault injection: the collector crashes
                if config.freeze_collector_at == tick and config.collector == "process":
                    os.kill(worker.pid, signal.SIGSTOP)  # fault injection: it is stuck
                if config.freeze_at == tick and config.rank is not None:
                    os.kill(os.getpid(), signal.SIGSTOP)  # fault injection: a stuck rank
                if config.interrupt_at == tick:  # fault injection: Ctrl-C or SIGTERM
                    if config.rank is None:
                        os.kill(os.getpid(), config.interrupt_signal)
                    else:  # as a terminal sends it: to the launcher's whole process group
                        os.killpg(os.getpgrp(), config.interrupt_signal)
                batch = pipe.sample_large_batch(tick, config.sample_count)
                if config.verify_data or tick == 0:
                    fingerprint.append(_check_batch(pipe, rb, tick, config.verify_data))
                for ahead in range(tick + 1, min(tick + config.ring_depth, config.ticks)):
                    pipe.start_prepare(ahead, config.sample_count, min_snapshot_ptr=warm)
                with torch.profiler.record_function("replay_fsm/learner_step"):
                    losses.append(learner.step(batch, all_reduce))
                pipe.after_tick()
                tick_times.append(time.perf_counter() - t0)
                done_ticks += 1
                if tick % 10 == 0 or tick == config.ticks - 1:
                    live = pipe.statistics()
                    elapsed = time.perf_counter() - t_start
                    bar.set_postfix(stall=f"{100 * live.learner_wait_s / elapsed:.0f}%",
                                    loss=f"{losses[-1]:.3f}",
                                    slots="".join(s.name[0] for s in pipe.states))
                bar.update(1)
        except KeyboardInterrupt:
            interrupted = "run"
            _agree_to_stop(all_reduce)
        except Exception as exc:  # noqa: BLE001 - raised below, once the files are written
            error = exc
        finally:  # the run's figures end with its ticks: the comparison after them
            # runs ticks of its own (and synchronous ones) and reports them apart
            bar.close()
            elapsed, stats = time.perf_counter() - t_start, pipe.statistics()
        if not interrupted and error is None:
            try:
                compare = _compare(pipe, rb, learner, config, dev, config.ticks, warm,
                                   all_reduce)
            except KeyboardInterrupt:
                interrupted = "comparison"
                _agree_to_stop(all_reduce)
            except Exception as exc:  # noqa: BLE001 - as above
                error = exc
    finally:
        with _after(error):  # a collector found dead (stopped, stuck) would not leave
            _stop_collector(pipe, stop, worker,
                            hung=isinstance(error, (CollectorDied, DataStalled)))
    with _after(error):
        try:
            summary = _write_files(config, out_dir, pipe, {
                "ticks": done_ticks,
                "interrupted": interrupted is not None or error is not None,
                "interrupted_in": interrupted,
                "error": None if error is None else f"{type(error).__name__}: {error}",
                "fingerprint": fingerprint, "tick_times": tick_times, "elapsed": elapsed,
                "stats": stats, "compare": compare, "losses": losses})
        except Exception:
            if error is None:
                raise
            raise error  # noqa: B904 - the run's own error, the write's its context
    try:  # a stop taken while the files were written (a step): raised here, with them
        raise_deferred()
    except KeyboardInterrupt as stop:
        stop.summary = summary  # type: ignore[attr-defined]
        if error is not None:
            stop.__context__ = error
        raise
    if error is not None:
        with contextlib.suppress(AttributeError, TypeError):  # a frozen exception
            error.summary = summary  # type: ignore[attr-defined] # (sac's: .result)
        raise error
    return summary


@contextlib.contextmanager
def _after(error: Exception | None) -> Iterator[None]:
    """Whatever escapes the block (a second Ctrl-C while the collector is joined, a
    third while the files are written) keeps ``error``, the run's own, as its
    context: it is not handled any more when the block runs, so Python would not
    chain it."""
    try:
        yield
    except BaseException as late:
        if error is not None and late is not error and late.__context__ is None:
            late.__context__ = error
        raise


def warm_up(config: DemoConfig) -> tuple[int, str]:
    """The rows every request of the run waits for (``min_snapshot_ptr``), and what a
    ``DataStalled`` calls them: the config's fields they come from (as
    ``replay_fsm.errors.setting`` calls them)."""
    if config.collect_steps is None:
        return 4 * config.sample_count, f"the warm-up, 4 x {setting('sample_count')}"
    return (config.collect_steps * config.envs,
            f"the warm-up, {setting('collect_steps')} x {setting('envs')}")


def output_folder(out: str | Path) -> Path:
    """``out`` as the run's output folder, which may not exist yet.

    Raises:
        NotADirectoryError: ``out`` is a file.
        ValueError: ``out`` is empty (an unset shell variable, say; ``.`` names the
            current folder).
    """
    if str(out) == "":  # Path("") is ".": a wish for the current folder it is not
        raise ValueError("--out '' names no folder; write --out . for the current folder")
    out_dir = Path(out)
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"{out_dir} is a file; --out names the output folder")
    return out_dir


@step
def _build(config: DemoConfig) -> tuple[Path, ReplayBuffer, Pipeline]:
    """The output folder, the replay buffer and the pipeline. A step
    (``replay_fsm.signals``): a stop signal taken while they are made waits for them,
    and ``run`` raises it inside the run, which then writes its files."""
    if config.learner_threads is not None:
        torch.set_num_threads(config.learner_threads)
    out_dir = output_folder(config.out)
    device = available_device(config.device)  # before any folder is made
    make_folder(out_dir)
    check_writable(_outputs(config, out_dir).values())  # found now, not after the run
    rb = ReplayBuffer(config.capacity, OBS, ACT)
    pipe = Pipeline(rb, device=device,
                    sample_count=config.sample_count, base_seed=config.batch_seed,
                    ring_depth=config.ring_depth, collector="external",
                    checked=config.checked, trace=True,
                    liveness_timeout=config.liveness_timeout,
                    # as the SAC trainer's: rows that stopped coming fail the run
                    # after liveness_timeout too (min_snapshot_ptr: the warm-up). A
                    # stall names the config's fields (as errors.setting calls them)
                    stall_timeout=config.liveness_timeout,
                    stall_timeout_name=setting("liveness_timeout"),
                    min_snapshot_ptr_name=warm_up(config)[1],
                    trace_capacity=trace_capacity(config.ticks))
    return out_dir, rb, pipe


def _outputs(config: DemoConfig, out_dir: Path) -> dict[str, Path]:
    """The files a run writes in ``out_dir``, by what they hold."""
    suffix = config.suffix
    return {"trace": out_dir / f"trace{suffix}.json",
            "transitions": out_dir / f"transitions{suffix}.jsonl",
            "diagram": out_dir / "slot.mmd", "summary": out_dir / f"summary{suffix}.json"}


@step
def _write_files(config: DemoConfig, out_dir: Path, pipe: Pipeline,
                 run: dict[str, Any]) -> dict[str, Any]:
    """Write the trace, the transition log, the diagram and the summary of a run
    (``run``: what ``run`` measured); returns the summary. A step
    (``replay_fsm.signals``): a stop signal taken while they are written waits for
    the last of them (the same signal again stops at once), so that the folder does
    not hold this run's trace beside an earlier run's summary."""
    assert pipe.tracer is not None
    paths = _outputs(config, out_dir)
    # An earlier run's summary goes first, and this run's comes last: a process killed
    # in between (SIGKILL, the OOM killer) leaves no summary beside this run's trace,
    # where it left the earlier one, looking current.
    forget(paths["summary"])
    pipe.tracer.write_chrome(
        paths["trace"],
        process_name="replay_fsm" if config.rank is None else f"rank {config.rank}",
        pid_base=0 if config.rank is None else 10 * (config.rank + 1))
    pipe.tracer.write_transitions(paths["transitions"])
    write_text(paths["diagram"], diagram.mermaid())
    if pipe.tracer.dropped_transitions:  # a run longer than the trace holds
        conforms, conformance = None, "not checked: " + truncated(
            pipe.tracer.dropped_transitions, pipe.tracer.capacity)
    elif not __debug__:  # check() refuses: its invariant checks are asserts
        conforms, conformance = None, ("not checked: python -O removes the invariant "
                                       "checks (assert statements)")
    else:
        report = check(pipe.tracer.transitions())
        conforms, conformance = report.ok, str(report)
    stats, elapsed, losses = run["stats"], run["elapsed"], run["losses"]
    tick_times = run["tick_times"]
    steady = steady_ticks(tick_times)
    tick_s = float(np.mean(steady)) if steady else 0.0
    summary = {
        "rank": config.rank, "base_seed": pipe.base_seed,
        "batch_fingerprint": run["fingerprint"][:1],
        "data_verified_ticks": len(run["fingerprint"]) if config.verify_data else 0,
        "ticks": run["ticks"], "interrupted": run["interrupted"],
        "interrupted_in": run["interrupted_in"], "error": run["error"],
        "device": str(pipe.device),
        "learner_threads": torch.get_num_threads(),
        "ring_depth": config.ring_depth, "collector": config.collector,
        "sample_count": config.sample_count,
        "elapsed_s": elapsed, "tick_ms": tick_s * 1e3,
        "stall_pct": 100 * stats.learner_wait_s / elapsed if elapsed else 0.0,
        "stalls": stats.stalls, "compare": run["compare"],
        "speedup_vs_sync": run["compare"].get("speedup_vs_sync"),
        "bytes_moved": stats.bytes_moved, "final_loss": losses[-1] if losses else None,
        "checked_mode_checks": stats.checks, "trace_conformance": conformance,
        "trace_conforms": conforms, "invariants": list(INVARIANTS),
        "dwell_s": stats.dwell_s,
    }
    write_text(paths["summary"], json.dumps(summary, indent=2) + "\n")
    return summary


def _make_collector(config: DemoConfig, rb: ReplayBuffer, pipe: Pipeline,
                    stop: threading.Event) -> Any:
    """The demo's collector, not started yet: a spawned process that ignores the stop
    signals (``collect_process``), or a thread."""
    args = (rb, pipe.packer_handle(), config.envs, config.collector_seed)
    if config.collector == "thread":
        return threading.Thread(target=collect, args=(*args, stop, config.collect_steps),
                                daemon=True)
    return mp.get_context("spawn").Process(
        target=collect_process, args=(*args, config.collect_steps), daemon=True)


def _start_collector(pipe: Pipeline, worker: Any) -> None:
    """Start the collector ``_make_collector`` made; the pipeline watches a process.
    Made first, so that whatever interrupts the start, ``_stop_collector`` has it.
    Watched even where a Ctrl-C that came during the start is raised as it returns:
    a pipeline closed with no watched collector alive lets its channels' semaphores
    go, and the child, still starting, failed to open them (a FileNotFoundError
    traceback from its unpickling)."""
    if isinstance(worker, threading.Thread):
        worker.start()
        return
    try:
        start_ignoring(worker, STOP_SIGNALS)
    finally:
        if worker.pid is not None:  # started
            pipe.watch(worker, "the demo collector process")


def _agree_to_stop(all_reduce: Callable[[list[torch.Tensor]], None] | None) -> None:
    """After a stop that ended this rank's run somewhere other than the step's
    all-reduce (its wait for a batch, ``AgreedInterrupt``): join that all-reduce, in
    which the other ranks wait, so that every rank stops at this step. Where the ranks
    already agreed there, the all-reduce raises again at once. Nothing for one rank
    alone."""
    if all_reduce is None:
        return
    try:
        all_reduce([])
    except (KeyboardInterrupt, RuntimeError):  # RuntimeError: a peer is gone; the rank
        pass  # stops either way, and writes its files


def _stop_collector(pipe: Pipeline, stop: threading.Event, worker: Any,
                    join_s: float = 30.0, *, hung: bool = False) -> None:
    """Close the pipeline (an attached collector sees it and leaves), then end the
    collector: joined within ``join_s``, or SIGKILLed if it does not leave (it ignores
    SIGTERM, so multiprocessing's clean-up at exit would wait for it for ever), at
    once when ``hung`` (as ``end_worker``). Each step runs even when the one before
    raised (a second Ctrl-C, say)."""
    try:
        pipe.close()
    finally:
        stop.set()
        if worker is not None:
            end_worker(worker, join_s, hung=hung)


COMPARE_BLOCKS, COMPARE_TICKS = 3, 20
# The trace holds the whole run, so that its conformance is checked from the start,
# up to TRACE_MAX_EVENTS (about 400 bytes an event): a run of more ticks than about
# TRACE_MAX_EVENTS / TRACE_EVENTS_PER_TICK is reported not checked.
TRACE_EVENTS_PER_TICK, TRACE_MAX_EVENTS = 10, 1 << 19


def trace_capacity(ticks: int) -> int:
    """The demo tracer's bound for a run of ``ticks`` (and the comparison's)."""
    wanted = TRACE_EVENTS_PER_TICK * (ticks + COMPARE_BLOCKS * COMPARE_TICKS) + 4096
    return min(max(wanted, 1 << 16), TRACE_MAX_EVENTS)


def _compare(pipe: Pipeline, rb: ReplayBuffer, learner: Learner, config: DemoConfig,
             device: torch.device, first: int, warm: int,
             all_reduce: Callable[[list[torch.Tensor]], None] | None = None
             ) -> dict[str, Any]:
    """The pipelined loop against the same loop sampling synchronously in the learner
    (the baseline), in interleaved blocks of COMPARE_TICKS ticks (pipelined,
    synchronous, pipelined, ...) while the collector keeps stepping and adding, so
    both see the same load on the machine's cores. Returns the mean tick (wall /
    ticks) and the learner's stall per tick (time blocked on its batch) of each, and
    the speed-up of each pair of blocks: on a busy machine they spread more than the
    stall the pipeline removes, and the spread says how much of the speed-up is noise.
    Both step as the run does (``all_reduce`` across ranks), so a rank's Ctrl-C
    stops every rank here too."""
    from ..data.sampling import sample_indices
    n, depth = config.sample_count, config.ring_depth
    out = torch.empty(n, rb.width)
    wall = {"pipeline": 0.0, "sync": 0.0}
    stall = {"pipeline": 0.0, "sync": 0.0}
    block_ratios: list[float] = []
    tick = first
    for ahead in range(first, first + depth - 1):  # the pipeline runs primed, as above
        pipe.start_prepare(ahead, n, min_snapshot_ptr=warm)
    pipe.wait_until_ready(first, n)
    for _ in range(COMPARE_BLOCKS):
        t0 = time.perf_counter()
        for _ in range(COMPARE_TICKS):
            s0 = time.perf_counter()
            batch = pipe.sample_large_batch(tick, n)
            stall["pipeline"] += time.perf_counter() - s0
            pipe.start_prepare(tick + depth - 1, n, min_snapshot_ptr=warm)
            learner.step(batch, all_reduce)
            pipe.after_tick()
            tick += 1
        pipelined = time.perf_counter() - t0
        wall["pipeline"] += pipelined
        t0 = time.perf_counter()
        for k in range(COMPARE_TICKS):
            s0 = time.perf_counter()
            rb.gather(sample_indices(rb.size, n, pipe.base_seed + 10**6 + tick + k), out)
            batch = rb.layout.views(out.to(device))
            stall["sync"] += time.perf_counter() - s0
            learner.step(batch, all_reduce)
        synchronous = time.perf_counter() - t0
        wall["sync"] += synchronous
        block_ratios.append(synchronous / pipelined)
    ticks = COMPARE_BLOCKS * COMPARE_TICKS
    return {"pipeline_tick_ms": wall["pipeline"] / ticks * 1e3,
            "sync_tick_ms": wall["sync"] / ticks * 1e3,
            "pipeline_stall_ms": stall["pipeline"] / ticks * 1e3,
            "sync_stall_ms": stall["sync"] / ticks * 1e3,
            "speedup_vs_sync": wall["sync"] / wall["pipeline"], "ticks_each": ticks,
            "blocks": COMPARE_BLOCKS, "block_ratios": block_ratios}



def _check_batch(pipe: Pipeline, rb: ReplayBuffer, tick: int, verify: bool) -> int:
    """The sampled indices' fingerprint; with ``verify``, INV-DATA bit for bit."""
    from ..data.sampling import sample_indices
    done = pipe.pack_record(tick)
    slot = done.slot
    indices = sample_indices(done.snapshot_size, done.sample_count, done.seed)
    if verify and not torch.equal(pipe.backend.device_slot(slot).cpu(), rb.storage[indices]):
        raise AssertionError(f"INV-DATA: the batch of tick {tick} differs")
    return int(indices.sum())



def format_summary(s: dict[str, Any], out: str | Path) -> str:
    c = s["compare"]
    rows = [
        ("ticks", f"{s['ticks']}" + (" (stopped by an error)" if s.get("error")
                                     else " (interrupted)" if s.get("interrupted_in") == "run"
                                     else "")),
        ("tick time (mean)", f"{s['tick_ms']:.2f} ms"),
        ("learner stall", f"{s['stall_pct']:.1f} % of the run ({s['stalls']} waits)"),
    ]
    if s.get("interrupted_in") == "comparison":
        rows.append(("pipelined vs synchronous", "not measured: interrupted after the "
                                                 "run's ticks"))
    if c:
        rows += [
            ("pipelined vs synchronous", f"{c['ticks_each']} ticks each, in {c['blocks']} "
                                         "interleaved blocks a side, collector running "
                                         "in both"),
            ("  stall per tick", f"{c['pipeline_stall_ms']:.2f} ms vs "
                                 f"{c['sync_stall_ms']:.2f} ms"),
            ("  mean tick", f"{c['pipeline_tick_ms']:.2f} ms vs {c['sync_tick_ms']:.2f} ms"),
            ("  speed-up over synchronous", f"{c['speedup_vs_sync']:.2f}x" + (
                f" (blocks {min(c['block_ratios']):.2f} to {max(c['block_ratios']):.2f})"
                if c.get("block_ratios") else "")),
        ]
    rows += [
        ("bytes moved", f"{s['bytes_moved'] / 1e6:.1f} MB"),
        ("checked-mode checks", f"{s['checked_mode_checks']}"),
        ("trace conformance", s["trace_conformance"]),
        ("invariants", ", ".join(s["invariants"])),
        ("output", f"{out}/trace.json (open in ui.perfetto.dev), transitions.jsonl, "
                   "slot.mmd, summary.json"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
