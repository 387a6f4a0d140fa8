"""Which process holds a lock shared between processes, and whether it still lives.

A POSIX semaphore is never released for a process that dies holding it: a collector
killed inside ``ReplayBuffer.add`` (SIGKILL, the OOM killer) leaves the buffer's write
lock taken for good. The holder writes its identity into shared memory (an ``Owner``
record) while it holds the lock, so that a process waiting for it can tell a holder
that is slow from one that is dead, and fail instead of waiting for ever.

A process is named by its pid and its start time (a pid is reused; the pair is not)
in one int64, with its pid namespace's inode beside it: a pid means something only in
its own namespace, and a holder from another one is never judged dead. Where /proc
cannot be read, nothing is judged dead either.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import numpy as np
import torch

PROC = "/proc"  # where processes are looked up (a test points it at a fake tree)
PID_BITS = 22  # pids are below 2**22, the kernel's PID_MAX_LIMIT
PID_MASK = (1 << PID_BITS) - 1

_me: tuple[int, int] | None = None  # (token, namespace) of this process, once read


def _stat(pid: int | str) -> tuple[int, bytes, int]:
    """The pid, state letter and start time (clock ticks after boot) of process
    ``pid`` ("self": this one)."""
    with open(os.path.join(PROC, str(pid), "stat"), "rb") as f:
        text = f.read()
    # the command name, field 2, is in parentheses and may hold spaces and ')'
    fields = text[text.rindex(b")") + 2:].split()
    return int(text[:text.index(b" ")]), fields[0], int(fields[19])


def me() -> tuple[int, int]:
    """This process's (token, pid namespace); (0, 0) where /proc cannot say."""
    global _me
    if _me is None:
        try:
            pid, _, start = _stat("self")
            namespace = os.stat(os.path.join(PROC, "self", "ns", "pid")).st_ino
        except (OSError, ValueError, IndexError):
            _me = (0, 0)
        else:
            _me = (pid | start << PID_BITS, namespace)
    return _me


def forget_me() -> None:
    """In a forked child (registered below): its pid and start time are its own."""
    global _me
    _me = None


class Owner:
    """A two-word record in shared memory: [holder's token, its pid namespace], the
    token 0 while no process that can be judged holds the lock.

    Invariant: the token is non-zero only while its process holds the lock (written
    after the lock is taken, cleared before it is released), the namespace written
    before the token.
    """

    def __init__(self) -> None:
        self.words = torch.zeros(2, dtype=torch.int64).share_memory_()
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
        token, namespace = me()
        if token:
            self._words[1] = namespace
            self._words[0] = token

    @property
    def held(self) -> bool:
        """Whether a process that can be judged holds the lock, as read now."""
        return bool(self._words[0])

    def dead_holder(self) -> int | None:
        """The pid of a process that died holding the lock; None while none holds it,
        its holder lives (a zombie is dead), or it cannot be judged (another pid
        namespace, no /proc)."""
        token = int(self._words[0])
        namespace = int(self._words[1])
        if not token or int(self._words[0]) != token:  # none, or changed meanwhile
            return None
        mine = me()[1]
        if not mine or namespace != mine:
            return None
        pid, start = token & PID_MASK, token >> PID_BITS
        try:
            _, state, started = _stat(pid)
        except (FileNotFoundError, ProcessLookupError):
            dead = True  # no such process: it died, and was reaped
        except (OSError, ValueError, IndexError):
            return None
        else:
            dead = state in (b"Z", b"X") or started != start
        # Read again: a holder that released the lock and then exited cleared its
        # token first; one still there after its process was seen dead was left by it.
        return pid if dead and int(self._words[0]) == token else None


os.register_at_fork(after_in_child=forget_me)
