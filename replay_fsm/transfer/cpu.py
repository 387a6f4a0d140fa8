"""CPU: zero-copy by default; the batch views the host slot.

Legal because the machine forbids writing H[i] while slot i is HOT (INV-HOST-WAR);
``copy=True`` gives the learner its own copy instead.
"""

from __future__ import annotations

import torch

from ..wire import CopyOrder
from .base import HostSlots, TransferBackend, allocate_like


class CpuBackend(TransferBackend):
    name = "cpu"
    submit_on_learner = True  # synchronous: a copy (or none) into its own slot

    def __init__(self, device: torch.device | str = "cpu", *, copy: bool = False) -> None:
        self.device = torch.device(device)
        self.copy = copy

    def allocate(self, host_slots: HostSlots) -> HostSlots:
        return allocate_like(host_slots) if self.copy else host_slots

    def submit(self, order: CopyOrder) -> None:
        if self.copy:
            self.copy_now(order.slot)
        self.on_complete(order.slot)
