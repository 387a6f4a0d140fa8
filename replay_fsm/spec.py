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


class SlotState(enum.Enum):
    """Where one ring slot (host buffer H[i] plus device buffer G[i]) stands."""

    IDLE = "idle"
    REQUESTED = "requested"
    SUBMITTED = "submitted"
    READY = "ready"
    HOT = "hot"
    FAILED = "failed"
    CLOSED = "closed"


class Event(enum.Enum):
    REQUEST = "request"
    SUBMIT = "submit"
    COMPLETE = "complete"
    ACQUIRE = "acquire"
    RELEASE = "release"
    FAIL = "fail"
    CLOSE = "close"


class Actor(enum.Enum):
    LEARNER = "learner"
    PACKER = "packer"
    TRANSFER = "transfer"
    COPY_ENGINE = "copy_engine"


@dataclass(frozen=True, slots=True)
class Transition:
    """One arrow. ``actor`` is None for ``fail``, which any actor may raise."""

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
TERMINAL = frozenset({SlotState.CLOSED})

# The main cycle in order, for renderers and models that draw or walk it.
CYCLE: tuple[Event, ...] = (
    Event.REQUEST, Event.SUBMIT, Event.COMPLETE, Event.ACQUIRE, Event.RELEASE,
)

INVARIANTS: dict[str, str] = {
    "INV-HOT": "At most one slot is HOT.",
    "INV-ORDER": "Ticks are requested consecutively, assigned to slots in ring order, "
                 "and acquired in request order, each exactly once.",
    "INV-HOST-WAR": "The packer writes H[i] only while slot i is REQUESTED, never while "
                    "a copy from H[i] may be in flight.",
    "INV-DEVICE-WAR": "A copy into G[i] starts only after every learner read of G[i] from "
                      "its previous HOT period has finished.",
    "INV-RAW": "The learner reads G[i] only while HOT and only after the copy into it "
               "completed.",
    "INV-DATA": "The batch for tick t is exactly storage[randint(0, snapshot_size, (n,), "
                "seed=base_seed + t)], bit for bit, on every backend and ring depth.",
    "INV-ROW": "Every packed row equals one transition as written by add, even while "
               "add runs concurrently.",
    "INV-LIVE": "With a live packer and enough data every requested tick becomes READY; "
                "a dead or failed packer makes the learner raise within a bounded time.",
    "INV-STICKY": "After a failure every call raises an error chained to the cause; an "
                  "illegal call raises and leaves every state unchanged.",
    "INV-CLOSE": "close() joins every thread, drains in-flight copies, unregisters "
                 "page-locked memory and is idempotent.",
}


def transition_for(source: SlotState, event: Event) -> Transition | None:
    """The row for (source, event), or None when the machine forbids it."""
    return _BY_KEY.get((source, event))


_BY_KEY: dict[tuple[SlotState, Event], Transition] = {
    (t.source, t.event): t for t in TRANSITIONS
}
