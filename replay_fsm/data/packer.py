"""The collector-side packer: takes pack requests, gathers rows into host slots.

In thread mode the pipeline runs ``Packer.service`` in a thread of the learner's
process; in process mode the user's collector process calls
``Packer.attach(handle, replay_buffer)`` once and ``service()`` between
environment steps, where the seed's collector serviced its queue.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass

import torch

from ..wire import DONE_FIELDS, REQUEST_FIELDS, PackDone, PackRequest, decode, encode
from .buffer import ReplayBuffer
from .channel import Channel, ChannelClosed
from .sampling import sample_indices

ERROR_TEXT_BYTES = 16384


@dataclass
class PackerHandle:
    """What the learner side gives a packer: channels, host slots, a pid cell.

    Picklable to a spawned process; nothing in it is copied (shared memory).
    """

    requests: Channel
    done: Channel
    host_slots: torch.Tensor  # [ring_depth, sample_count, width], shared
    # [pid, heartbeat monotonic ns] of the attached packer, shared; pid 0: none yet.
    packer_state: torch.Tensor

    @classmethod
    def create(cls, ring_depth: int, sample_count: int, width: int) -> PackerHandle:
        return cls(
            requests=Channel(ring_depth, REQUEST_FIELDS),
            done=Channel(ring_depth, DONE_FIELDS, text_bytes=ERROR_TEXT_BYTES),
            host_slots=torch.zeros(ring_depth, sample_count, width).share_memory_(),
            packer_state=torch.zeros(2, dtype=torch.int64).share_memory_(),
        )

    @property
    def packer_pid(self) -> int:
        return int(self.packer_state[0])

    @property
    def heartbeat_ns(self) -> int:
        return int(self.packer_state[1])

    @property
    def semaphore_names(self) -> tuple[str, ...]:
        """The /dev/shm names of the channels' semaphores (to check none is left)."""
        return self.requests.semaphore_names + self.done.semaphore_names

    def close(self) -> None:
        self.requests.close()
        self.done.close()


class Packer:
    """Serves pack requests for one pipeline from ``replay_buffer``."""

    def __init__(self, handle: PackerHandle, replay_buffer: ReplayBuffer) -> None:
        depth, n, width = handle.host_slots.shape
        if width != replay_buffer.width:
            raise ValueError(f"host slots are {width} columns wide but the replay buffer "
                             f"rows are {replay_buffer.width}")
        self.handle = handle
        self.replay_buffer = replay_buffer
        self._pending: PackRequest | None = None
        # Reused every tick: no allocation in steady state.
        self._indices = torch.empty(n, dtype=torch.int64)
        self._generator = torch.Generator()
        self._beat = handle.packer_state[1:].numpy()  # heartbeat cell, written per call
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

        A request stays pending while ``ptr < min_snapshot_ptr``. Returns whether a
        request was served: its pack-done message posted, or, when packing raised,
        that tick's failure with the traceback text.
        """
        self._beat[0] = time.monotonic_ns()
        try:
            if self._pending is None:
                got = self.handle.requests.get(timeout=timeout)
                if got is None:
                    return False
                self._pending = decode(PackRequest, got[0])
            request = self._pending
            if self.replay_buffer.ptr < request.min_snapshot_ptr:
                if timeout > 0:
                    time.sleep(min(timeout, 0.0005))  # collector has not caught up yet
                return False
            self._pending = None
            self._pack(request)
            return True
        except ChannelClosed:
            return False

    def _pack(self, request: PackRequest) -> None:
        start = time.monotonic_ns()  # system-wide clock: comparable across processes
        rb = self.replay_buffer
        size, ptr = rb.size, rb.ptr
        error = None
        try:
            if request.sample_count != self._indices.shape[0]:
                raise ValueError(f"request for {request.sample_count} rows, host slots "
                                 f"hold {self._indices.shape[0]}")
            indices = sample_indices(size, request.sample_count, request.seed,
                                     out=self._indices, generator=self._generator)
            rb.gather(indices, out=self.handle.host_slots[request.slot])
        except Exception:
            error = traceback.format_exc()
        done = PackDone(tick=request.tick, slot=request.slot, generation=request.generation,
                        seed=request.seed, sample_count=request.sample_count,
                        snapshot_ptr=ptr, snapshot_size=size, pack_start_ns=start,
                        pack_end_ns=time.monotonic_ns(), error=error)
        self.handle.done.put(*encode(done))
        self.packed_count += error is None


def serve_forever(handle: PackerHandle, replay_buffer: ReplayBuffer,
                  poll_s: float = 0.05, threads: int | None = None) -> None:
    """Packer-only process body (``collector="process"``): serve until closed.

    ``threads``: torch intra-op threads for the gather (None: torch's default).
    """
    if threads is not None:
        torch.set_num_threads(threads)
    packer = Packer.attach(handle, replay_buffer)
    while not packer.closed:
        packer.service(timeout=poll_s)
