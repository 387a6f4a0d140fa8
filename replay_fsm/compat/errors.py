"""The errors a seed user catches.

The seed raised what went wrong as it was (a ``KeyError`` from a ready dict without
``tick_id``, its own ``RuntimeError``s) and raised it again on every later call. The
compat class does the same with the cause of a failure. Failures that only
replay_fsm detects (a dead collector, a copy that never completes) come as these
classes: ours, so ``except replay_fsm.CollectorDied`` works, and ``RuntimeError``s, so
a trainer's ``except RuntimeError`` written for the seed catches them too.
"""

from __future__ import annotations

from .. import errors


class PipelineFailed(errors.PipelineFailed, RuntimeError):
    """The pipeline failed; ``__cause__`` is the original error, when there is one."""


class CollectorDied(errors.CollectorDied, PipelineFailed):
    """The collector that serves the request queue is gone (its process exited, or it
    stayed silent past ``stall_timeout``)."""


class TransferFailed(errors.TransferFailed, PipelineFailed):
    """The copy side is gone, or a copy did not complete within ``liveness_timeout``."""


def as_seed_error(failure: BaseException, message: str | None = None) -> BaseException:
    """What the seed's user sees for the pipeline's ``failure`` (its first error);
    ``message`` replaces the text of a failure replay_fsm detected."""
    if not isinstance(failure, errors.PipelineFailed):
        return failure  # the collector's or the queue's own error, as the seed raised it
    kind: type[PipelineFailed] = PipelineFailed
    if isinstance(failure, errors.CollectorDied):
        kind = CollectorDied
    elif isinstance(failure, errors.TransferFailed):
        kind = TransferFailed
    seen = kind(str(failure) if message is None else message)
    seen.__cause__ = failure.__cause__
    return seen
