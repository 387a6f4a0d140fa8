"""The sampling contract (INV-DATA), the packer, its channels and process mode."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from replay_fsm.data.buffer import ReplayBuffer
from replay_fsm.data.channel import Channel, ChannelClosed
from replay_fsm.data.packer import Packer, PackerHandle
from replay_fsm.data.sampling import expected_batch, sample_indices
from replay_fsm.wire import PackDone, PackRequest, decode, encode

from .collectors import constant_rows, fill_and_serve, serve


@given(size=st.integers(1, 10_000), n=st.integers(1, 300), seed=st.integers(0, 2**40))
def test_sampling_contract_is_torch_randint_with_a_seeded_generator(
        size: int, n: int, seed: int) -> None:
    """INV-DATA: exactly torch.randint with Generator().manual_seed(base_seed + tick)."""
    ref = torch.randint(0, size, (n,), generator=torch.Generator().manual_seed(seed))
    assert torch.equal(sample_indices(size, n, seed), ref)
    out, gen = torch.empty(n, dtype=torch.int64), torch.Generator()
    sample_indices(size + 1, n, seed + 1, out=out, generator=gen)  # dirty the reused state
    assert torch.equal(sample_indices(size, n, seed, out=out, generator=gen), ref)


def test_empty_buffer_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="empty replay buffer"):
        sample_indices(0, 4, 0)


def request(tick: int, slot: int, n: int, *, min_ptr: int = -1, seed: int | None = None
            ) -> list[int]:
    return encode(PackRequest(tick=tick, slot=slot, generation=1,
                                      seed=tick if seed is None else seed,
                                      sample_count=n, min_snapshot_ptr=min_ptr))[0]


def make(rows: int = 100, n: int = 32, depth: int = 2) -> tuple[ReplayBuffer, PackerHandle]:
    rb = ReplayBuffer(256, 4, 2, region_rows=16)
    if rows:
        rb.add_packed(constant_rows(rb, 1, rows))
    return rb, PackerHandle.create(depth, n, rb.width)


def test_packer_fills_the_slot_bit_exact() -> None:
    rb, h = make()
    packer = Packer(h, rb)
    for tick in range(5):
        h.requests.put(request(tick, tick % 2, 32, seed=1000 + tick))
        assert packer.service(timeout=1.0)
        got = h.done.get(timeout=1.0)
        assert got is not None
        done = decode(PackDone, *got)
        assert (done.tick, done.slot, done.snapshot_size, done.error) == (tick, tick % 2,
                                                                          100, None)
        assert torch.equal(h.host_slots[tick % 2],
                           expected_batch(rb.storage, 100, 32, 1000 + tick))


def test_min_snapshot_ptr_keeps_the_request_pending() -> None:
    rb, h = make(rows=10)
    packer = Packer(h, rb)
    h.requests.put(request(0, 0, 32, min_ptr=50))
    assert not packer.service(timeout=0.0)
    assert not packer.service(timeout=0.0)  # still pending, not lost
    rb.add_packed(constant_rows(rb, 11, 40))
    assert packer.service(timeout=0.0)
    done = decode(PackDone, *h.done.get(timeout=1.0))  # type: ignore[misc]
    assert (done.snapshot_ptr, done.snapshot_size) == (50, 50)
    assert torch.equal(h.host_slots[0], expected_batch(rb.storage, 50, 32, 0))


def test_packing_error_is_sent_back_with_its_traceback() -> None:
    rb, h = make(rows=0)
    packer = Packer(h, rb)
    h.requests.put(request(3, 1, 32))
    assert packer.service(timeout=1.0)  # served: the failure is its answer
    assert packer.packed_count == 0
    done = decode(PackDone, *h.done.get(timeout=1.0))  # type: ignore[misc]
    assert done.tick == 3 and done.error is not None
    assert "Traceback" in done.error and "empty replay buffer" in done.error


def test_channel_is_bounded_and_loses_nothing() -> None:
    ch = Channel(3, 2, text_bytes=8)
    for k in range(3):
        assert ch.put([k, -k], text=None if k % 2 else f"m{k}")
    assert not ch.put([9, 9], timeout=0.01)  # full
    got = [ch.get(timeout=1) for _ in range(3)]
    assert got == [([0, 0], "m0"), ([1, -1], None), ([2, -2], "m2")]
    assert ch.get(timeout=0.01) is None
    ch.close()
    with pytest.raises(ChannelClosed):
        ch.put([1, 1])
    with pytest.raises(ChannelClosed):
        ch.get(timeout=1)


def test_process_mode_with_spawn_end_to_end() -> None:
    rb, h = make(rows=0, n=64, depth=3)
    proc = mp.get_context("spawn").Process(target=fill_and_serve, args=(h, rb, 200))
    proc.start()
    try:
        for tick in range(6):
            h.requests.put(request(tick, tick % 3, 64, min_ptr=200), timeout=30)
            got = h.done.get(timeout=60)
            assert got is not None
            done = decode(PackDone, *got)
            assert done.error is None and done.snapshot_size == 200
            assert torch.equal(h.host_slots[tick % 3],
                               expected_batch(rb.storage, 200, 64, tick))
        assert h.packer_pid == proc.pid and h.heartbeat_ns > 0
    finally:
        h.close()
        proc.join(30)
    assert proc.exitcode == 0


def test_attach_to_a_spawned_collector_serving_a_count() -> None:
    rb, h = make(rows=100, n=16)
    proc = mp.get_context("spawn").Process(target=serve, args=(h, rb, 2))
    proc.start()
    for tick in range(2):
        h.requests.put(request(tick, tick, 16), timeout=30)
        assert decode(PackDone, *h.done.get(timeout=60)).error is None  # type: ignore[misc]
    proc.join(30)
    assert proc.exitcode == 0


def test_an_idle_packer_draws_the_next_ticks_indices_ahead() -> None:
    """Index drawing off the critical path: while idle, the packer draws the next
    tick's indices (seed + 1, current size); the pack uses them only when the request
    matches, so every batch is still INV-DATA's, hit or miss."""
    rb, h = make(rows=100)
    packer = Packer(h, rb)
    for tick in range(6):
        assert packer.service(timeout=0.01) is False  # idle: draws ahead (not at 0)
        if tick == 3:
            rb.add_packed(constant_rows(rb, 500, 7))  # the size moved since: a miss
        h.requests.put(request(tick, tick % 2, 32, seed=1000 + tick))
        assert packer.service(timeout=1.0)
        done = decode(PackDone, *h.done.get(timeout=1.0))  # type: ignore[misc]
        assert torch.equal(h.host_slots[tick % 2],
                           expected_batch(rb.storage, done.snapshot_size, 32, 1000 + tick))
    # tick 0 had no previous seed and tick 3 saw the size change: 4 drawn ahead
    assert packer.drawn_ahead == 4
