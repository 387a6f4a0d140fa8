"""The one protocol every transfer backend implements.

A backend owns the device slots G[i] and the ordering primitives of its device:
it copies H[i] to G[i] when given a CopyOrder (after the order's release
dependency, INV-DEVICE-WAR), reports completion through ``on_complete``, makes
the learner's reads wait for the copy (INV-RAW) and marks the end of the
learner's reads at release.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

from ..wire import CopyOrder

OnComplete = Callable[[int], None]


@runtime_checkable
class TransferBackend(Protocol):
    name: str
    device: torch.device
    device_family: str
    host_memory_kind: str
    host_pinned: bool
    supports_async_submit: bool
    supports_timing_events: bool
    # Where copies are issued: "transfer_thread" or "learner_thread" (MPS).
    h2d_submitter: str

    def setup(self, host_slots: torch.Tensor | Sequence[torch.Tensor],
              on_complete: OnComplete) -> None:
        """Allocate G[0..n) like ``host_slots`` ([n, rows, width] or n tensors);
        page-lock H if the device needs it."""

    def device_slot(self, slot: int) -> torch.Tensor:
        """G[slot]: what the learner's batch views."""

    def submit(self, order: CopyOrder) -> None:
        """Copy H[slot] -> G[slot] once ``order.after_release`` has drained; call
        ``on_complete(slot)`` when the copy is done (from any thread)."""

    def before_read(self, slot: int) -> None:
        """At acquire, on the learner thread: its reads of G[slot] wait for the copy."""

    def after_read(self, slot: int) -> None:
        """At release, on the learner thread: mark the end of its reads of G[slot]."""

    def close(self) -> None:
        """Drain in-flight copies and free what setup took. Idempotent."""


HostSlots = torch.Tensor | Sequence[torch.Tensor]


def allocate_like(host_slots: HostSlots, device: torch.device | str = "cpu") -> torch.Tensor:
    """One [n, rows, width] tensor on ``device`` for host slots given as a tensor or a
    list of [rows, width] tensors (the seed's collectors pass lists)."""
    first = host_slots[0]
    return torch.empty((len(host_slots), *first.shape), dtype=first.dtype, device=device)


class HostBackedSlots:
    """Shared bookkeeping for backends whose G[i] are plain tensors."""

    host: HostSlots
    device_slots: HostSlots  # a tensor [n, rows, width]; the host slots when zero-copy
    on_complete: OnComplete

    def device_slot(self, slot: int) -> torch.Tensor:
        return self.device_slots[slot]
