"""The core's own checks: who may take a step (``allows``/``refusal`` with an actor),
what a refusal names once the core is failed or closed, and ``check_invariants``
catching each way its bookkeeping could go wrong.

The last group corrupts the core's private state on purpose: ``check_invariants`` is
the sanitizer of that state (checked mode and the model's refinement check call it),
and the only way to see it fire is to hand it a state no table row can produce.
"""

from __future__ import annotations

import pytest

from replay_fsm.core import Core, Step
from replay_fsm.errors import IllegalTransition, PipelineClosed, PipelineFailed
from replay_fsm.spec import Actor, Event, SlotState

from .support import apply, drive


def test_a_step_is_allowed_to_its_own_actor_only() -> None:
    core = drive(SlotState.REQUESTED)
    request = Step(Event.REQUEST, tick=1)
    assert core.allows(request) and core.allows(request, Actor.LEARNER)
    assert not core.allows(request, Actor.PACKER)
    refusal = core.refusal(request, Actor.TRANSFER)
    assert isinstance(refusal, IllegalTransition)
    assert str(refusal) == ("can't handle event request from actor=transfer: the table "
                            "gives it to learner")
    assert core.next_tick == 1  # asking changed nothing


@pytest.mark.parametrize("ending, error", [(Event.CLOSE, PipelineClosed),
                                           (Event.FAIL, PipelineFailed)])
def test_after_the_end_a_refusal_names_the_actor_that_asked(
        ending: Event, error: type[Exception]) -> None:
    core = Core(2)
    apply(core, ending)
    for event in (Event.FAIL, Event.CLOSE):
        default = core.refusal(Step(event))
        assert isinstance(default, error) and "(actor=learner)" in str(default)
        packer = core.refusal(Step(event), Actor.PACKER)
        assert isinstance(packer, error) and "(actor=packer)" in str(packer)
    request = core.refusal(Step(Event.REQUEST, tick=0), Actor.LEARNER)
    assert isinstance(request, error) and "(actor=learner)" in str(request)


def hot_with_pending(pending: int = 2) -> Core:
    """Tick 0 HOT in slot 0, ticks 1.. REQUESTED in the next slots of a ring of 3."""
    core = Core(3)
    core.request(0)
    apply(core, Event.SUBMIT, 0)
    apply(core, Event.COMPLETE, 0)
    core.acquire(0)
    for tick in range(1, pending + 1):
        core.request(tick)
    core.check_invariants()
    return core


def test_check_invariants_passes_every_reachable_state_it_is_shown() -> None:
    core = hot_with_pending()
    core.release()
    core.check_invariants()
    core.close()
    core.check_invariants()


def test_check_invariants_catches_two_hot_slots() -> None:
    core = hot_with_pending()
    core._slots[1].state = SlotState.HOT  # type: ignore[misc]
    with pytest.raises(AssertionError, match=r"INV-HOT: slots \[0, 1\] are hot"):
        core.check_invariants()


def test_check_invariants_catches_pending_ticks_that_skip_one() -> None:
    core = hot_with_pending()
    core._pending[1] = (3, 2)
    with pytest.raises(AssertionError, match=r"INV-ORDER: pending ticks \[1, 3\] are not "
                       "consecutive"):
        core.check_invariants()


def test_check_invariants_catches_a_hot_tick_that_is_not_the_oldest() -> None:
    core = hot_with_pending()
    core._pending.popleft()  # tick 1 forgotten: the oldest pending tick is now 2
    core._slots[1].state = SlotState.IDLE  # type: ignore[misc]
    core._slots[1].tick = None
    with pytest.raises(AssertionError, match="^INV-ORDER: hot tick is not the oldest$"):
        core.check_invariants()


def test_check_invariants_catches_a_hot_slot_without_its_tick() -> None:
    core = hot_with_pending()
    core._slots[0].tick = None
    with pytest.raises(AssertionError):
        core.check_invariants()


def test_check_invariants_catches_a_hot_tick_outside_its_ring_slot() -> None:
    core = hot_with_pending(pending=0)
    core._slots[0].tick = 1  # tick 1 belongs in slot 1
    with pytest.raises(AssertionError):
        core.check_invariants()
