"""Exceptions. Misuse raises built-ins or ProtocolError; a broken pipeline raises
PipelineFailed chained to its cause."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator, Mapping
from typing import Any

# How this process's messages name the settings a front end sets: the names of each
# ``naming_settings`` block now open, in the order they opened (replaced whole, under
# the lock, so that a reader on any thread sees one or the other)
_SETTING_LAYERS: tuple[dict[str, str], ...] = ()
_SETTING_LOCK = threading.Lock()


def _forked() -> None:
    """In a child made by os.fork: the lock, which a thread of the parent may have
    held as it forked, is free (that thread is not in the child to release it)."""
    global _SETTING_LOCK
    _SETTING_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forked)


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
    for names in reversed(_SETTING_LAYERS):  # the block opened last first
        if name in names:
            return names[name]
    return name


def setting_names() -> dict[str, str]:
    """The names ``naming_settings`` gave for now: what a process started to carry
    on the work (a rank of a launch) names its settings as."""
    merged: dict[str, str] = {}
    for names in _SETTING_LAYERS:
        merged.update(names)
    return merged


@contextlib.contextmanager
def naming_settings(names: Mapping[str, str]) -> Iterator[None]:
    """For the with-block, every message this process builds (on any thread) calls
    the setting ``name`` ``names[name]`` (``setting``); the names given before come
    back after it. Blocks may end in another order than they began (two threads'
    blocks that overlap, each running a command): each one's end takes back its
    own names only, so that none outlives its block, whichever ends first."""
    global _SETTING_LAYERS
    layer = dict(names)  # this block's own: ended by identity, not by value
    with _SETTING_LOCK:
        _SETTING_LAYERS = (*_SETTING_LAYERS, layer)
    try:
        yield
    finally:
        with _SETTING_LOCK:
            _SETTING_LAYERS = tuple(each for each in _SETTING_LAYERS if each is not layer)


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
