"""The old path of ``replay_fsm.verify.conformance``, kept working: the same module object."""

import sys

from .verify import conformance as _module
from .verify.conformance import *  # noqa: F403  (for type checkers; the line below is what runs)

sys.modules[__name__] = _module
