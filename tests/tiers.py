"""The test tiers and the variables that turn each on (tests/conftest.py skips the rest).

fast: always. slow: in CI (``CI=true``) or with ``REPLAY_FSM_SLOW=1``. deep: with
``REPLAY_FSM_DEEP=1``, which ``make verify`` sets and CI does not: the SPIN and
refinement checks at ring depth 3 and the benchmarks' quick runs (the suite's and
compare_revisions'), which CI's time does not fit; CI runs the same checks at ring
depth 2. Also the end-to-end tests that only wait out a long bound, or repeat a case
that CI runs another way (specs/INVARIANTS.md says which).
"""

from __future__ import annotations

import os

TIERS = {  # tier: (the variables that turn it on, where it runs without them)
    "slow": (("CI", "REPLAY_FSM_SLOW"), "CI runs it"),
    "deep": (("REPLAY_FSM_DEEP",), "make verify runs it"),
}
# Unset for mutant runs: the fast tier suffices to kill and keeps them short.
TIER_VARIABLES = tuple(var for variables, _ in TIERS.values() for var in variables)


def is_set(var: str) -> bool:
    """Whether the environment turns ``var`` on: set to anything but empty, 0, false,
    no or off (some CI systems export ``CI=false``)."""
    return os.environ.get(var, "").strip().lower() not in ("", "0", "false", "no", "off")


def tier_runs(tier: str) -> bool:
    """Whether this run includes ``tier``: one of its variables is on (``is_set``)."""
    return any(is_set(var) for var in TIERS[tier][0])


def skip_reason(tier: str) -> str:
    variables, where = TIERS[tier]
    return f"{tier} tier: set {variables[-1]}=1 ({where})"
