"""Extending the library from outside the package: a backend written in a user's own
file, passed as an instance or registered by name, and an observer of transitions."""

from __future__ import annotations

import importlib
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch

from replay_fsm import Pipeline, ReplayBuffer, TransferBackend
from replay_fsm.runtime.observers import Observer
from replay_fsm.transfer import register_backend, registered_backends, unregister_backend

from .drive import packed, reference

USER_BACKEND = '''
"""A user's backend: copies on the transfer thread and counts what it did."""
import torch
from replay_fsm import TransferBackend


class CountingBackend(TransferBackend):
    name = "counting"

    def __init__(self, device="cpu", *, scale=1):
        self.device = torch.device(device)
        self.scale = scale
        self.copies = 0
        self.reads = 0

    def submit(self, order):
        self.copy_now(order.slot)
        self.copies += 1
        self.on_complete(order.slot)

    def before_read(self, slot):
        self.reads += 1
'''


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    (tmp_path / "my_backends.py").write_text(textwrap.dedent(USER_BACKEND))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("my_backends")
    yield module
    sys.modules.pop("my_backends", None)


def run(pipe: Pipeline, ticks: int) -> None:
    for tick, batch in pipe.ticks(0, ticks):
        assert torch.equal(packed(batch, pipe), reference(pipe, tick))  # INV-DATA


def buffer() -> ReplayBuffer:
    rb = ReplayBuffer(256, 4, 2)
    rb.add_packed(torch.randn(200, rb.width))
    return rb


def test_a_backend_instance_from_a_users_file(user_module) -> None:  # type: ignore[no-untyped-def]
    backend = user_module.CountingBackend()
    with Pipeline(buffer(), sample_count=32, ring_depth=3, backend=backend,
                  checked=True) as pipe:
        run(pipe, 10)
        assert pipe.backend is backend
    assert backend.copies == 10 and backend.reads == 10


def test_a_backend_registered_by_name_from_a_users_file(user_module) -> None:  # type: ignore[no-untyped-def]
    register_backend("counting", user_module.CountingBackend)
    try:
        assert "counting" in registered_backends()
        with pytest.raises(ValueError, match="already registered"):
            register_backend("counting", user_module.CountingBackend)
        with Pipeline(buffer(), sample_count=32, backend="counting",
                      backend_options={"scale": 2}) as pipe:
            run(pipe, 5)
            assert pipe.backend.copies == 5 and pipe.backend.scale == 2  # type: ignore[attr-defined]
        with pytest.raises(ValueError, match="does not take the options \\['colour'\\]"):
            Pipeline(buffer(), sample_count=32, backend="counting",
                     backend_options={"colour": "red"})
    finally:
        unregister_backend("counting")
    assert "counting" not in registered_backends()


def test_bad_backend_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="unknown backend 'nope'; registered: cpu"):
        Pipeline(buffer(), sample_count=8, backend="nope")
    with pytest.raises(ValueError, match="backend 'cpu' does not take the options"):
        Pipeline(buffer(), sample_count=8, backend_options={"copyy": True})
    with pytest.raises(TypeError, match="registered name or a TransferBackend"):
        Pipeline(buffer(), sample_count=8, backend=42)  # type: ignore[arg-type]
    for name in (3, ""):  # 3 was registered, and never reachable by backend=
        with pytest.raises(TypeError, match="a backend's name must be a non-empty str"):
            register_backend(name, lambda device: None)  # type: ignore[arg-type]
    assert 3 not in registered_backends()  # type: ignore[comparison-overlap]


def test_a_backend_written_wrongly_is_named_with_what_to_fix() -> None:
    """An ``__init__`` that neither called the base's nor set ``self.device`` (the
    README's rule) raised AttributeError ('B' object has no attribute 'device'); a
    registered factory that returned None or a class raised the same of what it
    returned; a factory that does not take the device said "does not take the options
    []", no option given (helper-106)."""

    class NoDevice(SubmitOnly):
        def __init__(self, scale: int = 1) -> None:
            self.scale = scale

    class NoDeviceParameter(SubmitOnly):
        def __init__(self) -> None:
            super().__init__()

    with pytest.raises(TypeError, match=r"^NoDevice has no device: its __init__ must call "
                                        r"super\(\).__init__\(device\) or set self.device$"):
        Pipeline(buffer(), sample_count=8, backend=NoDevice())
    made = {"none": lambda device: None, "class": lambda device: SubmitOnly,
            "no-device": NoDevice}
    for name, factory in made.items():
        register_backend(name, factory)
    register_backend("no-device-parameter", NoDeviceParameter)
    try:
        with pytest.raises(TypeError, match="^backend 'none': its factory returned "
                                            "NoneType, not a TransferBackend instance$"):
            Pipeline(buffer(), sample_count=8, backend="none")
        with pytest.raises(TypeError, match="^backend 'class': its factory returned "
                                            "ABCMeta, not a TransferBackend instance$"):
            Pipeline(buffer(), sample_count=8, backend="class")
        with pytest.raises(TypeError, match="^NoDevice has no device"):
            Pipeline(buffer(), sample_count=8, backend="no-device")
        with pytest.raises(ValueError, match=r"^backend 'no-device-parameter' is built as "
                                             r"factory\(device, \*\*backend_options\) and "
                                             r"does not take the device: too many "
                                             r"positional arguments; its signature: \(\)"):
            Pipeline(buffer(), sample_count=8, backend="no-device-parameter")
    finally:
        for name in [*made, "no-device-parameter"]:
            unregister_backend(name)


def test_a_factory_missing_an_option_is_not_said_to_refuse_the_device() -> None:
    """A factory ``(device, *, size)`` built with no backend_options was said to be
    one that "does not take the device: missing a required argument: 'size'" (the
    device-less factory's words, given wherever no option was; helper-108)."""

    def sized(device: str, *, size: int) -> SubmitOnly:
        return SubmitOnly(device)

    register_backend("sized", sized)
    try:
        with pytest.raises(ValueError, match=r"^backend 'sized' needs backend_options, "
                                             r"and none were given: missing a required "
                                             r"argument: 'size'; its signature: "):
            Pipeline(buffer(), sample_count=8, backend="sized")
        with Pipeline(buffer(), sample_count=8, backend="sized",
                      backend_options={"size": 1}) as pipe:
            assert pipe.device == torch.device("cpu")
    finally:
        unregister_backend("sized")


@pytest.mark.parametrize("name", ["emulated", "manual", "on-the-cpu"])
def test_a_backend_by_name_that_copies_elsewhere_than_the_device_is_refused(
        name: str) -> None:
    """``backend="emulated"`` or ``"manual"`` with ``device="cuda"`` gave a pipeline on
    the CPU, silently (its ``device`` said "cpu"); so did a registered factory that
    ignores its device. Refused as a backend instance on another device is; the
    device it copies to, or one that names it, is taken."""
    register_backend("on-the-cpu", lambda device: SubmitOnly("cpu"))
    try:
        for device in ("cuda", "cuda:1", "meta"):
            with pytest.raises(ValueError) as info:
                Pipeline(buffer(), sample_count=8, device=device, backend=name)
            assert str(info.value) == (
                f"backend {name!r} copies to 'cpu', not to the device asked for, "
                f"{device!r}: leave device out, or name a backend that copies to "
                f"{device!r}")
        for device in (None, "cpu", "cpu:0", torch.device("cpu")):
            with Pipeline(buffer(), sample_count=8, device=device, backend=name) as pipe:
                assert pipe.device == torch.device("cpu")
    finally:
        unregister_backend("on-the-cpu")


class ReportsADevice(TransferBackend):
    """A backend by name that copies on the CPU and reports the device ``reports``:
    how the pipeline judges a device, with no GPU."""

    def __init__(self, device: torch.device, reports: str = "cuda") -> None:
        super().__init__(reports)

    def submit(self, order):  # type: ignore[no-untyped-def]
        self.copy_now(order.slot)
        self.on_complete(order.slot)

    def allocate(self, host_slots):  # type: ignore[no-untyped-def]
        from replay_fsm.transfer.base import allocate_like

        return allocate_like(host_slots, "cpu")


def test_a_device_without_an_index_is_the_current_one_of_its_type() -> None:
    """``Pipeline(device="cuda:0", backend=...)`` with a backend by name that reports
    "cuda" was refused ("copies to 'cuda', not to the device asked for, 'cuda:0'",
    1 of 1), where "cuda" asked of one that reports "cuda:0" was taken, and so was
    "cuda" of one that reports "cuda:1", another device than the current one. As
    torch has it, a device without an index is the current device of its type
    (cuda:0 until ``torch.cuda.set_device`` chose another, and on a machine with no
    CUDA): the same device is taken however it is written, another one refused."""
    now = torch.cuda.current_device() if torch.cuda.is_available() else 0
    register_backend("reports", ReportsADevice)
    try:
        for asked, reports in (("cuda", f"cuda:{now}"), (f"cuda:{now}", "cuda"),
                               ("cuda", "cuda")):
            with Pipeline(buffer(), sample_count=32, device=asked, backend="reports",
                          backend_options={"reports": reports}) as pipe:
                run(pipe, 3)
                assert pipe.device == torch.device(reports)
        other = f"cuda:{now + 1}"
        for asked, reports in (("cuda", other), (other, "cuda"), (f"cuda:{now}", other)):
            with pytest.raises(ValueError) as info:
                Pipeline(buffer(), sample_count=32, device=asked, backend="reports",
                         backend_options={"reports": reports})
            shown = f"'cuda' (now cuda:{now})" if asked == "cuda" else repr(asked)
            assert str(info.value) == (
                f"backend 'reports' copies to {reports!r}, not to the device asked for, "
                f"{shown}: leave device out, or name a backend that copies to {asked!r}")
    finally:
        unregister_backend("reports")


@pytest.mark.parametrize("reported", ["0", True, 0.0, None])
def test_a_completion_reported_with_something_other_than_the_slot_is_named(
        reported: object) -> None:
    """A backend that called ``on_complete("0")`` failed the run with the core's
    "'<=' not supported between instances of 'int' and 'str'", one that called
    ``on_complete(None)`` with an empty message (an AssertionError), and
    ``on_complete(True)`` completed slot 1. Each is named as the backend's wrong call;
    a numpy integer is a slot."""
    import numpy as np

    from replay_fsm.errors import PipelineFailed

    class Reports(TransferBackend):
        def __init__(self, what: Any) -> None:
            super().__init__()
            self.what = what

        def submit(self, order):  # type: ignore[no-untyped-def]
            self.copy_now(order.slot)
            self.on_complete(self.what(order.slot))

    with Pipeline(small_buffer(), sample_count=8, backend=Reports(lambda slot: reported),
                  learner_packs=False) as pipe:
        pipe.start_prepare(0, 8)
        with pytest.raises(PipelineFailed) as info:
            pipe.sample_large_batch(0, 8)
    assert isinstance(info.value.__cause__, TypeError)
    assert str(info.value.__cause__) == (
        f"the backend called on_complete with {reported!r} of type "
        f"{type(reported).__name__}; it takes the slot of the copy it completed, the int "
        "order.slot")
    with Pipeline(small_buffer(), sample_count=8, backend=Reports(np.int64),
                  learner_packs=False) as pipe:
        assert [tick for tick, _ in pipe.ticks(0, 3)] == [0, 1, 2]


class Allocates(TransferBackend):
    """A backend whose ``allocate`` gives what ``slots(host_slots)`` makes."""

    def __init__(self, slots: Any) -> None:
        super().__init__()
        self.slots = slots

    def allocate(self, host_slots):  # type: ignore[no-untyped-def]
        return self.slots(host_slots)

    def submit(self, order):  # type: ignore[no-untyped-def]
        self.copy_now(order.slot)
        self.on_complete(order.slot)


@pytest.mark.parametrize("slots, error, message", [
    (lambda host: None, TypeError, "Allocates.allocate returned None of type NoneType: it "
     "returns one tensor per host slot, shaped like it (a list, or one tensor of them)"),
    (lambda host: [torch.zeros(8, 11)], ValueError, "Allocates.allocate returned 1 device "
     "slots for 2 host slots: it returns one tensor per host slot, shaped like it"),
    (lambda host: [torch.zeros(8, 11), None], TypeError, "Allocates's device slot 1 is None "
     "of type NoneType, not a tensor: its allocate returns one tensor per host slot, "
     "shaped like it"),
    (lambda host: [torch.zeros(8, 11), torch.zeros(11, 8)], ValueError, "Allocates's "
     "device slot 1 has shape (11, 8), not its host slot's (8, 11): its allocate returns "
     "one tensor per host slot, shaped like it (as many rows; at least as many "
     "columns)"),
    (lambda host: [torch.zeros(8, 11), torch.zeros(8, 10)], ValueError, "Allocates's "
     "device slot 1 has shape (8, 10), not its host slot's (8, 11)"),
])
def test_device_slots_that_are_not_tensors_shaped_like_the_host_slots_are_named(
        slots: Any, error: type, message: str) -> None:
    """A backend whose ``allocate`` returned None made the constructor raise "'NoneType'
    object is not subscriptable" from the first view of a slot; one slot short, "list
    index out of range". Named as what allocate returned; nothing is left running."""
    before = set(threading.enumerate())
    with pytest.raises(error) as info:
        Pipeline(small_buffer(), sample_count=8, backend=Allocates(slots))
    assert str(info.value).startswith(message)
    assert not [t for t in set(threading.enumerate()) - before if t.is_alive()]
    with Pipeline(small_buffer(), sample_count=8,  # one tensor of the slots: a ring
                  backend=Allocates(lambda host: torch.zeros(2, 8, 11))) as pipe:
        assert [tick for tick, _ in pipe.ticks(0, 3)] == [0, 1, 2]


@pytest.mark.parametrize("hook", ["before_read", "after_read"])
def test_a_hook_set_on_a_backend_instance_is_called(hook: str) -> None:
    """The pipeline calls the read hooks and pump only where the backend overrides
    the base's no-ops (looked at once, for the learner's calls' cost); one set on
    the instance, not the class, was never called (helper-111's trim)."""
    from replay_fsm.transfer.cpu import CpuBackend

    backend, calls = CpuBackend(), []
    setattr(backend, hook, lambda *args: calls.append(args))
    rb = small_buffer()
    with Pipeline(rb, sample_count=8, backend=backend, collector="thread") as pipe:
        for _ in pipe.ticks(0, 3):
            pass
    assert [args[0] for args in calls] == [0, 1, 0]  # each tick's slot
    pumping = CpuBackend()
    pumping.pump = lambda: None  # type: ignore[method-assign]
    with Pipeline(rb, sample_count=8, backend=pumping) as pipe:
        assert pipe._pumps  # the learner's waits run it


class Padded(Allocates):
    """Device slots with rows wider than the host's (alignment), filled in their
    first columns."""

    def __init__(self) -> None:
        super().__init__(lambda host: [torch.zeros(h.shape[0], h.shape[1] + 5)
                                       for h in host])

    def submit(self, order):  # type: ignore[no-untyped-def]
        host = self.host[order.slot]
        self.device_slots[order.slot][:, :host.shape[1]].copy_(host)
        self.on_complete(order.slot)


def test_device_slots_with_wider_rows_are_taken() -> None:
    """A backend whose allocate pads its rows, and copies into their first columns,
    ran before device slots were checked, and was refused by that check (helper-116:
    1 of 1): the batch's views read only the host's columns."""
    from replay_fsm.sampling import expected_batch

    rb = small_buffer()
    with Pipeline(rb, sample_count=8, backend=Padded(), base_seed=7) as pipe:
        for tick, batch in pipe.ticks(0, 3):
            assert torch.equal(rb.layout.pack(batch),
                               expected_batch(rb.storage, rb.size, 8, 7 + tick))


def test_the_cuda_backend_refuses_a_device_of_another_type() -> None:
    """``backend="cuda"`` with ``device="cpu"``: torch's "Torch not compiled with CUDA
    enabled" here, and a silent cuda:0 on a machine with CUDA."""
    for device in ("cpu", "meta"):
        with pytest.raises(ValueError, match=f"^backend 'cuda' is for cuda\\[:N\\] devices "
                                             f"\\(ROCm's too\\), got device '{device}'$"):
            Pipeline(buffer(), sample_count=8, device=device, backend="cuda")


def test_the_cpu_backend_refuses_a_device_of_another_type() -> None:
    """``backend="cpu"`` with ``device="cuda"`` ran: ``pipe.device`` said cuda and the
    batches were on the CPU, for the learner's model on the GPU to trip on (helper-98)."""
    for device in ("cuda", "cuda:1", "meta"):
        with pytest.raises(ValueError, match=f"^backend 'cpu' is for device 'cpu', got "
                                             f"device '{device}'"):
            Pipeline(buffer(), sample_count=8, device=device, backend="cpu")


def test_a_backend_built_directly_names_a_device_torch_does_not_know() -> None:
    """As its docstring says (and as ``Pipeline(device=...)`` does): a ValueError, where
    the cpu and accel backends let torch's RuntimeError out (helper-98)."""
    from replay_fsm.transfer.accel import AcceleratorBackend
    from replay_fsm.transfer.cpu import CpuBackend

    for backend in (AcceleratorBackend, CpuBackend):
        with pytest.raises(ValueError, match="^unknown device 'nope'"):
            backend("nope")


def test_a_device_index_past_the_machines_devices_is_not_available(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine with one CUDA device (made up here), cuda:1 is refused before
    anything starts, and the error lists what the machine has; it was let through to
    fail later in torch ("invalid device ordinal")."""
    from replay_fsm.transfer import available_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert available_device("cuda:0") == torch.device("cuda", 0)
    assert available_device("cuda") == torch.device("cuda")
    with pytest.raises(ValueError, match=r"^device 'cuda:1' is not available on this "
                       r"machine; supported here: cpu, cuda \(cuda:0\)"):
        available_device("cuda:1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert available_device("cuda:3") == torch.device("cuda", 3)
    with pytest.raises(ValueError, match=r"supported here: cpu, cuda \(cuda:0 to cuda:3\)"):
        available_device("cuda:4")


def test_a_backend_whose_setup_fails_part_way_is_closed() -> None:
    """A backend's setup that raises after it took something (CUDA: the host slots
    page-locked, then out of memory for the device slots) is closed by the constructor
    that raised: nothing else would close it, and the host slots' memory is freed
    while still registered."""
    from replay_fsm.transfer.cpu import CpuBackend

    closed = []

    class HalfSetUp(CpuBackend):
        def setup(self, host_slots, on_complete, on_error):  # type: ignore[no-untyped-def]
            super().setup(host_slots, on_complete, on_error)
            raise MemoryError("no room for the device slots")

        def close(self) -> None:
            closed.append(True)

    with pytest.raises(MemoryError, match="no room"):
        Pipeline(buffer(), sample_count=8, backend=HalfSetUp())
    assert closed == [True]


def test_the_cuda_backend_unregisters_the_host_slots_when_its_setup_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """CudaBackend.setup registers the host slots (cudaHostRegister), then allocates
    the device slots: an out-of-memory there unregisters them (made-up CUDA here)."""
    import contextlib

    import replay_fsm.transfer.cuda as cuda

    registered: dict[int, int] = {}

    class Cudart:
        def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
            registered[ptr] = size
            return 0

        def cudaHostUnregister(self, ptr: int) -> int:
            return 0 if registered.pop(ptr, None) is not None else 713

    def out_of_memory(host_slots, device):  # type: ignore[no-untyped-def]
        raise torch.OutOfMemoryError("CUDA out of memory")

    for name, value in (("is_available", lambda: True), ("device_count", lambda: 1),
                        ("current_device", lambda: 0), ("cudart", Cudart),
                        ("device", lambda device: contextlib.nullcontext())):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(cuda, "allocate_like", out_of_memory)
    backend = cuda.CudaBackend("cuda")
    slots = [torch.zeros(4, 3).share_memory_() for _ in range(2)]
    with pytest.raises(torch.OutOfMemoryError):
        backend.setup(slots, lambda slot: None, lambda exc: None)
    assert registered == {} and backend.host_pinned is False
    with pytest.raises(torch.OutOfMemoryError):
        Pipeline(buffer(), sample_count=8, device="cuda")
    assert registered == {}


def test_a_failed_cudahostregister_is_named_and_undoes_the_slots_registered_before(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The second host slot's cudaHostRegister fails: the error gives the runtime's
    number and words, and the first slot is unregistered (made-up CUDA here)."""
    import contextlib

    import replay_fsm.transfer.cuda as cuda

    registered: dict[int, int] = {}

    class Cudart:
        cudaError = int

        def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
            if registered:
                return 712
            registered[ptr] = size
            return 0

        def cudaHostUnregister(self, ptr: int) -> int:
            return 0 if registered.pop(ptr, None) is not None else 713

        def cudaGetErrorString(self, err: int) -> str:
            return {712: "part or all of the requested memory range is already mapped"}[err]

    for name, value in (("is_available", lambda: True), ("device_count", lambda: 1),
                        ("current_device", lambda: 0), ("cudart", Cudart),
                        ("device", lambda device: contextlib.nullcontext())):
        monkeypatch.setattr(torch.cuda, name, value)
    backend = cuda.CudaBackend("cuda")
    slots = [torch.zeros(4, 3).share_memory_() for _ in range(2)]
    with pytest.raises(RuntimeError) as info:
        backend.setup(slots, lambda slot: None, lambda exc: None)
    assert str(info.value) == ("cudaHostRegister of the host slots failed: cudaError 712: "
                               "part or all of the requested memory range is already mapped")
    assert registered == {} and backend.host_pinned is False


def test_a_cuda_copy_that_raises_closes_its_nvtx_range(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """With timing on, submit pushes an NVTX range around the copy's submission; a
    copy_ that raised skipped the pop, so every later range nested in the dead one
    (helper-61; made-up CUDA here)."""
    import contextlib

    import replay_fsm.transfer.cuda as cuda
    from replay_fsm.wire import CopyOrder

    ranges: list[str] = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", ranges.append)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: ranges.pop())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())

    class Event:
        def record(self, stream: object = None) -> None:
            pass

    class Refused:
        def copy_(self, source: torch.Tensor, non_blocking: bool = False) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    backend = cuda.CudaBackend.__new__(cuda.CudaBackend)
    backend.timing, backend.monitor, backend.stream = True, None, None
    backend.host, backend.device_slots = [torch.zeros(2)], [Refused()]
    backend.started, backend.ready = [Event()], [Event()]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        backend.submit(CopyOrder(tick=0, slot=0, generation=0, after_release=None))
    assert ranges == []


def test_an_observer_sees_every_transition_and_span() -> None:
    class Log(Observer):
        def __init__(self) -> None:
            self.events: list[str] = []
            self.spans: list[str] = []

        def transition(self, record, time_ns):  # type: ignore[no-untyped-def]
            self.events.append(record.event.value)

        def span(self, name, actor, start_ns, end_ns, **args):  # type: ignore[no-untyped-def]
            assert end_ns >= start_ns
            self.spans.append(name)

    log = Log()
    with Pipeline(buffer(), sample_count=16) as pipe:
        pipe.add_observer(log)
        run(pipe, 4)
    cycle = ["request", "submit", "complete", "acquire", "release"]
    assert all(log.events.count(e) >= 4 for e in cycle)
    assert log.events[-2:] == ["close", "close"]
    assert log.spans.count("pack") == log.spans.count("copy") >= 4


def small_buffer() -> ReplayBuffer:
    rb = ReplayBuffer(256, 3, 2)
    rb.add_packed(torch.randn(256, rb.width))
    return rb


@pytest.mark.parametrize("hook", ["pump", "before_read", "after_read"])
def test_a_backend_hook_that_raises_fails_the_run_chained(hook: str) -> None:
    """The error escaped raw and the pipeline went on; after_read's left the tick HOT
    for ever ("tick 0 is still hot"; helper-48), before_read's let the next call hand
    out the batch without its read fence (helper-49). Now TransferFailed, sticky."""
    from replay_fsm.errors import TransferFailed
    from replay_fsm.transfer.cpu import CpuBackend

    boom = RuntimeError(f"{hook} is broken")

    class Broken(CpuBackend):
        def pump(self) -> None:
            if hook == "pump":
                raise boom

        def before_read(self, slot: int) -> None:
            if hook == "before_read":
                raise boom

        def after_read(self, slot: int) -> None:
            if hook == "after_read":
                raise boom

    with Pipeline(small_buffer(), sample_count=8, backend=Broken()) as pipe:
        pipe.start_prepare(0, 8)
        with pytest.raises(TransferFailed) as info:
            pipe.sample_large_batch(0, 8)
            pipe.after_tick()
        assert info.value.__cause__ is boom
        assert str(info.value) == f"the backend's {hook} raised RuntimeError: {hook} is broken"
        with pytest.raises(TransferFailed, match=f"the pipeline failed: the backend's "
                           f"{hook} raised"):  # sticky
            pipe.start_prepare(1, 8)


def watchdog_answering(liveness: Callable[[], object], check_alive: Callable[[], object]
                       ) -> Any:
    """A ``Watchdog`` (liveness_timeout 1 s) over a link whose ``liveness`` and a
    backend whose ``check_alive`` answer what ``liveness()`` and ``check_alive()``
    return, or raise what they raise."""
    from replay_fsm.runtime.liveness import Watchdog

    class Link:
        def liveness(self, waiting: bool, timeout: float) -> object:
            return liveness()

    class Backend:
        def check_alive(self) -> object:
            return check_alive()

    return Watchdog(1.0, Link(), Backend(), lambda: True, lambda: None)  # type: ignore[arg-type]


def test_a_liveness_or_check_alive_that_raises_is_a_verdict(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """They escaped raw from the wait, the pipeline unfailed (helper-48)."""
    from replay_fsm.errors import CollectorDied, TransferFailed
    from replay_fsm.spec import SlotState

    boom = OSError("no answer")

    def raise_boom() -> NoReturn:
        raise boom

    dog = watchdog_answering(raise_boom, raise_boom)
    died = dog.verdict(4, 0, SlotState.REQUESTED, 0.0)
    assert isinstance(died, CollectorDied) and died.__cause__ is boom
    assert str(died) == "tick 4: the collector link's liveness raised OSError: no answer"
    failed = dog.verdict(4, 0, SlotState.SUBMITTED, 0.0)
    assert isinstance(failed, TransferFailed) and failed.__cause__ is boom
    assert str(failed) == "tick 4: the backend's check_alive raised OSError: no answer"


@pytest.mark.parametrize("answer", [True, False, "gone", 0])
def test_a_liveness_or_check_alive_answer_of_the_wrong_type_is_named(answer: object) -> None:
    """A link's liveness that answered True or a str raised AttributeError ('bool'
    object has no attribute 'reason') out of the learner's wait, the run not failed;
    a backend's check_alive that answered True ("alive") failed the run as
    "TransferFailed: tick 5: True" (helper-106)."""
    from replay_fsm.errors import CollectorDied, TransferFailed
    from replay_fsm.spec import SlotState

    dog = watchdog_answering(lambda: answer, lambda: answer)
    died = dog.verdict(4, 0, SlotState.REQUESTED, 0.0)
    assert isinstance(died, CollectorDied)
    assert str(died) == (f"tick 4: the collector link's liveness returned {answer!r}; it "
                         "returns None while the other side can serve requests, else a "
                         "replay_fsm.runtime.links.Gone saying why not")
    failed = dog.verdict(4, 0, SlotState.SUBMITTED, 0.0)
    if isinstance(answer, str):  # check_alive's reason: the run fails with it
        assert isinstance(failed, TransferFailed) and str(failed) == "tick 4: gone"
        return
    assert isinstance(failed, TransferFailed)
    assert str(failed) == (f"tick 4: the backend's check_alive returned {answer!r}; it "
                           "returns None while the copy engine can complete copies, else "
                           "a non-empty str saying why not")


@pytest.mark.parametrize("blank", ["", "  \n"])
def test_a_liveness_or_check_alive_answer_that_says_nothing_is_named(blank: str) -> None:
    """A backend's check_alive that answered "" failed the run as "TransferFailed:
    tick 4: ", a link's liveness answering Gone("") as "CollectorDied: tick 4: ": a
    failure with no reason at all. Named as the wrong answers they are, as True is."""
    from replay_fsm.errors import CollectorDied, TransferFailed
    from replay_fsm.runtime.links import Gone
    from replay_fsm.spec import SlotState

    dog = watchdog_answering(lambda: Gone(blank), lambda: blank)
    died = dog.verdict(4, 0, SlotState.REQUESTED, 0.0)
    assert isinstance(died, CollectorDied)
    assert str(died) == (f"tick 4: the collector link's liveness returned Gone(reason="
                         f"{blank!r}, cause=None); it returns None while the other side "
                         "can serve requests, else a replay_fsm.runtime.links.Gone saying "
                         "why not")
    failed = dog.verdict(4, 0, SlotState.SUBMITTED, 0.0)
    assert isinstance(failed, TransferFailed)
    assert str(failed) == (f"tick 4: the backend's check_alive returned {blank!r}; it "
                           "returns None while the copy engine can complete copies, else "
                           "a non-empty str saying why not")


def test_a_gone_with_no_reason_keeps_its_cause_chained() -> None:
    """A link's Gone("", cause) failed the run as "tick 4: " with the cause chained;
    since 34c5f1b it is named as a wrong answer, and the cause, the one account of
    the death there is, was no longer chained (its traceback lost; helper-116)."""
    from replay_fsm.errors import CollectorDied
    from replay_fsm.runtime.links import Gone
    from replay_fsm.spec import SlotState

    cause = ConnectionResetError("the collector's socket closed")

    dog = watchdog_answering(lambda: Gone("", cause), lambda: None)
    died = dog.verdict(4, 0, SlotState.REQUESTED, 0.0)
    assert isinstance(died, CollectorDied)
    assert "liveness returned Gone(reason=''" in str(died)
    assert died.__cause__ is cause


def test_a_link_whose_liveness_answers_true_fails_the_run_as_collector_died() -> None:
    """Through a real pipeline: the learner's wait raised AttributeError, not the
    run's failure (helper-106)."""
    from replay_fsm.errors import CollectorDied
    from replay_fsm.runtime.links import ThreadCollector
    from replay_fsm.spec import SlotState

    class NeverStarts(ThreadCollector):
        def start(self, fail):  # type: ignore[no-untyped-def]
            pass  # no packer: the learner's wait asks liveness

        def liveness(self, waiting: bool, timeout: float) -> object:
            return True  # type: ignore[return-value]

    rb = small_buffer()
    with Pipeline(rb, sample_count=8, collector=NeverStarts(rb, 2, 8),
                  learner_packs=False) as pipe:
        with pytest.raises(CollectorDied, match="liveness returned True"):
            for _ in pipe.ticks(0, 2):
                pass
        assert set(pipe.states) == {SlotState.FAILED}  # the run failed, sticky


@pytest.mark.parametrize("where", ["backend close", "link stop"])
def test_a_close_hook_that_raises_does_not_stop_close_halfway(
        where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend's close that raised left the slots held and every later close
    raising again; a link's stop that raised left the transfer worker running and the
    backend open (helper-48). Close runs every step, then raises the error once."""
    from replay_fsm.transfer.cpu import CpuBackend

    boom = RuntimeError(f"{where} is broken")
    released = []

    class Backend(CpuBackend):
        def close(self) -> None:
            if where == "backend close":
                raise boom

        def release_slots(self) -> None:
            released.append(True)

    pipe = Pipeline(small_buffer(), sample_count=8, backend=Backend(), collector="thread")
    if where == "link stop":
        real = pipe._link.stop

        def stop(timeout: float) -> list[str]:
            real(timeout)
            raise boom

        monkeypatch.setattr(pipe._link, "stop", stop)
    assert pipe._worker.is_alive()
    with pytest.raises(RuntimeError) as info:
        pipe.close()
    assert info.value is boom
    assert released == [True] and not pipe._worker.is_alive()
    pipe.close()  # closed: nothing raised again
    assert pipe.closed


@pytest.mark.parametrize("call", ["after_tick", "wait_until_ready", "batch_ready"])
def test_an_observer_that_calls_back_into_the_pipeline_is_refused(call: str) -> None:
    """The lock is re-entrant: an after_tick from an observer of the ACQUIRE released
    the batch being acquired (its views then refilled); a wait from an observer of a
    REQUEST waited for a request not sent yet, for ever (helper-48). The call raises
    ProtocolError, which fails the run as an observer's error does."""
    from replay_fsm.errors import PipelineFailed, ProtocolError
    from replay_fsm.spec import Event

    class CallsBack(Observer):
        def transition(self, record, time_ns):  # type: ignore[no-untyped-def]
            if record.event is (Event.ACQUIRE if call == "after_tick" else Event.REQUEST):
                if call == "after_tick":
                    pipe.after_tick()
                else:
                    getattr(pipe, call)(record.tick, 8)

    with Pipeline(small_buffer(), sample_count=8, backend="emulated") as pipe:
        pipe.add_observer(CallsBack())
        with pytest.raises(PipelineFailed) as info:
            pipe.start_prepare(0, 8)
            pipe.sample_large_batch(0, 8)
            pipe.start_prepare(1, 8)  # the step observed completes; the next call raises
        cause = info.value.__cause__
        assert isinstance(cause, ProtocolError), info.value
        assert str(cause) == (f"{call} called from inside an observer: observers run "
                              "within a step of the pipeline and must not call back into it")


def test_a_pump_that_raises_on_a_pipeline_failed_or_closed_raises_what_that_does() -> None:
    """batch_ready pumps before it looks at the pipeline: its error became a new
    TransferFailed after close (not PipelineClosed) and after fail(X) (not X's;
    INV-STICKY; helper-49)."""
    from replay_fsm.errors import PipelineClosed, PipelineFailed
    from replay_fsm.transfer.cpu import CpuBackend

    class Broken(CpuBackend):
        def pump(self) -> None:
            raise RuntimeError("pump is broken")

    pipe = Pipeline(small_buffer(), sample_count=8, backend=Broken())
    mine = RuntimeError("the learner's own reason")
    pipe.fail(mine)
    with pytest.raises(PipelineFailed) as info:
        pipe.batch_ready(0, 8)
    assert info.value.__cause__ is mine
    pipe.close()
    closed = Pipeline(small_buffer(), sample_count=8, backend=Broken())
    closed.close()
    with pytest.raises(PipelineClosed):
        closed.batch_ready(0, 8)


def test_an_observer_that_raises_at_close_makes_close_raise() -> None:
    """Its error was swallowed: a closed core takes no failure, and close returned
    None (helper-48)."""
    from replay_fsm.spec import Event

    boom = RuntimeError("observer broken at close")

    class RaisesAtClose(Observer):
        def transition(self, record, time_ns):  # type: ignore[no-untyped-def]
            if record.event is Event.CLOSE:
                raise boom

    pipe = Pipeline(small_buffer(), sample_count=8, backend="emulated")
    pipe.add_observer(RaisesAtClose())
    with pytest.raises(RuntimeError) as info:
        pipe.close()
    assert info.value is boom
    pipe.close()  # closed: once


class SubmitOnly(TransferBackend):
    """What the README says a backend needs: ``submit`` alone, no ``__init__``."""

    def submit(self, order):  # type: ignore[no-untyped-def]
        self.copy_now(order.slot)
        self.on_complete(order.slot)


def test_a_backend_that_writes_only_submit_runs_as_an_instance_and_by_name() -> None:
    """The base keeps the device it is given ("cpu" by default): a backend of only
    ``submit`` raised AttributeError ('SubmitOnly' object has no attribute 'device')
    in Pipeline(), as an instance and by a registered name."""
    with Pipeline(buffer(), sample_count=32, backend=SubmitOnly()) as pipe:
        run(pipe, 5)
        assert pipe.device == torch.device("cpu")
    register_backend("submit-only", SubmitOnly)
    try:
        with Pipeline(buffer(), sample_count=32, backend="submit-only") as pipe:
            run(pipe, 5)
    finally:
        unregister_backend("submit-only")
    with pytest.raises(ValueError, match="unknown device 'nowhere'"):
        SubmitOnly("nowhere")
