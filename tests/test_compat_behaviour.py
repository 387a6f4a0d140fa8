"""What a seed user sees of the compat class, behaviour by behaviour, against the seed's
own (``seed/unilab``): dicts, slots, trace slices, manifest, attributes, errors, edge
calls. The collector is served by hand, as UniLab's own tests of the class do."""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from replay_fsm import ReplayBuffer
from replay_fsm.compat import CPUPinnedDoubleBufferReplayPipeline
from replay_fsm.compat.buffer import ReplayBufferView
from replay_fsm.compat.transfer import SeedBackend
from replay_fsm.data.buffer import Layout
from replay_fsm.data.sampling import expected_batch

from .collectors import SeedStyleBuffer, add_rows, seed_pack
from .support import Exited

N, BASE_SEED, WIDTH = 8, 3, 2 * 5 + 3 + 3 + 2 * 2
SUBMITTED = {"pack_layout": "packed", "pack_executor": "collector_thread",
             "h2d_submitter": "torch_copy", "h2d_bytes": N * WIDTH * 4,
             "h2d_submitted": True, "pinned_memory": False, "direct_pinned_shared": False,
             "device_family": "cpu", "host_memory_kind": "pageable_shared",
             "supports_async_submit": False, "supports_timing_events": False,
             "ring_depth": 2, "transfer_worker_submit": True}


class Recorder:
    def __init__(self) -> None:
        self.slices: list[tuple[str, dict[str, Any]]] = []

    def add_slice(self, name: str, *, category: str, start_ns: int, end_ns: int,
                  args: dict[str, Any] | None = None) -> None:
        assert category == "replay_pipeline" and 0 < start_ns <= end_ns
        self.slices.append((name, args or {}))


class Hand:
    """The compat class over queue.Queue queues; the test is the collector."""

    def __init__(self, rb: Any = None, **kw: Any) -> None:
        if rb is None:
            rb = SeedStyleBuffer(256, 5, 3, critic_dim=2)
            rb.add_rows(torch.randn(100, WIDTH))
        self.rb = rb
        self.slots = [torch.zeros(N, WIDTH).share_memory_() for _ in range(2)]
        self.requests: queue.Queue[Any] = queue.Queue()
        self.ready: queue.Queue[Any] = queue.Queue()
        self.rec = Recorder()
        kw.setdefault("sample_count", N)
        self.pipe = CPUPinnedDoubleBufferReplayPipeline(
            rb, device="cpu", base_seed=kw.pop("base_seed", BASE_SEED),
            trace_recorder=self.rec, collector_pack_request_queue=self.requests,
            collector_pack_ready_queue=self.ready, collector_pack_shared_slots=self.slots,
            **kw)

    def serve(self, **changes: Any) -> dict[str, Any]:
        request = self.requests.get_nowait()
        self.ready.put({**seed_pack(self.rb, request, self.slots), **changes})
        return request

    def sample(self, tick: Any) -> dict[str, torch.Tensor]:
        """Request (if not yet), serve, wait, sample: UniLab's ``_sample_ready``."""
        if self.pipe.start_prepare(tick, N):
            self.serve()
        assert self.pipe.wait_until_ready(tick, N)
        return self.pipe.sample_large_batch(tick, N)

    def __enter__(self) -> Hand:
        return self

    def __exit__(self, *exc: object) -> None:
        self.pipe.close()


def test_the_first_request_targets_slot_1_calling_slot_0_hot_then_they_alternate() -> None:
    with Hand() as h:
        seen = []
        for tick in (5, 6, 7):
            assert h.pipe.start_prepare(tick, N)
            request = h.serve()
            seen.append((request["shared_slot"], request["target_gpu_slot"],
                         request["learner_hot_gpu_slot"]))
            h.sample(tick)
            assert (h.pipe._hot, h.pipe._cold, h.pipe._has_hot_batch) == (
                request["target_gpu_slot"], request["learner_hot_gpu_slot"], True)
            h.pipe.after_tick()
            assert not h.pipe._has_hot_batch
        assert seen == [(1, 1, 0), (0, 0, 1), (1, 1, 0)]


def test_a_request_holds_plain_ints_frozen_when_it_was_made() -> None:
    with Hand() as h:
        assert h.pipe.start_prepare(np.int64(4), N)
        h.rb.add_rows(torch.randn(16, WIDTH))  # after the request: not in its snapshot
        request = h.requests.get_nowait()
        assert request == {"tick_id": 4, "snapshot_ptr": 100, "snapshot_size": 100,
                           "min_snapshot_ptr": 100, "sample_seed": BASE_SEED + 4,
                           "sample_count": N, "shared_slot": 1, "learner_hot_gpu_slot": 0,
                           "target_gpu_slot": 1, "pack_layout": "packed",
                           "pack_executor": "collector_thread"}
        assert list(request) == list(h.rec.slices[0][1])  # the seed's key order
        assert all(type(v) is int for k, v in request.items() if k != "pack_layout"
                   and k != "pack_executor")
    with Hand() as h:
        h.pipe.start_prepare(0, N, min_snapshot_ptr=np.int64(140))
        assert h.requests.get_nowait()["min_snapshot_ptr"] == 140


def test_one_tick_leaves_the_seeds_trace_slices_with_its_args() -> None:
    with Hand() as h:
        h.pipe.start_prepare(2, N)
        request = h.serve()
        h.pipe.wait_until_ready(2, N)
        assert [name for name, _ in h.rec.slices] == [
            "replay_pipeline/collector_pack_request", "replay_pipeline/batch_h2d_submit"]
        h.pipe.sample_large_batch(2, N)
        names = [name for name, _ in h.rec.slices]
        assert names == ["replay_pipeline/collector_pack_request",
                         "replay_pipeline/batch_h2d_submit", "replay_pipeline/batch_h2d_wait",
                         "replay_pipeline/gpu_wait_for_batch", "replay_pipeline/hot_cold_swap"]
        args = dict(h.rec.slices)
        assert args["replay_pipeline/collector_pack_request"] is request
        assert args["replay_pipeline/batch_h2d_submit"] == {
            "tick_id": 2, "batch_gpu_slot": 1, "shared_slot": 1, **SUBMITTED}
        assert list(args["replay_pipeline/batch_h2d_submit"]) == [
            "tick_id", "batch_gpu_slot", "shared_slot", *SUBMITTED]
        where = {"tick_id": 2, "batch_gpu_slot": 1}
        assert args["replay_pipeline/batch_h2d_wait"] == where
        assert args["replay_pipeline/gpu_wait_for_batch"] == where
        assert args["replay_pipeline/hot_cold_swap"] == {
            "tick_id": 2, "old_hot": 0, "old_cold": 1, "new_hot": 1, "new_cold": 0}


def test_a_recorder_set_after_construction_is_used_and_none_records_nothing() -> None:
    with Hand() as h:
        h.pipe._trace_recorder = None
        h.sample(0)
        assert h.rec.slices == []
        h.pipe.after_tick()
        late = Recorder()
        h.pipe._trace_recorder = late
        h.sample(1)
        assert len(late.slices) == 5


def test_the_manifest_and_submitter_on_the_cpu_are_the_seeds() -> None:
    with Hand() as h:
        assert h.pipe.h2d_submitter == "torch_copy"
        assert h.pipe.transfer_manifest == {
            "backend": "TorchCopyReplayTransferBackend", "device": "cpu",
            "device_family": "cpu", "host_memory_kind": "pageable_shared",
            "host_pinned": False, "direct_pinned_shared": False,
            "supports_async_submit": False, "supports_timing_events": False,
            "h2d_submitter": "torch_copy", "ring_depth": 2}


@pytest.mark.parametrize("device,hip,expected", [
    ("cuda", None, ("CudaLikeReplayTransferBackend", "cuda", "pybind11",
                    "registered_pinned_shared", True, True, True)),
    ("cuda:1", "6.2", ("CudaLikeReplayTransferBackend", "rocm", "torch_copy_stream",
                       "registered_pinned_shared", True, True, True)),
    ("xpu", None, ("XpuReplayTransferBackend", "xpu", "torch_xpu_copy_stream",
                   "pageable_shared", True, False, False)),
    ("mps", None, ("TorchCopyReplayTransferBackend", "mps", "torch_copy_main_thread",
                   "pageable_shared", False, False, False)),
    ("meta", None, ("TorchCopyReplayTransferBackend", "meta", "torch_copy",
                    "pageable_shared", False, False, False)),
])
def test_each_device_is_described_as_the_seeds_backend_for_it(
        device: str, hip: str | None, expected: tuple[object, ...],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", hip)
    assert SeedBackend.of(torch.device(device)) == SeedBackend(*expected)  # type: ignore[arg-type]


def test_the_attributes_unilab_reads_are_there() -> None:
    with Hand() as h:
        p = h.pipe
        assert p._collector_pack_request_queue is h.requests
        assert p._collector_pack_ready_queue is h.ready
        assert p._collector_pack_shared_slots is h.slots
        assert p._replay_buffer is h.rb
        assert p._packed_h2d_source(0) is h.slots[0] and p._packed_h2d_source(1) is h.slots[1]
        assert (p._host_pinned, p._h2d_submitter, p._host_packed) == (False, "torch_copy", [])
        assert len(p._gpu_packed) == 2 and (p._hot, p._cold, p._has_hot_batch) == (0, 1, False)
        assert not any(slot.is_pinned() for slot in p._collector_pack_shared_slots)
        assert p.last_incremental_h2d_time_s == 0.0
        h.sample(0)
        assert p.last_incremental_h2d_time_s > 0.0
        p.close()
        assert (p._gpu_packed, p._host, p._gpu) == ([], [], [])


def test_verbose_writes_no_file_unless_pack_rows_were_added(tmp_path: Path) -> None:
    with Hand(verbose=True, verbose_output_dir=str(tmp_path)) as h:
        h.sample(0)
        assert h.pipe._verbose_pack_records == []
    assert list(tmp_path.iterdir()) == []
    with Hand(verbose_output_dir=str(tmp_path)) as h:
        assert h.pipe._verbose_pack_records is None and h.pipe._verbose_output_dir is None
    with Hand(verbose=True, verbose_output_dir=str(tmp_path)) as h:
        assert h.pipe._verbose_pack_records is not None
        h.pipe._verbose_pack_records.append((0, 1, "obs", N, 5, N * 20, 1234))
    lines = (tmp_path / "verbose" / "pack_fields.csv").read_text().splitlines()
    assert lines == ["tick_id,slot,field,rows,cols,bytes,dur_ns", f"0,1,obs,{N},5,{N * 20},1234"]


def test_a_ready_dict_without_a_key_raises_its_key_error_on_every_later_call() -> None:
    with Hand() as h:
        h.sample(0)
        h.pipe.start_prepare(1, N)
        h.ready.put({"tick_id": 1})  # a broken ready dict
        with pytest.raises(KeyError, match="snapshot_ptr") as info:
            h.pipe.wait_until_ready(1, N)
        h.pipe.after_tick()  # never raises, as the seed's
        for call in (lambda: h.pipe.batch_ready(1, N), lambda: h.pipe.start_prepare(1, N),
                     lambda: h.pipe.sample_large_batch(1, N)):
            with pytest.raises(KeyError) as again:
                call()
            assert again.value is info.value


@pytest.mark.parametrize("changes,message", [
    ({"shared_slot": 0}, "^collector_thread shared slot must match target GPU slot$"),
    ({"tick_id": 5}, "^Collector packed tick 5 does not match pending tick 0$"),
    ({"shared_slot": 0, "target_gpu_slot": 0},
     "^Prepared replay batch is not in the current cold slot$"),
])
def test_a_wrong_ready_dict_raises_the_seeds_runtime_error(changes: dict[str, int],
                                                           message: str) -> None:
    with Hand() as h:
        h.pipe.start_prepare(0, N)
        h.serve(**changes)
        with pytest.raises(RuntimeError, match=message):
            h.pipe.wait_until_ready(0, N)


def test_numpy_integers_are_accepted_everywhere() -> None:
    with Hand(sample_count=np.int64(N), base_seed=np.int64(BASE_SEED)) as h:
        n, tick = np.int64(N), np.int64(3)
        assert h.pipe.start_prepare(tick, n)
        h.serve()
        assert h.pipe.wait_until_ready(tick, n) and h.pipe.batch_ready(tick, n)
        batch = h.pipe.sample_large_batch(tick, n)
        assert batch["obs"].shape == (N, 5)
        h.pipe.after_tick()


def test_after_close_batch_ready_is_false_after_tick_is_none_requests_raise() -> None:
    with Hand() as h:
        h.pipe.close()
        assert h.pipe.batch_ready(0, N) is False
        assert h.pipe.after_tick() is None
        with pytest.raises(RuntimeError, match="^Cannot prepare replay batch after "
                           r"pipeline\.close\(\)$"):
            h.pipe.start_prepare(0, N)
        with pytest.raises(RuntimeError):
            h.pipe.sample_large_batch(0, N)
        h.pipe.close()  # again: nothing happens


def test_the_hot_tick_can_be_requested_again_and_gets_a_fresh_batch() -> None:
    with Hand() as h:
        first = h.sample(4)["obs"].clone()
        h.rb.add_rows(torch.randn(50, WIDTH))
        assert h.pipe.start_prepare(4, N) is True  # as the seed: new work for the hot tick
        assert h.pipe.start_prepare(4, N) is False  # now pending
        request = h.serve()
        assert (request["tick_id"], request["target_gpu_slot"], request["snapshot_size"]) == (
            4, 0, 150)
        assert h.pipe.batch_ready(4, N)  # the hot one
        assert torch.equal(h.pipe.sample_large_batch(4, N)["obs"], first)
        h.pipe.after_tick()
        again = h.pipe.sample_large_batch(4, N)
        assert torch.equal(again["obs"], expected_batch(h.rb._storage, 150, N,
                                                        BASE_SEED + 4)[:, :5])


def test_a_ready_tick_is_not_ready_while_another_tick_is_hot() -> None:
    with Hand() as h:
        h.sample(0)
        h.pipe.start_prepare(1, N)
        h.serve()
        assert h.pipe.wait_until_ready(1, N)
        assert h.pipe.batch_ready(1, N) is False  # the seed answers for the hot tick first
        with pytest.raises(RuntimeError, match="^Hot batch tick 0 does not match requested "
                           "tick 1$"):
            h.pipe.sample_large_batch(1, N)
        h.pipe.after_tick()
        assert h.pipe.batch_ready(1, N) is True


def test_one_request_is_outstanding_at_a_time() -> None:
    with Hand() as h:
        assert h.pipe.start_prepare(0, N)
        assert h.pipe.start_prepare(0, N) is False
        with pytest.raises(RuntimeError, match="^Cannot prepare a new replay batch before "
                           "the previous batch is consumed$"):
            h.pipe.start_prepare(1, N)
        h.serve()
        h.pipe.wait_until_ready(0, N)
        with pytest.raises(RuntimeError, match="^Prepared replay batch tick 0 does not match "
                           "requested tick 1$"):
            h.pipe.sample_large_batch(1, N)
        h.pipe.sample_large_batch(0, N)
        assert h.pipe.start_prepare(9, N)  # any tick id comes next, as in the seed


def test_the_cpu_batch_is_a_private_copy_of_the_collectors_slot() -> None:
    with Hand() as h:
        batch = h.sample(0)
        kept = batch["obs"].clone()
        for slot in h.slots:
            slot.fill_(-1.0)
        assert torch.equal(batch["obs"], kept)


def test_a_wrong_sample_count_raises_the_seeds_value_error() -> None:
    with Hand() as h:
        for call in (h.pipe.start_prepare, h.pipe.batch_ready, h.pipe.wait_until_ready,
                     h.pipe.sample_large_batch):
            with pytest.raises(ValueError, match="^sample_count must match the value used to "
                               "allocate the double buffer$"):
                call(0, N + 1)


def test_the_constructor_rejects_what_the_seeds_rejects() -> None:
    slots = [torch.zeros(N, WIDTH) for _ in range(2)]
    queues = {"collector_pack_request_queue": queue.Queue(),
              "collector_pack_ready_queue": queue.Queue(), "collector_pack_shared_slots": slots}
    unpacked = SeedStyleBuffer(64, 5, 3, critic_dim=2, packed=False)
    with pytest.raises(ValueError, match=r"^pack_layout='packed' requires "
                       r"ReplayBuffer\(packed_cpu_storage=True\)$"):
        CPUPinnedDoubleBufferReplayPipeline(unpacked, device="cpu", sample_count=N, **queues)
    with pytest.raises(ValueError, match="^collector_thread pack executor requires collector "
                       "pack IPC queues and slots$"):
        CPUPinnedDoubleBufferReplayPipeline(ReplayBuffer(64, 5, 3), device="cpu",
                                            sample_count=N)
    with pytest.raises(TypeError, match="h2d_submitter"):
        CPUPinnedDoubleBufferReplayPipeline(ReplayBuffer(64, 5, 3, 2), device="cpu",
                                            sample_count=N, h2d_submitter="python", **queues)
    with pytest.raises(TypeError, match="seed-style buffer"):
        CPUPinnedDoubleBufferReplayPipeline(object(), device="cpu", sample_count=N, **queues)
    for bad in (0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="stall_timeout"):
            CPUPinnedDoubleBufferReplayPipeline(ReplayBuffer(64, 5, 3, 2), device="cpu",
                                                sample_count=N, stall_timeout=bad, **queues)


@pytest.mark.parametrize("kind", ["seed-style", "replay_fsm"])
def test_the_buffer_view_reads_either_buffer_in_place(kind: str) -> None:
    rb: Any = (SeedStyleBuffer(64, 5, 3, critic_dim=2) if kind == "seed-style"
               else ReplayBuffer(64, 5, 3, critic_dim=2))
    view = ReplayBufferView(rb)
    rows = torch.randn(40, WIDTH)
    add_rows(rb, rows)
    assert (view.ptr, view.size, view.width) == (40, 40, WIDTH)
    assert view.layout == Layout.build(5, 3, 2)
    idx = torch.tensor([3, 0, 39, 3])
    out = torch.empty(4, WIDTH)
    got = view.gather(idx, out)
    # into the caller's slot: the packer reads the slot, not the value returned
    assert torch.equal(out, rows[idx]) and got.data_ptr() == out.data_ptr()


def test_replay_fsms_own_buffer_is_accepted_and_read_in_place() -> None:
    rb = ReplayBuffer(256, 5, 3, critic_dim=2)
    rb.add_packed(torch.randn(100, WIDTH))
    with Hand(rb) as h:
        batch = h.sample(1)
        assert torch.equal(batch["next_critic"],
                           expected_batch(rb.storage, 100, N, BASE_SEED + 1)[:, -2:])


class CudaRecorder(Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.cuda_spans: list[tuple[str, dict[str, Any], Any, Any]] = []

    def add_cuda_pending_span(self, name: str, *, category: str, cpu_begin_ns: int,
                              start_event: Any, end_event: Any,
                              args: dict[str, Any] | None = None) -> None:
        assert category == "gpu" and cpu_begin_ns > 0
        self.cuda_spans.append((name, args or {}, start_event, end_event))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_slots_are_pinned_until_close_and_each_copy_is_the_seeds_span() -> None:
    rb = SeedStyleBuffer(256, 5, 3, critic_dim=2)
    rb.add_rows(torch.randn(100, WIDTH))
    slots = [torch.zeros(N, WIDTH).share_memory_() for _ in range(2)]
    requests: queue.Queue[Any] = queue.Queue()
    ready: queue.Queue[Any] = queue.Queue()
    rec = CudaRecorder()
    pipe = CPUPinnedDoubleBufferReplayPipeline(
        rb, device="cuda", sample_count=N, base_seed=BASE_SEED, trace_recorder=rec,
        collector_pack_request_queue=requests, collector_pack_ready_queue=ready,
        collector_pack_shared_slots=slots)
    try:
        assert all(slot.is_pinned() for slot in slots)
        assert all(g.is_cuda for g in pipe._gpu_packed) and len(pipe._gpu_packed) == 2
        assert pipe.transfer_manifest["host_pinned"] is True
        assert pipe.transfer_manifest["device"] == "cuda"
        assert pipe.start_prepare(4, N)
        ready.put(seed_pack(rb, requests.get_nowait(), slots))
        assert pipe.wait_until_ready(4, N)
        batch = pipe.sample_large_batch(4, N)
        assert torch.equal(batch["obs"].cpu(),
                           expected_batch(rb._storage, 100, N, BASE_SEED + 4)[:, :5])
        (name, args, start, end), = rec.cuda_spans
        assert name == "gpu/replay_pipeline_batch_h2d" and start.elapsed_time(end) >= 0
        assert {k: args[k] for k in ("tick_id", "sample_seed", "sample_count", "slot",
                                     "batch_host_slot", "batch_gpu_slot", "pinned_memory",
                                     "h2d_submitter")} == {
            "tick_id": 4, "sample_seed": BASE_SEED + 4, "sample_count": N, "slot": 1,
            "batch_host_slot": 1, "batch_gpu_slot": 1, "pinned_memory": True,
            "h2d_submitter": pipe.h2d_submitter}
        submit = dict(rec.slices)["replay_pipeline/batch_h2d_submit"]
        assert submit["direct_pinned_shared"] is True and submit["h2d_bytes"] > 0
        pipe.after_tick()
        pipe._trace_cuda_events = False
        pipe.start_prepare(5, N)
        ready.put(seed_pack(rb, requests.get_nowait(), slots))
        pipe.sample_large_batch(5, N)
        assert len(rec.cuda_spans) == 1
    finally:
        pipe.close()
    assert not any(slot.is_pinned() for slot in slots)


def test_a_watched_process_that_dies_fails_the_wait_with_collector_died() -> None:
    """``pipe.watch(process, what)``, beyond the seed's API: a request outstanding to a
    collector that died raises at once, naming what died (not after stall_timeout)."""
    from replay_fsm.compat import CollectorDied

    with Hand() as h:
        h.pipe.watch(Exited(), "the simulator")
        h.pipe.start_prepare(0, N)
        with pytest.raises(CollectorDied, match=r"the simulator \(pid 4242\) exited with "
                           r"code -9"):
            h.pipe.wait_until_ready(0, N)
    with Hand() as h:  # by default, "the collector process"
        h.pipe.watch(Exited())
        h.pipe.start_prepare(0, N)
        with pytest.raises(CollectorDied, match=r"^.*the collector process \(pid 4242\)"):
            h.pipe.wait_until_ready(0, N)
