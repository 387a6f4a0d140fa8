"""Where the time goes when overlap degrades: what each kind of neighbour costs the
learner's compute, measured in one run.

The learner's step (matmuls, one torch thread) is timed alone and then beside one
neighbour at a time:
- a busy Python thread in the learner's process (it competes for the GIL only: the
  learner's matmuls release the GIL but it needs the GIL between ops);
- a busy Python process (it competes for a core only);
- a bare gather loop (``index_select``) in a thread, and in a process (a core and
  memory bandwidth; the thread also takes the GIL between its ops);
- replay_fsm's packer serving back-to-back requests (fed from another process) in a
  thread of the learner's process and in a process of its own: what a pipelined
  learner lives beside.
Each figure is the mean step time over the alone figure, and the GIL wait a probe
thread in the learner's process sees (how late a 1 ms sleep wakes up), p50 and p99.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from replay_fsm import ReplayBuffer
from replay_fsm.data.channel import ChannelClosed
from replay_fsm.data.packer import Packer, PackerHandle, serve_forever
from replay_fsm.data.sampling import sample_indices
from replay_fsm.wire import PackRequest, encode

try:
    from common import quantile, steady_malloc, table, write_result
    from learner_loop import make_compute
except ImportError:
    from benchmarks.common import quantile, steady_malloc, table, write_result
    from benchmarks.learner_loop import make_compute


def _busy_process(stop: Any) -> None:
    while not stop.is_set():
        pass


def _feed(handle: PackerHandle, n: int, stop: Any) -> None:
    """Back-to-back pack requests: a learner that never computes."""
    tick = 0
    while not stop.is_set():
        try:
            handle.requests.put(encode(PackRequest(tick, tick % 2, 1, tick, n, -1))[0],
                                timeout=1.0)
            handle.done.get(timeout=1.0)
        except ChannelClosed:
            return
        tick += 1


def _gather_process(storage: torch.Tensor, n: int, stop: Any) -> None:
    torch.set_num_threads(1)
    out = torch.empty(n, storage.shape[1])
    k = 0
    while not stop.is_set():
        torch.index_select(storage, 0, sample_indices(storage.shape[0], n, k), out=out)
        k += 1


@contextmanager
def neighbour(kind: str, rb: ReplayBuffer, n: int) -> Iterator[None]:
    """Run the neighbour ``kind`` for the length of the with-block."""
    if kind == "alone":
        yield
        return
    if kind.endswith("process") and not kind.startswith("replay_fsm"):
        stop = mp.get_context("spawn").Event()
        target: Callable[..., None] = _busy_process if kind.startswith("busy") else \
            _gather_process
        args = (stop,) if kind.startswith("busy") else (rb.storage, n, stop)
        proc = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
        proc.start()
        time.sleep(2.0)  # let it start: importing torch takes a while
        try:
            yield
        finally:
            stop.set()
            proc.join(30)
        return
    if kind.startswith("replay_fsm"):
        # The packer alone beside the learner: a feeder process sends back-to-back
        # requests and takes the pack-done messages, so the only work in the learner's
        # process is what a thread collector adds (none for a process collector).
        handle = PackerHandle.create(2, n, rb.width)
        ctx = mp.get_context("spawn")
        stop = ctx.Event()
        procs = [ctx.Process(target=_feed, args=(handle, n, stop), daemon=True)]
        stop_thread = threading.Event()
        thread = None
        if "thread" in kind:
            packer = Packer.attach(handle, rb)

            def serve() -> None:
                while not stop_thread.is_set():
                    packer.service(timeout=0.05)

            thread = threading.Thread(target=serve, daemon=True)
            thread.start()
        else:
            procs.append(ctx.Process(target=serve_forever, args=(handle, rb, 0.05, 1),
                                     daemon=True))
        for proc in procs:
            proc.start()
        time.sleep(2.0)  # let them start: importing torch takes a while
        try:
            yield
        finally:
            stop.set()
            stop_thread.set()
            handle.close()
            if thread is not None:
                thread.join(30)
            for proc in procs:
                proc.join(30)
        return
    stop_ev = threading.Event()
    out = torch.empty(n, rb.width)

    def busy() -> None:
        while not stop_ev.is_set():
            pass

    def gather() -> None:
        k = 0
        while not stop_ev.is_set():
            torch.index_select(rb.storage, 0, sample_indices(rb.size, n, k), out=out)
            k += 1

    thread = threading.Thread(target=busy if kind.startswith("busy") else gather,
                              daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop_ev.set()
        thread.join(30)


def gil_probe(samples: list[float], stop: threading.Event) -> None:
    """How late a 1 ms sleep wakes up: waiting for the GIL (and for a core)."""
    while not stop.is_set():
        t0 = time.perf_counter()
        time.sleep(0.001)
        samples.append(time.perf_counter() - t0 - 0.001)


KINDS = ("alone", "busy thread", "busy process", "gather thread", "gather process",
         "replay_fsm thread packer", "replay_fsm process packer")


def main(quick: bool = False) -> dict[str, Any]:
    malloc_fixed = steady_malloc()  # the learner step's temporaries: see common
    torch.set_num_threads(1)
    rows, width, n = (20_000, 128, 2048) if quick else (200_000, 500, 16_384)
    steps, rounds = (10, 1) if quick else (60, 3)
    rb = ReplayBuffer(rows, (width - 5) // 2, 2)
    rb.add_packed(torch.randn(rows, rb.width))
    compute = make_compute(rb.width, 128, 40, torch.device("cpu"))
    batch = rb.storage[:n].clone()
    results: dict[str, dict[str, list[float]]] = {k: {"step": [], "gil": []} for k in KINDS}
    for r in range(rounds):
        for kind in (KINDS if r % 2 == 0 else KINDS[::-1]):
            with neighbour(kind, rb, n):
                gil: list[float] = []
                stop = threading.Event()
                probe = threading.Thread(target=gil_probe, args=(gil, stop), daemon=True)
                probe.start()
                compute(batch)
                t0 = time.perf_counter()
                for _ in range(steps):
                    compute(batch)
                results[kind]["step"].append((time.perf_counter() - t0) / steps)
                stop.set()
                probe.join()
                results[kind]["gil"] += gil
    alone = statistics.median(results["alone"]["step"])
    figures: dict[str, Any] = {}
    for kind, v in results.items():
        gil = v["gil"] or [0.0]
        figures[kind] = {"step_ms": statistics.median(v["step"]) * 1e3,
                         "slowdown": statistics.median(v["step"]) / alone,
                         "gil_wait_p50_us": quantile(gil, 0.5) * 1e6,
                         "gil_wait_p99_us": quantile(gil, 0.99) * 1e6}
    write_result("interference", {"rows": rows, "width": width, "batch": n, "steps": steps,
                                  "rounds": rounds, "malloc_thresholds_fixed": malloc_fixed},
                 figures, quick=quick)
    print(table("what a neighbour costs the learner's compute (median step; probe wake-up)",
                [(k, f"{v['step_ms']:.2f}", f"{v['slowdown']:.3f}",
                  f"{v['gil_wait_p50_us']:.0f}", f"{v['gil_wait_p99_us']:.0f}")
                 for k, v in figures.items()],
                ("neighbour", "step ms", "x alone", "wake p50 us", "wake p99 us")))
    return figures


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    main(ap.parse_args().quick)
