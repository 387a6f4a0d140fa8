"""What the SAC learner and its collector share besides the replay buffer.

Both objects live in shared memory and pickle to a spawned collector without
copying, like ``ReplayBuffer``; in a collector thread they are simply shared.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import torch

from ..data.shared import small_shared_zeros


class WeightRing:
    """Versions of the actor's flat parameters, published by the learner.

    Version ``v`` lives in slot ``v % slots``; the learner writes the slot, then
    publishes ``v``. The lock-step schedule (see ``replay_fsm.trainers.run``) keeps
    the learner from reaching version ``v + slots - 1`` before the collector has
    copied version ``v``, so a slot is never rewritten while it is read; ``read``
    checks that and reports a violation as an internal error.
    """

    def __init__(self, numel: int, slots: int) -> None:
        if numel < 1 or slots < 2:
            raise ValueError("numel must be >= 1 and slots >= 2")
        self.slots = slots
        self._data = small_shared_zeros(slots, numel, dtype=torch.float32)
        # Invariant: _version[0] is the newest version whose slot is fully written.
        self._version = small_shared_zeros(1, dtype=torch.int64)
        # A token per publish. Not an Event: its set() waits, under its condition's
        # lock, for every sleeper to wake, and a collector killed (SIGKILL, the OOM
        # killer) asleep in wait() never does: the learner's publish hung for ever.
        self._published = mp.get_context("spawn").Semaphore(0)

    @property
    def version(self) -> int:
        return int(self._version[0])

    def publish(self, version: int, flat: torch.Tensor) -> None:
        """Write ``flat`` as ``version`` (one more than the last one).

        Raises:
            ValueError: versions must increase by one.
        """
        if version != self.version + 1:
            raise ValueError(f"version {version} published after {self.version}")
        self._data[version % self.slots].copy_(flat)
        self._version[0] = version  # after the data: a reader never sees a half slot
        self._published.release()  # never blocks, whoever waits or died waiting

    def wait(self, version: int, timeout: float) -> bool:
        """Block until ``version`` is published; False if ``timeout`` ran out first."""
        deadline = time.monotonic() + timeout
        while self.version < version:  # a publish after this check left its token
            left = deadline - time.monotonic()
            if left <= 0 or not self._published.acquire(timeout=left):
                return self.version >= version
        return True

    def read(self, version: int, out: torch.Tensor) -> torch.Tensor:
        """Copy ``version`` (already published) into ``out``.

        Raises:
            ValueError: ``version`` is not published yet.
            RuntimeError: the learner overtook the reader (an internal error: the
                schedule forbids it; please report it).
        """
        if version > self.version:
            raise ValueError(f"version {version} is not published (newest {self.version})")
        out.copy_(self._data[version % self.slots])
        if self.version >= version + self.slots - 1:
            raise RuntimeError(f"internal error: weight version {version} may have been "
                               f"overwritten while read (newest {self.version}); please "
                               "report this")
        return out


class EpisodeLog:
    """Finished episodes as rows (env steps so far, monotonic time, return, length):
    the newest ``capacity`` of them, in a ring (a long run's final return is of its
    last episodes); ``dropped`` counts the older ones no longer held."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        # One row more than it holds: the collector writes the next episode there.
        self._rows = small_shared_zeros(capacity + 1, 4, dtype=torch.float64)
        # Invariant: episodes [0, _count[0]) are complete, episode i in row i % rows;
        # episode _count[0] may be being written over episode _count[0] - rows.
        self._count = small_shared_zeros(1, dtype=torch.int64)

    def record(self, env_steps: int, returns: list[float], lengths: list[int]) -> None:
        """Append finished episodes (the collector's call), over the oldest when full."""
        n, rows = int(self._count[0]), self._rows.shape[0]
        now = time.monotonic()  # system-wide clock: comparable across processes
        for ret, length in zip(returns, lengths, strict=True):
            self._rows[n % rows] = torch.tensor([env_steps, now, ret, length],
                                               dtype=torch.float64)
            n += 1
            self._count[0] = n  # one row at a time: a reader loses at most the oldest

    def rows(self, start: int = 0) -> list[tuple[int, float, float, int]]:
        """Episodes from the ``start``-th on (counting every episode recorded), of those
        still held: (env_steps, monotonic_s, return, length)."""
        rows = self._rows.shape[0]
        n = int(self._count[0])
        held = self._rows.clone()
        # Keep the episodes the collector cannot have written over while they were
        # copied: it writes episode _count[0] (read after the copy) over the one
        # ``rows`` before, so the newest ``capacity`` as counted then are whole.
        first = max(start, int(self._count[0]) - self.capacity, 0)
        return [(int(r[0]), float(r[1]), float(r[2]), int(r[3]))
                for r in (held[i % rows].tolist() for i in range(first, n))]

    @property
    def dropped(self) -> int:
        """Episodes recorded beyond capacity, the oldest, no longer held."""
        return max(0, int(self._count[0]) - self.capacity)

    def __len__(self) -> int:
        """Every episode recorded, those dropped included."""
        return int(self._count[0])


class StopFlag:
    """The learner's word to its collector to stop: set once, read with no lock. Not
    a multiprocessing Event, whose ``is_set`` takes its condition's lock: a collector
    killed (SIGKILL, the OOM killer) while it read it left the lock held, and the
    learner's ``set`` then waited for it for ever."""

    def __init__(self) -> None:
        self._flag = small_shared_zeros(1, dtype=torch.uint8)

    def set(self) -> None:
        self._flag[0] = 1

    def is_set(self) -> bool:
        return bool(self._flag[0])
