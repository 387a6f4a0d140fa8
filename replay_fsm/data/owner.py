"""Which process holds a lock shared between processes, and whether it still lives.

A POSIX semaphore is never released for a process that dies holding it: a collector
killed inside ``ReplayBuffer.add`` (SIGKILL, the OOM killer) leaves the buffer's write
lock taken for good. The holder writes its identity into shared memory (an ``Owner``
record) while it holds the lock, so that a process waiting for it can tell a holder
that is slow from one that is dead, and fail instead of waiting for ever.

A process is named by its pid and its start time (a pid is reused; the pair is not)
in one int64, with the inodes of its pid and time namespaces beside it: a pid means
something only in its own pid namespace, and /proc shows a start time shifted by the
reader's time namespace, so a holder of another namespace is never judged dead.
Where /proc cannot be read, nothing is judged dead either, and a process that /proc
hides (``hidepid``) is asked for with ``kill(pid, 0)``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import numpy as np
import torch

from .shared import small_shared_zeros

PROC = "/proc"  # where processes are looked up (a test points it at a fake tree)
PID_BITS = 22  # pids are below 2**22, the kernel's PID_MAX_LIMIT
PID_MASK = (1 << PID_BITS) - 1
UNKNOWN = (0, 0, 0)

# (token, pid namespace, time namespace) of this process, once read; UNKNOWN for good
# where there is no /proc
_me: tuple[int, int, int] | None = None


def _stat(pid: int | str) -> tuple[int, bytes, int]:
    """The pid, state letter and start time (clock ticks after boot) of process
    ``pid`` ("self": this one)."""
    with open(os.path.join(PROC, str(pid), "stat"), "rb") as f:
        text = f.read()
    # the command name, field 2, is in parentheses and may hold spaces and ')'
    fields = text[text.rindex(b")") + 2:].split()
    return int(text[:text.index(b" ")]), fields[0], int(fields[19])


def _namespace(kind: str) -> int:
    try:
        return os.stat(os.path.join(PROC, "self", "ns", kind)).st_ino
    except FileNotFoundError:
        if kind == "time":
            return 0  # a kernel before 5.6: no time namespaces, every start time as is
        raise


def me() -> tuple[int, int, int]:
    """This process's (token, pid namespace, time namespace); UNKNOWN where /proc
    cannot say (read again at the next call, but for a system without /proc)."""
    global _me
    if _me is None:
        try:
            pid, _, start = _stat("self")
            found = (pid | start << PID_BITS, _namespace("pid"), _namespace("time"))
        except FileNotFoundError:
            found = UNKNOWN
        except (OSError, ValueError, IndexError):
            return UNKNOWN  # out of descriptors, say: not for ever
        _me = found
    return _me


def forget_me() -> None:
    """In a forked child (registered below): its pid and start time are its own."""
    global _me
    _me = None


def _gone(pid: int) -> bool:
    """Whether no process ``pid`` exists (of this pid namespace), /proc having no entry
    for it: one that ``hidepid`` hides from this process still answers ``kill``."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: it exists, another user's
        pass
    return False


class Owner:
    """A three-word record in shared memory: [holder's token, its pid namespace, its
    time namespace], the token 0 while no process that can be judged holds the lock.

    Invariant: the token is non-zero only while its process holds the lock (written
    after the lock is taken, cleared before it is released), the namespaces written
    before the token.
    """

    def __init__(self) -> None:
        self.words = small_shared_zeros(3, dtype=torch.int64)  # no name in /dev/shm
        self.view()

    def view(self) -> None:
        # numpy item access costs nanoseconds; a torch indexing call, microseconds
        self._words: np.ndarray = self.words.numpy()
        # Says that no process holds the lock (its holder is about to release it). One
        # C call, no Python frame: a Ctrl-C lands before it or after it, never at a
        # function's start with the token left behind for a lock released next.
        self.release: Callable[[], None] = functools.partial(self._words.__setitem__, 0, 0)

    def __getstate__(self) -> dict[str, torch.Tensor]:
        return {"words": self.words}

    def __setstate__(self, state: dict[str, torch.Tensor]) -> None:
        self.words = state["words"]
        self.view()

    def hold(self) -> None:
        """Say that this process holds the lock (the caller has just taken it)."""
        token, pid_namespace, time_namespace = me()
        if token:
            self._words[1] = pid_namespace
            self._words[2] = time_namespace
            self._words[0] = token

    @property
    def held(self) -> bool:
        """Whether a process that can be judged holds the lock, as read now."""
        return bool(self._words[0])

    def _read(self) -> tuple[int, int, int]:
        words = self._words
        return int(words[0]), int(words[1]), int(words[2])

    def dead_holder(self) -> int | None:
        """The pid of a process that died holding the lock; None while none holds it,
        its holder lives (a zombie is dead), or it cannot be judged (another pid or
        time namespace, no /proc)."""
        record = self._read()
        # Read again, token first: a holder that released the lock and then exited
        # cleared its token first, and a later holder writes its namespaces before
        # its token; a record unchanged after its process was seen dead was its last.
        if lives(record) is False and self._read() == record:
            return record[0] & PID_MASK
        return None


def lives(record: tuple[int, int, int]) -> bool | None:
    """Whether the process a (token, pid namespace, time namespace) record names
    still runs: False once it exited (a zombie has) or its pid names another process
    since (a start time of its own); None where that cannot be judged: no token,
    another pid or time namespace, no /proc."""
    token, pid_namespace, time_namespace = record
    mine = me()
    if not token or not mine[1] or (pid_namespace, time_namespace) != mine[1:]:
        return None
    pid, start = token & PID_MASK, token >> PID_BITS
    try:
        _, state, started = _stat(pid)
    except (FileNotFoundError, ProcessLookupError):
        return not _gone(pid)  # no entry: died and reaped, or hidden from this process
    except (OSError, ValueError, IndexError):
        return None
    return state not in (b"Z", b"X") and started == start


os.register_at_fork(after_in_child=forget_me)
