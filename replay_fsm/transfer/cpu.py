"""CPU: zero-copy by default; the batch views the host slot.

Legal because the machine forbids writing H[i] while slot i is HOT (INV-HOST-WAR);
``copy=True`` gives the learner its own copy instead.
"""

from __future__ import annotations

import torch

from ..wire import CopyOrder
from .base import HostSlots, TransferBackend, allocate_like, parse_device


class CpuBackend(TransferBackend):
    name = "cpu"
    submit_on_learner = True  # synchronous: a copy (or none) into its own slot

    def __init__(self, device: torch.device | str = "cpu", *, copy: bool = False) -> None:
        """Raises:
            ValueError: not a device torch knows, or a device other than the CPU (the
                batches would be on the CPU, ``Pipeline.device`` saying otherwise)."""
        self.device = parse_device(device)
        if self.device.type != "cpu":
            raise ValueError(f"backend 'cpu' is for device 'cpu', got device "
                             f"{str(self.device)!r}: leave backend= out for the device's "
                             "own backend")
        self.copy = copy

    def allocate(self, host_slots: HostSlots) -> HostSlots:
        return allocate_like(host_slots) if self.copy else host_slots

    def submit(self, order: CopyOrder) -> None:
        if self.copy:
            self.copy_now(order.slot)
        self.on_complete(order.slot)
