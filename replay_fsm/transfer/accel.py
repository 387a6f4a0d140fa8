"""Portable accelerators torch knows (mps, xpu, ...): a torch copy plus a device
synchronize. On MPS the copy is issued from the learner thread, because Metal
asserts on copies issued from a background thread (the seed learned this)."""

from __future__ import annotations

import threading

import torch

from ..wire import CopyOrder
from .base import HostBackedSlots, HostSlots, OnComplete, allocate_like


def synchronize(device: torch.device) -> None:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        accelerator.synchronize(device)
    else:
        getattr(torch, device.type).synchronize()


class AcceleratorBackend(HostBackedSlots):
    name = "accel"
    host_memory_kind = "shared"
    host_pinned = False
    supports_async_submit = False
    supports_timing_events = False

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.device_family = self.device.type
        self.h2d_submitter = "learner_thread" if self.device.type == "mps" else (
            "transfer_thread")
        self._deferred: list[CopyOrder] = []
        self._lock = threading.Lock()

    def setup(self, host_slots: HostSlots, on_complete: OnComplete) -> None:
        self.host = host_slots
        self.on_complete = on_complete
        self.device_slots = allocate_like(host_slots, self.device)

    def submit(self, order: CopyOrder) -> None:
        if self.h2d_submitter == "learner_thread":
            with self._lock:
                self._deferred.append(order)
            return
        self._copy(order)

    def pump(self) -> None:
        """Learner thread: issue the copies deferred to it (MPS)."""
        with self._lock:
            orders, self._deferred = self._deferred, []
        for order in orders:
            self._copy(order)

    def _copy(self, order: CopyOrder) -> None:
        # Synchronous device: the previous reads of G[slot] ended at release.
        self.device_slots[order.slot].copy_(self.host[order.slot])
        synchronize(self.device)
        self.on_complete(order.slot)

    def before_read(self, slot: int) -> None:
        pass

    def after_read(self, slot: int) -> None:
        synchronize(self.device)  # reads of G[slot] are done before it can be rewritten

    def close(self) -> None:
        with self._lock:
            self._deferred.clear()  # never issued: nothing in flight to drain
