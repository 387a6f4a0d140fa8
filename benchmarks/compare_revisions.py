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
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", nargs="?", help="the git revision to compare with")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--measure", metavar="LIBRARY", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure is not None:
        print(json.dumps(measure(Path(args.measure), args.quick)))
        return 0
    if args.base is None:
        ap.error("name the git revision to compare with, e.g. HEAD~3")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    try:
        git("rev-parse", "--verify", f"{args.base}^{{commit}}")
    except (OSError, RuntimeError):
        ap.error(f"{args.base!r} is not a revision of the git checkout at {ROOT}")
    sys.path.insert(0, str(HERE))
    from common import table, write_result
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
