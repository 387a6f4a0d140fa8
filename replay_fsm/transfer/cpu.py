"""CPU: zero-copy by default; the batch views the host slot.

Legal because the machine forbids writing H[i] while slot i is HOT (INV-HOST-WAR);
``copy=True`` gives the learner its own copy instead.
"""

from __future__ import annotations

import torch

from ..wire import CopyOrder
from .base import HostBackedSlots, HostSlots, OnComplete, allocate_like


class CpuBackend(HostBackedSlots):
    name = "cpu"
    device_family = "cpu"
    host_pinned = False
    supports_async_submit = False
    supports_timing_events = False
    h2d_submitter = "transfer_thread"

    def __init__(self, device: torch.device | str = "cpu", *, copy: bool = False) -> None:
        self.device = torch.device(device)
        self.copy = copy
        self.host_memory_kind = "shared" if not copy else "shared+private_copy"

    def setup(self, host_slots: HostSlots, on_complete: OnComplete) -> None:
        self.host = host_slots
        self.device_slots = allocate_like(host_slots) if self.copy else host_slots
        self.on_complete = on_complete

    def submit(self, order: CopyOrder) -> None:
        if self.copy:
            self.device_slots[order.slot].copy_(self.host[order.slot])
        self.on_complete(order.slot)

    def before_read(self, slot: int) -> None:
        pass  # the copy (if any) finished before the slot became READY

    def after_read(self, slot: int) -> None:
        pass  # CPU reads are synchronous: they are over when the learner releases

    def close(self) -> None:
        pass
