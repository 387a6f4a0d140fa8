"""An asynchronous device emulated on the CPU, so CUDA's orderings run without a GPU.

A copy-engine thread executes copy orders after a configurable or random delay;
emulated events stand for CUDA's: a slot's release event completes only after
the learner's (emulated) reads drain, a random time after release, and the
engine waits on it before overwriting G[i], as the CUDA copy stream does. An
exception on the engine thread reaches the pipeline through ``on_error`` and ends
the thread; ``check_alive`` then says so.
"""

from __future__ import annotations

import queue
import random
import threading
import time

import torch

from ..wire import CopyOrder
from .base import HostSlots, OnComplete, OnError, TransferBackend

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


class EmulatedBackend(TransferBackend):
    name = "emulated"

    def __init__(self, device: torch.device | str = "cpu", *, copy_delay: Delay = (0.0, 0.002),
                 read_delay: Delay = (0.0, 0.002), seed: int = 0) -> None:
        self.device = torch.device("cpu")
        self.copy_delay, self.read_delay = copy_delay, read_delay
        self._rng = random.Random(seed)
        self._orders: queue.Queue[CopyOrder | None] = queue.Queue()
        self._engine: threading.Thread | None = None
        self._died: BaseException | None = None

    def _delay(self, spec: Delay) -> float:
        return spec if isinstance(spec, (int, float)) else self._rng.uniform(*spec)

    def setup(self, host_slots: HostSlots, on_complete: OnComplete,
              on_error: OnError) -> None:
        super().setup(host_slots, on_complete, on_error)
        self.released = [EmulatedEvent() for _ in range(len(host_slots))]
        self._engine = threading.Thread(target=self._run, name="replay_fsm-copy-engine",
                                        daemon=True)
        self._engine.start()

    def submit(self, order: CopyOrder) -> None:
        self._orders.put(order)

    def reads_pending(self, slot: int) -> bool:
        return not self.released[slot].query()

    def check_alive(self) -> str | None:
        if self._engine is not None and not self._engine.is_alive():
            return f"the emulated copy engine thread exited ({self._died!r})"
        return None

    def _run(self) -> None:
        try:
            while (order := self._orders.get()) is not None:
                self._copy(order)
        except BaseException as exc:  # noqa: BLE001 - the pipeline gets it, chained
            self._died = exc
            self.on_error(exc)

    def _copy(self, order: CopyOrder) -> None:
        if order.after_release is not None:
            self.released[order.after_release.slot].synchronize()  # INV-DEVICE-WAR
        time.sleep(self._delay(self.copy_delay))  # the DMA takes a while
        self.copy_now(order.slot)
        self.on_complete(order.slot)

    def after_read(self, slot: int) -> None:
        self.released[slot].record(self._delay(self.read_delay))

    def stop_at_exit(self, timeout: float) -> list[str]:
        """End the copy engine after the orders it has (each a few milliseconds): left
        running, it copied (``Tensor.copy_``) while the interpreter finalized, and the
        daemon thread, retaking the GIL inside torch, was ended in C++ code: exit code
        134 in 2 of 6 runs of a script whose uncaught exception left a copy queued."""
        if self._end_engine(timeout):
            return []
        return [f"the emulated copy engine did not stop within {timeout:.0f} s; it "
                "is a daemon thread and is left behind"]

    def close(self) -> None:
        self._end_engine(None)
        self._engine = None

    def _end_engine(self, timeout: float | None) -> bool:
        """Post the end after the orders queued and wait for the engine (``timeout``
        seconds; None: until it ends): whether it ended (or never started)."""
        engine = self._engine
        if engine is None:
            return True
        self._orders.put(None)
        engine.join(timeout)
        return not engine.is_alive()
