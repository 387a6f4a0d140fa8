"""replay_fsm: a verified ring-buffered replay-batch pipeline."""

from .core import Core
from .errors import (
    CollectorDied,
    IllegalTransition,
    PackerError,
    PipelineClosed,
    PipelineFailed,
    ProtocolError,
)
from .spec import INVARIANTS, TRANSITIONS, Actor, Event, SlotState

__all__ = [
    "INVARIANTS", "TRANSITIONS", "Actor", "CollectorDied", "Core", "Event",
    "IllegalTransition", "PackerError", "PipelineClosed", "PipelineFailed",
    "ProtocolError", "SlotState",
]
__version__ = "0.1.0"

from .buffer import ReplayBuffer  # noqa: E402
from .packer import Packer, PackerHandle  # noqa: E402
from .pipeline import Pipeline, Statistics  # noqa: E402

__all__ += ["Packer", "PackerHandle", "Pipeline", "ReplayBuffer", "Statistics"]
