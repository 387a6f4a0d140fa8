"""The sans-IO core: a ring of slot machines and the tick bookkeeping.

No threads, no queues, no torch. Each public method is one actor step; it admits
the step against the table (the slot's state has a row for the event, the actor
is the row's, the row's guard holds), fires the row on the slot's ``transitions``
machine and returns what the caller must do next (a pack request, a copy order, a
release token). ``refusal`` answers "would this step be accepted, and if not,
why" without changing anything: the explorer and the conformance checker ask it
instead of keeping their own copy of the guards. A driver serialises calls with
one lock. An illegal step raises a ProtocolError and changes nothing
(INV-STICKY); a step is either done or not done, even when an observer raises.
"""

from __future__ import annotations

import decimal
import functools
import math
import numbers
import operator
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple, overload

from transitions import Event as _MachineEvent
from transitions import Machine, MachineError

from .errors import IllegalTransition, PipelineClosed, PipelineFailed, ProtocolError, setting
from .spec import (
    INITIAL,
    PENDING,
    TRANSITIONS,
    Actor,
    Event,
    SlotState,
    Transition,
    actor_of,
    guard_of,
    transition_for,
)
from .wire import MAX_SEED, CopyOrder, PackDone, PackRequest, ReleaseToken, TransitionRecord

Observer = Callable[[TransitionRecord], None]
# The events the steps name, read once: a read of ``Event.REQUEST`` goes through the
# Python ``__getattr__`` hook of Enum's metaclass (~80 ns in CPython 3.11, a tenth of
# that for a module global), and each step read two or three.
_REQUEST, _SUBMIT, _COMPLETE = Event.REQUEST, Event.SUBMIT, Event.COMPLETE
_ACQUIRE, _RELEASE = Event.ACQUIRE, Event.RELEASE
# Far beyond any useful prefetch (2-4 is the useful range); a slot holds a whole batch
# on the host and on the device, and a process's handles and memory run out long before
# a ring of many thousand slots is built.
MAX_RING_DEPTH = 64


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
    at well under 1 us: the event's rows become a map from source state to the
    destination's state value the first time it fires."""

    _dest: dict[Any, Any] | None = None

    def trigger(self, model: Any, *args: Any, **kwargs: Any) -> bool:
        dest = self._dest
        if dest is None:  # the machine's rows, read once: source value -> dest value
            states = self.machine.states
            dest = self._dest = {
                states[source].value: states[str(rows[0].dest)].value
                for source, rows in self.transitions.items() if rows}
        attr = self.machine.model_attribute
        state = getattr(model, attr)
        target = dest.get(state)
        if target is None:
            raise MachineError(f"Can't trigger event {self.name} from state {state.name}!")
        setattr(model, attr, target)
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


class Step(NamedTuple):
    """One actor step offered to the core: the event and what it names. A named
    tuple: immutable like a frozen dataclass, built in a third of its time (the
    core builds one per step)."""

    event: Event
    tick: int | None = None
    slot: int | None = None
    done: PackDone | None = None


# The core builds a Step and a TransitionRecord at every step: straight from a tuple
# of every field in order, they cost half of a call with keywords (no Python frame).
_step: Callable[[tuple[Any, ...]], Step] = functools.partial(tuple.__new__, Step)
_record: Callable[[tuple[Any, ...]], TransitionRecord] = functools.partial(
    tuple.__new__, TransitionRecord)
assert tuple(Step.__annotations__) == ("event", "tick", "slot", "done")
_RELEASE_STEP = _step((Event.RELEASE, None, None, None))  # names nothing: always the same
assert tuple(TransitionRecord.__annotations__) == (
    "slot", "tick", "generation", "source", "dest", "event", "actor")


# The predicates behind the table's guard names (methods of ``Core``, which read its
# fields: a guard runs at every step, and a property read is a Python call); each
# returns None when the guard holds, else the reason in words. ``spec.GUARDS`` names
# exactly these keys (tested).
Guard = Callable[["Core", _Slot, Step], "str | None"]
GUARDS: dict[str, Guard] = {}


def _guard(name: str) -> Callable[[Guard], Guard]:
    def register(fn: Guard) -> Guard:
        GUARDS[name] = fn
        return fn
    return register


def as_ring_depth(value: object) -> int:
    """``value`` as a ring depth, 2 to ``MAX_RING_DEPTH``.

    Raises:
        TypeError: not an integer.
        ValueError: below 2 or above ``MAX_RING_DEPTH``.
    """
    depth = as_count("ring_depth", value, 2)
    if depth > MAX_RING_DEPTH:
        raise ValueError(f"{setting('ring_depth')} must be <= {MAX_RING_DEPTH}, got "
                         f"{value}: a ring prefetches {setting('ring_depth')} - 1 ticks "
                         "ahead, and each slot holds a whole batch on the host and on "
                         "the device")
    return depth


def require_asserts(what: str) -> None:
    """Refuse to run ``what``, which checks invariants with assert statements (the
    core's ``check_invariants``), where ``python -O`` (PYTHONOPTIMIZE) removed them:
    it would check nothing and report that all holds.

    Raises:
        RuntimeError: asserts are off.
    """
    if not __debug__:
        raise RuntimeError(f"{what} checks the invariants with assert statements, which "
                           "python -O (or PYTHONOPTIMIZE) removes: run it without -O")


def as_int(name: str, value: object, bound: str = "") -> int:
    """``value`` as a plain int: an int or a numpy integer (anything ``operator.index``
    takes), never a bool (``True`` would silently mean 1) or a float (2.0 usually
    means a computation went wrong). The one check of "an int, not a bool" that every
    layer's integral arguments go through; ``bound`` is the range the caller checks
    after, in words (" >= 1"), for the message.

    Raises:
        TypeError: not an integer (the message names ``name``, ``bound`` and the
            value's type).
    """
    if type(value) is int:
        return value
    if not isinstance(value, bool):
        try:
            return operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
    raise TypeError(f"{setting(name)} must be an int (or numpy integer){bound}, got "
                    f"{value!r} of type {type(value).__name__}")


def as_count(name: str, value: object, low: int = 0) -> int:
    """``value`` as a plain int >= ``low`` (see ``as_int``). Every layer checks its
    counts with it.

    Raises:
        TypeError: not an integer (the message names ``name``, as ``errors.setting``
            calls it).
        ValueError: below ``low``.
    """
    if type(value) is int and value >= low:  # the common case, at once
        return value
    number = as_int(name, value, f" >= {low}")
    if number < low:
        raise ValueError(f"{setting(name)} must be an int >= {low}, got {number}")
    return number


def as_seed(value: object, name: str = "base_seed") -> int:
    """``value`` as a base seed: an int in [0, 2**63) (see ``as_count``).

    Raises:
        TypeError: not an integer.
        ValueError: negative, or past the 63-bit range.
    """
    seed = as_count(name, value)
    if seed > MAX_SEED:
        raise ValueError(f"{setting(name)} must be an int in [0, 2**63), got {value!r}")
    return seed


@overload
def as_seconds(name: str, value: object) -> float: ...


@overload
def as_seconds(name: str, value: object, *, none_ok: bool) -> float | None: ...


def as_seconds(name: str, value: object, *, none_ok: bool = False) -> float | None:
    """``value`` as a finite number of seconds > 0 (None too where ``none_ok``): any
    real number, numpy's floats and integers among them (a setting read from an array
    or a config loaded with numpy), and a ``decimal.Decimal`` (one read from a config
    with ``parse_float=Decimal``), never a bool.

    Raises:
        ValueError: anything else, a bool (numpy's too), nan and inf included (the
            message names ``name``).
    """
    if value is None and none_ok:
        return None
    seconds = seconds_of(value)
    if not 0 < seconds < math.inf:
        raise ValueError(f"{setting(name)} must be a finite number of seconds > 0"
                         f"{' or None' if none_ok else ''}, got {value!r}")
    return seconds


def seconds_of(value: object) -> float:
    """``value`` as a float where it is a real number (see ``real_of``), else nan,
    which every bound on seconds refuses."""
    number = real_of(value)
    return math.nan if number is None else number


def real_of(value: object) -> float | None:
    """``value`` as a float where it is a real number (numpy's included) and not a
    bool, else None; an int past float's range is inf. numpy's timedelta64 registers
    as an integer but counts its own unit (float() of 2 ns was 2.0 seconds, of 2 s a
    TypeError): it is no integer to ``operator.index``, so it is refused too. A
    ``decimal.Decimal``, which is no ``numbers.Real`` but a number all the same (one
    read from a config with ``parse_float=Decimal``), is taken as its float (a
    signalling NaN as nan). Seconds (``seconds_of``) and the SAC config's rates are
    read with it."""
    if isinstance(value, decimal.Decimal):
        try:
            return float(value)
        except ValueError:  # sNaN: float() refuses it where it takes NaN
            return math.nan
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    if isinstance(value, numbers.Integral):
        try:
            value = operator.index(value)
        except TypeError:
            return None
    try:
        return float(value)
    except OverflowError:
        return math.inf


def as_tick(tick: object) -> int:
    """``tick`` as an int >= 0 (see ``as_count``)."""
    if type(tick) is int and tick >= 0:  # as as_count's first line, one call fewer
        return tick
    return as_count("tick", tick)


class Core:
    """The ring of ``ring_depth`` slots and the order in which ticks move through it.

    Tick t always sits in slot ``t % ring_depth`` (INV-ORDER's ring order), whatever
    the first tick is, so a run resumed at tick N uses the slots the first run used.

    Raises (from the constructor): ValueError for a ring_depth outside 2 to
    MAX_RING_DEPTH, a negative base_seed or one past the 63-bit range; TypeError
    for a non-integer one.

    Raises (from every step):
        IllegalTransition: the step is not in the table from the slot's state, the
            actor is not the row's, or its guard does not hold; nothing changed.
        PipelineFailed: after ``fail``, chained to the original cause.
        PipelineClosed: after ``close``.
    """

    # One unlocked machine: the driver's single lock serialises steps (see STYLE.md).
    machine_class: type[Machine] = TableMachine

    def __init__(self, ring_depth: int, *, base_seed: int = 0, sample_count: int = 1,
                 observer: Observer | None = None) -> None:
        self.ring_depth = as_ring_depth(ring_depth)
        self.base_seed = as_seed(base_seed)
        self.sample_count = int(sample_count)
        self.observer = observer
        self._slots = [_Slot(i) for i in range(self.ring_depth)]
        self._machine = build_machine(self._slots, self.machine_class)
        self._fire = {e: self._machine.events[e.value].trigger for e in Event}
        # Invariant: requested, not yet acquired ticks in request order, with their slots.
        self._pending: deque[tuple[int, int]] = deque()
        # Invariant: the next tick to request is _next_tick (None before the first).
        self._next_tick: int | None = None
        # Invariant: _hot is the index of the only HOT slot, or None (INV-HOT).
        self._hot: int | None = None
        self._failure: BaseException | None = None
        self._closed = False
        # Records of the step in progress; observers see them once the step is done.
        self._records: list[TransitionRecord] = []

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
    def oldest_tick(self) -> int | None:
        """The oldest requested tick not yet acquired, None when there is none: the
        only one ``acquire`` takes (INV-ORDER)."""
        return self._pending[0][0] if self._pending else None

    @property
    def next_tick(self) -> int | None:
        return self._next_tick

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    @property
    def closed(self) -> bool:
        return self._closed

    def ring_slot(self, tick: int) -> int:
        """The slot that tick ``tick`` occupies (ring order: ``tick % ring_depth``)."""
        return tick % self.ring_depth

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
            tuple(self._pending), self._next_tick, self._hot,
            self._failure is not None, self._closed,
        )

    # -- asking without acting ------------------------------------------------

    def refusal(self, step: Step, actor: Actor | None = None) -> ProtocolError | None:
        """The error ``step`` would raise now, or None if the core would take it.

        Changes nothing. ``fail`` and ``close`` are refused only once the core is
        failed or closed (they are no-ops then).
        """
        try:
            if step.event is Event.FAIL or step.event is Event.CLOSE:
                self._check_usable(step.event, actor or Actor.LEARNER)
            else:
                self._admit(step, actor)
        except (ProtocolError, PipelineFailed) as exc:
            return exc  # type: ignore[return-value]
        return None

    def allows(self, step: Step, actor: Actor | None = None) -> bool:
        """Whether the core would take ``step`` now (see ``refusal``)."""
        return self.refusal(step, actor) is None

    # -- learner --------------------------------------------------------------

    def request(self, tick: int, min_snapshot_ptr: int | None = None, *,
                actor: Actor | None = None) -> PackRequest:
        """Learner: ask for ``tick`` to be packed into its slot in ring order.

        Raises:
            TypeError, ValueError: ``tick`` is not an int >= 0, or its seed
                ``base_seed + tick`` or ``min_snapshot_ptr`` leaves the 63-bit range;
                nothing changed.
        """
        if type(tick) is not int or tick < 0:  # as_tick's common case, without its call
            tick = as_tick(tick)
        if self.base_seed + tick > MAX_SEED:
            raise ValueError(f"tick {tick}: its seed base_seed + tick = "
                             f"{self.base_seed + tick} must be < 2**63")
        if min_snapshot_ptr is not None and min_snapshot_ptr > MAX_SEED:
            # The request travels as an int64 record, as the seed does.
            raise ValueError(f"tick {tick}: min_snapshot_ptr must be < 2**63, got "
                             f"{min_snapshot_ptr}")
        slot = self._admit(_step((_REQUEST, tick, None, None)), actor)
        slot.generation += 1
        self._transition(slot, _REQUEST, actor, tick=tick)
        self._pending.append((tick, slot.index))
        self._next_tick = tick + 1
        request = PackRequest(
            tick=tick, slot=slot.index, generation=slot.generation,
            seed=self.base_seed + tick, sample_count=self.sample_count,
            min_snapshot_ptr=-1 if min_snapshot_ptr is None else int(min_snapshot_ptr),
        )
        self._notify()
        return request

    def acquire(self, tick: int, *, actor: Actor | None = None) -> int:
        """Learner: make the READY slot of ``tick`` HOT; returns the slot index."""
        if type(tick) is not int or tick < 0:  # as_tick's common case, without its call
            tick = as_tick(tick)
        slot = self._admit(_step((_ACQUIRE, tick, None, None)), actor)
        self._transition(slot, _ACQUIRE, actor)
        self._pending.popleft()
        self._hot = slot.index
        self._notify()
        return slot.index

    def release(self, *, actor: Actor | None = None) -> ReleaseToken:
        """Learner: end the HOT period; the token is what a later copy must wait on."""
        slot = self._admit(_RELEASE_STEP, actor)
        assert slot.tick is not None
        token = ReleaseToken(slot=slot.index, tick=slot.tick, generation=slot.generation)
        self._transition(slot, _RELEASE, actor, tick=None)
        slot.last_release = token
        self._hot = None
        self._notify()
        return token

    # -- transfer worker and copy engine --------------------------------------

    def packed(self, done: PackDone, *, actor: Actor | None = None) -> CopyOrder:
        """Transfer worker: H[slot] is packed; returns the copy order to submit."""
        slot = self._admit(_step((_SUBMIT, None, done.slot, done)), actor)
        self._transition(slot, _SUBMIT, actor)
        order = CopyOrder(tick=done.tick, slot=slot.index, generation=slot.generation,
                          after_release=slot.last_release)
        self._notify()
        return order

    def copied(self, slot_index: int, *, actor: Actor | None = None) -> None:
        """Copy engine: the copy into G[slot] completed."""
        slot = self._admit(_step((_COMPLETE, None, slot_index, None)), actor)
        self._transition(slot, _COMPLETE, actor)
        self._notify()

    # -- any actor ------------------------------------------------------------

    def fail(self, error: BaseException, actor: Actor | None = None) -> None:
        """Put every slot in FAILED for good; later calls raise chained to ``error``.

        A second failure keeps the first cause; a failure after close is ignored.

        Raises:
            TypeError: ``error`` is not an exception (later calls chain to it).
        """
        if not isinstance(error, BaseException):
            raise TypeError(f"fail takes the exception that broke the run, got {error!r} "
                            f"of type {type(error).__name__}")
        if self._closed or self._failure is not None:
            return
        self._failure = error
        for slot in self._slots:
            self._transition(slot, Event.FAIL, actor)
        self._hot = None
        self._notify()

    def close(self) -> None:
        """Learner: every slot to CLOSED. Idempotent; legal after a failure."""
        if self._closed:
            return
        self._closed = True
        for slot in self._slots:
            self._transition(slot, Event.CLOSE, None)
        self._hot = None
        self._notify()

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
        assert ticks == list(range(ticks[0], ticks[0] + len(ticks))) if ticks else True, (
            f"INV-ORDER: pending ticks {ticks} are not consecutive")
        for t, s in self._pending:
            assert s == self.ring_slot(t), f"INV-ORDER: tick {t} sits in slot {s}"
        if ticks:
            assert self._next_tick == ticks[-1] + 1, (self._next_tick, ticks)
        if self._hot is not None:
            hot_tick = self._slots[self._hot].tick
            assert hot_tick is not None and self._hot == self.ring_slot(hot_tick)
            if ticks:
                assert ticks[0] == hot_tick + 1, "INV-ORDER: hot tick is not the oldest"
        in_flight = dict(self._pending)
        for t, s in in_flight.items():
            assert self._slots[s].tick == t, (s, t, self._slots[s].tick)
            assert states[s] in PENDING, (s, states[s])
        for i, state in enumerate(states):
            if i not in in_flight.values() and i != self._hot:
                assert state is SlotState.IDLE, f"slot {i} is {state} but holds no tick"
                assert self._slots[i].tick is None
        assert len(self._pending) + (self._hot is not None) <= self.ring_depth

    # -- the table's guards (registered in GUARDS) -----------------------------

    @_guard("tick_is_next_in_ring_order")
    def _next_in_ring_order(self, slot: _Slot, step: Step) -> str | None:
        nxt = self._next_tick
        if nxt is not None and step.tick != nxt:
            return f"INV-ORDER: ticks must be consecutive: expected tick {nxt}"
        return None

    @_guard("pack_done_matches_request")
    def _matches_request(self, slot: _Slot, step: Step) -> str | None:
        done = step.done
        assert done is not None
        if slot.tick != done.tick or (done.generation >= 0
                                      and done.generation != slot.generation):
            return (f"INV-ORDER: pack done for tick {done.tick} generation "
                    f"{done.generation} does not match the request (tick {slot.tick} "
                    f"generation {slot.generation})")
        return None

    @_guard("tick_is_next_to_acquire_and_no_slot_hot")
    def _next_to_acquire(self, slot: _Slot, step: Step) -> str | None:
        # oldest_tick's answer (not ``pending``: a tuple of them all, at every acquire)
        expected = self._pending[0][0] if self._pending else None
        if expected is None or expected != step.tick:
            return f"INV-ORDER: ticks are acquired in request order; next is {expected}"
        if self._hot is not None:
            return (f"INV-HOT: slot {self._hot} (tick {self.hot_tick}) is still hot; "
                    "release it first")
        return None

    # -- internals ------------------------------------------------------------

    def _check_usable(self, event: Event, actor: Actor | None) -> None:
        if self._failure is not None:
            raise PipelineFailed(
                f"can't handle event {event.value} (actor={_who(actor)}): the pipeline "
                f"failed earlier: {self._failure!r}") from self._failure
        if self._closed:
            raise PipelineClosed(
                f"can't handle event {event.value} (actor={_who(actor)}): the pipeline "
                "is closed")

    def _target(self, step: Step) -> _Slot | None:
        """The slot ``step`` acts on; None only for a release with no slot HOT."""
        event = step.event
        if event is _REQUEST:
            assert step.tick is not None
            return self._slots[self.ring_slot(step.tick)]
        if event is _ACQUIRE:
            assert step.tick is not None
            where = self.slot_of(step.tick)
            return self._slots[self.ring_slot(step.tick) if where is None else where]
        if event is _RELEASE:
            return None if self._hot is None else self._slots[self._hot]
        assert step.slot is not None
        if not 0 <= step.slot < self.ring_depth:
            raise IllegalTransition(
                f"can't handle event {step.event.value}: slot {step.slot} is outside "
                f"the ring of {self.ring_depth}")
        return self._slots[step.slot]

    def _admit(self, step: Step, actor: Actor | None) -> _Slot:
        """The slot ``step`` fires on, once the table admits it; raises otherwise."""
        event = step.event
        owner = _OWNER[event]
        if self._failure is not None or self._closed:
            self._check_usable(event, owner if actor is None else actor)
        if actor is not None and owner is not None and actor is not owner:
            raise IllegalTransition(
                f"can't handle event {event.value} from actor={actor.value}: the table "
                f"gives it to {owner.value}")
        slot = self._target(step)
        if slot is None:
            states = ", ".join(f"slot {s.index} (tick {s.tick}) {s.state.name}"
                               for s in self._slots)
            raise IllegalTransition(f"can't handle event {event.value} (actor="
                                    f"{(owner or actor or Actor.LEARNER).value}): no slot "
                                    f"is HOT; states: {states}")
        row = _ROW.get((slot.state, event))  # transition_for's, without its call
        guard = _GUARD_FN[event]
        # The guard is pure, so it is asked even where the row is missing: its reason
        # ("ticks are acquired in request order") says more than "no such row".
        why = None if guard is None else guard(self, slot, step)
        if why is None and row is None:
            why = ("INV-HOST-WAR: ring full: the tick's slot in ring order is "
                   f"{slot.state.name}; acquire or release a batch first"
                   if event is Event.REQUEST else "no such transition in the table")
        if why is not None:
            tick = step.tick if step.done is None else step.done.tick
            who = (owner or actor or Actor.LEARNER).value
            raise IllegalTransition(
                f"can't handle event {event.value} for slot {slot.index} (tick "
                f"{tick if tick is not None else slot.tick}) when state={slot.state.name}, "
                f"actor={who}: {why}")
        return slot

    def _transition(self, slot: _Slot, event: Event, actor: Actor | None,
                    *, tick: int | None | _Keep = KEEP) -> None:
        source, old_tick = slot.state, slot.tick
        self._fire[event](slot)
        if tick is not KEEP:
            slot.tick = tick  # type: ignore[assignment]
        if self.observer is not None:
            self._records.append(_record((
                slot.index, old_tick if slot.tick is None else slot.tick,
                slot.generation, source, slot.state, event, _OWNER[event] or actor)))

    def _notify(self) -> None:
        """Hand the finished step's records to the observer. The step is complete
        before the first call, and every record is delivered even if one call
        raises (the first exception is re-raised after the last record)."""
        records = self._records
        if len(records) == 1:  # a learner's or a worker's step: taken off first, as below
            self.observer(records.pop())  # type: ignore[misc]
            return
        self._records = []
        error: BaseException | None = None
        for record in records:
            try:
                self.observer(record)  # type: ignore[misc]
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                error = error or exc
        if error is not None:
            raise error


def _who(actor: Actor | None) -> str:
    return "any" if actor is None else actor.value


# Per event, read once from the table: the actor that owns it and its guard's
# predicate (the core asks both at every step).
_OWNER: dict[Event, Actor | None] = {e: actor_of(e) for e in Event}
_GUARD_FN: dict[Event, Guard | None] = {
    e: None if guard_of(e) is None else GUARDS[guard_of(e)]  # type: ignore[index]
    for e in Event}
# Per (state, event), the table's row (``transition_for``'s answer), read once: the
# core asks at every step, and a dict's ``get`` is no Python call.
_ROW: dict[tuple[SlotState, Event], Transition] = {
    (s, e): row for s in SlotState for e in Event
    if (row := transition_for(s, e)) is not None}
