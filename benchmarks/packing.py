"""Packing and control-plane figures, all in one run:
- pack throughput of the Packer (request, sample, seqlocked gather, done) vs a bare
  torch.index_select(out=) of the same indices vs a memcpy of the same bytes
  (budget: packer >= 95% of index_select). The packer is timed as the pipeline uses
  it, from request to done with the packer idle between requests (it draws the next
  tick's indices then, off the critical path), and back to back, with no idle time
  (it draws them on the critical path);
- ReplayBuffer.add throughput;
- cross-process request/done round trip over our channels vs an mp.Queue ping-pong
  (budget: <= 0.5x)."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from collections.abc import Callable
from typing import Any

import torch

from replay_fsm.data.buffer import ReplayBuffer
from replay_fsm.data.channel import Channel
from replay_fsm.data.packer import Packer, PackerHandle
from replay_fsm.data.sampling import sample_indices
from replay_fsm.wire import PackRequest, encode

try:
    from common import median_time, table, write_result
except ImportError:
    from benchmarks.common import median_time, table, write_result


def _channel_echo(inbox: Channel, outbox: Channel, n: int) -> None:
    for _ in range(n):
        got = inbox.get(timeout=60)
        assert got is not None
        outbox.put(got[0])


def _queue_echo(inbox: mp.Queue, outbox: mp.Queue, n: int) -> None:
    for _ in range(n):
        outbox.put(inbox.get(timeout=60))


def _ping_pong(target: Callable[..., None], out_ch: Any, in_ch: Any, msg: Any,
               n: int) -> float:
    """Seconds per round trip: ``msg`` out, echoed back by a spawned process."""
    proc = mp.get_context("spawn").Process(target=target, args=(out_ch, in_ch, n + 10))
    proc.start()
    for _ in range(10):  # warm-up: the child has started and both sides are hot
        out_ch.put(msg)
        in_ch.get(timeout=60)
    t0 = time.perf_counter()
    for _ in range(n):
        out_ch.put(msg)
        in_ch.get(timeout=60)
    elapsed = (time.perf_counter() - t0) / n
    proc.join(30)
    return elapsed


def round_trips(n: int) -> tuple[float, float]:
    """Our request/done channels vs an mp.Queue carrying the seed's request dict."""
    ctx = mp.get_context("spawn")
    ours = _ping_pong(_channel_echo, Channel(2, 9), Channel(2, 9), list(range(9)), n)
    req = {"tick_id": 0, "snapshot_ptr": 1, "snapshot_size": 1, "min_snapshot_ptr": 0,
           "sample_seed": 0, "sample_count": 1, "shared_slot": 0, "target_gpu_slot": 0}
    theirs = _ping_pong(_queue_echo, ctx.Queue(2), ctx.Queue(2), req, n)
    return ours, theirs


def main(quick: bool = False) -> dict[str, float]:
    rows, width, batch = (20_000, 128, 2048) if quick else (200_000, 500, 16_384)
    repeat = 3 if quick else 41
    rb = ReplayBuffer(rows, (width - 3) // 2 - 1, width - 3 - 2 * ((width - 3) // 2 - 1))
    assert rb.width == width
    fill = torch.randn(rows, width)
    add_s = median_time(lambda: rb.add_packed(fill[:4096]), repeat=repeat, number=5)
    rb.add_packed(fill)
    handle = PackerHandle.create(2, batch, width)
    packer = Packer(handle, rb)
    tick = [0]

    def pack() -> None:
        handle.requests.put(encode(PackRequest(tick[0], 0, 1, tick[0], batch, -1))[0])
        packer.service(timeout=1.0)
        handle.done.get(timeout=1.0)
        tick[0] += 1

    def idle() -> None:
        """Untimed: the packer waits for a request as it does while the learner
        computes, and draws the next tick's indices meanwhile."""
        packer.service(timeout=0.001)

    # Like for like: the bare gather gets fresh indices each call, never reused (as
    # each tick does; reused sets would find their rows in the CPU's caches), and
    # writes into the same kind of shared host slot the packer fills.
    index_sets = [sample_indices(rows, batch, 10_000 + k) for k in range(3 * repeat + 2)]
    cursor = [0]
    out = handle.host_slots[1]
    src = torch.randn(batch, width)

    def bare_gather() -> None:
        cursor[0] = (cursor[0] + 1) % len(index_sets)
        torch.index_select(rb.storage, 0, index_sets[cursor[0]], out=out)
    figures: dict[str, float] = {}
    # Interleave the contenders round by round so drift hits them alike.
    def as_used() -> float:
        """One request at a time, the packer idle between them: the median of three."""
        times = []
        for _ in range(3):
            idle()
            times.append(median_time(pack, repeat=1, number=1, warmup=0))
        return sorted(times)[1]

    def three(fn: Callable[[], object]) -> Callable[[], float]:
        return lambda: median_time(fn, repeat=1, number=3, warmup=0)

    # Seconds per call of each contender, one sample per round.
    contenders: dict[str, Callable[[], float]] = {
        "packer": as_used, "packer_back_to_back": three(pack),
        "index_select": three(bare_gather), "memcpy": three(lambda: out.copy_(src))}
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(repeat):
        order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
        for name in order:
            samples[name].append(contenders[name]())
    med = {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
    nbytes = batch * width * 4
    for k, v in med.items():
        figures[f"{k}_ms"] = v * 1e3
        figures[f"{k}_GBps"] = nbytes / v / 1e9
    figures["packer_vs_index_select"] = med["index_select"] / med["packer"]
    figures["packer_back_to_back_vs_index_select"] = (med["index_select"]
                                                      / med["packer_back_to_back"])
    figures["add_rows_per_s"] = 4096 / add_s
    ours, theirs = round_trips(200 if quick else 2000)
    figures["channel_round_trip_us"] = ours * 1e6
    figures["mp_queue_round_trip_us"] = theirs * 1e6
    figures["round_trip_ratio"] = ours / theirs
    figures["budget_packer_vs_index_select"] = 0.95
    figures["budget_round_trip_ratio"] = 0.5
    write_result("packing", {"rows": rows, "width": width, "batch": batch,
                             "torch_threads": torch.get_num_threads()}, figures, quick=quick)
    print(table(f"packing {batch} x {width} float32 from {rows} rows (median)", [
        ("Packer, request..done, idle between (as used)", f"{figures['packer_ms']:.2f}",
         f"{figures['packer_GBps']:.2f}", f"{figures['packer_vs_index_select']:.3f}"),
        ("Packer, back to back (indices drawn on the path)",
         f"{figures['packer_back_to_back_ms']:.2f}",
         f"{figures['packer_back_to_back_GBps']:.2f}",
         f"{figures['packer_back_to_back_vs_index_select']:.3f}"),
        ("torch.index_select(out=)", f"{figures['index_select_ms']:.2f}",
         f"{figures['index_select_GBps']:.2f}", "1.000"),
        ("memcpy of the same bytes", f"{figures['memcpy_ms']:.2f}",
         f"{figures['memcpy_GBps']:.2f}", ""),
    ], ("contender", "ms", "GB/s", "vs index_select")))
    print(table("control round trip between processes (median)", [
        ("replay_fsm Channel", f"{figures['channel_round_trip_us']:.1f}",
         f"{figures['round_trip_ratio']:.2f}"),
        ("mp.Queue ping-pong", f"{figures['mp_queue_round_trip_us']:.1f}", "1.00"),
    ], ("channel", "us", "ratio")))
    print(f"ReplayBuffer.add: {figures['add_rows_per_s']:.0f} rows/s ({width} columns)")
    return figures


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    main(ap.parse_args().quick)
