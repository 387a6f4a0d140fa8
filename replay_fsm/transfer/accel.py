"""Portable accelerators torch knows (mps, xpu, ...): a torch copy plus a device
synchronize. On MPS the copy is issued from the learner thread, inside ``pump``,
because Metal asserts on copies issued from a background thread (the seed learned
this)."""

from __future__ import annotations

import threading

import torch

from ..wire import CopyOrder
from .base import TransferBackend, available_device, parse_device


def synchronize(device: torch.device) -> None:
    """Wait for all work on ``device`` (every stream: the learner's reads and the
    worker's copies alike). Without ``torch.accelerator`` (torch < 2.6), through the
    device type's module, told the device: its ``synchronize()`` alone waits for the
    current device, not xpu:1's copy (mps has one device and takes no argument)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        accelerator.synchronize(device)
    elif device.index is None or device.type == "mps":
        getattr(torch, device.type).synchronize()
    else:
        getattr(torch, device.type).synchronize(device)


class AcceleratorBackend(TransferBackend):
    name = "accel"

    def __init__(self, device: torch.device | str) -> None:
        """Raises:
            ValueError: not a device torch knows, the CPU, or a device type not
                available on this machine."""
        self.device = parse_device(device)
        if self.device.type == "cpu":  # torch.cpu.is_available() is True, but no copy
            raise ValueError("backend 'accel' is for accelerators (mps, xpu, ...); for "
                             "device 'cpu' use backend 'cpu' (the default there)")
        available_device(self.device)
        self.on_learner_thread = self.device.type == "mps"
        self._deferred: list[CopyOrder] = []
        self._lock = threading.Lock()

    def submit(self, order: CopyOrder) -> None:
        if self.on_learner_thread:
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
        self.copy_now(order.slot)
        synchronize(self.device)
        self.on_complete(order.slot)

    def after_read(self, slot: int) -> None:
        synchronize(self.device)  # reads of G[slot] are done before it can be rewritten

    def close(self) -> None:
        with self._lock:
            self._deferred.clear()  # never issued: nothing in flight to drain
