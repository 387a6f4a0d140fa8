"""Where a tick's CPU time goes, thread by thread, with no background load.

learner_loop's cores columns count every thread of ours together, and with no
background load the replay_fsm rows spend more CPU per tick than the bare double
buffer, which gathers on a plain thread and does nothing else. This splits that CPU
by thread: the learner thread (its calls, the chunks it packs itself while it waits,
and its step, slowed by whatever runs beside it), the helper threads of its process
(the double buffer's gather thread; replay_fsm's packer and transfer threads) and a
packer process. Contenders: compute only, synchronous sampling, the bare double
buffer and replay_fsm's thread and process collectors at ring depth 2, and the thread
collector once more with the learner's own packs off (the control for them), on
learner_loop's workload and calibration (its own, in this run: each regime's step
over the bare gather is recorded), in its compute-bound and balanced regimes.
Contenders are interleaved round by round (ABBA); each figure is the CPU time over
every round divided by every timed tick. The CPU time of each thread of the
learner's process is read from the thread's own CPU clock, a packer process's from
the process's CPU clock (every thread of it, ended ones too): Linux only.

Beside it, alone on one thread (CPU time, interleaved rounds): the packer's way of
gathering a batch against one bare ``index_select``. The packer splits a batch in
chunks (``replay_fsm.data.packer.chunk_count``: a learner that waits takes the chunks
the packer has not reached) and gathers each with ``ReplayBuffer.gather``, which
brackets the copy with the torn-row check (INV-ROW).
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from typing import Any

import torch

from replay_fsm import ReplayBuffer
from replay_fsm.data.packer import chunk_count
from replay_fsm.data.sampling import sample_indices

try:
    import learner_loop
    from common import steady_malloc, table, write_result
except ImportError:  # run as a module
    from benchmarks import learner_loop
    from benchmarks.common import steady_malloc, table, write_result

REGIMES = ("compute-bound", "balanced")
# Per thread's role, in the order of the table's columns; "other threads" is any
# thread of this process no contender named (torch's own, say).
ROLES = ("learner thread", "gather thread", "packer thread", "transfer thread",
         "packer process", "other threads")
WARM_UP = 3  # untimed ticks first, as learner_loop's run_ticks
SYNC = "synchronous sampling"


def process_cpu_s(pid: int) -> float | None:
    """The CPU seconds process ``pid`` has used so far, every thread of it, ended
    ones too: its CPU clock (Linux's clock_getcpuclockid encoding, which Python does
    not expose); None where it cannot be read (not Linux, or it exited)."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)  # CPUCLOCK_SCHED, process-wide
    except (OSError, AttributeError, OverflowError):
        return None


def unsupported() -> str | None:
    """Why this machine cannot split the CPU by thread, or None."""
    if not hasattr(time, "pthread_getcpuclockid"):
        return "per-thread CPU clocks (time.pthread_getcpuclockid) are missing here"
    if process_cpu_s(os.getpid()) is None:
        return "another process's CPU clock cannot be read here (Linux only)"
    return None


def threads_cpu_s() -> dict[int, tuple[str, float]]:
    """Per Python thread of this process (by ident): its name and the CPU seconds it
    has run so far (its own CPU clock)."""
    out = {}
    for thread in threading.enumerate():
        if thread.ident is None:
            continue
        try:
            clock = time.pthread_getcpuclockid(thread.ident)
            out[thread.ident] = (thread.name, time.clock_gettime(clock))
        except (OSError, AttributeError):
            continue  # it ended while we looked, or no per-thread clocks here
    return out


def role_of(name: str) -> str:
    """The role of a helper thread of this process, from its Python thread name."""
    for part, role in (("packer", "packer thread"), ("transfer", "transfer thread"),
                       ("gather", "gather thread")):
        if part in name:
            return role
    return "other threads"


def measure(c: learner_loop.Contender, ticks: int) -> dict[str, float] | None:
    """Open ``c``, tick it ``WARM_UP`` times, then ``ticks`` times timed: the wall
    seconds of the timed ticks and the CPU seconds each role spent meanwhile. Threads
    that ran before ``c`` opened, and threads of this process no Python thread
    accounts for (torch's, say), count as "other threads". None where a packer
    process's CPU clock cannot be read."""
    earlier = {t.ident for t in threading.enumerate()}
    c.open()
    try:
        for t in range(WARM_UP):
            c.tick(t)
        learner = threading.get_ident()
        helpers = c.helpers()
        before, process_before = threads_cpu_s(), time.process_time()
        helpers_before = [process_cpu_s(pid) for pid in helpers]
        start = time.perf_counter()
        for t in range(WARM_UP, WARM_UP + ticks):
            c.tick(t)
        wall = time.perf_counter() - start
        after, process_after = threads_cpu_s(), time.process_time()
        helpers_after = [process_cpu_s(pid) for pid in helpers]
    finally:
        c.close()
    spent = dict.fromkeys(ROLES, 0.0)
    for ident, (name, seconds) in after.items():
        role = ("learner thread" if ident == learner else
                "other threads" if ident in earlier else role_of(name))
        spent[role] += seconds - before.get(ident, (name, 0.0))[1]
    spent["other threads"] += max(0.0, process_after - process_before - sum(spent.values()))
    for b, a in zip(helpers_before, helpers_after, strict=True):
        if a is None or b is None:
            return None
        spent["packer process"] += a - b
    spent["wall"] = wall
    return spent


def run_regime(rb: ReplayBuffer, n: int, compute: Any, dev: torch.device, rounds: int,
               ticks: int) -> dict[str, Any] | None:
    """Per contender: the mean tick (median of rounds) and each role's CPU time per
    tick (ms), the CPU time of every role together, and that over synchronous
    sampling's; None where a packer process's CPU clock cannot be read."""
    contenders: list[learner_loop.Contender] = [
        learner_loop.ComputeOnly(rb, n, compute, dev),
        learner_loop.Synchronous(rb, n, compute, dev),
        learner_loop.BareDoubleBuffer(rb, n, compute, dev),
        learner_loop.ReplayFSM(rb, n, compute, dev, "thread", 2),
        learner_loop.ReplayFSM(rb, n, compute, dev, "process", 2),
        learner_loop.ReplayFSM(rb, n, compute, dev, "thread", 2, learner_packs=False)]
    totals: dict[str, dict[str, float]] = {c.name: dict.fromkeys(ROLES, 0.0)
                                           for c in contenders}
    means: dict[str, list[float]] = {c.name: [] for c in contenders}
    packs: dict[str, list[int]] = {c.name: [0, 0] for c in contenders}
    for r in range(rounds):
        for c in (contenders if r % 2 == 0 else contenders[::-1]):
            spent = measure(c, ticks)
            if spent is None:
                return None
            means[c.name].append(spent.pop("wall") / ticks)
            for role, s in spent.items():
                totals[c.name][role] += s
            if isinstance(c, learner_loop.ReplayFSM):  # warm-up ticks included
                packs[c.name][0] += c.packed_here[0]
                packs[c.name][1] += c.packed_here[1]
    timed = rounds * ticks
    rows: dict[str, Any] = {}
    for c in contenders:
        row: dict[str, Any] = {"tick_ms": statistics.median(means[c.name]) * 1e3}
        row.update({f"{role}_ms": s / timed * 1e3 for role, s in totals[c.name].items()})
        row["cpu_ms"] = sum(totals[c.name].values()) / timed * 1e3
        if isinstance(c, learner_loop.ReplayFSM):
            row["learner_packs_per_tick"] = packs[c.name][0] / max(packs[c.name][1], 1)
        rows[c.name] = row
    for row in rows.values():
        row["cpu_over_sync"] = row["cpu_ms"] / rows[SYNC]["cpu_ms"]
    return rows


def gather_cost(rb: ReplayBuffer, n: int, rounds: int) -> dict[str, float]:
    """CPU ms per batch of ``n`` rows on this thread: one ``index_select``, the same
    rows in the packer's chunks, and those through ``ReplayBuffer.gather``; each over
    the first (the median of the rounds' ratios, and their quartiles); and per chunk,
    in us, the chunks' cost beyond the one call and the check's beyond the chunks
    (medians of the rounds' differences)."""
    out = torch.empty(n, rb.width).share_memory_()  # as the packer's host slots
    chunks = chunk_count(n)
    bounds = [n * c // chunks for c in range(chunks + 1)]
    batches = [sample_indices(rb.size, n, seed) for seed in range(8)]

    def whole(indices: torch.Tensor) -> None:
        torch.index_select(rb.storage, 0, indices, out=out)

    def chunked(indices: torch.Tensor) -> None:
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            torch.index_select(rb.storage, 0, indices[lo:hi], out=out[lo:hi])

    def checked(indices: torch.Tensor) -> None:
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            rb.gather(indices[lo:hi], out=out[lo:hi])

    ways = {"index_select": whole, "chunks": chunked, "chunks_checked": checked}
    per: dict[str, list[float]] = {k: [] for k in ways}
    for r in range(rounds):
        for name, way in (list(ways.items()) if r % 2 == 0 else list(ways.items())[::-1]):
            way(batches[0])  # its first call of the round, untimed
            start = time.thread_time()
            for indices in batches:
                way(indices)
            per[name].append((time.thread_time() - start) / len(batches))
    figures = {"chunks": float(chunks), "rounds": float(rounds)}
    for name, times in per.items():
        ratios = [a / b for a, b in zip(times, per["index_select"], strict=True)]
        figures[f"{name}_cpu_ms"] = statistics.median(times) * 1e3
        figures[f"{name}_over_index_select"] = statistics.median(ratios)
        if len(ratios) > 1:
            low, _, high = statistics.quantiles(ratios, n=4)
            figures[f"{name}_over_index_select_quartiles"] = [low, high]

    def per_chunk_us(a: str, b: str) -> float:
        return statistics.median(x - y for x, y in zip(per[a], per[b], strict=True)) \
            / chunks * 1e6
    figures["chunk_us"] = per_chunk_us("chunks_checked", "index_select")
    figures["check_us"] = per_chunk_us("chunks_checked", "chunks")
    return figures


def main(quick: bool = False) -> dict[str, Any]:
    malloc_fixed = steady_malloc()
    torch.set_num_threads(1)  # as learner_loop: the packer has the other core
    dev = torch.device("cpu")
    rows, width, n = (20_000, 128, 2048) if quick else (200_000, 500, 16_384)
    rounds, ticks = (2, 4) if quick else (6, 30)
    config: dict[str, Any] = {"rows": rows, "batch": n, "rounds": rounds, "ticks": ticks,
                              "learner_threads": 1, "malloc_thresholds_fixed": malloc_fixed}
    why = unsupported()
    if why is not None:
        print(f"cpu_split: {why}")
        write_result("cpu_split", config, {"missing": why}, quick=quick)
        return {"missing": why}
    rb = ReplayBuffer(rows, (width - 5) // 2, 2)
    rb.add_packed(torch.randn(rows, rb.width))
    config["width"] = rb.width
    pack_s, _, _, regimes = learner_loop.calibrate(rb, n, dev)
    figures: dict[str, Any] = {"pack_ms": pack_s * 1e3,
                               "gather": gather_cost(rb, n, 4 if quick else 30)}
    for name in REGIMES:
        hidden, reps = regimes[name]
        compute = learner_loop.make_compute(rb.width, hidden, reps, dev)
        result = run_regime(rb, n, compute, dev, rounds, ticks)
        if result is None:
            figures["missing"] = "a packer process's CPU clock could not be read"
            break
        # The regime as it came out here: the step (hidden units, hidden layers) and
        # compute only's CPU per tick over one index_select's per batch.
        figures[name] = {"rows": result, "step": [hidden, reps], "compute_over_gather":
                         result["compute only (ideal)"]["cpu_ms"]
                         / figures["gather"]["index_select_cpu_ms"]}
    write_result("cpu_split", config, figures, quick=quick)
    if "missing" in figures:
        print(f"cpu_split: {figures['missing']}")
        return figures
    for name in REGIMES:
        print(table(f"CPU ms per tick by thread, {name}, 0 background processes "
                    f"(mean tick = wall / ticks, median of {rounds} rounds)", [
            (k, f"{v['tick_ms']:.2f}", *(f"{v[f'{role}_ms']:.2f}" for role in ROLES),
             f"{v['cpu_ms']:.2f}", f"{v['cpu_over_sync']:.3f}")
            for k, v in figures[name]["rows"].items()
        ], ("contender", "tick ms", *ROLES, "all", "x synchronous")))
        print(f"{name}: compute only {figures[name]['compute_over_gather']:.2f} x one "
              "index_select's CPU")
    g = figures["gather"]
    print(f"the packer's gather alone, CPU per batch: one index_select "
          f"{g['index_select_cpu_ms']:.2f} ms; {g['chunks']:.0f} chunks "
          f"{g['chunks_over_index_select']:.3f} x; with the torn-row check "
          f"{g['chunks_checked_over_index_select']:.3f} x")
    return figures


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    main(args.quick)
