"""Tracing: every transition plus pack, copy and wait spans in a bounded ring,
exported as Chrome Trace Event JSON (Perfetto, chrome://tracing) or as a JSON
lines transition log for ``replay-fsm check-trace``. Off by default; when off
the pipeline does not call into this module at all."""

from __future__ import annotations

import json
import os
import threading
from collections import deque
from pathlib import Path
from typing import Any

from ..files import replacing, write_text
from ..spec import Actor
from ..wire import TransitionRecord
from .observers import Observer

PID_SLOTS, PID_ACTORS = 1, 2


TRUNCATED = "truncated"  # the kind of the first record of a log that lost its start


class Tracer(Observer):
    """Records transitions and spans in a bounded ring (the oldest drop first;
    ``dropped_transitions`` counts the transitions lost so)."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._events: deque[dict[str, Any]] = deque(maxlen=capacity)
        self.dropped_transitions = 0

    def _append(self, event: dict[str, Any]) -> None:
        events = self._events
        if len(events) == self.capacity and events[0]["kind"] == "transition":
            self.dropped_transitions += 1
        events.append(event)

    def transition(self, record: TransitionRecord, time_ns: int) -> None:
        actor = record.actor
        self._append({
            "kind": "transition", "slot": record.slot, "tick": record.tick,
            "generation": record.generation, "from": record.source.value,
            "to": record.dest.value, "event": record.event.value,
            "actor": None if actor is None else actor.value,
            "thread": threading.current_thread().name, "time_ns": time_ns,
        })

    def span(self, name: str, actor: Actor, start_ns: int, end_ns: int, *,
             tick: int | None = None, slot: int | None = None, **args: Any) -> None:
        self._append({
            "kind": "span", "name": name, "actor": actor.value, "start_ns": start_ns,
            "end_ns": end_ns, "tick": tick, "slot": slot, "args": args,
        })

    def events(self) -> list[dict[str, Any]]:
        return list(self._events)

    def transitions(self) -> list[dict[str, Any]]:
        # Over a copy (one C call): the pipeline's threads append while a run goes on,
        # and a deque mutated under a Python loop over it raises.
        return [e for e in list(self._events) if e["kind"] == "transition"]

    def write_transitions(self, path: str | os.PathLike[str]) -> Path:
        """A JSON-lines transition log, one record a line (for check-trace). A log
        that lost its first transitions to the ring's bound begins with a record of
        kind "truncated" saying how many: check-trace refuses it (a log is checked
        from the pipeline's start) instead of finding a false violation."""
        out = Path(path)
        with replacing(out) as f:
            if self.dropped_transitions:
                f.write(json.dumps({"kind": TRUNCATED,
                                    "dropped_transitions": self.dropped_transitions,
                                    "trace_capacity": self.capacity}) + "\n")
            for rec in self.transitions():
                f.write(json.dumps(rec) + "\n")
        return out

    def chrome_trace(self, *, process_name: str = "replay_fsm", pid_base: int = 0
                     ) -> dict[str, Any]:
        """Trace Event JSON: one track per slot (its state over time) and per actor."""
        events: list[dict[str, Any]] = []
        pids = {"slots": pid_base + PID_SLOTS, "actors": pid_base + PID_ACTORS}
        for key, pid in pids.items():
            events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                           "args": {"name": f"{process_name} {key}"}})
        actor_tid = {a.value: i + 1 for i, a in enumerate(Actor)}
        for actor, tid in actor_tid.items():
            events.append({"ph": "M", "name": "thread_name", "pid": pids["actors"],
                           "tid": tid, "args": {"name": actor}})
        open_state: dict[int, dict[str, Any]] = {}
        recorded = list(self._events)  # a copy, as transitions() takes
        t0 = min((e.get("time_ns", e.get("start_ns", 0)) for e in recorded), default=0)
        slots: set[int] = set()
        for e in recorded:
            if e["kind"] == "transition":
                slot = e["slot"]
                slots.add(slot)
                ts = (e["time_ns"] - t0) / 1000
                prev = open_state.pop(slot, None)
                if prev is not None:
                    prev["dur"] = max(ts - prev["ts"], 0.001)
                    events.append(prev)
                open_state[slot] = {"ph": "X", "name": e["to"], "cat": "state",
                                    "pid": pids["slots"], "tid": slot + 1, "ts": ts,
                                    "args": {"tick": e["tick"], "event": e["event"],
                                             "actor": e["actor"],
                                             "generation": e["generation"]}}
                events.append({"ph": "i", "s": "t", "name": e["event"], "cat": "transition",
                               "pid": pids["actors"],
                               "tid": actor_tid.get(e["actor"] or "", 0), "ts": ts,
                               "args": {"slot": slot, "tick": e["tick"], "from": e["from"],
                                        "to": e["to"]}})
            else:
                events.append({"ph": "X", "name": e["name"], "cat": "span",
                               "pid": pids["actors"], "tid": actor_tid[e["actor"]],
                               "ts": (e["start_ns"] - t0) / 1000,
                               "dur": max((e["end_ns"] - e["start_ns"]) / 1000, 0.001),
                               "args": {"tick": e["tick"], "slot": e["slot"], **e["args"]}})
        for slot in sorted(slots):
            events.append({"ph": "M", "name": "thread_name", "pid": pids["slots"],
                           "tid": slot + 1, "args": {"name": f"slot {slot}"}})
        for ev in open_state.values():
            ev["dur"] = 0.001
            events.append(ev)
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write_chrome(self, path: str | os.PathLike[str], **kw: Any) -> Path:
        return write_text(path, json.dumps(self.chrome_trace(**kw)))
