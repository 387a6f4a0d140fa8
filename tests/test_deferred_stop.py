"""A stop signal that lands inside a pipeline step waits for the step (signals.step).

Python runs a signal handler between any two bytecodes of the main thread. Raised
there, inside a step, the interrupt left it half done: a slot changed with its
trace record never written (the demo's trace then failed check-trace), or a lock
released for a wait and never taken back (a RuntimeError hid the interrupt).
Under ``sigterm_as_interrupt`` (the command line's handlers) the step finishes and
the interrupt is raised after it, or at its wait's next slice.
"""

from __future__ import annotations

import gc
import itertools
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType, SimpleNamespace
from typing import Any

import pytest
import torch

from replay_fsm import Pipeline, ReplayBuffer, signals
from replay_fsm.data.packer import Packer
from replay_fsm.errors import PipelineClosed, PipelineFailed
from replay_fsm.runtime import pipeline as pipeline_module
from replay_fsm.runtime.observers import Observer
from replay_fsm.transfer.manual import ManualBackend
from replay_fsm.verify.conformance import check

from .support import MARGIN_S
from .tiers import tier_runs

N = 64


def buffer() -> ReplayBuffer:
    rb = ReplayBuffer(4096, 8, 2)
    rb.add_packed(torch.randn(1024, rb.width))
    return rb


@pytest.fixture
def stops() -> Iterator[list[int]]:
    """The command line's handlers, and nothing deferred left behind by a test."""
    with signals.sigterm_as_interrupt() as taken:
        yield taken
        assert signals.DEFERRED == []  # before the block's end raises what is left


# -- the handler ----------------------------------------------------------------------


def test_inside_a_step_the_handler_defers_and_the_same_signal_again_raises_at_once(
        ) -> None:
    frames: list[FrameType] = []

    def called() -> None:
        frames.append(sys._getframe())

    @signals.step
    def in_a_step() -> None:
        called()

    in_a_step()
    called()
    inside, outside = frames
    handler = signals.interrupt_after_step(signals.Interrupted)
    try:
        with pytest.raises(signals.Interrupted):
            handler(signal.SIGTERM, outside)  # not in a step: raised where it lands
        assert signals.DEFERRED == []
        handler(signal.SIGTERM, inside)  # in a step (a caller of the frame): deferred
        assert _raised_by(lambda: handler(signal.SIGINT, inside)) is None  # joins it
        assert [e.signum for e in signals.DEFERRED] == [  # type: ignore[attr-defined]
            signal.SIGTERM, signal.SIGINT]
        with pytest.raises(signals.Interrupted) as info:
            handler(signal.SIGINT, inside)  # the same again: the user insists
        assert info.value.signum == signal.SIGINT and signals.DEFERRED == []
        handler(signal.SIGTERM, inside)
        seen: list[list[Any]] = []
        thread = threading.Thread(target=lambda: (signals.raise_deferred(),
                                                  seen.append(list(signals.DEFERRED))))
        thread.start()
        thread.join()
        assert len(seen[0]) == 1  # another thread never raises the main thread's stop

        @signals.step
        def nested() -> None:
            signals.raise_deferred()  # inside a step: left to the step's caller

        nested()
        assert len(signals.DEFERRED) == 1
        with pytest.raises(signals.Interrupted) as info:
            signals.raise_deferred()
        assert info.value.signum == signal.SIGTERM and signals.DEFERRED == []
    finally:
        signals.DEFERRED.clear()


def _raised_by(fn: Any) -> BaseException | None:
    """What ``fn()`` raised, a KeyboardInterrupt included (one escaping a test would
    stop the whole run), or None."""
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - what the test looks at
        return exc
    return None


def test_two_signals_that_come_together_both_wait_for_the_step(
        stops: list[int]) -> None:
    """A terminal's Ctrl-C and a wrapper's SIGTERM, pending at once: Python runs
    both handlers in one go, inside the step. Neither raises there; the first is
    raised after it."""
    done = []

    @signals.step
    def a_step() -> None:
        both = {signal.SIGINT, signal.SIGTERM}
        signal.pthread_sigmask(signal.SIG_BLOCK, both)
        # To this thread: pending here until it unblocks them. Sent to the process
        # (os.kill), another thread took them while this one blocked them, and on a
        # loaded machine its C handler could run after the loop below (helper-42).
        me = threading.get_ident()
        signal.pthread_kill(me, signal.SIGTERM)
        signal.pthread_kill(me, signal.SIGINT)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, both)  # both handlers run soon
        for _ in range(10_000):
            pass
        done.append(len(signals.DEFERRED))

    assert _raised_by(a_step) is None and done == [2]  # the step finished whole
    with pytest.raises(KeyboardInterrupt):
        signals.raise_deferred()
    assert signals.DEFERRED == []


def test_a_signal_while_the_handler_walks_the_stack_is_not_lost(
        stops: list[int]) -> None:
    """The handler can itself be interrupted (between its bytecodes): the second
    signal finds the first already deferred, and the first is raised after the
    step."""
    sent = []

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code is signals.in_step.__code__ and not sent:
            sent.append(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)  # lands while the first walks
        return tracer

    @signals.step
    def a_step() -> None:
        sys.settrace(tracer)
        try:
            signal.raise_signal(signal.SIGTERM)
            for _ in range(10_000):
                pass
        finally:
            sys.settrace(None)

    assert _raised_by(a_step) is None
    assert sent and {signals.signum_of(e) for e in signals.DEFERRED} == {
        signal.SIGTERM, signal.SIGINT}
    with pytest.raises(KeyboardInterrupt):
        signals.raise_deferred()
    assert signals.DEFERRED == []


def test_a_stop_still_deferred_when_the_block_ends_is_raised_there() -> None:
    """A step whose caller never asks loses nothing: the block raises it."""
    with pytest.raises(signals.Interrupted):
        with signals.sigterm_as_interrupt() as taken:
            signals.DEFERRED.append(signals.Interrupted(signal.SIGTERM))
    assert signals.DEFERRED == [] and taken == []


def test_ctrl_c_is_a_plain_keyboard_interrupt_and_the_handlers_come_back() -> None:
    before = [signal.getsignal(s) for s in signals.STOP_SIGNALS]
    with pytest.raises(KeyboardInterrupt) as info:
        with signals.sigterm_as_interrupt() as taken:
            signal.raise_signal(signal.SIGINT)
            for _ in range(10_000):  # the handler runs between bytecodes, soon
                pass
    assert type(info.value) is KeyboardInterrupt and taken == []
    assert [signal.getsignal(s) for s in signals.STOP_SIGNALS] == before


# -- the pipeline ---------------------------------------------------------------------


class SignalsOnce(Observer):
    """Sends SIGTERM to this process from inside the first REQUEST's step."""

    def __init__(self) -> None:
        self.sent = False

    def transition(self, record: Any, time_ns: int) -> None:
        if not self.sent:
            self.sent = True
            signal.raise_signal(signal.SIGTERM)


def test_a_signal_inside_a_step_is_raised_after_it_and_the_step_is_whole(
        stops: list[int]) -> None:
    """The signal lands inside start_prepare's core step (an observer sends it): the
    request is made and sent whole, then the call raises and the pipeline closes."""
    with Pipeline(buffer(), sample_count=N, backend="manual", trace=True) as pipe:
        observer = SignalsOnce()
        pipe.add_observer(observer)
        with pytest.raises(signals.Interrupted) as info:
            pipe.start_prepare(0, N)
        assert observer.sent and stops == [signal.SIGTERM]
        innermost = info.traceback[-1]
        assert innermost.name == "raise_deferred", info.traceback  # not mid-step
        assert pipe.closed
        assert pipe.tracer is not None
        records = pipe.tracer.transitions()
        assert [(r["event"], r["to"]) for r in records][:1] == [("request", "requested")]
        assert check(records).ok, check(records)


class PumpSignals(ManualBackend):
    """A backend the learner pumps while it waits: its first pump sends SIGTERM.
    Copies never complete, so the wait would last until the watchdog's verdict."""

    def __init__(self) -> None:
        super().__init__()
        self.pumps = 0

    def pump(self) -> None:
        self.pumps += 1
        if self.pumps == 1:
            signal.raise_signal(signal.SIGTERM)


@pytest.mark.timeout(120)
def test_a_signal_during_a_wait_is_raised_at_its_next_slice(stops: list[int]) -> None:
    """Not at the wait's end: the learner waits for a copy that never completes, and
    the stop is raised within the wait (the watchdog would say the copy engine hung
    only after liveness_timeout, 60 s here)."""
    backend = PumpSignals()
    with Pipeline(buffer(), sample_count=N, backend=backend, trace=True,
                  liveness_timeout=2 * MARGIN_S) as pipe:
        pipe.start_prepare(0, N)
        started = time.monotonic()
        with pytest.raises(signals.Interrupted) as info:
            pipe.sample_large_batch(0, N)
        assert time.monotonic() - started < MARGIN_S  # a slice: 50 ms; the verdict: 2x
        assert info.traceback[-1].name == "raise_deferred"
        assert backend.pumps >= 1 and pipe.closed
        with pytest.raises(PipelineClosed):
            pipe.after_tick()
        assert pipe.tracer is not None and check(pipe.tracer.transitions()).ok


def test_a_step_that_raises_with_a_stop_deferred_raises_the_stop_chained_to_it(
        stops: list[int]) -> None:
    """The stop is never lost to the step's own error: a failed pipeline's call
    raises PipelineFailed, and the signal that came during it wins, chained."""
    with Pipeline(buffer(), sample_count=N, backend=PumpSignals()) as pipe:
        pipe.fail(RuntimeError("the run broke"))
        with pytest.raises(signals.Interrupted) as info:
            pipe.batch_ready(0, N)  # pumps (the signal), then finds the failure
        assert isinstance(info.value.__context__, PipelineFailed)
        assert pipe.closed


class SignalsAndCloses(Observer):
    """In pipeline A's first step: sends SIGTERM (deferred), then closes pipeline B,
    as a finalizer or an observer might."""

    def __init__(self, other: Pipeline) -> None:
        self.other, self.close_raised = other, None
        self.sent = False

    def transition(self, record: Any, time_ns: int) -> None:
        if not self.sent:
            self.sent = True
            signal.raise_signal(signal.SIGTERM)
            try:
                self.other.close()
            except BaseException as exc:  # noqa: BLE001 - what the test looks at
                self.close_raised = exc


def test_a_pipeline_closed_inside_another_ones_step_leaves_the_stop_to_that_step(
        stops: list[int]) -> None:
    """close() raises a deferred stop only outside every step: inside one (here an
    observer of A's request closes B), raising it would cut A's step short, or, in
    a finalizer, lose it."""
    with Pipeline(buffer(), sample_count=N, backend="manual", trace=True) as a, \
            Pipeline(buffer(), sample_count=N, backend="manual") as b:
        observer = SignalsAndCloses(b)
        a.add_observer(observer)
        with pytest.raises(signals.Interrupted) as info:
            a.start_prepare(0, N)
        assert observer.sent and observer.close_raised is None and b.closed
        assert info.traceback[-1].name == "raise_deferred" and a.closed
        assert a.tracer is not None and check(a.tracer.transitions()).ok


def test_the_same_signal_again_inside_a_copy_on_the_learners_thread_is_a_stop(
        stops: list[int]) -> None:
    """SIGTERM during the learner's own pack is deferred; a second SIGTERM, inside
    the copy-complete callback the cpu backend runs on the learner's thread, is
    raised at once: it comes out as the stop, never as a copy-engine failure."""
    from replay_fsm.core import Core

    rb = buffer()
    pipe = Pipeline(rb, sample_count=N, backend="cpu", collector="external")
    targets = {Pipeline._take_locked.__code__: "first", Core.copied.__code__: "second"}
    sent: list[str] = []

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        which = targets.get(frame.f_code)
        if event == "call" and which is not None and which not in sent:
            sent.append(which)
            signal.raise_signal(signal.SIGTERM)
        return None

    try:
        pipe.start_prepare(0, N)
        sys.settrace(tracer)
        try:
            with pytest.raises(KeyboardInterrupt) as info:
                pipe.sample_large_batch(0, N)
        finally:
            sys.settrace(None)
        assert sent == ["first", "second"]
        assert isinstance(info.value, signals.Interrupted), info.value
        assert pipe.closed and signals.DEFERRED == []
        with pytest.raises(PipelineClosed):  # closed, not failed
            pipe.after_tick()
    finally:
        pipe.close()


@pytest.mark.timeout(120)
def test_a_stop_during_a_learner_pack_held_up_by_the_claim_lock_is_raised_then(
        stops: list[int]) -> None:
    """The learner wrote a chunk and must count it, but the claim lock's holder (a
    stopped packer) keeps it: the take retries for up to a minute. A stop signal
    then ends it at the next retry, not after the minute (60 s here; the bound
    below is half that)."""
    rb = buffer()
    pipe = Pipeline(rb, sample_count=N, backend="cpu", collector="external",
                    liveness_timeout=2 * MARGIN_S)
    handle = pipe.packer_handle()
    held, release = threading.Event(), threading.Event()

    def hold() -> None:  # the stopped packer
        handle.claim_lock.acquire()
        held.set()
        release.wait()
        handle.claim_lock.release()

    holder = threading.Thread(target=hold)
    real_claim = handle.claim

    def claim(*args: Any, **kwargs: Any) -> Any:
        got = real_claim(*args, **kwargs)
        if not holder.is_alive() and not held.is_set():
            holder.start()  # it takes the lock right after the learner's claim
            assert held.wait(60)
        return got

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code.co_name == "give_up" and not sent:
            sent.append(time.monotonic())
            signal.raise_signal(signal.SIGTERM)
        return None

    sent: list[float] = []
    handle.claim = claim  # type: ignore[method-assign]
    try:
        pipe.start_prepare(0, N)
        sys.settrace(tracer)
        try:
            with pytest.raises(signals.Interrupted):
                pipe.sample_large_batch(0, N)
        finally:
            sys.settrace(None)
        assert sent and time.monotonic() - sent[0] < MARGIN_S
        assert pipe.closed
    finally:
        release.set()
        if holder.is_alive():
            holder.join(60)
        pipe.close()


# -- a signal at every bytecode -----------------------------------------------------


# The pipeline's clock in the sweep: 10 ms further at each read. A wait's deadline
# is then met, or not, at the same read in every run, however slowly the machine
# runs the traced bytecodes.
CLOCK_STEP_NS = 10_000_000


def _run_interrupted_at(k: int | None, traced: int, wait_s: float
                        ) -> tuple[list[str], Any, Any]:
    """Tick 0, then ``traced`` ticks with SIGTERM sent at the ``k``-th bytecode the
    main thread runs in them (None: list them, send nothing). Each tick waits
    ``wait_s`` for its batch first (a wait with a deadline never packs; with 0 it
    ends before it waits, with more than CLOCK_STEP_NS it enters threading's
    Condition.wait, whose lock is released and taken back there), then samples it:
    the learner packs it itself (its lock released and taken back around the pack)
    and the cpu backend copies it on the learner's thread. The collector, attached
    here, only drops the requests the learner packed, between ticks. Nothing runs
    on another thread meanwhile: the bytecodes are the same from run to run.

    Returns the function of each bytecode run (file:function; listed when ``k`` is
    None), what the loop raised (None if nothing) and the conformance of the trace
    after close."""
    rb = buffer()
    pipe = Pipeline(rb, sample_count=N, ring_depth=3, trace=True, backend="cpu",
                    collector="external")
    collector = Packer.attach(pipe.packer_handle(), rb)
    count, functions = 0, []

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "opcode":
            count += 1
            if count == k:
                signal.raise_signal(signal.SIGTERM)
            elif k is None:
                code = frame.f_code
                functions.append(f"{Path(code.co_filename).name}:{code.co_name}")
        return local

    def call(frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        return local

    raised: Any = None
    clock = itertools.count(0, CLOCK_STEP_NS)

    def monotonic() -> float:
        return next(clock) / 1e9

    real_time = pipeline_module.time
    pipeline_module.time = SimpleNamespace(  # type: ignore[assignment]
        monotonic=monotonic, monotonic_ns=clock.__next__)
    gc.disable()  # no finalizer of an earlier run's objects runs at the k-th bytecode
    try:
        try:
            for tick in range(1 + traced):
                if tick >= 1:
                    sys.settrace(call)
                pipe.start_prepare(tick, N)
                assert not pipe.wait_until_ready(tick, N, timeout=wait_s)
                pipe.sample_large_batch(tick, N)
                pipe.after_tick()
                sys.settrace(None)
                collector.service(0.0)  # drops the request the learner packed
                assert collector.handle.requests.backlog == 0
        finally:
            sys.settrace(None)
            gc.enable()
            pipeline_module.time = real_time
    except BaseException as exc:  # noqa: BLE001 - what the test looks at
        raised = exc
    try:
        pipe.close()
    except BaseException as exc:  # noqa: BLE001 - the signal after the last bytecode
        raised = raised or exc
    assert pipe.tracer is not None
    return functions, raised, check(pipe.tracer.transitions())


# Where a lock is released and taken back: every bytecode there is tried (the wait's
# in the ticks that wait in it).
DENSE = ("pipeline.py:_take_locked", "pipeline.py:_pump_locked")
WAIT = ("threading.py:wait",)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigterm_at_any_bytecode_of_the_learners_calls_leaves_a_conforming_trace(
        stops: list[int]) -> None:
    """SIGTERM at the k-th bytecode of a tick's calls (in the pipeline, in torch's
    Python, in threading's Condition.wait): the loop stops with the interrupt
    itself, and the trace conforms. Without steps, many of them tore the trace, or
    turned the interrupt into 'cannot release un-acquired lock'. CI tries every 15th
    bytecode of a tick whose wait ends at once and each one of DENSE, then each
    one of Condition.wait in a tick that waits there (the pipeline's clock is the
    sweep's: whether a wait enters Condition.wait does not depend on how fast the
    machine runs the traced bytecodes). The deep tier does the same over two
    ticks, with every bytecode of the first kind. Every 15th still finds each
    learner step left unmarked: with no step marked, 92 of its 614 fail and 9 of the
    61 in Condition.wait; without _request's mark 20, _release's 16, _acquire's 25,
    _wait's the 9 in Condition.wait."""
    deep = tier_runs("deep")
    traced, stride = (2, 1) if deep else (1, 15)
    tried, failures = 0, []
    for wait_s, every, dense in ((0.0, stride, DENSE), (0.015, 0, WAIT)):
        functions, raised, conformance = _run_interrupted_at(None, traced, wait_s)
        assert raised is None and conformance.ok, (raised, conformance)
        waits = any(f.startswith(WAIT) for f in functions)
        assert waits == (wait_s > 0), f"a {wait_s} s wait: Condition.wait {waits}"
        runs = [k for k, function in enumerate(functions, 1)
                if (every and k % every == 0) or function.startswith(dense)]
        for k in runs:
            _, raised, conformance = _run_interrupted_at(k, traced, wait_s)
            if not isinstance(raised, signals.Interrupted) or not conformance.ok:
                failures.append(f"k={k} ({functions[k - 1]}, {wait_s} s wait): "
                                f"{raised!r}; {str(conformance)[:300]}")
        tried += len(runs)
    bad = len(failures)
    assert not bad, f"{bad} of {tried}:\n" + "\n".join(failures[:5])
