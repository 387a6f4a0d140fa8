"""Learner-visible overhead per tick with the batch already ready:
sample_large_batch + after_tick + start_prepare (budget: 30 us median, 100 us p99 on
2 cores), with the packer idle and with the packer gathering the next batch at the
same time (thread and process collectors: a packer thread shares the GIL with the
learner); and allocations per tick in steady state: net Python bytes (tracemalloc)
and torch CPU allocations on the learner's calls (torch.profiler); budget 0.

Those figures are taken with the interpreter's working set in the CPU caches: the
calls follow each other. In a learner they do not: the step between them streams
megabytes of activations and batch through the caches, and the calls then run with
their code and objects evicted. The cold-cache figures repeat the calls with the
learner streaming a buffer larger than the last-level cache between them, at the
point its step would run, beside the bare hand-off of a double buffer (a semaphore
acquired and one released, as ``learner_loop.BareDoubleBuffer`` does) under the same
eviction: what any prefetcher's hand-off costs there."""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import tracemalloc

import torch

from replay_fsm import Pipeline, ReplayBuffer

try:
    from common import keep_by_machine, quantile, table, write_result
except ImportError:
    from benchmarks.common import keep_by_machine, quantile, table, write_result


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
            steady = samples[len(samples) // 10:]
            figures[f"depth{depth}_us_median"] = statistics.median(steady) / 1e3
            figures[f"depth{depth}_us_p90"] = quantile(steady, 0.9) / 1e3
            figures[f"depth{depth}_us_p99"] = quantile(steady, 0.99) / 1e3
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
        for key, value in while_gathering(collector, quick).items():
            figures[f"gathering_{collector}_{key}"] = value
    figures.update(cold_cache(quick))
    figures["budget_us_median"] = 30.0
    figures["budget_us_p99"] = 100.0
    path = write_result("learner_overhead", {"sample_count": n, "width": rb.width,
                                             "ticks": ticks}, figures, quick=quick)
    if not quick:
        keep_by_machine(path)
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
         f"{100 * figures[f'gathering_{c}_share']:.0f} %",
         f"{figures[f'gathering_{c}_handoff_us_median']:.1f}",
         f"{figures[f'gathering_{c}_over_handoff']:.1f}") for c in ("thread", "process")
    ], ("config", "median", "p99", "ticks timed mid-gather", "bare hand-off median",
        "x the hand-off (same run)")))
    print(table(f"learner-visible overhead per tick, cache evicted between the calls "
                f"({figures['cold_evict_MB']:.0f} MB streamed where the step runs; us)", [
        (f"{c} collector", f"{figures[f'cold_{c}_us_median']:.1f}",
         f"{figures[f'cold_{c}_us_p99']:.1f}",
         f"{figures[f'cold_{c}_over_handoff']:.1f}") for c in ("thread", "process")
    ] + [("bare double buffer hand-off", f"{figures['cold_handoff_us_median']:.1f}",
          f"{figures['cold_handoff_us_p99']:.1f}", "1.0")],
        ("config", "median", "p99", "x the bare hand-off (same round)")))
    return figures


# Streamed between the learner's calls: larger than the last-level cache of this
# machine (32 MB) and of most CPUs a learner runs on.
EVICT_BYTES = 64 * 2**20
COLD = ("thread", "process", "handoff")
# Untimed ticks first: a packer process may still be settling after its first pack.
WARM_UP = 100


def cold_cache(quick: bool) -> dict[str, float]:
    """The learner's calls per tick with the caches evicted where its step runs, for
    the thread and process collectors and the bare double buffer's hand-off, in
    interleaved rounds (ABBA). Returns per contender the median over rounds of each
    round's median and p99 (us), and the median of the rounds' ratios to the
    hand-off measured in the same round."""
    rounds, ticks = (2, 60) if quick else (6, 300)
    evict = torch.zeros(EVICT_BYTES // 4)
    per: dict[str, list[tuple[float, float]]] = {k: [] for k in COLD}
    # One torch thread, as in learner_loop: the step leaves the other core to the
    # packer (with two, the step's second OpenMP thread spins on it after each op).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for r in range(rounds):
            for kind in (COLD if r % 2 == 0 else COLD[::-1]):
                samples = (cold_handoff(evict, ticks) if kind == "handoff"
                           else cold_pipeline(kind, evict, ticks))
                per[kind].append((statistics.median(samples), quantile(samples, 0.99)))
    finally:
        torch.set_num_threads(threads)
    out: dict[str, float] = {}
    for kind in COLD:
        out[f"cold_{kind}_us_median"] = statistics.median(m for m, _ in per[kind]) / 1e3
        out[f"cold_{kind}_us_p99"] = statistics.median(p for _, p in per[kind]) / 1e3
        if kind != "handoff":
            out[f"cold_{kind}_over_handoff"] = statistics.median(
                a[0] / b[0] for a, b in zip(per[kind], per["handoff"], strict=True))
    out["cold_evict_MB"] = EVICT_BYTES / 2**20
    out["cold_rounds"] = rounds
    return out


def cold_pipeline(collector: str, evict: torch.Tensor, ticks: int) -> list[int]:
    """Per tick (ns): ``sample_large_batch`` and ``start_prepare``, then the step
    (streaming ``evict`` through the caches, not timed), then ``after_tick``, as a
    learner makes them. Ring depth 3 and small batches; each tick waits, untimed,
    for the packer to pack the next batch before its step, so the calls never wait
    and the packer idles: the figure is the calls' own cost with their code and data
    evicted."""
    rb = ReplayBuffer(4096, 16, 4)
    rb.add_packed(torch.randn(4096, rb.width))
    n = 256
    samples = []
    with Pipeline(rb, sample_count=n, ring_depth=3, collector=collector,
                  packer_threads=1, liveness_timeout=60) as pipe:
        pipe.start_prepare(0, n)
        pipe.start_prepare(1, n)
        # With a timeout the learner does not pack for itself: the packer (a process
        # starting up, too) serves every tick, and the calls below never wait.
        if not pipe.wait_until_ready(1, n, timeout=120):
            raise RuntimeError("the packer served nothing within 120 s")
        for tick in range(WARM_UP + ticks):
            t0 = time.perf_counter_ns()
            pipe.sample_large_batch(tick, n)  # ready: it was waited for
            pipe.start_prepare(tick + 2, n)
            t1 = time.perf_counter_ns()
            if not pipe.wait_until_ready(tick + 2, n, timeout=120):
                raise RuntimeError(f"tick {tick + 2} not packed within 120 s")
            evict.add_(1.0)  # the learner's step
            t2 = time.perf_counter_ns()
            pipe.after_tick()
            samples.append(t1 - t0 + time.perf_counter_ns() - t2)
    return samples[WARM_UP:]


class Handoff:
    """The bare double buffer's hand-off, as ``learner_loop.BareDoubleBuffer`` makes
    it: acquire the gathered batch, release the gatherer (a thread that hands the
    next one back at once). A context manager: the thread runs inside it."""

    def __init__(self) -> None:
        self.wanted, self.gathered = threading.Semaphore(0), threading.Semaphore(1)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._gatherer, daemon=True)

    def _gatherer(self) -> None:
        while True:
            self.wanted.acquire()
            if self.stopping.is_set():
                return
            self.gathered.release()

    def __enter__(self) -> Handoff:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.wanted.release()
        self.thread.join()

    def wait_ready(self) -> None:
        """Until the next batch is handed back (not timed: as the pipeline's wait)."""
        self.gathered.acquire()
        self.gathered.release()

    def timed(self) -> int:
        """One hand-off of a ready batch (ns)."""
        t0 = time.perf_counter_ns()
        self.gathered.acquire()
        self.wanted.release()
        return time.perf_counter_ns() - t0


def cold_handoff(evict: torch.Tensor, ticks: int) -> list[int]:
    """Per tick (ns): the bare double buffer's hand-off with the caches evicted
    before it, where the step runs."""
    samples = []
    with Handoff() as handoff:
        for _ in range(WARM_UP + ticks):
            handoff.wait_ready()
            evict.add_(1.0)
            samples.append(handoff.timed())
    return samples[WARM_UP:]


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
    steady = totals[len(totals) // 10:]
    return (statistics.median(steady) / 1e3, quantile(steady, 0.99) / 1e3,
            statistics.median(prepares[len(prepares) // 10:]) / 1e3)


def while_gathering(collector: str, quick: bool) -> dict[str, float]:
    """The overhead of the learner's calls on a ready batch while the packer gathers
    the next one (ring depth 3, batches whose gather takes milliseconds), beside the
    bare double buffer's hand-off timed in the same run: the learner comes to both
    from a wait of milliseconds for its batch, its code and data cold, which no
    prefetcher's hand-off avoids. Only ticks whose next batch was not ready when the
    calls began count; in even ticks the calls are timed first, in odd ones the
    hand-off, and each contender's figures are of the ticks it went first. Returns
    ``us_median``, ``us_p99``, ``share`` (of ticks that counted), ``handoff_us_median``
    and ``over_handoff`` (the two medians' ratio)."""
    rows, width, n = (20_000, 128, 4096) if quick else (200_000, 500, 16_384)
    rb = ReplayBuffer(rows, (width - 5) // 2, 2)
    rb.add_packed(torch.randn(rows, rb.width))
    ticks = 30 if quick else 400
    ours, bare, counted = [], [], 0
    with Pipeline(rb, sample_count=n, ring_depth=3, collector=collector,
                  packer_threads=1, liveness_timeout=60) as pipe, Handoff() as handoff:
        pipe.start_prepare(0, n)
        pipe.start_prepare(1, n)
        for tick in range(ticks):
            handoff.wait_ready()
            pipe.wait_until_ready(tick, n)
            gathering = not pipe.batch_ready(tick + 1, n)
            first = handoff.timed() if tick % 2 else None
            t0 = time.perf_counter_ns()
            pipe.sample_large_batch(tick, n)
            pipe.after_tick()
            pipe.start_prepare(tick + 2, n)
            dt = time.perf_counter_ns() - t0
            if first is None:
                handoff.timed()  # second: not counted
            if gathering and tick >= 3:
                counted += 1
                if first is None:
                    ours.append(dt)
                else:
                    bare.append(first)
    if not ours or not bare:
        nan = float("nan")
        return {"us_median": nan, "us_p99": nan, "share": 0.0, "handoff_us_median": nan,
                "over_handoff": nan}
    median, handoff_median = statistics.median(ours), statistics.median(bare)
    return {"us_median": median / 1e3, "us_p99": quantile(ours, 0.99) / 1e3,
            "share": counted / (ticks - 3), "handoff_us_median": handoff_median / 1e3,
            "over_handoff": median / handoff_median}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    main(ap.parse_args().quick)
