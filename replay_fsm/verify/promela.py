"""The Promela skeleton of the slot machine, generated from the table.

``specs/slot_table.pml`` is this module's output; the SPIN model includes it and
fires every state change through its ``fire`` inline, so the model cannot drift
from ``spec.TRANSITIONS`` (a test regenerates and compares the committed file).
"""

from __future__ import annotations

from ..spec import TRANSITIONS, Event, SlotState


def slot_table() -> str:
    states = ", ".join(s.name for s in SlotState)
    events = ", ".join(f"ev_{e.value}" for e in Event)
    lines = [
        "/* Generated from replay_fsm.spec.TRANSITIONS by replay_fsm.verify.promela: do not edit.",
        "   Regenerate: python -c 'from replay_fsm.verify.promela import slot_table;"
        " print(slot_table(), end=\"\")' > specs/slot_table.pml */",
        f"mtype = {{ {states} }};",
        f"mtype = {{ {events} }};",
        "",
        "/* Fire event ev on slot i: a row of the table, or an assertion failure. */",
        "inline fire(i, ev) {",
        "  if",
    ]
    for t in TRANSITIONS:
        lines.append(f"  :: st[i] == {t.source.name} && ev == ev_{t.event.value} -> "
                     f"st[i] = {t.dest.name}")
    lines += ["  :: else -> assert(false) /* no such row */", "  fi", "}", ""]
    return "\n".join(lines)
