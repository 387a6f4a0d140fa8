"""The compat layer's parts one at a time: the errors a seed user catches, the view of
either replay buffer, the backend built per device. ``test_compat_behaviour.py`` drives
them through the compat class; here each edge is pinned where it is decided."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from replay_fsm import errors
from replay_fsm.compat import errors as seed_errors
from replay_fsm.compat.buffer import ReplayBufferView
from replay_fsm.compat.transfer import build_backend_for
from replay_fsm.data.buffer import Layout, ReplayBuffer
from replay_fsm.transfer.cpu import CpuBackend

from .collectors import SeedStyleBuffer


def no_span(slot: int) -> None:
    return None


# -- as_seed_error -----------------------------------------------------------------

@pytest.mark.parametrize(("ours", "theirs"), [
    (errors.PipelineFailed, seed_errors.PipelineFailed),
    (errors.CollectorDied, seed_errors.CollectorDied),
    (errors.TransferFailed, seed_errors.TransferFailed),
])
def test_a_failure_replay_fsm_detected_comes_as_the_compat_class_of_its_kind(
        ours: type[errors.PipelineFailed], theirs: type[BaseException]) -> None:
    cause = OSError("the pipe broke")
    failure = ours("tick 4: what went wrong")
    failure.__cause__ = cause
    seen = seed_errors.as_seed_error(failure)
    assert type(seen) is theirs and isinstance(seen, RuntimeError)
    assert str(seen) == "tick 4: what went wrong" and seen.__cause__ is cause
    renamed = seed_errors.as_seed_error(failure, "tick 3: what went wrong")
    assert type(renamed) is theirs and str(renamed) == "tick 3: what went wrong"
    assert renamed.__cause__ is cause


def test_any_other_error_is_raised_as_it_was() -> None:
    failure = KeyError("tick_id")
    assert seed_errors.as_seed_error(failure) is failure
    assert seed_errors.as_seed_error(failure, "ignored") is failure


# -- ReplayBufferView --------------------------------------------------------------

class Partial:
    """A seed-style buffer with some of its parts replaced."""

    def __init__(self, **parts: Any) -> None:
        rb = SeedStyleBuffer(16, 2, 1)
        self._storage, self.ptr, self.size = rb._storage, rb.ptr, rb.size
        self._packed_cpu_storage = True
        for name, value in parts.items():
            if value is None:
                delattr(self, name)
            else:
                setattr(self, name, value)


@pytest.mark.parametrize("missing", ["_storage", "ptr", "size"])
def test_a_buffer_missing_a_counter_or_its_rows_is_refused_by_name(missing: str) -> None:
    with pytest.raises(TypeError, match=r"^replay_buffer must be a replay_fsm.ReplayBuffer "
                       r"or a seed-style buffer \(UniLab's ReplayBuffer: rows in _storage, "
                       r"one-element ptr and size tensors\), got Partial$"):
        ReplayBufferView(Partial(**{missing: None}))
    with pytest.raises(TypeError, match="got Partial$"):
        ReplayBufferView(Partial(**{missing: [0]}))  # there, but not a tensor


def test_a_seed_style_buffer_without_the_packed_flag_gets_the_seeds_value_error() -> None:
    for flag in (None, False):  # absent, or false
        with pytest.raises(ValueError, match=r"^pack_layout='packed' requires "
                           r"ReplayBuffer\(packed_cpu_storage=True\)$"):
            ReplayBufferView(Partial(_packed_cpu_storage=flag))


def test_a_seed_style_buffer_without_critic_columns_has_none_in_its_layout() -> None:
    rb = SeedStyleBuffer(16, 2, 1)  # critic_dim=0: UniLab sets no _critic_sl then
    assert not hasattr(rb, "_critic_sl")
    view = ReplayBufferView(rb)
    assert view.layout == Layout.build(2, 1, 0)
    assert view.layout.critic is None and view.layout.next_critic is None


def test_the_view_of_our_buffer_is_the_buffer_itself() -> None:
    rb = ReplayBuffer(16, 2, 1)
    view = ReplayBufferView(rb)
    assert view.storage is rb.storage and view.layout is rb.layout
    rb.add_packed(torch.ones(5, rb.layout.width))
    assert (view.ptr, view.size) == (5, 5)


# -- build_backend_for -------------------------------------------------------------

def test_the_cpu_gets_a_copying_cpu_backend() -> None:
    backend = build_backend_for(torch.device("cpu"), no_span)
    assert type(backend) is CpuBackend and backend.copy
    assert backend.device == torch.device("cpu")


@pytest.mark.parametrize("device", ["mps", "xpu"])
def test_another_device_gets_the_default_backend_of_that_device(device: str) -> None:
    if getattr(torch, device).is_available():
        pytest.skip(f"{device} is available here")
    # build_backend's own refusal, naming the device (not the CUDA backend's)
    with pytest.raises(ValueError, match=f"^device '{device}' is not available on this "
                       "machine"):
        build_backend_for(torch.device(device), no_span)
