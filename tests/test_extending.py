"""Extending the library from outside the package: a backend written in a user's own
file, passed as an instance or registered by name, and an observer of transitions."""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from replay_fsm import Pipeline, ReplayBuffer
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


def test_the_cuda_backend_refuses_a_device_of_another_type() -> None:
    """``backend="cuda"`` with ``device="cpu"``: torch's "Torch not compiled with CUDA
    enabled" here, and a silent cuda:0 on a machine with CUDA."""
    for device in ("cpu", "meta"):
        with pytest.raises(ValueError, match=f"^backend 'cuda' is for cuda\\[:N\\] devices "
                                             f"\\(ROCm's too\\), got device '{device}'$"):
            Pipeline(buffer(), sample_count=8, device=device, backend="cuda")


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
