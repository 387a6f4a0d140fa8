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

# A mutant's row in specs/MUTATION.md: | `name` | reason |, in the section "Equivalent
# mutants", "Killed outside mutmut's run" (code that runs only at import) or "Needs a
# CUDA device" (code only a CUDA run reaches; its tests skip here).
LISTED = re.compile(r"^\|\s*`(replay_fsm\.[^`]+__mutmut_\d+)`\s*\|")
SECTIONS = {"equivalent": "## Equivalent mutants", "outside": "## Killed outside mutmut's run",
            "cuda": "## Needs a CUDA device"}


def module_of(mutant: str) -> str:
    return re.split(r"\.x[_ǁ]", mutant, maxsplit=1)[0]


def results(mutants: Path = MUTANTS) -> dict[str, str]:
    """Every mutant's status, from the ``.meta`` files mutmut writes."""
    out: dict[str, str] = {}
    for meta in sorted(mutants.rglob("*.py.meta")):
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            out[name] = STATUS.get(code, "suspicious")
    return out


def listed(listing: Path = LISTING) -> dict[str, set[str]]:
    """The mutants each section of specs/MUTATION.md lists."""
    found: dict[str, set[str]] = {key: set() for key in SECTIONS}
    section = None
    for line in listing.read_text().splitlines() if listing.exists() else []:
        if line.startswith("## "):
            section = next((k for k, title in SECTIONS.items() if line.startswith(title)),
                           None)
        elif section is not None and (m := LISTED.match(line)):
            found[section].add(m.group(1))
    return found


NOT_KILLED = ("survived", "no tests")
# What a survivor listed in each section of specs/MUTATION.md counts as.
VERDICT = {"equivalent": "equivalent", "outside": "killed", "cuda": "cuda"}


def final(status: dict[str, str], lists: dict[str, set[str]]) -> dict[str, str]:
    """Each mutant's verdict once the listing is applied: a survivor listed as
    equivalent is "equivalent", one listed as killed outside the run is "killed", one
    that only a CUDA device reaches is "cuda"."""
    out = dict(status)
    for name, state in status.items():
        if state in NOT_KILLED:
            section = next((key for key in SECTIONS if name in lists[key]), None)
            if section is not None:
                out[name] = VERDICT[section]
    return out


def table(verdict: dict[str, str]) -> list[str]:
    rows = ["| module | generated | checked | killed | timeout | survived | equivalent "
            "| needs CUDA | kill rate | detected |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    modules = sorted({module_of(n) for n in verdict})
    for module in [*modules, "all"]:
        names = [n for n in verdict if module in ("all", module_of(n))]
        count = Counter(verdict[n] for n in names)
        checked = len(names) - count["not checked"]
        real = checked - count["equivalent"] - count["cuda"]
        rate = f"{count['killed'] / real:.1%}" if real else "-"
        detected = f"{(count['killed'] + count['timeout']) / real:.1%}" if real else "-"
        survived = count["survived"] + count["no tests"]
        rows.append(f"| {module} | {len(names)} | {checked} | {count['killed']} "
                    f"| {count['timeout']} | {survived} | {count['equivalent']} "
                    f"| {count['cuda']} | {rate} | {detected} |")
    return rows


def main() -> int:
    status = results()
    if not status:
        print("no results under mutants/: run `make mutation` first")
        return 1
    lists = listed()
    print("\n".join(table(final(status, lists))))
    print("(kill rate: killed / (checked - equivalent - needs CUDA), the mutants killed "
          "outside the run counted as killed; detected: timeouts too; survived: with no "
          "test too; needs CUDA: reached only on a CUDA device, whose tests skip here)")
    problems = []
    for name, state in sorted(status.items()):
        where = [k for k, names in lists.items() if name in names]
        if state in NOT_KILLED and not where:
            problems.append(f"{state}, not listed in specs/MUTATION.md: {name}")
        elif state not in NOT_KILLED and where:
            problems.append(f"listed as {where[0]} but {state}: {name}")
        elif state in ("not checked", "suspicious", "segfault", "skipped"):
            problems.append(f"{state}: {name}")
    for key, names in lists.items():
        problems += [f"listed as {key}, no such mutant: {n}" for n in sorted(names - set(status))]
    print("\n".join(problems) or "every survivor is listed in specs/MUTATION.md")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
