"""The clock the learner's liveness verdicts run on: time its looks saw pass.

A verdict of INV-LIVE needs a fault to persist for a bound (a heartbeat's silence, a
state that must not last, a copy late, rows that stopped coming). The learner sees
the other actors only at its looks (each slice of a wait for a tick not ready, each
poll), and looks are not close in time: the next wait may come a long step later, a
learner that polls may poll seldom, and the learner itself may not have run at all (the
whole job stopped with Ctrl-Z and resumed with ``fg``, every process at once). Measured
on the monotonic clock, such a stretch counted in full at the first look after it: a
packer stopped with its learner, and not yet resumed when the learner looked, was
judged dead (a job stopped 1.2 s with a bound of 0.5 s failed in ``CollectorDied``).

``LookClock`` counts a stretch between two looks for at most ``cap``: half the bound,
so that no stretch that no look saw judges alone; looks that saw a fault persist
(a wait's slices, or polls) judge it. While a learner waits, its looks come one slice
apart and the clock keeps time.
"""

from __future__ import annotations

import threading
import time


class LookClock:
    """Monotonic nanoseconds as the looks saw them pass (``look``), starting at 0 at
    the first look (or the first instant given to ``at``). A stretch between two
    looks counts for at most ``cap_s`` seconds (``look`` may set it anew: a link
    learns its bound at each look)."""

    def __init__(self, cap_s: float = float("inf")) -> None:
        self._mutex = threading.Lock()  # looks come from more than one thread
        self._cap_ns = _ns(cap_s)
        self._real_ns: int | None = None  # monotonic ns of the last look
        self._seen_ns = 0  # the clock at the last look

    def look(self, cap_s: float | None = None, real_ns: int | None = None) -> int:
        """A look now (``real_ns``: ``time.monotonic_ns()`` now, if the caller read it):
        the clock advances by the time since the last look, at most the cap, and is
        returned. ``cap_s``: the cap from now on (None: as before)."""
        real = time.monotonic_ns() if real_ns is None else real_ns
        with self._mutex:
            if cap_s is not None:
                self._cap_ns = _ns(cap_s)
            if self._real_ns is None:
                self._real_ns = real
            elif real > self._real_ns:  # another thread's look may have read a later one
                self._seen_ns += min(real - self._real_ns, self._cap_ns)
                self._real_ns = real
            return self._seen_ns

    def at(self, real_ns: int) -> int:
        """The clock's reading for ``real_ns`` (a monotonic instant), from the last look:
        exact within the cap of it, and no further than the cap from it (an event long
        before the last look, found only now, counts as one stretch no look saw: a
        heartbeat's last beat, a request made before a long step). Before the first
        look: 0, and the clock starts there (its first look finds it on from then).

        Without the mutex: a request places its instant here, on the learner's hot
        path (0.14 us a call instead of 0.48 here). A look on another thread between
        the two reads below moves the clock, and then the last look's instant, in that
        order, so the instant read first is never newer than the clock read after it:
        the instant is placed later than either look would place it, and a stretch
        from it counts less, never more. (The first call's write, before any look,
        races with nothing: the pipeline and the links look only after it.)"""
        last = self._real_ns
        if last is None:
            self._real_ns = real_ns
            return self._seen_ns
        ahead, cap = real_ns - last, self._cap_ns
        return self._seen_ns + (cap if ahead > cap else -cap if ahead < -cap else ahead)


def _ns(seconds: float) -> int:
    if seconds != seconds or seconds <= 0:
        raise ValueError(f"a look clock's cap must be positive seconds, got {seconds!r}")
    # At least 1 ns: a cap truncated to 0 (a bound under 2 ns) stopped the clock, and
    # no verdict on it could ever come.
    return 2**62 if seconds == float("inf") else max(1, int(seconds * 1e9))
