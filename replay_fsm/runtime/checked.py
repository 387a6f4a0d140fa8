"""Checked mode: a runtime sanitizer of the slot protocol.

It records, per slot, when the packer wrote H[i], when a copy read H[i] and
wrote G[i], and when the learner read G[i], and raises CheckedModeViolation on
any overlap the invariants forbid (INV-HOST-WAR, INV-DEVICE-WAR, INV-RAW). At
release it poisons the device slot with NaN, so a batch view kept past
``after_tick()`` fails loudly. The pipeline calls it only when ``checked=True``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..spec import STOPPED, SlotState
from ..wire import PackDone


class CheckedModeViolation(AssertionError):
    """Two actors touched one slot's buffer at once; the invariant is named."""


class Checker:
    """The sanitizer. It sees the pipeline only through narrow callables: the state of
    a slot, a way to fail the pipeline, the device slots and whether a slot's reads
    may still be in flight."""

    def __init__(self, ring_depth: int, *, state_of: Callable[[int], SlotState],
                 fail: Callable[[BaseException], None],
                 device_slot: Callable[[int], torch.Tensor],
                 reads_pending: Callable[[int], bool]) -> None:
        self._state_of, self._fail_pipeline = state_of, fail
        self._device_slot, self._reads_pending = device_slot, reads_pending
        n = ring_depth
        self.copy_open = [False] * n  # a copy reads H[i] and writes G[i]
        self.copy_end_ns = [0] * n
        self.reading = [False] * n  # the learner reads G[i] (HOT, reads not drained)
        self.checks = 0

    def _fail(self, inv: str, msg: str) -> None:
        """Fail the pipeline (the learner sees it, chained) and raise to the caller."""
        violation = CheckedModeViolation(f"{inv}: {msg}")
        self._fail_pipeline(violation)
        raise violation

    def pack_done(self, done: PackDone) -> None:
        """Transfer worker, before submit: the packer's write of H[slot] happened
        while the slot was REQUESTED and no copy from H[slot] was in flight."""
        self.checks += 1
        slot = done.slot
        state = self._state_of(slot)
        if state is not SlotState.REQUESTED:
            self._fail("INV-HOST-WAR", f"packer wrote H[{slot}] while it was {state.name}")
        if self.copy_open[slot] or self.copy_end_ns[slot] > done.pack_start_ns:
            self._fail("INV-HOST-WAR", f"packer wrote H[{slot}] (tick {done.tick}) while "
                       "a copy from it was in flight")

    def copy_started(self, slot: int) -> None:
        """Copy engine: G[slot] may be written only after its reads drained."""
        state = self._state_of(slot)
        if state in STOPPED:
            self.copy_open[slot] = True
            return  # a copy submitted before the end drains; nobody will read G[slot]
        self.checks += 1
        if self.reading[slot] or self._reads_pending(slot):
            self._fail("INV-DEVICE-WAR", f"copy into G[{slot}] started while the learner's "
                       "reads of it were in flight")
        if state is not SlotState.SUBMITTED:
            self._fail("INV-HOST-WAR", f"copy from H[{slot}] started in state {state.name}")
        self.copy_open[slot] = True

    def copy_finished(self, slot: int) -> None:
        self.copy_open[slot] = False
        self.copy_end_ns[slot] = time.monotonic_ns()

    def acquiring(self, slot: int) -> None:
        """Learner, at acquire: G[slot] is read only after its copy completed."""
        self.checks += 1
        if self.copy_open[slot]:
            self._fail("INV-RAW", f"learner acquired G[{slot}] while its copy was in flight")
        self.reading[slot] = True

    def released(self, slot: int) -> None:
        """Learner, at release: poison G[slot] so a view kept past release shows NaN."""
        self.checks += 1
        self.reading[slot] = False
        self._device_slot(slot).fill_(float("nan"))
