"""The int-record codec: records round-trip every message, field counts come from the
dataclasses. The seed's dicts: tests/test_compat_wire.py."""

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

