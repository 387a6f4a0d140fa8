"""Shared-memory tensors that cannot fit are refused up front, by name and size."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from replay_fsm import ReplayBuffer
from replay_fsm.data import shared
from replay_fsm.data.packer import PackerHandle


def shm_with_free(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    monkeypatch.setattr(shared.os, "statvfs",
                        lambda path: SimpleNamespace(f_bavail=free // 4096, f_frsize=4096))


def test_a_buffer_larger_than_dev_shm_is_refused_by_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A container's 64 MB /dev/shm and a 1000-row buffer of 11 floats (44000 B) fit;
    with 40 KiB free it is refused before anything is allocated."""
    shm_with_free(monkeypatch, 64 << 20)
    assert ReplayBuffer(1000, 3, 2).storage.shape == (1000, 11)
    shm_with_free(monkeypatch, 40 << 10)
    with pytest.raises(MemoryError) as info:
        ReplayBuffer(1000, 3, 2)
    assert str(info.value) == (
        "a replay buffer of 1000 rows needs 43.0 KiB of shared memory, more than the free "
        "space of /dev/shm (40.0 KiB): make it smaller, or give the machine more (a "
        "container's /dev/shm: docker run --shm-size)")


def test_host_slots_that_do_not_fit_are_refused_by_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    shm_with_free(monkeypatch, 1 << 20)
    with pytest.raises(MemoryError, match=r"^host slot 0 of 65536 rows needs 2\.8 MiB"):
        PackerHandle.create(2, 65536, 11)


def test_the_machine_memory_bounds_it_where_dev_shm_is_missing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(path: str) -> None:
        raise FileNotFoundError(path)

    monkeypatch.setattr(shared.os, "statvfs", missing)
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with pytest.raises(MemoryError, match="more than the machine's memory"):
        shared.shared_zeros(ram // 4 + 1, what="too much")
    assert shared.shared_zeros(2, 3, what="a little").is_shared()


def test_the_allocators_refusal_is_a_memory_error_that_names_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the checks (another process took the room meanwhile), torch's own refusal
    still comes back as a MemoryError naming what was asked for."""
    def refuse(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        raise RuntimeError("unable to write to file </torch_1_2>: No space left on device")

    monkeypatch.setattr(shared.torch, "zeros", refuse)
    with pytest.raises(MemoryError) as info:
        shared.shared_zeros(4, 4, what="a test tensor")
    assert str(info.value).startswith("a test tensor: 64 B of shared memory could not be "
                                      "allocated: unable to write to file")
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.parametrize("nbytes,text", [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"),
                                         (3 << 20, "3.0 MiB"), (5 << 30, "5.0 GiB")])
def test_sizes_read_in_binary_units(nbytes: int, text: str) -> None:
    assert shared._size(nbytes) == text


def test_another_allocator_error_stays_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a lack of room becomes a MemoryError: too many open files (a file
    descriptor per shared tensor) is not one, and keeps torch's error."""
    def refuse(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        raise RuntimeError("unable to open shared memory object: Too many open files (24)")

    monkeypatch.setattr(shared.torch, "zeros", refuse)
    with pytest.raises(RuntimeError, match="Too many open files"):
        shared.shared_zeros(4, 4, what="a test tensor")
