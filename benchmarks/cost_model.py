"""The cost model and its scaling curves: tick ~ max(compute, pack, copy) + overhead.

Each term is measured alone, at each point of five sweeps around one base
configuration (batch 16k rows, rows of 256 float32, a buffer of 500k rows, ring
depth 2, one packer thread):
- compute: the learner's step on a ready batch (fixed work per row, one thread);
- pack: the bare gather of a batch (``index_select(out=)``, fresh indices, with as
  many torch threads as the packer gets);
- copy: host to device; zero on the CPU backend (the batch views the host slot);
- overhead: the learner-visible cost of request + acquire + release with the batch
  ready (measured once, at the base point).
Then the pipeline's mean tick (process collector, so the packer has its own
interpreter) and synchronous sampling's are measured at the same point. Every figure
is the median of three windows (of ``reps`` calls, or of ``ticks`` ticks). The model
and both measurements go into one plot per sweep (benchmarks/results/cost_model.png)
and into benchmarks/results/cost_model.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from replay_fsm import Pipeline, ReplayBuffer
from replay_fsm.data.sampling import sample_indices

try:
    from common import RESULTS, steady_malloc, table, write_result
    from learner_loop import make_compute
except ImportError:
    from benchmarks.common import RESULTS, steady_malloc, table, write_result
    from benchmarks.learner_loop import make_compute

BASE = {"batch": 16_384, "width": 256, "rows": 500_000, "depth": 2, "packer_threads": 1}
SWEEPS: dict[str, list[int]] = {
    "batch": [1024, 2048, 4096, 8192, 16_384, 32_768, 65_536],
    "width": [64, 128, 256, 512, 1024, 2048],
    "rows": [100_000, 200_000, 500_000, 1_000_000, 2_000_000],
    "depth": [2, 3, 4],
    "packer_threads": [1, 2],
}
QUICK_SWEEPS: dict[str, list[int]] = {"batch": [1024, 4096], "depth": [2, 3]}
QUICK_BASE = {"batch": 2048, "width": 64, "rows": 20_000, "depth": 2, "packer_threads": 1}


def mean_time(fn: Any, reps: int, windows: int = 1) -> float:
    """Seconds per call, the mean over ``reps`` calls; with ``windows`` > 1, the median
    of that many such means (a hiccup of the machine moves one window, not the
    figure)."""
    fn(0)
    means = []
    for w in range(windows):
        t0 = time.perf_counter()
        for k in range(1 + w * reps, 1 + (w + 1) * reps):
            fn(k)
        means.append((time.perf_counter() - t0) / reps)
    return statistics.median(means)


class Buffers:
    """One replay buffer per (rows, width), filled once and kept for the run."""

    def __init__(self) -> None:
        self.cache: dict[tuple[int, int], ReplayBuffer] = {}

    def get(self, rows: int, width: int) -> ReplayBuffer:
        key = (rows, width)
        if key not in self.cache:
            self.cache.clear()  # one at a time: the largest are gigabytes
            rb = ReplayBuffer(rows, (width - 5) // 2, width - 3 - 2 * ((width - 5) // 2))
            assert rb.width == width
            chunk = 100_000
            for start in range(0, rows, chunk):
                rb.add_packed(torch.rand(min(chunk, rows - start), width))
            self.cache[key] = rb
        return self.cache[key]


def measure_point(rb: ReplayBuffer, cfg: dict[str, int], compute: Any, overhead_s: float,
                  ticks: int, reps: int) -> dict[str, float]:
    n, threads = cfg["batch"], cfg["packer_threads"]
    out = torch.empty(n, rb.width)
    batch = rb.storage[:n].clone()
    compute_s = mean_time(lambda k: compute(batch), reps, windows=3)
    torch.set_num_threads(threads)
    pack_s = mean_time(lambda k: torch.index_select(
        rb.storage, 0, sample_indices(rb.size, n, 7_000 + k), out=out), reps, windows=3)
    torch.set_num_threads(1)

    def sync_tick(k: int) -> None:
        torch.index_select(rb.storage, 0, sample_indices(rb.size, n, k), out=out)
        compute(out)
    sync_s = mean_time(sync_tick, reps, windows=3)
    with Pipeline(rb, sample_count=n, ring_depth=cfg["depth"], collector="process",
                  packer_threads=threads, liveness_timeout=60) as pipe:
        for t in range(cfg["depth"] - 1):
            pipe.start_prepare(t, n)
        requested = cfg["depth"] - 1

        def tick(t: int) -> None:
            nonlocal requested
            pipe.sample_large_batch(t, n)
            pipe.start_prepare(requested, n)
            requested += 1
            compute(pipe.backend.device_slot(pipe.slot_of(t)))  # type: ignore[arg-type]
            pipe.after_tick()
        for t in range(3):
            tick(t)
        # The median of three windows: one hiccup of the machine (a page compaction,
        # a neighbour's burst) moves one window, not the figure.
        windows = []
        for w in range(3):
            t0 = time.perf_counter()
            for t in range(3 + w * ticks, 3 + (w + 1) * ticks):
                tick(t)
            windows.append((time.perf_counter() - t0) / ticks)
        pipe_s = statistics.median(windows)
    copy_s = 0.0  # CPU backend: zero-copy
    model_s = max(compute_s, pack_s, copy_s) + overhead_s
    return {"compute_ms": compute_s * 1e3, "pack_ms": pack_s * 1e3, "copy_ms": copy_s,
            "overhead_ms": overhead_s * 1e3, "model_ms": model_s * 1e3,
            "pipeline_ms": pipe_s * 1e3, "sync_ms": sync_s * 1e3,
            "pipeline_over_model": pipe_s / model_s, "speedup_vs_sync": sync_s / pipe_s}


def learner_overhead(rb: ReplayBuffer, n: int, ticks: int) -> float:
    """Median request + acquire + release with the batch ready (seconds)."""
    samples = []
    with Pipeline(rb, sample_count=n, ring_depth=2, liveness_timeout=60) as pipe:
        pipe.start_prepare(0, n)
        for t in range(ticks):
            pipe.wait_until_ready(t, n)
            t0 = time.perf_counter()
            pipe.sample_large_batch(t, n)
            pipe.after_tick()
            pipe.start_prepare(t + 1, n)
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def plot(figures: dict[str, Any], path: Any) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sweeps = figures["sweeps"]
    fig, axes = plt.subplots(1, len(sweeps), figsize=(4.2 * len(sweeps), 3.8))
    axes = [axes] if len(sweeps) == 1 else list(axes)
    for ax, (param, points) in zip(axes, sweeps.items(), strict=True):
        xs = [p["value"] for p in points]
        for key, style, label in (("pipeline_ms", "o-", "pipeline (measured)"),
                                  ("model_ms", "k--", "model max(C, P, X) + O"),
                                  ("sync_ms", "s:", "synchronous (measured)"),
                                  ("compute_ms", "-", "compute C"),
                                  ("pack_ms", "-", "pack P")):
            ax.plot(xs, [p[key] for p in points], style, label=label,
                    alpha=1.0 if key in ("pipeline_ms", "model_ms") else 0.6)
        if param in ("batch", "width", "rows"):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
        ax.set_xlabel(param.replace("_", " "))
        ax.set_ylabel("ms per tick")
        ax.set_title(f"sweep over {param.replace('_', ' ')}")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def save(figures: dict[str, Any], config: dict[str, Any], quick: bool) -> Path:
    """Draw the plot of ``figures``, then write them with ``config`` as the result file,
    with the plot's name (``figures["plot"]``, None where none could be drawn, and an
    earlier run's plot is then removed, not left beside these figures). Once the JSON
    was written first and the name set after: no result file named its plot, and the
    README's section, which shows the plot its JSON names, showed none. A plot that
    raises is one not drawn: the figures are written, then its error raised, not the
    run's minutes of figures lost with it. Returns the result file's path.

    Raises:
        Exception: what drawing the plot raised, once the figures are written.
    """
    png = RESULTS / f"cost_model{'-quick' if quick else ''}.png"
    RESULTS.mkdir(parents=True, exist_ok=True)
    failed: Exception | None = None
    try:
        drawn = plot(figures, png)
    except Exception as exc:  # noqa: BLE001 - raised once the figures are kept
        drawn, failed = False, exc
    if drawn:
        figures["plot"] = png.name
    else:
        png.unlink(missing_ok=True)
        figures["plot"] = None
    path = write_result("cost_model", config, figures, quick=quick)
    if failed is not None:
        raise failed
    return path


def main(quick: bool = False) -> dict[str, Any]:
    malloc_fixed = steady_malloc()  # the learner step's temporaries: see common
    torch.set_num_threads(1)
    base = QUICK_BASE if quick else BASE
    sweeps = QUICK_SWEEPS if quick else SWEEPS
    ticks, reps = (5, 3) if quick else (30, 10)
    buffers = Buffers()
    rb = buffers.get(base["rows"], base["width"])
    overhead_s = learner_overhead(rb, 256, 50 if quick else 500)
    # Compute: fixed work per row, sized so that compute and pack cross near the base.
    n = base["batch"]
    out = torch.empty(n, rb.width)
    pack_base = mean_time(lambda k: torch.index_select(
        rb.storage, 0, sample_indices(rb.size, n, k), out=out), reps)
    per_rep = max(mean_time(lambda k: make_compute(rb.width, 128, 4, torch.device("cpu"))(
        out), 3) / 4, 1e-6)
    reps_compute = max(1, round(pack_base / per_rep))
    compute = make_compute(rb.width, 128, reps_compute, torch.device("cpu"))
    figures: dict[str, Any] = {"base": base, "overhead_us": overhead_s * 1e6,
                               "compute_reps": reps_compute, "sweeps": {}}
    for param, values in sweeps.items():
        points = []
        for value in values:
            cfg = {**base, param: value}
            rb = buffers.get(cfg["rows"], cfg["width"])
            point = measure_point(rb, cfg, compute, overhead_s, ticks, reps)
            points.append({"value": value, **point})
            print(f"{param}={value}: pipeline {point['pipeline_ms']:.2f} ms, model "
                  f"{point['model_ms']:.2f} ms, sync {point['sync_ms']:.2f} ms", flush=True)
        figures["sweeps"][param] = points
    errors = [abs(p["pipeline_over_model"] - 1) for ps in figures["sweeps"].values()
              for p in ps]
    figures["model_error_median"] = statistics.median(errors)
    figures["model_error_max"] = max(errors)
    save(figures, {"base": base, "ticks": ticks, "reps": reps,
                   "malloc_thresholds_fixed": malloc_fixed}, quick)
    for param, points in figures["sweeps"].items():
        print(table(f"sweep over {param} (ms per tick)", [
            (str(p["value"]), f"{p['compute_ms']:.2f}", f"{p['pack_ms']:.2f}",
             f"{p['model_ms']:.2f}", f"{p['pipeline_ms']:.2f}", f"{p['sync_ms']:.2f}",
             f"{p['pipeline_over_model']:.2f}", f"{p['speedup_vs_sync']:.2f}")
            for p in points],
            (param, "compute", "pack", "model", "pipeline", "sync", "pipe/model",
             "x sync")))
    print(f"model error |pipeline/model - 1|: median {figures['model_error_median']:.3f}, "
          f"max {figures['model_error_max']:.3f}")
    return figures


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    main(ap.parse_args().quick)
