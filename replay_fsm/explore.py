"""The old path of ``replay_fsm.verify.explore``, kept working: the same module object."""

import sys

from .verify import explore as _module
from .verify.explore import *  # noqa: F403  (for type checkers; the line below is what runs)

sys.modules[__name__] = _module
