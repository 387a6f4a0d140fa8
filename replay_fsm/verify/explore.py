"""Exhaustive exploration of the real core's interleavings (the way loom does it).

Breadth-first search over every reachable state of the actual ``Core`` driven by
every enabled actor step, with a small model of the buffers around it: the
packer writing H[i], copy orders, the copy engine writing G[i], and the
learner's device reads of G[i], which may outlive ``release``. In every state
the core's ``check_invariants()`` and the catalogue's safety invariants hold, or
the shortest path to the violation is reported (and printed as a regression
test). At the end every state with unfinished ticks must reach completion.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transitions import MachineError

from ..core import Core, Step, as_count, require_asserts
from ..errors import ReplayFSMError
from ..spec import Event, SlotState
from ..wire import CopyOrder, PackDone

Action = tuple[str, str, int]  # (actor, step, slot or tick)


@dataclass
class World:
    core: Core
    ticks: int
    htick: list[int | None]
    packed: list[bool]
    order: list[CopyOrder | None]
    copying: list[bool]
    gtick: list[int | None]
    reads: list[int | None]
    acquired: list[int] = field(default_factory=list)
    released: int = 0
    faulted: bool = False

    @classmethod
    def initial(cls, core: Core, ticks: int) -> World:
        d = core.ring_depth
        return cls(core, ticks, [None] * d, [False] * d, [None] * d, [False] * d,
                   [None] * d, [None] * d)

    def key(self) -> tuple[Any, ...]:
        return (self.core.key(), tuple(self.htick), tuple(self.packed),
                tuple(self.order), tuple(self.copying), tuple(self.gtick),
                tuple(self.reads), len(self.acquired), self.released, self.faulted)

    @property
    def done(self) -> bool:
        return self.released == self.ticks

    @property
    def terminal(self) -> bool:
        return self.done or self.core.closed or self.core.failure is not None


def enabled(w: World, faults: bool) -> list[Action]:
    """Every step some actor can take in ``w``. The learner's and the transfer
    worker's steps are the ones the real core would accept (``Core.allows``); the
    packer, the copy engine and the device follow the buffer model around it."""
    c = w.core
    out: list[Action] = []
    live = c.allows(Step(Event.FAIL))
    d = c.ring_depth
    if live:
        nxt = 0 if c.next_tick is None else c.next_tick
        if nxt < w.ticks and c.allows(Step(Event.REQUEST, tick=nxt)):
            out.append(("learner", "request", nxt))
        if c.pending and c.allows(Step(Event.ACQUIRE, tick=c.pending[0][0])):
            out.append(("learner", "acquire", c.pending[0][0]))
        if c.allows(Step(Event.RELEASE)):
            out.append(("learner", "release", c.hot_slot))  # type: ignore[arg-type]
        for i in range(d):
            # The packer serves requested slots whose rows it has not written yet.
            if (c.state(i) is SlotState.REQUESTED and not w.packed[i]
                    and w.htick[i] != c.tick_of(i)):
                out.append(("packer", "pack", i))
            if w.packed[i] and c.allows(Step(Event.SUBMIT, slot=i, done=_done(c, i))):
                out.append(("transfer", "submit", i))
            order = w.order[i]
            if order is not None and not w.copying[i]:
                dep = order.after_release
                if dep is None or w.reads[dep.slot] != dep.tick:
                    out.append(("copy_engine", "copy_start", i))
            if w.copying[i]:
                out.append(("copy_engine", "copy_done", i))
    for i in range(d):
        if w.reads[i] is not None and c.hot_slot != i:
            out.append(("device", "reads_finish", i))
    if faults and live:
        out.append(("any", "fail", 0))
        out.append(("learner", "close", 0))
    return out


def _done(c: Core, slot: int) -> PackDone:
    """The pack-done message the packer sends for what ``slot`` holds now."""
    return PackDone(c.tick_of(slot) or 0, slot, c.generation_of(slot), 0, 1, 1, 1)


def apply(w: World, action: Action) -> None:
    """Perform ``action`` on ``w``; raises AssertionError on a broken invariant."""
    c = w.core
    actor, step, arg = action
    if step == "request":
        c.request(arg)  # H[i] keeps its stale rows until the packer writes it
    elif step == "acquire":
        slot = c.slot_of(arg)
        assert slot is not None
        assert not w.copying[slot] and w.gtick[slot] == arg, (
            f"INV-RAW: tick {arg} acquired from G[{slot}] holding tick {w.gtick[slot]}")
        c.acquire(arg)
        w.acquired.append(arg)
        w.reads[slot] = arg
    elif step == "release":
        c.release()
        w.released += 1
    elif step == "pack":
        assert not w.copying[arg], f"INV-HOST-WAR: packer writes H[{arg}] during a copy"
        w.htick[arg] = c.tick_of(arg)
        w.packed[arg] = True
    elif step == "submit":
        w.order[arg] = c.packed(_done(c, arg))
        w.packed[arg] = False
    elif step == "copy_start":
        assert w.reads[arg] is None, (
            f"INV-DEVICE-WAR: copy into G[{arg}] while reads of tick {w.reads[arg]} "
            "are in flight")
        w.copying[arg] = True
    elif step == "copy_done":
        order = w.order[arg]
        assert order is not None
        w.copying[arg] = False
        w.order[arg] = None
        w.gtick[arg] = w.htick[arg]
        c.copied(arg)
    elif step == "reads_finish":
        w.reads[arg] = None
    elif step == "fail":
        c.fail(RuntimeError("explored fault"))
        w.faulted = True
    elif step == "close":
        c.close()
    else:  # pragma: no cover - the action list above is closed
        raise ValueError(step)


def check_state(w: World) -> None:
    c = w.core
    c.check_invariants()
    assert sum(s is SlotState.HOT for s in c.states) <= 1, "INV-HOT"
    first = w.acquired[0] if w.acquired else 0
    assert w.acquired == list(range(first, first + len(w.acquired))), "INV-ORDER"
    for i in range(c.ring_depth):
        assert not (w.copying[i] and w.reads[i] is not None), f"INV-DEVICE-WAR: G[{i}]"


def describe(action: Action) -> str:
    actor, step, arg = action
    what = "tick" if step in ("request", "acquire") else "slot"
    return f"{actor}: {step}({what} {arg})" if step not in ("fail", "close") else (
        f"{actor}: {step}()")


@dataclass
class Result:
    depth: int
    ticks: int
    faults: bool = False
    states: int = 0
    transitions: int = 0
    complete_states: int = 0
    violation: str | None = None
    path: list[Action] = field(default_factory=list)
    stuck: int = 0  # non-terminal states from which completion is unreachable

    @property
    def ok(self) -> bool:
        return self.violation is None and self.stuck == 0

    def steps(self) -> list[str]:
        return [describe(a) for a in self.path]

    def regression_test(self, name: str = "test_explored_counterexample") -> str:
        """Pytest source replaying the path on the real ``Core``: the last step must
        either not be enabled there or leave every invariant holding."""
        # the violation may hold quotes or backslashes (a MachineError's message does)
        why = str(self.violation).replace("\\", "\\\\").replace('"', '\\"')
        lines = [f"def {name}() -> None:",
                 f'    """Found by replay_fsm.explore at depth {self.depth}, '
                 f'{self.ticks} ticks: {why}"""',
                 "    from replay_fsm.core import Core",
                 "    from replay_fsm.explore import World, apply, check_state, enabled",
                 f"    world = World.initial(Core({self.depth}), {self.ticks})",
                 "    for action in ["]
        lines += [f"        {a!r},  # {describe(a)}" for a in self.path[:-1]]
        lines += ["    ]:", "        apply(world, action)",
                  f"    last = {self.path[-1]!r}  # {describe(self.path[-1])}",
                  f"    if last in enabled(world, faults={self.faults}):",
                  "        apply(world, last)",
                  "        check_state(world)"]
        return "\n".join(lines) + "\n"

    def summary(self) -> str:
        head = (f"depth {self.depth}, {self.ticks} ticks: {self.states} states, "
                f"{self.transitions} transitions, {self.complete_states} complete")
        if self.violation:
            return head + f"\nVIOLATION: {self.violation}\n  " + "\n  ".join(self.steps())
        if self.stuck:
            return head + f"\nDEADLOCK: {self.stuck} states cannot reach completion"
        return head + "\nno violation; every state can reach completion"


# States found between two calls of explore's ``progress``.
PROGRESS_EVERY = 1000


def explore(depth: int, ticks: int, *, faults: bool = False,
            core_factory: Callable[[int], Core] = Core, limit: int = 2_000_000,
            progress: Callable[[int], None] | None = None) -> Result:
    """BFS over every interleaving of ``ticks`` ticks (>= 1) on a ring of ``depth``
    slots; stops at the first (shortest) violation. ``progress``, if given, is called
    with the number of states found so far, every ``PROGRESS_EVERY`` of them.

    Raises:
        ValueError, TypeError: ``ticks`` is not an int >= 1 (``depth``: as ``Core``).
        RuntimeError: asserts are off (``python -O``), so nothing would be checked.
    """
    ticks = as_count("ticks", ticks, 1)
    require_asserts("explore")  # every check below is an assert statement
    result = Result(depth, ticks, faults)

    def build(path: list[Action]) -> World:
        w = World.initial(core_factory(depth), ticks)
        for a in path:
            apply(w, a)
        return w

    root = build([])
    seen: dict[tuple[Any, ...], int] = {root.key(): 0}
    paths: list[list[Action]] = [[]]
    edges: list[list[int]] = [[]]
    terminal: list[bool] = [root.terminal]
    queue: deque[int] = deque([0])
    while queue:
        sid = queue.popleft()
        path = paths[sid]
        world = build(path)
        for action in enabled(world, faults):
            child = build(path)
            try:
                apply(child, action)
                check_state(child)
            # MachineError: a step the table has no row for, which the core fires
            # without asking it first (fail and close on every slot)
            except (AssertionError, ReplayFSMError, MachineError) as exc:
                result.violation = f"{type(exc).__name__}: {exc}"
                result.path = [*path, action]
                result.states = len(paths)
                return result
            result.transitions += 1
            key = child.key()
            cid = seen.get(key)
            if cid is None:
                cid = len(paths)
                if cid >= limit:
                    raise RuntimeError(f"more than {limit} states; lower depth or ticks")
                seen[key] = cid
                if progress is not None and cid % PROGRESS_EVERY == 0:
                    progress(cid)
                paths.append([*path, action])
                edges.append([])
                terminal.append(child.terminal)
                if child.done:
                    result.complete_states += 1
                queue.append(cid)
            edges[sid].append(cid)
    result.states = len(paths)
    # Completion reachable from every non-terminal state (deadlock freedom).
    reverse: list[list[int]] = [[] for _ in paths]
    for s, outs in enumerate(edges):
        for t in outs:
            reverse[t].append(s)
    good = {s for s in range(len(paths)) if terminal[s]}
    stack = list(good)
    while stack:
        for p in reverse[stack.pop()]:
            if p not in good:
                good.add(p)
                stack.append(p)
    result.stuck = len(paths) - len(good)
    return result
