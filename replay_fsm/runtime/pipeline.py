"""The runtime pipeline: the core driven by real threads, memory and devices.

One lock (a Condition) serialises every core step. The learner calls the public
methods; a transfer-worker thread turns pack-done messages into copy orders; a
packer runs in a thread, a spawned process, or the user's collector process;
the backend's copy engine reports completions. Every wait is sliced so that a
dead packer is noticed within ``liveness_timeout`` (INV-LIVE).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core import Core
from ..data.buffer import ReplayBuffer
from ..data.channel import ChannelClosed
from ..data.packer import Packer, PackerHandle, serve_forever
from ..errors import (
    CollectorDied,
    PackerError,
    PipelineClosed,
    PipelineFailed,
    ProtocolError,
    ReplayFSMError,
)
from ..spec import Actor, SlotState
from ..transfer import TransferBackend, build_backend
from ..wire import PackDone, TransitionRecord
from .checked import Checker
from .links import ChannelLink, CollectorLink
from .tracer import Tracer

COLLECTORS = ("thread", "process", "external")
_WAIT_SLICE_S = 0.05


@dataclass(frozen=True)
class Statistics:
    """A snapshot of what the pipeline did so far."""

    ticks: int  # batches acquired by the learner
    requests: int
    packs: int
    learner_wait_s: float  # time the learner spent blocked waiting for a batch
    stalls: int  # acquires that found their batch not yet READY
    bytes_moved: int  # host-to-device bytes copied
    dwell_s: dict[str, float] = field(default_factory=dict)  # per state, all slots


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _ClosedLink:
    """Stands in for the link after close, holding no shared resources."""

    def send(self, request: object, **kw: object) -> None:
        raise ChannelClosed()

    def receive(self, timeout: float) -> None:
        raise ChannelClosed()

    def close(self) -> None:
        pass


class Pipeline:
    """Packs and copies tick t+1.. while the learner trains on tick t.

    Args:
        replay_buffer: the shared ReplayBuffer to sample from.
        device: the learner's device ("cpu", "cuda", "cuda:1", "mps", ...).
        sample_count: rows per batch; every call must pass the same value.
        base_seed: tick t samples with seed ``base_seed + t`` (INV-DATA).
        ring_depth: slots in the ring (>= 2); up to ring_depth - 1 ticks prefetch.
        collector: "thread" (a packer thread here), "process" (a spawned packer-only
            process) or "external" (your collector calls ``Packer.attach``).
        backend: override the backend chosen by ``device``: "cpu", "cuda", "accel",
            "emulated" or "manual". ``backend_options`` go to its constructor.
        liveness_timeout: seconds without a packer heartbeat, while a request waits,
            before the learner raises CollectorDied.
        checked: record reader and writer intervals per slot and raise on any
            overlap the invariants forbid; poison released device slots with NaN.
        trace: record transitions and spans (see ``tracer``) for Perfetto export.
        packer_threads: torch threads of the spawned packer process
            (collector="process"); None leaves torch's default.
        host_slots, link: for the seed-compatible class: host slots and a
            collector link supplied by the caller.

    Raises:
        ValueError: a bad argument (unknown device, collector, ring depth, count).
    """

    def __init__(self, replay_buffer: ReplayBuffer, *, device: str | torch.device = "cpu",
                 sample_count: int, base_seed: int = 0, ring_depth: int = 2,
                 collector: str = "thread", backend: str | None = None,
                 backend_options: dict[str, Any] | None = None,
                 liveness_timeout: float = 5.0, checked: bool = False,
                 trace: bool = False, trace_capacity: int = 1 << 16,
                 packer_threads: int | None = None,
                 host_slots: torch.Tensor | Sequence[torch.Tensor] | None = None,
                 link: CollectorLink | None = None) -> None:
        if not isinstance(sample_count, int) or sample_count < 1:
            raise ValueError(f"sample_count must be a positive int, got {sample_count!r}")
        if collector not in COLLECTORS:
            raise ValueError(f"unknown collector {collector!r}; supported: "
                             f"{', '.join(COLLECTORS)}")
        if liveness_timeout <= 0:
            raise ValueError("liveness_timeout must be positive")
        self.replay_buffer = replay_buffer
        self.sample_count = sample_count
        self.base_seed = int(base_seed)
        self.ring_depth = ring_depth
        self.collector = collector
        self.liveness_timeout = float(liveness_timeout)
        self._core = Core(ring_depth, base_seed=base_seed, sample_count=sample_count,
                          observer=self._observe)
        options = dict(backend_options or {})
        if trace and str(device).startswith("cuda") and backend in (None, "cuda"):
            options.setdefault("timing", True)  # CUDA-event copy timings and NVTX ranges
        self.backend: TransferBackend = build_backend(device, backend, **options)
        self.device = self.backend.device
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._closed = False
        self._watched: list[tuple[Any, str]] = []
        self._packer_thread: threading.Thread | None = None
        self._process: Any = None
        # Statistics, updated under the lock.
        self._acquired = self._requests = self._packs = self._stalls = 0
        self._wait_ns = self._bytes = 0
        self._dwell_ns = dict.fromkeys(SlotState, 0)
        self._since = [time.monotonic_ns()] * ring_depth
        self.last_done: dict[int, PackDone] = {}
        self._copy_submit_ns = [0] * ring_depth
        self.last_copy_s = 0.0  # submit-to-complete time of the latest copy
        self.tracer: Tracer | None = Tracer(trace_capacity) if trace else None
        self._checker: Checker | None = None

        width = replay_buffer.width
        self.handle: PackerHandle | None = None
        if link is None:
            self.handle = PackerHandle.create(ring_depth, sample_count, width)
            host_slots = self.handle.host_slots
            link = ChannelLink(self.handle)
        elif host_slots is None:
            raise ValueError("a custom link needs the host_slots it packs into")
        shapes = [tuple(s.shape) for s in host_slots]
        if shapes != [(sample_count, width)] * ring_depth:
            raise ValueError(f"host slots have shapes {shapes}, expected {ring_depth} of "
                             f"{(sample_count, width)}")
        self.host_slots = host_slots
        self._link = link
        self.backend.setup(host_slots, self._on_copy_complete)
        self._views = [replay_buffer.layout.views(self.backend.device_slot(i))
                       for i in range(ring_depth)]
        self._slot_bytes = int(host_slots[0].numel() * host_slots[0].element_size())
        if checked:
            self._checker = Checker(self)
            if hasattr(self.backend, "monitor"):
                self.backend.monitor = self._checker  # type: ignore[attr-defined]

        self._transfer_thread = threading.Thread(
            target=self._transfer_loop, name="replay_fsm-transfer", daemon=True)
        self._transfer_thread.start()
        if self.handle is not None and collector == "thread":
            packer = Packer(self.handle, replay_buffer)
            self._packer_thread = threading.Thread(
                target=self._packer_loop, args=(packer,), name="replay_fsm-packer",
                daemon=True)
            self._packer_thread.start()
        elif self.handle is not None and collector == "process":
            self._process = mp.get_context("spawn").Process(
                target=serve_forever,
                args=(self.handle, replay_buffer, _WAIT_SLICE_S, packer_threads),
                name="replay_fsm-packer", daemon=True)
            self._process.start()
            self.watch(self._process, "the packer process")

    # -- collector side -------------------------------------------------------

    def packer_handle(self) -> PackerHandle:
        """The picklable handle for ``Packer.attach(handle, rb)`` in your collector.

        Raises:
            ValueError: this pipeline talks to its collector through a custom link.
        """
        if self.handle is None:
            raise ValueError("this pipeline has no packer handle (custom link)")
        return self.handle

    def watch(self, process: Any, what: str = "the collector process") -> None:
        """Fail fast with CollectorDied when ``process`` (``is_alive()``) dies."""
        with self._cv:
            self._watched.append((process, what))

    # -- learner API ----------------------------------------------------------

    def start_prepare(self, tick_id: int, sample_count: int,
                      min_snapshot_ptr: int | None = None) -> bool:
        """Request ``tick_id``: pack and copy it into the next slot in ring order.

        ``min_snapshot_ptr`` (default: the buffer's ptr now) makes the packer wait
        until that many rows were ever written. Returns False when the tick is
        already requested or hot, True when this call started new work.

        Raises:
            ValueError: ``sample_count`` differs from the allocated one.
            IllegalTransition: out of order, or the ring is full.
            PipelineFailed, PipelineClosed.
        """
        self._validate(sample_count)
        with self._profiled("start_prepare"), self._cv:
            self._raise_if_unusable()
            if self._core.slot_of(tick_id) is not None:
                return False
            ptr = self.replay_buffer.ptr
            request = self._core.request(
                int(tick_id), ptr if min_snapshot_ptr is None else int(min_snapshot_ptr))
            self._requests += 1
            hot = self._core.hot_slot
            try:
                self._link.send(request, snapshot=(ptr, self.replay_buffer.size),
                                hot_slot=-1 if hot is None else hot)
            except ChannelClosed as exc:
                self._fail_locked(CollectorDied(f"tick {tick_id}: the packer's channel is "
                                                "closed"), Actor.LEARNER, exc)
                self._raise_if_unusable()
            except Exception as exc:  # the request is lost: the slot can never fill
                self._fail_locked(exc, Actor.LEARNER)
                self._raise_if_unusable()
            return True

    def batch_ready(self, tick_id: int, sample_count: int) -> bool:
        """Whether ``tick_id`` can be sampled without waiting. Never blocks."""
        self._validate(sample_count)
        with self._cv:
            self._pump_locked()
            self._raise_if_unusable()
            slot = self._core.slot_of(tick_id)
            return slot is not None and self._core.state(slot) in (SlotState.READY,
                                                                   SlotState.HOT)

    def wait_until_ready(self, tick_id: int, sample_count: int,
                         timeout: float | None = None) -> bool:
        """Wait until ``tick_id`` is READY (or HOT); False if ``timeout`` ran out.

        Even without a timeout the wait ends: a dead packer raises CollectorDied
        within ``liveness_timeout``.

        Raises:
            ProtocolError: the tick was never requested.
            CollectorDied, PipelineFailed, PipelineClosed.
        """
        self._validate(sample_count)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._profiled("wait_until_ready"):
            return self._interruptible(self._wait, int(tick_id), deadline)

    def sample_large_batch(self, tick_id: int, sample_count: int) -> dict[str, torch.Tensor]:
        """The batch of ``tick_id``, waiting for it if needed; the slot becomes HOT.

        The tensors view the device slot and stay valid until ``after_tick()``.

        Raises:
            ProtocolError: the tick was never requested, or another tick is hot.
            ValueError: ``sample_count`` differs from the allocated one.
            CollectorDied, PipelineFailed, PipelineClosed.
        """
        self._validate(sample_count)
        with self._profiled("sample_large_batch"):
            return self._interruptible(self._acquire, int(tick_id))

    def after_tick(self) -> None:
        """Release the hot batch (no-op when none is hot); its slot can be reused."""
        with self._profiled("after_tick"), self._cv:
            self._raise_if_unusable()
            slot = self._core.hot_slot
            if slot is None:
                return
            if self._checker is not None:
                self._checker.released(slot)
            self.backend.after_read(slot)  # the end of this HOT period's reads
            self._core.release()

    def ticks(self, start: int, stop: int) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Yield (tick, batch) for ticks in [start, stop), prefetching up to
        ring_depth - 1 ticks ahead; each batch is released when the loop moves on."""
        try:
            for tick in range(start, stop):
                self.after_tick()
                for ahead in range(tick, min(tick + self.ring_depth - 1, stop - 1) + 1):
                    self.start_prepare(ahead, self.sample_count)
                yield tick, self.sample_large_batch(tick, self.sample_count)
        finally:
            with contextlib.suppress(ReplayFSMError):
                self.after_tick()

    def statistics(self) -> Statistics:
        with self._cv:
            now = time.monotonic_ns()
            dwell = dict(self._dwell_ns)
            for i, state in enumerate(self._core.states):
                dwell[state] += now - self._since[i]
            return Statistics(
                ticks=self._acquired, requests=self._requests, packs=self._packs,
                learner_wait_s=self._wait_ns / 1e9, stalls=self._stalls,
                bytes_moved=self._bytes,
                dwell_s={s.value: ns / 1e9 for s, ns in dwell.items()})

    @property
    def states(self) -> tuple[SlotState, ...]:
        with self._cv:
            return self._core.states

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def collector_process(self) -> Any:
        """The spawned packer process (collector="process"), else None."""
        return self._process

    def close(self) -> None:
        """Stop everything: join threads, stop a spawned packer, drain copies,
        unregister page-locked memory. Idempotent (INV-CLOSE)."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._core.close()
            self._cv.notify_all()
        self._stop.set()
        self._link.close()
        for thread in (self._packer_thread, self._transfer_thread):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=30)
        if self._process is not None:
            self._process.join(timeout=10)
            if self._process.is_alive():
                self._process.terminate()
                self._process.join(timeout=10)
        self.backend.close()
        # Drop our references to shared memory and semaphores so they are freed now.
        self._views = []
        self.handle = None
        self._process = None
        self._link = _ClosedLink()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- learner internals ----------------------------------------------------

    def _profiled(self, name: str) -> Any:
        """A torch.profiler range named for the learner call when tracing; else nothing."""
        if self.tracer is None:
            return contextlib.nullcontext()
        return torch.profiler.record_function(f"replay_fsm/{name}")

    def _interruptible(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except KeyboardInterrupt:
            self.close()
            raise

    def _wait(self, tick: int, deadline: float | None) -> bool:
        with self._cv:
            return self._wait_locked(tick, deadline)

    def _wait_locked(self, tick: int, deadline: float | None) -> bool:
        self._raise_if_unusable()
        slot = self._core.slot_of(tick)
        if slot is None:
            raise ProtocolError(f"tick {tick} was not requested; call start_prepare first")
        started = None
        while True:
            self._pump_locked()
            self._raise_if_unusable()
            if self._core.state(slot) in (SlotState.READY, SlotState.HOT):
                break
            now = time.monotonic()
            if started is None:
                started = time.monotonic_ns()
                self._stalls += 1
            if deadline is not None and now >= deadline:
                break
            self._check_liveness(tick)
            wait = _WAIT_SLICE_S if deadline is None else min(_WAIT_SLICE_S, deadline - now)
            self._cv.wait(timeout=max(wait, 0.0))
        if started is not None:
            end = time.monotonic_ns()
            self._wait_ns += end - started
            if self.tracer is not None:
                self.tracer.span("wait", Actor.LEARNER, started, end, tick=tick, slot=slot)
        return self._core.state(slot) in (SlotState.READY, SlotState.HOT)

    def _acquire(self, tick: int) -> dict[str, torch.Tensor]:
        with self._cv:
            self._raise_if_unusable()
            hot = self._core.hot_slot
            if hot is not None:
                if self._core.hot_tick == tick:
                    return dict(self._views[hot])
                raise ProtocolError(f"tick {self._core.hot_tick} is still hot; call "
                                    f"after_tick() before sampling tick {tick}")
            self._wait_locked(tick, None)  # raises if the tick was never requested
            slot = self._core.slot_of(tick)
            assert slot is not None
            self.backend.before_read(slot)  # INV-RAW: reads wait for the copy
            if self._checker is not None:
                self._checker.acquiring(slot)
            self._core.acquire(tick)
            return dict(self._views[slot])

    def _validate(self, sample_count: int) -> None:
        if int(sample_count) != self.sample_count:
            raise ValueError(f"sample_count must match the value used to allocate the "
                             f"ring ({self.sample_count}), got {sample_count}")

    def _raise_if_unusable(self) -> None:
        failure = self._core.failure
        if failure is not None:
            # A CollectorDied stays a CollectorDied for every later call.
            kind = type(failure) if isinstance(failure, PipelineFailed) else PipelineFailed
            raise kind(f"the pipeline failed: {failure}") from failure
        if self._closed:
            raise PipelineClosed("the pipeline is closed")

    def _pump_locked(self) -> None:
        pump = getattr(self.backend, "pump", None)
        if pump is not None:
            self._cv.release()
            try:
                pump()
            finally:
                self._cv.acquire()

    def _check_liveness(self, tick: int) -> None:
        reason = None
        if self._packer_thread is not None and not self._packer_thread.is_alive():
            reason = "the packer thread exited"
        for proc, what in self._watched:
            if not proc.is_alive():
                reason = f"{what} (pid {proc.pid}) exited with code {proc.exitcode}"
        handle = self.handle
        if reason is None and handle is not None and handle.packer_pid:
            pid = handle.packer_pid
            if pid != os.getpid() and not _pid_alive(pid):
                reason = f"the packer process (pid {pid}) is gone"
            elif SlotState.REQUESTED in self._core.states:
                silent = (time.monotonic_ns() - handle.heartbeat_ns) / 1e9
                if silent > self.liveness_timeout:
                    reason = f"no heartbeat from the packer (pid {pid}) for {silent:.1f} s"
        if reason is not None:
            died = CollectorDied(f"tick {tick}: {reason}")
            self._fail_locked(died, Actor.LEARNER)
            raise died

    # -- transfer worker and callbacks ---------------------------------------

    def _packer_loop(self, packer: Packer) -> None:
        try:
            while not self._stop.is_set() and not packer.closed:
                packer.service(timeout=_WAIT_SLICE_S)
        except BaseException as exc:  # noqa: BLE001 - reported to the learner
            self._fail(exc, Actor.PACKER)

    def _transfer_loop(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    done = self._link.receive(timeout=0.1)
                except ChannelClosed:
                    return
                if done is not None:
                    self._on_pack_done(done)
        except BaseException as exc:  # noqa: BLE001 - reported to the learner
            self._fail(exc, Actor.TRANSFER)

    def _on_pack_done(self, done: PackDone) -> None:
        if done.error is not None:
            self._fail(PackerError(done.tick, done.error), Actor.PACKER)
            return
        with self._cv:
            if self._core.failure is not None or self._closed:
                return
            if self._checker is not None:
                self._checker.pack_done(done)
            order = self._core.packed(done)
            self._packs += 1
            self.last_done[done.slot] = done
            if self.tracer is not None:
                self.tracer.span("pack", Actor.PACKER, done.pack_start_ns, done.pack_end_ns,
                                 tick=done.tick, slot=done.slot,
                                 snapshot_size=done.snapshot_size)
            self._copy_submit_ns[done.slot] = time.monotonic_ns()
        self.backend.submit(order)

    def _on_copy_complete(self, slot: int) -> None:
        try:
            with self._cv:
                if self._core.failure is not None or self._closed:
                    return
                self._core.copied(slot)
                self._bytes += self._slot_bytes
                end = time.monotonic_ns()
                self.last_copy_s = (end - self._copy_submit_ns[slot]) / 1e9
                if self.tracer is not None:
                    self.tracer.span("copy", Actor.COPY_ENGINE, self._copy_submit_ns[slot],
                                     end, tick=self._core.tick_of(slot), slot=slot,
                                     bytes=self._slot_bytes)
                self._cv.notify_all()
        except BaseException as exc:  # noqa: BLE001 - reported to the learner
            self._fail(exc, Actor.COPY_ENGINE)

    def _fail(self, error: BaseException, actor: Actor | None) -> None:
        with self._cv:
            self._fail_locked(error, actor)

    def _fail_locked(self, error: BaseException, actor: Actor | None,
                     cause: BaseException | None = None) -> None:
        if cause is not None:
            error.__cause__ = cause
        self._core.fail(error, actor)
        self._cv.notify_all()

    def _observe(self, rec: TransitionRecord) -> None:
        now = time.monotonic_ns()
        self._dwell_ns[rec.source] += now - self._since[rec.slot]
        self._since[rec.slot] = now
        if rec.dest is SlotState.HOT:
            self._acquired += 1
        if self.tracer is not None:
            self.tracer.transition(rec, now)
