"""Exceptions. Misuse raises built-ins or ProtocolError; a broken pipeline raises
PipelineFailed chained to its cause."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator, Mapping
from typing import Any

# How this process's messages name the settings a front end sets (``naming_settings``)
_SETTING_NAMES: dict[str, str] = {}


class ReplayFSMError(Exception):
    """Base of the library's own errors."""


class ProtocolError(ReplayFSMError, RuntimeError):
    """A call the protocol forbids in the current state; nothing was changed."""


class IllegalTransition(ProtocolError):
    """An event the transition table has no row for, from the slot's state."""


class PipelineClosed(ProtocolError):
    """A call after close()."""


class PipelineFailed(ReplayFSMError):
    """The pipeline failed earlier; ``__cause__`` is the original error."""


class CollectorDied(PipelineFailed):
    """The packer (thread or process) that serves pack requests is gone."""


class DataStalled(PipelineFailed):
    """A request waited for rows (``min_snapshot_ptr``) and none was added to the
    replay buffer for ``stall_timeout`` seconds: whatever writes the rows stopped."""


class TransferFailed(PipelineFailed):
    """The copy side is gone: the copy engine or the transfer worker died, or a copy
    did not complete within the liveness bound."""


class WriterDied(ReplayFSMError, RuntimeError):
    """A process died inside an ``add`` to a replay buffer (killed: SIGKILL, the OOM
    killer), holding the buffer's write lock with rows half written. The lock is
    never released and those rows never become whole: adds, pauses and saves of the
    buffer, and gathers of those rows, raise this instead of waiting for ever."""


class PackerError(ReplayFSMError):
    """An exception raised while packing, carried over from the packer's side.

    The message is the packer's exception in one line; ``traceback_text`` holds its
    whole traceback, as the packer's process printed it.
    """

    def __init__(self, tick: int, traceback_text: str) -> None:
        lines = [line for line in traceback_text.strip().splitlines() if line.strip()]
        cause = lines[-1].strip() if lines else "unknown error"
        super().__init__(f"packing tick {tick} failed: {cause}")
        self.tick = tick
        self.traceback_text = traceback_text

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from what the constructor takes (args holds the message), so it
        # crosses a process boundary: a pool's worker, a spawned collector.
        return type(self), (self.tick, self.traceback_text), vars(self)


class RankFailed(ReplayFSMError):
    """A rank of ``replay_fsm.distributed.launch`` failed, and the launcher stopped
    the others: the first rank to fail (a stop signal's exit aside), its exit code
    (negative: the signal that killed it) and its error in one line. ``silent``: the
    ranks that neither failed nor wrote their files, such as one stopped (SIGSTOP)
    or stuck while the others' all-reduce ran out of ``peer_timeout``: the error of
    a collective does not say which peer did not come. ``__cause__`` is torch's
    ``ChildFailedError``, with every rank's failure."""

    def __init__(self, rank: int, exitcode: int, reason: str,
                 silent: tuple[int, ...] = ()) -> None:
        named = ", ".join(map(str, silent))
        super().__init__(f"rank {rank} failed ({describe_exit(exitcode)}): {reason}" + (
            f"; rank{'s' if len(silent) > 1 else ''} {named} wrote no files (stopped, "
            "stuck, or killed before writing them)" if silent else ""))
        self.rank, self.exitcode, self.reason = rank, exitcode, reason
        self.silent = tuple(silent)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.rank, self.exitcode, self.reason, self.silent),
                vars(self))


def setting(name: str) -> str:
    """What a message calls the setting ``name`` (a config's field, a parameter its
    user sets): ``name`` itself, unless a front end said how its users set it
    (``naming_settings``): the command line's ``--liveness-timeout`` for
    ``liveness_timeout``. A message that names what its user can change names it
    through here, so the front end's user is told the option to change, and no one
    rewrites the message's text (which holds the user's own values too)."""
    return _SETTING_NAMES.get(name, name)


def setting_names() -> dict[str, str]:
    """The names ``naming_settings`` gave for now: what a process started to carry
    on the work (a rank of a launch) names its settings as."""
    return dict(_SETTING_NAMES)


@contextlib.contextmanager
def naming_settings(names: Mapping[str, str]) -> Iterator[None]:
    """For the with-block, every message this process builds (on any thread) calls
    the setting ``name`` ``names[name]`` (``setting``); the names given before come
    back after it."""
    global _SETTING_NAMES
    before = _SETTING_NAMES
    _SETTING_NAMES = {**before, **names}
    try:
        yield
    finally:
        _SETTING_NAMES = before


def first_line(text: str) -> str:
    """The first line of ``text`` that says something (a letter or a digit in it),
    stripped; "" for none. torch's errors begin with a newline and a rule of "="s."""
    return next((line.strip() for line in text.splitlines()
                 if any(c.isalnum() for c in line)), "")


def describe_exit(exitcode: int) -> str:
    """``exit code 1``, or ``killed by SIGKILL`` for a negative (signal) code."""
    if exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        return f"killed by {signal.Signals(-exitcode).name}"
    except ValueError:
        return f"killed by signal {-exitcode}"
