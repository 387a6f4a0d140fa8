"""Copies complete only when the caller says so: deterministic tests of every
interleaving of copy completion with the learner's steps."""

from __future__ import annotations

import threading

import torch

from ..wire import CopyOrder
from .base import TransferBackend


class ManualBackend(TransferBackend):
    name = "manual"

    def __init__(self, device: torch.device | str = "cpu", *, hold_reads: bool = False
                 ) -> None:
        """``hold_reads``: the learner's reads of a slot stay in flight after release
        until ``finish_reads(slot)``, like kernels still queued on a GPU."""
        self.device = torch.device("cpu")
        self.hold_reads = hold_reads
        self._submitted: dict[int, CopyOrder] = {}
        self._reading: set[int] = set()
        self._cv = threading.Condition()

    def submit(self, order: CopyOrder) -> None:
        with self._cv:
            self._submitted[order.slot] = order
            self._cv.notify_all()

    @property
    def submitted(self) -> tuple[int, ...]:
        """Slots with a copy order not yet completed."""
        with self._cv:
            return tuple(sorted(self._submitted))

    def wait_submitted(self, slot: int, timeout: float = 10.0) -> bool:
        """Block until the transfer worker has submitted a copy into ``slot``."""
        with self._cv:
            return self._cv.wait_for(lambda: slot in self._submitted, timeout=timeout)

    def reads_pending(self, slot: int) -> bool:
        return slot in self._reading

    def complete(self, slot: int) -> None:
        """Perform the copy into ``slot`` now and report it complete.

        Raises:
            KeyError: no copy into ``slot`` was submitted.
            RuntimeError: the order's release dependency has not drained.
        """
        with self._cv:
            order = self._submitted[slot]
            dep = order.after_release
            if dep is not None and dep.slot in self._reading:
                raise RuntimeError(f"copy into slot {slot} must wait for the release of "
                                   f"tick {dep.tick}")
            del self._submitted[slot]
        self.copy_now(slot)
        self.on_complete(slot)

    def before_read(self, slot: int) -> None:
        with self._cv:
            self._reading.add(slot)

    def after_read(self, slot: int) -> None:
        if not self.hold_reads:
            self.finish_reads(slot)

    def finish_reads(self, slot: int) -> None:
        """The learner's reads of G[slot] from its last HOT period are over."""
        with self._cv:
            self._reading.discard(slot)

    def close(self) -> None:
        with self._cv:
            self._submitted.clear()
