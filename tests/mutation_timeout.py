"""A pytest plugin for mutation runs (``make mutation``): a test that runs past its
pytest-timeout ends the run with exit code 36, which mutmut records as a timeout.

pytest-timeout alone turns a hang into an ordinary failure (exit code 1), which
mutmut would count as a kill; a mutant that only makes a test hang is reported
apart, so the figures in specs/MUTATION.md can say how many kills were hangs.
The timer is a thread that ends the process, so it also ends a test stuck in a
C call or a lock, where a SIGALRM handler would never run.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import pytest

# mutmut's exit code for "timeout" (mutmut.stats.status_by_exit_code).
TIMEOUT_EXIT_CODE = 36


def _end_run(nodeid: str, timeout: float) -> None:
    sys.stderr.write(f"\nmutation run: {nodeid} ran past {timeout:g} s\n")
    sys.stderr.flush()
    os._exit(TIMEOUT_EXIT_CODE)


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: Any, settings: Any) -> bool:
    timer = threading.Timer(settings.timeout, _end_run, (item.nodeid, settings.timeout))
    timer.daemon = True
    timer.start()
    item.mutation_timer = timer
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_cancel_timer(item: Any) -> bool:
    timer = getattr(item, "mutation_timer", None)
    if timer is not None:
        timer.cancel()
    return True
