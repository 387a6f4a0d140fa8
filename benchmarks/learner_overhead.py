"""Learner-visible overhead per tick with the batch already ready:
sample_large_batch + after_tick + start_prepare (budget: 30 us median, 100 us p99 on
2 cores), with the packer idle and with the packer gathering the next batch at the
same time (thread and process collectors: a packer thread shares the GIL with the
learner); and allocations per tick in steady state: net Python bytes (tracemalloc)
and torch CPU allocations on the learner's calls (torch.profiler); budget 0."""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc

import torch

from replay_fsm import Pipeline, ReplayBuffer

try:
    from common import table, write_result
except ImportError:
    from benchmarks.common import table, write_result


def main(quick: bool = False) -> dict[str, float]:
    ticks = 200 if quick else 3000
    rb = ReplayBuffer(4096, 16, 4)
    rb.add_packed(torch.randn(4096, rb.width))
    n = 256
    figures: dict[str, float] = {}
    for depth in (2, 3):
        with Pipeline(rb, sample_count=n, ring_depth=depth) as pipe:
            samples = []
            for tick in range(depth - 1):
                pipe.start_prepare(tick, n)
            for tick in range(ticks):
                pipe.wait_until_ready(tick, n)  # outside the timed region
                t0 = time.perf_counter_ns()
                pipe.sample_large_batch(tick, n)
                pipe.after_tick()
                pipe.start_prepare(tick + depth - 1, n)
                samples.append(time.perf_counter_ns() - t0)
            steady = sorted(samples[len(samples) // 10:])
            figures[f"depth{depth}_us_median"] = statistics.median(steady) / 1e3
            figures[f"depth{depth}_us_p90"] = steady[int(len(steady) * 0.9)] / 1e3
            figures[f"depth{depth}_us_p99"] = steady[int(len(steady) * 0.99)] / 1e3
            # Allocations per tick in steady state: net bytes still held after K ticks.
            tracemalloc.start()
            snap0 = tracemalloc.take_snapshot()
            k = 1000
            for tick in range(ticks, ticks + k):
                pipe.wait_until_ready(tick, n)
                pipe.sample_large_batch(tick, n)
                pipe.after_tick()
                pipe.start_prepare(tick + depth - 1, n)
            snap1 = tracemalloc.take_snapshot()
            tracemalloc.stop()
            diff = sum(s.size_diff for s in snap1.compare_to(snap0, "filename")
                       if "tracemalloc" not in str(s.traceback))
            figures[f"depth{depth}_net_bytes_per_tick"] = diff / k
            # torch's own CPU allocations on the learner's calls, from the profiler.
            act = [torch.profiler.ProfilerActivity.CPU]
            with torch.profiler.profile(activities=act, profile_memory=True) as prof:
                for tick in range(ticks + k, ticks + 2 * k):
                    pipe.wait_until_ready(tick, n)
                    pipe.sample_large_batch(tick, n)
                    pipe.after_tick()
                    pipe.start_prepare(tick + depth - 1, n)
            allocs = [e for e in prof.events() if e.cpu_memory_usage > 0]
            figures[f"depth{depth}_torch_allocs_per_tick"] = len(allocs) / k
    for collector in ("thread", "process"):
        med, p99, prepare = packer_idle(collector, quick)
        figures[f"idle_{collector}_us_median"] = med
        figures[f"idle_{collector}_us_p99"] = p99
        figures[f"idle_{collector}_start_prepare_us_median"] = prepare
    for collector in ("thread", "process"):
        med, p99, share = while_gathering(collector, quick)
        figures[f"gathering_{collector}_us_median"] = med
        figures[f"gathering_{collector}_us_p99"] = p99
        figures[f"gathering_{collector}_share"] = share
    figures["budget_us_median"] = 30.0
    figures["budget_us_p99"] = 100.0
    write_result("learner_overhead", {"sample_count": n, "width": rb.width, "ticks": ticks},
                 figures, quick=quick)
    print(table("learner-visible overhead per tick, batch ready, packer idle (us)", [
        (f"ring depth {d}", f"{figures[f'depth{d}_us_median']:.1f}",
         f"{figures[f'depth{d}_us_p99']:.1f}",
         f"{figures[f'depth{d}_net_bytes_per_tick']:.1f}",
         f"{figures[f'depth{d}_torch_allocs_per_tick']:.2f}") for d in (2, 3)
    ], ("config", "median", "p99", "net bytes/tick", "torch allocs/tick")))
    print(table("the same by collector, ring depth 3, the packer asleep when asked (us)", [
        (f"{c} collector", f"{figures[f'idle_{c}_us_median']:.1f}",
         f"{figures[f'idle_{c}_us_p99']:.1f}",
         f"{figures[f'idle_{c}_start_prepare_us_median']:.1f}") for c in ("thread", "process")
    ], ("config", "median", "p99", "start_prepare median")))
    print(table("learner-visible overhead per tick, batch ready, packer gathering (us)", [
        (f"{c} collector", f"{figures[f'gathering_{c}_us_median']:.1f}",
         f"{figures[f'gathering_{c}_us_p99']:.1f}",
         f"{100 * figures[f'gathering_{c}_share']:.0f} %") for c in ("thread", "process")
    ], ("config", "median", "p99", "ticks timed mid-gather")))
    return figures


def packer_idle(collector: str, quick: bool) -> tuple[float, float, float]:
    """The learner's calls with the next batch ready too (ring depth 3, small
    batches), so the packer sleeps on its channel when ``start_prepare`` asks it for
    more: the request wakes it (a thread of this process or another process).
    Returns median and p99 of the three calls and the median of ``start_prepare``
    alone, in microseconds."""
    rb = ReplayBuffer(4096, 16, 4)
    rb.add_packed(torch.randn(4096, rb.width))
    n, ticks = 256, (200 if quick else 3000)
    totals, prepares = [], []
    with Pipeline(rb, sample_count=n, ring_depth=3, collector=collector,
                  packer_threads=1, liveness_timeout=60) as pipe:
        pipe.start_prepare(0, n)
        pipe.start_prepare(1, n)
        for tick in range(ticks):
            pipe.wait_until_ready(tick + 1, n)  # both batches ready: the packer idles
            t0 = time.perf_counter_ns()
            pipe.sample_large_batch(tick, n)
            pipe.after_tick()
            t1 = time.perf_counter_ns()
            pipe.start_prepare(tick + 2, n)
            t2 = time.perf_counter_ns()
            totals.append(t2 - t0)
            prepares.append(t2 - t1)
    steady = sorted(totals[len(totals) // 10:])
    return (statistics.median(steady) / 1e3, steady[int(len(steady) * 0.99)] / 1e3,
            statistics.median(prepares[len(prepares) // 10:]) / 1e3)


def while_gathering(collector: str, quick: bool) -> tuple[float, float, float]:
    """The overhead of the learner's calls on a ready batch while the packer gathers
    the next one (ring depth 3, batches whose gather takes milliseconds). Only ticks
    whose next batch was not ready when the calls began count. Returns median and
    p99 in microseconds, and the share of ticks that counted."""
    rows, width, n = (20_000, 128, 4096) if quick else (200_000, 500, 16_384)
    rb = ReplayBuffer(rows, (width - 5) // 2, 2)
    rb.add_packed(torch.randn(rows, rb.width))
    ticks = 30 if quick else 400
    samples = []
    with Pipeline(rb, sample_count=n, ring_depth=3, collector=collector,
                  packer_threads=1, liveness_timeout=60) as pipe:
        pipe.start_prepare(0, n)
        pipe.start_prepare(1, n)
        for tick in range(ticks):
            pipe.wait_until_ready(tick, n)
            gathering = not pipe.batch_ready(tick + 1, n)
            t0 = time.perf_counter_ns()
            pipe.sample_large_batch(tick, n)
            pipe.after_tick()
            pipe.start_prepare(tick + 2, n)
            dt = time.perf_counter_ns() - t0
            if gathering and tick >= 3:
                samples.append(dt)
    if not samples:
        return float("nan"), float("nan"), 0.0
    samples.sort()
    return (statistics.median(samples) / 1e3, samples[int(len(samples) * 0.99)] / 1e3,
            len(samples) / (ticks - 3))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    main(ap.parse_args().quick)
