"""The wire codecs: int records round-trip every message, field counts come from the
dataclasses, and the seed's dicts round-trip the fields they carry."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from replay_fsm.wire import (
    DONE_FIELDS,
    REQUEST_FIELDS,
    PackDone,
    PackRequest,
    decode,
    encode,
    int_fields,
)

i64 = st.integers(-(2**63), 2**63 - 1)


@given(st.builds(PackRequest, tick=i64, slot=i64, generation=i64, seed=i64,
                 sample_count=i64, min_snapshot_ptr=i64))
def test_request_round_trips_as_an_int_record(request: PackRequest) -> None:
    values, text = encode(request)
    assert len(values) == REQUEST_FIELDS and text is None
    assert decode(PackRequest, values) == request


@given(st.builds(PackDone, tick=i64, slot=i64, generation=i64, seed=i64,
                 sample_count=i64, snapshot_ptr=i64, snapshot_size=i64,
                 pack_start_ns=i64, pack_end_ns=i64,
                 error=st.none() | st.text(max_size=50)))
def test_done_round_trips_with_its_error_text(done: PackDone) -> None:
    values, text = encode(done)
    assert len(values) == DONE_FIELDS and text == done.error
    assert decode(PackDone, values, text) == done


def test_field_counts_follow_the_dataclasses() -> None:
    assert int_fields(PackRequest) == ("tick", "slot", "generation", "seed",
                                       "sample_count", "min_snapshot_ptr")
    assert DONE_FIELDS == len(int_fields(PackDone)) == 9
    with pytest.raises(ValueError, match="6 fields, got 5"):
        decode(PackRequest, [1, 2, 3, 4, 5])


def test_seed_dicts_round_trip() -> None:
    done = PackDone(tick=3, slot=1, generation=2, seed=10, sample_count=64,
                    snapshot_ptr=100, snapshot_size=90, pack_start_ns=5, pack_end_ns=9)
    assert PackDone.from_seed_dict(done.to_seed_dict()) == done
    request = PackRequest(tick=3, slot=1, generation=2, seed=10, sample_count=64,
                          min_snapshot_ptr=-1)
    d = request.to_seed_dict(snapshot_ptr=100, snapshot_size=90, learner_hot_slot=0)
    assert PackRequest.from_seed_dict(d) == request


# The seed's formats, key for key (seed/000_*.txt: the request its learner sends, the
# ready dict its collector answers with); a collector written for the seed reads them.
SEED_REQUEST = {"tick_id": 3, "snapshot_ptr": 100, "snapshot_size": 90,
                "min_snapshot_ptr": 7, "sample_seed": 10, "sample_count": 64,
                "shared_slot": 1, "learner_hot_gpu_slot": 0, "target_gpu_slot": 1,
                "pack_layout": "packed", "pack_executor": "collector_thread"}
SEED_READY = {"tick_id": 3, "snapshot_ptr": 100, "snapshot_size": 90, "sample_seed": 10,
              "sample_count": 64, "shared_slot": 1, "target_gpu_slot": 1}


def test_request_dict_is_the_seeds_format() -> None:
    """Every key the seed's learner sends, with its value, plus our generation. Kills
    the key mutants of replay_fsm.wire.xǁPackRequestǁto_seed_dict (each was a hang
    of the seed-style collector in test_compat before)."""
    request = PackRequest(tick=3, slot=1, generation=2, seed=10, sample_count=64,
                          min_snapshot_ptr=7)
    assert request.to_seed_dict(snapshot_ptr=100, snapshot_size=90, learner_hot_slot=0) == {
        **SEED_REQUEST, "generation": 2}


def test_dicts_the_seed_writes_decode_without_a_generation() -> None:
    """The seed's dicts carry no generation: it decodes as -1, "unknown", which the
    core's submit guard does not compare. Kills the default-value mutants of
    xǁPackRequestǁfrom_seed_dict and xǁPackDoneǁfrom_seed_dict."""
    assert PackRequest.from_seed_dict(SEED_REQUEST) == PackRequest(
        tick=3, slot=1, generation=-1, seed=10, sample_count=64, min_snapshot_ptr=7)
    assert PackDone.from_seed_dict(SEED_READY) == PackDone(
        tick=3, slot=1, generation=-1, seed=10, sample_count=64, snapshot_ptr=100,
        snapshot_size=90, pack_start_ns=0, pack_end_ns=0, error=None)


def test_a_ready_dict_must_name_one_slot() -> None:
    """The seed's own check: the host slot packed is the device slot it goes to."""
    with pytest.raises(ValueError, match="ready message for tick 3: shared_slot 1 must "
                                         "equal target_gpu_slot 0"):
        PackDone.from_seed_dict({**SEED_READY, "target_gpu_slot": 0})


def test_a_ready_dict_carries_a_packers_error() -> None:
    """A seed-style collector reports a failed pack with an "error" key; its text
    becomes the PackDone's error (the pipeline then fails with PackerError). Kills
    xǁPackDoneǁfrom_seed_dict mutants 24 and 78-80."""
    assert PackDone.from_seed_dict({**SEED_READY, "error": "Traceback: disk"}).error == (
        "Traceback: disk")
