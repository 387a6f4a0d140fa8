"""Judge the mutants mutmut's run has not reached, with a narrow set of fast tests.

``python -m tests.mutation_quick PATTERN TEST...`` runs, for every mutant whose name
matches PATTERN and which mutmut has not checked (or, with ``--survivors``, which
survived or had no test in mutmut's run: to judge a test written for it), the given
tests on mutmut's
trampolined copy (``mutants/``) with that mutant active, two at a time. A mutant
those tests fail on is killed, and is recorded as mutmut records a kill (exit code 1
in its ``.meta`` file), so that the report and later ``mutmut run``s see it. Any
other outcome records nothing: the mutant stays for mutmut's full test selection.
A control run of the same tests with no mutant active must pass first.
"""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from tests.mutation_report import MUTANTS, NOT_KILLED, STATUS

TIMEOUT_S = 60


def run(tests: list[str], mutant: str) -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "REPLAY_FSM_SLOW")}
    env.update(MUTANT_UNDER_TEST=mutant, HYPOTHESIS_PROFILE="mutation")
    try:
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
             "-p", "no:randomly", *tests], cwd=MUTANTS, env=env, timeout=TIMEOUT_S,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    except subprocess.TimeoutExpired:
        return -1


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
        codes = list(pool.map(lambda item: run(tests, item[1]), todo))
    killed = [(meta, name) for (meta, name), code in zip(todo, codes, strict=True)
              if code == 1]
    for meta, name in killed:
        metas[meta]["exit_code_by_key"][name] = 1
    for meta in {m for m, _ in killed}:
        meta.write_text(json.dumps(metas[meta]))
    with (MUTANTS / "quick-kills.txt").open("a") as log:
        log.writelines(f"{name}\t{' '.join(tests)}\n" for _, name in killed)
    print(f"{len(todo)} judged, {len(killed)} killed, {len(todo) - len(killed)} left "
          "for mutmut")
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    flag = "--survivors" in args
    args = [a for a in args if a != "--survivors"]
    sys.exit(main(args[0], args[1:], survivors=flag))
