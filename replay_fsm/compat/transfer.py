"""The seed's transfer backends as its users see them, over ours.

The seed picked one backend per device type and reported it in ``transfer_manifest``,
``h2d_submitter`` and its trace args; UniLab logs those values. ``SeedBackend`` holds
the seed's description of each; ``build_backend_for`` builds the backend of ours that
does the work: ``cpu`` with a private copy (the seed copied; the batch never aliases
the collector's slots), ``cuda`` through ``SeedCudaBackend`` (the seed's per-copy
CUDA span), ``accel`` for the rest (mps copies on the learner thread, as the seed's).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..transfer import build_backend
from ..transfer.base import HostSlots, OnComplete, OnError, TransferBackend
from ..transfer.cpu import CpuBackend
from ..transfer.cuda import CudaBackend
from ..wire import CopyOrder

CUDA_SPAN = "gpu/replay_pipeline_batch_h2d"


@dataclass(frozen=True)
class SeedBackend:
    """The seed's description of the backend it would have built for a device."""

    name: str  # the seed's class name: transfer_manifest["backend"]
    device_family: str
    h2d_submitter: str
    host_memory_kind: str
    supports_async_submit: bool
    supports_timing_events: bool
    registers_host_slots: bool  # host_pinned / direct_pinned_shared once registered

    @classmethod
    def of(cls, device: torch.device) -> SeedBackend:
        if device.type == "cuda":
            rocm = bool(getattr(torch.version, "hip", None))
            return cls("CudaLikeReplayTransferBackend", "rocm" if rocm else "cuda",
                       "torch_copy_stream" if rocm else "pybind11",
                       "registered_pinned_shared", True, True, True)
        if device.type == "xpu":
            return cls("XpuReplayTransferBackend", "xpu", "torch_xpu_copy_stream",
                       "pageable_shared", True, False, False)
        return cls("TorchCopyReplayTransferBackend", device.type,
                   "torch_copy_main_thread" if device.type == "mps" else "torch_copy",
                   "pageable_shared", False, False, False)


# (the recorder to report to, the span's args) for a copy into a slot, or None when
# no CUDA span is wanted.
CudaSpanFor = Callable[[int], "tuple[Any, dict[str, object]] | None"]


class SeedCudaBackend(CudaBackend):
    """``CudaBackend`` that also reports each copy as the seed's CUDA span
    (``gpu/replay_pipeline_batch_h2d``) when ``span_for(slot)`` asks for one.

    Such a copy gets fresh timing events, as in the seed: the recorder resolves the
    span later, and the slot's own events are recorded again by the next copy into it.
    The span is reported before the slot becomes READY, so a learner that sampled the
    batch finds it recorded.
    """

    def __init__(self, device: torch.device | str, span_for: CudaSpanFor) -> None:
        super().__init__(device)
        self._span_for = span_for
        self._spans: list[tuple[Any, dict[str, object], int] | None] = []

    def setup(self, host_slots: HostSlots, on_complete: OnComplete,
              on_error: OnError) -> None:
        super().setup(host_slots, self._completed, on_error)
        self._on_ready = on_complete
        self._spans = [None] * len(host_slots)

    def submit(self, order: CopyOrder) -> None:
        slot, wanted = order.slot, self._span_for(order.slot)
        self.timing = wanted is not None
        if wanted is not None:
            self.started[slot] = torch.cuda.Event(enable_timing=True)
            self.ready[slot] = torch.cuda.Event(enable_timing=True, blocking=True)
            self._spans[slot] = (*wanted, time.perf_counter_ns())
        super().submit(order)

    def _completed(self, slot: int) -> None:
        span, self._spans[slot] = self._spans[slot], None
        if span is not None:
            recorder, args, begin_ns = span
            recorder.add_cuda_pending_span(CUDA_SPAN, category="gpu", cpu_begin_ns=begin_ns,
                                           start_event=self.started[slot],
                                           end_event=self.ready[slot], args=args)
        self._on_ready(slot)


def build_backend_for(device: torch.device, span_for: CudaSpanFor) -> TransferBackend:
    """Our backend doing the seed's work on ``device``."""
    if device.type == "cpu":
        return CpuBackend(device, copy=True)
    if device.type == "cuda":
        return SeedCudaBackend(device, span_for)
    return build_backend(device)
