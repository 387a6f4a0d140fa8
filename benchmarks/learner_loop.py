"""The learner loop, side by side in one process: compute only (the ideal),
synchronous sampling (the baseline), torchrl's ReplayBuffer with prefetch 1 and 2,
and replay_fsm with thread and process collectors at ring depth 2 and 3.

Workload: a buffer of 200k rows x ~500 float32 columns, batches of 16k rows, a
learner step of matmuls (GIL released). Two regimes: compute longer than
pack + copy, and the reverse. The learner runs one torch thread so the packer has
the other core of a 2-core machine, as it would beside a GPU learner.

Throughput is the headline: the MEAN tick (wall time / ticks), which counts every
stall; p50 and p99 of the tick and the learner's stall per tick (time blocked on
its batch) stand beside it. Contention is a dimension: every contender runs with 0,
1 and 2 background CPU-bound processes, and its ratio is to compute-only measured
under the same load. Contenders are interleaved round by round (ABBA), so drift in
the machine's load hits them alike.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from replay_fsm import Pipeline, ReplayBuffer
from replay_fsm.data.sampling import sample_indices

try:
    from common import table, write_result
except ImportError:
    from benchmarks.common import table, write_result


FEATURES = 64  # columns the learner's first layer reads; the rest is carried along
LOADS = (0, 1, 2)


class BackgroundLoad:
    """``k`` CPU-bound processes (busy Python loops) for the length of a with-block:
    what a shared machine, or the simulator beside the learner, does to it."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> BackgroundLoad:
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                      for _ in range(self.k)]
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def make_compute(width: int, hidden: int, reps: int, device: torch.device
                 ) -> Callable[[torch.Tensor], torch.Tensor]:
    """A learner step: a first layer over the batch, then ``reps`` hidden matmuls."""
    gen = torch.Generator().manual_seed(0)
    w1 = (torch.randn(FEATURES, hidden, generator=gen) / FEATURES**0.5).to(device)
    w2 = (torch.randn(hidden, hidden, generator=gen) / hidden**0.5).to(device)

    def step(batch: torch.Tensor) -> torch.Tensor:
        h = torch.relu(batch[:, :FEATURES] @ w1)
        for _ in range(reps):
            h = torch.relu(h @ w2)
        out = h.sum()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out
    return step


class Contender:
    name = ""

    def open(self) -> None: ...

    def tick(self, t: int) -> float:
        """One learner tick; returns the seconds the learner was blocked on its batch."""
        raise NotImplementedError

    def close(self) -> None: ...


class ComputeOnly(Contender):
    name = "compute only (ideal)"

    def __init__(self, rb: ReplayBuffer, n: int, compute: Callable, device: torch.device):
        self.batch = rb.storage[:n].to(device)
        self.compute = compute

    def tick(self, t: int) -> float:
        self.compute(self.batch)
        return 0.0


class GatherOnly(Contender):
    """The unavoidable part of a data-bound tick: the bare gather of a fresh batch
    (``index_select(out=)``, indices drawn outside), no compute."""

    name = "bare gather only"

    def __init__(self, rb: ReplayBuffer, n: int, compute: Callable, device: torch.device):
        self.rb, self.n = rb, n
        self.out = torch.empty(n, rb.width)
        self.indices = [sample_indices(rb.size, n, 50_000 + k) for k in range(64)]

    def tick(self, t: int) -> float:
        torch.index_select(self.rb.storage, 0, self.indices[t % 64], out=self.out)
        return 0.0


class Synchronous(Contender):
    name = "synchronous sampling"

    def __init__(self, rb: ReplayBuffer, n: int, compute: Callable, device: torch.device):
        self.rb, self.n, self.compute, self.device = rb, n, compute, device
        self.out = torch.empty(n, rb.width)

    def tick(self, t: int) -> float:
        t0 = time.perf_counter()
        idx = sample_indices(self.rb.size, self.n, t)
        torch.index_select(self.rb.storage, 0, idx, out=self.out)
        batch = self.out.to(self.device)
        stall = time.perf_counter() - t0
        self.compute(batch)
        return stall


class TorchRL(Contender):
    def __init__(self, rb: ReplayBuffer, n: int, compute: Callable, device: torch.device,
                 prefetch: int):
        self.name = f"torchrl ReplayBuffer prefetch={prefetch}"
        from torchrl.data import LazyTensorStorage
        from torchrl.data import ReplayBuffer as TRB
        from torchrl.data.replay_buffers.samplers import RandomSampler
        self.trb = TRB(storage=LazyTensorStorage(rb.capacity), sampler=RandomSampler(),
                       batch_size=n, prefetch=prefetch)
        self.trb.extend(rb.storage)
        self.compute, self.device = compute, device

    def tick(self, t: int) -> float:
        t0 = time.perf_counter()
        batch = self.trb.sample().to(self.device)
        stall = time.perf_counter() - t0
        self.compute(batch)
        return stall


class ReplayFSM(Contender):
    def __init__(self, rb: ReplayBuffer, n: int, compute: Callable, device: torch.device,
                 collector: str, depth: int):
        self.name = f"replay_fsm {collector} collector, depth {depth}"
        self.rb, self.n, self.compute = rb, n, compute
        self.device, self.collector, self.depth = device, collector, depth

    def open(self) -> None:
        self.pipe = Pipeline(self.rb, device=self.device, sample_count=self.n,
                             ring_depth=self.depth, collector=self.collector,
                             packer_threads=1, liveness_timeout=60)
        self.next = 0
        for t in range(self.depth - 1):
            self.pipe.start_prepare(t, self.n)
        self.requested = self.depth - 1

    def tick(self, t: int) -> float:
        t0 = time.perf_counter()
        self.pipe.sample_large_batch(self.next, self.n)  # blocks only if not ready
        stall = time.perf_counter() - t0
        self.pipe.start_prepare(self.requested, self.n)
        self.requested += 1
        hot = self.pipe.hot
        assert hot is not None
        self.compute(self.pipe.backend.device_slot(hot[1]))  # the packed [n, width] view
        self.pipe.after_tick()
        self.next += 1
        return stall

    def close(self) -> None:
        self.pipe.close()


def run_ticks(c: Contender, ticks: int) -> tuple[list[float], list[float]]:
    """Tick times and learner stalls (seconds) of ``ticks`` ticks after a warm-up."""
    for t in range(3):
        c.tick(t)
    times, stalls = [], []
    for t in range(3, 3 + ticks):
        t0 = time.perf_counter()
        stalls.append(c.tick(t))
        times.append(time.perf_counter() - t0)
    return times, stalls


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_regime(name: str, rb: ReplayBuffer, n: int, compute: Callable, device: torch.device,
               rounds: int, ticks: int, loads: tuple[int, ...], depths: tuple[int, ...],
               collectors: tuple[str, ...], torchrl_note: str | None) -> dict[str, Any]:
    contenders: list[Contender] = [ComputeOnly(rb, n, compute, device),
                                   GatherOnly(rb, n, compute, device),
                                   Synchronous(rb, n, compute, device)]
    missing: dict[str, str] = {}
    for prefetch in (1, 2):
        label = f"torchrl ReplayBuffer prefetch={prefetch}"
        if torchrl_note is None:
            contenders.append(TorchRL(rb, n, compute, device, prefetch))
        else:
            missing[label] = torchrl_note
    for collector in collectors:
        for depth in depths:
            contenders.append(ReplayFSM(rb, n, compute, device, collector, depth))
    nbytes = n * rb.width * 4
    columns: dict[str, Any] = {}
    for load in loads:
        means: dict[str, list[float]] = {c.name: [] for c in contenders}
        times: dict[str, list[float]] = {c.name: [] for c in contenders}
        stalls: dict[str, list[float]] = {c.name: [] for c in contenders}
        with BackgroundLoad(load):
            for r in range(rounds):
                for c in (contenders if r % 2 == 0 else contenders[::-1]):
                    c.open()
                    try:
                        t, s = run_ticks(c, ticks)
                    finally:
                        c.close()
                    means[c.name].append(sum(t) / len(t))
                    times[c.name] += t
                    stalls[c.name] += s
        ideal = statistics.median(means[contenders[0].name])
        rows: dict[str, Any] = {}
        for c in contenders:
            mean = statistics.median(means[c.name])  # the rounds' mean ticks
            rows[c.name] = {
                "mean_tick_ms": mean * 1e3, "tick_over_ideal": mean / ideal,
                "p50_ms": quantile(times[c.name], 0.5) * 1e3,
                "p99_ms": quantile(times[c.name], 0.99) * 1e3,
                "stall_ms": statistics.fmean(stalls[c.name]) * 1e3,
                "rows_per_s": n / mean, "GBps": nbytes / mean / 1e9}
        for label, why in missing.items():
            rows[label] = {"missing": why}
        columns[f"load{load}"] = rows
    return {"regime": name, "loads": list(loads), "columns": columns}


def verdicts(result: dict[str, Any]) -> dict[str, bool]:
    """The budget's claims, checked on this run's numbers."""
    out: dict[str, bool] = {}
    for regime in ("compute-bound", "data-bound"):
        for column, rows in result[regime]["columns"].items():
            ours = {k: v for k, v in rows.items() if k.startswith("replay_fsm")}
            sync = rows["synchronous sampling"]["mean_tick_ms"]
            others = [v["mean_tick_ms"] for k, v in rows.items()
                      if k.startswith("torchrl") and "missing" not in v]
            best = min(v["mean_tick_ms"] for v in ours.values())
            out[f"{regime} {column}: every replay_fsm row <= synchronous"] = all(
                v["mean_tick_ms"] <= sync for v in ours.values())
            out[f"{regime} {column}: best replay_fsm <= every other prefetcher"] = all(
                best <= o for o in [sync, *others])
    rows = result["compute-bound"]["columns"]["load0"]
    out["compute-bound load0: best replay_fsm <= 1.05 x compute only"] = min(
        v["tick_over_ideal"] for k, v in rows.items() if k.startswith("replay_fsm")) <= 1.05
    rows = result["data-bound"]["columns"]["load0"]
    floor = max(rows["compute only (ideal)"]["mean_tick_ms"],
                rows["bare gather only"]["mean_tick_ms"])
    best = min(v["mean_tick_ms"] for k, v in rows.items() if k.startswith("replay_fsm"))
    result["data-bound"]["best_over_floor"] = best / floor
    out["data-bound load0: best replay_fsm <= 1.05 x max(compute, bare gather)"] = (
        best <= 1.05 * floor)
    return out


def main(quick: bool = False, device: str = "cpu") -> dict[str, Any]:
    torch.set_num_threads(1)
    dev = torch.device(device)
    rows, width, n = (20_000, 128, 2048) if quick else (200_000, 500, 16_384)
    rounds, ticks = (1, 4) if quick else (4, 30)
    loads = (0, 1) if quick else LOADS
    rb = ReplayBuffer(rows, (width - 5) // 2, 2)
    rb.add_packed(torch.randn(rows, rb.width))
    try:
        import torchrl  # noqa: F401
        torchrl_note = None
    except ImportError:
        torchrl_note = "torchrl not installed (make bench installs it)"
    # Calibrate: pack time, then compute of ~2x (heavy) and ~0.4x (light) of it.
    out = torch.empty(n, rb.width)
    t0 = time.perf_counter()
    for k in range(5):
        torch.index_select(rb.storage, 0, sample_indices(rows, n, k), out=out)
    pack_s = (time.perf_counter() - t0) / 5
    hidden = 128

    def cost(reps: int) -> float:
        probe = make_compute(rb.width, hidden, reps, dev)
        probe(out.to(dev))
        t0 = time.perf_counter()
        for _ in range(5):
            probe(out.to(dev))
        return (time.perf_counter() - t0) / 5

    base, per_rep = cost(0), max((cost(8) - cost(0)) / 8, 1e-6)
    regimes = {"compute-bound": max(0, round((2.0 * pack_s - base) / per_rep)),
               "data-bound": max(0, round((0.4 * pack_s - base) / per_rep))}
    results: dict[str, Any] = {"pack_ms": pack_s * 1e3, "compute_base_ms": base * 1e3,
                               "compute_rep_ms": per_rep * 1e3}
    for name, reps in regimes.items():
        compute = make_compute(rb.width, hidden, reps, dev)
        results[name] = run_regime(name, rb, n, compute, dev, rounds, ticks, loads, (2, 3),
                                   ("thread", "process"), torchrl_note)
        results[name]["compute_reps"] = reps
    results["verdicts"] = verdicts(results)
    write_result("learner_loop", {"rows": rows, "width": rb.width, "batch": n,
                                  "device": device, "rounds": rounds, "ticks": ticks,
                                  "loads": list(loads), "learner_threads": 1},
                 results, quick=quick)
    print(f"pack (index_select) {pack_s * 1e3:.2f} ms per batch")
    for name in regimes:
        for column, table_rows in results[name]["columns"].items():
            print(table(f"learner loop, {name}, {column[4:]} background processes "
                        f"({device}; mean tick = wall / ticks, median of {rounds} rounds)", [
                (k, f"{v['mean_tick_ms']:.2f}", f"{v['tick_over_ideal']:.3f}",
                 f"{v['p50_ms']:.2f}", f"{v['p99_ms']:.2f}", f"{v['stall_ms']:.2f}")
                if "missing" not in v else (k, v["missing"], "", "", "", "")
                for k, v in table_rows.items()
            ], ("contender", "mean ms", "x compute", "p50 ms", "p99 ms", "stall ms")))
    for claim, ok in results["verdicts"].items():
        print(f"{'holds ' if ok else 'MISSED'}  {claim}")
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    main(args.quick, args.device)
