"""An asynchronous device emulated on the CPU, so CUDA's orderings run without a GPU.

A copy-engine thread executes copy orders after a configurable or random delay;
emulated events stand for CUDA's: a slot's release event completes only after
the learner's (emulated) reads drain, a random time after release, and the
engine waits on it before overwriting G[i], as the CUDA copy stream does.
"""

from __future__ import annotations

import queue
import random
import threading
import time

import torch

from ..wire import CopyOrder
from .base import HostBackedSlots, HostSlots, OnComplete, allocate_like

Delay = float | tuple[float, float]


class EmulatedEvent:
    """Completes at a point in time; ``synchronize`` waits for it."""

    def __init__(self) -> None:
        self._at = 0.0

    def record(self, delay: float = 0.0) -> None:
        self._at = time.monotonic() + delay

    def query(self) -> bool:
        return time.monotonic() >= self._at

    def synchronize(self) -> None:
        remaining = self._at - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)  # the emulated device is busy until then


class EmulatedBackend(HostBackedSlots):
    name = "emulated"
    device_family = "emulated"
    host_memory_kind = "shared"
    host_pinned = False
    supports_async_submit = True
    supports_timing_events = False
    h2d_submitter = "transfer_thread"

    def __init__(self, device: torch.device | str = "cpu", *, copy_delay: Delay = (0.0, 0.002),
                 read_delay: Delay = (0.0, 0.002), seed: int = 0) -> None:
        self.device = torch.device("cpu")
        self.copy_delay, self.read_delay = copy_delay, read_delay
        self._rng = random.Random(seed)
        self._orders: queue.Queue[CopyOrder | None] = queue.Queue()
        self._engine: threading.Thread | None = None
        self.monitor = None  # checked mode's sanitizer, when on

    def _delay(self, spec: Delay) -> float:
        return spec if isinstance(spec, (int, float)) else self._rng.uniform(*spec)

    def setup(self, host_slots: HostSlots, on_complete: OnComplete) -> None:
        self.host = host_slots
        self.on_complete = on_complete
        self.device_slots = allocate_like(host_slots)
        n = len(host_slots)
        self.released = [EmulatedEvent() for _ in range(n)]
        self._engine = threading.Thread(target=self._run, name="replay_fsm-copy-engine",
                                        daemon=True)
        self._engine.start()

    def submit(self, order: CopyOrder) -> None:
        self._orders.put(order)

    def reads_pending(self, slot: int) -> bool:
        return not self.released[slot].query()

    def _run(self) -> None:
        while (order := self._orders.get()) is not None:
            try:
                self._copy(order)
            except AssertionError:
                continue  # checked mode reported it: the pipeline is failed already

    def _copy(self, order: CopyOrder) -> None:
        if order.after_release is not None:
            self.released[order.after_release.slot].synchronize()  # INV-DEVICE-WAR
        if self.monitor is not None:
            self.monitor.copy_started(order.slot)
        time.sleep(self._delay(self.copy_delay))  # the DMA takes a while
        self.device_slots[order.slot].copy_(self.host[order.slot])
        if self.monitor is not None:
            self.monitor.copy_finished(order.slot)
        self.on_complete(order.slot)

    def before_read(self, slot: int) -> None:
        pass  # on_complete ran after the copy: READY implies the data is there

    def after_read(self, slot: int) -> None:
        self.released[slot].record(self._delay(self.read_delay))

    def close(self) -> None:
        if self._engine is not None:
            self._orders.put(None)
            self._engine.join()
            self._engine = None
