"""The seed-compatible class driven by a collector loop written for the seed."""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading

import pytest
import torch

from replay_fsm import ReplayBuffer
from replay_fsm.compat import CPUPinnedDoubleBufferReplayPipeline
from replay_fsm.data.sampling import expected_batch

from .collectors import seed_style_collector
from .drive import packed


class Recorder:
    def __init__(self) -> None:
        self.names: list[str] = []

    def add_slice(self, name: str, *, category: str, start_ns: int, end_ns: int,
                  args: dict) -> None:
        assert category == "replay_pipeline" and end_ns >= start_ns and "tick_id" in args
        self.names.append(name)


@pytest.mark.parametrize("where", ["thread", "process"])
def test_seed_style_collector_serves_the_compat_class(where: str) -> None:
    rb = ReplayBuffer(512, 4, 2, region_rows=32)
    rb.add_packed(torch.randn(400, rb.width))
    n = 32
    slots = [torch.zeros(n, rb.width).share_memory_() for _ in range(2)]
    if where == "thread":
        rq, dq = queue.Queue(), queue.Queue()
        worker = threading.Thread(target=seed_style_collector, args=(rb, rq, dq, slots))
    else:
        ctx = mp.get_context("spawn")
        rq, dq = ctx.Queue(), ctx.Queue()
        worker = ctx.Process(target=seed_style_collector, args=(rb, rq, dq, slots))
    worker.start()
    rec = Recorder()
    pipe = CPUPinnedDoubleBufferReplayPipeline(
        rb, device="cpu", sample_count=n, base_seed=77, trace_recorder=rec,
        collector_pack_request_queue=rq, collector_pack_ready_queue=dq,
        collector_pack_shared_slots=slots, liveness_timeout=60)
    try:
        assert pipe.h2d_submitter == "transfer_thread"
        assert pipe.transfer_manifest["ring_depth"] == 2
        assert pipe.start_prepare(0, n) is True
        assert pipe.start_prepare(0, n) is False  # already pending
        for tick in range(8):
            assert pipe.wait_until_ready(tick, n)
            assert pipe.batch_ready(tick, n)
            batch = pipe.sample_large_batch(tick, n)
            assert pipe.start_prepare(tick + 1, n) is True
            assert torch.equal(packed(batch, pipe.pipeline),
                               expected_batch(rb.storage, 400, n, 77 + tick))
            pipe.after_tick()
        assert "replay_pipeline/collector_pack_request" in rec.names
        assert "replay_pipeline/batch_h2d_wait" in rec.names
        with pytest.raises(ValueError, match="sample_count"):
            pipe.sample_large_batch(8, n + 1)
    finally:
        pipe.close()
        rq.put(None)
        worker.join(30)


def test_seed_constructor_requires_the_queues_and_slots() -> None:
    rb = ReplayBuffer(8, 2, 1)
    with pytest.raises(ValueError, match="requires collector pack IPC queues and slots"):
        CPUPinnedDoubleBufferReplayPipeline(rb, device="cpu", sample_count=4)
