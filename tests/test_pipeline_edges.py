"""The Pipeline's edges: what each request tells the collector (the buffer's ptr and
size, the hot slot), what the spans and statistics report (ticks, slots, bytes), the
exact messages of a failed or closed pipeline and of bad counts, a watchdog verdict
that stays sticky, a pumping backend looked at every slice of a wait, what checked
mode is wired to, callbacks that arrive after the end, and close() with an observer
that interrupts it or a worker stuck in a submit."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from replay_fsm import PackerError, Pipeline, PipelineFailed, ReplayBuffer
from replay_fsm.data.packer import Packer
from replay_fsm.data.sampling import expected_batch
from replay_fsm.errors import (
    IllegalTransition,
    PipelineClosed,
    ProtocolError,
    TransferFailed,
)
from replay_fsm.runtime import links
from replay_fsm.runtime import pipeline as pipeline_module
from replay_fsm.runtime.checked import CheckedModeViolation
from replay_fsm.runtime.links import ThreadCollector
from replay_fsm.runtime.observers import Observer
from replay_fsm.spec import Actor, Event, SlotState
from replay_fsm.transfer.manual import ManualBackend

from .drive import complete_copies_for, run_ticks
from .support import MARGIN_S, SlotsOnlyLink, done_for, finishes_within

N = 8  # rows per batch
WIDTH = 11  # ReplayBuffer(_, 3, 2): obs 3 + next_obs 3 + actions 2 + 3 scalar columns
SLOT_BYTES = N * WIDTH * 4  # float32


def buffer(rows: int = 80) -> ReplayBuffer:
    """64 rows of capacity; 80 rows written, so ptr (80) and size (64) differ."""
    rb = ReplayBuffer(64, 3, 2)
    for _ in range(rows // 40):
        rb.add_packed(torch.randn(40, rb.width))
    return rb


class Log(Observer):
    """Keeps every transition and span; ``seen`` is set at the first ``event``."""

    def __init__(self, event: Event | None = None) -> None:
        self.transitions: list[Any] = []
        self.spans: list[tuple[str, Actor, dict[str, Any]]] = []
        self.seen = threading.Event()
        self._event = event

    def transition(self, record: Any, time_ns: int) -> None:
        self.transitions.append(record)
        if record.event is self._event:
            self.seen.set()

    def span(self, name: str, actor: Actor, start_ns: int, end_ns: int,  # type: ignore[override]
             **args: Any) -> None:
        self.spans.append((name, actor, args))


def outcome(fn: Callable[[], Any]) -> Any:
    """``fn()``, or the exception it raised (for a call run in another thread)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - handed back to the test
        return exc


class Receiving(ThreadCollector):
    """A packer thread whose ``asked_again`` is set when the transfer worker, having
    been handed a pack-done message, comes back for the next one."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.delivered = 0
        self.asked_again = threading.Event()

    def receive(self, timeout: float) -> Any:
        if self.delivered:
            self.asked_again.set()
        got = super().receive(timeout)
        if got is not None:
            self.delivered += 1
        return got


# -- first: the steps later tests rely on --------------------------------------------
# (a mutant of either fails here at once, not in a later test's wait)


def test_a_pack_done_becomes_a_copy_order_before_the_worker_takes_the_next() -> None:
    """The transfer worker fires SUBMIT and hands the copy order to the backend before
    it receives again. Kills xǁPipelineǁ_on_pack_done mutants 8 (a pack-done message
    dropped while the pipeline runs) and 11 (SUBMIT fired, no copy ordered)."""
    rb = buffer()
    link = Receiving(rb, 2, N)
    with Pipeline(rb, sample_count=N, backend="manual", collector=link) as pipe:
        pipe.start_prepare(0, N)
        assert link.asked_again.wait(MARGIN_S)
        assert pipe.backend.submitted == (0,)
        assert pipe.states == (SlotState.SUBMITTED, SlotState.IDLE)


def test_a_batch_already_copied_is_ready_without_a_wait() -> None:
    """A READY tick is ready at the first look: no wait is recorded. Kills
    xǁPipelineǁ_wait_locked mutant 7 (the state never looked at: every wait runs to
    its deadline, and one without a deadline never ends)."""
    with Pipeline(buffer(), sample_count=N, backend="manual", trace=True) as pipe:
        pipe.start_prepare(0, N)
        complete_copies_for(pipe, 0)
        assert pipe.wait_until_ready(0, N, timeout=0) is True
        assert pipe.statistics().stalls == 0
        assert pipe.tracer is not None
        assert [e["name"] for e in pipe.tracer.events() if e["kind"] == "span"] == [
            "pack", "copy"]


# -- the constructor ---------------------------------------------------------------


def test_a_new_pipeline_is_open_and_unchecked_by_default() -> None:
    """``closed`` is the bool False until close(); checked mode is off unless asked
    for (the transfer worker handles a pack-done message without checking it). Kills
    xǁPipelineǁ__init__ mutants 85 (``_closed = None``) and 9 (``checked`` defaulting
    to True)."""
    rb = buffer()
    link = Receiving(rb, 2, N)
    with Pipeline(rb, sample_count=N, backend="manual", collector=link) as pipe:
        assert pipe.closed is False
        pipe.start_prepare(0, N)
        assert link.asked_again.wait(MARGIN_S)  # tick 0's pack-done message handled
        assert pipe.statistics().checks == 0
    assert pipe.closed is True


def test_an_external_collector_has_sixty_seconds_to_attach_by_default() -> None:
    """Kills xǁPipelineǁ__init__ mutant 8 (the default 61 s)."""
    with Pipeline(buffer(), sample_count=N, collector="external", backend="manual") as pipe:
        assert pipe._link.attach_timeout == 60.0  # type: ignore[attr-defined]


def test_the_packer_process_is_given_the_thread_count_asked_for(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``packer_threads`` reaches ``serve_forever`` in the spawned packer process (the
    process is not started here); 1 by default, None for torch's own. Kills
    xǁPipelineǁ__init__ mutant 124."""
    monkeypatch.setattr(links.ProcessCollector, "start", lambda self, fail: None)
    for asked, given in ((3, 3), (None, None), ("default", 1)):
        kwargs = {} if asked == "default" else {"packer_threads": asked}
        with Pipeline(buffer(), sample_count=N, collector="process", backend="manual",
                      **kwargs) as pipe:  # type: ignore[arg-type]
            # serve_forever(handle, replay_buffer, poll_s, threads)
            assert pipe.collector_process._args[3] == given, asked


def test_host_slots_of_the_wrong_shape_are_refused_by_name() -> None:
    """Kills xǁPipelineǁ__init__ mutant 143 (the message dropped)."""
    threads = set(threading.enumerate())
    with pytest.raises(ValueError) as info:
        Pipeline(buffer(), sample_count=N, backend="manual", collector=SlotsOnlyLink(4, WIDTH))
    assert str(info.value) == ("host slots have shapes [(4, 11), (4, 11)], expected 2 of "
                               "(8, 11)")
    assert set(threading.enumerate()) <= threads  # nothing was started


def test_many_host_slots_of_one_shape_are_named_once_with_their_count() -> None:
    """One tensor of rows iterated as slots: its 64 rows were named one shape each."""
    with pytest.raises(ValueError) as info:
        Pipeline(buffer(), sample_count=N, backend="manual",
                 collector=SlotsOnlyLink(N, WIDTH, count=64))
    assert str(info.value) == "host slots have shapes 64 of (8, 11), expected 2 of (8, 11)"


@pytest.mark.parametrize("trace", [False, True])
def test_the_backend_is_told_whether_tracing_is_on(trace: bool) -> None:
    """Kills xǁPipelineǁ__init__ mutant 169 (``backend.trace(None)``)."""

    class Told(ManualBackend):
        def __init__(self) -> None:
            super().__init__()
            self.told: list[object] = []

        def trace(self, enabled: bool) -> None:
            self.told.append(enabled)

    backend = Told()
    with Pipeline(buffer(), sample_count=N, backend=backend, trace=trace):
        assert backend.told == [trace] and backend.told[0] is trace


def test_checked_mode_counts_four_checks_per_tick() -> None:
    """Per tick: the pack (before submit), the copy's start (the backend reports it
    to the checker), the acquire and the release. Kills xǁPipelineǁ__init__ mutant 199
    (the backend not given the checker: no copy checks)."""
    with Pipeline(buffer(), sample_count=N, backend="manual", checked=True) as pipe:
        run_ticks(pipe, 0, 3)
        assert pipe.statistics().checks == 4 * 3


class CompletesEarly(ManualBackend):
    """A backend bug checked mode exists to catch: it reports a copy complete while
    the copy is still running (it started and never finished)."""

    def submit(self, order: Any) -> None:
        assert self.monitor is not None, "checked mode gave the backend no monitor"
        self.monitor.copy_started(order.slot)
        self.on_complete(order.slot)


def test_checked_mode_fails_the_pipeline_on_a_read_of_a_slot_still_being_copied() -> None:
    """INV-RAW: the acquire raises CheckedModeViolation, and the pipeline is failed
    with it (every later call raises chained to it). Kills xǁPipelineǁ__init__ mutants
    168 (the checker given no way to fail the pipeline) and 176 (no monitor)."""
    with Pipeline(buffer(), sample_count=N, backend=CompletesEarly(), checked=True,
                  liveness_timeout=MARGIN_S) as pipe:
        pipe.start_prepare(0, N)
        assert pipe.wait_until_ready(0, N, timeout=MARGIN_S)
        with pytest.raises(CheckedModeViolation) as info:
            pipe.sample_large_batch(0, N)
        assert str(info.value) == "INV-RAW: learner acquired G[0] while its copy was in flight"
        with pytest.raises(PipelineFailed) as again:
            pipe.start_prepare(1, N)
        assert again.value.__cause__ is info.value


# -- requests --------------------------------------------------------------------


class Sending(ThreadCollector):
    """A packer thread that keeps what every request was sent with."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.sent: list[tuple[int, int | None, object, object]] = []

    def send(self, request: Any, **kw: Any) -> None:
        self.sent.append((request.tick, request.min_snapshot_ptr, kw["snapshot"],
                          kw["hot_slot"]))
        super().send(request, **kw)


def test_a_request_carries_the_buffers_ptr_and_size_and_the_hot_slot() -> None:
    """Each request: ``min_snapshot_ptr`` defaults to the buffer's ptr now (80 rows
    ever written) and is the caller's when given; the snapshot is (ptr, size) = (80,
    64); the hot slot is -1 when no batch is hot, else its slot. Kills
    xǁPipelineǁ_request mutants 4, 10, 14, 16, 17 and 21-25."""
    rb = buffer()
    link = Sending(rb, 2, N)
    with Pipeline(rb, sample_count=N, collector=link, liveness_timeout=MARGIN_S) as pipe:
        pipe.start_prepare(0, N)
        assert pipe.wait_until_ready(0, N, timeout=MARGIN_S)
        pipe.sample_large_batch(0, N)  # tick 0 hot in slot 0
        pipe.start_prepare(1, N, min_snapshot_ptr=7)
        pipe.after_tick()
        assert pipe.wait_until_ready(1, N, timeout=MARGIN_S)
        pipe.sample_large_batch(1, N)  # tick 1 hot in slot 1
        pipe.start_prepare(2, N)
    assert link.sent == [(0, 80, (80, 64), -1), (1, 7, (80, 64), 0), (2, 80, (80, 64), 1)]


def test_a_bad_min_snapshot_ptr_is_named() -> None:
    """Kills xǁPipelineǁstart_prepare mutant 8 (the argument misnamed)."""
    with Pipeline(buffer(), sample_count=N, backend="manual") as pipe:
        with pytest.raises(ValueError) as info:
            pipe.start_prepare(0, N, min_snapshot_ptr=-1)
        assert str(info.value) == "min_snapshot_ptr must be an int >= 0, got -1"
        assert pipe.pending == ()


@pytest.mark.parametrize("count", [True, 1.0])
def test_a_sample_count_that_is_a_bool_or_a_float_is_refused(count: object) -> None:
    """``True`` and ``1.0`` equal 1, and still are not counts. Kills xǁPipelineǁ_validate
    mutants 1 (neither refused) and 9 (the message dropped)."""
    with Pipeline(buffer(), sample_count=1, backend="manual") as pipe:
        with pytest.raises(TypeError) as info:
            pipe.start_prepare(0, count)  # type: ignore[arg-type]
        assert str(info.value) == f"sample_count must be an int, got {count!r}"
        assert pipe.pending == ()


# -- the learner's reads ------------------------------------------------------------


def test_sampling_the_hot_tick_again_returns_its_batch_and_another_tick_is_refused() -> None:
    """Kills xǁPipelineǁ_acquire mutants 1 (the hot slot not looked at) and 4."""
    with Pipeline(buffer(), sample_count=N, backend="manual") as pipe:
        pipe.start_prepare(0, N)
        complete_copies_for(pipe, 0)
        first = pipe.sample_large_batch(0, N)
        again = pipe.sample_large_batch(0, N)
        assert again.keys() == first.keys()
        assert all(again[k].data_ptr() == first[k].data_ptr() for k in first)
        assert pipe.hot == (0, 0)
        pipe.start_prepare(1, N)
        complete_copies_for(pipe, 1)
        with pytest.raises(ProtocolError) as info:
            pipe.sample_large_batch(1, N)
        assert str(info.value) == ("tick 0 is still hot; call after_tick() before "
                                   "sampling tick 1")


def test_the_backend_knows_the_hot_slot_is_read_from_acquire_to_release() -> None:
    """``before_read(slot)`` at acquire, ``after_read(slot)`` at release. Kills
    xǁPipelineǁ_acquire mutant 11 (``before_read(None)``)."""
    with Pipeline(buffer(), sample_count=N, backend="manual") as pipe:
        pipe.start_prepare(0, N)
        pipe.start_prepare(1, N)
        complete_copies_for(pipe, 0)
        complete_copies_for(pipe, 1)
        pipe.sample_large_batch(0, N)
        assert [pipe.backend.reads_pending(s) for s in (0, 1)] == [True, False]
        pipe.after_tick()
        pipe.sample_large_batch(1, N)
        assert [pipe.backend.reads_pending(s) for s in (0, 1)] == [False, True]
        pipe.after_tick()
        assert [pipe.backend.reads_pending(s) for s in (0, 1)] == [False, False]


# -- spans and statistics ------------------------------------------------------------


def test_pack_and_copy_spans_name_their_tick_slot_and_sizes() -> None:
    """The pack span carries the snapshot size the packer sampled from, the copy span
    the bytes it moved; statistics add those bytes up. Kills xǁPipelineǁ_on_pack_done
    mutants 21-23 and 28-30, xǁPipelineǁ_on_copy_complete mutants 11, 12 and 18-20,
    xǁPipelineǁ_span mutant 9 and xǁPipelineǁ__init__ mutant 163 (the slot's bytes)."""
    with Pipeline(buffer(), sample_count=N, backend="manual", trace=True) as pipe:
        run_ticks(pipe, 0, 2)
        assert pipe.tracer is not None
        spans = sorted(((e["name"], e["tick"]), e) for e in pipe.tracer.events()
                       if e["kind"] == "span")
        assert [{k: e[k] for k in ("name", "actor", "tick", "slot", "args")}
                for _, e in spans] == [
            {"name": "copy", "actor": "copy_engine", "tick": 0, "slot": 0,
             "args": {"bytes": SLOT_BYTES}},
            {"name": "copy", "actor": "copy_engine", "tick": 1, "slot": 1,
             "args": {"bytes": SLOT_BYTES}},
            {"name": "pack", "actor": "packer", "tick": 0, "slot": 0,
             "args": {"snapshot_size": 64}},
            {"name": "pack", "actor": "packer", "tick": 1, "slot": 1,
             "args": {"snapshot_size": 64}},
        ]
        stats = pipe.statistics()
        assert (stats.packs, stats.bytes_moved, stats.stalls) == (2, 2 * SLOT_BYTES, 0)


def test_a_wait_span_names_the_tick_and_slot_waited_on() -> None:
    """No collector attaches, so tick 1 stays REQUESTED; a wait with ``timeout=0``
    looks once, returns False and records one wait. Kills xǁPipelineǁ_wait_locked
    mutants 56, 57, 62 and 63."""
    log = Log()
    with Pipeline(buffer(), sample_count=N, collector="external", backend="manual",
                  ring_depth=3, liveness_timeout=MARGIN_S) as pipe:
        pipe.add_observer(log)
        pipe.start_prepare(0, N)
        pipe.start_prepare(1, N)
        assert pipe.wait_until_ready(1, N, timeout=0) is False
        assert log.spans == [("wait", Actor.LEARNER, {"tick": 1, "slot": 1})]
        assert pipe.statistics().stalls == 1


# -- waits and the watchdog ------------------------------------------------------------


class PumpCompletes(ManualBackend):
    """A backend that needs the learner thread (as MPS does): once armed, its copy
    into slot 0 completes at the third pump."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.pumps = 0

    def pump(self) -> None:
        if self.armed:
            self.pumps += 1
            if self.pumps == 3:
                self.complete(0)


def test_a_wait_without_a_timeout_pumps_the_backend_every_slice() -> None:
    """The learner's wait looks again after each slice (it never waits for a wake-up
    that a pumping backend cannot give), and the time it has waited is counted in
    seconds: two slices are far from the liveness bound. Kills xǁPipelineǁ_wait_locked
    mutants 29 (nanoseconds times 1e9: TransferFailed at the second look) and 45 (an
    untimed wait on the lock: it hangs)."""
    backend = PumpCompletes()
    with Pipeline(buffer(), sample_count=N, backend=backend,
                  liveness_timeout=MARGIN_S) as pipe:
        pipe.start_prepare(0, N)
        assert backend.wait_submitted(0, timeout=MARGIN_S)
        backend.armed = True
        finished, got = finishes_within(lambda: outcome(lambda: pipe.wait_until_ready(0, N)))
        assert finished and got == [True]
        assert backend.pumps == 3


def test_an_acquire_whose_wait_span_fails_the_run_starts_no_read() -> None:
    """An observer that raises on the learner's wait span fails the run while
    ``sample_large_batch`` is still in its call: the call raises chained to the
    observer's error and marks no read of the slot in flight (the backend was not
    told a read began, so nothing waits on its end)."""
    bug = ZeroDivisionError("span bug")

    class SpanBug(Observer):
        def span(self, name: str, *args: Any, **kw: Any) -> None:
            if name == "wait":
                raise bug

    backend = PumpCompletes()
    with Pipeline(buffer(), sample_count=N, backend=backend,
                  liveness_timeout=MARGIN_S) as pipe:
        pipe.add_observer(SpanBug())
        pipe.start_prepare(0, N)
        assert backend.wait_submitted(0, timeout=MARGIN_S)
        backend.armed = True  # the copy completes while the learner waits: a span
        with pytest.raises(PipelineFailed) as info:
            pipe.sample_large_batch(0, N)
        assert info.value.__cause__ is bug
        assert backend.pumps == 3 and not backend.reads_pending(0)


class NoStorage:
    """A replay source that offers what the pipeline reads and no ``storage``."""

    def __init__(self, rb: ReplayBuffer) -> None:
        self.layout, self.width, self.gather = rb.layout, rb.width, rb.gather
        self.ptr, self.size = rb.ptr, rb.size


def slots_of(*dtypes: torch.dtype) -> SlotsOnlyLink:
    link = SlotsOnlyLink(N, WIDTH)
    link.host_slots = [s.to(d) for s, d in zip(link.host_slots, dtypes, strict=True)]
    return link


@pytest.mark.parametrize(("source", "dtypes"), [
    (buffer, (torch.float32, torch.float64)),
    (buffer, (torch.float64, torch.float64)),  # one dtype, not the rows'
    (lambda: NoStorage(buffer()), (torch.float32, torch.float64)),  # slot 0's decides
], ids=["mixed", "float64", "mixed, no storage"])
def test_host_slots_of_another_dtype_than_the_rows_are_refused_by_name(
        source: Callable[[], Any], dtypes: tuple[torch.dtype, ...]) -> None:
    """Host slots that are not the buffer's float32 rows (a source without
    ``storage``: not all of slot 0's dtype) are refused before anything starts: the
    packer's gather would fail at the first tick. Kills xǁPipelineǁ__init__ mutants
    141, 147 and 148 (the rows' dtype not looked up) and 149 (slot 1's dtype)."""
    threads = set(threading.enumerate())
    with pytest.raises(ValueError) as info:
        Pipeline(source(), sample_count=N, backend="manual", collector=slots_of(*dtypes))
    assert str(info.value) == (f"host slots have dtypes {[str(d) for d in dtypes]}, "
                               "expected 2 of torch.float32 (the replay buffer's rows)")
    assert set(threading.enumerate()) <= threads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_source_without_storage_takes_host_slots_of_one_dtype(dtype: torch.dtype) -> None:
    """Kills xǁPipelineǁ__init__ mutants 147 and 150 (the dtype asked of a
    ``storage`` the source does not have)."""
    with Pipeline(NoStorage(buffer()), sample_count=N, backend="manual",
                  collector=slots_of(dtype, dtype)) as pipe:
        assert [s.dtype for s in pipe.host_slots] == [dtype, dtype]


def test_a_watchdog_verdict_fails_the_pipeline_for_good() -> None:
    """The verdict is raised to the waiting learner and is the pipeline's failure:
    later calls raise it again, chained. Kills xǁPipelineǁ_wait_locked mutant 42."""

    class Dead(ManualBackend):
        def check_alive(self) -> str | None:
            return "the copy engine is gone"

    backend = Dead()
    with Pipeline(buffer(), sample_count=N, backend=backend,
                  liveness_timeout=MARGIN_S) as pipe:
        pipe.start_prepare(0, N)
        assert backend.wait_submitted(0, timeout=MARGIN_S)  # the slot is SUBMITTED
        with pytest.raises(TransferFailed) as info:
            pipe.wait_until_ready(0, N, timeout=MARGIN_S)
        assert str(info.value) == "tick 0: the copy engine is gone"
        with pytest.raises(TransferFailed) as again:
            pipe.start_prepare(1, N)
        assert str(again.value) == "the pipeline failed: tick 0: the copy engine is gone"
        assert again.value.__cause__ is info.value


# -- a failed or closed pipeline ---------------------------------------------------------


def test_a_failed_pipeline_names_its_cause_and_a_closed_one_says_so() -> None:
    """Kills xǁPipelineǁ_raise_if_unusable mutants 1 (the failure not looked at: the
    core's own refusal is raised instead), 7 and 8-10 (the messages)."""
    cause = RuntimeError("the learner's own error")
    with Pipeline(buffer(), sample_count=N, backend="manual") as pipe:
        pipe.fail(cause)
        with pytest.raises(PipelineFailed) as info:
            pipe.start_prepare(0, N)
        assert type(info.value) is PipelineFailed
        assert str(info.value) == "the pipeline failed: the learner's own error"
        assert info.value.__cause__ is cause
    pipe = Pipeline(buffer(), sample_count=N, backend="manual")
    pipe.close()
    with pytest.raises(PipelineClosed) as closed:
        pipe.start_prepare(0, N)
    assert str(closed.value) == "the pipeline is closed"


def test_a_pipeline_failed_then_closed_raises_its_failure_from_every_learner_call() -> None:
    """The README: after close() the learner's calls raise PipelineClosed,
    ``packer_handle()`` included, and a pipeline that failed before it was closed
    raises its PipelineFailed instead (INV-STICKY). ``packer_handle()`` raised
    PipelineClosed there (helper-98)."""
    cause = RuntimeError("the learner's own error")
    pipe = Pipeline(buffer(), sample_count=N, backend="manual")
    pipe.fail(cause)
    pipe.close()
    for call in (lambda: pipe.start_prepare(0, N), lambda: pipe.batch_ready(0, N),
                 pipe.after_tick, pipe.packer_handle):
        with pytest.raises(PipelineFailed) as info:
            call()
        assert info.value.__cause__ is cause


def test_a_packers_error_fails_the_pipeline_with_a_packer_error() -> None:
    """An empty buffer: packing tick 0 raises in the packer thread; the pipeline fails
    chained to a PackerError for tick 0. Kills xǁPipelineǁ_on_pack_done mutant 2
    (``fail(None)``: the slots fail with no cause)."""
    log = Log(Event.FAIL)
    with Pipeline(buffer(rows=0), sample_count=N, backend="manual") as pipe:
        pipe.add_observer(log)
        pipe.start_prepare(0, N)
        assert log.seen.wait(MARGIN_S)
        with pytest.raises(PipelineFailed) as info:
            pipe.start_prepare(1, N)
        cause = info.value.__cause__
        assert isinstance(cause, PackerError) and cause.tick == 0


def test_a_copy_reported_for_a_slot_not_submitted_fails_the_run_as_the_copy_engine() -> None:
    """A backend that reports a completion the core refuses fails the pipeline, and
    the FAIL transitions name the copy engine. Kills xǁPipelineǁ_on_copy_complete
    mutant 25 (the actor dropped)."""
    log = Log()
    with Pipeline(buffer(), sample_count=N, backend="manual") as pipe:
        pipe.add_observer(log)
        pipe.backend.on_complete(0)  # slot 0 is IDLE: nothing was submitted
        assert [(r.event, r.actor) for r in log.transitions] == [
            (Event.FAIL, Actor.COPY_ENGINE)] * 2
        with pytest.raises(PipelineFailed) as info:
            pipe.start_prepare(0, N)
        assert isinstance(info.value.__cause__, IllegalTransition)


def test_a_pack_done_that_arrives_after_the_end_is_dropped_quietly() -> None:
    """After a failure, or after close, a pack-done message orders no copy, is not
    checked and raises nothing into the transfer worker (which would end it). Kills
    xǁPipelineǁ_on_pack_done mutant 7 (``and`` for ``or``: it went on to check and
    fire SUBMIT, which raise)."""
    with Pipeline(buffer(), sample_count=N, collector="external", backend="manual",
                  checked=True, liveness_timeout=MARGIN_S) as pipe:
        pipe.start_prepare(0, N)  # no collector attaches: slot 0 stays REQUESTED
        done = done_for(pipe._core, 0)
        pipe.fail(RuntimeError("the learner gave up"))
        assert pipe._on_pack_done(done) is None
        assert pipe.statistics().checks == 0
    pipe = Pipeline(buffer(), sample_count=N, collector="external", backend="manual",
                    checked=True, liveness_timeout=MARGIN_S)
    pipe.start_prepare(0, N)
    done = done_for(pipe._core, 0)
    pipe.close()
    assert pipe._on_pack_done(done) is None
    assert pipe.statistics().checks == 0


def test_an_observer_whose_span_raises_is_dropped_before_the_pipeline_fails() -> None:
    """The observer sees none of the transitions that follow its error (the FAIL
    ones, close). Kills xǁPipelineǁ_span mutant 10 (the observer not dropped)."""
    bug = ZeroDivisionError("span bug")

    class SpanBug(Observer):
        def __init__(self) -> None:
            self.raised = False
            self.after: list[Event] = []

        def transition(self, record: Any, time_ns: int) -> None:
            if self.raised:
                self.after.append(record.event)

        def span(self, *args: Any, **kw: Any) -> None:
            self.raised = True
            raise bug

    observer = SpanBug()
    with Pipeline(buffer(), sample_count=N, collector="external", backend="manual",
                  liveness_timeout=MARGIN_S) as pipe:
        pipe.add_observer(observer)
        pipe.start_prepare(0, N)  # no collector attaches: tick 0 stays REQUESTED
        assert pipe.wait_until_ready(0, N, timeout=0) is False  # its wait span raises
        with pytest.raises(PipelineFailed) as info:
            pipe.start_prepare(1, N)
        assert info.value.__cause__ is bug
    assert observer.raised and observer.after == []


# -- close --------------------------------------------------------------------------


def test_an_observer_that_interrupts_close_is_reraised_after_everything_stopped() -> None:
    """A BaseException from an observer at close (Ctrl-C, say) does not cut close
    short: the link and the worker stop, and then it is raised. Kills
    xǁPipelineǁclose mutant 4 (it was swallowed)."""

    class Stop(BaseException):
        pass

    stop = Stop()

    class StopsAtClose(Observer):
        def transition(self, record: Any, time_ns: int) -> None:
            if record.event is Event.CLOSE:
                raise stop

    threads = {t.ident for t in threading.enumerate()}
    pipe = Pipeline(buffer(), sample_count=N, backend="manual")
    pipe.add_observer(StopsAtClose())
    with pytest.raises(Stop) as info:
        pipe.close()
    assert info.value is stop
    assert pipe.closed and pipe.states == (SlotState.CLOSED,) * 2 and pipe.forced == []
    assert {t.ident for t in threading.enumerate()} <= threads


def test_an_observers_error_at_a_close_cut_short_is_raised_by_the_close_that_finishes(
        ) -> None:
    """A Ctrl-C stopping the collector link, after the core closed and an observer
    raised a BaseException (an Exception fails the run instead): the next close
    finishes stopping everything and raises it (it was lost: the core was closed
    already)."""

    class Broken(BaseException):
        pass

    class RaisesAtClose(Observer):
        def transition(self, record: Any, time_ns: int) -> None:
            if record.event is Event.CLOSE:
                raise Broken("the observer's")

    pipe = Pipeline(buffer(), sample_count=N, backend="manual")
    pipe.add_observer(RaisesAtClose())
    stop, calls = pipe._link.stop, []

    def interrupted_once(timeout: float) -> list[str]:
        calls.append(timeout)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return stop(timeout)
    pipe._link.stop = interrupted_once  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        pipe.close()
    with pytest.raises(Broken, match="the observer's"):
        pipe.close()
    assert len(calls) == 2 and pipe.forced == []
    pipe.close()  # and then nothing more


def test_close_leaves_a_worker_stuck_in_a_submit_behind_and_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """close() waits for the transfer worker at most its stop timeout, then names it
    in ``forced``. Kills xǁPipelineǁclose mutant 8 (no timeout: close hangs)."""
    monkeypatch.setattr(pipeline_module, "STOP_TIMEOUT_S", 0.1)
    entered, release = threading.Event(), threading.Event()

    class Stuck(ManualBackend):
        def submit(self, order: Any) -> None:
            entered.set()
            release.wait(MARGIN_S)

    rb = buffer()
    pipe = Pipeline(rb, sample_count=N, backend=Stuck(), collector="external",
                    liveness_timeout=MARGIN_S)
    try:
        packer = Packer.attach(pipe.packer_handle(), rb)
        pipe.start_prepare(0, N)
        assert packer.service(timeout=MARGIN_S)
        assert entered.wait(MARGIN_S)  # the worker is inside the backend's submit
        finished, _ = finishes_within(pipe.close)
        assert finished
        assert pipe.forced == ["the transfer worker did not stop within 0 s (a backend "
                               "submit that never returns); it is a daemon thread and is "
                               "left behind"]
    finally:
        release.set()
        pipe.close()


@pytest.mark.parametrize("collector", ["thread", "external"])
def test_sampling_the_second_pending_tick_is_refused_before_any_wait(collector: str
                                                                     ) -> None:
    """INV-ORDER, INV-STICKY: sampling a tick younger than the oldest pending one is
    an illegal call, refused with nothing changed. It waited for that tick first, and
    a wait that failed (its rows never came: DataStalled; a busy external collector:
    CollectorDied) failed the whole run for the learner's mistake (helper-84)."""
    rb = buffer()
    with Pipeline(rb, sample_count=N, collector=collector, stall_timeout=1.0,
                  liveness_timeout=MARGIN_S, attach_timeout=MARGIN_S) as pipe:
        pipe.start_prepare(0, N)
        pipe.start_prepare(1, N, min_snapshot_ptr=rb.ptr + 1)  # its rows never come
        # Tick 0 READY first: else the packer may fill it between the snapshot and
        # the check, which then fails on a change the refused call did not make.
        # (Untimed: the learner packs it itself where nobody attached.)
        assert pipe.wait_until_ready(0, N)
        before = (pipe.states, pipe.pending, pipe.hot)
        with pytest.raises(IllegalTransition, match="acquired in request order; next is 0"):
            pipe.sample_large_batch(1, N)
        assert (pipe.states, pipe.pending, pipe.hot) == before  # nothing changed
        assert torch.equal(pipe.sample_large_batch(0, N)["obs"],
                           expected_batch(rb.storage, rb.size, N, 0)[:, rb.layout.obs])

