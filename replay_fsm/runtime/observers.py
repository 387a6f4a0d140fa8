"""Observers of the pipeline: what happened to the slots, and how long the work took.

The core reports transitions; the pipeline adds spans (a pack, a copy, a learner
wait). Statistics and traces are observers; so can be yours
(``Pipeline.add_observer``). Observers run under the pipeline's lock, on whichever
thread made the step: keep them short and never call back into the pipeline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..spec import Actor, Event, SlotState
from ..wire import TransitionRecord


def steady_ticks(tick_s: list[float]) -> list[float]:
    """The ticks a run's tick figures are of: all but the first tenth, and never tick
    0 (its wait for warm-up data, or a trainer's collector start-up: it made a 3-tick
    SAC run's mean 50 times its steady one) unless it is the only one."""
    return tick_s[max(1, len(tick_s) // 10):] if len(tick_s) > 1 else tick_s


# Read once: a read of ``Event.ACQUIRE`` goes through the Python ``__getattr__`` hook
# of Enum's metaclass (~80 ns in CPython 3.11), and the statistics see every step.
_ACQUIRE, _REQUEST = Event.ACQUIRE, Event.REQUEST


class Observer:
    """Base class: override what you need; both hooks default to nothing."""

    def transition(self, record: TransitionRecord, time_ns: int) -> None:
        """A slot changed state (``time_ns``: ``time.monotonic_ns()`` of the step)."""

    def span(self, name: str, actor: Actor, start_ns: int, end_ns: int, *,
             tick: int | None = None, slot: int | None = None, **args: Any) -> None:
        """A piece of work: ``pack`` (packer), ``copy`` (copy engine, with ``bytes``),
        ``wait`` (learner, blocked on a batch), ``learner_pack`` (learner, packing the
        ``chunks`` of a batch the packer had not reached, within its wait; the
        batch's ``pack`` span comes with its pack-done message, before or after),
        on the monotonic clock."""


@dataclass(frozen=True)
class Statistics:
    """A snapshot of what the pipeline did so far."""

    ticks: int  # batches acquired by the learner
    requests: int
    packs: int
    learner_wait_s: float  # time the learner spent blocked waiting for a batch
    # Waits that found their batch not yet READY: each sample_large_batch that waited,
    # and each wait_until_ready that did (one per call, a timed-out one included).
    stalls: int
    bytes_moved: int  # host-to-device bytes copied
    dwell_s: dict[str, float] = field(default_factory=dict)  # per state, all slots
    checks: int = 0  # checked mode's interval checks (0 when off)
    last_copy_s: float = 0.0  # submit-to-complete time of the latest copy
    # Of the packs, those the learner made itself, in whole or in part (learner_packs),
    # and how many chunks it wrote of them (PackerHandle.chunks per pack).
    learner_packs: int = 0
    learner_chunks: int = 0


class StatisticsObserver(Observer):
    """Counts and dwell times behind ``Pipeline.statistics()``."""

    def __init__(self, ring_depth: int) -> None:
        self.ticks = self.requests = self.packs = self.stalls = self.learner_packs = 0
        self.learner_chunks = 0
        self.wait_ns = self.bytes = 0
        self.last_copy_ns = 0
        self._dwell_ns = dict.fromkeys(SlotState, 0)
        self._since = [time.monotonic_ns()] * ring_depth

    def transition(self, record: TransitionRecord, time_ns: int) -> None:
        self._dwell_ns[record.source] += time_ns - self._since[record.slot]
        self._since[record.slot] = time_ns
        event = record.event
        if event is _ACQUIRE:
            self.ticks += 1
        elif event is _REQUEST:
            self.requests += 1

    def span(self, name: str, actor: Actor, start_ns: int, end_ns: int, *,
             tick: int | None = None, slot: int | None = None, **args: Any) -> None:
        if name == "pack":
            self.packs += 1
        elif name == "learner_pack":
            self.learner_packs += 1
            self.learner_chunks += int(args.get("chunks", 1))
        elif name == "copy":
            self.bytes += int(args.get("bytes", 0))
            self.last_copy_ns = end_ns - start_ns
        elif name == "wait":
            self.stalls += 1
            self.wait_ns += end_ns - start_ns

    def snapshot(self, states: tuple[SlotState, ...], checks: int = 0) -> Statistics:
        now = time.monotonic_ns()
        dwell = dict(self._dwell_ns)
        for i, state in enumerate(states):
            dwell[state] += now - self._since[i]
        return Statistics(
            ticks=self.ticks, requests=self.requests, packs=self.packs,
            learner_wait_s=self.wait_ns / 1e9, stalls=self.stalls, bytes_moved=self.bytes,
            dwell_s={s.value: ns / 1e9 for s, ns in dwell.items()}, checks=checks,
            last_copy_s=self.last_copy_ns / 1e9, learner_packs=self.learner_packs,
            learner_chunks=self.learner_chunks)
