"""The runtime pipeline: the learner API over the core, driven by real threads,
memory and devices.

One lock (a Condition) serialises every core step. ``Pipeline`` keeps the learner
API and the waits; it delegates the rest: the collector link launches, stops and
vouches for the packer; the transfer worker turns pack-done messages into copy
orders; the backend copies; the watchdog ends any wait the other side can no
longer finish (INV-LIVE); statistics and traces observe transitions and spans.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Iterator, Mapping
from types import FrameType
from typing import Any, NoReturn

import torch

from ..core import (
    Core,
    Step,
    as_count,
    as_int,
    as_seconds,
    as_tick,
    require_asserts,
    seconds_of,
)
from ..data.buffer import ReplayBuffer, ReplaySource
from ..data.channel import ChannelClosed
from ..data.packer import PackerHandle
from ..errors import (
    CollectorDied,
    PackerError,
    PipelineClosed,
    PipelineFailed,
    ProtocolError,
    ReplayFSMError,
    TransferFailed,
)
from ..looks import LookClock
from ..signals import DEFERRED, WAIT_STOPS, raise_deferred, raise_wait_stop, step
from ..spec import AVAILABLE, Actor, Event, SlotState
from ..transfer import build_backend
from ..transfer.base import TransferBackend
from ..wire import CopyOrder, PackDone, PackRequest, TransitionRecord
from .checked import Checker
from .links import WAIT_SLICE_S, ChannelLink, CollectorLink, make_link
from .liveness import RowWatch, Watchdog
from .observers import Observer, Statistics, StatisticsObserver
from .tracer import Tracer
from .worker import TransferWorker

# close() waits at most about this long for each side to stop on its own, then forces.
STOP_TIMEOUT_S = 4.0

# Pipelines started and not closed, stopped at the interpreter's exit: a daemon packer
# thread still inside a torch call while the interpreter finalises aborts the process
# (SIGABRT, "terminate called without an active exception"). Registered after
# multiprocessing's exit hook, so it runs first: packer processes leave on their own.
_OPEN: weakref.WeakSet[Pipeline] = weakref.WeakSet()


@atexit.register
def _stop_open_pipelines() -> None:
    """Stop every pipeline left open, each within its bounded stops (a Ctrl-C in one
    does not spare the others; the first is raised at the end). Their waits for a
    close on another thread share one STOP_TIMEOUT_S: closes stuck in a backend's
    drain made an exit wait that long once per pipeline. What a hook raised on the
    way (a backend's ``stop_at_exit``, say) is reported as a RuntimeWarning once
    every pipeline is stopped, not dropped; a warnings filter that makes it an error
    raises it then (Python prints it as an exception ignored in an exit callback),
    after a Ctrl-C's, never instead of one."""
    interrupted: BaseException | None = None
    failures: list[str] = []
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for pipe in list(_OPEN):
        try:
            failures += pipe._stop_at_exit(deadline)
        except Exception as exc:  # noqa: BLE001 - the process is ending: what can stop, stops
            failures.append(f"its stop raised {type(exc).__name__}: {exc}")
        except BaseException as exc:  # noqa: BLE001 - raised once every pipeline stopped
            interrupted = interrupted or exc
    refused: Exception | None = None  # a warning a filter turned into an error
    for failure in failures:
        try:
            warnings.warn(f"replay_fsm: a Pipeline left open, stopped at the interpreter's "
                          f"exit: {failure}", RuntimeWarning, stacklevel=1)
        except Exception as exc:  # noqa: BLE001 - the other reports, and a Ctrl-C, first
            refused = refused or exc
    if interrupted is not None:
        raise interrupted
    if refused is not None:
        raise refused


def _seen_for(first_seen: list[int | None], slot: int, now: int) -> float:
    """Seconds from ``first_seen[slot]`` (ns) to ``now``; a first sighting records
    ``now``. The per-slot clocks of the watchdog's verdicts (``_owed_ns``, ``_late_ns``)
    run over every wait and poll this way."""
    since = first_seen[slot]
    if since is None:
        since = first_seen[slot] = now
    return (now - since) / 1e9


def _completed_slot(slot: object) -> int:
    """What a backend passed ``on_complete`` as the slot of a copy it completed: an int
    or a numpy integer, never a bool (True would complete slot 1): ``core.as_int``.

    Raises:
        TypeError: anything else, named as the backend's wrong call.
    """
    try:
        return as_int("slot", slot)
    except TypeError:
        pass  # named below as the backend's call, not as an argument
    raise TypeError(f"the backend called on_complete with {slot!r} of type "
                    f"{type(slot).__name__}; it takes the slot of the copy it completed, "
                    "the int order.slot")


def _overrides(backend: TransferBackend, hook: str) -> bool:
    """Whether ``backend``'s ``hook`` is other than the base's no-op: its class's
    own, or one set on the instance before the pipeline was built."""
    return (getattr(type(backend), hook) is not getattr(TransferBackend, hook)
            or hook in getattr(backend, "__dict__", ()))


def _shapes_text(shapes: list[tuple[int, ...]]) -> str:
    """``shapes`` as an error names them: more than four of one shape (one tensor of rows
    iterated as slots) once, with their count."""
    if len(shapes) > 4 and len(set(shapes)) == 1:
        return f"{len(shapes)} of {shapes[0]}"
    return str(shapes)


class Pipeline:
    """Packs and copies tick t+1.. while the learner trains on tick t.

    Args:
        replay_buffer: the shared ReplayBuffer to sample from (any ``ReplaySource``
            with a ``CollectorLink`` of your own, as ``replay_fsm.compat`` does).
        device: the learner's device ("cpu", "cuda", "cuda:1", "mps", ...). None: the
            device of a ``backend`` instance, else "cpu". Given with an instance, it
            must be the instance's device (ValueError naming both otherwise: the
            instance copies to its own device, whatever ``device`` says), and with a
            backend by name, the device it copies to ("emulated" and "manual": the
            CPU).
        sample_count: rows per batch; every call must pass the same value.
        base_seed: tick t samples with seed ``base_seed + t`` (INV-DATA).
        ring_depth: slots in the ring (2 to 64); up to ring_depth - 1 ticks prefetch.
        collector: "thread" (a packer thread here), "process" (a spawned packer-only
            process), "external" (your collector calls ``Packer.attach``), or a
            ``CollectorLink`` instance (the seed's queues: ``replay_fsm.compat``).
        backend: a registered backend name ("cpu", "cuda", "accel", "emulated",
            "manual", or one you registered) or a ``TransferBackend`` instance; by
            default the one ``device`` calls for. ``backend_options`` go to the
            constructor of a backend built by name.
        liveness_timeout: seconds a wait may go without the other side showing life
            (a packer heartbeat, a copy completing) before the learner raises. A copy
            counts from when the learner first found it pending (a wait or a poll), and
            so does a transfer worker inside one message's submit, which holds back
            the pack-done messages behind it. An
            external collector's silence counts only once the request's rows are there
            (from when the learner saw them, the request at the earliest): it must
            call ``Packer.service`` more often than this.
        attach_timeout: seconds from the first request within which the packer must
            attach: an external collector's ``Packer.attach``, the spawned packer
            process's start (collector="process"; one stopped or blocked in its start,
            say in code of ``__main__`` it re-imports, never beats).
        stall_timeout: seconds a wait for a tick whose rows are not there yet
            (``min_snapshot_ptr``) may go with no row added to the replay buffer
            before the learner raises ``DataStalled``: whatever writes the rows
            stopped. None waits for rows for ever.
        stall_timeout_name: what the ``DataStalled`` message calls that bound. A
            layer that sets ``stall_timeout`` from a setting of its own (the SAC
            trainer's and the demo's ``liveness_timeout``) names that one, so its user
            is told what to change, and the pipeline knows nothing of that layer.
        min_snapshot_ptr_name: what the ``DataStalled`` message calls the rows a
            request waits for; likewise a layer that sets ``min_snapshot_ptr`` from
            settings of its own (the SAC trainer's warm-up, ``warmup_steps``) names
            them.
        checked: record reader and writer intervals per slot and raise on any
            overlap the invariants forbid; poison released device slots with NaN.
        trace: record transitions and spans (see ``tracer``) for Perfetto export.
        trace_capacity: events the trace keeps (the oldest drop first; a transition
            log that lost its start cannot be checked).
        packer_threads: torch threads of the spawned packer process
            (collector="process"), 1 by default: a gather whose thread team spans
            the learner's cores waits on them (on 2 cores, torch's default made the
            mean tick 4 to 14 % longer than 1 thread). None leaves torch's default.
        learner_packs: when ``sample_large_batch`` (or ``wait_until_ready`` without
            a timeout) waits for the oldest requested tick and the packer has not
            started it, gather it on the learner's thread instead of waiting
            (specs/LEARNER_PACKS.md; for a request an external collector that died
            had read: any wait or poll for it, oldest or not). False leaves every
            pack to the collector, for a learner that must leave its core to it.
            Collectors reached through a packer handle only (thread, process,
            external).

    Raises:
        ValueError: a bad argument (unknown device, backend, collector, ring depth,
            count, timeout), or a ``device`` other than the one the backend, an
            instance or one built by name, copies to.
        TypeError: an argument of the wrong type (a replay buffer without
            ``ReplayBuffer``'s interface, a flag that is not a bool, a count that is
            not an int, a collector that is neither a name nor a ``CollectorLink``, a
            collector name for a source that needs one, ``backend_options`` not a
            mapping, a ``stall_timeout_name`` or ``min_snapshot_ptr_name`` that is not
            a non-empty str).
    """

    def __init__(self, replay_buffer: ReplaySource, *,
                 device: str | torch.device | None = None,
                 sample_count: int, base_seed: int = 0, ring_depth: int = 2,
                 collector: str | CollectorLink = "thread",
                 backend: str | TransferBackend | None = None,
                 backend_options: dict[str, Any] | None = None,
                 liveness_timeout: float = 5.0, attach_timeout: float = 60.0,
                 stall_timeout: float | None = 60.0,
                 stall_timeout_name: str = "stall_timeout",
                 min_snapshot_ptr_name: str = "min_snapshot_ptr", checked: bool = False,
                 trace: bool = False, trace_capacity: int = 1 << 16,
                 packer_threads: int | None = 1, learner_packs: bool = True) -> None:
        sample_count = as_count("sample_count", sample_count, 1)
        as_seconds("liveness_timeout", liveness_timeout)
        as_seconds("attach_timeout", attach_timeout)
        as_seconds("stall_timeout", stall_timeout, none_ok=True)
        for name, text in (("stall_timeout_name", stall_timeout_name),
                           ("min_snapshot_ptr_name", min_snapshot_ptr_name)):
            if not isinstance(text, str) or not text:
                raise TypeError(f"{name} must be a non-empty str, got {text!r}")
        missing = [a for a in ("layout", "width", "ptr", "size", "gather")
                   if not hasattr(replay_buffer, a)]
        if missing:
            raise TypeError(f"replay_buffer must be a replay_fsm.ReplayBuffer (or offer "
                            f"its interface); {type(replay_buffer).__name__} lacks "
                            f"{', '.join(missing)}")
        as_count("trace_capacity", trace_capacity, 1)
        if packer_threads is not None:
            as_count("packer_threads", packer_threads, 1)
        for name, flag in (("learner_packs", learner_packs), ("checked", checked),
                           ("trace", trace)):
            if not isinstance(flag, bool):  # "no" would turn it on
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        if not isinstance(collector, (str, CollectorLink)):
            raise TypeError(f"collector must be 'thread', 'process', 'external' or a "
                            f"CollectorLink, got {type(collector).__name__}")
        if backend_options is not None and not isinstance(backend_options, Mapping):
            raise TypeError(f"backend_options must be a mapping of keyword arguments, "
                            f"got {type(backend_options).__name__}")
        self.learner_packs = learner_packs
        self.replay_buffer = replay_buffer
        self.sample_count = int(sample_count)
        self.liveness_timeout = float(liveness_timeout)
        self.stall_timeout = None if stall_timeout is None else float(stall_timeout)
        self.stall_timeout_name = stall_timeout_name
        self.min_snapshot_ptr_name = min_snapshot_ptr_name
        # One lock serialises every step; the condition waits on it. ``with
        # self._lock`` enters it in C, where ``with self._cv`` adds a Python frame.
        self._lock = threading.RLock()
        self._observing: int | None = None  # the thread running the observers, if any
        self._cv = threading.Condition(self._lock)
        # One close at a time: a second (another thread's) waits for the first to
        # finish, then returns; the link's, worker's and backend's stops and closes
        # are not safe from two threads at once. Not the step lock: the learner
        # needs that while close joins the other sides.
        self._close_lock = threading.RLock()
        self._closed = False
        # The thread packing a batch itself (learner_packs), the lock let go: close
        # waits for it, as for the packer (INV-CLOSE: no pack in flight after close).
        self._taker: int | None = None
        self._pid = os.getpid()  # the process whose threads and packer these are
        self._stopped = False  # close() finished: link, worker and backend stopped
        # What an observer raised at close, raised by the close that finishes (a
        # Ctrl-C may cut the first one short after the core closed)
        self._close_error: BaseException | None = None
        # What close() had to force (a process killed, a thread left behind).
        self.forced: list[str] = []
        self._core = Core(ring_depth, base_seed=base_seed, sample_count=self.sample_count,
                          observer=self._observe)
        self.ring_depth = self._core.ring_depth
        self.base_seed = self._core.base_seed
        self._stats = StatisticsObserver(self.ring_depth)
        # A tuple, replaced on change: observers run on every step, never copied.
        self._stats_alone: tuple[Observer, ...] = (self._stats,)
        self._observers: tuple[Observer, ...] = self._stats_alone
        self.tracer: Tracer | None = None
        if trace:
            self.tracer = Tracer(trace_capacity)
            self._observers += (self.tracer,)

        self.backend: TransferBackend = build_backend(device, backend,
                                                      **(backend_options or {}))
        self.device = self.backend.device
        self.collector = collector if isinstance(collector, str) else collector.kind
        if isinstance(collector, CollectorLink):
            self._link: CollectorLink = collector
        elif isinstance(replay_buffer, ReplayBuffer):
            self._link = make_link(collector, replay_buffer, self.ring_depth,
                                   self.sample_count, packer_threads=packer_threads,
                                   attach_timeout=float(attach_timeout),
                                   writer_patience=self.liveness_timeout)
        else:
            raise TypeError(f"collector={collector!r} packs with a replay_fsm.ReplayBuffer; "
                            f"a {type(replay_buffer).__name__} needs a CollectorLink of its "
                            "own")
        if isinstance(self._link, ChannelLink):
            self._link.learner_packs = learner_packs
        host_slots = self._link.host_slots
        shapes = [tuple(s.shape) for s in host_slots]
        expected = (self.sample_count, replay_buffer.width)
        if shapes != [expected] * self.ring_depth:
            raise ValueError(f"host slots have shapes {_shapes_text(shapes)}, expected "
                             f"{self.ring_depth} of {expected}")
        # The rows' dtype (a source without ``storage``: one dtype for every slot).
        dtype = getattr(replay_buffer, "storage", host_slots[0]).dtype
        if any(s.dtype != dtype for s in host_slots):
            raise ValueError(f"host slots have dtypes {[str(s.dtype) for s in host_slots]}, "
                             f"expected {self.ring_depth} of {dtype} (the replay buffer's "
                             "rows)")
        self.host_slots = host_slots
        self._slot_bytes = int(host_slots[0].numel() * host_slots[0].element_size())
        # Only a backend that overrides pump needs the learner thread (and the lock
        # released around it) while the learner waits.
        self._pumps = _overrides(self.backend, "pump")
        # Likewise the read hooks, called at every acquire and release: the base's do
        # nothing (the CPU backend's reads need no fence).
        self._fences_reads = _overrides(self.backend, "before_read")
        self._ends_reads = _overrides(self.backend, "after_read")
        # Per slot: the request the learner may still pack itself (learner_packs), the
        # rows its tick waits for (min_snapshot_ptr), the pack-done message of the
        # tick it holds, and when its copy began.
        self._requests: list[PackRequest | None] = [None] * self.ring_depth
        self._rows_needed = [0] * self.ring_depth
        # The clocks of the verdicts' stretches: a stretch that no look saw (a long
        # step, the whole job stopped and resumed) counts for at most half the bound
        # (``looks.LookClock``): liveness_timeout for those below and the watchdog's,
        # stall_timeout for RowWatch's (each its own: a stall_timeout shorter than a
        # wait's slice would slow the other down, helper-86).
        self._looks = LookClock(self.liveness_timeout / 2)
        self._row_looks = LookClock((self.stall_timeout or self.liveness_timeout) / 2)
        # Since when (the looks' ns) the learner has seen the rows of the slot's request
        # there: for a link whose collector does not beat while rows come, its silence
        # counts from then (never earlier than the request); None while they are missing.
        self._owed_ns: list[int | None] = [None] * self.ring_depth
        # Since when (the looks' ns) the learner has seen the slot's copy pending
        # (SUBMITTED), in a wait or a poll: the copy's bound counts from then, over every
        # wait and poll; None until the learner first finds it pending.
        self._late_ns: list[int | None] = [None] * self.ring_depth
        self._packs: list[PackDone | None] = [None] * self.ring_depth
        self._copy_submit_ns = [0] * self.ring_depth
        self._checker: Checker | None = None
        if checked:
            self._checker = Checker(self.ring_depth, state_of=self._core.state,
                                    fail=self.fail, device_slot=self.backend.device_slot,
                                    reads_pending=self.backend.reads_pending)
            self.backend.watch_copies(self._checker)
        self._worker = TransferWorker(self._link.receive, self._on_pack_done,
                                      self.backend.submit, self._on_transfer_error)
        self._watchdog = Watchdog(self.liveness_timeout, self._link, self.backend,
                                  self._worker.is_alive, self._worker.busy_since_ns)
        if self.backend.submit_on_learner:
            # A batch the learner packs to its end is submitted on the learner's
            # thread at once, with no wait for the transfer worker's thread to wake.
            self._link.deliver_here(self._worker.handle)
        try:
            _OPEN.add(self)  # first: a Ctrl-C in it, too, is cleaned up below
            # Inside the clean-up's reach: a setup that fails part way (CUDA: the host
            # slots page-locked, then out of memory for the device slots), or a Ctrl-C
            # after it, closes the backend (close() does) instead of leaving what it
            # took (registered host memory, a copy-engine thread) behind.
            self.backend.trace(trace)
            self.backend.setup(host_slots, self._on_copy_complete, self._on_backend_error)
            # G[i], read once, checked, as the views are: a release marks its reads
            # over on it.
            self._device_slots = [self._device_slot(i) for i in range(self.ring_depth)]
            self._views = [replay_buffer.layout.views(g) for g in self._device_slots]
            self._worker.start()
            self._link.start(self._on_packer_error)
        except BaseException:
            # Nothing left running behind a constructor that raised (a packer that
            # could not start, a Ctrl-C): what did start stops here.
            with contextlib.suppress(Exception):
                self.close()
            raise

    def _device_slot(self, slot: int) -> torch.Tensor:
        """G[slot] as the backend's setup left it, checked: a tensor shaped like the
        host slot. A backend's ``allocate`` (or ``device_slot``) of its own that gives
        something else is named, not met as the TypeError of the first view of it
        ("'NoneType' object is not subscriptable").

        Raises:
            TypeError: not a tensor, or ``device_slot`` raised (chained).
            ValueError: a tensor of another shape.
        """
        kind = type(self.backend).__name__
        if type(self.backend).device_slot is TransferBackend.device_slot:  # allocate's
            slots = getattr(self.backend, "device_slots", None)
            try:
                count: int | None = len(slots)  # type: ignore[arg-type]
            except TypeError:
                count = None
            if count is None:
                raise TypeError(f"{kind}.allocate returned {slots!r:.80} of type "
                                f"{type(slots).__name__}: it returns one tensor per host "
                                "slot, shaped like it (a list, or one tensor of them)")
            if count < len(self.host_slots):
                raise ValueError(f"{kind}.allocate returned {count} device slots for "
                                 f"{len(self.host_slots)} host slots: it returns one "
                                 "tensor per host slot, shaped like it")
        try:
            got = self.backend.device_slot(slot)
        except Exception as exc:
            raise TypeError(f"{kind}.device_slot({slot}) raised {type(exc).__name__}: "
                            f"{exc}; its allocate returns one tensor per host slot") from exc
        if not isinstance(got, torch.Tensor):
            raise TypeError(f"{kind}'s device slot {slot} is {got!r:.80} of type "
                            f"{type(got).__name__}, not a tensor: its allocate returns one "
                            "tensor per host slot, shaped like it")
        expected = tuple(self.host_slots[slot].shape)
        shape = tuple(got.shape)
        # Wider rows are a backend's padding (its submit copies into the first
        # columns, and the batch's views read only those).
        if len(shape) != len(expected) or shape[0] != expected[0] or any(
                g < e for g, e in zip(shape[1:], expected[1:], strict=True)):
            raise ValueError(f"{kind}'s device slot {slot} has shape {shape}, not its "
                             f"host slot's {expected}: its allocate returns one tensor "
                             "per host slot, shaped like it (as many rows; at least as "
                             "many columns)")
        return got

    # -- collector side -------------------------------------------------------

    def packer_handle(self) -> PackerHandle:
        """The handle for ``Packer.attach(handle, rb)`` in your collector: pass it, with
        ``rb``, as an argument of the collector's ``Process`` (its semaphores travel by
        inheritance only, not through a queue or ``pickle.dumps``).

        Raises:
            ValueError: this pipeline's collector is not reached through a handle
                (the seed's queues).
            PipelineClosed: the pipeline is closed (as every call after ``close()``).
            PipelineFailed: the pipeline failed before it was closed (INV-STICKY, as
                every learner call then).
        """
        with self._lock:  # close stops the link only once it marked itself closed
            if self._closed:
                if self._core.failure is not None:
                    self._raise_if_unusable()  # its PipelineFailed, chained
                raise PipelineClosed("the pipeline is closed; its packer handle is gone")
            if not isinstance(self._link, ChannelLink):
                raise ValueError(f"this pipeline's collector ({self._link.kind}) has no "
                                 "packer handle")
            return self._link.handle

    def watch(self, process: Any, what: str = "the collector process") -> None:
        """Fail fast with CollectorDied when ``process`` dies: a
        ``multiprocessing.Process``, or anything with ``is_alive()``, ``pid`` and
        ``exitcode`` (the error names them: "``what`` (pid P) exited with code C"). A
        watched collector still running when the pipeline closes, not attached yet,
        can still open the handle's semaphores: the pipeline keeps them until it goes,
        and the collector attaches and leaves.

        Raises:
            TypeError: ``process`` lacks ``is_alive()``, ``pid`` or ``exitcode``.
            ValueError: ``process`` is a ``multiprocessing.Process`` already closed
                (``Process.close()``: it ended, and its attributes are gone).
        """
        try:
            missing = [a for a in ("is_alive", "pid", "exitcode") if not hasattr(process, a)]
        except ValueError as exc:  # a closed Process's attributes raise it
            raise ValueError(f"watch takes a process that is not closed: {exc}") from exc
        if missing or not callable(process.is_alive):
            raise TypeError(f"watch takes a process: a multiprocessing.Process, or anything "
                            f"with is_alive(), pid and exitcode; {type(process).__name__} "
                            f"lacks {', '.join(missing or ['a callable is_alive'])}")
        with self._lock:
            self._link.watch(process, what)

    @property
    def collector_process(self) -> Any:
        """The spawned packer process (collector="process"), else None."""
        return getattr(self._link, "process", None)

    # -- learner API ----------------------------------------------------------

    def start_prepare(self, tick_id: int, sample_count: int,
                      min_snapshot_ptr: int | None = None) -> bool:
        """Request ``tick_id``: pack and copy it into its slot in ring order.

        ``min_snapshot_ptr`` (default: the buffer's ptr now) makes the packer wait
        until that many rows were ever written; a wait for the tick raises
        ``DataStalled`` once no row came for ``stall_timeout`` (None: never). Returns
        False when the tick is already requested or hot, True when this call started
        new work.

        Raises:
            ValueError, TypeError: ``sample_count`` differs from the allocated one, or
                a bad tick or ``min_snapshot_ptr``.
            IllegalTransition: out of order, or the ring is full.
            PipelineFailed, PipelineClosed.
        """
        # The common cases of _validate and as_tick inline: one of the learner's
        # three calls a tick, and each Python call costs most with cold caches.
        if type(sample_count) is not int or sample_count != self.sample_count:
            self._validate(sample_count)
        if type(tick_id) is not int or tick_id < 0:
            tick_id = as_tick(tick_id)
        if min_snapshot_ptr is not None:
            min_snapshot_ptr = as_count("min_snapshot_ptr", min_snapshot_ptr)
        return self._call("start_prepare", self._request, tick_id, min_snapshot_ptr)

    @step
    def _request(self, tick_id: int, min_snapshot_ptr: int | None) -> bool:
        with self._lock:
            self._raise_if_unusable()
            if self._core.slot_of(tick_id) is not None:
                return False
            ptr = self.replay_buffer.ptr
            request = self._core.request(
                tick_id, ptr if min_snapshot_ptr is None else min_snapshot_ptr)
            self._rows_needed[request.slot] = request.min_snapshot_ptr
            self._owed_ns[request.slot] = (self._looks.at(time.monotonic_ns())
                                           if ptr >= request.min_snapshot_ptr else None)
            self._late_ns[request.slot] = None
            if self.learner_packs:
                self._requests[request.slot] = request
            hot = self._core.hot_slot
            try:
                self._link.send(request, snapshot=(ptr, self.replay_buffer.size),
                                hot_slot=-1 if hot is None else hot)
            except ChannelClosed as exc:
                self._fail_locked(CollectorDied(f"tick {tick_id}: the packer's channel is "
                                                "closed"), exc)
                self._raise_if_unusable()
            except Exception as exc:  # the request is lost: the slot can never fill
                self._fail_locked(exc)
                self._raise_if_unusable()
            return True

    def batch_ready(self, tick_id: int, sample_count: int) -> bool:
        """Whether ``tick_id`` can be sampled without waiting (False for a tick not
        requested: unlike a wait, a poll does not raise for it). Never waits for
        another actor; one exception packs on the calling thread: a requested tick
        read by an external collector process gone since, which nobody else can
        pack (``specs/LEARNER_PACKS.md``: a whole batch's gather, held up to
        ``liveness_timeout`` by a writer stopped inside an add). When it
        cannot, the watchdog is asked, as by every slice of a wait: a learner that
        only polls learns of a dead collector or copy engine too. Rows that stopped
        coming (``min_snapshot_ptr``) are judged by a wait, from its own start, never
        by a poll: ``DataStalled`` comes from ``wait_until_ready`` or the sample.

        Raises:
            ValueError, TypeError: ``sample_count`` differs from the allocated one, or
                a bad tick.
            CollectorDied, TransferFailed: the other side is gone (as a wait raises).
            PipelineFailed, PipelineClosed: as every learner call.
        """
        self._validate(sample_count)
        return self._call(None, self._ready, as_tick(tick_id))

    @step
    def _ready(self, tick_id: int) -> bool:
        with self._lock:
            self._pump_locked()
            self._raise_if_unusable()
            slot = self._core.slot_of(tick_id)
            if slot is None:
                return False
            state = self._core.state(slot)
            if state in AVAILABLE:
                return True
            if state is SlotState.REQUESTED and self._orphaned(slot):
                # Read by a collector process gone since: nobody but the learner packs
                # it, so a learner that only polls packs it too (or waits for ever).
                self._take_locked(tick_id, slot)
                self._raise_if_unusable()
                state = self._core.state(slot)
                if state in AVAILABLE:
                    return True
            # Not ready: a learner that only polls learns of a dead collector too.
            self._judge_locked(tick_id, slot, state, time.monotonic_ns(), None)
            return False

    def wait_until_ready(self, tick_id: int, sample_count: int,
                         timeout: float | None = None) -> bool:
        """Wait until ``tick_id`` is READY (or HOT); False if ``timeout`` ran out.

        Even without a timeout the wait ends: a dead collector or copy engine
        raises within ``liveness_timeout``, and a wait for rows that stopped coming
        (``min_snapshot_ptr``) within ``stall_timeout``; both apply with a timeout
        too. Each wait watches the rows from its own start, so a loop of waits
        shorter than ``stall_timeout`` bounds itself.

        Raises:
            ValueError, TypeError: ``sample_count`` differs from the allocated one, a
                bad tick, or a ``timeout`` that is not None or a finite number of
                seconds >= 0 (ValueError).
            ProtocolError: the tick was never requested.
            CollectorDied, DataStalled, TransferFailed, PipelineFailed, PipelineClosed.
        """
        self._validate(sample_count)
        if timeout is not None:
            seconds = seconds_of(timeout)
            if not 0 <= seconds < float("inf"):
                raise ValueError(f"timeout must be None or a finite number of seconds >= "
                                 f"0, got {timeout!r}")
            timeout = seconds
        deadline = None if timeout is None else time.monotonic() + timeout
        return self._call("wait_until_ready", self._wait, as_tick(tick_id), deadline)

    def sample_large_batch(self, tick_id: int, sample_count: int) -> dict[str, torch.Tensor]:
        """The batch of ``tick_id``, waiting for it if needed; the slot becomes HOT.

        The tensors view the device slot and stay valid until ``after_tick()``.

        Raises:
            ProtocolError: the tick was never requested, or another tick is hot.
            ValueError, TypeError: ``sample_count`` differs from the allocated one, or
                a bad tick.
            CollectorDied, DataStalled, TransferFailed, PipelineFailed, PipelineClosed.
        """
        if type(sample_count) is not int or sample_count != self.sample_count:
            self._validate(sample_count)  # as start_prepare: the common cases inline
        if type(tick_id) is not int or tick_id < 0:
            tick_id = as_tick(tick_id)
        return self._call("sample_large_batch", self._acquire, tick_id)

    def after_tick(self) -> None:
        """Release the hot batch (no-op when none is hot); its slot can be reused.

        Raises:
            PipelineFailed, PipelineClosed: as every learner call.
        """
        self._call("after_tick", self._release)

    @step
    def _release(self) -> None:
        with self._lock:
            self._raise_if_unusable()
            slot = self._core.hot_slot
            if slot is None:
                return
            if self._checker is not None:
                self._checker.released(slot)
            if self._ends_reads:
                try:
                    self.backend.after_read(slot)  # the end of this HOT period's reads
                except Exception as exc:  # noqa: BLE001 - else the tick stayed HOT for ever
                    self._hook_failed("after_read", exc)
            # A graph that saved the batch's views must fail autograd's in-place check
            # from here on, whoever refills the slot: a packer process's writes (into a
            # zero-copy CPU slot) are not counted in this process.
            torch.autograd.graph.increment_version(self._device_slots[slot])
            self._core.release()

    def ticks(self, start: int, stop: int, *, min_snapshot_ptr: int | None = None
              ) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Yield (tick, batch) for ticks in [start, stop), prefetching up to
        ring_depth - 1 ticks ahead; each batch is released when the loop moves on.

        ``min_snapshot_ptr``: every request waits until the buffer has seen that many
        rows (as in ``start_prepare``), e.g. to start before the collector has data;
        a collector whose first rows take longer than ``stall_timeout`` needs a
        larger one (or None). ``stop <= start`` yields nothing, as ``range`` does (a
        run resumed after its last tick has none left).

        Raises:
            TypeError, ValueError: ``start``, ``stop`` or ``min_snapshot_ptr`` is not
                an int >= 0 (numpy integers too), here, before any tick: the loop
                does not begin.
            As each tick's ``start_prepare`` and ``sample_large_batch``, from the loop.
        """
        start, stop = as_count("start", start), as_count("stop", stop)
        if min_snapshot_ptr is not None:
            min_snapshot_ptr = as_count("min_snapshot_ptr", min_snapshot_ptr)
        return self._tick_loop(start, stop, min_snapshot_ptr)

    def _tick_loop(self, start: int, stop: int, min_snapshot_ptr: int | None
                   ) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """``ticks``' loop, its arguments checked."""
        try:
            for tick in range(start, stop):
                self.after_tick()
                for ahead in range(tick, min(tick + self.ring_depth - 1, stop - 1) + 1):
                    self.start_prepare(ahead, self.sample_count, min_snapshot_ptr)
                yield tick, self.sample_large_batch(tick, self.sample_count)
        finally:
            with contextlib.suppress(ReplayFSMError):
                self.after_tick()

    def fail(self, error: BaseException) -> None:
        """Fail the pipeline with ``error`` as the cause: every later call raises
        chained to it (INV-STICKY). For a collector or a test that knows the run is
        broken. A second failure keeps the first cause.

        Raises:
            TypeError: ``error`` is not an exception; nothing changed.
        """
        try:
            with self._lock:
                self._fail_locked(error)
        finally:
            if DEFERRED:  # a stop signal came during the step: raised now
                raise_deferred()

    def add_observer(self, observer: Observer) -> None:
        """Report every later transition and span to ``observer`` (see
        ``replay_fsm.runtime.observers``).

        Raises:
            TypeError: ``observer`` lacks a callable ``transition`` or ``span`` (an
                ``Observer`` subclass has both).
        """
        missing = [m for m in ("transition", "span")
                   if not callable(getattr(observer, m, None))]
        if isinstance(observer, type):
            raise TypeError(f"add_observer takes an observer, an instance: got the class "
                            f"{observer.__name__} (call it: {observer.__name__}())")
        if missing:
            raise TypeError(f"an observer needs the methods transition and span (subclass "
                            f"replay_fsm.runtime.observers.Observer); "
                            f"{type(observer).__name__} lacks {' and '.join(missing)}")
        with self._lock:
            self._observers += (observer,)

    # -- read-only views ------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert the core's structural invariants (INV-HOT, INV-ORDER, the slots'
        ticks); a failure is a library bug.

        Raises:
            AssertionError: an invariant does not hold.
            RuntimeError: asserts are off (``python -O``): nothing would be checked.
        """
        require_asserts("check_invariants")
        with self._lock:
            self._core.check_invariants()

    def statistics(self) -> Statistics:
        """A snapshot of the run's counters and per-state dwell times."""
        with self._lock:
            return self._stats.snapshot(self._core.states,
                                        0 if self._checker is None else self._checker.checks)

    @property
    def states(self) -> tuple[SlotState, ...]:
        """Each slot's state, slot 0 first."""
        with self._lock:
            return self._core.states

    @property
    def pending(self) -> tuple[tuple[int, int], ...]:
        """(tick, slot) of requested ticks not yet acquired, oldest first."""
        with self._lock:
            return self._core.pending

    @property
    def hot(self) -> tuple[int, int] | None:
        """(tick, slot) of the batch the learner holds, or None."""
        with self._lock:
            slot, tick = self._core.hot_slot, self._core.hot_tick
            return None if slot is None or tick is None else (tick, slot)

    def slot_of(self, tick_id: int) -> int | None:
        """The slot holding ``tick_id`` (pending or hot), else None.

        Raises:
            ValueError, TypeError: a bad tick (not an int >= 0).
        """
        tick_id = as_tick(tick_id)
        with self._lock:
            return self._core.slot_of(tick_id)

    def pack_record(self, tick_id: int) -> PackDone:
        """The packer's record of ``tick_id``'s batch (its seed and the snapshot size
        it sampled from: what ``replay_fsm.sampling.expected_batch`` needs).

        Raises:
            ValueError, TypeError: a bad tick (not an int >= 0).
            ProtocolError: the tick's batch is not READY or HOT.
            PipelineFailed, PipelineClosed.
        """
        tick_id = as_tick(tick_id)
        with self._lock:
            self._raise_if_unusable()
            slot = self._core.slot_of(tick_id)
            done = None if slot is None else self._packs[slot]
            if slot is None or done is None or self._core.state(slot) not in AVAILABLE:
                raise ProtocolError(f"tick {tick_id} has no batch ready or hot")
            return done

    @property
    def closed(self) -> bool:
        """Whether ``close`` has begun (or a Ctrl-C closed the pipeline): the learner's
        calls raise ``PipelineClosed`` from then on."""
        return self._closed

    def close(self) -> None:
        """Stop everything: stop the collector link and the transfer worker, drain
        copies, unregister page-locked memory. Idempotent (INV-CLOSE). Nothing else
        does it before the interpreter's exit: a pipeline dropped unclosed is held by
        its own running threads, and they, its packer process and its slots stay until
        then (an exit hook stops it). In a child forked (``os.fork``) from the process
        that made it, it only makes the pipeline unusable there: its threads, packer
        and channels are the parent's.

        Raises:
            Exception: the first error an observer or a custom link's or backend's
                close hook raised, once every step of the close has run (the
                pipeline is closed all the same; a second close raises nothing).
        """
        if os.getpid() != self._pid:
            self._closed = True
            return
        # A thread inside a step (an observer's close, a signal handler's or a
        # finaliser's run there) holds the step lock, which a close running on another
        # thread needs before it lets go of the close lock: waiting for that close
        # would deadlock. It closes the core (the learner's calls raise from now on)
        # and leaves the rest to that close.
        if self._lock._is_owned():  # type: ignore[attr-defined]
            held = self._close_lock._is_owned()  # type: ignore[attr-defined]
            try:
                got = self._close_lock.acquire(blocking=False)
            except BaseException:  # a Ctrl-C right after it took the lock
                if not held and self._close_lock._is_owned():  # type: ignore[attr-defined]
                    self._close_lock.release()
                raise
            if not got:
                with self._lock:
                    self._close_core_once()
                return
            try:
                self._close_once()
            finally:
                self._close_lock.release()
            return
        # Entered in C: a stop signal cannot land between taking the close lock and
        # the block that gives it back. With acquire() and try: one landing right
        # after the acquire left the lock taken for good, the pipeline open, and
        # every close from another thread waiting for ever (helper-79).
        with self._close_lock:
            self._close_once()

    def _close_once(self) -> None:
        """The part of close that holds the close lock: stop the sides (once), close
        the backend, let go of the slots."""
        try:
            with self._lock:
                if self._stopped:
                    return
            self.forced = self._stop_sides()
            with self._closing_step():
                self.backend.close()
            # Let go of the slots so their memory is freed now (the learner's
            # batches keep theirs): the closed pipeline may live on, in reference
            # cycles too.
            self._views, self._device_slots = [], []
            self.host_slots = self._link.host_slots = []
            with self._closing_step():
                self.backend.release_slots()
            self._stopped = True
            _OPEN.discard(self)
            if self._close_error is not None:
                raise self._close_error
        finally:
            if DEFERRED:  # a stop signal came during the core's close: raised now
                raise_deferred()

    def _stop_at_exit(self, deadline: float | None = None) -> list[str]:
        """The interpreter's exit: stop the collector link, the transfer worker and then
        the backend's own threads (``stop_at_exit``), each bounded (STOP_TIMEOUT_S),
        not the backend's drain, which has no bound (a copy that never completes, a hung
        device) and is moot as the process ends. A close on another thread is waited
        for until ``deadline`` (time.monotonic; None: STOP_TIMEOUT_S from now).
        Returns what the hooks raised on the way, for the exit hook to report: every
        stop still runs after one that raised, and there is no close to raise it."""
        if os.getpid() != self._pid or self._stopped:
            return []
        failures: list[str] = []
        # After a close running on another thread (a daemon's), not beside it; bounded
        # as well, since that close may be stuck in the backend's drain.
        wait = STOP_TIMEOUT_S if deadline is None else max(0.0, deadline - time.monotonic())
        got = self._close_lock.acquire(timeout=wait)
        try:
            if not self._stopped:
                self._stop_sides()
                kept = self._close_error  # a link's stop, an observer's close
                if kept is not None:
                    failures.append(f"a stop of its collector link or an observer's close "
                                    f"raised {type(kept).__name__}: {kept}")
                # After the worker: nothing submits to the backend any more.
                try:
                    self.backend.stop_at_exit(STOP_TIMEOUT_S)
                except Exception as exc:  # noqa: BLE001 - reported, the others stopped
                    failures.append(f"its backend's stop_at_exit raised "
                                    f"{type(exc).__name__}: {exc}")
        finally:
            if got:
                self._close_lock.release()
        return failures

    def _stop_sides(self) -> list[str]:
        """Close the core (once: a close that a Ctrl-C cut short is finished by the
        next one) and stop the collector link and the transfer worker, each within
        STOP_TIMEOUT_S; returns what had to be forced. The part of ``close`` the exit
        hook runs too."""
        forced: list[str] = []
        with self._lock:
            self._close_core_once()
            # A learner thread inside its own pack ends it (its give_up sees the
            # close when held up): not this thread's (a handler of its own).
            taker = self._taker
            if taker not in (None, threading.get_ident()) and not self._cv.wait_for(
                    lambda: self._taker is None, STOP_TIMEOUT_S):
                forced.append(f"the learner's own pack on thread {taker}")
        for stop in (self._link.stop, self._worker.stop):
            with self._closing_step():  # a custom link's that raises: the worker still
                forced += stop(STOP_TIMEOUT_S)
        return forced

    def _close_core_once(self) -> None:
        """Close the core unless closed (what an observer raises is kept for close to
        raise), and wake every wait; with the lock held."""
        if not self._closed:
            error = self._close_core()  # an observer's, raised by close
            self._close_error = self._close_error or error
        self._cv.notify_all()

    @contextlib.contextmanager
    def _closing_step(self) -> Iterator[None]:
        """One step of close: an error in it (a custom link's or backend's hook) is
        kept for close to raise once every step has run (the first one met)."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - raised by close, after the rest
            if self._close_error is None:
                self._close_error = exc

    @step
    def _close_core(self) -> BaseException | None:
        """Mark the pipeline closed and close the core, as one step; returns what an
        observer raised (the core is closed all the same; the rest of close runs)."""
        self._closed = True
        try:
            self._core.close()
        except BaseException as exc:  # noqa: BLE001 - an observer's; re-raised by close
            return exc
        return None

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- learner internals ----------------------------------------------------

    def _call(self, name: str | None, fn: Any, *args: Any) -> Any:
        """Run a learner call, in a torch.profiler range named ``name`` when tracing.
        ``fn`` is a ``step``: a stop signal taken by replay_fsm's handlers while it
        runs is raised here once it returns or raises (chained to what it raised),
        or by its wait, between slices. A KeyboardInterrupt closes the pipeline, so
        no thread or process is left waiting on a learner that has stopped (and no
        request is left taken but never sent, where a handler of Python's own
        raised it mid-step)."""
        if self._observing is not None and self._observing == threading.get_ident():
            raise ProtocolError(f"{name or 'batch_ready'} called from inside an observer: "
                                "observers run within a step of the pipeline and must not "
                                "call back into it")
        try:
            try:
                if name is None or self.tracer is None:
                    return fn(*args)
                with torch.profiler.record_function(f"replay_fsm/{name}"):
                    return fn(*args)
            finally:
                if DEFERRED:
                    raise_deferred()
        except KeyboardInterrupt:
            self.close()
            raise
        except BaseException as exc:
            # threading's Condition.wait cut short by a Ctrl-C before it takes its lock
            # back raises "cannot release un-acquired lock", the interrupt its context;
            # not an interrupt the caller was handling when it called (its except block).
            if isinstance(exc.__context__, KeyboardInterrupt) and _raised_under(
                    exc.__context__, sys._getframe()):
                self.close()
            raise

    @step
    def _wait(self, tick: int, deadline: float | None) -> bool:
        with self._lock:
            self._raise_if_unusable()
            return self._wait_locked(tick, deadline) is not None

    def _wait_locked(self, tick: int, deadline: float | None) -> int | None:
        """Wait until ``tick``'s slot is READY or HOT and return it; None when it is
        not: ``deadline`` passed first, or an observer failed the run on the wait's
        span. The caller checked the pipeline is usable, holding the lock since: it is
        checked again only once the lock was let go."""
        slot = self._core.slot_of(tick)
        if slot is None:
            raise ProtocolError(f"tick {tick} was not requested; call start_prepare first")
        started = None
        rows: RowWatch | None = None  # made when the wait is for rows
        while True:
            if DEFERRED:  # a stop signal came during the wait: nothing is half done here
                raise_deferred(within_step=True)
            if WAIT_STOPS:  # one that ends waits alone (AgreedInterrupt), as DEFERRED
                raise_wait_stop()
            if self._pumps:
                self._pump_locked()
            if started is not None or self._pumps:
                # The lock was let go since the caller's check (a slice's wait, a take,
                # a pump): a failure or a close may have come meanwhile.
                self._raise_if_unusable()
            state = self._core.state(slot)
            if state in AVAILABLE:
                break
            now = time.monotonic_ns()
            if started is None:
                started = now  # the first slice is judged even past the deadline
            elif deadline is not None and now / 1e9 >= deadline:
                break
            if state is SlotState.REQUESTED and (deadline is None or self._orphaned(slot)):
                # A timed wait takes too where nobody but the learner packs the tick.
                if self._take_locked(tick, slot):
                    continue  # packed here; its pack-done message goes to the worker
                # The take may have let go of the lock: a close or a failure, or the
                # batch made READY (its notify_all missed), came meanwhile. Look
                # again before judging a state that may be gone or waiting a slice.
                self._raise_if_unusable()
                state = self._core.state(slot)
                if state in AVAILABLE:
                    break
            if state is SlotState.REQUESTED:
                rows = rows or RowWatch(self.stall_timeout, self.stall_timeout_name,
                                        self.min_snapshot_ptr_name)
            self._judge_locked(tick, slot, state, now, rows)
            if deadline is not None and now / 1e9 >= deadline:
                break  # a wait past its deadline at once (timeout 0) is judged once too
            wait = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S,
                                                             deadline - now / 1e9)
            self._cv.wait(timeout=max(wait, 0.0))
        if started is None:
            return slot  # available at the first look, the lock held since: no wait
        self._span("wait", Actor.LEARNER, started, time.monotonic_ns(), tick=tick,
                   slot=slot)
        return slot if self._core.state(slot) in AVAILABLE else None

    def _judge_locked(self, tick: int, slot: int, state: SlotState, now: int,
                      rows: RowWatch | None) -> None:
        """Raise (failing the pipeline) when the watchdog, or ``rows`` for a tick that
        waits for its rows, says the wait for ``tick`` in ``slot`` cannot end. A copy
        is late from when the learner first found it pending, in a wait or a poll.
        ``now``: monotonic ns of this look."""
        rows_now = self._row_looks.look(real_ns=now)
        now = self._looks.look(real_ns=now)  # every clock below runs on the looks'
        stalled, owed, waited_s = None, True, 0.0
        if state is SlotState.SUBMITTED:
            waited_s = _seen_for(self._late_ns, slot, now)
        elif state is SlotState.REQUESTED:
            ptr, needed = self.replay_buffer.ptr, self._rows_needed[slot]
            if rows is not None:
                stalled = rows.verdict(tick, needed, ptr, rows_now)
            owed = self._owed(slot, ptr >= needed, now)
        failure = self._watchdog.verdict(tick, slot, state, waited_s, owed, now)
        failure = failure or stalled  # the collector's first: rows stop when it dies
        if failure is not None:
            self._fail_locked(failure)
            raise failure

    def _owed(self, slot: int, rows_there: bool, now: int) -> bool:
        """Whether the collector's silence counts against the request in ``slot``: at
        once for a link whose collector beats while rows come; otherwise once the
        request's rows have been there, as seen by the learner, for longer than
        ``liveness_timeout`` (over every wait for it, not just this one)."""
        if self._link.beats_while_rows_come:
            return True
        if not rows_there:
            return False
        return _seen_for(self._owed_ns, slot, now) > self.liveness_timeout

    def _orphaned(self, slot: int) -> bool:
        """Whether the request in ``slot`` was read by a collector process gone since
        (``CollectorLink.orphaned``): only the learner can pack what is left."""
        return self.learner_packs and self._link.orphaned(slot)

    def _take_locked(self, tick: int, slot: int) -> bool:
        """Pack the chunks of ``tick`` the packer has not claimed, on this thread, if
        its rows are there (``min_snapshot_ptr``) and it is the oldest requested tick,
        or one that only the learner can pack (``_orphaned``: a wait for it, behind an
        older tick not acquired yet, waited for ever); the lock is released meanwhile.
        Not while another thread packs (``_taker``): the two would share the link's
        one learner packer, its drawn indices among them (two ticks only the learner
        can pack, waited for by two threads). Returns whether this call packed any."""
        request = self._requests[slot]
        if (request is None or self._taker is not None
                or self.replay_buffer.ptr < request.min_snapshot_ptr
                or (self._core.pending[0][0] != tick and not self._orphaned(slot))):
            return False
        # Taken off before the lock is released: a second thread waiting for the same
        # tick does not take it too (its chunks would draw on this one's indices).
        self._requests[slot] = None
        start = time.monotonic_ns()
        error: Exception | None = None

        def give_up() -> None:
            # Called, without the lock, while the pack is held up: a written chunk
            # cannot be counted (the claim lock's holder is stopped or dead), or rows
            # it gathers are being written by an add: a stop signal or the watchdog's
            # verdict ends it (either way the chunk is lost, and the pipeline closes
            # or fails). The packer bounds the second by liveness_timeout itself.
            if DEFERRED:
                raise_deferred(within_step=True)
            if self._closed:  # another thread's close waits for this pack to end
                raise PipelineClosed("the pipeline was closed while the learner packed")
            now = self._looks.look()
            # Owed as a wait judges it: an external collector's silence counts only
            # liveness_timeout after the learner saw the rows (they are there: the
            # take began only then). Without the lock: its clock's first sighting is
            # set once, by whichever thread comes first.
            failure = self._watchdog.verdict(tick, slot, SlotState.REQUESTED, 0.0,
                                             self._owed(slot, True, now), now)
            if failure is not None:
                raise failure
        self._taker = threading.get_ident()
        try:
            # In the try: a Ctrl-C that Python's own handler raises right after the
            # release is taken back under the lock, with _taker cleared, as any other
            # end of the pack (outside, the caller's lock was released twice, and a
            # close on another thread waited STOP_TIMEOUT_S for a pack long gone).
            self._cv.release()
            took = self._link.take(request, WAIT_SLICE_S, give_up=give_up)
        except Exception as exc:  # noqa: BLE001 - failed below, under the lock
            took, error = None, exc
        finally:
            self._taker = None  # first: one right after the retake skips the rest
            interrupted = self._retake_lock()
            self._cv.notify_all()  # a close waiting for this pack
            if interrupted is not None:
                raise interrupted
        if error is not None:
            # A chunk may be ours and never counted: the slot could never fill. (A
            # pipeline closed meanwhile stays closed: the core ignores a failure then.)
            self._fail_locked(error)
            self._raise_if_unusable()
        if took is None and (tick, slot) in self._core.pending:
            # Could not look now: again next slice (an orphaned tick behind the oldest
            # too, which nobody else packs: dropped, its waits went on for ever).
            self._requests[slot] = request
        if took:
            self._span("learner_pack", Actor.LEARNER, start, time.monotonic_ns(),
                       tick=tick, slot=slot, chunks=took)
        return bool(took)

    @step
    def _acquire(self, tick: int) -> dict[str, torch.Tensor]:
        with self._lock:
            self._raise_if_unusable()
            hot = self._core.hot_slot
            if hot is not None:
                if self._core.hot_tick == tick:
                    return dict(self._views[hot])
                raise ProtocolError(f"tick {self._core.hot_tick} is still hot; call "
                                    f"after_tick() before sampling tick {tick}")
            if self._core.oldest_tick != tick and self._core.slot_of(tick) is not None:
                # A tick younger than the oldest pending one can never be acquired
                # first: the core's refusal now, before any wait for it (a wait could
                # fail the run, DataStalled or CollectorDied, for an illegal call that
                # must change nothing: INV-STICKY) and before the hooks touch the
                # backend or the checker.
                refused = self._core.refusal(Step(Event.ACQUIRE, tick))
                if refused is not None:
                    raise refused
            slot = self._wait_locked(tick, None)  # raises if the tick was never requested
            if slot is None:  # without a deadline: an observer failed the run on its span
                self._raise_if_unusable()
            assert slot is not None
            if self._core.oldest_tick != tick:
                # A tick younger than the oldest pending one: the core's refusal, before
                # the hooks touch the backend or the checker (INV-STICKY).
                refused = self._core.refusal(Step(Event.ACQUIRE, tick))
                if refused is not None:
                    raise refused
            if self._fences_reads:
                try:
                    self.backend.before_read(slot)  # INV-RAW: reads wait for the copy
                except Exception as exc:  # noqa: BLE001 - else the batch went out unfenced
                    self._hook_failed("before_read", exc)
            if self._checker is not None:
                self._checker.acquiring(slot)
            # Last: the slot is HOT only once its read fence is in place (a
            # BaseException in a hook leaves it READY, its hooks run again next time).
            self._core.acquire(tick)
            return dict(self._views[slot])

    def _validate(self, sample_count: int) -> None:
        if type(sample_count) is int and sample_count == self.sample_count:
            return  # the common case, at once
        if isinstance(sample_count, bool) or not hasattr(sample_count, "__index__"):
            raise TypeError(f"sample_count must be an int, got {sample_count!r}")
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
        if not self._pumps:
            return  # the backend has nothing to run on the learner thread
        try:  # in the try: a Ctrl-C right after the release is taken back too
            self._cv.release()  # the backend may call back (on_complete) while it pumps
            self.backend.pump()
        except Exception as exc:  # noqa: BLE001 - a backend's bug fails the run
            error: Exception | None = exc
        else:
            error = None
        finally:
            interrupted = self._retake_lock()
            if interrupted is not None:
                raise interrupted
        if error is not None:
            self._hook_failed("pump", error)

    def _retake_lock(self) -> BaseException | None:
        """Take back the pipeline's lock, which this thread let go of for work done
        without it, and return what interrupted the taking (raised by the caller once
        the lock is its own). RLock.acquire runs signal handlers while it waits: a
        Ctrl-C there raised without the lock, and the caller's with-block then
        released a lock it did not hold ("cannot release un-acquired lock")."""
        interrupted: BaseException | None = None
        while not self._lock._is_owned():  # type: ignore[attr-defined]
            try:
                self._cv.acquire()
            except BaseException as exc:  # noqa: BLE001 - the first one is raised
                interrupted = interrupted or exc
        return interrupted

    def _hook_failed(self, hook: str, error: Exception) -> NoReturn:
        """A backend hook the learner's call ran raised: fail the pipeline with
        ``TransferFailed`` chained to it (sticky, as any failure) and raise that; on a
        pipeline failed or closed already, what that raises (INV-STICKY)."""
        self._raise_if_unusable()
        failure = TransferFailed(f"the backend's {hook} raised {type(error).__name__}: "
                                 f"{error}")
        self._fail_locked(failure, error)
        raise failure

    # -- transfer worker, copy engine, collector callbacks --------------------

    @step  # on the learner's thread too, for a batch it packed to its end
    def _on_pack_done(self, done: PackDone) -> CopyOrder | None:
        if done.error is not None:
            self.fail(PackerError(done.tick, done.error))
            return None
        with self._lock:
            if self._core.failure is not None or self._closed:
                return None
            if self._checker is not None:
                self._checker.pack_done(done)
            order = self._core.packed(done, actor=Actor.TRANSFER)
            self._packs[done.slot] = done
            self._span("pack", Actor.PACKER, done.pack_start_ns, done.pack_end_ns,
                       tick=done.tick, slot=done.slot, snapshot_size=done.snapshot_size)
            self._copy_submit_ns[done.slot] = time.monotonic_ns()
            return order

    @step  # on the learner's thread too (the cpu backend; a test's ManualBackend)
    def _on_copy_complete(self, slot: int) -> None:
        try:
            if type(slot) is not int:  # a backend's bug: named, not the core's TypeError
                slot = _completed_slot(slot)
            with self._lock:
                if self._core.failure is not None or self._closed:
                    return
                self._core.copied(slot, actor=Actor.COPY_ENGINE)
                self._span("copy", Actor.COPY_ENGINE, self._copy_submit_ns[slot],
                           time.monotonic_ns(), tick=self._core.tick_of(slot), slot=slot,
                           bytes=self._slot_bytes)
                self._cv.notify_all()
        except KeyboardInterrupt:
            raise  # a stop signal on the learner's thread (its own copy): not a failure
        except BaseException as exc:  # noqa: BLE001 - reported to the learner
            self._fail(exc, Actor.COPY_ENGINE)

    def _on_backend_error(self, error: BaseException) -> None:
        self._fail(error, Actor.COPY_ENGINE)

    def _on_transfer_error(self, error: BaseException) -> None:
        self._fail(error, Actor.TRANSFER)

    def _on_packer_error(self, error: BaseException) -> None:
        self._fail(error, Actor.PACKER)

    def _fail(self, error: BaseException, actor: Actor | None) -> None:
        with self._lock:
            self._fail_locked(error, actor=actor)

    @step
    def _fail_locked(self, error: BaseException, cause: BaseException | None = None, *,
                     actor: Actor | None = None) -> None:
        if cause is not None:
            error.__cause__ = cause
        self._core.fail(error, actor)
        self._cv.notify_all()

    # -- observers ------------------------------------------------------------

    # Both mark this thread as running the observers (``_observing``), so that a
    # learner call from one of them is refused (``_call``): the lock is re-entrant,
    # and such a call ran in the middle of the step being observed (an after_tick
    # released the batch being acquired; a wait waited for a request not sent yet,
    # for ever). Inline, not a context manager: they run at every transition and
    # span, on the learner's hot path (a generator's with-block cost 1.4 us a time).

    def _observe(self, record: TransitionRecord) -> None:
        now = time.monotonic_ns()
        if self._observers is self._stats_alone:
            # Our statistics alone (none added, no trace): they never call back into
            # the pipeline, so the thread need not be marked (a third of this call).
            try:
                self._stats.transition(record, now)
            except Exception as exc:  # noqa: BLE001 - as any observer's bug
                self._observer_failed(self._stats, exc)
            return
        before, self._observing = self._observing, threading.get_ident()
        try:
            for observer in self._observers:
                try:
                    observer.transition(record, now)
                except Exception as exc:  # noqa: BLE001 - an observer's bug fails the run
                    self._observer_failed(observer, exc)
        finally:
            self._observing = before

    def _span(self, name: str, actor: Actor, start_ns: int, end_ns: int, **args: Any
              ) -> None:
        before, self._observing = self._observing, threading.get_ident()
        try:
            for observer in self._observers:
                try:
                    observer.span(name, actor, start_ns, end_ns, **args)
                except Exception as exc:  # noqa: BLE001 - an observer's bug fails the run
                    self._observer_failed(observer, exc)
        finally:
            self._observing = before

    def _observer_failed(self, observer: Observer, error: Exception) -> None:
        """An observer raised: drop it and fail the pipeline, chained to its error.
        The step it watched is complete; failing (not re-raising into the middle of
        a learner call) keeps the rest of that call from being skipped."""
        with self._lock:
            self._observers = tuple(o for o in self._observers if o is not observer)
            if self._closed:  # a closed core takes no failure: close raises it
                if self._close_error is None:
                    self._close_error = error
                return
            self._fail_locked(error)


def _raised_under(error: BaseException, frame: FrameType) -> bool:
    """Whether ``error`` was raised in a call that ``frame`` was running (its traceback
    passes through a frame called, at any depth, from ``frame``)."""
    tb = error.__traceback__
    while tb is not None:
        caller: FrameType | None = tb.tb_frame
        while caller is not None:
            if caller is frame:
                return True
            caller = caller.f_back
        tb = tb.tb_next
    return False
