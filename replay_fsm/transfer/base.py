"""The one protocol every transfer backend implements, with its defaults.

A backend owns the device slots G[i] and the ordering primitives of its device: it
copies H[i] to G[i] when given a CopyOrder (after the order's release dependency,
INV-DEVICE-WAR), reports completion through ``on_complete`` and failures of its
own threads through ``on_error``, makes the learner's reads wait for the copy
(INV-RAW) and marks the end of the learner's reads at release. Everything the
pipeline calls on a backend is declared here; a backend overrides what its device
needs. Pass an instance as ``Pipeline(backend=...)``, or give it a name with
``replay_fsm.transfer.register_backend``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import ClassVar, Protocol

import torch

from ..wire import CopyOrder

HostSlots = torch.Tensor | Sequence[torch.Tensor]
OnComplete = Callable[[int], None]
OnError = Callable[[BaseException], None]


class CopyMonitor(Protocol):
    """Checked mode's view of the copy engine: when a copy reads H[i] and writes G[i]."""

    def copy_started(self, slot: int) -> None: ...

    def copy_finished(self, slot: int) -> None: ...


def allocate_like(host_slots: HostSlots, device: torch.device | str = "cpu"
                  ) -> list[torch.Tensor]:
    """G[0..n) on ``device``, one tensor per slot, shaped like the host slots (given
    as one [n, rows, width] tensor or n tensors [rows, width]). Separate tensors, not
    views of one: a copy into one slot must not bump the autograd version counter of
    the batch views the learner holds on another (a saved view would then fail
    ``backward()``)."""
    return [torch.empty(s.shape, dtype=s.dtype, device=device) for s in host_slots]


class TransferBackend(abc.ABC):
    """Base of every backend. Only ``submit`` must be written; the rest defaults to
    what a synchronous device with plain tensor slots needs."""

    name: ClassVar[str] = "custom"
    # Whether ``submit`` may run on the learner's thread too, beside the transfer
    # worker's: a batch the learner packed itself is then submitted at once, with no
    # hand-off to the worker thread. Only for a submit that finishes the copy before it
    # returns and is safe from two threads at once.
    submit_on_learner: ClassVar[bool] = False
    device: torch.device
    host: HostSlots
    device_slots: HostSlots  # one tensor per slot; the host slots when zero-copy
    on_complete: OnComplete
    on_error: OnError
    monitor: CopyMonitor | None = None

    def __init__(self, device: str | torch.device = "cpu") -> None:
        """Keep ``device``, where G[0..n) go: a backend that writes only ``submit``
        runs as an instance (on the CPU by default) and by a registered name (built
        as ``factory(device, **backend_options)``). One with an ``__init__`` of its
        own that does not call this sets ``self.device`` itself.

        Raises:
            ValueError: not a device torch knows.
        """
        self.device = parse_device(device)

    # -- set-up and slots ----------------------------------------------------

    def setup(self, host_slots: HostSlots, on_complete: OnComplete,
              on_error: OnError) -> None:
        """Allocate G[0..n) like ``host_slots`` ([n, rows, width] or n tensors) and
        keep the callbacks. ``on_complete(slot)`` reports a finished copy,
        ``on_error(exc)`` an exception on a thread of the backend's own."""
        self.host = host_slots
        self.on_complete = on_complete
        self.on_error = on_error
        self.device_slots = self.allocate(host_slots)

    def allocate(self, host_slots: HostSlots) -> HostSlots:
        """G[0..n): by default a tensor on ``self.device`` shaped like the host slots."""
        return allocate_like(host_slots, self.device)

    def device_slot(self, slot: int) -> torch.Tensor:
        """G[slot]: what the learner's batch views."""
        return self.device_slots[slot]

    # -- the copy --------------------------------------------------------------

    @abc.abstractmethod
    def submit(self, order: CopyOrder) -> None:
        """Transfer worker: copy H[slot] -> G[slot] once ``order.after_release`` has
        drained; call ``on_complete(slot)`` when the copy is done (from any thread)."""

    def copy_now(self, slot: int) -> None:
        """Copy H[slot] into G[slot] synchronously, telling checked mode's monitor."""
        if self.monitor is not None:
            self.monitor.copy_started(slot)
        self.device_slots[slot].copy_(self.host[slot])
        if self.monitor is not None:
            self.monitor.copy_finished(slot)

    def pump(self) -> None:
        """Learner thread, while it waits for a batch: issue work that must run on it
        (MPS copies). Default: nothing."""

    # -- the learner's reads ---------------------------------------------------

    def before_read(self, slot: int) -> None:
        """At acquire, on the learner thread: its reads of G[slot] wait for the copy.
        Default: nothing (the copy finished before the slot became READY)."""

    def after_read(self, slot: int) -> None:
        """At release, on the learner thread: mark the end of its reads of G[slot].
        Default: nothing (reads are synchronous and over at release)."""

    def reads_pending(self, slot: int) -> bool:
        """Whether reads of G[slot] from its last HOT period may still run (checked
        mode asks before a copy into it). Default: False."""
        return False

    def copy_held(self, slot: int) -> bool:
        """Whether the copy into G[slot] (SUBMITTED) still waits for the learner's own
        device work: the reads of G[slot] from its last HOT period, which it must not
        overtake (INV-DEVICE-WAR). Asked, on the learner's thread, only of a copy
        past ``liveness_timeout``: its ``TransferFailed`` then names the learner's
        device work, not the copy (a learner step that long, or one that hangs).
        Default: ``reads_pending`` (a backend whose copy engine waits for those reads
        before it starts)."""
        return self.reads_pending(slot)

    # -- observability and liveness --------------------------------------------

    def watch_copies(self, monitor: CopyMonitor | None) -> None:
        """Checked mode: report each copy's start and end to ``monitor``."""
        self.monitor = monitor

    def trace(self, enabled: bool) -> None:
        """Tracing is on: record device-side timings (CUDA events, NVTX). Called
        before ``setup``. Default: nothing to record."""

    def check_alive(self) -> str | None:
        """None while the copy engine can still complete copies, else why it cannot,
        a non-empty str (its thread died). Asked while a slot is SUBMITTED
        (INV-LIVE)."""
        return None

    def release_slots(self) -> None:
        """After ``close``: let go of the host and device slots, so that their memory
        (shared memory for the host's, which counts against /dev/shm) is freed when
        nothing else holds them (the learner's batches; an external collector's
        process maps the host slots until it exits), not when a garbage collection
        finds the closed pipeline."""
        self.host = []
        self.device_slots = []

    def close(self) -> None:
        """Drain in-flight copies and free what setup took. Idempotent."""

    def stop_at_exit(self, timeout: float) -> list[str]:
        """The interpreter's exit, for a pipeline left open, once nothing submits any
        more: end the backend's own threads within ``timeout``, not its drain (a copy
        that never completes, a hung device); returns what was left running. A daemon
        thread still inside a torch call while the interpreter finalizes aborts the
        process ("terminate called without an active exception", exit code 134).
        Default: nothing (no thread of its own)."""
        return []


def parse_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``.

    Raises:
        ValueError: not a device torch knows (torch's own error lists every type).
    """
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r}; supported: cpu, cuda[:N], mps, xpu, "
                         "or any device type torch knows") from exc


def available_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device`` this machine has (its index too, where it
    names one): what the commands check before they start anything (a backend
    checks its own device when it is built).

    Raises:
        ValueError: an unknown device, a device type this machine lacks, or an index
            past its devices of that type.
    """
    dev = parse_device(device)
    if dev.type == "cpu":
        return dev
    module = getattr(torch, dev.type, None)
    if (module is None or not getattr(module, "is_available", lambda: False)()
            or (dev.index is not None and dev.index >= _device_count(module))):
        raise ValueError(f"device {str(dev)!r} is not available on this machine; "
                         f"supported here: {', '.join(_available_devices())}")
    return dev


def _device_count(module: object) -> int:
    count = getattr(module, "device_count", None)
    return int(count()) if callable(count) else 1


def _available_devices() -> list[str]:
    """What ``available_device`` accepts here, for its error: cpu, then each
    accelerator type torch finds with its indices (``cuda (cuda:0 to cuda:3)``)."""
    names = ["cpu"]
    for kind in ("cuda", "xpu", "mps"):
        module = getattr(torch, kind, None)
        if module is not None and getattr(module, "is_available", lambda: False)():
            last = _device_count(module) - 1
            names.append(f"{kind} ({kind}:0" + (f" to {kind}:{last})" if last > 0 else ")"))
    return names
