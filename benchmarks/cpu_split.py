"""Where a tick's CPU time goes, thread by thread, with no background load.

learner_loop's cores columns count every thread of ours together, and with no
background load the replay_fsm rows spend more CPU per tick than the bare double
buffer, which gathers on a plain thread and does nothing else. This splits that CPU
by thread: the learner thread (its calls, the chunks it packs itself while it waits,
and its step, slowed by whatever runs beside it), the helper threads of its process
(the double buffer's gather thread; replay_fsm's packer and transfer threads) and a
packer process. Contenders: compute only, synchronous sampling, the bare double
buffer and replay_fsm's thread and process collectors at ring depth 2, on
learner_loop's workload and calibration, in its compute-bound and balanced regimes.
Contenders are interleaved round by round (ABBA); each figure is the CPU time over
every round divided by every timed tick. CPU time per thread of the learner's
process is read from the thread's own CPU clock; a packer process's from the
kernel's per-thread run time in /proc: Linux only.

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
from pathlib import Path
from typing import Any

import torch

from replay_fsm import ReplayBuffer
from replay_fsm.data.packer import chunk_count
from replay_fsm.data.sampling import sample_indices

try:
    from common import steady_malloc, table, write_result
    from learner_loop import (
        BareDoubleBuffer,
        ComputeOnly,
        Contender,
        ReplayFSM,
        Synchronous,
        calibrate,
        make_compute,
    )
except ImportError:  # run as a module
    from benchmarks.common import steady_malloc, table, write_result
    from benchmarks.learner_loop import (
        BareDoubleBuffer,
        ComputeOnly,
        Contender,
        ReplayFSM,
        Synchronous,
        calibrate,
        make_compute,
    )

REGIMES = ("compute-bound", "balanced")
# Per thread's role, in the order of the table's columns; "other threads" is any
# thread of this process no contender named (torch's own, say).
ROLES = ("learner thread", "gather thread", "packer thread", "transfer thread",
         "packer process", "other threads")
WARM_UP = 3  # untimed ticks first, as learner_loop's run_ticks
SYNC = "synchronous sampling"
FLOOR = "bare double buffer (floor)"


def process_cpu_s(pid: int) -> float | None:
    """The CPU seconds every thread of process ``pid`` has run so far, from the
    kernel's per-thread run time (``/proc/<pid>/task/<tid>/schedstat``); None where
    /proc cannot tell (not Linux, or it exited)."""
    base = Path(f"/proc/{pid}/task")
    try:
        tids = os.listdir(base)
    except OSError:
        return None
    total = 0
    for tid in tids:
        try:
            total += int((base / tid / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended while we looked
    return total / 1e9


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
                       ("_gather", "gather thread")):
        if part in name:
            return role
    return "other threads"


def measure(c: Contender, ticks: int) -> dict[str, float] | None:
    """Open ``c``, tick it ``WARM_UP`` times, then ``ticks`` times timed: the wall
    seconds of the timed ticks and the CPU seconds each role spent meanwhile (threads
    of this process no Python thread accounts for, torch's say, count as "other
    threads"); None where /proc cannot tell a packer process's."""
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
        role = "learner thread" if ident == learner else role_of(name)
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
    sampling's; None where /proc cannot tell."""
    contenders: list[Contender] = [
        ComputeOnly(rb, n, compute, dev), Synchronous(rb, n, compute, dev),
        BareDoubleBuffer(rb, n, compute, dev),
        ReplayFSM(rb, n, compute, dev, "thread", 2),
        ReplayFSM(rb, n, compute, dev, "process", 2)]
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
            if isinstance(c, ReplayFSM):  # warm-up ticks included
                packs[c.name][0] += c.packed_here[0]
                packs[c.name][1] += c.packed_here[1]
    timed = rounds * ticks
    rows: dict[str, Any] = {}
    for c in contenders:
        row: dict[str, Any] = {"tick_ms": statistics.median(means[c.name]) * 1e3}
        row.update({f"{role}_ms": s / timed * 1e3 for role, s in totals[c.name].items()})
        row["cpu_ms"] = sum(totals[c.name].values()) / timed * 1e3
        if isinstance(c, ReplayFSM):
            row["learner_packs_per_tick"] = packs[c.name][0] / max(packs[c.name][1], 1)
        rows[c.name] = row
    for row in rows.values():
        row["cpu_over_sync"] = row["cpu_ms"] / rows[SYNC]["cpu_ms"]
    return rows


def gather_cost(rb: ReplayBuffer, n: int, rounds: int) -> dict[str, float]:
    """CPU ms per batch of ``n`` rows on this thread: one ``index_select``, the same
    rows in the packer's chunks, and those through ``ReplayBuffer.gather``; and each
    over the first, the median of the rounds' ratios."""
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
        figures[f"{name}_cpu_ms"] = statistics.median(times) * 1e3
        figures[f"{name}_over_index_select"] = statistics.median(
            a / b for a, b in zip(times, per["index_select"], strict=True))
    return figures


def main(quick: bool = False) -> dict[str, Any]:
    malloc_fixed = steady_malloc()
    torch.set_num_threads(1)  # as learner_loop: the packer has the other core
    dev = torch.device("cpu")
    rows, width, n = (20_000, 128, 2048) if quick else (200_000, 500, 16_384)
    rounds, ticks = (2, 4) if quick else (6, 30)
    rb = ReplayBuffer(rows, (width - 5) // 2, 2)
    rb.add_packed(torch.randn(rows, rb.width))
    pack_s, base, per_rep, regimes = calibrate(rb, n, dev)
    figures: dict[str, Any] = {"pack_ms": pack_s * 1e3,
                               "gather": gather_cost(rb, n, 4 if quick else 30)}
    for name in REGIMES:
        hidden, reps = regimes[name]
        result = run_regime(rb, n, make_compute(rb.width, hidden, reps, dev), dev,
                            rounds, ticks)
        if result is None:
            figures["missing"] = "a packer process's CPU time needs Linux /proc"
            break
        figures[name] = result
    write_result("cpu_split", {"rows": rows, "width": rb.width, "batch": n,
                               "rounds": rounds, "ticks": ticks, "learner_threads": 1,
                               "malloc_thresholds_fixed": malloc_fixed},
                 figures, quick=quick)
    if "missing" in figures:
        print(f"cpu_split: {figures['missing']}")
        return figures
    for name in REGIMES:
        print(table(f"CPU ms per tick by thread, {name}, 0 background processes "
                    f"(mean tick = wall / ticks, median of {rounds} rounds)", [
            (k, f"{v['tick_ms']:.2f}", *(f"{v[f'{role}_ms']:.2f}" for role in ROLES),
             f"{v['cpu_ms']:.2f}", f"{v['cpu_over_sync']:.3f}")
            for k, v in figures[name].items()
        ], ("contender", "tick ms", *ROLES, "all", "x synchronous")))
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
