"""CUDA: the pipeline's copy bandwidth vs a bare pinned ``copy_(non_blocking=True)``
of the same bytes (budget: within 10%). Skips without a CUDA device."""

from __future__ import annotations

import argparse
import statistics

import torch

from replay_fsm import Pipeline, ReplayBuffer

try:
    from common import table, write_result
except ImportError:
    from benchmarks.common import table, write_result


def main(quick: bool = False) -> dict[str, float] | None:
    if not torch.cuda.is_available():
        print("cuda_copy: no CUDA device here, skipped")
        return None
    rows, width, n = (20_000, 128, 2048) if quick else (200_000, 500, 16_384)
    reps = 5 if quick else 50
    rb = ReplayBuffer(rows, (width - 5) // 2, 2)
    rb.add_packed(torch.randn(rows, rb.width))
    host = torch.empty(n, rb.width).pin_memory()
    dev = torch.empty(n, rb.width, device="cuda")
    stream = torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    bare = []
    for _ in range(reps):
        with torch.cuda.stream(stream):
            start.record(stream)
            dev.copy_(host, non_blocking=True)
            end.record(stream)
        end.synchronize()
        bare.append(start.elapsed_time(end) / 1e3)
    nbytes = n * rb.width * 4
    with Pipeline(rb, device="cuda", sample_count=n, backend_options={"timing": True},
                  ring_depth=2) as pipe:
        ours = []
        for _tick, _ in pipe.ticks(0, reps):
            slot = pipe.slot_of(_tick)
            ours.append(pipe.backend.last_copy_ms[slot] / 1e3)  # type: ignore[attr-defined]
    figures = {"bare_GBps": nbytes / statistics.median(bare) / 1e9,
               "pipeline_GBps": nbytes / statistics.median(ours) / 1e9}
    figures["ratio"] = figures["pipeline_GBps"] / figures["bare_GBps"]
    figures["budget_ratio"] = 0.9
    write_result("cuda_copy", {"batch": n, "width": rb.width,
                               "gpu": torch.cuda.get_device_name()}, figures, quick=quick)
    print(table("CUDA host-to-device copy (median)", [
        ("bare pinned copy_(non_blocking=True)", f"{figures['bare_GBps']:.2f}", "1.00"),
        ("replay_fsm (registered shared slots)", f"{figures['pipeline_GBps']:.2f}",
         f"{figures['ratio']:.2f}")], ("copy", "GB/s", "ratio")))
    return figures


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    main(ap.parse_args().quick)
