"""The request channel's give-backs, model-checked: every case of
specs/channel_model.py finds what it must (no fault, and a give-back made, where
the code's own rules are modelled; a fault in each mutant and in the rules before
stop 63's fixes). The small cases run in the fast tier, the largest five (about 30 s)
in the deep one (make verify), the rest (about 25 s) in the slow one."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

PATH = Path(__file__).resolve().parent.parent / "specs" / "channel_model.py"
FAST = ("B sound: all lost, ring empty", "B main (no in-flight rule)", "B mutant: no check",
        "A fixed (UNSURE read after)", "A main (UNSURE read before)",
        "C fixed: item taken, 1 record", "C main: item taken, 1 record")
# The largest cases (4 to 10 s each here, half of the model's time) run in the deep
# tier, with the SPIN checks (make verify): CI's time does not fit them.
DEEP = ("A2 svc fixed: D killed anywhere", "B sound: cap 3, 1 lost 2 records, closer",
        "A2 svc main (UNSURE before): items owed",
        "A2 svc mutant: service's items reading asks no alone",
        "A2 svc fixed: items owed, 1 taken, 2 records")


def model() -> ModuleType:
    spec = importlib.util.spec_from_file_location("channel_model", PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CASES = model().CASES


@pytest.mark.parametrize("case", [
    pytest.param(case, id=case[0],
                 marks=(() if case[0].startswith(FAST) else
                        pytest.mark.deep if case[0] in DEEP else pytest.mark.slow))
    for case in CASES])
def test_each_case_finds_what_it_must(case: tuple) -> None:
    ok, line = model().verdict(case)
    assert ok, line


def test_the_fast_cases_are_there() -> None:
    """A case renamed in the model would leave the fast tier with none of its own, or
    move a deep one to the slow tier."""
    assert all(any(case[0].startswith(name) for case in CASES) for name in FAST)
    assert set(DEEP) <= {case[0] for case in CASES}
