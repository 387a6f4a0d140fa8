"""Driving a Pipeline in tests: complete manual copies as the learner needs them."""

from __future__ import annotations

import torch

from replay_fsm.data.sampling import expected_batch
from replay_fsm.runtime.pipeline import Pipeline


def complete_copies_for(pipe: Pipeline, tick: int) -> None:
    """Manual backend: complete the copy of ``tick`` (and any older pending copy)."""
    backend = pipe.backend
    if backend.name != "manual":
        return
    slot = pipe.slot_of(tick)
    assert slot is not None, f"tick {tick} not requested"
    if pipe.batch_ready(tick, pipe.sample_count):
        return
    assert backend.wait_submitted(slot, timeout=30), f"copy of tick {tick} never submitted"  # type: ignore[attr-defined]
    backend.complete(slot)  # type: ignore[attr-defined]


def reference(pipe: Pipeline, tick: int) -> torch.Tensor:
    """The INV-DATA batch of ``tick`` given the snapshot its packer used."""
    done = pipe.pack_record(tick)
    assert done.tick == tick
    return expected_batch(pipe.replay_buffer.storage, done.snapshot_size,
                          pipe.sample_count, pipe.base_seed + tick)


def packed(batch: dict[str, torch.Tensor], pipe: Pipeline) -> torch.Tensor:
    """Reassemble the packed rows from a batch dict, on the CPU."""
    return pipe.replay_buffer.layout.pack(batch)


def run_ticks(pipe: Pipeline, start: int, stop: int) -> int:
    """Request/sample/release ticks in a seed-style loop, checking INV-DATA each tick."""
    n = pipe.sample_count
    pipe.start_prepare(start, n)
    for tick in range(start, stop):
        complete_copies_for(pipe, tick)
        batch = pipe.sample_large_batch(tick, n)
        if tick + 1 < stop:
            pipe.start_prepare(tick + 1, n)
        got = packed(batch, pipe)
        assert torch.equal(got, reference(pipe, tick)), f"INV-DATA broken at tick {tick}"
        pipe.after_tick()
    return stop - start
