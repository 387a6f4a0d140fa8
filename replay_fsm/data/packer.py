"""The collector-side packer: takes pack requests, gathers rows into host slots.

In thread mode the pipeline runs ``Packer.service`` in a thread of the learner's
process; in process mode the user's collector process calls
``Packer.attach(handle, replay_buffer)`` once and ``service()`` between
environment steps, where the seed's collector serviced its queue.

The learner may pack the part of a request the packer has not reached (``Packer.take``,
see specs/LEARNER_PACKS.md). A request's rows are split in chunks; the packer and the
learner each claim a chunk before writing it, under one lock, in cells per slot
(the request's generation, the next chunk to claim, the chunks written), so every
chunk has exactly one writer (INV-HOST-WAR), and whoever writes the last chunk posts
the request's one pack-done message.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import multiprocessing as mp
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CollectorDied, ProtocolError, setting
from ..looks import LookClock
from ..signals import ignore
from ..wire import DONE_FIELDS, REQUEST_FIELDS, PackDone, PackRequest, decode, encode
from . import owner
from .buffer import ReplayBuffer
from .channel import Channel, ChannelClosed, semaphore_name, unlink_semaphore
from .sampling import sample_indices
from .shared import shared_zeros, small_shared_zeros

ERROR_TEXT_BYTES = 16384
LEARNER_CHECK_S = 0.25  # how often a packer looks whether its learner still lives
# A collector process's add that still waits for the replay buffer's write lock this
# long after its learner died waits on a pause that only the learner could end (its
# adds_paused(), a save's last pass; a pause records no holder): the process exits
# with ORPHAN_EXIT_CODE instead of hanging for ever (it ignores the stop signals).
ORPHANED_ADD_S = 10.0
ORPHAN_EXIT_CODE = 70  # EX_SOFTWARE
# A request is split in at most MAX_CHUNKS chunks of at least CHUNK_MIN_ROWS rows: a
# learner that waits takes the chunks the packer has not reached, so it waits for at
# most the one chunk the packer is writing. A chunk costs one more lock round and
# one more gather call (microseconds), a small fraction of the rows' gather.
MAX_CHUNKS = 8
CHUNK_MIN_ROWS = 1024
# A writer that wrote a chunk must count it (under the claim lock), or the request
# never completes. The lock is held for microseconds; one a live peer holds for
# this long means a stopped or hung process, and the learner's take then fails.
HOLD_PATIENCE_S = 60.0
NO_CHUNK = -1  # claim/advance: nothing left for the caller to write
# The claim cells' columns, per slot. PACKER_OWES: the chunks the packer side claimed
# and has not counted as written yet (the learner's own claims are not in it).
GENERATION, NEXT, WRITTEN, FAILED, SNAPSHOT_PTR, START_NS, PACKER_OWES = range(7)
# packer_state's cells: the attached packer's pid and heartbeat, the learner's pid,
# the attached packer's owner record (3 cells), then, set when a packer attaches after
# another process's (gone: attach refuses a live one), how many requests had been read
# off the request channel then and that predecessor's pid; set for good by an
# attach that could not make sure no other reader of the request channel lives (its
# predecessor could not be judged dead, or the claim lock stayed taken); last, whether
# the attached process still owes the items and the places that its predecessors
# took and lost (``Packer.items_owed``): a Packer of its next attach owes them too.
PID, BEAT, LEARNER, RECORD, READ_BEFORE, PREDECESSOR, UNSURE = 0, 1, 2, 3, 6, 7, 8
ITEMS_OWED, PLACES_OWED = 9, 10
# This process's learner-watch threads, one per (learner pid, replay buffer object):
# a collector that attaches again (a retry, one pipeline after another) reuses its
# thread, where each attach started one more, each looking every LEARNER_CHECK_S for
# as long as the learner lived. A fork child has none of its parent's threads.
_WATCHES: dict[tuple[int, int], threading.Thread] = {}
_WATCHES_LOCK = threading.Lock()


def _forget_watches() -> None:
    global _WATCHES_LOCK
    _WATCHES.clear()
    _WATCHES_LOCK = threading.Lock()  # a parent's thread may have held it at the fork


os.register_at_fork(after_in_child=_forget_watches)


def chunk_count(rows: int) -> int:
    """How many chunks a request of ``rows`` rows is split into."""
    return max(1, min(MAX_CHUNKS, rows // CHUNK_MIN_ROWS))


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs; an exited process nobody has reaped yet (a
    zombie) answers ``kill(pid, 0)`` but counts as gone (Linux's /proc tells)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, but another user's
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc here: kill(0) is all we know


def _takes_retrying(gather: Callable[..., Any]) -> bool:
    """Whether ``gather`` takes the keyword ``retrying`` (or any keyword)."""
    try:
        parameters = inspect.signature(gather).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "retrying" or p.kind is inspect.Parameter.VAR_KEYWORD
               for p in parameters)


def learner_lives(pid: int, is_parent: bool) -> bool:
    """Whether the learner, ``pid`` (0: none recorded), still runs, as a packer
    process sees it; ``is_parent``: it spawned this process, which is orphaned the
    moment it exits, even while it lingers as a zombie nobody has reaped yet."""
    if pid in (0, os.getpid()):
        return True  # a packer thread in the learner's own process
    if is_parent:
        return os.getppid() == pid
    return process_alive(pid)


class LearnerWatch:
    """A collector process's daemon thread, one per learner and replay buffer
    (``Packer.attach``): once the learner is gone, an add of this process still
    waiting for the write lock ORPHANED_ADD_S later waits for ever, and the process
    exits. It holds the learner's pid and the buffer, not the packer that started it
    (which kept that packer's channels for the process's life)."""

    def __init__(self, learner_pid: int, learner_is_parent: bool,
                 replay_buffer: ReplayBuffer) -> None:
        self._learner_pid = learner_pid
        self._learner_is_parent = learner_is_parent
        self.replay_buffer = replay_buffer

    def run(self) -> None:
        """The thread's loop: ORPHANED_ADD_S counts from when the add began, or from
        when the learner was found gone if that is later."""
        while learner_lives(self._learner_pid, self._learner_is_parent):
            time.sleep(LEARNER_CHECK_S)
        gone_ns = time.monotonic_ns()
        rb = self.replay_buffer
        # Found so at two looks in a row: one look can fall between a pause of this
        # process ending and the add it held off taking the lock.
        looks = 0
        while looks < 2:
            waited = rb.add_waiting_s()
            stuck = min(waited, (time.monotonic_ns() - gone_ns) / 1e9) >= ORPHANED_ADD_S
            looks = looks + 1 if waited and stuck else 0
            if looks < 2:
                time.sleep(LEARNER_CHECK_S)
        with contextlib.suppress(Exception):  # standard error closed, say: exit all the same
            sys.stderr.write(
                f"replay_fsm: the learner (pid {self._learner_pid}) is gone and an add of "
                f"this process (pid {os.getpid()}) has waited {waited:.0f} s for the "
                f"replay buffer's write lock, which a pause of the learner's "
                f"(adds_paused(), a save's last pass) holds for good: exiting with code "
                f"{ORPHAN_EXIT_CODE}\n")
            sys.stderr.flush()
        os._exit(ORPHAN_EXIT_CODE)


@dataclass
class PackerHandle:
    """What the learner side gives a packer: channels, host slots, a pid cell, the
    claim cells and their lock.

    Picklable to a spawned process; nothing in it is copied (shared memory).
    """

    requests: Channel
    done: Channel
    # ring_depth tensors [sample_count, width] in shared memory. Separate tensors, not
    # views of one: a write into one slot must not bump the autograd version counter
    # of the batch views the learner holds on another.
    host_slots: list[torch.Tensor]
    # [pid, heartbeat monotonic ns] of the attached packer (pid 0: none yet), the pid
    # of the learner that created the handle, the attached packer's (token, pid
    # namespace, time namespace) record as ``owner`` makes it (a pid may be reused,
    # the record names one process), the requests read before it attached with
    # the pid of the packer process before it (0, 0: none), UNSURE, and what the
    # attached process still owes the request channel (ITEMS_OWED, PLACES_OWED); shared.
    packer_state: torch.Tensor
    # Per slot (int64, shared; read and set only under claim_lock, a spawn Lock): the
    # generation of the request being written, its next chunk to claim, its chunks
    # written, whether a writer failed, the snapshot ptr and start time its first
    # writer took (every writer of a request draws the same rows), and the chunks the
    # packer side claimed and has not counted.
    claims: torch.Tensor
    claim_lock: Any
    chunks: int = 1  # per request; the bounds split the rows evenly
    buffer_id: int = 0  # the replay buffer's it was made for (0: any buffer)

    @classmethod
    def create(cls, ring_depth: int, sample_count: int, width: int, buffer_id: int = 0
               ) -> PackerHandle:
        state = small_shared_zeros(PLACES_OWED + 1, dtype=torch.int64)
        state[LEARNER] = os.getpid()
        return cls(
            # Twice the ring: besides one live request per slot, at most ring_depth
            # requests the learner packed itself wait to be dropped (ChannelLink.take).
            requests=Channel(2 * ring_depth, REQUEST_FIELDS),
            done=Channel(ring_depth, DONE_FIELDS, text_bytes=ERROR_TEXT_BYTES),
            host_slots=[shared_zeros(sample_count, width,
                                     what=f"host slot {i} of {sample_count} rows")
                        for i in range(ring_depth)],
            packer_state=state,
            claims=small_shared_zeros(ring_depth, PACKER_OWES + 1, dtype=torch.int64),
            claim_lock=mp.get_context("spawn").Lock(),
            chunks=chunk_count(sample_count),
            buffer_id=buffer_id,
        )

    def __post_init__(self) -> None:
        self._state_np = self.packer_state.numpy()  # reads cost ns, not a torch call
        self._claims_np = self.claims.numpy()
        rows = self.host_slots[0].shape[0]
        self.chunk_bounds = [rows * c // self.chunks for c in range(self.chunks + 1)]

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        state.pop("_state_np")
        state.pop("_claims_np")
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self.__post_init__()

    @property
    def packer_pid(self) -> int:
        return int(self._state_np[PID])

    @property
    def heartbeat_ns(self) -> int:
        return int(self._state_np[BEAT])

    @property
    def learner_pid(self) -> int:
        return int(self._state_np[LEARNER])

    @property
    def packer_record(self) -> tuple[int, int, int]:
        """The attached packer's (token, pid namespace, time namespace): ``owner``'s."""
        state = self._state_np
        return int(state[RECORD]), int(state[RECORD + 1]), int(state[RECORD + 2])

    @property
    def predecessor(self) -> tuple[int, int]:
        """(requests read off the request channel, pid) of the packer process attached
        before the one attached now, which was gone when it attached; (0, 0) when no
        other process's packer was attached before it. A request read before is that
        process's, or an earlier one's: whatever of it they left undone, nobody does."""
        state = self._state_np
        return int(state[READ_BEFORE]), int(state[PREDECESSOR])

    def sure(self) -> bool:
        """Whether every attach to this handle so far made sure no other reader of
        the request channel lived (``UNSURE`` unset): none attached without the
        claim lock, or after a predecessor it could not judge dead. A give-back
        asks it after its measurement: an attach without the lock may set it, and
        start reading, at any time."""
        return not self._state_np[UNSURE]

    @property
    def semaphore_names(self) -> tuple[str, ...]:
        """The /dev/shm names of the channels' semaphores and the claim lock (to
        check none is left)."""
        return (self.requests.semaphore_names + self.done.semaphore_names
                + (semaphore_name(self.claim_lock),))

    def claim(self, slot: int, generation: int, snapshot_ptr: int, timeout: float,
              *, by_packer: bool = True) -> int | None:
        """The first chunk of request ``generation`` in ``slot`` for this caller to
        write; NO_CHUNK when every chunk is claimed, or when the slot holds a newer
        request (this one was packed and released). The request's first claim
        records ``snapshot_ptr`` and the time for all its writers (``snapshot``).
        None when the lock stayed taken for ``timeout`` seconds (its holder may have
        died in it; a claim holds it for microseconds). ``by_packer``: the caller is
        the packer side, not the learner (``stranded`` counts its chunks)."""
        if not self.claim_lock.acquire(timeout=timeout):
            return None
        try:
            cells = self._claims_np[slot]
            if cells[GENERATION] > generation:
                return NO_CHUNK
            if cells[GENERATION] < generation:
                cells[:] = (generation, 0, 0, 0, snapshot_ptr, time.monotonic_ns(), 0)
            return self._next_locked(cells, by_packer)
        finally:
            self.claim_lock.release()

    def advance(self, slot: int, generation: int, timeout: float, *,
                by_packer: bool = True) -> tuple[int, bool] | None:
        """Count the caller's chunk of request ``generation`` as written and claim its
        next: (that chunk or NO_CHUNK, whether every chunk is now written and none
        failed: the caller then posts the request's pack-done message). None when the
        lock stayed taken for ``timeout`` seconds; nothing is counted then.
        ``by_packer`` as ``claim``'s."""
        if not self.claim_lock.acquire(timeout=timeout):
            return None
        try:
            cells = self._claims_np[slot]
            if cells[GENERATION] != generation:
                raise RuntimeError(f"slot {slot} holds request {cells[GENERATION]} while "
                                   f"a chunk of request {generation} was being written")
            cells[WRITTEN] += 1
            if by_packer:  # a numpy cell's update costs 0.2 us: only where it counts
                cells[PACKER_OWES] -= 1
            return (self._next_locked(cells, by_packer),
                    bool(cells[WRITTEN] == self.chunks and not cells[FAILED]))
        finally:
            self.claim_lock.release()

    def stranded(self, slot: int, generation: int, learner_packs: bool, timeout: float
                 ) -> bool | None:
        """Whether request ``generation`` in ``slot``, read off the request channel by
        a packer process that is gone (``predecessor``), can never complete: neither
        written whole nor failed, and either a chunk of it was claimed by the packer
        side and not counted (only that process could count it), or the learner packs
        nothing (``learner_packs`` False: nobody else claims its chunks). None when the
        lock stayed taken for ``timeout`` seconds: ask again later."""
        if not self.claim_lock.acquire(timeout=timeout):
            return None
        try:
            cells = self._claims_np[slot]
            if cells[GENERATION] > generation:
                return False  # packed, and the slot holds a later request since
            if cells[GENERATION] == generation and (
                    cells[WRITTEN] == self.chunks or cells[FAILED]):
                return False  # written whole, or failed (its error was posted)
            owes = cells[GENERATION] == generation and cells[PACKER_OWES] > 0
            return bool(owes or not learner_packs)
        finally:
            self.claim_lock.release()

    def finished(self, slot: int, generation: int) -> bool:
        """Whether request ``generation`` in ``slot`` was written whole (every chunk
        counted) or failed: its pack-done message, or its error, is posted by the
        writer that did it. A snapshot read without the lock (the cells only move on
        until the slot holds a later request)."""
        cells = self._claims_np[slot]
        return bool(cells[GENERATION] == generation
                    and (cells[WRITTEN] == self.chunks or cells[FAILED]))

    def abandon(self, slot: int, generation: int, timeout: float) -> None:
        """A writer of request ``generation`` failed (it posts the error itself): no
        chunk of it is claimed any more, and no writer posts it as packed."""
        if not self.claim_lock.acquire(timeout=timeout):
            return  # the error is posted anyway and fails the run
        try:
            cells = self._claims_np[slot]
            if cells[GENERATION] == generation:
                cells[NEXT] = self.chunks
                cells[FAILED] = 1
        finally:
            self.claim_lock.release()

    def snapshot(self, slot: int) -> tuple[int, int]:
        """(ptr, start ns) the request in ``slot`` was first claimed at. Read by a
        writer after its claim: the cells do not change until the request is packed."""
        cells = self._claims_np[slot]
        return int(cells[SNAPSHOT_PTR]), int(cells[START_NS])

    def _next_locked(self, cells: Any, by_packer: bool) -> int:
        chunk = int(cells[NEXT])
        if chunk >= self.chunks:
            return NO_CHUNK
        cells[NEXT] = chunk + 1
        if by_packer:
            cells[PACKER_OWES] += 1
        return chunk

    def close(self) -> None:
        self.requests.close()
        self.done.close()

    def unlink(self) -> None:
        """Remove the channels' semaphores from the system now, from any process
        that holds the handle: its creator is gone and cannot do it at exit."""
        self.requests.unlink()
        self.done.unlink()
        unlink_semaphore(self.claim_lock)


class Packer:
    """Serves pack requests for one pipeline from ``replay_buffer``.

    If the learner that created the handle dies, the packer notices within
    ``LEARNER_CHECK_S`` of a ``service`` call, closes the channels (``closed`` turns
    True, so a collector's ``while not packer.closed`` loop ends) and removes the
    shared names the dead learner can no longer remove.
    """

    def __init__(self, handle: PackerHandle, replay_buffer: ReplayBuffer) -> None:
        n, width = handle.host_slots[0].shape
        if handle.buffer_id and handle.buffer_id != getattr(replay_buffer, "buffer_id", 0):
            raise ValueError("this packer handle is for the pipeline of another replay "
                             "buffer: attach with the buffer that pipeline was built on "
                             "(pass that object to this process)")
        if width != replay_buffer.width:
            raise ValueError(f"host slots are {width} columns wide but the replay buffer "
                             f"rows are {replay_buffer.width}")
        self.handle = handle
        self.replay_buffer = replay_buffer
        self._pending: PackRequest | None = None
        # Reused every tick: no allocation in steady state.
        self._indices = torch.empty(n, dtype=torch.int64)
        self._generator = torch.Generator()
        # Speculation: ticks come in order, so the next request's seed is the last one
        # plus one; an idle packer draws those indices ahead for the current size and
        # uses them when (seed, size) match (a full buffer's size does not move).
        self._next_indices = torch.empty(n, dtype=torch.int64)
        self._drawn: tuple[int, int] | None = None  # (seed, size) of _next_indices
        self._last_seed: int | None = None
        self.drawn_ahead = 0  # packs whose indices were drawn while the packer idled
        # How long the learner's gather (``take``) waits for rows an add is writing
        # before it raises CollectorDied: a writer stopped inside its add holds them
        # for ever. The pipeline sets its liveness_timeout.
        self.writer_patience_s = HOLD_PATIENCE_S
        # A subclass's gather written before ``retrying`` existed is called without it.
        self._gather_retries = _takes_retrying(replay_buffer.gather)
        self._beat = handle.packer_state[1:2].numpy()  # heartbeat cell: per call, chunk
        self._learner_pid = handle.learner_pid
        # A packer the learner spawned is orphaned the moment the learner exits, even
        # while the learner lingers as a zombie nobody has reaped yet.
        self._learner_is_parent = os.getppid() == self._learner_pid
        self._next_learner_check_ns = 0
        # Requests this side wrote chunks of and did not fail in itself (another
        # writer of the same request may have failed, and posted the error).
        self.packed_count = 0
        # Requests read whose every chunk the learner had claimed (it packed them
        # itself), dropped unserved: ``serve_due`` goes on past them.
        self._dropped = 0
        # Whether the items and the places of the request channel that the process
        # attached before this one took and lost are still to be given back: the
        # attach could not measure them (``_give_back``, at each service call until
        # it can). Kept in the handle's ITEMS_OWED and PLACES_OWED cells too, for
        # this process's next attach.
        self.items_owed = False
        self.places_owed = False

    @classmethod
    def attach(cls, handle: PackerHandle, replay_buffer: ReplayBuffer) -> Packer:
        """Become the packer of ``handle`` in this (collector) process; the learner
        side then watches this process's pid for liveness. One packer process per
        handle: its request channel has one reader. A collector restarted after its
        packer process died attaches again (with the dead one's pid or another), and
        records how many requests the dead
        one had read (``PackerHandle.predecessor``): those it never sees. The learner
        packs one of them whose chunks nobody claimed (learner_packs), in any wait
        or poll for it (the oldest requested tick or a later one); one the dead
        process had claimed a chunk of fails the run (``CollectorDied``) once the
        learner waits for it, as does any of them without learner_packs; so, after
        liveness_timeout, does one the dead process finished (its last chunk
        counted, or failed) and died before posting its pack-done message, and a
        claim lock it died holding. A process killed in the few bytecodes between
        taking a request's item off the channel and counting it taken is not counted
        as having read it: the restart gives that item back and reads the request
        next (``Channel.restore_taken``; where the learner's put was between
        counting a request and releasing its item all through the attach's reading,
        at a later ``service`` call, however long the learner was held up there).
        Where the dead process cannot be judged
        dead (another pid namespace) nothing is given back: the restart reads each
        request with the next one's item, a request behind, so the run goes on while
        the learner sends more; a wait for the newest with nothing more sent, which
        the learner does not pack itself, fails the run after liveness_timeout
        (``CollectorDied``: "no get can take"). One killed in the few bytecodes
        after counting a request taken and before freeing its place in the channel
        left the channel a place short: the restart gives the place back
        (``Channel.restore_spaces``; where the learner was sending a request all
        along, every place but the one its put may hold, and the last at a later
        ``service`` call) where it gives an item back, unless an
        attach to this handle before it could not judge its own predecessor dead,
        or ran without the claim lock (a reader that may still live would free its
        place itself, one too many: a request written over before it is read); the
        place then stays lost, and once every place of the channel is, the
        learner's next request fails the run ("request channel stayed full ...: N of
        its M places were lost"). What is left to a later ``service`` call is the
        handle's to give back, not one Packer object's: the Packer of this
        process's next attach to it (a retry) gives it back at its calls. The
        restart must attach before the learner's next wait or poll: one that finds
        the attached collector dead and none attached in its place fails the run
        (``CollectorDied``: "the collector process (pid P) is gone").
        A process the learner ``watch``es is not restarted: its death fails the run
        whatever attached since ("... exited with code C").

        Raises:
            ValueError: ``handle`` is the pipeline's of another replay buffer, or its
                slots are not as wide as ``replay_buffer``'s rows.
            ProtocolError: another live process is attached to ``handle`` (two would
                take each other's requests, and the learner would wait for ever).
        """
        packer = cls(handle, replay_buffer)
        # Under the claim lock: of two processes attaching at once, one sees the other.
        locked = handle.claim_lock.acquire(timeout=LEARNER_CHECK_S)
        try:
            pid, record = handle.packer_pid, handle.packer_record
            # This process attached before, unless its record is another's: a
            # collector restarted with its dead predecessor's pid (given it again, or
            # in another pid namespace, as a restarted container's first process).
            again = pid == os.getpid() and (not record[0] or record == owner.me())
            if again:
                # What this process's attach before could not give back yet, this
                # Packer gives back (that one may be dropped: a retry). Used beside
                # it, two readers (unsupported): one after the other on one thread,
                # the later reading finds nothing more; from two threads, one may
                # count the other's get under way as lost, one given back too many.
                packer.items_owed = bool(handle.packer_state[ITEMS_OWED])
                packer.places_owed = bool(handle.packer_state[PLACES_OWED])
            # Judged by its record: its pid may name another process since (a collector
            # restarted after a SIGKILL); from another pid namespace (a restarted
            # container) it cannot be judged, and the restart attaches.
            if pid and not again and (
                    owner.lives(record) if record[0] else process_alive(pid)):
                raise ProtocolError(
                    f"process {pid} is attached to this packer handle already: one "
                    "packer process per pipeline (the request channel has one reader); "
                    "let that process serve every request, or give each collector a "
                    "pipeline of its own")
            if pid and not again:
                # Another process's packer was attached, and is gone: what it read off
                # the request channel and left undone is lost with it (``stranded``).
                # Set before the pid: a learner that sees this process sees them.
                handle.packer_state[READ_BEFORE] = handle.requests.taken
                handle.packer_state[PREDECESSOR] = pid
                if locked and (not record[0] or owner.lives(record) is False):
                    # Surely gone, and given back only while every reader before it
                    # is surely gone too (one alive inside its get would count its
                    # record, or free its place, itself: one too many), and only
                    # under the claim lock (two restarts at once would each give
                    # the same back). UNSURE is asked again after each measurement:
                    # an attach without the lock may set it meanwhile, and get.
                    if handle.sure():
                        # Killed inside its get, it took a request's item and never
                        # counted the request read: this process reads that request
                        # next, with its own item again, not every request one
                        # behind. One reading, no wait under the lock (a second
                        # restart waiting for it for LEARNER_CHECK_S would attach
                        # without it, beside this one): with the learner's put
                        # between its count and its release, ``service`` reads again.
                        packer.items_owed = handle.requests.restore_taken(
                            0.0, handle.sure) is None
                        # Or it counted the request read and never freed its place.
                        # One reading too: with the learner's put under way, all
                        # but the place it may hold (``service`` reads again).
                        packer.places_owed = handle.requests.restore_spaces(
                            0.0, handle.sure) is None
                else:
                    handle.packer_state[UNSURE] = 1
            elif not locked:
                handle.packer_state[UNSURE] = 1  # another attach may run beside it
            if not again:  # the cells are this process's now
                handle.packer_state[ITEMS_OWED] = int(packer.items_owed)
                handle.packer_state[PLACES_OWED] = int(packer.places_owed)
            handle.packer_state[RECORD:RECORD + 3] = torch.tensor(owner.me())
            handle.packer_state[BEAT] = time.monotonic_ns()
            handle.packer_state[PID] = os.getpid()
        finally:
            if locked:
                handle.claim_lock.release()
        if handle.learner_pid not in (0, os.getpid()):
            cls._start_learner_watch(packer)
        return packer

    def _start_learner_watch(self) -> None:
        """Start this process's daemon thread that watches the learner for this
        learner and replay buffer (``LearnerWatch``), unless one runs."""
        key = (self._learner_pid, id(self.replay_buffer))  # the thread keeps it alive
        with _WATCHES_LOCK:
            running = _WATCHES.get(key)
            if running is not None and running.is_alive():
                return
            watch = LearnerWatch(self._learner_pid, self._learner_is_parent,
                                 self.replay_buffer)
            thread = threading.Thread(target=watch.run, daemon=True,
                                      name="replay_fsm-learner-watch")
            thread.start()
            _WATCHES[key] = thread

    @property
    def closed(self) -> bool:
        return self.handle.requests.closed

    def service(self, timeout: float = 0.0) -> bool:
        """Serve at most one request, waiting up to ``timeout`` seconds for one.

        A request stays pending while ``ptr < min_snapshot_ptr``; one whose every
        chunk the learner claimed first (it packs them itself) is dropped. Returns
        whether a request was served: chunks of it written (its pack-done message
        is posted by whichever side counts its last chunk) or, when packing raised,
        that tick's failure posted with the traceback text.
        """
        now = self._beat[0] = time.monotonic_ns()
        if self._left_by_learner(now):
            return False
        if self.items_owed or self.places_owed:
            self._give_back()
        try:
            if self._pending is None:
                got = self.handle.requests.get(timeout=0)
                if got is None and timeout > 0:
                    self._speculate()  # idle: draw the next tick's indices now
                    got = self.handle.requests.get(timeout=timeout)
                if got is None:
                    return False
                self._pending = decode(PackRequest, got[0])
            request = self._pending
            if self.replay_buffer.ptr < request.min_snapshot_ptr:
                if timeout > 0:
                    time.sleep(min(timeout, 0.0005))  # collector has not caught up yet
                return False
            chunk = self.handle.claim(request.slot, request.generation,
                                      self.replay_buffer.ptr, LEARNER_CHECK_S)
            if chunk is None:
                return False  # kept pending; the next call first checks the learner
            self._pending = None
            if chunk == NO_CHUNK:
                self._last_seed = request.seed  # the learner packed it: speculate on
                self._dropped += 1
                return False
            self._pack(request, chunk)
            return True
        except ChannelClosed:
            return False

    def _give_back(self) -> None:
        """Give back the items and places of the request channel that the process
        attached before this one took and lost, which the attach could not measure:
        the learner's put was between counting its request and releasing its item,
        or a request was being sent all along (the place its put may hold was kept
        back). Asked again at every call, between gets, while this process is the
        channel's one reader (no attach beside it since): a put's release needs no
        get, and a descheduled learner's put ends, however long it is held up."""
        if not self._alone():
            self.items_owed = self.places_owed = False
            return
        requests, state = self.handle.requests, self.handle.packer_state
        # A reading that counts settles the handle's debt too: it measured the whole
        # shortfall, whichever Packer of this process owed it.
        if self.items_owed:
            self.items_owed = requests.restore_taken(0.0, self._alone) is None
            state[ITEMS_OWED] = int(self.items_owed)
        if self.places_owed:
            self.places_owed = requests.restore_spaces(0.0, self._alone) is None
            state[PLACES_OWED] = int(self.places_owed)

    def _alone(self) -> bool:
        """Whether this process is still the request channel's one reader: the
        attached packer, and no attach unsure since (``PackerHandle.sure``)."""
        return self.handle.sure() and self.handle.packer_pid == os.getpid()

    def serve_due(self) -> int:
        """Serve every waiting request whose ``min_snapshot_ptr`` is reached; returns
        how many this call served.

        A lock-step collector calls it before it adds rows again, so each of those
        requests is packed at exactly the ptr it asked for (the synchronous schedule
        of ``replay_fsm.trainers``). ``service`` alone would stop at the first call
        that serves nothing, which is not only an empty channel: a request whose
        every chunk the learner packed itself, or a claim whose lock stayed taken
        (a learner descheduled while holding it, on a loaded machine). Those are
        passed or retried here; the requests behind them would otherwise be served
        later, at a larger ptr. A request counted whose item is on its way (the
        learner's put between its count and its release) is waited for on the
        channel's semaphore, not in a spin. Returns when the channel is empty, the
        request at its head is not due yet, or cannot be taken until the learner
        sends another (a collector killed inside its get took its item, and no
        give-back came: ``Channel.get_can_take``), or the channels closed (a dead
        learner too).
        """
        served, wait = 0, 0.0
        requests = self.handle.requests
        while not self.closed:
            dropped = self._dropped
            if self.service(timeout=wait):
                served += 1
                wait = 0.0
                continue
            pending = self._pending
            if pending is not None:
                if self.replay_buffer.ptr < pending.min_snapshot_ptr:
                    return served  # not due: this process's next rows make it so
                wait = 0.0
                continue  # due, and its claim lock stayed taken: try again
            if self._dropped != dropped:
                # The learner packed it itself: the next may be due, its item there
                # (which ``get_can_take`` cannot see where the semaphore's value
                # cannot be read: macOS).
                wait = 0.0
                continue
            if not requests.backlog or not requests.get_can_take:
                # Empty, or its oldest request waits on an item that a collector
                # killed inside its get took, and no give-back came: the next
                # request's item brings it, as ``service`` reads it then.
                return served
            # A request counted, its item on its way (the learner's put between its
            # count and its release, the learner descheduled there): waited for on
            # the semaphore, a slice at a time, where a retry at once spun a core
            # until the learner ran again.
            wait = LEARNER_CHECK_S
        return served

    def take(self, request: PackRequest, timeout: float,
             give_up: Callable[[], None] | None = None,
             deliver: Callable[[PackDone], None] | None = None) -> int | None:
        """The learner's side: pack the chunks of ``request`` the packer has not
        claimed, on this thread; whoever writes the last chunk posts the pack-done
        message (the learner to this process's consumer, ``Channel.post_local``, or,
        given ``deliver``, straight to ``deliver`` on this thread).
        Returns how many chunks this call wrote (0: none was left), None when the
        claim lock stayed taken for ``timeout`` seconds. A chunk that raises is
        reported as the packer's are: its traceback in the pack-done message.

        A written chunk must be counted under the claim lock, and a chunk's gather
        waits for rows an add is writing. While either is held up, ``give_up`` is
        called at every retry (the pipeline's watchdog, a stop signal): what it
        raises ends the take, the request abandoned and nothing posted.

        Raises:
            ChannelClosed: the channel closed while packing.
            RuntimeError: a written chunk could not be counted: the packer process
                holding the claim lock died, or the lock stayed taken for
                HOLD_PATIENCE_S (its holder is stopped or hung). The request can
                never complete; the caller fails its run.
            CollectorDied: a gather waited ``writer_patience_s`` at a stretch for
                rows an add is writing (its writer is stopped inside it).
        """
        chunk = self.handle.claim(request.slot, request.generation,
                                  self.replay_buffer.ptr, timeout, by_packer=False)
        if chunk is None:
            return None
        if chunk == NO_CHUNK:
            return 0
        return self._pack(request, chunk, local=True, give_up=give_up, deliver=deliver)

    def _speculate(self) -> None:
        if self._last_seed is None:
            return
        key = (self._last_seed + 1, self.replay_buffer.size)
        if key != self._drawn and key[1] > 0:
            sample_indices(key[1], self._next_indices.shape[0], key[0],
                           out=self._next_indices, generator=self._generator)
            self._drawn = key

    def _left_by_learner(self, now: int) -> bool:
        """Whether the learner is gone (``_orphaned`` has run then), asked at most every
        LEARNER_CHECK_S: a serving or waiting packer calls it often."""
        if now < self._next_learner_check_ns:
            return False
        self._next_learner_check_ns = now + int(LEARNER_CHECK_S * 1e9)
        if self._learner_alive():
            return False
        self._orphaned()
        return True

    def _learner_alive(self) -> bool:
        return learner_lives(self._learner_pid, self._learner_is_parent)

    def _orphaned(self) -> None:
        """The learner is gone: stop serving and leave no named object behind."""
        if self.handle.requests.closed:
            return
        self.handle.close()
        self.handle.unlink()
        self.replay_buffer.unlink()

    def _pack(self, request: PackRequest, chunk: int, *, local: bool = False,
              give_up: Callable[[], None] | None = None,
              deliver: Callable[[PackDone], None] | None = None) -> int:
        """Write ``chunk`` of ``request`` and every further chunk this side claims;
        post the pack-done message when this side wrote the last one, or the
        traceback when a chunk raised. Returns the chunks written. A chunk that
        cannot be counted raises (``_advance``): nothing is posted then."""
        handle, rb = self.handle, self.replay_buffer
        # Every writer of the request uses its first writer's snapshot: one ptr read,
        # so size is min(ptr, capacity) by construction (two reads could give a pair
        # that never existed together while an add runs).
        ptr, start = handle.snapshot(request.slot)
        size = min(ptr, rb.capacity)
        written, last, error = 0, False, None
        try:
            if request.sample_count != self._indices.shape[0]:
                raise ValueError(f"request for {request.sample_count} rows, host slots "
                                 f"hold {self._indices.shape[0]}")
            indices = self._draw(request.seed, size)
        except Exception:
            error = traceback.format_exc()
        out, bounds = handle.host_slots[request.slot], handle.chunk_bounds
        stopped: list[BaseException] = []  # what ended a gather waiting on a writer
        # The learner's patience with a writer counts on the looks' clock, as every
        # liveness bound: each call of ``retrying`` is a look, and a stretch no call saw
        # (the whole job stopped with Ctrl-Z and resumed) counts for at most half of it.
        looks = LookClock(self.writer_patience_s / 2)
        held: list[int] = []  # the looks' ns the chunk's gather began to wait, per chunk

        def retrying(waited_s: float) -> None:
            if local:
                now = looks.look()
                if not held:
                    held.append(now - int(min(waited_s, self.writer_patience_s / 2) * 1e9))
                waited_s = (now - held[0]) / 1e9
            try:
                self._writer_wait(request.tick, waited_s, local, give_up)
            except BaseException as exc:
                stopped.append(exc)
                raise

        while error is None and chunk != NO_CHUNK:
            lo, hi = bounds[chunk], bounds[chunk + 1]
            held.clear()
            try:
                if self._gather_retries:
                    rb.gather(indices[lo:hi], out=out[lo:hi], retrying=retrying)
                else:
                    rb.gather(indices[lo:hi], out=out[lo:hi])
            except Exception as exc:
                if stopped and exc is stopped[0]:
                    # Not the pack's error: no traceback posted; its chunk never comes.
                    handle.abandon(request.slot, request.generation, LEARNER_CHECK_S)
                    raise
                error = traceback.format_exc()
                break
            written += 1
            if not local:
                # A beat per chunk: a long pack is not silence. The learner's own
                # chunks never beat, or they would hide a hung packer.
                self._beat[0] = time.monotonic_ns()
            chunk, last = self._advance(request, local, give_up)
        if error is not None:
            handle.abandon(request.slot, request.generation, LEARNER_CHECK_S)
        self.packed_count += written > 0 and error is None
        if last or error is not None:
            done = PackDone(tick=request.tick, slot=request.slot,
                            generation=request.generation, seed=request.seed,
                            sample_count=request.sample_count, snapshot_ptr=ptr,
                            snapshot_size=size, pack_start_ns=start,
                            pack_end_ns=time.monotonic_ns(), error=error)
            if not local:
                handle.done.put(*encode(done))
            elif deliver is None:
                handle.done.post_local(*encode(done))
            else:
                deliver(done)
        return written

    def _writer_wait(self, tick: int, waited_s: float, learner: bool,
                     give_up: Callable[[], None] | None) -> None:
        """A gather of ``tick``'s rows has read some again for ``waited_s`` seconds: an
        add writes them, or its writer is stopped inside it (SIGSTOP, a debugger),
        which the gather would wait for as long as the writer lives. The packer stops
        when its channel closed or its learner is gone (ChannelClosed); the learner
        when ``give_up`` (its watchdog, a stop signal) raises, or after
        ``writer_patience_s`` (CollectorDied: the writer is the collector side)."""
        if self.handle.requests.closed:
            raise ChannelClosed()
        if not learner:
            if self._left_by_learner(time.monotonic_ns()):
                raise ChannelClosed()
            return
        if give_up is not None:
            give_up()
        if waited_s > self.writer_patience_s:
            raise CollectorDied(
                f"tick {tick}: the learner's gather of it has waited {waited_s:.1f} s "
                f"({setting('liveness_timeout')} {self.writer_patience_s:g} s) "
                "for rows an add is writing: its writer is stopped or hung inside it")

    def _draw(self, seed: int, size: int) -> torch.Tensor:
        if (seed, size) == self._drawn:
            indices = self._next_indices  # drawn while idle (``_speculate``)
            self.drawn_ahead += 1
        else:
            indices = sample_indices(size, self._indices.shape[0], seed,
                                     out=self._indices, generator=self._generator)
        self._drawn = None
        self._last_seed = seed
        return indices

    def _advance(self, request: PackRequest, learner: bool,
                 give_up: Callable[[], None] | None = None) -> tuple[int, bool]:
        """``PackerHandle.advance``, waited for: a written chunk must be counted, or
        the request never completes. The packer waits while its learner lives. The
        learner asks ``give_up`` at every retry, and stops when the packer process
        died (it holds the lock for good) or after HOLD_PATIENCE_S."""
        # On the looks' clock (each retry a look): a job stopped and resumed meanwhile
        # counts for at most half of HOLD_PATIENCE_S.
        looks = LookClock(HOLD_PATIENCE_S / 2)
        since = looks.look()
        while True:
            got = self.handle.advance(request.slot, request.generation, LEARNER_CHECK_S,
                                      by_packer=not learner)
            if got is not None:
                return got
            if self.handle.requests.closed:
                raise ChannelClosed()
            if not learner:
                if not self._learner_alive():
                    self._orphaned()
                    raise ChannelClosed()
                continue
            if give_up is not None:
                give_up()
            pid = self.handle.packer_pid
            if pid not in (0, os.getpid()) and not process_alive(pid):
                raise RuntimeError(f"the packer process (pid {pid}) died holding the "
                                   "claim lock")
            if looks.look() - since > HOLD_PATIENCE_S * 1e9:
                raise RuntimeError(f"the claim lock stayed taken for {HOLD_PATIENCE_S:.0f}"
                                   " s: its holder (the packer) is stopped or hung")


def serve_forever(handle: PackerHandle, replay_buffer: ReplayBuffer,
                  poll_s: float = 0.05, threads: int | None = None) -> None:
    """Packer-only process body (``collector="process"``): serve until closed.

    ``threads``: torch intra-op threads for the gather (None: torch's default).
    """
    ignore()  # Ctrl-C is the learner's to act on: it closes the channels, this loop ends
    if threads is not None:
        torch.set_num_threads(threads)
    packer = Packer.attach(handle, replay_buffer)
    while not packer.closed:
        packer.service(timeout=poll_s)
    # Left: the interpreter's teardown is what the learner's close() waits for now.
    # Frozen, its collections skip every object of the imports (torch's): a spawned
    # process with torch exited in about 0.1 s instead of 0.3 s, and under load past
    # close's patience (a SIGTERM, counted as forced).
    gc.freeze()
