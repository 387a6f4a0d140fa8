"""A bounded single-producer single-consumer channel in shared memory.

Records are fixed-width int64 rows (plus an optional text field) in a ring; two
semaphores count items and free spaces, so a message is neither lost nor
duplicated, and ``put`` blocks only when the ring is full. A consumer killed inside
its ``get`` takes an item and leaves its record unread, or counts its record taken
and never frees its place: the consumer that takes its place gives the item, and the
place, back (``restore_taken``, ``restore_spaces``). Spawn-safe: the ring
is a shared tensor and the semaphores are the spawn context's. Cheaper than an
``mp.Queue``: no pickling and no feeder thread.

One producer writes the ring. A second producer in the consumer's own process (the
learner, posting a batch it packed itself) uses ``post_local``: its records wait in
a process-local queue that ``get`` serves first, counted by the same semaphore, so
the two producers never share the ring's tail.
"""

from __future__ import annotations

import _multiprocessing
import multiprocessing as mp
import os
import platform
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing import resource_tracker
from multiprocessing import synchronize as mp_synchronize
from multiprocessing import util as mp_util
from typing import Any

import numpy as np
import torch

from ..signals import start_resource_tracker
from .shared import small_shared_zeros


def orders_stores(machine: str, pointer_bits: int) -> bool:
    """Whether a CPU of ``platform.machine()`` name ``machine``, under an interpreter
    of ``pointer_bits``-bit pointers, shows another process one process's stores in
    the order made, each whole: x86's total store order, and a 64-bit interpreter's
    8-byte stores of the channel's counters in one instruction (a 32-bit one may
    split them in two, and a count read between its halves is off by 2**32 once the
    counts pass it). Python has no fence to order them on a weakly ordered CPU (ARM,
    POWER)."""
    return machine.lower() in ("x86_64", "amd64") and pointer_bits == 64


# Whether ``restore_taken``'s reading of a put's count, its release and its
# ``released`` cell holds here, and ``restore_spaces``'s of its ``begun`` cell, its
# place taken, its count and its ``settled`` cell; where not, nothing is given back
# (the run goes on a request behind, or a place short, as before).
STORES_IN_ORDER = orders_stores(platform.machine(), struct.calcsize("P") * 8)


class ChannelClosed(Exception):
    """The channel was closed; no more messages will come."""


class Channel:
    def __init__(self, capacity: int, width: int, *, text_bytes: int = 0) -> None:
        if capacity < 1 or width < 1:
            raise ValueError("capacity and width must be >= 1")
        ctx = mp.get_context("spawn")
        start_resource_tracker()  # first: it must live through a hangup (SIGHUP)
        self.capacity, self.width, self.text_bytes = capacity, width, text_bytes
        self._buf = small_shared_zeros(capacity, width + 1, dtype=torch.int64)
        self._text = small_shared_zeros(capacity, max(text_bytes, 1), dtype=torch.uint8)
        # [head, tail, closed, released, begun, settled]: head is the consumer's; the
        # rest but closed the producer's: tail (records put) and released (puts that
        # have released their record's item), equal while no put is between its count
        # and its release (``restore_taken``); begun (puts that went for a place) and
        # settled (those that counted their record, or gave up), equal while no put
        # may hold a place its record is not counted in (``restore_spaces``).
        self._idx = small_shared_zeros(6, dtype=torch.int64)
        self._items = ctx.Semaphore(0)
        self._spaces = ctx.Semaphore(capacity)
        self._views()

    def _views(self) -> None:
        self._buf_np = self._buf.numpy()
        self._text_np = self._text.numpy()
        self._idx_np = self._idx.numpy()
        # The ring as bytes and the counters as int64 cells: records and counters
        # are read and written through these, a C call each (numpy's scalar and
        # slice access cost several times as much per message).
        self._bytes = self._buf_np.data.cast("B")
        self._counters = self._idx_np.data.cast("B").cast("q")
        self._record = struct.Struct(f"{self.width + 1}q")  # a row and its text length
        # post_local's records, for this process's consumer only (never pickled), and
        # how many it ever posted.
        self._local: deque[tuple[list[int], str | None]] = deque()
        self._local_posted = 0

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in VIEWS:
            state.pop(key)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._views()

    @property
    def semaphore_names(self) -> tuple[str, ...]:
        """The /dev/shm names of this channel's semaphores (to check none is left)."""
        return tuple(semaphore_name(s) for s in (self._items, self._spaces))

    @property
    def backlog(self) -> int:
        """Records put and not yet taken (a snapshot; either side may move it); in
        the consumer's process, ``post_local``'s too."""
        return self._counters[1] - self._counters[0] + len(self._local)

    @property
    def closed(self) -> bool:
        return bool(self._counters[2])

    @property
    def sent(self) -> int:
        """Records ever put into the ring (``post_local``'s not counted): the next
        record put is number ``sent``, counted from 0."""
        return self._counters[1]

    @property
    def taken(self) -> int:
        """Records ever taken off the ring: record number ``k`` was taken iff
        ``k < taken``."""
        return self._counters[0]

    @property
    def position(self) -> tuple[int, int, int, int]:
        """Where the channel stands: records ever put into the ring and ever taken off
        it, and in this process ``post_local``'s records ever posted and waiting now.
        Any put, post or get moves it; a producer stopped inside its put, none."""
        return (self._counters[1], self._counters[0], self._local_posted,
                len(self._local))

    @property
    def unreleased(self) -> int | None:
        """Records counted in the backlog whose item was never released: a producer
        killed inside its ``put`` (between counting the record and releasing its
        item) leaves one for good, and no ``get`` takes it until a later put's item
        does (then every later record waits one put behind). A consumer killed
        inside its ``get`` (between taking an item and counting the record taken)
        leaves one for good too: the next ``get`` takes that record with a later
        record's item. A live producer's put, and a ``get`` between its acquire and
        its count, show one for microseconds. None where the semaphore's value
        cannot be read (macOS)."""
        try:
            items = self._items.get_value()
        except NotImplementedError:
            return None
        return max(0, self.backlog - items)

    @property
    def get_can_take(self) -> bool:
        """Whether a ``get`` takes a record now, or once a put under way (between
        counting its record and releasing its item) releases that item: False when
        no item is there and no put is bringing one, the records counted (if any)
        waiting on items that consumers killed inside their ``get`` took
        (``restore_taken``). A snapshot for the consumer between its gets, to tell
        an item worth waiting for from one that never comes; a put that begins
        after it is not seen. Where the semaphore's value cannot be read (macOS),
        only a put under way counts; where the CPU may show a put's stores out of
        order (``STORES_IN_ORDER`` False), a hint, never a give-back's ground."""
        counters = self._counters
        if counters[1] != counters[3]:
            return True  # a put between its count and its ``released`` store
        # Every put counted by then had released its item before its ``released``.
        try:
            return self._items.get_value() > 0
        except NotImplementedError:
            return False

    @property
    def lost_spaces(self) -> int | None:
        """Places of the ring that neither hold a record nor are free: a consumer
        killed inside its ``get`` between counting its record taken and freeing the
        record's place loses one for good (``restore_spaces``), and once every place
        is lost, ``put`` waits for ever. A live get there, and a put between taking
        a place and counting its record, show one for microseconds. None where the
        semaphore's value cannot be read (macOS)."""
        try:
            spaces = self._spaces.get_value()
        except NotImplementedError:
            return None
        return max(0, self.capacity - (self._counters[1] - self._counters[0]) - spaces)

    def put(self, values: Sequence[int], text: str | None = None,
            timeout: float | None = None) -> bool:
        """Append one record; False if no space came within ``timeout``.

        Raises:
            ChannelClosed: the channel is closed.
            ValueError: a record the channel cannot carry (see ``_pack``); it took
                no space.
        """
        counters = self._counters  # [head, tail, closed, ...], read inline: per message
        if counters[2]:
            raise ChannelClosed()
        record, data = self._pack(values, text)  # before it takes a space
        begun = counters[4] + 1
        counters[4] = begun  # before the acquire: ``restore_spaces`` waits from here
        try:
            if not self._spaces.acquire(timeout=timeout):
                return False
            if counters[2]:
                self._spaces.release()
                raise ChannelClosed()
            i = counters[1] % self.capacity
            if data is not None:
                self._text_np[i, : len(data)] = np.frombuffer(data, dtype=np.uint8)
            size = self._record.size
            self._bytes[i * size:(i + 1) * size] = record
            tail = counters[1] + 1
            counters[1] = tail
        finally:
            # Its place is counted in the backlog now, or it took none, or (a
            # signal's exception on the way) it is lost for good: no put holds it.
            counters[5] = begun
        self._items.release()
        counters[3] = tail
        return True

    def _pack(self, values: Sequence[int], text: str | None
              ) -> tuple[bytes, bytes | None]:
        """A record's row (``values`` zero-padded to the width, then the text's
        length) and its text's bytes (None without a text).

        Raises:
            ValueError: more values than the width, a value no int64 holds, or a
                text on a channel without room for text.
        """
        if text is None and len(values) == self.width:  # a request: no padding, no text
            try:
                return self._record.pack(*values, -1), None
            except struct.error as exc:
                raise ValueError(f"a record's values must be ints in the int64 range, "
                                 f"got {list(values)!r}") from exc
        if text is not None and not self.text_bytes:
            raise ValueError("this channel carries no text (text_bytes=0)")
        if len(values) > self.width:
            raise ValueError(f"a record of this channel has at most {self.width} "
                             f"values, got {len(values)}")
        data = None if text is None else text.encode("utf-8", "replace")[-self.text_bytes:]
        try:
            row = self._record.pack(*values, *(0,) * (self.width - len(values)),
                                    -1 if data is None else len(data))
        except struct.error as exc:
            raise ValueError(f"a record's values must be ints in the int64 range, got "
                             f"{list(values)!r}") from exc
        return row, data

    def post_local(self, values: Sequence[int], text: str | None = None) -> None:
        """Append one record from the consumer's own process, beside the ring's one
        producer; ``get`` in this process takes it before the ring's records. Never
        blocks: the caller bounds how many are outstanding.

        Raises:
            ChannelClosed: the channel is closed.
            ValueError: as ``put``.
        """
        if self.closed:
            raise ChannelClosed()
        record, _ = self._pack(values, text)  # refused as put refuses it
        *row, _ = self._record.unpack(record)  # read back as the ring's records are
        self._local.append((row, text))
        self._local_posted += 1
        self._items.release()

    def get(self, timeout: float | None = None) -> tuple[list[int], str | None] | None:
        """Take the oldest record; None if none came within ``timeout``. A
        ``timeout`` of 0 (or less) only looks: the semaphore is tried without a
        wait (asked to wait 0 s, it waits for a deadline already past, about 70 us
        on Linux, where ``service(timeout=0)`` between environment steps cost that
        much per call).

        Raises:
            ChannelClosed: the channel is closed.
        """
        if timeout is not None and timeout <= 0:
            got = self._items.acquire(False)
        else:
            got = self._items.acquire(timeout=timeout)
        if not got:
            return None
        counters = self._counters
        if counters[2]:  # closed
            self._items.release()  # wake the next waiter too
            raise ChannelClosed()
        if self._local:
            # Every release follows its record, so a count taken with the local
            # queue empty is the ring's.
            return self._local.popleft()
        i = counters[0] % self.capacity
        *row, n_text = self._record.unpack_from(self._bytes, i * self._record.size)
        text = None if n_text < 0 else bytes(self._text_np[i, :n_text]).decode("utf-8")
        counters[0] += 1
        self._spaces.release()
        return row, text

    def restore_taken(self, patience_s: float,
                      alone: Callable[[], bool] | None = None) -> int | None:
        """Give back the items that consumers killed inside their ``get`` took (between
        taking an item and counting its record taken), so that every record is read
        with its own item again; returns how many were given back. Without it, the
        next ``get`` takes the oldest such record with a later record's item, every
        record after it one behind, and the newest waits until another is put.

        For a consumer that takes the place of one gone, between its own gets (its
        first, or any later: a whole get takes an item and counts a record, and
        leaves the shortfall as it was): no other consumer may be alive (a live one
        inside its get would be counted as killed there), and no ``get`` or
        ``post_local`` of this process under way.
        ``alone`` (None: always True) is asked once the shortfall is measured, before
        anything is given back: False, another consumer may have begun beside this
        one meanwhile, and nothing is given back (asked before the measurement, it
        would miss one that began during it and was then inside its get).
        What the items semaphore lacks is measured at an instant when no put is
        between counting its record and releasing its item (that put's item would
        be counted as taken too); read again until one is found, for at most
        ``patience_s`` seconds (0: read once). None where none came (a put between
        its count and its release all through: the producer descheduled, or
        stopped), nothing given back: ask again later, as the put's release needs
        no get to come. 0 on a closed channel, where the semaphore's value cannot
        be read (macOS), and on a CPU that may show the put's stores out of order
        (``STORES_IN_ORDER`` False).
        """
        if not STORES_IN_ORDER:
            return 0
        counters = self._counters
        deadline = time.monotonic() + patience_s
        while True:
            tail, released = counters[1], counters[3]
            try:
                items = self._items.get_value()
            except NotImplementedError:
                return 0
            # The put's release comes after its count and before ``released``: both
            # equal and unmoved around the semaphore's read, no put was between.
            if tail == released and counters[3] == released and counters[1] == tail:
                break
            if counters[2]:
                return 0
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.001)
        taken = tail - counters[0] + len(self._local) - items
        if counters[2] or taken <= 0 or (alone is not None and not alone()):
            return 0
        for _ in range(taken):
            self._items.release()
        return taken

    def restore_spaces(self, patience_s: float,
                       alone: Callable[[], bool] | None = None) -> int | None:
        """Give back the places that consumers killed inside their ``get`` lost
        (between counting a record taken and freeing its place), so that the ring
        holds ``capacity`` records again; returns how many were given back. Without
        it, each such death leaves one place fewer for good, and once none is left
        the producer's ``put`` waits for ever.

        For a consumer that takes the place of one gone, between its own gets (its
        first, or any later): no other consumer may be alive (a live one between
        its count and its release would be counted as killed there, and the place
        it frees later would be one too many: a put would then write over a record
        not read yet). ``alone`` is asked as ``restore_taken``'s. What the spaces
        semaphore lacks is measured at an instant when no put may hold a place
        whose record it has not counted (that place would be counted as lost too):
        a put marks itself begun before it goes for a place and settled once its
        record is counted (or it gave up); read again until begun and settled are
        equal and begun is unmoved after the semaphore's read, for at most
        ``patience_s`` seconds (0: read once). Where none came and the last
        reading found one put under way all through it (begun one past settled,
        and unmoved), that put, of the channel's one producer, holds at most one
        of the places missing: all but one are given back, so that a put waiting
        for a place with every place lost and no record left to get gets one, and
        None is returned (that one may be lost too: ask again after a get). None
        too, nothing given back, where begun moved during the last reading (a put
        ended and the next began). 0 on a closed channel, where the semaphore's
        value cannot be read (macOS), and on a CPU that may show the put's stores
        out of order (``STORES_IN_ORDER`` False).
        """
        if not STORES_IN_ORDER:
            return 0
        counters = self._counters
        deadline = time.monotonic() + patience_s
        while True:
            begun, settled, tail = counters[4], counters[5], counters[1]
            try:
                spaces = self._spaces.get_value()
            except NotImplementedError:
                return 0
            # Every put that had begun had counted its record (settled after its
            # count), and none began before the semaphore's read (begun is stored
            # before the acquire): the backlog and the free places are one instant's.
            steady = counters[4] == begun
            if steady and begun == settled:
                held = 0
                break
            if counters[2]:
                return 0
            if time.monotonic() >= deadline:
                # Every put before it had settled; this one took a place or not, and
                # counted its record in ``tail`` or not: the reading counts at most
                # its one place as lost.
                if steady and begun == settled + 1:
                    held = 1
                    break
                return None
            time.sleep(0.001)
        lost = self.capacity - (tail - counters[0]) - spaces
        if counters[2] or lost <= 0 or (alone is not None and not alone()):
            return 0
        for _ in range(lost - held):
            self._spaces.release()
        return None if held else lost

    def unlink(self) -> None:
        """Remove the semaphores' names from the system and from the resource
        tracker, from any process holding the channel (for when its creator died and
        cannot). Handles already open keep working."""
        for sem in (self._items, self._spaces):
            unlink_semaphore(sem)

    def close(self) -> None:
        """Wake every waiter; later puts and gets raise ChannelClosed."""
        if not self.closed:
            self._counters[2] = 1
            self._items.release()
            self._spaces.release()


# What each process builds for itself (views over the shared tensors, the record's
# Struct, post_local's queue): never pickled, rebuilt where a channel is unpickled.
VIEWS = ("_buf_np", "_text_np", "_idx_np", "_bytes", "_counters", "_record", "_local",
         "_local_posted")


def semaphore_name(sem: Any) -> str:
    """The /dev/shm name of a multiprocessing semaphore or lock."""
    return f"sem.{sem._semlock.name.lstrip('/')}"


def unlink_semaphore(sem: Any) -> None:
    """Remove a multiprocessing semaphore's (or lock's) name from the system and from
    the resource tracker; handles already open keep working.

    In the process that created the semaphore, multiprocessing holds a finalizer that
    removes the name at exit or collection and reports a name already gone with a
    traceback: that finalizer is run now instead, once, so nothing is left to say."""
    name = sem._semlock.name
    cleanup = _creator_cleanup(name)
    try:
        if cleanup is not None:
            cleanup()  # unlinks and unregisters; leaves the registry even if it raises
        else:
            _multiprocessing.sem_unlink(name)
            resource_tracker.unregister(name, "semaphore")
    except FileNotFoundError:
        return  # already gone, and whoever removed it told the tracker


def _creator_cleanup(name: str) -> Any:
    """The finalizer multiprocessing registered for semaphore ``name`` in this
    process (its creator), or None (another process made it, or it already ran)."""
    try:
        cleanup = mp_synchronize.SemLock._cleanup  # type: ignore[attr-defined]
        for finalizer in list((mp_util._finalizer_registry or {}).values()):  # type: ignore[attr-defined]
            # A bare os.fork() child inherits the registry; the entry is the parent's.
            if (finalizer._callback is cleanup and finalizer._args == (name,)
                    and finalizer._pid == os.getpid()):
                return finalizer
    except AttributeError:  # a multiprocessing without them: unlink as any process does
        pass
    return None
