"""A drop-in for the seed's ``CPUPinnedDoubleBufferReplayPipeline``.

Same constructor, methods, properties and request/ready dict formats, so a
collector written for the seed (it reads request dicts from
``collector_pack_request_queue``, packs into ``collector_pack_shared_slots`` and
puts ready dicts on ``collector_pack_ready_queue``) serves it unchanged. Under
the hood it is a ``Pipeline`` with ring depth 2, so the seed's defects are gone:
copies wait for the release of their slot, waits are bounded, failures surface.
"""

from __future__ import annotations

import csv
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from .data.buffer import ReplayBuffer
from .runtime.links import SeedQueueLink
from .runtime.observers import Observer
from .runtime.pipeline import Pipeline
from .spec import Actor

RING_DEPTH = 2

# What the seed's transfer_manifest says of each backend; only this class reads it.
_MANIFEST: dict[str, dict[str, object]] = {
    "cuda": {"device_family": "cuda", "host_memory_kind": "shared_registered",
             "host_pinned": True, "supports_async_submit": True,
             "supports_timing_events": True, "h2d_submitter": "transfer_thread"},
    "cpu": {"device_family": "cpu", "host_memory_kind": "shared", "host_pinned": False,
            "supports_async_submit": False, "supports_timing_events": False,
            "h2d_submitter": "transfer_thread"},
    "accel": {"host_memory_kind": "shared", "host_pinned": False,
              "supports_async_submit": False, "supports_timing_events": False},
}
_DEFAULT_MANIFEST: dict[str, object] = {
    "host_memory_kind": "shared", "host_pinned": False, "supports_async_submit": True,
    "supports_timing_events": False, "h2d_submitter": "transfer_thread"}


class _CopyClock(Observer):
    """Keeps the latest copy's duration, the seed's ``last_incremental_h2d_time_s``."""

    def __init__(self) -> None:
        self.last_copy_s = 0.0

    def span(self, name: str, actor: Actor, start_ns: int, end_ns: int, **args: object
             ) -> None:
        if name == "copy":
            self.last_copy_s = (end_ns - start_ns) / 1e9


class CPUPinnedDoubleBufferReplayPipeline:
    """Double-buffered packed replay batch pipeline (the seed's interface)."""

    def __init__(self, replay_buffer: ReplayBuffer, *, device: str, sample_count: int,
                 base_seed: int = 0, trace_recorder: Any = None,
                 trace_cuda_events: bool = True, verbose: bool = False,
                 verbose_output_dir: str | None = None,
                 collector_pack_request_queue: Any = None,
                 collector_pack_ready_queue: Any = None,
                 collector_pack_shared_slots: torch.Tensor | Sequence[torch.Tensor] | None
                 = None, backend: str | None = None,
                 liveness_timeout: float = 5.0) -> None:
        if (collector_pack_request_queue is None or collector_pack_ready_queue is None
                or collector_pack_shared_slots is None):
            raise ValueError("collector_thread pack executor requires collector pack IPC "
                             "queues and slots")
        self._trace_recorder = trace_recorder
        self._verbose_dir = verbose_output_dir if verbose else None
        link = SeedQueueLink(collector_pack_request_queue, collector_pack_ready_queue,
                             collector_pack_shared_slots)
        self._pipe = Pipeline(
            replay_buffer, device=device, sample_count=sample_count, base_seed=base_seed,
            ring_depth=RING_DEPTH, collector=link, backend=backend,
            backend_options={"timing": True} if (trace_cuda_events and str(device).startswith(
                "cuda")) else None,
            liveness_timeout=liveness_timeout, trace=verbose)
        self._clock = _CopyClock()
        self._pipe.add_observer(self._clock)
        self.last_incremental_h2d_time_s = 0.0

    # -- the seed's properties -----------------------------------------------

    @property
    def pipeline(self) -> Pipeline:
        return self._pipe

    @property
    def h2d_submitter(self) -> str:
        return str(self.transfer_manifest["h2d_submitter"])

    @property
    def transfer_manifest(self) -> dict[str, object]:
        b = self._pipe.backend
        described = {"device_family": self._pipe.device.type,
                     "h2d_submitter": "learner_thread" if self._pipe.device.type == "mps"
                     else "transfer_thread",
                     **_MANIFEST.get(b.name, _DEFAULT_MANIFEST)}
        return {
            "backend": type(b).__name__,
            "device": str(self._pipe.device),
            "device_family": described["device_family"],
            "host_memory_kind": described["host_memory_kind"],
            "host_pinned": described["host_pinned"],
            "direct_pinned_shared": described["host_pinned"],
            "supports_async_submit": described["supports_async_submit"],
            "supports_timing_events": described["supports_timing_events"],
            "h2d_submitter": described["h2d_submitter"],
            "ring_depth": RING_DEPTH,
        }

    def watch(self, process: Any, what: str = "the collector process") -> None:
        """Fail fast with CollectorDied when the collector ``process`` dies."""
        self._pipe.watch(process, what)

    # -- the seed's methods ----------------------------------------------------

    def start_prepare(self, tick_id: int, sample_count: int,
                      min_snapshot_ptr: int | None = None) -> bool:
        """True when this call launches new work; False if the tick is already
        pending or prepared."""
        start = time.perf_counter_ns()
        launched = self._pipe.start_prepare(tick_id, sample_count, min_snapshot_ptr)
        if launched:
            self._slice("replay_pipeline/collector_pack_request", start,
                        {"tick_id": int(tick_id)})
        return launched

    def batch_ready(self, tick_id: int, sample_count: int) -> bool:
        return self._pipe.batch_ready(tick_id, sample_count)

    def wait_ready(self) -> None:
        return None

    def wait_until_ready(self, tick_id: int, sample_count: int,
                         timeout: float | None = None) -> bool:
        """As the seed: requests the tick first when nothing is pending for it."""
        self._pipe.start_prepare(tick_id, sample_count)
        return self._pipe.wait_until_ready(tick_id, sample_count, timeout=timeout)

    def sample_large_batch(self, tick_id: int, sample_count: int) -> dict[str, torch.Tensor]:
        self._pipe.start_prepare(tick_id, sample_count)
        start = time.perf_counter_ns()
        batch = self._pipe.sample_large_batch(tick_id, sample_count)
        self.last_incremental_h2d_time_s = self._clock.last_copy_s
        self._slice("replay_pipeline/batch_h2d_wait", start, {"tick_id": int(tick_id)})
        return batch

    def after_tick(self) -> None:
        self._pipe.after_tick()

    def close(self) -> None:
        self._pipe.close()
        tracer = self._pipe.tracer
        if self._verbose_dir and tracer is not None:
            out = os.path.join(self._verbose_dir, "verbose")
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "pack_fields.csv"), "w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow(["tick_id", "slot", "field", "rows", "cols", "bytes",
                                 "dur_ns"])
                n, width = self._pipe.sample_count, self._pipe.replay_buffer.width
                for e in tracer.events():
                    if e["kind"] == "span" and e["name"] == "pack":
                        writer.writerow([e["tick"], e["slot"], "packed", n, width,
                                         n * width * 4, e["end_ns"] - e["start_ns"]])

    def _slice(self, name: str, start_ns: int, args: dict[str, Any]) -> None:
        if self._trace_recorder is not None:
            self._trace_recorder.add_slice(name, category="replay_pipeline",
                                           start_ns=start_ns, end_ns=time.perf_counter_ns(),
                                           args=args)
