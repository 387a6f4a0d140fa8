"""Trace conformance: replay a recorded transition log against the table and the
invariants, and report the first violation with its context.

A log is a sequence of records with keys slot, tick, from, to, event, actor (and
optionally generation, thread, time_ns), as ``Tracer.write_transitions`` writes:
JSON lines, or a JSON list. Works for a log from any run, a GPU run included.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..spec import INITIAL, Event, SlotState, transition_for


@dataclass
class Report:
    records: int = 0
    slots: int = 0
    violation: str | None = None
    index: int | None = None
    context: list[dict[str, Any]] = field(default_factory=list)
    rows_seen: set[tuple[str, str]] = field(default_factory=set)

    @property
    def ok(self) -> bool:
        return self.violation is None

    def __str__(self) -> str:
        if self.ok:
            return (f"ok: {self.records} transitions over {self.slots} slots conform to the "
                    f"table and the invariants ({len(self.rows_seen)} distinct rows)")
        ctx = "\n".join(f"    #{c['index']}: {c['record']}" for c in self.context)
        return f"violation at record #{self.index}: {self.violation}\n  context:\n{ctx}"


def load(path: str | Path) -> list[dict[str, Any]]:
    text = Path(path).read_text()
    stripped = text.lstrip()
    if stripped.startswith("["):
        return list(json.loads(text))
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def check(records: Iterable[dict[str, Any]], *, context: int = 5) -> Report:
    """Replay ``records``; stop at the first violation of the table or of INV-HOT,
    INV-ORDER or INV-STICKY."""
    recs = list(records)
    report = Report(records=len(recs))
    state: dict[int, SlotState] = {}
    holds: dict[int, int | None] = {}
    requested: list[tuple[int, int]] = []  # (tick, slot) in request order
    acquired: list[int] = []
    failed = closed = False
    depth = 1 + max((int(r["slot"]) for r in recs), default=-1)
    report.slots = depth

    def bad(i: int, why: str) -> Report:
        report.violation, report.index = why, i
        lo = max(0, i - context)
        report.context = [{"index": k, "record": recs[k]} for k in range(lo, i + 1)]
        return report

    for i, r in enumerate(recs):
        try:
            slot, src = int(r["slot"]), SlotState(r["from"])
            dst, event = SlotState(r["to"]), Event(r["event"])
        except (KeyError, ValueError) as exc:
            return bad(i, f"malformed record: {exc!r}")
        tick = r.get("tick")
        current = state.get(slot, INITIAL)
        if src is not current:
            return bad(i, f"slot {slot} is {current.name} but the record leaves {src.name}")
        row = transition_for(src, event)
        if row is None or row.dest is not dst:
            return bad(i, f"no table row {src.name} --{event.value}--> {dst.name}")
        if failed and event is not Event.FAIL and event is not Event.CLOSE:
            return bad(i, f"INV-STICKY: {event.value} after a failure")
        if closed and event is not Event.CLOSE:
            return bad(i, f"{event.value} after close")
        report.rows_seen.add((src.value, event.value))
        state[slot] = dst
        if event is Event.REQUEST:
            if requested and tick != requested[-1][0] + 1:
                return bad(i, f"INV-ORDER: tick {tick} requested after {requested[-1][0]}")
            if requested and slot != (requested[-1][1] + 1) % depth:
                return bad(i, f"INV-ORDER: tick {tick} went to slot {slot}, not the next "
                           "in ring order")
            requested.append((int(tick or 0), slot))
            holds[slot] = tick
        elif event is Event.ACQUIRE:
            if sum(s is SlotState.HOT for s in state.values()) > 1:
                return bad(i, "INV-HOT: two slots are hot")
            expected = requested[len(acquired)][0] if len(acquired) < len(requested) else None
            if tick != expected:
                return bad(i, f"INV-ORDER: acquired tick {tick}, expected {expected}")
            acquired.append(int(tick or 0))
        elif event is Event.SUBMIT or event is Event.COMPLETE:
            if holds.get(slot) != tick:
                return bad(i, f"slot {slot} holds tick {holds.get(slot)} but the record "
                           f"names tick {tick}")
        elif event is Event.FAIL:
            failed = True
        elif event is Event.CLOSE:
            closed = True
    return report
