import os
import signal

from hypothesis import HealthCheck, settings

from .tiers import TIERS, skip_reason, tier_runs

# fast: local runs. ci: thorough and derandomized, so a failure replays exactly.
settings.register_profile(
    "fast", max_examples=25, stateful_step_count=30, deadline=None, print_blob=True,
)
settings.register_profile(
    "ci", max_examples=300, stateful_step_count=100, deadline=None, print_blob=True,
    derandomize=True, suppress_health_check=[HealthCheck.too_slow],
)
# mutation: the fast profile, derandomized and without the example database, so a
# mutant's verdict does not depend on the mutants run before it (make mutation).
settings.register_profile(
    "mutation", max_examples=25, stateful_step_count=30, deadline=None, print_blob=True,
    derandomize=True, database=None,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fast"))

# A shell without job control starts a background command (`make test &` in a
# script) with SIGINT ignored, and every process the tests start would inherit
# that through exec: the tests that interrupt a learner or a demo would then wait
# for an interrupt that never lands. Take Python's own handler back (the library
# puts back whatever handlers its caller had: tests/test_signals.py checks that).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    """Skips the tests of each tier this run leaves out (tests/tiers.py)."""
    import pytest

    for tier in TIERS:
        if tier_runs(tier):
            continue
        skip = pytest.mark.skip(reason=skip_reason(tier))
        for item in items:
            if tier in item.keywords:
                item.add_marker(skip)
