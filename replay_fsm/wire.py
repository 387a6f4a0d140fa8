"""Messages between the actors, and the two codecs that carry them.

The records are small frozen dataclasses. Across a process boundary they travel as
fixed-width int64 records (``encode`` / ``decode``, for the shared-memory channels;
the field counts come from the dataclasses, so a new field cannot be forgotten) or,
for collectors written for the seed, as its ``request`` and ``ready`` dicts
(``to_seed_dict`` / ``from_seed_dict``). Torch-free: the protocol layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from .spec import Actor, Event, SlotState

# Seeds and ticks travel as int64 records: the largest seed a request can carry.
MAX_SEED = 2**63 - 1

PACK_LAYOUT = "packed"
PACK_EXECUTOR = "collector_thread"


@dataclass(frozen=True, slots=True)
class PackRequest:
    """Learner -> packer: gather ``sample_count`` rows for ``tick`` into host slot ``slot``.

    ``min_snapshot_ptr``: the packer waits until the buffer has seen this many rows.
    """

    tick: int
    slot: int
    generation: int
    seed: int
    sample_count: int
    min_snapshot_ptr: int

    def to_seed_dict(self, *, snapshot_ptr: int, snapshot_size: int,
                     learner_hot_slot: int) -> dict[str, Any]:
        return {
            "tick_id": self.tick,
            "snapshot_ptr": snapshot_ptr,
            "snapshot_size": snapshot_size,
            "min_snapshot_ptr": self.min_snapshot_ptr,
            "sample_seed": self.seed,
            "sample_count": self.sample_count,
            "shared_slot": self.slot,
            "learner_hot_gpu_slot": learner_hot_slot,
            "target_gpu_slot": self.slot,
            "pack_layout": PACK_LAYOUT,
            "pack_executor": PACK_EXECUTOR,
            "generation": self.generation,
        }

    @classmethod
    def from_seed_dict(cls, d: dict[str, Any]) -> PackRequest:
        return cls(
            tick=int(d["tick_id"]),
            slot=int(d["shared_slot"]),
            generation=int(d.get("generation", -1)),
            seed=int(d["sample_seed"]),
            sample_count=int(d["sample_count"]),
            min_snapshot_ptr=int(d["min_snapshot_ptr"]),
        )


@dataclass(frozen=True, slots=True)
class PackDone:
    """Packer -> transfer worker: host slot ``slot`` holds the batch of ``tick``.

    ``error`` carries the packer's traceback text when packing failed.
    """

    tick: int
    slot: int
    generation: int
    seed: int
    sample_count: int
    snapshot_ptr: int
    snapshot_size: int
    pack_start_ns: int = 0
    pack_end_ns: int = 0
    error: str | None = None

    def to_seed_dict(self) -> dict[str, Any]:
        return {
            "tick_id": self.tick,
            "snapshot_ptr": self.snapshot_ptr,
            "snapshot_size": self.snapshot_size,
            "sample_seed": self.seed,
            "sample_count": self.sample_count,
            "shared_slot": self.slot,
            "target_gpu_slot": self.slot,
            "generation": self.generation,
            "pack_start_ns": self.pack_start_ns,
            "pack_end_ns": self.pack_end_ns,
        }

    @classmethod
    def from_seed_dict(cls, d: dict[str, Any]) -> PackDone:
        if int(d["shared_slot"]) != int(d["target_gpu_slot"]):
            raise ValueError(
                f"ready message for tick {d['tick_id']}: shared_slot {d['shared_slot']} "
                f"must equal target_gpu_slot {d['target_gpu_slot']}"
            )
        return cls(
            tick=int(d["tick_id"]),
            slot=int(d["shared_slot"]),
            generation=int(d.get("generation", -1)),
            seed=int(d["sample_seed"]),
            sample_count=int(d["sample_count"]),
            snapshot_ptr=int(d["snapshot_ptr"]),
            snapshot_size=int(d["snapshot_size"]),
            pack_start_ns=int(d.get("pack_start_ns", 0)),
            pack_end_ns=int(d.get("pack_end_ns", 0)),
            error=d.get("error"),
        )


@dataclass(frozen=True, slots=True)
class ReleaseToken:
    """The end of a HOT period of ``slot``: device reads of it up to here must finish
    before the slot's device buffer is overwritten (INV-DEVICE-WAR)."""

    slot: int
    tick: int
    generation: int


@dataclass(frozen=True, slots=True)
class CopyOrder:
    """Transfer worker -> copy engine: copy H[slot] to G[slot] once ``after_release``
    (the previous HOT period of this slot, if any) has been released and drained."""

    tick: int
    slot: int
    generation: int
    after_release: ReleaseToken | None


@dataclass(frozen=True, slots=True)
class TransitionRecord:
    """What the observer hook receives for every transition."""

    slot: int
    tick: int | None
    generation: int
    source: SlotState
    dest: SlotState
    event: Event
    actor: Actor | None


# -- the int-record codec ----------------------------------------------------------

Message = TypeVar("Message", "PackRequest", "PackDone")


def int_fields(cls: type[Any]) -> tuple[str, ...]:
    """The int fields of a message class, in declaration order: its record layout."""
    fields = _INT_FIELDS.get(cls)
    if fields is None:  # once per class: encode and decode run per packed tick
        fields = _INT_FIELDS[cls] = tuple(
            f.name for f in dataclasses.fields(cls) if f.type == "int")
    return fields


_INT_FIELDS: dict[type[Any], tuple[str, ...]] = {}


REQUEST_FIELDS = len(int_fields(PackRequest))
DONE_FIELDS = len(int_fields(PackDone))


def encode(message: PackRequest | PackDone) -> tuple[list[int], str | None]:
    """The int record of ``message`` and its text (a PackDone's error), for a channel."""
    values = [getattr(message, name) for name in int_fields(type(message))]
    return values, getattr(message, "error", None)


def decode(cls: type[Message], values: Sequence[int], text: str | None = None) -> Message:
    """The message of class ``cls`` from its int record (and text, for PackDone).

    Raises:
        ValueError: the record has the wrong number of fields.
    """
    names = int_fields(cls)
    if len(values) != len(names):
        raise ValueError(f"a {cls.__name__} record has {len(names)} fields, got "
                         f"{len(values)}")
    kwargs: dict[str, Any] = dict(zip(names, (int(v) for v in values), strict=True))
    if text is not None:
        kwargs["error"] = text
    return cls(**kwargs)
