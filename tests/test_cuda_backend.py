"""CudaBackend (and the accel backend's synchronize) against made-up CUDA, on a machine
without a GPU: the runtime's last error after a failed registration, the live answer
of ``host_pinned``, the registered slots held until close, and ``copy_held`` (the
copy waits for the learner's own reads) from the slot's release event. What needs a
real device is benchmarks/gpu_check.sh's (its ``register`` probe: a failed
registration's error at an unrelated kernel launch)."""

from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Any

import pytest
import torch

import replay_fsm.transfer.accel as accel
import replay_fsm.transfer.cuda as cuda


class Cudart:
    """torch.cuda.cudart() as the CUDA runtime answers on one host thread: a failed
    call leaves its error as the thread's last error until cudaGetLastError reads it
    out. ``pinned``: the page-locked addresses (``Tensor.is_pinned`` asks them here)."""

    cudaError = int

    def __init__(self, refuse: int | None = None, refuse_unregister: bool = False) -> None:
        self.refuse, self.refuse_unregister = refuse, refuse_unregister
        self.pinned: set[int] = set()
        self.last = 0

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        if self.refuse is not None and ptr == self.refuse:
            self.last = 2
            return 2
        self.pinned.add(ptr)
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        if self.refuse_unregister or ptr not in self.pinned:
            self.last = 713
            return 713
        self.pinned.discard(ptr)
        return 0

    def cudaGetErrorString(self, err: int) -> str:
        return {2: "out of memory", 713: "pointer does not correspond to a registered "
                "memory region"}[err]


class CudartWithGetLastError(Cudart):
    def cudaGetLastError(self) -> int:
        err, self.last = self.last, 0
        return err


class Stream:
    def synchronize(self) -> None:
        pass


class Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
        self.done = True

    def query(self) -> bool:
        return self.done


def fake_cuda(monkeypatch: pytest.MonkeyPatch, runtime: Cudart) -> None:
    """Made-up CUDA with one device, whose runtime is ``runtime``; device slots on the
    CPU."""
    for name, value in (("is_available", lambda: True), ("device_count", lambda: 1),
                        ("current_device", lambda: 0), ("cudart", lambda: runtime),
                        ("device", lambda device: contextlib.nullcontext()),
                        ("Stream", lambda device=None: Stream()), ("Event", Event),
                        ("current_stream", lambda device=None: Stream())):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(torch.Tensor, "is_pinned",
                        lambda self: self.data_ptr() in runtime.pinned)
    monkeypatch.setattr(cuda, "allocate_like",
                        lambda host_slots, device: [torch.empty_like(s) for s in host_slots])


def slots(n: int = 2) -> list[torch.Tensor]:
    return [torch.zeros(4, 3).share_memory_() for _ in range(n)]


@pytest.mark.parametrize("reader", ["cudaGetLastError", "a kernel launch"])
def test_a_failed_cudahostregister_leaves_no_error_set_on_the_thread(
        monkeypatch: pytest.MonkeyPatch, reader: str) -> None:
    """The runtime keeps a failed call's error as the thread's last error, and torch
    reads it after its next kernel launch there (C10_CUDA_KERNEL_LAUNCH_CHECK): the
    learner's first op after a Pipeline that could not pin its slots raised "CUDA
    error: out of memory" as its own. setup reads it out: through the binding's
    cudaGetLastError where torch has one, else through torch's own launch check."""
    host = slots()
    runtime = (CudartWithGetLastError if reader == "cudaGetLastError" else Cudart)(
        refuse=host[1].data_ptr())
    fake_cuda(monkeypatch, runtime)
    launches: list[torch.device] = []

    def launch_check(device: torch.device) -> None:  # torch's check after a launch
        launches.append(device)
        err, runtime.last = runtime.last, 0
        if err:
            raise RuntimeError(f"CUDA error: {runtime.cudaGetErrorString(err)}")

    monkeypatch.setattr(cuda, "_launch_check", launch_check, raising=False)
    backend = cuda.CudaBackend("cuda")
    with pytest.raises(RuntimeError, match="cudaHostRegister of the host slots failed: "
                                           "cudaError 2: out of memory"):
        backend.setup(host, lambda slot: None, lambda exc: None)
    assert runtime.last == 0  # nothing left for the next kernel launch to find
    assert runtime.pinned == set() and backend.host_pinned is False
    assert launches == ([] if reader == "cudaGetLastError" else [torch.device("cuda", 0)])


def test_a_failed_cudahostunregister_at_close_leaves_no_error_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = CudartWithGetLastError()
    fake_cuda(monkeypatch, runtime)
    backend = cuda.CudaBackend("cuda")
    backend.setup(slots(), lambda slot: None, lambda exc: None)
    assert backend.host_pinned is True
    runtime.refuse_unregister = True
    backend.close()
    assert runtime.last == 0 and backend.host_pinned is False


def test_host_pinned_is_asked_each_time_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slot page-locked before setup (someone else's registration) is left to its
    owner; when the owner unregisters it, the slots are no longer all pinned, and
    host_pinned (the seed's transfer_manifest["host_pinned"], its traces'
    pinned_memory) says so. It was set once at setup and stayed True."""
    runtime = CudartWithGetLastError()
    fake_cuda(monkeypatch, runtime)
    host = slots()
    runtime.pinned.add(host[0].data_ptr())  # pinned by its owner
    backend = cuda.CudaBackend("cuda")
    assert backend.host_pinned is False
    backend.setup(host, lambda slot: None, lambda exc: None)
    assert backend.host_pinned is True
    assert runtime.pinned == {host[0].data_ptr(), host[1].data_ptr()}
    runtime.cudaHostUnregister(host[0].data_ptr())  # its owner lets go of it
    assert backend.host_pinned is False
    backend.close()
    assert runtime.pinned == set() and backend.host_pinned is False


def test_the_registered_slots_are_held_until_close(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend held the list it was given (the caller's) and the registered
    addresses: a slot the caller replaced in its list could be freed, unmapped while
    still registered. It holds the registered tensors themselves until close."""
    runtime = CudartWithGetLastError()
    fake_cuda(monkeypatch, runtime)
    host = slots()
    first = weakref.ref(host[0])
    backend = cuda.CudaBackend("cuda")
    backend.setup(host, lambda slot: None, lambda exc: None)
    host[0] = torch.zeros(4, 3)  # the caller's list, changed under the backend
    gc.collect()
    assert first() is not None  # still mapped while registered
    backend.close()
    gc.collect()
    assert first() is None and runtime.pinned == set()


def test_a_copy_is_held_while_the_slots_release_event_is_pending(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy stream waits on the slot's release event (INV-DEVICE-WAR): until the
    learner's stream passes it, the copy has not begun (the watchdog does not count
    that time against it). reads_pending stays False: checked mode asks it when the
    copy is enqueued, which the wait makes legal."""
    runtime = CudartWithGetLastError()
    fake_cuda(monkeypatch, runtime)
    backend = cuda.CudaBackend("cuda")
    backend.setup(slots(), lambda slot: None, lambda exc: None)
    try:
        released: Any = backend.released[1]
        assert backend.copy_held(1) is False  # never recorded: nothing to wait for
        released.done = False  # recorded at after_tick, the learner's step still queued
        assert backend.copy_held(1) is True and backend.copy_held(0) is False
        assert backend.reads_pending(1) is False
        released.done = True
        assert backend.copy_held(1) is False
    finally:
        backend.close()


@pytest.mark.parametrize(("device", "args"), [("xpu:1", (torch.device("xpu", 1),)),
                                              ("xpu", ()), ("mps:0", ())])
def test_accels_synchronize_without_torch_accelerator_names_the_device(
        monkeypatch: pytest.MonkeyPatch, device: str, args: tuple[object, ...]) -> None:
    """torch < 2.6 has no torch.accelerator: the device module's synchronize() alone
    waited for the current device (xpu:0), not the one whose copy is to end (xpu:1)."""
    calls: list[tuple[object, ...]] = []
    monkeypatch.delattr(torch, "accelerator", raising=False)
    kind = torch.device(device).type
    monkeypatch.setattr(getattr(torch, kind), "synchronize", lambda *a: calls.append(a))
    accel.synchronize(torch.device(device))
    assert calls == [args]
