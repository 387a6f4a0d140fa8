"""The looks' clock (``replay_fsm/looks.LookClock``) that every liveness verdict's
stretch runs on: a stretch between two looks counts in full up to the cap, and for the cap
beyond it; an instant is placed on it no further than the cap from the last look."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from replay_fsm.looks import LookClock

S = 1_000_000_000


def test_a_stretch_counts_in_full_up_to_the_cap_and_for_the_cap_beyond() -> None:
    clock = LookClock(2.0)
    assert clock.look(real_ns=100 * S) == 0  # the first look: the clock starts
    assert clock.look(real_ns=101 * S) == S
    assert clock.look(real_ns=103 * S) == 3 * S  # exactly the cap: in full
    assert clock.look(real_ns=3703 * S) == 5 * S  # an hour: the cap
    assert clock.look(cap_s=0.5, real_ns=3713 * S) == 5 * S + S // 2  # a new cap
    assert clock.look(real_ns=3714 * S) == 6 * S  # kept


def test_a_look_that_read_the_clock_before_the_last_adds_nothing() -> None:
    """Looks come from more than one thread: one may read the monotonic clock before
    another's look that read it later."""
    clock = LookClock(2.0)
    clock.look(real_ns=10 * S)
    assert clock.look(real_ns=11 * S) == S
    assert clock.look(real_ns=10 * S + 1) == S
    assert clock.look(real_ns=12 * S) == 2 * S  # from the latest instant read


def test_an_instant_is_placed_no_further_than_the_cap_from_the_last_look() -> None:
    clock = LookClock(2.0)
    assert clock.at(50 * S) == 0  # before any look: the clock starts there
    assert clock.look(real_ns=51 * S) == S
    assert clock.at(51 * S + 5) == S + 5  # after the last look, within the cap: exact
    assert clock.at(50 * S) == 0  # before it, within the cap: exact
    assert clock.at(40 * S) == -S  # long before it (a beat found only now): the cap
    assert clock.at(90 * S) == 3 * S  # long after it: the cap


@pytest.mark.parametrize("cap", [0, -1.0, math.nan])
def test_a_cap_that_is_not_positive_seconds_is_refused(cap: float) -> None:
    with pytest.raises(ValueError, match="a look clock's cap must be positive seconds"):
        LookClock(cap)
    clock = LookClock()
    with pytest.raises(ValueError, match="a look clock's cap must be positive seconds"):
        clock.look(cap_s=cap)


@pytest.mark.parametrize("cap", [1e-10, 1.5e-9])
def test_a_cap_under_a_nanosecond_still_lets_the_clock_run(cap: float) -> None:
    """A bound is any positive seconds (``as_seconds``): one under 2 ns made a cap of
    0 ns, the clock stood still, and no verdict on it ever came (a copy that never
    completes, liveness_timeout=1e-9, waited for ever)."""
    clock = LookClock(cap)
    clock.look(real_ns=10 * S)
    assert clock.look(real_ns=11 * S) >= 1


@given(st.integers(1, 10**10), st.lists(st.integers(0, 10**10), max_size=30))
def test_the_clock_is_the_sum_of_the_capped_stretches(cap_ns: int, gaps: list[int]
                                                      ) -> None:
    """Against the model: the reading is the sum over the stretches between looks of
    min(stretch, cap), never more than the monotonic time between the first and the
    last look, and no stretch alone adds more than the cap."""
    clock = LookClock(cap_ns / 1e9)
    cap = int(cap_ns / 1e9 * 1e9)  # as the clock rounds it
    real, expected = 7 * S, 0
    before = clock.look(real_ns=real)
    assert before == 0
    for gap in gaps:
        real += gap
        expected += min(gap, cap)
        got = clock.look(real_ns=real)
        assert got == expected and got - before <= cap
        before = got
    assert expected <= real - 7 * S
