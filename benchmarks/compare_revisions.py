"""The learner's calls per tick in two revisions of replay_fsm, measured in
interleaved rounds: ``python benchmarks/compare_revisions.py BASE`` compares the
library at git revision BASE (checked out into a temporary worktree) with the one in
this checkout, measured by this checkout's code.

Each round runs one fresh process per revision, in alternating order (ABBA), and
each process measures, after ``WARM_UP`` untimed ticks:

- ``warm_<collector>``: ``sample_large_batch`` + ``after_tick`` + ``start_prepare``
  back to back, ring depth 2 (as learner_overhead's first figure, which drops the
  first tenth of its ticks instead);
- ``cold_<collector>``: the same calls with the caches evicted where the learner's
  step runs (``learner_overhead.cold_pipeline``);
- ``cold_handoff``: the bare double buffer's hand-off evicted the same way; no
  replay_fsm code runs in it, so its ratio shows what the machine moved between the
  two processes of a round.

Reported per figure: the median over rounds of each process's median (us) and the
median and range of the rounds' ratios (this checkout over BASE); the result file
keeps every round's figures too. Two revisions on a machine whose speed moves from
hour to hour are compared only like this: their absolute figures from different runs
are not comparable.

Between processes, that is not enough for a change of a few per cent: on the 2-core
machine beside other work the hand-off, the same code on both sides, moved 0.89-1.21 x
from one process to the next. ``--paired`` measures in one process instead: BASE's
package is imported as ``replay_fsm_base`` beside this checkout's ``replay_fsm``, and
this checkout's a second time as ``replay_fsm_again`` (each through a link named so;
the package imports its own modules relatively, so each copy runs its own code, and a
packer process imports the same copy). Per figure, each side's pipeline is built and
warmed up, then each round measures blocks of ticks in ABCCBA order, rotated from round
to round. Reported per figure: each side's median, the A/B ratios (this checkout over
BASE) and the A/A ratios (this checkout over its second copy: the same code, so their
spread is the noise floor a change must stand out of). Written to
``results/compare_revisions_paired.json``.
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import hashlib
import importlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
COLLECTORS = ("thread", "process")
MEASURE_TIMEOUT_S = 1800  # one revision's figures; about a minute here
STOP_GRACE_S = 30


def measure(library: Path, quick: bool) -> dict[str, float]:
    """This process's figures (us per tick), with ``replay_fsm`` imported from
    ``library`` (first on ``PYTHONPATH``)."""
    import torch

    import replay_fsm
    from replay_fsm import Pipeline, ReplayBuffer

    if Path(replay_fsm.__file__).resolve().parent.parent != library.resolve():
        raise RuntimeError(f"replay_fsm came from {replay_fsm.__file__}, not {library}")
    sys.path.insert(0, str(HERE))
    from common import steady_malloc
    from learner_overhead import EVICT_BYTES, WARM_UP, cold_handoff, cold_pipeline

    steady_malloc()
    torch.set_num_threads(1)  # as learner_loop: the packer keeps the other core
    # (the result file's machine facts are the parent's: "torch_threads_measuring")
    ticks = 100 if quick else 1500
    out: dict[str, float] = {}
    for collector in COLLECTORS:
        rb = ReplayBuffer(4096, 16, 4)
        rb.add_packed(torch.randn(4096, rb.width))
        n, samples = 256, []
        with Pipeline(rb, sample_count=n, ring_depth=2, collector=collector) as pipe:
            pipe.start_prepare(0, n)
            for tick in range(WARM_UP + ticks):
                pipe.wait_until_ready(tick, n)  # not timed
                t0 = time.perf_counter_ns()
                pipe.sample_large_batch(tick, n)
                pipe.after_tick()
                pipe.start_prepare(tick + 1, n)
                samples.append(time.perf_counter_ns() - t0)
        out[f"warm_{collector}"] = statistics.median(samples[WARM_UP:]) / 1e3
    evict = torch.zeros(EVICT_BYTES // 4)
    cold_ticks = 40 if quick else 200
    for collector in COLLECTORS:
        out[f"cold_{collector}"] = statistics.median(
            cold_pipeline(collector, evict, cold_ticks)) / 1e3
    out["cold_handoff"] = statistics.median(cold_handoff(evict, cold_ticks)) / 1e3
    return out


def git(*args: str) -> str:
    """git's output; a failure raises with git's own message."""
    got = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    if got.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed: {got.stderr.strip()}")
    return got.stdout.strip()


def run_one(library: Path, quick: bool) -> dict[str, float]:
    """``measure`` in a fresh process that imports replay_fsm from ``library``. The
    process gets a session of its own: on a timeout or a Ctrl-C here it is sent
    Ctrl-C (its pipeline closes and ends the packer it spawned, whose named
    semaphores are then removed), and its whole group is killed if it is still
    there ``STOP_GRACE_S`` later."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(library), *filter(None, [os.environ.get("PYTHONPATH")])]))
    argv = [sys.executable, str(Path(__file__).resolve()), "--measure", str(library)]
    if quick:
        argv.append("--quick")
    child = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = child.communicate(timeout=MEASURE_TIMEOUT_S)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGINT)
        try:
            child.communicate(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        raise
    if child.returncode != 0:
        raise RuntimeError(f"measuring {library} failed:\n{out}{err}")
    return json.loads(out.strip().splitlines()[-1])


def compare(base: str, rounds: int, quick: bool) -> dict[str, Any]:
    base_sha = git("rev-parse", "--verify", f"{base}^{{commit}}")
    head_sha = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--", "replay_fsm"))  # untracked too
    per: dict[str, list[dict[str, float]]] = {"base": [], "this": []}
    with tempfile.TemporaryDirectory(prefix="replay_fsm-base-") as tmp:
        tree = Path(tmp) / "tree"
        try:
            git("worktree", "add", "--detach", str(tree), base_sha)
            for r in range(rounds):
                for side in (("base", "this") if r % 2 == 0 else ("this", "base")):
                    per[side].append(run_one(tree if side == "base" else ROOT, quick))
                    print(f"round {r + 1}/{rounds} {side}: "
                          + ", ".join(f"{k} {v:.1f}" for k, v in per[side][-1].items()),
                          flush=True)
        finally:  # never masks the error that got here: a failed removal is pruned
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                           capture_output=True)
            subprocess.run(["git", "worktree", "prune"], cwd=ROOT, capture_output=True)
    figures: dict[str, Any] = {}
    for key in per["base"][0]:
        ratios = [b[key] / a[key] for a, b in zip(per["base"], per["this"], strict=True)]
        figures[key] = {
            "base_us": statistics.median(x[key] for x in per["base"]),
            "this_us": statistics.median(x[key] for x in per["this"]),
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios),
        }
    return {"base": base, "base_sha": base_sha, "head_sha": head_sha,
            "uncommitted_changes": dirty, "rounds": rounds,
            "torch_threads_measuring": 1, "figures": figures,
            "by_round": [{"base": a, "this": b}
                         for a, b in zip(per["base"], per["this"], strict=True)]}


# The paired mode: both revisions in one process.

# Module names the package is imported under: this checkout's ``replay_fsm`` as it
# is, and two more through links named so (BASE's, and this checkout's a second
# time, for the A/A control).
SIDES = {"base": "replay_fsm_base", "this": "replay_fsm", "this_again": "replay_fsm_again"}
PAIRED_ROUNDS = 12  # a multiple of 3: each side starts as many rounds as the others


def package_digest(package: Path) -> str:
    """A digest of the Python files of the package at ``package`` (names and bytes):
    equal for two packages of the same code, wherever they lie."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def import_as(name: str, package: Path, links: Path) -> ModuleType:
    """The replay_fsm package at ``package`` imported as the module ``name``, through a
    link ``links/name`` (``links`` is first on ``sys.path``, so a packer process
    spawned from here, which gets this ``sys.path``, imports it the same way). The
    package imports its own modules relatively, so each copy runs its own code.

    Raises:
        RuntimeError: ``name`` was imported from somewhere else already.
    """
    if name != "replay_fsm":
        link = links / name
        if not link.exists():
            link.symlink_to(package, target_is_directory=True)
        where = link
    else:
        where = package
    module = importlib.import_module(name)
    if Path(module.__file__ or "").parent.resolve() != where.resolve():
        raise RuntimeError(f"{name} came from {module.__file__}, not {where}")
    return module


def foreign_parts(root: object, name: str, family: Collection[str]) -> list[str]:
    """The objects reachable from ``root`` (attributes and the items of containers,
    four levels down) whose class comes from a package of ``family`` other than
    ``name``: none where a side's pipeline is made of its own copy's code only."""
    seen: set[int] = set()
    found: list[str] = []
    level: list[object] = [root]
    for _ in range(4):
        nxt: list[object] = []
        for obj in level:
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            top = type(obj).__module__.split(".")[0]
            if top in family and top != name:
                found.append(f"{type(obj).__module__}.{type(obj).__qualname__}")
            if isinstance(obj, (list, tuple, set, frozenset)):
                nxt += list(obj)
            elif isinstance(obj, dict):
                nxt += list(obj.values())
            elif top in family:
                nxt += list(getattr(obj, "__dict__", {}).values())
                nxt += [getattr(obj, s) for s in getattr(type(obj), "__slots__", ())
                        if isinstance(s, str) and hasattr(obj, s)]
        level = nxt
    return found


class PipelineSide(abc.ABC):
    """A side's pipeline over 4096 random rows, 256 of them a tick, built with
    ``options``: its first ticks requested (``start``), then ``warm_up`` ticks run;
    closed again if either raises."""

    def __init__(self, lib: ModuleType, warm_up: int, **options: Any) -> None:
        import torch
        rb = lib.ReplayBuffer(4096, 16, 4)
        rb.add_packed(torch.randn(4096, rb.width))
        self.n, self.tick = 256, 0
        self.pipe = lib.Pipeline(rb, sample_count=self.n, **options)
        try:
            self.start()
            self.block(warm_up)
        except BaseException:
            self.pipe.close()
            raise

    @abc.abstractmethod
    def start(self) -> None:
        """Request the ticks the first ``block`` expects under way."""

    @abc.abstractmethod
    def block(self, ticks: int) -> list[int]:
        """``ticks`` more ticks; each one's time (ns)."""

    def close(self) -> None:
        self.pipe.close()


class Warm(PipelineSide):
    """The learner's three calls, ring depth 2, with the batch ready (``warm_``)."""

    def __init__(self, lib: ModuleType, collector: str, warm_up: int) -> None:
        super().__init__(lib, warm_up, ring_depth=2, collector=collector)

    def start(self) -> None:
        self.pipe.start_prepare(0, self.n)

    def block(self, ticks: int) -> list[int]:
        samples, pipe, n = [], self.pipe, self.n
        for tick in range(self.tick, self.tick + ticks):
            pipe.wait_until_ready(tick, n)  # not timed
            t0 = time.perf_counter_ns()
            pipe.sample_large_batch(tick, n)
            pipe.after_tick()
            pipe.start_prepare(tick + 1, n)
            samples.append(time.perf_counter_ns() - t0)
        self.tick += ticks
        return samples


class Cold(PipelineSide):
    """The learner's calls with the caches evicted where its step runs, as
    ``learner_overhead.cold_pipeline`` makes them (``cold_``)."""

    def __init__(self, lib: ModuleType, collector: str, warm_up: int, evict: Any) -> None:
        self.evict = evict
        super().__init__(lib, warm_up, ring_depth=3, collector=collector, packer_threads=1,
                         liveness_timeout=60)

    def start(self) -> None:
        self.pipe.start_prepare(0, self.n)
        self.pipe.start_prepare(1, self.n)
        if not self.pipe.wait_until_ready(1, self.n, timeout=120):
            raise RuntimeError("the packer served nothing within 120 s")

    def block(self, ticks: int) -> list[int]:
        samples, pipe, n = [], self.pipe, self.n
        for tick in range(self.tick, self.tick + ticks):
            t0 = time.perf_counter_ns()
            pipe.sample_large_batch(tick, n)
            pipe.start_prepare(tick + 2, n)
            t1 = time.perf_counter_ns()
            if not pipe.wait_until_ready(tick + 2, n, timeout=120):
                raise RuntimeError(f"tick {tick + 2} not packed within 120 s")
            self.evict.add_(1.0)  # the learner's step
            t2 = time.perf_counter_ns()
            pipe.after_tick()
            samples.append(t1 - t0 + time.perf_counter_ns() - t2)
        self.tick += ticks
        return samples


class ColdHandoff:
    """The bare double buffer's hand-off, evicted the same way (``cold_handoff``): one
    per side, though no replay_fsm code runs in it."""

    def __init__(self, warm_up: int, evict: Any) -> None:
        from learner_overhead import Handoff
        self.evict = evict
        self.handoff = Handoff().__enter__()
        try:
            self.block(warm_up)
        except BaseException:
            self.close()
            raise

    def block(self, ticks: int) -> list[int]:
        samples = []
        for _ in range(ticks):
            self.handoff.wait_ready()
            self.evict.add_(1.0)
            samples.append(self.handoff.timed())
        return samples

    def close(self) -> None:
        self.handoff.__exit__(None, None, None)


def block_order(round_index: int) -> list[str]:
    """The sides' blocks in round ``round_index``: the sides in turn, rotated by the
    round, then the same backwards (ABCCBA), so each side's two blocks sit as far
    from the round's middle, on average, as every other side's."""
    sides = list(SIDES)
    k = round_index % len(sides)
    turn = sides[k:] + sides[:k]
    return turn + turn[::-1]


def summarize(by_round: list[dict[str, float]]) -> dict[str, float]:
    """One figure's summary from its rounds (each side's median in us): the median
    over rounds of each side's figure, and the median and range of the rounds'
    ratios ``ab`` (this checkout over BASE) and ``aa`` (this checkout over itself,
    imported a second time: what the same code gets, the noise floor)."""
    ab = [r["this"] / r["base"] for r in by_round]
    aa = [r["this"] / r["this_again"] for r in by_round]
    out = {f"{side}_us": statistics.median(r[side] for r in by_round) for side in SIDES}
    for key, ratios in (("ab", ab), ("aa", aa)):
        out.update({f"{key}_ratio_median": statistics.median(ratios),
                    f"{key}_ratio_min": min(ratios), f"{key}_ratio_max": max(ratios)})
    return out


def paired(base: str, rounds: int = PAIRED_ROUNDS, quick: bool = False,
           collectors: Sequence[str] = COLLECTORS) -> dict[str, Any]:
    """Compare BASE with this checkout in this one process: BASE's package (checked
    out into a temporary worktree) imported as ``replay_fsm_base``, this checkout's as
    ``replay_fsm`` and again as ``replay_fsm_again``. Per figure, each side's pipeline
    is built (in a turn rotated by the figure) and warmed up, then ``rounds`` rounds
    of blocks of ticks in ABCCBA order (``block_order``); a side's figure in a round is
    the median of its two blocks' ticks.

    Raises:
        RuntimeError: git failed, a package came from somewhere else than its side's,
            or a side's pipeline holds an object of another side's package.
    """
    import torch

    base_sha = git("rev-parse", "--verify", f"{base}^{{commit}}")
    head_sha = git("rev-parse", "HEAD")
    added = [str(f) for f in (ROOT, HERE) if str(f) not in sys.path]
    sys.path[:0] = added  # this checkout's replay_fsm, and learner_overhead
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as measure: the packer keeps the other core
    with tempfile.TemporaryDirectory(prefix="replay_fsm-paired-") as tmp:
        tree, links = Path(tmp) / "tree", Path(tmp) / "links"
        links.mkdir()
        added.append(str(links))
        sys.path.insert(0, str(links))
        try:
            from learner_overhead import EVICT_BYTES, WARM_UP
            warm_up, warm_block, cold_block = (10, 10, 5) if quick else (WARM_UP, 40, 10)
            git("worktree", "add", "--detach", str(tree), base_sha)
            packages = {"base": tree / "replay_fsm", "this": ROOT / "replay_fsm",
                        "this_again": ROOT / "replay_fsm"}
            libs = {side: import_as(SIDES[side], packages[side], links) for side in SIDES}
            digests = {side: package_digest(packages[side]) for side in SIDES}
            evict = torch.zeros(EVICT_BYTES // 4)
            makers: dict[str, Callable[[ModuleType], Any]] = {}
            for c in collectors:
                makers[f"warm_{c}"] = lambda lib, c=c: Warm(lib, c, warm_up)
            for c in collectors:
                makers[f"cold_{c}"] = lambda lib, c=c: Cold(lib, c, warm_up, evict)
            makers["cold_handoff"] = lambda lib: ColdHandoff(warm_up, evict)
            by_round: dict[str, list[dict[str, float]]] = {}
            for f, (key, make) in enumerate(makers.items()):
                block = warm_block if key.startswith("warm_") else cold_block
                by_round[key] = measure_paired(key, make, libs, f, rounds, block)
        finally:
            for folder in added:
                sys.path.remove(folder)
            for module_name in list(sys.modules):  # the links go with the folder
                if module_name.split(".")[0] in ("replay_fsm_base", "replay_fsm_again"):
                    del sys.modules[module_name]
            torch.set_num_threads(threads)
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                           capture_output=True)
            subprocess.run(["git", "worktree", "prune"], cwd=ROOT, capture_output=True)
    return {"base": base, "base_sha": base_sha, "head_sha": head_sha, "mode": "paired",
            "uncommitted_changes": bool(git("status", "--porcelain", "--", "replay_fsm")),
            "same_code": digests["base"] == digests["this"],
            "sides": {side: {"module": SIDES[side], "package_digest": digests[side]}
                      for side in SIDES},
            "rounds": rounds, "blocks": {"warm_ticks": warm_block, "cold_ticks": cold_block,
                                         "warm_up_ticks": warm_up},
            "torch_threads_measuring": 1,
            "figures": {key: summarize(rs) for key, rs in by_round.items()},
            "by_round": by_round}


def measure_paired(key: str, make: Callable[[ModuleType], Any], libs: dict[str, ModuleType],
                   turn: int, rounds: int, block: int) -> list[dict[str, float]]:
    """One figure's rounds (each side's median, us): the sides' contenders built with
    ``make`` in a turn rotated by ``turn``, then measured in ABCCBA blocks."""
    sides = block_order(turn)[:len(SIDES)]
    made: dict[str, Any] = {}
    try:
        for side in sides:
            made[side] = make(libs[side])
            if hasattr(made[side], "pipe"):
                foreign = foreign_parts(made[side].pipe, SIDES[side], SIDES.values())
                if foreign:
                    raise RuntimeError(f"{side}'s pipeline ({SIDES[side]}) holds objects "
                                       f"of another side's package: {foreign[:3]}")
        out = []
        for r in range(rounds):
            samples: dict[str, list[int]] = {side: [] for side in SIDES}
            for side in block_order(r):
                samples[side] += made[side].block(block)
            out.append({side: statistics.median(s) / 1e3 for side, s in samples.items()})
            print(f"{key} round {r + 1}/{rounds}: " + ", ".join(
                f"{side} {v:.1f}" for side, v in out[-1].items()), flush=True)
        return out
    finally:
        for contender in made.values():
            contender.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", nargs="?", help="the git revision to compare with")
    ap.add_argument("--rounds", type=int, default=None,
                    help=f"rounds (default: 6, or {PAIRED_ROUNDS} with --paired)")
    ap.add_argument("--paired", action="store_true",
                    help="both revisions in this one process, in ABCCBA blocks, beside "
                         "this checkout against itself (the A/A control)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--measure", metavar="LIBRARY", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure is not None:
        print(json.dumps(measure(Path(args.measure), args.quick)))
        return 0
    if args.base is None:
        ap.error("name the git revision to compare with, e.g. HEAD~3")
    if args.rounds is None:
        args.rounds = PAIRED_ROUNDS if args.paired else 6
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    try:
        git("rev-parse", "--verify", f"{args.base}^{{commit}}")
    except (OSError, RuntimeError):
        ap.error(f"{args.base!r} is not a revision of the git checkout at {ROOT}")
    sys.path.insert(0, str(HERE))
    from common import steady_malloc, table, write_result
    if args.paired:
        steady_malloc()  # as each process of the other mode does
        result = paired(args.base, args.rounds, args.quick)
        write_result("compare_revisions_paired",
                     {k: v for k, v in result.items() if k != "figures"},
                     result["figures"], quick=args.quick)
        print(table(f"the learner's calls per tick in one process, this checkout over "
                    f"{args.base} ({result['base_sha'][:7]}; A/B) and over itself (A/A), "
                    f"{args.rounds} rounds of ABCCBA blocks (us)", [
            (key, f"{f['base_us']:.1f}", f"{f['this_us']:.1f}", f"{f['this_again_us']:.1f}",
             f"{f['ab_ratio_median']:.3f} ({f['ab_ratio_min']:.2f}-{f['ab_ratio_max']:.2f})",
             f"{f['aa_ratio_median']:.3f} ({f['aa_ratio_min']:.2f}-{f['aa_ratio_max']:.2f})")
            for key, f in result["figures"].items()
        ], ("figure", "base", "this", "this again", "A/B (rounds)", "A/A (rounds)")))
        if result["same_code"]:
            print(f"{args.base}'s replay_fsm is this checkout's code: A/B is an A/A too")
        return 0
    result = compare(args.base, args.rounds, args.quick)
    write_result("compare_revisions", {k: v for k, v in result.items() if k != "figures"},
                 result["figures"], quick=args.quick)  # config: revisions and each round
    print(table(f"the learner's calls per tick, this checkout over {args.base} "
                f"({result['base_sha'][:7]}), {args.rounds} interleaved rounds (us)", [
        (key, f"{f['base_us']:.1f}", f"{f['this_us']:.1f}", f"{f['ratio_median']:.3f}",
         f"{f['ratio_min']:.2f}-{f['ratio_max']:.2f}")
        for key, f in result["figures"].items()
    ], ("figure", "base", "this", "ratio (median)", "rounds")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
