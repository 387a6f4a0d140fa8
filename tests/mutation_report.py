"""The figures of a mutation run, per module, checked against specs/MUTATION.md.

``python -m tests.mutation_report`` (the last step of ``make mutation``) reads
mutmut's results from ``mutants/`` and prints, per mutated module: mutants
generated, killed, timed out, survived, with no test, equivalent (listed in
specs/MUTATION.md), and the kill rate over the non-equivalent mutants. It exits
non-zero when a survivor is not listed as equivalent, when a listed mutant was
killed after all (a stale entry), or when a mutant was not checked.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTANTS = ROOT / "mutants"
LISTING = ROOT / "specs" / "MUTATION.md"

# mutmut's exit codes (mutmut.stats.status_by_exit_code), kept here so the report
# runs without mutmut; codes it does not know are "suspicious", as mutmut says.
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests",
          34: "skipped", 36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout",
          255: "timeout", 37: "caught by type check", -11: "segfault", -9: "segfault",
          None: "not checked"}

# An equivalent mutant's row in specs/MUTATION.md: | `name` | reason |
LISTED = re.compile(r"^\|\s*`(replay_fsm\.[^`]+__mutmut_\d+)`\s*\|")


def module_of(mutant: str) -> str:
    return re.split(r"\.x[_ǁ]", mutant, maxsplit=1)[0]


def results(mutants: Path = MUTANTS) -> dict[str, str]:
    """Every mutant's status, from the ``.meta`` files mutmut writes."""
    out: dict[str, str] = {}
    for meta in sorted(mutants.rglob("*.py.meta")):
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            out[name] = STATUS.get(code, "suspicious")
    return out


def listed_equivalent(listing: Path = LISTING) -> set[str]:
    if not listing.exists():
        return set()
    return {m.group(1) for line in listing.read_text().splitlines()
            if (m := LISTED.match(line))}


def table(status: dict[str, str], equivalent: set[str]) -> list[str]:
    rows = ["| module | generated | killed | timeout | survived | no tests | equivalent "
            "| kill rate | detected |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    modules = sorted({module_of(n) for n in status})
    for module in [*modules, "all"]:
        names = [n for n in status if module in ("all", module_of(n))]
        count = Counter(status[n] for n in names)
        eq = sum(1 for n in names if n in equivalent and status[n] == "survived")
        real = len(names) - eq
        rate = f"{count['killed'] / real:.1%}" if real else "-"
        detected = f"{(count['killed'] + count['timeout']) / real:.1%}" if real else "-"
        rows.append(f"| {module} | {len(names)} | {count['killed']} | {count['timeout']} "
                    f"| {count['survived'] - eq} | {count['no tests']} | {eq} | {rate} "
                    f"| {detected} |")
    return rows


def main() -> int:
    status = results()
    if not status:
        print("no results under mutants/: run `make mutation` first")
        return 1
    equivalent = listed_equivalent()
    print("\n".join(table(status, equivalent)))
    print("(kill rate: killed / (generated - equivalent); detected counts timeouts too; "
          "survived excludes the equivalent ones)")
    problems = []
    for name, state in sorted(status.items()):
        if state == "survived" and name not in equivalent:
            problems.append(f"survived, not listed as equivalent: {name}")
        elif state != "survived" and name in equivalent:
            problems.append(f"listed as equivalent but {state}: {name}")
        elif state in ("not checked", "suspicious", "segfault", "skipped"):
            problems.append(f"{state}: {name}")
    stale = sorted(equivalent - set(status))
    problems += [f"listed as equivalent, no such mutant: {name}" for name in stale]
    print("\n".join(problems) or "every survivor is listed as equivalent in specs/MUTATION.md")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
