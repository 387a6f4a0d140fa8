"""The watchdog: INV-LIVE for every state a learner can wait on.

While the learner waits on a slot, each slice of the wait (and each poll of a tick
not ready) asks:
- REQUESTED: is the collector alive and serving (the link's answer), and is the
  transfer worker there to take its pack-done message, not in one backend submit for
  longer than ``timeout`` since the learner first found it there?
- SUBMITTED: can the backend's copy engine still complete copies, and has the copy
  completed within ``timeout`` of when the learner first found it pending, in a wait
  or a poll (``Pipeline._judge_locked``)?
The first "no" becomes the pipeline's failure: ``CollectorDied`` for the collector
side, ``TransferFailed`` for the copy side. A REQUESTED tick whose rows are not in the
replay buffer yet (``min_snapshot_ptr``) has nothing to do with either: its wait asks
whether rows still come (``RowWatch``), and ``DataStalled`` ends it when they stopped.
Meanwhile a link whose collector does not beat while rows come (an external one calls
``Packer.service`` between its environment steps, ``beats_while_rows_come``) is asked
only whether the collector is there at all (a process that exited); its silence
counts from when the learner saw the rows there (the request, at the earliest).
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import CollectorDied, DataStalled, PipelineFailed, TransferFailed, setting
from ..spec import SlotState
from ..transfer.base import TransferBackend
from .links import CollectorLink, Gone


class Watchdog:
    def __init__(self, timeout: float, link: CollectorLink, backend: TransferBackend,
                 worker_alive: Callable[[], bool],
                 worker_busy_since: Callable[[], int | None]) -> None:
        self.timeout = timeout
        self._link, self._backend, self._worker_alive = link, backend, worker_alive
        self._worker_busy_since = worker_busy_since
        # The worker's busy episode the learner saw and when it first saw it: a
        # submit counts from there, as a copy does from its first sighting.
        self._busy_seen: tuple[int, int] | None = None

    def verdict(self, tick: int, slot: int, state: SlotState, waited_s: float,
                owed: bool = True, now_ns: int = 0) -> PipelineFailed | None:
        """The failure that ends the learner's wait for ``tick`` in ``slot`` (now in
        ``state``, waited on for ``waited_s``), or None to keep waiting. ``owed``: the
        collector owes a REQUESTED tick its pack (``Pipeline._owed``), so its silence
        counts against it."""
        if state is SlotState.REQUESTED:
            try:
                gone = self._link.liveness(owed, self.timeout)
            except Exception as exc:  # noqa: BLE001 - a link's bug: no answer is death
                died = CollectorDied(f"tick {tick}: the collector link's liveness raised "
                                     f"{type(exc).__name__}: {exc}")
                died.__cause__ = exc
                return died
            if gone is not None and not (isinstance(gone, Gone) and _says(gone.reason)):
                # True, a str, a Gone with no reason: a bug, and no reason to report;
                # a Gone's cause, the one account of it there is, is chained all the same
                wrong = CollectorDied(
                    f"tick {tick}: the collector link's liveness returned {gone!r}; it "
                    "returns None while the other side can serve requests, else a "
                    "replay_fsm.runtime.links.Gone saying why not")
                wrong.__cause__ = gone.cause if isinstance(gone, Gone) else None
                return wrong
            if gone is not None:
                died = CollectorDied(f"tick {tick}: {gone.reason}")
                died.__cause__ = gone.cause
                return died
            if not self._worker_alive():
                return TransferFailed(f"tick {tick}: the transfer worker thread exited")
            busy = self._busy_for_s(now_ns)
            if busy > self.timeout:  # its pack-done message may wait behind that one
                return TransferFailed(
                    f"tick {tick}: the transfer worker has been in one backend submit "
                    f"for {busy:.1f} s since the learner first found it there "
                    f"({setting('liveness_timeout')} {self.timeout:g} s): it does not "
                    "return")
        elif state is SlotState.SUBMITTED:
            try:
                why = self._backend.check_alive()
            except Exception as exc:  # noqa: BLE001 - a backend's bug: not alive
                failed = TransferFailed(f"tick {tick}: the backend's check_alive raised "
                                        f"{type(exc).__name__}: {exc}")
                failed.__cause__ = exc
                return failed
            if why is not None and not _says(why):  # True for "alive", "": a bug
                return TransferFailed(
                    f"tick {tick}: the backend's check_alive returned {why!r}; it returns "
                    "None while the copy engine can complete copies, else a non-empty str "
                    "saying why not")
            if why is not None:
                return TransferFailed(f"tick {tick}: {why}")
            if waited_s > self.timeout:
                return self._late_copy(tick, slot, waited_s)
        return None

    def _late_copy(self, tick: int, slot: int, waited_s: float) -> TransferFailed:
        """The failure of a copy into ``slot`` not complete ``waited_s`` after the
        learner first found it pending: the copy's own, or, where the copy still waits
        for the learner's own device work (``TransferBackend.copy_held``: the reads of
        the slot's last batch, INV-DEVICE-WAR), said to be that."""
        try:
            held = self._backend.copy_held(slot)
        except Exception as exc:  # noqa: BLE001 - a backend's bug: not alive
            failed = TransferFailed(f"tick {tick}: the backend's copy_held raised "
                                    f"{type(exc).__name__}: {exc}")
            failed.__cause__ = exc
            return failed
        if held:
            return TransferFailed(
                f"tick {tick}: the copy into slot {slot} has waited {waited_s:.1f} s "
                f"({setting('liveness_timeout')} {self.timeout:g} s) for the learner's "
                "own device work: the reads of the slot's last batch, released at "
                "after_tick(), have not ended on the device. A learner step that long "
                f"needs a larger {setting('liveness_timeout')}; otherwise its device "
                "work hangs")
        return TransferFailed(
            f"tick {tick}: the copy into slot {slot} did not complete within "
            f"{self.timeout:g} s ({setting('liveness_timeout')})")


    def _busy_for_s(self, now_ns: int) -> float:
        """Seconds since the learner first saw the transfer worker busy with the
        message it is busy with now (``now_ns``), 0 while it waits for one."""
        since = self._worker_busy_since()
        if since is None:
            self._busy_seen = None
            return 0.0
        if self._busy_seen is None or self._busy_seen[0] != since:
            self._busy_seen = (since, now_ns)
            return 0.0
        return (now_ns - self._busy_seen[1]) / 1e9


def _says(reason: object) -> bool:
    """Whether ``reason``, a hook's answer why the other side is gone, says anything:
    a str with more than blanks (an empty one made the run fail as "tick 4: ")."""
    return isinstance(reason, str) and bool(reason.strip())


class RowWatch:
    """One wait's watch on the rows its tick needs: while the buffer holds fewer than
    that, a row added is the writer's sign of life. ``timeout`` None: no bound.
    ``name``: what the ``DataStalled`` calls the bound, the setting its user can
    change (the pipeline's ``stall_timeout_name``); ``rows_name``: what it calls the
    rows the tick waits for (``min_snapshot_ptr_name``)."""

    def __init__(self, timeout: float | None, name: str = "stall_timeout",
                 rows_name: str = "min_snapshot_ptr") -> None:
        self.timeout = timeout
        self.name = name
        self.rows_name = rows_name
        self._seen: tuple[int, int] | None = None  # (rows ever written, since ns)

    def verdict(self, tick: int, needed: int, rows: int, now_ns: int) -> DataStalled | None:
        """The failure that ends the wait for ``tick`` (which waits for ``needed``
        rows ever written; the buffer has seen ``rows`` at ``now_ns``), or None."""
        if rows >= needed or self.timeout is None:
            self._seen = None  # not waiting for rows (now): the packer's part
            return None
        if self._seen is None or self._seen[0] != rows:
            self._seen = (rows, now_ns)
            return None
        silent = (now_ns - self._seen[1]) / 1e9
        if silent <= self.timeout:
            return None
        return DataStalled(
            f"tick {tick} waits for {needed} rows ({self.rows_name}); the replay buffer "
            f"has had {rows} for {silent:.1f} s ({self.name}): is whatever adds the "
            "rows still running?")
