"""Refinement: the SPIN model and the real ``Core`` reach the same states and decide
every learner step alike.

Both sides are projected onto what the model and the core have in common
(``Projection``): each slot's state and the tick it holds, the next tick to
request, the pending ticks with their slots in request order, the hot slot, and
whether the pipeline failed or closed.

The model's side. SPIN has no "print every state" mode, so ``specs/pipeline.pml``
built with ``-DREFINE -DNOCLAIMS`` adds ``specs/refine_probe.pml``: a probe process
whose one step changes nothing and runs C code (``c_code``) that appends the
current state's projection, and the learner's three guards evaluated by the
model's own Promela expressions, to ``refine.txt``. Without partial-order
reduction (``-DNOREDUCE``) pan executes every enabled step of every state it
stores, so the probe writes each reachable state exactly once (the line count
equals pan's "states, stored"). The learner's request, acquire and release steps
also write their pre- and post-state, which gives the model's successor for each
learner step. The probe never blocks, so that build checks neither claims nor
deadlocks; tests/test_spin.py does both on the plain model. A never claim calling
C from ``c_expr`` was the other option, but C sees only the state vector: the
guards are Promela expressions (with a remote reference, ``learner@head``), which
the probe evaluates in Promela and hands to C as one number. The model keeps its
pending ticks as two counters (``next_acq``, ``acq_slot`` up to ``next_req``); the
projection expands them into the core's list of (tick, slot).

The core's side is a breadth-first search over ``replay_fsm.verify.explore``'s
worlds (``World.initial``, ``enabled``, ``apply``) on the real ``Core``, plus the
one step the model's learner adds at its end: ``close()`` once every tick is
released or after a failure. In every state the search reaches it offers the core
every learner step, legal or not: a request of the next tick, of the one after
and of the one before; an acquire of each pending tick, of the hot tick and of
the next tick to request; a release. The check then requires:

- the two sets of projected states are equal (for a backend variant of the model,
  the model's set is contained in the core's: those backends allow fewer
  interleavings);
- the core accepts exactly the steps the model's guards allow in that state, and
  an accepted step leads both to the same projected state;
- a refused step raises the library's own error and leaves ``Core.key()`` as it
  was (INV-STICKY's second clause).

The first request may name any tick on the core; the model starts at tick 0, so
in the initial state only ``request(0)`` is offered. Ticks at or beyond ``ticks``
are outside the bounded run of both sides and are not offered.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core import Core
from ..errors import ReplayFSMError
from ..spec import SlotState
from .explore import Action, World, apply, enabled

SPECS = Path(__file__).resolve().parents[2] / "specs"
NONE = 255  # pipeline.pml's "no tick / no slot"
Step = tuple[str, int]  # ("request", tick), ("acquire", tick), ("release", -1)
RELEASE: Step = ("release", -1)
_KINDS = {1: "request", 2: "acquire", 3: "release"}


@dataclass(frozen=True, slots=True)
class Projection:
    """A state of the model or of the core, reduced to what both have."""

    states: tuple[SlotState, ...]
    ticks: tuple[int | None, ...]
    next_tick: int
    pending: tuple[tuple[int, int], ...]
    hot: int | None
    failed: bool
    closed: bool

    def __str__(self) -> str:
        slots = ", ".join(f"{s.name}({t})" if t is not None else s.name
                          for s, t in zip(self.states, self.ticks, strict=True))
        flags = "".join((" failed" if self.failed else "", " closed" if self.closed else ""))
        return (f"[{slots}] next {self.next_tick} pending {list(self.pending)} "
                f"hot {self.hot}{flags}")


def project(core: Core) -> Projection:
    """The core's state as a ``Projection``; no request yet reads as next tick 0."""
    return Projection(
        states=core.states,
        ticks=tuple(core.tick_of(i) for i in range(core.ring_depth)),
        next_tick=0 if core.next_tick is None else core.next_tick,
        pending=core.pending,
        hot=core.hot_slot,
        failed=core.failure is not None,
        closed=core.closed,
    )


# -- running SPIN ---------------------------------------------------------------


class Pan:
    """One model built by spin and gcc in its own directory, ready to run ./pan.

    Args:
        workdir: an empty or scratch directory; the specs are copied into it.
        model: the .pml file to build, relative to ``specs``.
        depth, ticks: -DD and -DT.
        defines: further -D names (``"CUDA"``, ``"FAULTS"``, ``"NOCLAIMS"``...).
        cflags: gcc flags for pan (``-DSAFETY``, ``-DNOREDUCE``...).

    Raises:
        RuntimeError: spin or gcc failed; the message holds their output.
        FileNotFoundError: ``specs`` lacks ``model``: the SPIN models live in the
            repository's ``specs/``, which an installed package does not hold.
    """

    def __init__(self, workdir: Path, model: str, depth: int, ticks: int,
                 defines: Iterable[str] = (), cflags: Iterable[str] = (),
                 specs: Path = SPECS) -> None:
        if not (specs / model).is_file():  # spin's own error names a cpp step
            raise FileNotFoundError(
                f"the SPIN model {specs / model} is not there: the models live in the "
                "repository's specs/ folder, which an installed package does not hold; "
                "run this from a clone (or pass specs=<a clone's specs/>)")
        workdir.mkdir(parents=True, exist_ok=True)
        for f in specs.glob("**/*.pml"):
            (workdir / f.relative_to(specs)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, workdir / f.relative_to(specs))
        self.workdir, self.model = workdir, model
        self.flags = [f"-DD={depth}", f"-DT={ticks}", *(f"-D{d}" for d in defines)]
        started = time.perf_counter()
        out = self._run(["spin", *self.flags, "-a", model])
        listed = re.search(r"never claims: (.*)", out)
        self.claims: list[str] = [] if listed is None else listed.group(1).split(", ")
        # -O0: these state spaces take pan well under a second, gcc's -O1 takes longer.
        self._run(["gcc", "-O0", "-w", "-DNFAIR=3", *cflags, "-o", "pan", "pan.c"])
        self.build_seconds = time.perf_counter() - started

    def _run(self, cmd: list[str], check: bool = True) -> str:
        done = subprocess.run(cmd, cwd=self.workdir, capture_output=True, text=True,
                              timeout=300)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout}{done.stderr}")
        return done.stdout + done.stderr

    def run(self, *args: str) -> PanResult:
        """./pan with ``args``; errors and stored states parsed from its report."""
        started = time.perf_counter()
        out = self._run(["./pan", "-w19", "-m100000", *args], check=False)
        errors = re.search(r"errors: (\d+)", out)
        stored = re.search(r"(\d+) states, stored", out)
        if errors is None or stored is None or "max search depth too small" in out:
            # a truncated search would prove nothing: fail rather than pass
            raise RuntimeError(f"./pan {' '.join(args)} did not finish:\n{out}")
        return PanResult(int(errors.group(1)), int(stored.group(1)), out,
                         time.perf_counter() - started)

    def check(self, claim: str) -> PanResult:
        """Check one ltl claim of the model, under weak fairness (-a -f)."""
        return self.run("-a", "-f", "-N", claim)

    def trail(self) -> str:
        """The last error trail replayed by spin, with every step (-p) and global (-g)."""
        # pan writes the trail beside pan.c, named after the model file's base name.
        trail = f"{Path(self.model).name}.trail"
        return self._run(["spin", *self.flags, "-t", "-k", trail, "-p", "-g", self.model],
                         check=False)

    def mtypes(self) -> dict[int, str]:
        """SPIN's numbering of the mtype names, as pan.c prints them."""
        text = (self.workdir / "pan.c").read_text()
        return {int(n): name for name, n in re.findall(r'"\tmtype\s+(\w+):\s+(\d+)\\n"', text)}


@dataclass(frozen=True)
class PanResult:
    errors: int
    stored: int
    output: str
    seconds: float

    @property
    def violation(self) -> str | None:
        """pan's first error line ("assertion violated ...", "acceptance cycle ...")."""
        found = re.search(r"^pan:1: (.*)$", self.output, re.M)
        return None if found is None else found.group(1)

    @property
    def claim_violated(self) -> bool:
        """An error of the never claim itself, not fire()'s table assertion (which pan
        reports as "assertion violated 0")."""
        v = self.violation or ""
        return v.startswith(("acceptance cycle", "claim violated", "assertion violated  !("))


# -- the model's side -----------------------------------------------------------


@dataclass
class ModelStates:
    """What the probe wrote: each reachable projection with the learner guards seen
    there, and each learner step's successor."""

    states: dict[Projection, set[tuple[bool, bool, bool]]]
    edges: dict[tuple[Projection, Step], set[Projection]]
    stored: int
    seconds: float


def model_states(depth: int, ticks: int, *, defines: Iterable[str] = (),
                 workdir: Path | None = None, specs: Path = SPECS) -> ModelStates:
    """Every reachable state of ``pipeline.pml`` at (depth, ticks) with ``defines``.

    Raises:
        RuntimeError: spin, gcc or pan failed, or the probe missed a state.
    """
    with tempfile.TemporaryDirectory(prefix="replay_fsm-refine-") as scratch:
        where = workdir if workdir is not None else Path(scratch)
        started = time.perf_counter()
        pan = Pan(where, "pipeline.pml", depth, ticks, ("REFINE", "NOCLAIMS", *defines),
                  ("-DSAFETY", "-DNOREDUCE"), specs)
        result = pan.run()
        if result.errors:
            raise RuntimeError(f"the refinement build found an error:\n{result.output}")
        names = pan.mtypes()
        lines = (where / "refine.txt").read_text().splitlines()
        seconds = time.perf_counter() - started
    decode = _Decoder(depth, names)
    states: dict[Projection, set[tuple[bool, bool, bool]]] = {}
    edges: dict[tuple[Projection, Step], set[Projection]] = {}
    probed = 0
    for line in lines:
        kind, rest = line.split(" ", 1)
        if kind == "S":
            probed += 1
            bits, raw = rest.split(" ", 1)
            g = int(bits)
            states.setdefault(decode(raw), set()).add((bool(g & 1), bool(g & 2), bool(g & 4)))
        else:
            step_kind, tick, raws = rest.split(" ", 2)
            before, after = raws.split(" | ")
            step = (_KINDS[int(step_kind)], int(tick))
            edges.setdefault((decode(before), step), set()).add(decode(after))
    if probed != result.stored:
        raise RuntimeError(f"the probe saw {probed} states, pan stored {result.stored}")
    return ModelStates(states, edges, result.stored, seconds)


class _Decoder:
    """A probe line's numbers -> Projection (memoised: few distinct lines)."""

    def __init__(self, depth: int, names: dict[int, str]) -> None:
        self.depth = depth
        self.states = {n: SlotState[name] for n, name in names.items()
                       if name in SlotState.__members__}
        self.memo: dict[str, Projection] = {}

    def __call__(self, raw: str) -> Projection:
        found = self.memo.get(raw)
        if found is None:
            found = self.memo[raw] = self._decode([int(x) for x in raw.split()])
        return found

    def _decode(self, v: list[int]) -> Projection:
        d = self.depth
        next_req, next_acq, acq_slot, hot, failed, closed = v[2 * d:]
        return Projection(
            states=tuple(self.states[x] for x in v[:d]),
            ticks=tuple(None if t == NONE else t for t in v[d:2 * d]),
            next_tick=next_req,
            pending=tuple((next_acq + i, (acq_slot + i) % d)
                          for i in range(next_req - next_acq)),
            hot=None if hot == NONE else hot,
            failed=bool(failed),
            closed=bool(closed),
        )


# -- the core's side ------------------------------------------------------------


@dataclass
class CoreStates:
    """The projections the real core reaches, and its answer to every offered step
    (the projected successor, or None when it refused) in each of them."""

    states: set[Projection]
    answers: dict[Projection, dict[Step, Projection | None]]
    worlds: int
    explored_worlds: int  # without the closing steps: explore()'s own count
    steps_offered: int
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0


def offered_steps(core: Core, ticks: int) -> list[Step]:
    """Every learner step offered to ``core``: the legal ones and their near misses."""
    if core.next_tick is None:
        requests = {0}  # the model's run starts at tick 0
    else:
        requests = {core.next_tick - 1, core.next_tick, core.next_tick + 1}
    pending = [t for t, _ in core.pending]
    acquires = {*pending, (pending[0] - 1) if pending else -1,
                0 if core.next_tick is None else core.next_tick}
    if core.hot_tick is not None:
        acquires.add(core.hot_tick)
    return ([("request", t) for t in sorted(requests) if 0 <= t < ticks]
            + [("acquire", t) for t in sorted(acquires) if 0 <= t < ticks]
            + [RELEASE])


def _step_of(action: Action) -> Step | None:
    actor, step, arg = action
    if actor != "learner" or step == "close":
        return None
    return RELEASE if step == "release" else (step, arg)


def _offer(core: Core, step: Step) -> None:
    kind, tick = step
    if kind == "request":
        core.request(tick)
    elif kind == "acquire":
        core.acquire(tick)
    else:
        core.release()


def core_states(depth: int, ticks: int, *, faults: bool = False,
                core_factory: Callable[[int], Core] = Core) -> CoreStates:
    """Breadth-first search of the real core's worlds, offering the learner's steps."""
    started = time.perf_counter()

    def build(path: list[Action]) -> World:
        w = World.initial(core_factory(depth), ticks)
        for a in path:
            apply(w, a)
        return w

    seen: dict[Any, int] = {build([]).key(): 0}
    paths: list[list[Action]] = [[]]
    # Reached only through the closing step added below: explore() does not count it.
    added: list[bool] = [False]
    queue: deque[int] = deque([0])
    result = CoreStates(set(), {}, 0, 0, 0)
    close: Action = ("learner", "close", 0)
    while queue:
        sid = queue.popleft()
        path = paths[sid]
        world = build(path)
        here = project(world.core)
        result.states.add(here)
        actions = enabled(world, faults)
        extra = ((world.done or world.core.failure is not None) and not world.core.closed
                 and close not in actions)
        if extra:
            actions.append(close)  # the model's learner closes at its end
        # Offers that no enabled action makes go to this world first (a refused step
        # leaves it as it was); the enabled actions then answer the others.
        answers: dict[Step, Projection | None] = {}
        offers = offered_steps(world.core, ticks)
        result.steps_offered += len(offers)
        taken = {_step_of(a) for a in actions}
        for step in offers:
            if step in taken:
                continue
            before = world.core.key()
            try:
                _offer(world.core, step)
            except ReplayFSMError:
                answers[step] = None
                if world.core.key() != before:
                    result.problems.append(f"{here}: refused {step} but changed the core")
                    world = build(path)
                continue
            answers[step] = project(world.core)
            world = build(path)  # the accepted step moved this world on
        for n, action in enumerate(actions):
            # Core construction dominates the cost: the last action reuses this world.
            child = world if n == len(actions) - 1 else build(path)
            taken_step = _step_of(action)
            try:
                apply(child, action)
            except ReplayFSMError as exc:
                if taken_step is None:
                    result.problems.append(f"{here}: the core refused {action}: {exc}")
                else:
                    answers[taken_step] = None
                continue
            except AssertionError as exc:
                result.problems.append(f"{here}: {action} broke an invariant: {exc}")
                continue
            if taken_step is not None:
                answers[taken_step] = project(child.core)
            key = child.key()
            if key not in seen:
                seen[key] = len(paths)
                paths.append([*path, action])
                added.append(added[sid] or (extra and action == close))
                queue.append(seen[key])
        known = result.answers.setdefault(here, answers)
        if known != answers:
            result.problems.append(f"{here}: the core answers differently in two worlds "
                                   f"with this projection: {known} vs {answers}")
    result.worlds = len(paths)
    result.explored_worlds = added.count(False)
    result.seconds = time.perf_counter() - started
    return result


# -- the check ------------------------------------------------------------------


@dataclass
class Report:
    depth: int
    ticks: int
    faults: bool
    backend: str | None
    model: ModelStates
    core: CoreStates
    only_in_model: list[Projection]
    only_in_core: list[Projection]
    mismatches: list[str]

    @property
    def equal(self) -> bool:
        return not self.only_in_model and not self.only_in_core

    @property
    def ok(self) -> bool:
        same_states = self.equal if self.backend is None else not self.only_in_model
        return same_states and not self.mismatches and not self.core.problems

    def summary(self) -> str:
        head = (f"D={self.depth} T={self.ticks} faults={self.faults} "
                f"backend={self.backend or 'default'}: model {len(self.model.states)} "
                f"projected states ({self.model.stored} stored by pan, "
                f"{self.model.seconds:.2f} s), core {len(self.core.states)} "
                f"({self.core.worlds} worlds, {self.core.seconds:.2f} s), "
                f"{self.core.steps_offered} steps offered")
        lines = [head]
        lines += [f"only in the model: {p}" for p in self.only_in_model[:5]]
        lines += [f"only in the core: {p}" for p in self.only_in_core[:5]]
        lines += [*self.mismatches[:10], *self.core.problems[:10]]
        return "\n".join(lines)


def model_accepts(guards: tuple[bool, bool, bool], here: Projection, step: Step) -> bool:
    """The model's answer to ``step``: its guard holds and the tick is the one the
    model's learner would name."""
    may_request, may_acquire, may_release = guards
    kind, tick = step
    if kind == "request":
        return may_request and tick == here.next_tick
    if kind == "acquire":
        return may_acquire and bool(here.pending) and tick == here.pending[0][0]
    return may_release


def compare(model: ModelStates, core: CoreStates, *, depth: int, ticks: int,
            faults: bool, backend: str | None) -> Report:
    only_model = sorted(set(model.states) - core.states, key=str)
    only_core = sorted(core.states - set(model.states), key=str)
    mismatches: list[str] = []
    if backend is None:
        for here, answers in core.answers.items():
            seen = model.states.get(here)
            if seen is None:
                continue  # reported as only in the core
            if len(seen) != 1:
                mismatches.append(f"{here}: the model's guards differ between states "
                                  f"with this projection: {sorted(seen)}")
                continue
            guards = next(iter(seen))
            for step, after in answers.items():
                allowed = model_accepts(guards, here, step)
                if allowed != (after is not None):
                    mismatches.append(f"{here}: {step[0]}({step[1]}) is "
                                      f"{'accepted' if after else 'refused'} by the core, "
                                      f"{'allowed' if allowed else 'refused'} by the model")
    for (here, step), afters in model.edges.items():
        answer = core.answers.get(here, {}).get(step)
        if here in core.answers and afters != {answer}:
            mismatches.append(f"{here}: after {step[0]}({step[1]}) the model is in "
                              f"{', '.join(map(str, afters))}, the core in {answer}")
    return Report(depth, ticks, faults, backend, model, core, only_model, only_core,
                  mismatches)


def check(depth: int, ticks: int, *, faults: bool = False, backend: str | None = None,
          core_factory: Callable[[int], Core] = Core, specs: Path = SPECS) -> Report:
    """Compare the model (``backend``: None, "CUDA", "ZEROCOPY" or "MPS") with the
    core at (depth, ticks), with or without faults (the model's -DFAULTS, the
    explorer's ``faults``)."""
    defines = [*([backend] if backend else []), *(["FAULTS"] if faults else [])]
    model = model_states(depth, ticks, defines=defines, specs=specs)
    core = core_states(depth, ticks, faults=faults, core_factory=core_factory)
    return compare(model, core, depth=depth, ticks=ticks, faults=faults, backend=backend)
