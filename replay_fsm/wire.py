"""Messages between the actors, and the two codecs that carry them.

The records are small frozen dataclasses. Across a process boundary they travel as
fixed-width int64 records (``encode`` / ``decode``, for the shared-memory channels;
the field counts come from the dataclasses, so a new field cannot be forgotten) or,
for collectors written for the seed, as its request and ready dicts (``SeedRequest``,
``SeedReady``: the seed's keys, its values, its errors). Torch-free: the protocol
layer.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

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


class TransitionRecord(NamedTuple):
    """What the observer hook receives for every transition. A named tuple rather
    than a frozen dataclass like the messages: it is made for every transition, and
    builds in a third of the time."""

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
    cls = type(message)
    read = _READERS.get(cls)
    if read is None:  # once per class, as int_fields: one C call per message after
        # A tuple of the values: each message class has several int fields.
        read = _READERS[cls] = operator.attrgetter(*int_fields(cls))
    return list(read(message)), getattr(message, "error", None)


_READERS: dict[type[Any], Callable[[Any], tuple[Any, ...]]] = {}


def decode(cls: type[Message], values: Sequence[int], text: str | None = None) -> Message:
    """The message of class ``cls`` from its int record (and text, for PackDone).

    Raises:
        ValueError: the record has the wrong number of fields.
    """
    names = int_fields(cls)
    if len(values) != len(names):
        raise ValueError(f"a {cls.__name__} record has {len(names)} fields, got "
                         f"{len(values)}")
    kwargs: dict[str, Any] = dict(zip(names, map(int, values), strict=True))
    if text is not None:
        kwargs["error"] = text
    return cls(**kwargs)


# -- the seed's dicts ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SeedRequest:
    """The seed's request dict, key for key and in its order: what a collector written
    for the seed reads from ``collector_pack_request_queue``. Every number is a plain
    int, frozen when the request was made."""

    tick_id: int
    snapshot_ptr: int
    snapshot_size: int
    min_snapshot_ptr: int
    sample_seed: int
    sample_count: int
    shared_slot: int
    learner_hot_gpu_slot: int
    target_gpu_slot: int
    pack_layout: str = PACK_LAYOUT
    pack_executor: str = PACK_EXECUTOR

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _SEED_REQUEST_KEYS}


_SEED_REQUEST_KEYS = tuple(f.name for f in dataclasses.fields(SeedRequest))


@dataclass(frozen=True, slots=True)
class SeedReady:
    """What the seed's learner reads of a ready dict from ``collector_pack_ready_queue``
    (collectors add more keys; those are ignored, as the seed ignored them)."""

    tick_id: int
    snapshot_ptr: int
    snapshot_size: int
    sample_seed: int
    sample_count: int
    shared_slot: int
    target_gpu_slot: int
    pack_begin_ns: int = 0
    pack_end_ns: int = 0

    @classmethod
    def from_dict(cls, d: Any) -> SeedReady:
        """Read a ready dict as the seed did, with the seed's errors.

        ``pack_begin_ns`` and ``pack_end_ns`` (traces only) are 0 when missing or not
        integers.

        Raises:
            KeyError: a key the seed reads is missing (the first one, in the seed's
                order).
            TypeError, ValueError: a value is not an integer.
            RuntimeError: ``shared_slot`` differs from ``target_gpu_slot`` (the seed's
                message).
        """
        values = {name: int(d[name]) for name in _SEED_READY_REQUIRED}
        ready = cls(**values, pack_begin_ns=_timestamp(d, "pack_begin_ns"),
                    pack_end_ns=_timestamp(d, "pack_end_ns"))
        if ready.shared_slot != ready.target_gpu_slot:
            raise RuntimeError("collector_thread shared slot must match target GPU slot")
        return ready


_SEED_READY_REQUIRED = tuple(f.name for f in dataclasses.fields(SeedReady)
                             if f.default is dataclasses.MISSING)


def _timestamp(d: Any, key: str) -> int:
    """A pack timestamp of a ready dict, for traces only: the seed never read these
    keys, so one missing or not an integer (None, a string) is 0, not an error."""
    try:
        return int(d[key])
    except (KeyError, TypeError, ValueError, OverflowError):
        return 0
