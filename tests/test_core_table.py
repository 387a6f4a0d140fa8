"""One test per table row and one per forbidden (state, event) pair (INV-STICKY)."""

from __future__ import annotations

import pytest
from transitions import MachineError

from replay_fsm import spec
from replay_fsm.core import Core, build_machine
from replay_fsm.errors import IllegalTransition, PipelineClosed, PipelineFailed
from replay_fsm.spec import TRANSITIONS, Event, SlotState

from .support import apply, done_for, drive

FORBIDDEN = [
    (s, e) for s in SlotState for e in Event if spec.transition_for(s, e) is None
]


def test_table_is_complete_and_deterministic() -> None:
    keys = [(t.source, t.event) for t in TRANSITIONS]
    assert len(keys) == len(set(keys)), "two rows for one (state, event)"
    reached = {spec.INITIAL} | {t.dest for t in TRANSITIONS}
    assert reached == set(SlotState)
    assert {t.event for t in TRANSITIONS} == set(Event)
    for state in SlotState:
        if state not in spec.TERMINAL:
            assert any(t.source is state for t in TRANSITIONS), state
    assert set(spec.INVARIANTS) == {
        "INV-HOT", "INV-ORDER", "INV-HOST-WAR", "INV-DEVICE-WAR", "INV-RAW", "INV-DATA",
        "INV-ROW", "INV-LIVE", "INV-STICKY", "INV-CLOSE"}


@pytest.mark.parametrize("row", TRANSITIONS, ids=lambda t: f"{t.source.name}-{t.event.value}")
def test_row_fires_through_core(row: spec.Transition) -> None:
    seen = []
    core = drive(row.source, observer=seen.append)
    seen.clear()
    apply(core, row.event)
    assert core.state(0) is row.dest
    mine = [r for r in seen if r.slot == 0]
    assert [(r.source, r.event, r.dest, r.actor) for r in mine] == [
        (row.source, row.event, row.dest, row.actor if row.actor else None)]
    core.check_invariants()


@pytest.mark.parametrize("pair", FORBIDDEN, ids=lambda p: f"{p[0].name}-{p[1].value}")
def test_forbidden_pair_on_machine_raises(pair: tuple[SlotState, Event]) -> None:
    state, event = pair

    class Model:
        pass

    model = Model()
    machine = build_machine([model])
    machine.set_state(state, model)  # test set-up only: place the model in ``state``
    with pytest.raises(MachineError):
        machine.events[event.value].trigger(model)
    assert model.state is state  # type: ignore[attr-defined]


@pytest.mark.parametrize("pair", FORBIDDEN, ids=lambda p: f"{p[0].name}-{p[1].value}")
def test_forbidden_pair_on_core_raises_and_changes_nothing(
        pair: tuple[SlotState, Event]) -> None:
    """INV-STICKY: an illegal step raises and leaves every slot as it was."""
    state, event = pair
    core = drive(state)
    if event is Event.REQUEST and state not in (SlotState.FAILED, SlotState.CLOSED):
        apply(core, Event.REQUEST)  # tick 1 to slot 1: the next request targets slot 0
    before = core.key()
    if event in (Event.FAIL, Event.CLOSE):
        apply(core, event)  # fail and close are no-ops once terminal, by design
    else:
        expected = {SlotState.FAILED: PipelineFailed, SlotState.CLOSED: PipelineClosed}
        with pytest.raises(expected.get(state, IllegalTransition)) as info:
            apply(core, event)
        if state is not SlotState.FAILED and state is not SlotState.CLOSED:
            assert f"state={state.name}" in str(info.value) or "no slot is HOT" in str(
                info.value)
    assert core.key() == before


def test_error_after_fail_is_chained_to_the_cause() -> None:
    core = drive(SlotState.SUBMITTED)
    cause = ValueError("disk on fire")
    core.fail(cause)
    core.fail(RuntimeError("second"))  # the first cause stays
    for event in (Event.REQUEST, Event.SUBMIT, Event.COMPLETE, Event.ACQUIRE,
                  Event.RELEASE):
        with pytest.raises(PipelineFailed) as info:
            apply(core, event)
        assert info.value.__cause__ is cause
    core.close()
    assert core.states == (SlotState.CLOSED,) * 2


def test_ticks_must_be_consecutive_and_acquired_in_order() -> None:
    core = Core(3)
    core.request(5)
    with pytest.raises(IllegalTransition, match="consecutive"):
        core.request(7)
    core.request(6)
    apply(core, Event.SUBMIT, slot=0)
    apply(core, Event.COMPLETE, slot=0)
    with pytest.raises(IllegalTransition, match="request order"):
        core.acquire(6)
    assert core.pending == ((5, 2), (6, 0))  # tick t sits in slot t % depth (INV-ORDER)


@pytest.mark.parametrize("first", [0, 1, 2, 7, 2**40])
def test_the_first_tick_takes_its_ring_slot(first: int) -> None:
    """INV-ORDER's ring order holds from any first tick, so a run resumed at tick N
    puts each tick in the slot the uninterrupted run used."""
    core = Core(3)
    for tick in range(first, first + 5):
        assert core.request(tick).slot == tick % 3
        apply(core, Event.SUBMIT, slot=tick % 3)
        apply(core, Event.COMPLETE, slot=tick % 3)
        assert core.acquire(tick) == tick % 3
        core.release()


def test_ring_depth_is_validated() -> None:
    for bad in (1, 0, -2):
        with pytest.raises(ValueError, match="ring_depth must be an int >= 2"):
            Core(bad)
    for bad in (2.0, "2", True):
        with pytest.raises(TypeError, match="ring_depth must be an int"):
            Core(bad)  # type: ignore[arg-type]


def test_copy_order_names_the_previous_release() -> None:
    """INV-DEVICE-WAR: the second copy into a slot waits on that slot's last release."""
    core = Core(2)
    for tick in range(4):
        req = core.request(tick)
        order = apply(core, Event.SUBMIT, slot=req.slot)
        if tick < 2:
            assert order.after_release is None  # type: ignore[attr-defined]
        else:
            token = order.after_release  # type: ignore[attr-defined]
            assert (token.slot, token.tick) == (req.slot, tick - 2)
        core.copied(req.slot)
        core.acquire(tick)
        core.release()


def test_every_guard_name_of_the_table_resolves_to_one_core_predicate() -> None:
    """The table owns the protocol: a guard name no predicate answers is a bug."""
    from replay_fsm.core import GUARDS
    assert spec.GUARDS and set(GUARDS) == spec.GUARDS
    for row in TRANSITIONS:
        assert row.guard is None or callable(GUARDS[row.guard])
        assert spec.actor_of(row.event) is row.actor and spec.guard_of(row.event) == row.guard


def test_derived_sets_come_from_the_rows() -> None:
    S = SlotState
    assert spec.TERMINAL == {S.CLOSED} and spec.STOPPED == {S.FAILED, S.CLOSED}
    assert spec.AVAILABLE == {S.READY, S.HOT}
    assert spec.IN_FLIGHT == {S.REQUESTED, S.SUBMITTED}
    assert spec.PENDING == {S.REQUESTED, S.SUBMITTED, S.READY}


def test_a_step_by_the_wrong_actor_is_refused_and_changes_nothing() -> None:
    from replay_fsm.spec import Actor
    core = Core(2)
    before = core.key()
    with pytest.raises(IllegalTransition, match="gives it to learner"):
        core.request(0, actor=Actor.TRANSFER)
    assert core.key() == before
    core.request(0, actor=Actor.LEARNER)
    with pytest.raises(IllegalTransition, match="gives it to transfer"):
        core.packed(done_for(core, 0), actor=Actor.COPY_ENGINE)
    assert core.state(0) is SlotState.REQUESTED


def test_each_actor_may_take_its_own_steps() -> None:
    """The other half of the actor check: every step of a tick, taken by the actor
    DESIGN.md's actor table names for it, is accepted (the learner requests,
    acquires and releases; the transfer worker submits; the copy engine completes).
    Kills the hand-written mutant "the transfer worker acquires" (tests/test_mutations.py),
    a table row with another actor, which the tests driven by the rows cannot see."""
    from replay_fsm.spec import Actor
    core = Core(2)
    for tick in range(3):
        slot = core.request(tick, actor=Actor.LEARNER).slot
        core.packed(done_for(core, slot), actor=Actor.TRANSFER)
        core.copied(slot, actor=Actor.COPY_ENGINE)
        assert core.acquire(tick, actor=Actor.LEARNER) == slot
        assert core.release(actor=Actor.LEARNER).tick == tick
    core.fail(RuntimeError("any actor may fail the pipeline"), Actor.COPY_ENGINE)
    assert core.states == (SlotState.FAILED,) * 2


def test_refusal_answers_without_acting() -> None:
    """Tools ask the core what it would accept instead of re-implementing guards."""
    from replay_fsm.core import Step
    core = Core(2)
    assert core.allows(Step(Event.REQUEST, tick=3))  # any first tick
    core.request(3)
    before = core.key()
    assert core.refusal(Step(Event.REQUEST, tick=4)) is None
    err = core.refusal(Step(Event.REQUEST, tick=6))
    assert isinstance(err, IllegalTransition) and "consecutive" in str(err)
    assert not core.allows(Step(Event.ACQUIRE, tick=3))  # REQUESTED, not READY
    assert "no slot is HOT" in str(core.refusal(Step(Event.RELEASE)))
    assert core.key() == before
    core.fail(RuntimeError("x"))
    assert isinstance(core.refusal(Step(Event.REQUEST, tick=4)), PipelineFailed)
    assert not core.allows(Step(Event.FAIL))


def test_an_observer_that_raises_sees_a_finished_step() -> None:
    """A step is done or not done: the observer runs after every state change of the
    step, gets every record, and its error comes out once the step is complete."""
    seen: list[object] = []

    def observer(rec: object) -> None:
        seen.append(rec)
        raise KeyboardInterrupt

    core = Core(3, observer=observer)
    with pytest.raises(KeyboardInterrupt):
        core.fail(RuntimeError("x"))
    assert core.states == (SlotState.FAILED,) * 3 and len(seen) == 3
    core.check_invariants()


@pytest.mark.parametrize("tick", [-1, 1.0, True, "3", None])
def test_ticks_must_be_non_negative_ints(tick: object) -> None:
    core = Core(2)
    with pytest.raises((TypeError, ValueError), match="tick"):
        core.request(tick)  # type: ignore[arg-type]
    assert core.next_tick is None


def test_numpy_ticks_and_seeds_in_range() -> None:
    np = pytest.importorskip("numpy")
    core = Core(np.int64(2), base_seed=np.int64(5))
    assert core.request(np.int64(7)).seed == 12
    with pytest.raises(ValueError, match="2\\*\\*63"):
        Core(2, base_seed=2**63)
    big = Core(2, base_seed=2**63 - 2)
    big.request(1)
    with pytest.raises(ValueError, match="2\\*\\*63"):
        big.request(2)


def test_fail_and_close_records_name_the_tables_actor_or_the_caller() -> None:
    """The table's actor of fail (None: any actor, the one that failed is recorded)
    and of close (the learner) reach the records a trace is written from."""
    from replay_fsm.spec import Actor
    seen: list = []
    core = Core(2, observer=seen.append)
    core.fail(RuntimeError("the copy engine broke"), Actor.COPY_ENGINE)
    assert [(r.event, r.actor) for r in seen] == [(Event.FAIL, Actor.COPY_ENGINE)] * 2
    seen.clear()
    core.close()
    assert [(r.event, r.actor) for r in seen] == [(Event.CLOSE, Actor.LEARNER)] * 2
