"""replay_fsm: a verified ring-buffered replay-batch pipeline.

The package is layered; each layer imports only the ones above it in this list:

- protocol (torch-free): ``spec`` (the transition table), ``core`` (the sans-IO
  ring of slot machines), ``wire`` (the messages and their codecs), ``errors``,
  ``signals`` (what Ctrl-C and SIGTERM mean to each process);
- ``data``: the shared replay buffer, the sampling contract, channels, the packer;
- ``transfer``: one backend per device family behind one protocol, and a registry;
- ``runtime``: ``Pipeline`` with its collector links, transfer worker, observers
  (statistics, traces) and checked mode;
- ``verify``: the explorer of the real core, trace conformance, the Promela and
  diagram generators;
- entry points: ``compat`` (the seed's class), ``testing`` (a Hypothesis machine
  for your configuration), ``demo``, ``distributed``, ``cli``.

The names below load lazily, so ``import replay_fsm.spec`` or ``replay_fsm.core``
never imports torch.
"""

from __future__ import annotations

import importlib
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> module that defines it
_EXPORTS = {
    "INVARIANTS": "spec", "TRANSITIONS": "spec", "Actor": "spec", "Event": "spec",
    "SlotState": "spec", "Core": "core", "MAX_RING_DEPTH": "core",
    "CollectorDied": "errors", "DataStalled": "errors", "IllegalTransition": "errors",
    "PackerError": "errors", "PipelineClosed": "errors", "PipelineFailed": "errors",
    "ProtocolError": "errors", "TransferFailed": "errors", "WriterDied": "errors",

    "ReplayBuffer": "data.buffer", "Packer": "data.packer", "PackerHandle": "data.packer",
    "Pipeline": "runtime.pipeline", "Statistics": "runtime.pipeline",
    "TransferBackend": "transfer.base", "CheckpointError": "data.checkpoint",
}
__all__ = [
    "INVARIANTS", "TRANSITIONS", "Actor", "CheckpointError", "CollectorDied", "Core",
    "DataStalled", "Event",
    "IllegalTransition", "MAX_RING_DEPTH", "Packer", "PackerError", "PackerHandle", "Pipeline",
    "PipelineClosed", "PipelineFailed", "ProtocolError", "ReplayBuffer", "SlotState",
    "Statistics", "TransferBackend", "TransferFailed", "WriterDied",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'replay_fsm' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    """The exported names, the module's dunders and the subpackages imported so far;
    not the names this file imports for itself (``importlib``, ``Any``...)."""
    own = {name for name, value in globals().items()
           if name.startswith("__") or (isinstance(value, types.ModuleType)
                                        and value.__name__.startswith(f"{__name__}."))}
    return sorted(own | set(__all__))


if TYPE_CHECKING:
    from .core import MAX_RING_DEPTH, Core
    from .data.buffer import ReplayBuffer
    from .data.checkpoint import CheckpointError
    from .data.packer import Packer, PackerHandle
    from .errors import (
        CollectorDied,
        DataStalled,
        IllegalTransition,
        PackerError,
        PipelineClosed,
        PipelineFailed,
        ProtocolError,
        TransferFailed,
        WriterDied,
    )
    from .runtime.pipeline import Pipeline, Statistics
    from .spec import INVARIANTS, TRANSITIONS, Actor, Event, SlotState
    from .transfer.base import TransferBackend
