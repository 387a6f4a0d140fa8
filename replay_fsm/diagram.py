"""The old path of ``replay_fsm.verify.diagram``, kept working: the same module object."""

import sys

from .verify import diagram as _module
from .verify.diagram import *  # noqa: F403  (for type checkers; the line below is what runs)

sys.modules[__name__] = _module
