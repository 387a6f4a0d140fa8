"""``CPUPinnedDoubleBufferReplayPipeline``: the seed's class over a ``Pipeline``.

What a seed user sees is the seed's: the constructor, what each method returns or
raises, the request dicts its collector reads and the ready dicts it writes, the
trace slices and their args, ``transfer_manifest``, and the attributes UniLab's
tests read. Underneath, a ``Pipeline`` of ring depth 2 fed through ``SeedQueueLink``
keeps the fixes: a copy into a device slot waits for the kernels still reading it,
and a learner waiting on a dead collector raises ``CollectorDied`` (``link`` says
what is watched) instead of hanging.

The seed's protocol, kept here: one request outstanding at a time (requested and
not yet sampled); tick ids are any ints in any order, and a tick may be requested
again, the hot one too. The pipeline's ticks are the request numbers 1, 2, ...; the
seed's tick ids travel as labels.
"""

from __future__ import annotations

import csv
import os
import re
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from .. import errors
from ..core import as_seconds
from ..files import replacing
from ..runtime.observers import Observer
from ..runtime.pipeline import Pipeline
from ..spec import Actor
from ..transfer.cuda import CudaBackend
from ..wire import MAX_SEED, PACK_EXECUTOR, PACK_LAYOUT
from .buffer import ReplayBufferView
from .errors import as_seed_error
from .link import RING_DEPTH, SeedQueueLink
from .transfer import SeedBackend, build_backend_for

T = TypeVar("T")
CLOSED = "Cannot prepare replay batch after pipeline.close()"
_SLOTS_WANTED = (f"collector_pack_shared_slots must be {RING_DEPTH} CPU tensors of "
                 f"(sample_count, width), as a list, or one CPU tensor of ({RING_DEPTH}, "
                 "sample_count, width), got ")


class _Copies(Observer):
    """Hands each finished copy (slot, monotonic start and end) to the compat class."""

    def __init__(self, copied: Callable[[int, int, int], None]) -> None:
        self._copied = copied

    def span(self, name: str, actor: Actor, start_ns: int, end_ns: int, *,
             tick: int | None = None, slot: int | None = None, **args: Any) -> None:
        if name == "copy" and slot is not None:
            self._copied(slot, start_ns, end_ns)


def _not_host_slots(slots: Any) -> Exception | None:
    """The error for ``collector_pack_shared_slots`` that the collector cannot pack
    into: not tensors (TypeError), or tensors outside host memory (ValueError). Any
    sequence of tensors is a list of them (the signature's ``Sequence``: a
    ``UserList`` served the seed's protocol as a list does); a str is none."""
    listed = [slots] if isinstance(slots, torch.Tensor) else slots
    what = type(slots).__name__
    if isinstance(listed, Sequence) and not isinstance(listed, (str, bytes)):
        kinds = sorted({type(s).__name__ for s in listed if not isinstance(s, torch.Tensor)})
        what = f"a {what} of {', '.join(kinds)}"
        if not kinds:
            devices = sorted({str(s.device) for s in listed if s.device.type != "cpu"})
            if not devices:
                return None
            what = (f"a tensor on {devices[0]}" if listed is not slots
                    else f"tensors on {', '.join(devices)}")
            return ValueError(_SLOTS_WANTED + what)
    return TypeError(_SLOTS_WANTED + what)


class CPUPinnedDoubleBufferReplayPipeline:
    """Double-buffered packed replay batch pipeline, the seed's interface.

    Args, as the seed's: ``replay_buffer`` (UniLab's ``ReplayBuffer`` or ours),
    ``device``, ``sample_count``, ``base_seed`` (tick t samples with seed
    ``base_seed + t``), ``trace_recorder`` (``add_slice``; ``add_cuda_pending_span``
    on CUDA when ``trace_cuda_events``), ``verbose`` / ``verbose_output_dir``, and the
    collector's ``collector_pack_request_queue``, ``collector_pack_ready_queue`` and
    ``collector_pack_shared_slots``. Ours, optional:
        liveness_timeout: seconds a copy may take once the learner found it pending
            (in a wait or a ``batch_ready`` poll), and the transfer worker one
            backend submit once the learner found it in there.
        stall_timeout: seconds a request may go with no ready dict and no row added
            to the buffer before the learner raises ``CollectorDied``; None: never.

    Raises:
        ValueError: UniLab's buffer without packed storage, a queue or the slots
            missing (the seed's messages), slots of the wrong shape or dtype or
            outside host memory, a bad timeout.
        TypeError: ``replay_buffer`` is neither kind of buffer, or the slots are not
            tensors.
    """

    def __init__(self, replay_buffer: Any, *, device: str | torch.device, sample_count: int,
                 base_seed: int = 0, trace_recorder: Any = None,
                 trace_cuda_events: bool = True, verbose: bool = False,
                 verbose_output_dir: str | None = None,
                 collector_pack_request_queue: Any = None,
                 collector_pack_ready_queue: Any = None,
                 collector_pack_shared_slots: torch.Tensor | Sequence[torch.Tensor] | None
                 = None, liveness_timeout: float = 5.0,
                 stall_timeout: float | None = 60.0) -> None:
        stall_timeout = as_seconds("stall_timeout", stall_timeout, none_ok=True)
        self._replay_buffer = replay_buffer
        self._device = torch.device(device)
        self._device_type = self._device.type
        self._sample_count = int(sample_count)
        self._base_seed = base_seed  # unconverted, as the seed kept it (it reaches the dicts)
        self._trace_recorder = trace_recorder
        seed_backend = SeedBackend.of(self._device)
        self._seed_backend = seed_backend
        self._trace_cuda_events = bool(trace_cuda_events) and seed_backend.supports_timing_events
        self._verbose = bool(verbose)
        self._verbose_output_dir = verbose_output_dir if self._verbose else None
        # The seed kept these rows for a learner-side packer; with a collector nothing
        # adds to them, so verbose writes no file unless a caller adds rows.
        self._verbose_pack_records: list[tuple[Any, ...]] | None = [] if self._verbose else None
        self._pack_layout, self._pack_executor = PACK_LAYOUT, PACK_EXECUTOR
        self._ring_depth = RING_DEPTH
        self._h2d_submitter = seed_backend.h2d_submitter
        self._device_family = seed_backend.device_family
        self._host_memory_kind = seed_backend.host_memory_kind
        self._supports_async_submit = seed_backend.supports_async_submit
        buffer = ReplayBufferView(replay_buffer)
        if (collector_pack_request_queue is None or collector_pack_ready_queue is None
                or collector_pack_shared_slots is None):
            raise ValueError("collector_thread pack executor requires collector pack IPC "
                             "queues and slots")
        refused = _not_host_slots(collector_pack_shared_slots)
        if refused is not None:
            raise refused
        if (isinstance(collector_pack_shared_slots, torch.Tensor)
                and collector_pack_shared_slots.dim() != 3):
            raise ValueError(
                f"collector_pack_shared_slots: one tensor of shape "
                f"{tuple(collector_pack_shared_slots.shape)}; the collector packs into "
                f"{RING_DEPTH} slots of (sample_count, width): a list of {RING_DEPTH} such "
                f"tensors, or one of shape ({RING_DEPTH}, sample_count, width)")
        self._collector_pack_request_queue = collector_pack_request_queue
        self._collector_pack_ready_queue = collector_pack_ready_queue
        self._collector_pack_shared_slots = collector_pack_shared_slots
        self._packed_width = buffer.width
        # The seed's learner-side buffers, empty with a collector packing.
        self._host_packed: list[torch.Tensor] = []
        self._host: list[dict[str, torch.Tensor]] = []
        self._gpu: list[dict[str, torch.Tensor]] = []
        # Invariant: _cold == 1 - _hot; _hot is the slot last handed out (0 before).
        self._hot, self._cold = 0, 1
        self._has_hot_batch = False
        self.last_incremental_h2d_time_s = 0.0
        self._close_called = False
        self._requests = 0  # request numbers handed out: the pipeline's ticks
        # Invariant: at most one request outstanding, as (tick id, request number).
        self._pending: tuple[int, int] | None = None
        self._hot_tick: int | None = None
        self._hot_batch: dict[str, torch.Tensor] = {}
        self._error: BaseException | None = None  # raised again by every later call
        self._clock_ns = time.perf_counter_ns() - time.monotonic_ns()  # spans -> slices

        self._link = SeedQueueLink(
            collector_pack_request_queue, collector_pack_ready_queue,
            collector_pack_shared_slots, buffer, base_seed=self._base_seed,
            sample_count=sample_count, stall_timeout=stall_timeout, on_request=self._requested)
        self._backend = build_backend_for(self._device, self._cuda_span_for)
        # The Pipeline reads ptr, size, width and layout of a buffer and checks for
        # gather: the view has them.
        self._pipe = Pipeline(buffer, device=self._device,
                              sample_count=self._sample_count, ring_depth=RING_DEPTH,
                              collector=self._link, backend=self._backend,
                              liveness_timeout=liveness_timeout,
                              stall_timeout=None)  # the link's stall_timeout decides
        self._pipe.add_observer(_Copies(self._copied))
        self._gpu_packed = [self._backend.device_slot(i) for i in range(RING_DEPTH)]

    # -- the seed's properties and attributes ----------------------------------

    @property
    def h2d_submitter(self) -> str:
        return self._h2d_submitter

    @property
    def transfer_manifest(self) -> dict[str, object]:
        return {
            "backend": self._seed_backend.name,
            "device": str(self._device),
            "device_family": self._device_family,
            "host_memory_kind": self._host_memory_kind,
            "host_pinned": self._host_pinned,
            "direct_pinned_shared": self._direct_pinned_shared,
            "supports_async_submit": self._supports_async_submit,
            "supports_timing_events": self._seed_backend.supports_timing_events,
            "h2d_submitter": self._h2d_submitter,
            "ring_depth": self._ring_depth,
        }

    @property
    def _host_pinned(self) -> bool:
        """Whether the collector's slots are page-locked now (CUDA, until close)."""
        return (self._seed_backend.registers_host_slots
                and isinstance(self._backend, CudaBackend) and self._backend.host_pinned)

    @property
    def _direct_pinned_shared(self) -> bool:
        return self._host_pinned

    @property
    def _closed(self) -> bool:
        """``close()`` was called, or a Ctrl-C in a learner call closed the pipeline
        underneath: either way the seed's answers after close apply."""
        return self._close_called or self._pipe.closed

    @_closed.setter
    def _closed(self, value: bool) -> None:  # the seed's attribute, written by some code
        self._close_called = value

    def _packed_h2d_source(self, slot: int) -> torch.Tensor:
        return self._collector_pack_shared_slots[slot]

    # -- ours ---------------------------------------------------------------------

    @property
    def pipeline(self) -> Pipeline:
        """The Pipeline underneath; its ticks are this class's request numbers."""
        return self._pipe

    def watch(self, process: Any, what: str = "the collector process") -> None:
        """Also raise ``CollectorDied`` once ``process`` dies (the compat class already
        watches the child processes that map the shared slots)."""
        self._pipe.watch(process, what)

    # -- the seed's methods -------------------------------------------------------

    def start_prepare(self, tick_id: int, sample_count: int,
                      min_snapshot_ptr: int | None = None) -> bool:
        """Request ``tick_id``: its collector packs it into the cold slot, then it is
        copied to the device. True when this call launched new work, False when
        ``tick_id`` is already requested and not yet sampled.

        Raises:
            ValueError: ``sample_count`` differs from the allocated one, or
                ``min_snapshot_ptr`` is 2**63 or more (requests travel as int64).
            RuntimeError: another tick is requested and not yet sampled, the pipeline
                is closed, or an earlier failure (raised again).
        """
        self._validate_sample_count(sample_count)
        if self._closed:
            raise errors.PipelineClosed(CLOSED)
        tick = int(tick_id)
        if self._pending is not None:
            self._refresh()  # an earlier failure first, as the seed
            if self._pending[0] == tick:
                return False
            raise errors.ProtocolError(
                "Cannot prepare a new replay batch before the previous batch is consumed")
        if min_snapshot_ptr is not None:
            # The seed took int() of it: a float (ptr + num_envs * 1.0) or a tensor
            # works as it did there; a negative one waits for no row, as 0 does.
            min_snapshot_ptr = max(int(min_snapshot_ptr), 0)
            if min_snapshot_ptr > MAX_SEED:  # the pipeline's refusal names its own tick
                raise ValueError(f"tick {tick}: min_snapshot_ptr must be < 2**63, got "
                                 f"{min_snapshot_ptr}")
        number = self._requests + 1
        self._link.label(number, tick)
        self._call(self._pipe.start_prepare, number, self._sample_count, min_snapshot_ptr)
        self._requests, self._pending = number, (tick, number)
        return True

    def batch_ready(self, tick_id: int, sample_count: int) -> bool:
        """Whether ``tick_id`` can be sampled now: it is the hot batch, or its copy
        is done while no batch is hot. Never blocks."""
        self._validate_sample_count(sample_count)
        if self._closed:  # its slots are gone: sample_large_batch would raise
            return False
        if self._has_hot_batch:
            return self._hot_tick == int(tick_id)
        pending = self._pending
        if pending is None or pending[0] != int(tick_id):
            self._refresh()
            return False
        return self._call(self._pipe.batch_ready, pending[1], self._sample_count)

    def wait_ready(self) -> None:
        return None

    def wait_until_ready(self, tick_id: int, sample_count: int,
                         timeout: float | None = None) -> bool:
        """Wait for the outstanding request, requesting ``tick_id`` first when none
        is. True once ready; False only when ``timeout`` (ours) runs out.

        Raises:
            CollectorDied: the collector died or stalled while this waited.
            RuntimeError: a ready batch of another tick, the pipeline is closed, or
                an earlier failure (raised again).
        """
        self._validate_sample_count(sample_count)
        if self._closed:
            raise errors.PipelineClosed(CLOSED)
        self._refresh()
        pending = self._pending
        if pending is None:
            self.start_prepare(tick_id, sample_count)
            pending = self._pending
            assert pending is not None
        elif pending[0] != int(tick_id) and self._call(self._pipe.batch_ready, pending[1],
                                                       self._sample_count):
            raise errors.ProtocolError(f"Prepared replay batch tick {pending[0]} does not "
                                       f"match requested tick {tick_id}")
        return self._call(self._pipe.wait_until_ready, pending[1], self._sample_count,
                          timeout)

    def sample_large_batch(self, tick_id: int, sample_count: int) -> dict[str, torch.Tensor]:
        """The batch of ``tick_id`` on the device, waiting for it (and requesting it
        when nothing is requested); it stays hot until ``after_tick()``.

        Raises:
            ValueError: ``sample_count`` differs from the allocated one.
            CollectorDied: the collector died or stalled while this waited.
            RuntimeError: another tick is hot or ready, the pipeline is closed, or an
                earlier failure (raised again).
        """
        self._validate_sample_count(sample_count)
        if self._closed:
            raise errors.PipelineClosed("Cannot sample a replay batch after pipeline.close()")
        if self._has_hot_batch:
            if self._hot_tick != int(tick_id):
                raise errors.ProtocolError(f"Hot batch tick {self._hot_tick} does not match "
                                           f"requested tick {tick_id}")
            return dict(self._hot_batch)
        if not self.batch_ready(tick_id, sample_count):
            self.wait_until_ready(tick_id, sample_count)
        pending = self._pending
        assert pending is not None  # wait_until_ready requests when nothing is pending
        if pending[0] != int(tick_id):
            raise errors.ProtocolError(f"Prepared replay batch tick {pending[0]} does not "
                                       f"match requested tick {tick_id}")
        slot = pending[1] % RING_DEPTH
        waited_ns = time.perf_counter_ns()
        batch = self._call(self._pipe.sample_large_batch, pending[1], self._sample_count)
        ready_ns = time.perf_counter_ns()
        # The batch is hot from here: record it before the trace slices, so that a
        # Ctrl-C in the recorder's add_slice leaves the class as the pipeline is.
        swap_ns = time.perf_counter_ns()
        old_hot, old_cold = self._hot, self._cold
        self._hot, self._cold = old_cold, old_hot  # slot == old_cold: requests alternate
        swapped_ns = time.perf_counter_ns()
        self._has_hot_batch, self._hot_tick, self._hot_batch = True, pending[0], batch
        self._pending = None
        where = {"tick_id": tick_id, "batch_gpu_slot": slot}
        self._slice("replay_pipeline/batch_h2d_wait", waited_ns, ready_ns, where)
        self._slice("replay_pipeline/gpu_wait_for_batch", waited_ns, ready_ns, dict(where))
        self._slice("replay_pipeline/hot_cold_swap", swap_ns, swapped_ns, {
            "tick_id": tick_id, "old_hot": old_hot, "old_cold": old_cold,
            "new_hot": self._hot, "new_cold": self._cold})
        return dict(batch)

    def after_tick(self) -> None:
        """Release the hot batch; its slot can be packed again. Never raises."""
        if self._has_hot_batch and not self._closed and self._error is None:
            try:
                self._pipe.after_tick()
            except errors.PipelineFailed:
                pass  # as the seed's after_tick, this one never raises; the next call does
        self._has_hot_batch, self._hot_tick, self._hot_batch = False, None, {}

    def close(self) -> None:
        """Stop the transfer worker, drain copies, unpin the slots. Idempotent."""
        self._close_called = True
        self._pipe.close()
        records = self._verbose_pack_records
        if self._verbose and self._verbose_output_dir and records:
            try:
                out = os.path.join(self._verbose_output_dir, "verbose")
                os.makedirs(out, exist_ok=True)
                with replacing(os.path.join(out, "pack_fields.csv"), newline="") as f:
                    writer = csv.writer(f)
                    writer.writerow(["tick_id", "slot", "field", "rows", "cols", "bytes",
                                     "dur_ns"])
                    writer.writerows(records)
            except OSError:
                pass
        for kept in (self._host, self._gpu, self._host_packed, self._gpu_packed):
            kept.clear()

    # -- internals ----------------------------------------------------------------

    def _validate_sample_count(self, sample_count: int) -> None:
        if int(sample_count) != self._sample_count:
            raise ValueError("sample_count must match the value used to allocate the "
                             "double buffer")

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the pipeline; a failure comes out as the seed's error."""
        if self._error is not None:
            raise self._error
        try:
            return fn(*args)
        except errors.PipelineFailed as exc:
            error = self._seed_error(exc)
        self._error = error
        raise error

    def _refresh(self) -> None:
        """Raise the pipeline's failure, if any, as the seed's error."""
        # Request number 0 is never made: this asks only whether the pipeline failed.
        self._call(self._pipe.batch_ready, 0, self._sample_count)

    def _seed_error(self, exc: errors.PipelineFailed) -> BaseException:
        failure = exc.__cause__ if exc.__cause__ is not None else exc
        # Our own verdicts name the pipeline's tick, a request number.
        numbered = re.match(r"tick (\d+): (.*)", str(failure), re.S)
        tick = None if numbered is None else self._link.tick_id(int(numbered[1]))
        message = None if numbered is None or tick is None else f"tick {tick}: {numbered[2]}"
        return as_seed_error(failure, message)

    def _slice(self, name: str, start_ns: int, end_ns: int, args: dict[str, Any]) -> None:
        recorder = self._trace_recorder
        if recorder is not None:
            recorder.add_slice(name, category="replay_pipeline", start_ns=start_ns,
                               end_ns=end_ns, args=args)

    def _requested(self, request: dict[str, Any]) -> None:
        """The link is about to put ``request`` on the queue."""
        now = time.perf_counter_ns()
        self._slice("replay_pipeline/collector_pack_request", now, time.perf_counter_ns(),
                    request)

    def _h2d_bytes(self) -> int:
        source = self._packed_h2d_source(0)
        return int(source.numel() * source.element_size())

    def _copied(self, slot: int, start_ns: int, end_ns: int) -> None:
        """Transfer side, under the pipeline's lock: a copy into ``slot`` finished."""
        self.last_incremental_h2d_time_s = (end_ns - start_ns) / 1e9
        ready = self._link.readies[slot]
        if self._trace_recorder is None or ready is None:
            return
        pinned = self._host_pinned
        self._slice("replay_pipeline/batch_h2d_submit", start_ns + self._clock_ns,
                    end_ns + self._clock_ns, {
                        "tick_id": ready.tick_id, "batch_gpu_slot": slot,
                        "shared_slot": ready.shared_slot, "pack_layout": self._pack_layout,
                        "pack_executor": self._pack_executor,
                        "h2d_submitter": self._h2d_submitter,
                        "h2d_bytes": self._h2d_bytes(), "h2d_submitted": True,
                        "pinned_memory": pinned, "direct_pinned_shared": pinned,
                        "device_family": self._device_family,
                        "host_memory_kind": self._host_memory_kind,
                        "supports_async_submit": self._supports_async_submit,
                        "supports_timing_events": self._seed_backend.supports_timing_events,
                        "ring_depth": self._ring_depth, "transfer_worker_submit": True})

    def _cuda_span_for(self, slot: int) -> tuple[Any, dict[str, object]] | None:
        """The recorder and args of the seed's CUDA span for a copy into ``slot``."""
        recorder, ready = self._trace_recorder, self._link.readies[slot]
        if recorder is None or not self._trace_cuda_events or ready is None:
            return None
        pinned = self._host_pinned
        return recorder, {
            "slot": slot, "h2d_bytes": self._h2d_bytes(), "pinned_memory": pinned,
            "pack_layout": self._pack_layout, "pack_executor": self._pack_executor,
            "h2d_submitter": self._h2d_submitter, "direct_pinned_shared": pinned,
            "tick_id": ready.tick_id, "snapshot_ptr": ready.snapshot_ptr,
            "snapshot_size": ready.snapshot_size, "sample_seed": ready.sample_seed,
            "sample_count": ready.sample_count, "batch_host_slot": ready.shared_slot,
            "batch_gpu_slot": ready.target_gpu_slot}
