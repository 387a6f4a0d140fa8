"""The old path of ``replay_fsm.data.sampling``, kept working: the same module object."""

import sys

from .data import sampling as _module
from .data.sampling import *  # noqa: F403  (for type checkers; the line below is what runs)

sys.modules[__name__] = _module
