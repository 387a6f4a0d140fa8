"""The sans-IO core: a ring of slot machines and the tick bookkeeping.

No threads, no queues, no torch. Each public method is one actor step; it
validates the step against the protocol, fires the table's transition on the
slot's ``transitions`` machine and returns what the caller must do next (a pack
request, a copy order, a release token). A driver serialises calls with one lock.
An illegal step raises a ProtocolError and changes nothing (INV-STICKY).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from transitions import Event as _MachineEvent
from transitions import Machine, MachineError

from .errors import IllegalTransition, PipelineClosed, PipelineFailed
from .wire import CopyOrder, PackDone, PackRequest, ReleaseToken, TransitionRecord
from .spec import INITIAL, TRANSITIONS, Actor, Event, SlotState, transition_for

Observer = Callable[[TransitionRecord], None]


class _Keep:
    """Marker: leave the slot's tick as it is."""


KEEP = _Keep()


class _Slot:
    """The model object of one slot's machine; ``state`` is set by ``transitions``."""

    state: SlotState

    def __init__(self, index: int) -> None:
        self.index = index
        # Invariant: tick is the tick this slot holds from request until release.
        self.tick: int | None = None
        # Invariant: generation counts requests into this slot; stale data is detectable.
        self.generation = 0
        # Invariant: the previous HOT period's release; a copy into G[i] waits on it.
        self.last_release: ReleaseToken | None = None


class _TableEvent(_MachineEvent):
    """Fires one row: our table has no conditions and no callbacks, so an event is
    "find the row for the model's state, enter its dest". transitions' general
    dispatch (callback lists, EventData, logging) costs ~6 us per transition here;
    this keeps its rows, its state objects and its MachineError for invalid triggers,
    at under 1 us."""

    def trigger(self, model: Any, *args: Any, **kwargs: Any) -> bool:
        state = getattr(model, self.machine.model_attribute)
        rows = self.transitions.get(state.name)
        if not rows:
            raise MachineError(f"Can't trigger event {self.name} from state {state.name}!")
        dest = rows[0].dest
        assert dest is not None  # every row of our table has a destination
        self.machine.set_state(dest, model)
        return True


class TableMachine(Machine):
    """A ``transitions.Machine`` whose events fire through ``_TableEvent``."""

    event_cls = _TableEvent


def build_machine(models: list[Any], machine_class: type[Machine] = TableMachine
                  ) -> Machine:
    """A ``transitions`` machine for ``models`` built from the table, nothing else."""
    return machine_class(
        model=models,
        states=list(SlotState),
        initial=INITIAL,
        transitions=[
            {"trigger": t.event.value, "source": t.source, "dest": t.dest}
            for t in TRANSITIONS
        ],
        auto_transitions=False,
        ignore_invalid_triggers=False,
    )


class Core:
    """The ring of ``ring_depth`` slots and the order in which ticks move through it.

    Raises (from every step):
        IllegalTransition: the step is not in the table from the slot's state, or its
            guard does not hold; nothing changed.
        PipelineFailed: after ``fail``, chained to the original cause.
        PipelineClosed: after ``close``.
    """

    # One unlocked machine: the driver's single lock serialises steps (see STYLE.md).
    machine_class: type[Machine] = TableMachine

    def __init__(self, ring_depth: int, *, base_seed: int = 0, sample_count: int = 1,
                 observer: Observer | None = None) -> None:
        if not isinstance(ring_depth, int) or ring_depth < 2:
            raise ValueError(f"ring_depth must be an int >= 2, got {ring_depth!r}")
        self.ring_depth = ring_depth
        self.base_seed = int(base_seed)
        self.sample_count = int(sample_count)
        self.observer = observer
        self._slots = [_Slot(i) for i in range(ring_depth)]
        self._machine = build_machine(self._slots, self.machine_class)
        self._fire = {e: self._machine.events[e.value].trigger for e in Event}
        # Invariant: requested, not yet acquired ticks in request order, with their slots.
        self._pending: deque[tuple[int, int]] = deque()
        # Invariant: the next tick to request is _next_tick (None before the first).
        self._next_tick: int | None = None
        # Invariant: ticks go to slots in ring order starting at slot 0.
        self._next_slot = 0
        # Invariant: _hot is the index of the only HOT slot, or None (INV-HOT).
        self._hot: int | None = None
        self._failure: BaseException | None = None
        self._closed = False

    # -- inspection -----------------------------------------------------------

    def state(self, slot: int) -> SlotState:
        return self._slots[slot].state

    @property
    def states(self) -> tuple[SlotState, ...]:
        return tuple(s.state for s in self._slots)

    @property
    def hot_slot(self) -> int | None:
        return self._hot

    @property
    def hot_tick(self) -> int | None:
        return None if self._hot is None else self._slots[self._hot].tick

    @property
    def pending(self) -> tuple[tuple[int, int], ...]:
        """(tick, slot) of requested ticks not yet acquired, oldest first."""
        return tuple(self._pending)

    @property
    def next_tick(self) -> int | None:
        return self._next_tick

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    @property
    def closed(self) -> bool:
        return self._closed

    def slot_of(self, tick: int) -> int | None:
        """The slot holding ``tick`` (pending or hot), else None."""
        for t, s in self._pending:
            if t == tick:
                return s
        if self._hot is not None and self._slots[self._hot].tick == tick:
            return self._hot
        return None

    def tick_of(self, slot: int) -> int | None:
        return self._slots[slot].tick

    def generation_of(self, slot: int) -> int:
        return self._slots[slot].generation

    def last_release(self, slot: int) -> ReleaseToken | None:
        return self._slots[slot].last_release

    def key(self) -> tuple[Any, ...]:
        """A canonical, hashable key of the whole core state (for the explorer)."""
        return (
            tuple((s.state, s.tick, s.generation, s.last_release) for s in self._slots),
            tuple(self._pending), self._next_tick, self._next_slot, self._hot,
            self._failure is not None, self._closed,
        )

    # -- learner --------------------------------------------------------------

    def request(self, tick: int, min_snapshot_ptr: int | None = None) -> PackRequest:
        """Learner: ask for ``tick`` to be packed into the next slot in ring order."""
        self._check_usable(Event.REQUEST, Actor.LEARNER)
        slot = self._slots[self._next_slot]
        if self._next_tick is not None and tick != self._next_tick:
            self._illegal(slot, Event.REQUEST, Actor.LEARNER, tick,
                          f"ticks must be consecutive: expected tick {self._next_tick}")
        if slot.state is not SlotState.IDLE:
            self._illegal(slot, Event.REQUEST, Actor.LEARNER, tick,
                          f"ring full: the next slot in ring order is {slot.state.name}; "
                          "acquire or release a batch first")
        slot.generation += 1
        self._transition(slot, Event.REQUEST, Actor.LEARNER, tick=tick)
        self._pending.append((tick, slot.index))
        self._next_tick = tick + 1
        self._next_slot = (self._next_slot + 1) % self.ring_depth
        return PackRequest(
            tick=tick, slot=slot.index, generation=slot.generation,
            seed=self.base_seed + tick, sample_count=self.sample_count,
            min_snapshot_ptr=-1 if min_snapshot_ptr is None else int(min_snapshot_ptr),
        )

    def acquire(self, tick: int) -> int:
        """Learner: make the READY slot of ``tick`` HOT; returns the slot index."""
        self._check_usable(Event.ACQUIRE, Actor.LEARNER)
        if not self._pending or self._pending[0][0] != tick:
            expected = self._pending[0][0] if self._pending else None
            where = self.slot_of(tick)
            slot = self._slots[self._next_slot if where is None else where]
            self._illegal(slot, Event.ACQUIRE, Actor.LEARNER, tick,
                          f"ticks are acquired in request order; next is {expected}")
        slot = self._slots[self._pending[0][1]]
        if self._hot is not None:
            self._illegal(slot, Event.ACQUIRE, Actor.LEARNER, tick,
                          f"slot {self._hot} (tick {self.hot_tick}) is still hot; "
                          "release it first")
        self._require(slot, Event.ACQUIRE, Actor.LEARNER, tick)
        self._transition(slot, Event.ACQUIRE, Actor.LEARNER)
        self._pending.popleft()
        self._hot = slot.index
        return slot.index

    def release(self) -> ReleaseToken:
        """Learner: end the HOT period; the token is what a later copy must wait on."""
        self._check_usable(Event.RELEASE, Actor.LEARNER)
        if self._hot is None:
            states = ", ".join(f"slot {s.index} (tick {s.tick}) {s.state.name}"
                               for s in self._slots)
            raise IllegalTransition("can't handle event release (actor=learner): no slot "
                                    f"is HOT; states: {states}")
        slot = self._slots[self._hot]
        assert slot.tick is not None
        token = ReleaseToken(slot=slot.index, tick=slot.tick, generation=slot.generation)
        self._transition(slot, Event.RELEASE, Actor.LEARNER, tick=None)
        slot.last_release = token
        self._hot = None
        return token

    # -- transfer worker and copy engine --------------------------------------

    def packed(self, done: PackDone) -> CopyOrder:
        """Transfer worker: H[slot] is packed; returns the copy order to submit."""
        self._check_usable(Event.SUBMIT, Actor.TRANSFER)
        if not 0 <= done.slot < self.ring_depth:
            raise IllegalTransition(f"can't handle event submit (actor=transfer): slot "
                                    f"{done.slot} is outside the ring of {self.ring_depth}")
        slot = self._slots[done.slot]
        self._require(slot, Event.SUBMIT, Actor.TRANSFER, done.tick)
        if slot.tick != done.tick or (done.generation >= 0
                                      and done.generation != slot.generation):
            self._illegal(slot, Event.SUBMIT, Actor.TRANSFER, done.tick,
                          f"pack done for tick {done.tick} generation {done.generation} "
                          f"does not match the request (tick {slot.tick} generation "
                          f"{slot.generation})")
        self._transition(slot, Event.SUBMIT, Actor.TRANSFER)
        return CopyOrder(tick=done.tick, slot=slot.index, generation=slot.generation,
                         after_release=slot.last_release)

    def copied(self, slot_index: int) -> None:
        """Copy engine: the copy into G[slot] completed."""
        self._check_usable(Event.COMPLETE, Actor.COPY_ENGINE)
        slot = self._slots[slot_index]
        self._require(slot, Event.COMPLETE, Actor.COPY_ENGINE, slot.tick)
        self._transition(slot, Event.COMPLETE, Actor.COPY_ENGINE)

    # -- any actor ------------------------------------------------------------

    def fail(self, error: BaseException, actor: Actor | None = None) -> None:
        """Put every slot in FAILED for good; later calls raise chained to ``error``.

        A second failure keeps the first cause; a failure after close is ignored.
        """
        if self._closed or self._failure is not None:
            return
        self._failure = error
        for slot in self._slots:
            self._transition(slot, Event.FAIL, actor)
        self._hot = None

    def close(self) -> None:
        """Learner: every slot to CLOSED. Idempotent; legal after a failure."""
        if self._closed:
            return
        self._closed = True
        for slot in self._slots:
            self._transition(slot, Event.CLOSE, Actor.LEARNER)
        self._hot = None

    # -- invariants -----------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert the catalogue's structural invariants; a failure is a library bug."""
        states = self.states
        if self._closed:
            assert all(s is SlotState.CLOSED for s in states), states
            return
        if self._failure is not None:
            assert all(s is SlotState.FAILED for s in states), states
            return
        hot = [i for i, s in enumerate(states) if s is SlotState.HOT]
        assert len(hot) <= 1, f"INV-HOT: slots {hot} are hot; please report a bug"
        assert hot == ([] if self._hot is None else [self._hot]), (hot, self._hot)
        ticks = [t for t, _ in self._pending]
        slots = [s for _, s in self._pending]
        assert ticks == list(range(ticks[0], ticks[0] + len(ticks))) if ticks else True, (
            f"INV-ORDER: pending ticks {ticks} are not consecutive")
        for k in range(1, len(slots)):
            assert slots[k] == (slots[k - 1] + 1) % self.ring_depth, (
                f"INV-ORDER: pending slots {slots} are not in ring order")
        if ticks:
            assert self._next_tick == ticks[-1] + 1, (self._next_tick, ticks)
            assert self._next_slot == (slots[-1] + 1) % self.ring_depth
        if self._hot is not None:
            hot_tick = self._slots[self._hot].tick
            assert hot_tick is not None
            if ticks:
                assert ticks[0] == hot_tick + 1, "INV-ORDER: hot tick is not the oldest"
        in_flight = dict(self._pending)
        for t, s in in_flight.items():
            assert self._slots[s].tick == t, (s, t, self._slots[s].tick)
            assert states[s] in (SlotState.REQUESTED, SlotState.SUBMITTED,
                                 SlotState.READY), (s, states[s])
        for i, state in enumerate(states):
            if i not in in_flight.values() and i != self._hot:
                assert state is SlotState.IDLE, f"slot {i} is {state} but holds no tick"
                assert self._slots[i].tick is None
        assert len(self._pending) + (self._hot is not None) <= self.ring_depth

    # -- internals ------------------------------------------------------------

    def _check_usable(self, event: Event, actor: Actor) -> None:
        if self._failure is not None:
            raise PipelineFailed(
                f"can't handle event {event.value} (actor={actor.value}): the pipeline "
                f"failed earlier: {self._failure!r}") from self._failure
        if self._closed:
            raise PipelineClosed(
                f"can't handle event {event.value} (actor={actor.value}): the pipeline is "
                "closed")

    def _require(self, slot: _Slot, event: Event, actor: Actor, tick: int | None) -> None:
        if transition_for(slot.state, event) is None:
            self._illegal(slot, event, actor, tick, "no such transition in the table")

    def _illegal(self, slot: _Slot, event: Event, actor: Actor, tick: int | None,
                 why: str) -> None:
        raise IllegalTransition(
            f"can't handle event {event.value} for slot {slot.index} (tick {tick}) when "
            f"state={slot.state.name}, actor={actor.value}: {why}")

    def _transition(self, slot: _Slot, event: Event, actor: Actor | None,
                    *, tick: int | None | _Keep = KEEP) -> None:
        source, old_tick = slot.state, slot.tick
        self._fire[event](slot)
        if not isinstance(tick, _Keep):
            slot.tick = tick
        if self.observer is not None:
            self.observer(TransitionRecord(
                slot=slot.index, tick=old_tick if slot.tick is None else slot.tick,
                generation=slot.generation, source=source, dest=slot.state,
                event=event, actor=actor))
