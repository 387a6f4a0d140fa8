"""The seed's dicts: the request a seed-style collector reads, the ready dict it writes,
read with the seed's errors."""

from __future__ import annotations

import pytest

from replay_fsm.wire import SeedReady, SeedRequest

READY = {"tick_id": 7, "snapshot_ptr": 120, "snapshot_size": 100, "sample_seed": 12,
         "sample_count": 8, "shared_slot": 1, "target_gpu_slot": 1,
         "learner_hot_gpu_slot": 0, "pack_layout": "packed",
         "pack_executor": "collector_thread", "pack_begin_ns": 5, "pack_end_ns": 9}


def test_a_request_is_the_seeds_dict_key_for_key_in_its_order() -> None:
    d = SeedRequest(tick_id=7, snapshot_ptr=120, snapshot_size=100, min_snapshot_ptr=128,
                    sample_seed=12, sample_count=8, shared_slot=1, learner_hot_gpu_slot=0,
                    target_gpu_slot=1).to_dict()
    assert list(d.items()) == [
        ("tick_id", 7), ("snapshot_ptr", 120), ("snapshot_size", 100),
        ("min_snapshot_ptr", 128), ("sample_seed", 12), ("sample_count", 8),
        ("shared_slot", 1), ("learner_hot_gpu_slot", 0), ("target_gpu_slot", 1),
        ("pack_layout", "packed"), ("pack_executor", "collector_thread")]


def test_a_ready_dict_is_read_as_the_seed_read_it() -> None:
    ready = SeedReady.from_dict(READY)
    assert ready == SeedReady(tick_id=7, snapshot_ptr=120, snapshot_size=100, sample_seed=12,
                              sample_count=8, shared_slot=1, target_gpu_slot=1,
                              pack_begin_ns=5, pack_end_ns=9)
    bare = {k: v for k, v in READY.items() if not k.endswith("_ns")}
    assert (SeedReady.from_dict(bare).pack_begin_ns, SeedReady.from_dict(bare).pack_end_ns) == (
        0, 0)


@pytest.mark.parametrize("missing", ["tick_id", "snapshot_size", "target_gpu_slot"])
def test_a_ready_dict_without_a_key_the_seed_reads_raises_its_key_error(missing: str
                                                                        ) -> None:
    with pytest.raises(KeyError, match=missing):
        SeedReady.from_dict({k: v for k, v in READY.items() if k != missing})


def test_a_ready_dict_whose_slots_differ_raises_the_seeds_runtime_error() -> None:
    with pytest.raises(RuntimeError, match="^collector_thread shared slot must match "
                       "target GPU slot$"):
        SeedReady.from_dict({**READY, "shared_slot": 0})
    with pytest.raises(ValueError):
        SeedReady.from_dict({**READY, "tick_id": "seven"})


@pytest.mark.parametrize("value", [None, "n/a", float("nan"), float("inf")])
def test_a_ready_dict_pack_timestamp_the_seed_never_read_may_be_anything(value: object
                                                                         ) -> None:
    ready = SeedReady.from_dict({**READY, "pack_begin_ns": value, "pack_end_ns": value})
    assert (ready.tick_id, ready.pack_begin_ns, ready.pack_end_ns) == (7, 0, 0)
