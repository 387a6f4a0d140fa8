"""The slot state machine as data: the single source of truth.

Every state, event and arrow of the per-slot machine lives in this module.
The runtime core builds its ``transitions`` machines from ``TRANSITIONS``; the
diagrams, the Promela skeleton, the explorer and the property-based tests are
all generated from, or checked against, the same rows. Nothing else in the
package assigns a slot state.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class _FastHash:
    """Enum members are singletons compared by identity, so an identity hash agrees
    with equality; it costs a tenth of Enum's own ``hash(self._name_)``, and the core
    hashes states and events on every step."""

    __hash__ = object.__hash__


class SlotState(_FastHash, enum.Enum):
    """Where one ring slot (host buffer H[i] plus device buffer G[i]) stands."""

    IDLE = "idle"
    REQUESTED = "requested"
    SUBMITTED = "submitted"
    READY = "ready"
    HOT = "hot"
    FAILED = "failed"
    CLOSED = "closed"


class Event(_FastHash, enum.Enum):
    REQUEST = "request"
    SUBMIT = "submit"
    COMPLETE = "complete"
    ACQUIRE = "acquire"
    RELEASE = "release"
    FAIL = "fail"
    CLOSE = "close"


class Actor(_FastHash, enum.Enum):
    LEARNER = "learner"
    PACKER = "packer"
    TRANSFER = "transfer"
    COPY_ENGINE = "copy_engine"

    @property
    def title(self) -> str:
        """The actor's name in diagrams and messages."""
        return {"transfer": "Transfer worker"}.get(
            self.value, self.value.replace("_", " ").capitalize())


@dataclass(frozen=True, slots=True)
class Transition:
    """One arrow. ``actor`` is None for ``fail``, which any actor may raise.

    ``guard`` names the core's predicate that must hold as well as the source state
    (``replay_fsm.core.GUARDS`` maps each name to it).
    """

    source: SlotState
    event: Event
    dest: SlotState
    actor: Actor | None
    guard: str | None = None


_LIVE = (
    SlotState.IDLE,
    SlotState.REQUESTED,
    SlotState.SUBMITTED,
    SlotState.READY,
    SlotState.HOT,
)

TRANSITIONS: tuple[Transition, ...] = (
    Transition(SlotState.IDLE, Event.REQUEST, SlotState.REQUESTED, Actor.LEARNER,
               guard="tick_is_next_in_ring_order"),
    Transition(SlotState.REQUESTED, Event.SUBMIT, SlotState.SUBMITTED, Actor.TRANSFER,
               guard="pack_done_matches_request"),
    Transition(SlotState.SUBMITTED, Event.COMPLETE, SlotState.READY, Actor.COPY_ENGINE),
    Transition(SlotState.READY, Event.ACQUIRE, SlotState.HOT, Actor.LEARNER,
               guard="tick_is_next_to_acquire_and_no_slot_hot"),
    Transition(SlotState.HOT, Event.RELEASE, SlotState.IDLE, Actor.LEARNER),
    *(Transition(s, Event.FAIL, SlotState.FAILED, None) for s in _LIVE),
    *(Transition(s, Event.CLOSE, SlotState.CLOSED, Actor.LEARNER)
      for s in (*_LIVE, SlotState.FAILED)),
)

INITIAL = SlotState.IDLE

# -- sets derived from the rows: every other module asks these, never a literal --

TERMINAL: frozenset[SlotState] = frozenset(
    s for s in SlotState if not any(t.source is s for t in TRANSITIONS))
# A batch can be sampled without waiting: the copy completed (READY) or it is in use (HOT).
AVAILABLE: frozenset[SlotState] = frozenset(
    {t.source for t in TRANSITIONS if t.event is Event.ACQUIRE}
    | {t.dest for t in TRANSITIONS if t.event is Event.ACQUIRE})
# Work the learner may wait on: requested but not yet complete. Liveness bounds each.
IN_FLIGHT: frozenset[SlotState] = frozenset(
    t.source for t in TRANSITIONS if t.event in (Event.SUBMIT, Event.COMPLETE))
# Requested and not yet acquired: what the ring holds ahead of the learner.
PENDING: frozenset[SlotState] = IN_FLIGHT | {
    t.source for t in TRANSITIONS if t.event is Event.ACQUIRE}
# Where the machine stops for good: after fail, and after close.
STOPPED: frozenset[SlotState] = frozenset(
    t.dest for t in TRANSITIONS if t.event in (Event.FAIL, Event.CLOSE))
# Every guard name a row carries; each resolves to one predicate of the core.
GUARDS: frozenset[str] = frozenset(t.guard for t in TRANSITIONS if t.guard is not None)


def actor_of(event: Event) -> Actor | None:
    """The actor that owns ``event`` (None: any actor, for ``fail``)."""
    return _ACTOR[event]


def guard_of(event: Event) -> str | None:
    """The guard name of ``event``'s rows (None: the source state suffices)."""
    return _GUARD[event]


# One actor and one guard per event, whatever its source state: the core relies on it.
_ACTOR: dict[Event, Actor | None] = {t.event: t.actor for t in TRANSITIONS}
_GUARD: dict[Event, str | None] = {t.event: t.guard for t in TRANSITIONS}
assert all(_ACTOR[t.event] is t.actor and _GUARD[t.event] == t.guard for t in TRANSITIONS)

# The main cycle in order, for renderers and models that draw or walk it.
CYCLE: tuple[Event, ...] = (
    Event.REQUEST, Event.SUBMIT, Event.COMPLETE, Event.ACQUIRE, Event.RELEASE,
)


@dataclass(frozen=True, slots=True)
class Handoff:
    """What moves between actors around one event of the cycle (the sequence diagram)."""

    event: Event
    sender: Actor
    receiver: Actor
    message: str


HANDOFFS: tuple[Handoff, ...] = (
    Handoff(Event.REQUEST, Actor.LEARNER, Actor.PACKER,
            "pack request (tick t, slot i, seed)"),
    Handoff(Event.SUBMIT, Actor.PACKER, Actor.TRANSFER, "pack done: H[i] holds tick t"),
    Handoff(Event.COMPLETE, Actor.TRANSFER, Actor.COPY_ENGINE,
            "copy H[i] to G[i] after release of G[i]"),
    Handoff(Event.ACQUIRE, Actor.COPY_ENGINE, Actor.LEARNER,
            "ready event: G[i] holds tick t"),
    Handoff(Event.RELEASE, Actor.LEARNER, Actor.COPY_ENGINE,
            "release event: reads of G[i] done"),
)

INVARIANTS: dict[str, str] = {
    "INV-HOT": "At most one slot is HOT.",
    "INV-ORDER": "Ticks are requested consecutively, assigned to slots in ring order, "
                 "and acquired in request order, each exactly once.",
    "INV-HOST-WAR": "H[i] is written (by the packer, or by the learner packing in its "
                    "place) only while slot i is REQUESTED, never while a copy from H[i] "
                    "may be in flight, every chunk of a request by one writer.",
    "INV-DEVICE-WAR": "A copy into G[i] starts only after every learner read of G[i] from "
                      "its previous HOT period has finished.",
    "INV-RAW": "The learner reads G[i] only while HOT and only after the copy into it "
               "completed.",
    "INV-DATA": "The batch for tick t is exactly storage[randint(0, snapshot_size, (n,), "
                "seed=base_seed + t)], bit for bit, on every backend and ring depth.",
    "INV-ROW": "Every packed row equals one transition as written by add, even while "
               "add runs concurrently; rows a writer killed inside its add left half "
               "written raise WriterDied instead of being handed out.",
    "INV-LIVE": "With a live packer and enough data every requested tick becomes READY; "
                "a dead or failed packer makes the learner raise within a bounded time, "
                "and so do rows that stop coming while a tick waits for them "
                "(DataStalled).",
    "INV-STICKY": "After a failure every call raises an error chained to the cause; an "
                  "illegal call raises and leaves every state unchanged.",
    "INV-CLOSE": "close() joins every thread, drains in-flight copies, unregisters "
                 "page-locked memory, lets go of the slots and is idempotent.",
}


def transition_for(source: SlotState, event: Event) -> Transition | None:
    """The row for (source, event), or None when the machine forbids it."""
    return _BY_KEY.get((source, event))


_BY_KEY: dict[tuple[SlotState, Event], Transition] = {
    (t.source, t.event): t for t in TRANSITIONS
}
