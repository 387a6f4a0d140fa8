"""Judge the mutants mutmut's run has not reached, with a narrow set of fast tests.

``python -m tests.mutation_quick PATTERN TEST...`` runs, for every mutant whose name
matches PATTERN and which mutmut has not checked (or, with ``--survivors``, which
survived or had no test in mutmut's run: to judge a test written for it), the given
tests on mutmut's trampolined copy (``mutants/``) with that mutant active, two at a
time. A mutant those tests fail on is killed, and is recorded as mutmut records a
kill (exit code 1 in its ``.meta`` file), so that the report and later ``mutmut
run``s see it. Any other outcome records nothing: the mutant stays for mutmut's full
test selection.
A control run of the same tests with no mutant active must pass first, and a failure
counts only when a second run fails too (a loaded machine can fail a test once).

``python -m tests.mutation_quick --recheck N [SEED]`` runs the tests of N recorded
kills (a random sample of ``quick-kills.txt``) again, to see that they hold.

Like mutmut's fork server, this process imports the libraries of
``tests/mutation_preload.txt`` (never replay_fsm, whose import-time code must run
mutated) once, and forks one pytest per mutant from there: torch is not imported
again for each mutant.
"""

from __future__ import annotations

import fnmatch
import importlib
import json
import os
import random
import select
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.mutation_report import MUTANTS, NOT_KILLED, STATUS
from tests.tiers import TIER_VARIABLES

TIMEOUT_S = 60
PRELOAD = Path(__file__).with_name("mutation_preload.txt")


def preload() -> None:
    for line in PRELOAD.read_text().splitlines():
        name = line.split("#", 1)[0].strip()
        if name:
            importlib.import_module(name)


def run(tests: list[str], mutant: str) -> int:
    """Fork, run ``tests`` under ``mutant`` in the child; its exit code, -1 if it
    outran TIMEOUT_S (it and everything it started are killed)."""
    pid = os.fork()
    if pid == 0:  # the child: its own process group, so a timeout kills its children
        code = 3
        try:
            os.setsid()
            for name in [n for n in sys.modules if n == "tests" or n.startswith("tests.")]:
                del sys.modules[name]  # the child's tests are mutants/tests
            assert "replay_fsm" not in sys.modules
            os.chdir(MUTANTS)
            sys.path.insert(0, str(MUTANTS))
            for var in TIER_VARIABLES:
                os.environ.pop(var, None)
            os.environ.update(MUTANT_UNDER_TEST=mutant, HYPOTHESIS_PROFILE="mutation")
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            import pytest
            code = int(pytest.main(["-q", "-x", "-p", "no:cacheprovider",
                                    "-p", "no:randomly", *tests]))
        finally:
            os._exit(code)
    fd = os.pidfd_open(pid)
    try:
        if not select.select([fd], [], [], TIMEOUT_S)[0]:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -1
    finally:
        os.close(fd)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def run_twice(tests: list[str], mutant: str) -> int:
    """``run``, and for a failure a second run: a kill is a failure seen twice, so a
    test that fails once on a loaded machine does not turn into a kill."""
    code = run(tests, mutant)
    return run(tests, mutant) if code == 1 else code


def main(pattern: str, tests: list[str], survivors: bool = False) -> int:
    judge = ([code for code, state in STATUS.items() if state in NOT_KILLED] if survivors
             else [None])
    if run(tests, "") != 0:
        print("the tests fail with no mutant active: nothing judged")
        return 1
    metas = {meta: json.loads(meta.read_text()) for meta in MUTANTS.rglob("*.py.meta")}
    todo = [(meta, name) for meta, data in metas.items()
            for name, code in data["exit_code_by_key"].items()
            if code in judge and fnmatch.fnmatch(name, pattern)]
    with ThreadPoolExecutor(2) as pool:
        codes = list(pool.map(lambda item: run_twice(tests, item[1]), todo))
    killed = [(meta, name) for (meta, name), code in zip(todo, codes, strict=True)
              if code == 1]
    # Read each file again before writing it: a mutmut run may have recorded other
    # verdicts in it while these tests ran.
    for meta in {m for m, _ in killed}:
        data = json.loads(meta.read_text())
        data["exit_code_by_key"].update((name, 1) for m, name in killed if m == meta)
        meta.write_text(json.dumps(data))
    with (MUTANTS / "quick-kills.txt").open("a") as log:
        log.writelines(f"{name}\t{' '.join(tests)}\n" for _, name in killed)
    print(f"{len(todo)} judged, {len(killed)} killed, {len(todo) - len(killed)} left "
          "for mutmut")
    return 0


def recorded_kills() -> dict[str, list[str]]:
    """Each mutant in ``quick-kills.txt`` and the tests that killed it (its last
    entry); a ``-k`` expression is the rest of its line."""
    kills = {}
    for line in (MUTANTS / "quick-kills.txt").read_text().splitlines():
        name, _, words = line.partition("\t")
        tokens = words.split()
        if "-k" in tokens:
            at = tokens.index("-k")
            tokens = [*tokens[:at], "-k", " ".join(tokens[at + 1:])]
        kills[name] = tokens
    return kills


def recheck(count: int, seed: int = 0) -> int:
    """Run the tests of ``count`` recorded quick kills again (a random sample, the
    same for the same seed) with their mutant active: each must fail twice again.
    Prints the ones that do not; records nothing."""
    kills = recorded_kills()
    sample = random.Random(seed).sample(sorted(kills), min(count, len(kills)))
    with ThreadPoolExecutor(2) as pool:
        codes = list(pool.map(lambda name: run_twice(kills[name], name), sample))
    for name, code in zip(sample, codes, strict=True):
        if code != 1:
            print(f"did not hold: {name} (exit code {code}; tests {' '.join(kills[name])})")
    held = sum(code == 1 for code in codes)
    print(f"{len(sample)} quick kills rechecked (seed {seed}), {held} held")
    return 0 if held == len(sample) else 1


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--recheck"]:
        if len(args) not in (2, 3):
            sys.exit("usage: python -m tests.mutation_quick --recheck N [SEED]")
        preload()
        sys.exit(recheck(int(args[1]), int(args[2]) if len(args) > 2 else 0))
    flag = "--survivors" in args
    args = [a for a in args if a != "--survivors"]
    preload()
    sys.exit(main(args[0], args[1:], survivors=flag))
