"""A drop-in for the seed's ``CPUPinnedDoubleBufferReplayPipeline``.

Change one import::

    from replay_fsm.compat import CPUPinnedDoubleBufferReplayPipeline

and the trainer, its collector (UniLab's ``_service_collector_pack_requests`` or
yours) and its replay buffer (UniLab's ``ReplayBuffer`` or ``replay_fsm``'s) run
unchanged. Modules: ``pipeline`` (the class), ``link`` (the seed's queues, and how a
dead collector is noticed), ``buffer`` (one view of either buffer), ``transfer``
(the seed's backends as its users saw them), ``errors`` (``RuntimeError``s).
"""

from .errors import CollectorDied, PipelineFailed, TransferFailed
from .pipeline import CPUPinnedDoubleBufferReplayPipeline

__all__ = ["CPUPinnedDoubleBufferReplayPipeline", "CollectorDied", "PipelineFailed",
           "TransferFailed"]
