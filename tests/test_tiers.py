"""The tier switches read as a user means them (tests/tiers.py)."""

from __future__ import annotations

import pytest

from .tiers import TIER_VARIABLES, tier_runs


@pytest.mark.parametrize("value, on", [
    ("1", True), ("true", True), ("yes", True), ("on", True),
    ("", False), ("0", False), ("false", False), ("False", False), ("no", False),
    ("off", False), (" 0 ", False)])
def test_a_tier_variable_set_to_0_or_false_is_off(
        monkeypatch: pytest.MonkeyPatch, value: str, on: bool) -> None:
    """``CI=false`` (some CI systems export it) or ``REPLAY_FSM_DEEP=0`` turned the tier
    on: any value but an empty one did."""
    for var in TIER_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    for tier, var in (("slow", "CI"), ("slow", "REPLAY_FSM_SLOW"), ("deep", "REPLAY_FSM_DEEP")):
        monkeypatch.setenv(var, value)
        assert tier_runs(tier) is on, (var, value)
        monkeypatch.delenv(var)
