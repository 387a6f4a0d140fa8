"""Diagrams drawn from the transition table: Mermaid, Graphviz DOT, SVG.

Nothing here knows a state or an arrow that ``spec.TRANSITIONS`` does not list.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess

from ..errors import describe_exit, first_line
from ..spec import HANDOFFS, INITIAL, STOPPED, TERMINAL, TRANSITIONS, Actor, SlotState, Transition


def _label(t: Transition) -> str:
    actor = "any actor" if t.actor is None else t.actor.value
    return f"{t.event.value} ({actor})"


def mermaid(highlight: SlotState | None = None) -> str:
    """A Mermaid ``stateDiagram-v2`` of the slot machine."""
    lines = ["stateDiagram-v2", f"    [*] --> {INITIAL.name}"]
    for t in TRANSITIONS:
        lines.append(f"    {t.source.name} --> {t.dest.name}: {_label(t)}")
    lines += [f"    {s.name} --> [*]" for s in SlotState if s in TERMINAL]
    if highlight is not None:
        lines.append("    classDef highlight fill:#ffd54f,stroke:#e65100,stroke-width:3px")
        lines.append(f"    class {highlight.name} highlight")
    return "\n".join(lines) + "\n"


def dot(highlight: SlotState | None = None) -> str:
    """A Graphviz digraph of the slot machine."""
    lines = ["digraph slot {", '    rankdir=LR;', '    node [shape=box, style=rounded];',
             '    start [shape=point];', f"    start -> {INITIAL.name};"]
    for state in SlotState:
        attrs = ', style="rounded,filled", fillcolor="#ffd54f"' if state is highlight else ""
        lines.append(f'    {state.name} [label="{state.name}"{attrs}];')
    for t in TRANSITIONS:
        style = ', style=dashed, color="#888888"' if t.dest in STOPPED else ""
        lines.append(f'    {t.source.name} -> {t.dest.name} [label="{_label(t)}"{style}];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def dot_digest(highlight: SlotState | None = None) -> str:
    return hashlib.sha256(dot(highlight).encode()).hexdigest()


def svg(highlight: SlotState | None = None) -> str:
    """SVG rendered by Graphviz's ``dot``, stamped with the digest of its DOT source.

    Raises:
        RuntimeError: the ``dot`` program is not installed, or failed (its message).
    """
    exe = shutil.which("dot")
    if exe is None:
        raise RuntimeError("the 'dot' program (Graphviz) is not installed; "
                           "apt-get install graphviz, or use --format dot")
    done = subprocess.run([exe, "-Tsvg"], input=dot(highlight), capture_output=True,
                          text=True)
    if done.returncode:
        said = first_line(done.stderr) or "nothing on its standard error"
        raise RuntimeError(f"{exe} -Tsvg failed ({describe_exit(done.returncode)}): {said}")
    out = done.stdout
    return out + f"<!-- replay_fsm dot sha256 {dot_digest(highlight)} -->\n"


def sequence() -> str:
    """A Mermaid sequence diagram of one tick across the actors: ``spec.HANDOFFS``,
    each with the row it drives."""
    lines = ["sequenceDiagram"]
    ident = {a: a.title.replace(" ", "_") for a in Actor}
    lines += [f"    participant {ident[a]} as {a.title}" for a in Actor]
    for h in HANDOFFS:
        row = next(t for t in TRANSITIONS if t.event is h.event and t.dest not in STOPPED)
        lines.append(f"    {ident[h.sender]}->>{ident[h.receiver]}: {h.message}")
        owner = ident[row.actor] if row.actor else "any"
        lines.append(f"    Note over {owner}: slot i {row.source.name} -> {row.dest.name} "
                     f"({h.event.value})")
    return "\n".join(lines) + "\n"
