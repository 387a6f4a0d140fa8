"""The collector-side packer: takes pack requests, gathers rows into host slots.

In thread mode the pipeline runs ``Packer.service`` in a thread of the learner's
process; in process mode the user's collector process calls
``Packer.attach(handle, replay_buffer)`` once and ``service()`` between
environment steps, where the seed's collector serviced its queue.

The learner may pack a request the packer has not started (``Packer.take``, see
specs/LEARNER_PACKS.md). Exactly one of them writes a request's host slot: each
claims it first, under one lock, in a cell per slot holding the generation last
claimed (INV-HOST-WAR).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from ..wire import DONE_FIELDS, REQUEST_FIELDS, PackDone, PackRequest, decode, encode
from .buffer import ReplayBuffer
from .channel import Channel, ChannelClosed, semaphore_name, unlink_semaphore
from .sampling import sample_indices

ERROR_TEXT_BYTES = 16384
LEARNER_CHECK_S = 0.25  # how often a packer looks whether its learner still lives


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
    # [pid, heartbeat monotonic ns] of the attached packer (pid 0: none yet), and the
    # pid of the learner that created the handle; shared.
    packer_state: torch.Tensor
    # Per slot, the generation of the last request claimed by its writer (the packer
    # or the learner), shared; read and set only under claim_lock (a spawn Lock).
    claims: torch.Tensor
    claim_lock: Any

    @classmethod
    def create(cls, ring_depth: int, sample_count: int, width: int) -> PackerHandle:
        state = torch.zeros(3, dtype=torch.int64).share_memory_()
        state[2] = os.getpid()
        return cls(
            # Twice the ring: besides one live request per slot, at most ring_depth
            # requests the learner packed itself wait to be dropped (ChannelLink.take).
            requests=Channel(2 * ring_depth, REQUEST_FIELDS),
            done=Channel(ring_depth, DONE_FIELDS, text_bytes=ERROR_TEXT_BYTES),
            host_slots=[torch.zeros(sample_count, width).share_memory_()
                        for _ in range(ring_depth)],
            packer_state=state,
            claims=torch.zeros(ring_depth, dtype=torch.int64).share_memory_(),
            claim_lock=mp.get_context("spawn").Lock(),
        )

    def __post_init__(self) -> None:
        self._state_np = self.packer_state.numpy()  # reads cost ns, not a torch call
        self._claims_np = self.claims.numpy()

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
        return int(self._state_np[0])

    @property
    def heartbeat_ns(self) -> int:
        return int(self._state_np[1])

    @property
    def learner_pid(self) -> int:
        return int(self._state_np[2])

    @property
    def semaphore_names(self) -> tuple[str, ...]:
        """The /dev/shm names of the channels' semaphores and the claim lock (to
        check none is left)."""
        return (self.requests.semaphore_names + self.done.semaphore_names
                + (semaphore_name(self.claim_lock),))

    def claim(self, slot: int, generation: int, timeout: float) -> bool | None:
        """Become the one writer of ``slot`` for request ``generation``: True when
        this caller writes it, False when the other side claimed it first, None when
        the lock stayed taken for ``timeout`` seconds (its holder may have died in
        it; a claim holds it for microseconds)."""
        if not self.claim_lock.acquire(timeout=timeout):
            return None
        try:
            if self._claims_np[slot] >= generation:
                return False
            self._claims_np[slot] = generation
            return True
        finally:
            self.claim_lock.release()

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
        self._beat = handle.packer_state[1:2].numpy()  # heartbeat cell, written per call
        self._learner_pid = handle.learner_pid
        # A packer the learner spawned is orphaned the moment the learner exits, even
        # while the learner lingers as a zombie nobody has reaped yet.
        self._learner_is_parent = os.getppid() == self._learner_pid
        self._next_learner_check_ns = 0
        self.packed_count = 0

    @classmethod
    def attach(cls, handle: PackerHandle, replay_buffer: ReplayBuffer) -> Packer:
        """Become the packer of ``handle`` in this (collector) process; the learner
        side then watches this process's pid for liveness."""
        packer = cls(handle, replay_buffer)
        handle.packer_state[1] = time.monotonic_ns()
        handle.packer_state[0] = os.getpid()
        return packer

    @property
    def closed(self) -> bool:
        return self.handle.requests.closed

    def service(self, timeout: float = 0.0) -> bool:
        """Serve at most one request, waiting up to ``timeout`` seconds for one.

        A request stays pending while ``ptr < min_snapshot_ptr``; one the learner
        claimed first (it packed it itself) is dropped. Returns whether a request
        was served: its pack-done message posted, or, when packing raised, that
        tick's failure with the traceback text.
        """
        now = self._beat[0] = time.monotonic_ns()
        if now >= self._next_learner_check_ns:
            self._next_learner_check_ns = now + int(LEARNER_CHECK_S * 1e9)
            if not self._learner_alive():
                self._orphaned()
                return False
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
            claimed = self.handle.claim(request.slot, request.generation, LEARNER_CHECK_S)
            if claimed is None:
                return False  # kept pending; the next call first checks the learner
            self._pending = None
            if not claimed:
                self._last_seed = request.seed  # the learner packed it: speculate on
                return False
            self._pack(request)
            return True
        except ChannelClosed:
            return False

    def take(self, request: PackRequest, timeout: float) -> bool:
        """The learner's side: pack ``request`` on this thread unless the packer
        claimed it first, and post its pack-done message to this process's consumer
        (``Channel.post_local``). Returns whether this call packed it; waits at most
        ``timeout`` seconds for the claim lock.

        Raises:
            ChannelClosed: the channel closed while packing.
        """
        if not self.handle.claim(request.slot, request.generation, timeout):
            return False
        self._pack(request, local=True)
        return True

    def _speculate(self) -> None:
        if self._last_seed is None:
            return
        key = (self._last_seed + 1, self.replay_buffer.size)
        if key != self._drawn and key[1] > 0:
            sample_indices(key[1], self._next_indices.shape[0], key[0],
                           out=self._next_indices, generator=self._generator)
            self._drawn = key

    def _learner_alive(self) -> bool:
        pid = self._learner_pid
        if pid in (0, os.getpid()):
            return True  # a packer thread in the learner's own process
        if self._learner_is_parent:
            return os.getppid() == pid
        return process_alive(pid)

    def _orphaned(self) -> None:
        """The learner is gone: stop serving and leave no named object behind."""
        if self.handle.requests.closed:
            return
        self.handle.close()
        self.handle.unlink()
        self.replay_buffer.unlink()

    def _pack(self, request: PackRequest, *, local: bool = False) -> None:
        start = time.monotonic_ns()  # system-wide clock: comparable across processes
        rb = self.replay_buffer
        # One counter read: size is min(ptr, capacity) by construction, and two reads
        # could give a pair that never existed together while an add runs.
        ptr = rb.ptr
        size = min(ptr, rb.capacity)
        error = None
        try:
            if request.sample_count != self._indices.shape[0]:
                raise ValueError(f"request for {request.sample_count} rows, host slots "
                                 f"hold {self._indices.shape[0]}")
            if (request.seed, size) == self._drawn:
                indices = self._next_indices  # drawn while idle (``_speculate``)
                self.drawn_ahead += 1
            else:
                indices = sample_indices(size, request.sample_count, request.seed,
                                         out=self._indices, generator=self._generator)
            self._drawn = None
            self._last_seed = request.seed
            rb.gather(indices, out=self.handle.host_slots[request.slot])
        except Exception:
            error = traceback.format_exc()
        done = PackDone(tick=request.tick, slot=request.slot, generation=request.generation,
                        seed=request.seed, sample_count=request.sample_count,
                        snapshot_ptr=ptr, snapshot_size=size, pack_start_ns=start,
                        pack_end_ns=time.monotonic_ns(), error=error)
        if local:
            self.handle.done.post_local(*encode(done))
        else:
            self.handle.done.put(*encode(done))
        self.packed_count += error is None


def serve_forever(handle: PackerHandle, replay_buffer: ReplayBuffer,
                  poll_s: float = 0.05, threads: int | None = None) -> None:
    """Packer-only process body (``collector="process"``): serve until closed.

    ``threads``: torch intra-op threads for the gather (None: torch's default).
    """
    # Ctrl-C reaches the whole process group; the learner decides what happens (it
    # closes the channels, and this loop ends), so the packer prints no traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if threads is not None:
        torch.set_num_threads(threads)
    packer = Packer.attach(handle, replay_buffer)
    while not packer.closed:
        packer.service(timeout=poll_s)
