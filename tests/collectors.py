"""Process bodies for spawn-based tests (importable by the child interpreter)."""

from __future__ import annotations

import torch

from replay_fsm.data.buffer import ReplayBuffer
from replay_fsm.data.packer import Packer, PackerHandle


def constant_rows(rb: ReplayBuffer, first_id: int, n: int) -> torch.Tensor:
    ids = torch.arange(first_id, first_id + n, dtype=torch.float32)
    return ids[:, None].expand(n, rb.width).contiguous()


def write_ids(rb: ReplayBuffer, batches: int, batch: int, first_id: int = 1) -> None:
    """Writer: every column of a row carries the row's id."""
    for k in range(batches):
        rb.add_packed(constant_rows(rb, first_id + k * batch, batch))


def serve(handle: PackerHandle, rb: ReplayBuffer, count: int) -> None:
    """A collector that attaches a packer and serves ``count`` batches."""
    packer = Packer.attach(handle, rb)
    served = 0
    while served < count and not packer.closed:
        served += packer.service(timeout=0.05)


def fill_and_serve(handle: PackerHandle, rb: ReplayBuffer, rows: int) -> None:
    """A collector that adds data itself, then serves until closed."""
    write_ids(rb, 1, rows)
    packer = Packer.attach(handle, rb)
    while not packer.closed:
        packer.service(timeout=0.05)


def seed_style_collector(rb: ReplayBuffer, requests, ready, slots) -> None:  # type: ignore[no-untyped-def]
    """A collector loop written for the seed: dict requests in, dict readies out."""
    while (req := requests.get()) is not None:
        size = rb.size
        gen = torch.Generator().manual_seed(int(req["sample_seed"]))
        idx = torch.randint(0, size, (int(req["sample_count"]),), generator=gen)
        torch.index_select(rb.storage, 0, idx, out=slots[int(req["shared_slot"])])
        ready.put({
            "tick_id": req["tick_id"], "snapshot_ptr": rb.ptr, "snapshot_size": size,
            "sample_seed": req["sample_seed"], "sample_count": req["sample_count"],
            "shared_slot": req["shared_slot"], "target_gpu_slot": req["target_gpu_slot"],
        })


def external_loop(handle: PackerHandle, rb: ReplayBuffer) -> None:
    """The README's external collector loop: step (here: add rows), serve, until the
    packer is closed: by the learner's close(), or because the learner died."""
    packer = Packer.attach(handle, rb)
    first = 10**6
    while not packer.closed:
        rb.add_packed(constant_rows(rb, first, 4))
        first += 4
        packer.service(timeout=0.01)


LEARNER = """
import json, multiprocessing as mp, signal, sys, time
import torch
from replay_fsm import Pipeline, ReplayBuffer
from tests.collectors import external_loop

if __name__ == "__main__":
    mode = sys.argv[1]
    rb = ReplayBuffer(4096, 4, 2)
    rb.add_packed(torch.randn(1000, rb.width))
    pipe = Pipeline(rb, sample_count=64, liveness_timeout=60,
                    collector="external" if mode == "external" else mode)
    other = pipe.collector_process
    if mode == "external":
        other = mp.get_context("spawn").Process(target=external_loop,
                                                args=(pipe.packer_handle(), rb))
        other.start()
        pipe.watch(other)
    for tick in range(5):
        pipe.start_prepare(tick, 64)
        pipe.sample_large_batch(tick, 64)
        pipe.after_tick()
    names = list(pipe.packer_handle().semaphore_names + rb.semaphore_names)
    try:  # the test interrupts us as soon as it reads the line
        print(json.dumps({"other": other.pid, "names": names}), flush=True)
        time.sleep(600)  # until the test kills or interrupts us
    except KeyboardInterrupt:
        pipe.close()
        sys.exit(130)
"""
