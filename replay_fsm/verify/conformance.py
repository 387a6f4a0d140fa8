"""Trace conformance: replay a recorded transition log on a real ``Core`` and report
the first record the core refuses, or that differs from what the core did.

A log is a sequence of records with keys slot, tick, from, to, event, actor (and
optionally generation, thread, time_ns), as ``Tracer.write_transitions`` writes:
JSON lines, or a JSON list. Works for a log from any run, a GPU run included.
The core is the judge, so the table, the guards and the invariants the core checks
are the ones the runtime ran with; nothing here keeps a second copy of them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core import MAX_RING_DEPTH, Core, require_asserts
from ..errors import PipelineClosed, PipelineFailed, ProtocolError, first_line
from ..runtime.tracer import TRUNCATED
from ..spec import Actor, Event, SlotState
from ..wire import PackDone, TransitionRecord

_KEYS = ("slot", "from", "to", "event")


class TraceFileError(ValueError):
    """A transition log that cannot be read: missing, not JSON, or not a log; or one
    that cannot be checked: it lost its start to the tracer's bound."""


def truncated(dropped: object, capacity: object) -> str:
    """Why a log that lost its first ``dropped`` transitions cannot be checked (None:
    a record that does not say)."""
    kept = "a bounded number of" if capacity is None else f"only its last {capacity}"
    lost = "its first" if dropped is None else f"the first {dropped}"
    return (f"the tracer kept {kept} events and dropped {lost} transitions: a log is "
            f"checked from the pipeline's start, where every slot is IDLE (trace with a "
            f"larger trace_capacity)")


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
        where = "" if self.index is None else f" at record #{self.index}"
        why = _shown(self.violation, 2 * CONTEXT_CHARS)  # it may quote a field's value
        if not self.context:  # an empty log: no record to show
            return f"violation{where}: {why}"
        ctx = "\n".join(f"    #{c['index']}: {_shown(c['record'])}" for c in self.context)
        return f"violation{where}: {why}\n  context:\n{ctx}"


CONTEXT_CHARS = 400  # of a record shown beside a violation (a field may hold megabytes)


def _shown(value: object, limit: int = CONTEXT_CHARS) -> str:
    """``value`` as a report prints it: cut at ``limit`` characters, saying so."""
    text = str(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} characters more)"


def _kind(text: str) -> str:
    """What a log was read as: a JSON list where it starts with '[' (after blanks)."""
    return "a JSON list (it starts with '[')" if text.startswith("[") else "JSON lines"


def _one_document(text: str) -> object:
    """``text`` read as one JSON document, or None where it is not one."""
    if not text.startswith("{"):
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        return None


def _not_a_log(path: str | Path, document: dict[str, Any]) -> str:
    """Why ``path``, one JSON object, is not a transition log: a Chrome trace, or
    another object (the demo's summary.json), named by its first keys."""
    if "traceEvents" in document:
        return (f"{path} is a Chrome trace (trace.json); check-trace reads the "
                "transition log (transitions.jsonl)")
    keys = ", ".join(map(str, list(document)[:5])) + (", ..." if len(document) > 5 else "")
    return (f"{path} is one JSON object (keys: {_shown(keys, 120)}), not a transition "
            "log: one record a line (transitions.jsonl), or a JSON list of them")


def load(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines or JSON-list transition log.

    Raises:
        TraceFileError: the file is missing or unreadable, is not JSON, or holds
            something other than transition records (a Chrome trace, say).
    """
    if not str(path):
        raise TraceFileError("no file named: the path is empty")
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise TraceFileError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise TraceFileError(f"{path} is not text (JSON lines): byte {exc.start} is not "
                             f"{exc.encoding}") from exc
    stripped = text.lstrip()
    number, line = 0, ""  # the file's line being read (json's lineno counts in that line)
    try:
        if stripped.startswith("["):
            records = json.loads(text)
        else:
            records = []
            for at, line in enumerate(text.split("\n"), 1):  # not \x0c, U+2028...
                number = at
                if line.strip():
                    records.append(json.loads(line))
    except json.JSONDecodeError as exc:
        whole = _one_document(stripped)  # one object over several lines: what it is
        if isinstance(whole, dict):
            raise TraceFileError(_not_a_log(path, whole)) from exc
        # a record cut inside: a last line with no end of line that begins as one
        cut = (" (the file's last line, with no end of line: the log was cut short)"
               if number and number == text.count("\n") + 1
               and line.lstrip().startswith("{") else "")
        raise TraceFileError(f"{path} is not {_kind(stripped)}: line "
                             f"{number or exc.lineno}: {exc.msg}{cut}") from exc
    except (ValueError, RecursionError) as exc:  # a number too long, nesting too deep
        where = f"line {number}: " if number else ""
        raise TraceFileError(f"{path} is not {_kind(stripped)}: {where}"
                             f"{first_line(str(exc))}") from exc
    if len(records) == 1 and isinstance(records[0], dict) and "traceEvents" in records[0]:
        raise TraceFileError(_not_a_log(path, records[0]))
    if not isinstance(records, list):
        raise TraceFileError(f"{path}: expected a list of transition records")
    if records and isinstance(records[0], dict) and records[0].get("kind") == TRUNCATED:
        why = truncated(records[0].get("dropped_transitions"),
                        records[0].get("trace_capacity"))
        raise TraceFileError(f"{path} cannot be checked: {why}")
    for i, rec in enumerate(records):
        if not isinstance(rec, dict) or any(k not in rec for k in _KEYS):
            raise TraceFileError(f"{path}: record #{i} is not a transition record (needs "
                                 f"{', '.join(_KEYS)}): {str(rec)[:120]}")
    return records


def _not_an_int(record: dict[str, Any]) -> str | None:
    """Why ``record``'s tick or generation is malformed (neither may be a bool, a float
    or a string), or None; either may be absent or null (not logged)."""
    for name in ("tick", "generation"):
        value = record.get(name)
        if value is not None and type(value) is not int:
            return f"malformed record: {name} {value!r} is not an int"
    return None


_NAMES: tuple[tuple[str, str, tuple[str, ...]], ...] = tuple(
    (key, word, tuple(m.value for m in names)) for key, word, names in (
        ("from", "state", SlotState), ("to", "state", SlotState),
        ("event", "event", Event), ("actor", "actor", Actor)))


def _unknown_name(record: dict[str, Any]) -> str | None:
    """Why ``record`` names a state, an event or an actor this table lacks (a log of
    another version, or of something else), or None."""
    for key, word, names in _NAMES:
        value = record.get(key)
        if isinstance(value, str) and value not in names:
            known = ", ".join(names)
            return (f"{key} {_shown(repr(value), 80)} is not a {word} of this "
                    f"version's table ({known}): a log of another version, or not a "
                    "replay_fsm log")
    return None


def _invariant(exc: BaseException) -> str:
    """The catalogue ID an error of the core stands for, in the report's words."""
    if isinstance(exc, PipelineFailed):
        return "INV-STICKY: a step after the failure"
    if isinstance(exc, PipelineClosed):
        return "a step after close"
    return "illegal step"


def check(records: Iterable[dict[str, Any]], *, context: int = 5) -> Report:
    """Replay ``records`` on a real core; stop at the first one it refuses or at the
    first disagreement between the log and the transitions the core made.

    An empty log is a violation: it proves nothing.

    Raises:
        RuntimeError: asserts are off (``python -O``): the invariants would go unchecked.
    """
    require_asserts("check")
    recs = list(records)
    report = Report(records=len(recs))
    if not recs:
        report.violation = "the log is empty: no transition to check"
        return report

    def bad(i: int, why: str) -> Report:
        report.violation, report.index = why, i
        lo = max(0, i - context)
        report.context = [{"index": k, "record": recs[k]} for k in range(lo, i + 1)]
        return report

    depth = 0
    for i, r in enumerate(recs):  # the ring's size first: the largest slot named
        slot = r.get("slot") if isinstance(r, dict) else None
        if type(slot) is not int:
            return bad(i, f"malformed record: slot {slot!r} is not an int")
        if not 0 <= slot < MAX_RING_DEPTH:
            return bad(i, f"malformed record: slot {slot} is outside any ring (0 to "
                          f"{MAX_RING_DEPTH - 1})")
        depth = max(depth, slot + 1)
    last_ns: int | None = None  # the tracer stamps records in the order the core made them
    for i, r in enumerate(recs):
        stamp = r.get("time_ns")
        if stamp is None:  # not logged
            continue
        if type(stamp) is not int:  # a float, a string, NaN: no order to check by
            return bad(i, f"malformed record: time_ns {stamp!r} is not an int")
        if last_ns is not None and stamp < last_ns:
            return bad(i, f"records out of order: time_ns {stamp} is earlier than the "
                          f"record before it ({last_ns}); the tracer logs transitions in "
                          "the order the core made them")
        last_ns = stamp
    if depth < 2:
        return bad(0, "the log names only slot 0; a ring has at least 2 slots")
    # The log does not say the ring's size, and one written before close or a failure
    # (each names every slot) may not name them all: a run resumed at tick N > 0 fills
    # slot N mod D first. Such a log's ring is the smallest in which every logged tick
    # sits in its slot (tick mod depth); where none is, the largest slot's, and the
    # replay below reports the record out of ring order.
    if not any(r.get("event") in ("close", "fail") for r in recs):
        ticked = {(r["slot"], r["tick"]) for r in recs
                  if type(r.get("tick")) is int and r["tick"] >= 0}
        for size in range(depth, MAX_RING_DEPTH + 1):
            if all(tick % size == slot for slot, tick in ticked):
                depth = size
                break
    report.slots = depth
    made: list[TransitionRecord] = []
    core = Core(depth, observer=made.append)
    i = 0
    while i < len(recs):
        r = recs[i]
        unknown = _unknown_name(r)
        if unknown:
            return bad(i, unknown)
        try:
            slot, src = int(r["slot"]), SlotState(r["from"])
            event = Event(r["event"])
            actor = None if r.get("actor") is None else Actor(r["actor"])
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            return bad(i, f"malformed record: {exc!r}")
        tick, generation = r.get("tick"), r.get("generation")  # None: not logged
        malformed = _not_an_int(r)
        if malformed:
            return bad(i, malformed)
        if tick is None and event in (Event.REQUEST, Event.ACQUIRE):
            return bad(i, f"malformed record: a {event.value} record must name its tick")
        if slot >= depth or src is not core.state(slot):
            return bad(i, f"slot {slot} is {core.state(slot).name} but the record leaves "
                          f"{src.name}")
        made.clear()
        try:
            if event is Event.REQUEST:
                core.request(-1 if tick is None else tick, actor=actor)
            elif event is Event.SUBMIT:  # a tick not logged: the one the slot holds
                held = core.tick_of(slot)
                core.packed(PackDone(tick=tick if tick is not None else
                                     -1 if held is None else held, slot=slot,
                                     generation=-1 if generation is None else generation,
                                     seed=0, sample_count=0,
                                     snapshot_ptr=0, snapshot_size=0), actor=actor)
            elif event is Event.COMPLETE:
                core.copied(slot, actor=actor)
            elif event is Event.ACQUIRE:
                core.acquire(-1 if tick is None else tick, actor=actor)
            elif event is Event.RELEASE:
                core.release(actor=actor)
            elif event is Event.FAIL:
                core.fail(RuntimeError("failure recorded in the log"), actor)
            else:
                core.close()
        except (ProtocolError, PipelineFailed, TypeError, ValueError) as exc:
            return bad(i, f"{_invariant(exc)}: {exc}")
        if not made:
            return bad(i, f"{event.value} changed nothing in the core (a second "
                          f"{event.value} is a no-op) but the log records a transition")
        for k, rec in enumerate(made):
            j = i + k
            if j >= len(recs):
                return bad(len(recs) - 1, f"the log ends inside {event.value}: slot "
                                          f"{rec.slot} is missing")
            logged = recs[j]
            malformed = _not_an_int(logged)  # a close's or a fail's later records too
            if malformed:
                return bad(j, malformed)
            want = (rec.slot, rec.source.value, rec.dest.value, rec.event.value)
            got = tuple(logged.get(key) for key in _KEYS)
            if tuple(str(x) for x in got) != tuple(str(x) for x in want):
                return bad(j, f"the core made {want[1]} --{want[3]}--> {want[2]} on slot "
                              f"{want[0]}, the log records {got[1]} --{got[3]}--> {got[2]} "
                              f"on slot {got[0]}")
            actor_logged = logged.get("actor")  # None: not logged
            if (actor_logged is not None and rec.actor is not None
                    and actor_logged != rec.actor.value):
                return bad(j, f"the table gives {rec.event.value} to {rec.actor.value}, "
                              f"the record names actor {actor_logged!r}")
            for name, want_value in (("tick", rec.tick), ("generation", rec.generation)):
                value = logged.get(name)
                if want_value is not None and value is not None and value != want_value:
                    return bad(j, f"slot {rec.slot} holds {name} {want_value} but the "
                                  f"record names {name} {value!r}")
            report.rows_seen.add((rec.source.value, rec.event.value))
        try:
            core.check_invariants()
        except AssertionError as exc:  # pragma: no cover - the core refuses first
            return bad(i, f"invariant broken: {exc}")
        i += len(made)
    return report
