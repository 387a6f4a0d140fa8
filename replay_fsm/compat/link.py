"""The seed's queues as a collector link, and how it knows the collector.

Numbering: the pipeline's ticks are the compat class's request numbers 1, 2, 3...
Request n sits in slot n % 2, which is the seed's numbering (its first request goes
to slot 1 while it calls slot 0 hot, then they alternate), so slots need no
translation; the seed's tick ids are labels this link carries in the dicts.

Liveness without a call the seed lacks. A learner that waits on a request asks
``liveness``; the answer is "gone" when
- a child process of the learner that maps or holds open the shared memory of
  ``collector_pack_shared_slots`` has exited (Linux: ``/proc/<pid>/maps`` and
  ``/proc/<pid>/fd``). Only the collector writes into those slots, so it is the
  queues' other end; it is recognised while it runs (from its start: a spawned child
  holds the files open before it maps them), at each request and while the learner
  waits, and watched from then on, whatever its exit code (UniLab's collector catches
  its exception and exits 0);
- a process given to ``watch`` has exited;
- ``stall_timeout`` seconds passed with a request outstanding, no ready dict and no
  row added to the replay buffer: a collector thread that died, or a collector this
  link cannot see (no ``/proc``), or one stuck for good. A live collector adds rows,
  so a slow one is not taken for dead.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..data.channel import ChannelClosed
from ..looks import LookClock
from ..runtime.links import CollectorLink, Gone
from ..transfer.base import HostSlots
from ..wire import PackDone, PackRequest, SeedReady, SeedRequest
from .buffer import ReplayBufferView

RING_DEPTH = 2  # the seed's
PUT_TIMEOUT_S = 10.0  # a request queue full this long: nobody takes requests
RESCAN_S = 1.0  # how often unrecognised child processes are looked at again


def _shared_mappings(pid: int | str) -> dict[tuple[int, int], tuple[int, int]]:
    """(st_dev, st_ino) -> address range of every shared file mapping of ``pid``."""
    found = {}
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and "s" in fields[1] and fields[4] != "0":
                major, minor = (int(x, 16) for x in fields[3].split(":"))
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                found[(os.makedev(major, minor), int(fields[4]))] = (lo, hi)
    return found


def _open_files(pid: int) -> set[tuple[int, int]]:
    """(st_dev, st_ino) of the files ``pid`` maps or holds open. A spawned child holds
    the slots' shared-memory files open from its start and maps them once it has
    unpickled its arguments, then closes them (so: the fds first, the maps after)."""
    files = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            st = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        files.add((st.st_dev, st.st_ino))
    return files | set(_shared_mappings(pid))


class SlotHolders:
    """The learner's child processes that map or hold open the host slots' shared
    memory: the collector(s).

    Slots made without ``share_memory_()`` are looked for again once they are in
    shared memory: torch moves them there, in place, when it pickles them for a
    spawned child. Where ``/proc`` is missing (not Linux) or the slots never reach
    shared memory (a thread collector's), nothing is recognised and ``dead`` is
    always None.
    """

    def __init__(self, host_slots: HostSlots) -> None:
        self._slots = host_slots
        self._files = self._slot_files()
        # Invariant: True only while no file was found because a slot is not shared.
        self._unshared = not self._files and not self._all_shared()
        self.collectors: list[Any] = []
        self._others: set[int] = set()
        self._scanned_ns = 0

    def _all_shared(self) -> bool:
        return all(s.is_shared() for s in self._slots)

    def _slot_files(self) -> set[tuple[int, int]]:
        """(st_dev, st_ino) of the shared-memory files this process maps the slots from."""
        try:
            mine = _shared_mappings("self")
        except OSError:
            return set()
        addresses = [int(s.data_ptr()) for s in self._slots]
        return {key for key, (lo, hi) in mine.items()
                if any(lo <= a < hi for a in addresses)}

    def scan(self) -> None:
        """Recognise children that hold the slots (others again at most every RESCAN_S:
        a child may be handed the slots after it started)."""
        if self._unshared and self._all_shared():
            self._unshared = False
            self._files = self._slot_files()
        if not self._files:
            return
        now = time.monotonic_ns()
        rescan = now - self._scanned_ns > RESCAN_S * 1e9
        known = {p.pid for p in self.collectors}
        for proc in mp.active_children():
            pid = proc.pid
            if pid is None or pid in known or (pid in self._others and not rescan):
                continue
            try:
                holds_slots = not self._files.isdisjoint(_open_files(pid))
            except OSError:  # it exited meanwhile
                continue
            if holds_slots:
                self.collectors.append(proc)
                self._others.discard(pid)
            else:
                self._others.add(pid)
        if rescan:
            self._scanned_ns = now

    def dead(self) -> Gone | None:
        self.scan()
        for proc in self.collectors:
            if not proc.is_alive():
                return Gone(f"the collector process {proc.name} (pid {proc.pid}, it holds "
                            f"collector_pack_shared_slots) exited with code {proc.exitcode}")
        return None


@dataclass(frozen=True)
class _Outstanding:
    """The one request the seed's protocol has in flight: sent, no ready dict yet."""

    number: int
    slot: int
    generation: int
    tick_id: int
    sent_ns: int


class SeedQueueLink(CollectorLink):
    """``collector_pack_request_queue`` / ``collector_pack_ready_queue`` and the host
    slots the collector packs into (``collector_pack_shared_slots``)."""

    kind = "seed"

    def __init__(self, requests: Any, ready: Any, host_slots: HostSlots,
                 buffer: ReplayBufferView, *, base_seed: int, sample_count: Any,
                 stall_timeout: float | None,
                 on_request: Callable[[dict[str, Any]], None]) -> None:
        super().__init__()
        self.requests, self.ready = requests, ready
        self.host_slots = host_slots
        self.base_seed = base_seed
        self.sample_count = sample_count  # as the caller gave it: the seed sent it so
        self._buffer = buffer
        self._stall_ns = None if stall_timeout is None else int(stall_timeout * 1e9)
        # The stall's clock: a stretch no look saw (a long step, the whole job stopped
        # and resumed) counts for at most half of stall_timeout.
        self._looks = LookClock(float("inf") if stall_timeout is None
                                else stall_timeout / 2)
        self._on_request = on_request
        self._tick_ids: dict[int, int] = {}
        self._outstanding: _Outstanding | None = None
        # Per slot: the ready dict of the batch it holds (for the seed's trace args).
        self.readies: list[SeedReady | None] = [None] * RING_DEPTH
        self.holders = SlotHolders(host_slots)
        self._rows_seen, self._progress_ns = -1, 0
        self._closed = False

    def label(self, number: int, tick_id: int) -> None:
        """Request ``number`` (the pipeline's tick) carries the seed's ``tick_id``."""
        self._tick_ids[number] = tick_id

    def tick_id(self, number: int) -> int | None:
        return self._tick_ids.get(number)

    def send(self, request: PackRequest, *, snapshot: tuple[int, int],
             hot_slot: int) -> None:
        tick_id = self._tick_ids[request.tick]
        self._tick_ids = {n: t for n, t in self._tick_ids.items() if n >= request.tick - 1}
        message = SeedRequest(
            tick_id=tick_id, snapshot_ptr=snapshot[0], snapshot_size=snapshot[1],
            min_snapshot_ptr=request.min_snapshot_ptr,
            sample_seed=self.base_seed + tick_id, sample_count=self.sample_count,
            shared_slot=request.slot,
            # The seed's hot slot is the one it last handed out, 0 before the first:
            # with requests alternating, always the other one.
            learner_hot_gpu_slot=(request.slot + 1) % RING_DEPTH,
            target_gpu_slot=request.slot).to_dict()
        self._on_request(message)
        now = self._looks.at(time.monotonic_ns())  # this module's clock (tests set it)
        self._saw_rows(snapshot[0], now)
        self._outstanding = _Outstanding(request.tick, request.slot, request.generation,
                                         tick_id, now)
        self.holders.scan()
        try:
            self.requests.put(message, timeout=PUT_TIMEOUT_S)
        except queue.Full:
            raise RuntimeError(f"collector_pack_request_queue stayed full for "
                               f"{PUT_TIMEOUT_S:.0f} s: no collector takes requests") from None

    def receive(self, timeout: float) -> PackDone | None:
        if self._closed:
            raise ChannelClosed()
        try:
            message = self.ready.get(timeout=timeout)
        except queue.Empty:
            return None
        if message is None or self._closed:
            raise ChannelClosed()
        ready = SeedReady.from_dict(message)
        out = self._outstanding
        if out is None or ready.tick_id != out.tick_id:
            raise RuntimeError(f"Collector packed tick {ready.tick_id} does not match pending "
                               f"tick {None if out is None else out.tick_id}")
        if ready.target_gpu_slot != out.slot:
            raise RuntimeError("Prepared replay batch is not in the current cold slot")
        self._outstanding = None
        self.readies[out.slot] = ready
        return PackDone(tick=out.number, slot=out.slot, generation=out.generation,
                        seed=ready.sample_seed, sample_count=ready.sample_count,
                        snapshot_ptr=ready.snapshot_ptr, snapshot_size=ready.snapshot_size,
                        pack_start_ns=ready.pack_begin_ns, pack_end_ns=ready.pack_end_ns)

    def liveness(self, waiting: bool, timeout: float) -> Gone | None:
        return super().liveness(waiting, timeout) or self.holders.dead() or self._stalled()

    def _saw_rows(self, rows: int, now: int) -> None:
        """Rows ever written, as seen at ``now``: a change is the collector's progress."""
        if rows != self._rows_seen:
            self._rows_seen, self._progress_ns = rows, now

    def _stalled(self) -> Gone | None:
        now = self._looks.look(real_ns=time.monotonic_ns())
        self._saw_rows(self._buffer.ptr, now)
        out = self._outstanding
        if out is None or self._stall_ns is None:
            return None
        silent = now - max(self._progress_ns, out.sent_ns)
        if silent <= self._stall_ns:
            return None
        return Gone(f"no ready dict on collector_pack_ready_queue and no row added to the "
                    f"replay buffer for {silent / 1e9:.1f} s (stall_timeout): is a collector "
                    "still serving collector_pack_request_queue?")

    def stop(self, timeout: float) -> list[str]:
        self._closed = True
        try:
            self.ready.put_nowait(None)  # wake the transfer worker, as the seed did
        except Exception:  # noqa: BLE001 - a full or broken queue: the flag suffices
            pass
        # An mp.Queue's feeder thread is joined at interpreter exit; if a collector was
        # killed while it held the queue's write lock, that None can never be sent and
        # the join would hang the learner's exit. The None is only a wake-up: drop it.
        cancel = getattr(self.ready, "cancel_join_thread", None)
        if cancel is not None:
            cancel()
        return []
