"""The core's outputs to the letter: the requests, copy orders, release tokens and
transition records of a scripted run (generations, seeds, the default snapshot
pointer, the tick a record names), and every refusal's message, since the message is
what a user reads when a step is wrong. The table tests check which steps are legal;
these check what the legal ones hand out and what the illegal ones say."""

from __future__ import annotations

import pytest
from transitions import MachineError

from replay_fsm.core import (
    Core,
    Step,
    TableMachine,
    as_count,
    as_seconds,
    as_tick,
    build_machine,
)
from replay_fsm.errors import IllegalTransition, PipelineClosed, PipelineFailed
from replay_fsm.spec import Actor, Event, SlotState
from replay_fsm.wire import MAX_SEED, CopyOrder, PackDone, PackRequest, ReleaseToken

L, T, C = Actor.LEARNER, Actor.TRANSFER, Actor.COPY_ENGINE
ID, R, S, Y, H, F, X = (SlotState.IDLE, SlotState.REQUESTED, SlotState.SUBMITTED,
                       SlotState.READY, SlotState.HOT, SlotState.FAILED, SlotState.CLOSED)


def done(request: PackRequest, **change: object) -> PackDone:
    fields = dict(tick=request.tick, slot=request.slot, generation=request.generation,
                  seed=request.seed, sample_count=request.sample_count, snapshot_ptr=0,
                  snapshot_size=0)
    fields.update(change)
    return PackDone(**fields)  # type: ignore[arg-type]


def record(slot: int, tick: int | None, generation: int, source: SlotState,
           dest: SlotState, event: Event, actor: Actor | None) -> tuple[object, ...]:
    return (slot, tick, generation, source, dest, event, actor)


def as_tuples(records: list) -> list[tuple[object, ...]]:
    return [(r.slot, r.tick, r.generation, r.source, r.dest, r.event, r.actor)
            for r in records]


def test_a_scripted_run_hands_out_exactly_these_messages_and_records() -> None:
    seen: list = []
    core = Core(2, base_seed=5, sample_count=7, observer=seen.append)
    assert core.closed is False and core.failure is None and core.hot_slot is None
    assert [core.generation_of(i) for i in range(2)] == [0, 0]

    first = core.request(3)  # the first tick need not be 0: it still sits in 3 % 2
    second = core.request(4, min_snapshot_ptr=9)
    assert first == PackRequest(tick=3, slot=1, generation=1, seed=8, sample_count=7,
                                min_snapshot_ptr=-1)
    assert second == PackRequest(tick=4, slot=0, generation=1, seed=9, sample_count=7,
                                 min_snapshot_ptr=9)
    assert core.packed(done(first)) == CopyOrder(tick=3, slot=1, generation=1,
                                                 after_release=None)
    core.copied(1)
    assert core.acquire(3) == 1
    assert (core.slot_of(3), core.slot_of(4), core.slot_of(5)) == (1, 0, None)
    token = core.release()
    assert token == ReleaseToken(slot=1, tick=3, generation=1)
    assert core.last_release(1) == token and core.last_release(0) is None
    third = core.request(5)  # slot 1 again: its second generation
    assert third == PackRequest(tick=5, slot=1, generation=2, seed=10, sample_count=7,
                                min_snapshot_ptr=-1)
    assert core.generation_of(1) == 2 and core.generation_of(0) == 1
    # The copy into slot 1 must wait for the release of its previous HOT period.
    assert core.packed(done(third)) == CopyOrder(tick=5, slot=1, generation=2,
                                                 after_release=token)
    assert as_tuples(seen) == [
        record(1, 3, 1, ID, R, Event.REQUEST, L),
        record(0, 4, 1, ID, R, Event.REQUEST, L),
        record(1, 3, 1, R, S, Event.SUBMIT, T),
        record(1, 3, 1, S, Y, Event.COMPLETE, C),
        record(1, 3, 1, Y, H, Event.ACQUIRE, L),
        record(1, 3, 1, H, ID, Event.RELEASE, L),  # names the tick it released
        record(1, 5, 2, ID, R, Event.REQUEST, L),
        record(1, 5, 2, R, S, Event.SUBMIT, T),
    ]

    seen.clear()
    core.fail(RuntimeError("boom"), actor=Actor.PACKER)  # the actor who saw it
    assert as_tuples(seen) == [record(0, 4, 1, R, F, Event.FAIL, Actor.PACKER),
                               record(1, 5, 2, S, F, Event.FAIL, Actor.PACKER)]
    assert core.key()[-2:] == (True, False)
    seen.clear()
    core.close()
    assert as_tuples(seen) == [record(0, 4, 1, F, X, Event.CLOSE, L),
                               record(1, 5, 2, F, X, Event.CLOSE, L)]
    assert core.key()[-2:] == (True, True) and core.closed is True


def test_the_hot_slot_is_none_once_failed_or_closed() -> None:
    for end in ("fail", "close"):
        core = Core(2)
        assert core.request(0).sample_count == 1  # the default
        core.packed(done(PackRequest(0, 0, 1, 0, 1, -1)))
        core.copied(0)
        core.acquire(0)
        assert core.hot_slot == 0 and core.hot_tick == 0 and core.slot_of(0) == 0
        assert core.slot_of(1) is None
        core.fail(RuntimeError("x")) if end == "fail" else core.close()
        assert core.hot_slot is None and core.hot_tick is None


def refusals() -> list[tuple[str, object, str]]:
    """(what, a call on a core holding ticks 3 and 4 at depth 2, its exact message)."""
    return [
        ("ring full", lambda c: c.request(5),
         "can't handle event request for slot 1 (tick 5) when state=REQUESTED, "
         "actor=learner: INV-HOST-WAR: ring full: the tick's slot in ring order is "
         "REQUESTED; acquire or release a batch first"),
        ("out of order", lambda c: c.acquire(4),
         "can't handle event acquire for slot 0 (tick 4) when state=REQUESTED, "
         "actor=learner: INV-ORDER: ticks are acquired in request order; next is 3"),
        ("nothing hot", lambda c: c.release(),
         "can't handle event release (actor=learner): no slot is HOT; states: slot 0 "
         "(tick 4) REQUESTED, slot 1 (tick 3) REQUESTED"),
        ("outside the ring", lambda c: c.copied(2),
         "can't handle event complete: slot 2 is outside the ring of 2"),
        ("no row", lambda c: c.copied(0),
         "can't handle event complete for slot 0 (tick 4) when state=REQUESTED, "
         "actor=copy_engine: no such transition in the table"),
        ("stale pack", lambda c: c.packed(done(PackRequest(7, 1, 1, 12, 7, -1))),
         "can't handle event submit for slot 1 (tick 7) when state=REQUESTED, "
         "actor=transfer: INV-ORDER: pack done for tick 7 generation 1 does not match "
         "the request (tick 3 generation 1)"),
        ("wrong actor (acquire)", lambda c: c.acquire(3, actor=Actor.PACKER),
         "can't handle event acquire from actor=packer: the table gives it to learner"),
        ("wrong actor (release)", lambda c: c.release(actor=T),
         "can't handle event release from actor=transfer: the table gives it to learner"),
        ("wrong actor (complete)", lambda c: c.copied(1, actor=L),
         "can't handle event complete from actor=learner: the table gives it to "
         "copy_engine"),
        ("wrong actor (submit)", lambda c: c.packed(done(PackRequest(3, 1, 1, 8, 7, -1)),
                                                    actor=C),
         "can't handle event submit from actor=copy_engine: the table gives it to "
         "transfer"),
        ("wrong actor (request)", lambda c: c.request(5, actor=C),
         "can't handle event request from actor=copy_engine: the table gives it to "
         "learner"),
    ]


REFUSALS = refusals()


@pytest.mark.parametrize("what,call,message", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_each_refusal_says_exactly_what_is_wrong(what: str, call, message: str) -> None:
    core = Core(2, base_seed=5, sample_count=7)
    core.request(3)
    core.request(4)
    before = core.key()
    with pytest.raises(IllegalTransition) as info:
        call(core)
    assert str(info.value) == message
    assert core.key() == before


def test_a_failed_or_closed_core_names_the_event_the_actor_and_the_cause() -> None:
    core = Core(2)
    core.fail(RuntimeError("boom"))
    with pytest.raises(PipelineFailed) as info:
        core.request(0)
    assert str(info.value) == ("can't handle event request (actor=learner): the "
                               "pipeline failed earlier: RuntimeError('boom')")
    assert info.value.__cause__ is core.failure
    # The actor named is the one that offered the step, even one the table refuses.
    assert str(core.refusal(Step(Event.ACQUIRE, tick=0), Actor.PACKER)) == (
        "can't handle event acquire (actor=packer): the pipeline failed earlier: "
        "RuntimeError('boom')")
    core = Core(2)
    core.close()
    with pytest.raises(PipelineClosed) as closed:
        core.copied(0)
    assert str(closed.value) == ("can't handle event complete (actor=copy_engine): the "
                                 "pipeline is closed")


def test_integer_arguments_are_named_with_their_type_in_the_message() -> None:
    with pytest.raises(TypeError) as info:
        as_count("rows", 2.0)
    assert str(info.value) == ("rows must be an int (or numpy integer) >= 0, got 2.0 "
                               "of type float")
    with pytest.raises(TypeError, match=r"^tick must be an int .* of type str$"):
        as_tick("3")
    with pytest.raises(TypeError, match=r"^base_seed must be an int "):
        Core(2, base_seed=1.5)  # type: ignore[arg-type]


def test_as_int_is_the_one_check_of_an_int_that_is_no_bool() -> None:
    """"An int, not a bool" was written three times (``as_count``, the SAC config's
    counts, a backend's ``on_complete`` slot). ``core.as_int`` is the one check: a
    numpy integer is taken as a plain int, a bool (numpy's too), a float and a str
    are refused with the name, the caller's bound and the type."""
    import numpy as np

    from replay_fsm.core import as_int

    for value in (3, np.int64(3), np.uint8(3), np.int32(3)):
        taken = as_int("n", value)
        assert type(taken) is int and taken == 3
    for bad, kind in ((True, "bool"), (np.bool_(False), "bool"), (2.0, "float"),
                      ("3", "str"), (None, "NoneType")):
        with pytest.raises(TypeError) as info:
            as_int("n", bad)
        assert str(info.value) == (f"n must be an int (or numpy integer), got {bad!r} of "
                                   f"type {kind}")
    with pytest.raises(TypeError, match=r"^n must be an int \(or numpy integer\) >= 1, "):
        as_int("n", 1.5, " >= 1")


def test_seconds_take_any_real_number_numpys_included_and_no_bool() -> None:
    """A trainer passing a bound read from numpy (np.float32(2.0), np.int64(3)) was
    refused with "must be a finite number of seconds > 0", which reads as a range
    error for 2.0 (only float's own subclass np.float64 passed; helper-104)."""
    import fractions

    import numpy as np

    for value, seconds in ((np.float32(2.0), 2.0), (np.int64(3), 3.0), (np.float16(0.5), 0.5),
                           (np.uint8(1), 1.0), (fractions.Fraction(1, 4), 0.25), (2, 2.0)):
        got = as_seconds("liveness_timeout", value)
        assert got == seconds and type(got) is float, value
    for bad in (True, np.bool_(True), np.float32("nan"), np.float64("inf"), np.int64(0),
                np.float32(-1.0), 10**400, "2", None):
        with pytest.raises(ValueError, match=r"^liveness_timeout must be a finite number "
                                             r"of seconds > 0, got "):
            as_seconds("liveness_timeout", bad)
    assert as_seconds("stall_timeout", None, none_ok=True) is None


def test_a_numpy_timedelta_is_no_number_of_seconds() -> None:
    """numpy registers timedelta64 as an integer: np.timedelta64(2, 'ns') passed as
    2.0 seconds (a billion times its length), np.timedelta64(2, 's') raised float()'s
    TypeError, where a bound in seconds refuses what it cannot read (helper-108)."""
    import numpy as np

    for bad in (np.timedelta64(2, "ns"), np.timedelta64(2, "s"), np.timedelta64(1, "Y"),
                np.timedelta64("NaT")):
        with pytest.raises(ValueError, match=r"^liveness_timeout must be a finite number "
                                             r"of seconds > 0, got "):
            as_seconds("liveness_timeout", bad)


def test_a_decimal_is_a_number_of_seconds() -> None:
    """A bound read from a config parsed with Decimal (json's parse_float=Decimal) was
    refused as "must be a finite number of seconds > 0, got Decimal('2')": a Decimal
    is no numbers.Real. It is taken as its float; its nan, sNaN and infinity are
    refused as float's are, and a wait's timeout takes it too."""
    from decimal import Decimal

    import numpy as np

    from replay_fsm.core import seconds_of

    assert as_seconds("liveness_timeout", Decimal("2")) == 2.0
    got = as_seconds("liveness_timeout", Decimal("0.25"))
    assert got == 0.25 and type(got) is float
    assert seconds_of(Decimal("0")) == 0.0  # a wait's timeout of 0
    for bad in (Decimal("NaN"), Decimal("sNaN"), Decimal("Infinity"), Decimal("-1"),
                Decimal("0"), Decimal("1e999999")):
        with pytest.raises(ValueError, match=r"^liveness_timeout must be a finite number "
                                             r"of seconds > 0, got Decimal\("):
            as_seconds("liveness_timeout", bad)
    for kept_out in (True, np.timedelta64(2, "s")):  # still refused
        with pytest.raises(ValueError):
            as_seconds("liveness_timeout", kept_out)


def test_seeds_use_the_whole_63_bit_range_and_no_more() -> None:
    core = Core(2, base_seed=MAX_SEED)  # the largest seed is allowed
    assert core.request(0).seed == MAX_SEED
    with pytest.raises(ValueError, match=r"base_seed must be an int in \[0, 2\*\*63\)"):
        Core(2, base_seed=MAX_SEED + 1)
    core = Core(2, base_seed=MAX_SEED - 1)
    with pytest.raises(ValueError) as info:
        core.request(2)
    assert str(info.value) == (f"tick 2: its seed base_seed + tick = {MAX_SEED + 1} "
                               "must be < 2**63")


def test_the_machine_has_the_tables_events_and_nothing_else() -> None:
    class Model:
        pass

    model = Model()
    machine = build_machine([model])
    # No auto transitions (to_hot() and the like would bypass the table).
    assert set(machine.events) == {e.value for e in Event}
    assert not hasattr(model, "to_hot")
    assert model.request() is True  # type: ignore[attr-defined]
    assert model.state is SlotState.REQUESTED  # type: ignore[attr-defined]
    with pytest.raises(MachineError) as info:
        model.acquire()  # type: ignore[attr-defined]
    assert str(info.value) == "\"Can't trigger event acquire from state REQUESTED!\""


def test_a_core_subclass_chooses_its_machine_class() -> None:
    class Counting(TableMachine):
        built = 0

        def __init__(self, *args: object, **kwargs: object) -> None:
            Counting.built += 1
            super().__init__(*args, **kwargs)

    class MyCore(Core):
        machine_class = Counting

    core = MyCore(3)
    assert Counting.built == 1
    core.request(0)
    assert core.states == (R, ID, ID)
