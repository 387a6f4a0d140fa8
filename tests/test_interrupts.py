"""INV-STICKY under interruption: a KeyboardInterrupt (what Ctrl-C raises) or any
exception at any callout a learner call makes (observers, backend hooks, the
collector link) leaves every core step done or not done. In a loop over every
callout point and every position of the interrupt: the pipeline is consistent
afterwards (its invariants hold), an interrupted learner call has closed it (no
request is left taken but unsent, nothing waits on a learner that stopped), an
interrupt on another thread fails it chained, and nothing hangs."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from replay_fsm import Pipeline, PipelineFailed, ReplayBuffer
from replay_fsm.errors import PipelineClosed
from replay_fsm.runtime.links import ThreadCollector
from replay_fsm.runtime.observers import Observer
from replay_fsm.transfer.cpu import CpuBackend

from .drive import packed, reference
from .support import MARGIN_S

TICKS = 6


class Bomb:
    """Raises ``error`` at the ``at``-th call (counted across threads)."""

    def __init__(self, at: int, error: type[BaseException]) -> None:
        self.at, self.error, self.calls = at, error, 0
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            self.calls += 1
            boom = self.calls == self.at
        if boom:
            raise self.error("injected")


def build(point: str, bomb: Bomb) -> Pipeline:
    rb = ReplayBuffer(512, 4, 2)
    rb.add_packed(torch.randn(300, rb.width))

    class Backend(CpuBackend):
        def before_read(self, slot: int) -> None:
            if point == "before_read":
                bomb()

        def after_read(self, slot: int) -> None:
            if point == "after_read":
                bomb()

        def pump(self) -> None:
            if point == "pump":
                bomb()

    class Link(ThreadCollector):
        def send(self, *args: object, **kw: object) -> None:
            if point == "send":
                bomb()
            super().send(*args, **kw)  # type: ignore[arg-type]

    class Watcher(Observer):
        def transition(self, record: object, time_ns: int) -> None:
            if point == "transition":
                bomb()

        def span(self, name: str, *args: object, **kw: object) -> None:
            if point == "span":
                bomb()

    pipe = Pipeline(rb, sample_count=16, ring_depth=3, backend=Backend(copy=True),
                    collector=Link(rb, 3, 16), liveness_timeout=60)
    pipe.add_observer(Watcher())
    return pipe


def learner_loop(pipe: Pipeline) -> None:
    for tick in range(TICKS):
        pipe.start_prepare(tick, 16)
        if tick + 1 < TICKS:
            pipe.start_prepare(tick + 1, 16)
        pipe.batch_ready(tick, 16)
        pipe.wait_until_ready(tick, 16, timeout=60)
        batch = pipe.sample_large_batch(tick, 16)
        assert torch.equal(packed(batch, pipe), reference(pipe, tick))  # INV-DATA
        pipe.after_tick()


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("point", ["transition", "span", "before_read", "after_read",
                                   "pump", "send"])
def test_an_interrupt_at_any_callout_leaves_every_step_done_or_not(
        point: str, error: type[BaseException]) -> None:
    threads_before = set(threading.enumerate())
    for at in range(1, 200):
        bomb = Bomb(at, error)
        pipe = build(point, bomb)
        try:
            learner_loop(pipe)
        except KeyboardInterrupt:
            assert pipe.closed, f"{point} #{at}: an interrupted call must close"
        except PipelineFailed as exc:
            # on another thread, or an observer's or hook's own error: failed, chained
            assert isinstance(exc.__cause__, error), (point, at, exc)
        except RuntimeError as exc:
            assert error is RuntimeError and str(exc) == "injected", (point, at, exc)
        pipe.check_invariants()
        try:
            pipe.close()  # an observer may be interrupted by close's own transitions
        except error:
            assert pipe.closed
        pipe.check_invariants()
        assert set(threading.enumerate()) <= threads_before | {threading.current_thread()}
        if bomb.calls < at:  # the whole loop ran without reaching the bomb
            break
    else:
        pytest.fail(f"{point}: more than 200 callouts in {TICKS} ticks")
    assert at > 1, f"{point} was never called"


def test_a_learner_call_after_an_interrupt_says_closed() -> None:
    bomb = Bomb(3, KeyboardInterrupt)
    pipe = build("before_read", bomb)
    with pytest.raises(KeyboardInterrupt):
        learner_loop(pipe)
    with pytest.raises(PipelineClosed):
        pipe.start_prepare(10, 16)


OURS = ("pipeline.py", "links.py", "worker.py", "channel.py", "packer.py", "threading.py",
        "signals.py")


def _signal_points(code: object) -> set[int]:
    """The offsets in ``code`` where CPython runs a signal handler (and so where a
    Ctrl-C raises): right after a call returns, at a function's entry, at a
    backward jump."""
    import dis
    points, before = set(), None
    for ins in dis.get_instructions(code):  # type: ignore[arg-type]
        if ins.opname == "CACHE":
            continue
        if ins.opname in ("RESUME", "JUMP_BACKWARD") or (
                before is not None and before.opname in ("CALL", "CALL_FUNCTION_EX")):
            points.add(ins.offset)
        before = ins
    return points


def test_a_close_a_ctrl_c_cut_short_at_any_point_is_finished_by_the_next() -> None:
    """A KeyboardInterrupt at each point of close() where a signal handler can raise
    one, the stops of the link and the transfer worker included: the next close()
    (from another thread here) finishes it, within its bounds. A Ctrl-C right after
    close took its close lock left that lock taken for good, and one right after
    the transfer worker's Event.set() took the Event's own lock left that one:
    either way the pipeline stayed open and the next close() blocked for ever
    (the interpreter's exit too, in its hook) (helper-79)."""
    import sys
    threads_before = set(threading.enumerate())
    for at in range(1, 400):
        rb = ReplayBuffer(512, 4, 2)
        rb.add_packed(torch.randn(300, rb.width))
        pipe = Pipeline(rb, sample_count=16, collector="external", liveness_timeout=60)
        pipe.start_prepare(0, 16)
        count = 0

        def local(frame: Any, event: str, arg: object, at: int = at) -> Any:
            nonlocal count
            if event == "opcode" and frame.f_lasti in _signal_points(frame.f_code):
                count += 1
                if count == at:
                    raise KeyboardInterrupt("injected")
            return local

        def tracer(frame: Any, event: str, arg: object) -> Any:
            # The pipeline's code and threading's (its locks, Event, joins); not the
            # finalizers of multiprocessing's semaphores, which print what they take
            if not frame.f_code.co_filename.endswith(OURS):
                return None
            frame.f_trace_opcodes = True
            return local

        sys.settrace(tracer)
        try:
            pipe.close()
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        other = threading.Thread(target=pipe.close, daemon=True)
        other.start()
        other.join(MARGIN_S)
        assert not other.is_alive(), f"point {at}: the next close() blocks"
        assert pipe.closed and pipe.forced == [], (at, pipe.forced)
        assert set(threading.enumerate()) <= threads_before | {threading.current_thread()}
        if count < at:  # close() ran to its end before the interrupt
            break
    else:
        pytest.fail("more than 400 points in one close()")


def test_a_ctrl_c_right_after_the_learner_lets_go_of_the_lock_for_its_own_pack() -> None:
    """The learner packs a batch itself with the pipeline's lock released. A Ctrl-C
    right after that release returned (a point where Python's handler raises) was
    raised outside the try that takes the lock back: the call raised RuntimeError
    ("cannot release un-acquired lock") instead of the interrupt, and the pack was
    left marked as running, so a close on another thread waited 4 s for it and
    reported it forced (helper-79)."""
    import sys

    from replay_fsm.runtime.pipeline import Pipeline as RuntimePipeline

    tracer = _interrupting_right_after(RuntimePipeline._take_locked.__code__, "release")
    rb = ReplayBuffer(4096, 4, 2)
    rb.add_packed(torch.randn(2000, rb.width))
    # external, never attached: the learner packs the batch itself
    pipe = Pipeline(rb, sample_count=64, collector="external", liveness_timeout=60)
    pipe.start_prepare(0, 64)
    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt, match="injected"):
            pipe.sample_large_batch(0, 64)
    finally:
        sys.settrace(None)
    assert pipe.closed
    pipe.close()
    assert pipe.forced == []


def _interrupting_right_after(code: Any, name: str) -> Any:
    """A ``sys.settrace`` tracer that raises KeyboardInterrupt("injected") in ``code``
    right after its first call of method ``name`` returned (where a signal handler
    raises), once, and then stops tracing."""
    import dis
    import sys
    ins = [i for i in dis.get_instructions(code) if i.opname != "CACHE"]
    at = next(k for k, i in enumerate(ins) if i.argval == name)
    call = next(k for k in range(at, len(ins)) if ins[k].opname.startswith("CALL"))
    after = ins[call + 1].offset

    def local(frame: Any, event: str, arg: object) -> Any:
        if event == "opcode" and frame.f_lasti == after:
            sys.settrace(None)
            raise KeyboardInterrupt("injected")
        return local

    def tracer(frame: Any, event: str, arg: object) -> Any:
        if frame.f_code is code:
            frame.f_trace_opcodes = True
            return local
        return None

    return tracer


def test_a_ctrl_c_right_after_a_close_from_inside_a_step_took_its_lock() -> None:
    """An observer closes the pipeline from inside a step, and a Ctrl-C lands right
    after that close took its close lock (without blocking: the step holds the
    pipeline's lock): the close lock stayed taken for good, and a close on another
    thread blocked for ever (helper-82)."""
    import sys

    tracer = _interrupting_right_after(Pipeline.close.__code__, "acquire")

    class Closer(Observer):
        def __init__(self) -> None:
            self.pipe: Pipeline | None = None

        def transition(self, record: Any, time_ns: int) -> None:
            pipe, self.pipe = self.pipe, None
            if pipe is not None:
                sys.settrace(tracer)
                try:
                    pipe.close()
                finally:
                    sys.settrace(None)

        def span(self, *args: Any, **kwargs: Any) -> None:
            pass

    rb = ReplayBuffer(512, 4, 2)
    rb.add_packed(torch.randn(300, rb.width))
    pipe = Pipeline(rb, sample_count=16, collector="external", liveness_timeout=60)
    closer = Closer()
    pipe.add_observer(closer)
    closer.pipe = pipe
    with pytest.raises(KeyboardInterrupt, match="injected"):
        pipe.start_prepare(0, 16)
    other = threading.Thread(target=pipe.close, daemon=True)
    other.start()
    other.join(MARGIN_S)
    assert not other.is_alive(), "a close on another thread blocks"
    assert pipe.closed and pipe.forced == []


def test_a_ctrl_c_while_the_learner_takes_its_lock_back_after_its_own_pack() -> None:
    """Taking the pipeline's lock back after its own pack, the learner waits in
    RLock.acquire when another thread holds the lock, and Python's SIGINT handler
    raises there, without the lock: the caller's with-block then released a lock it
    did not hold, and the call raised RuntimeError ("cannot release un-acquired
    lock") instead of the interrupt (helper-82)."""
    import dis
    import signal
    import sys
    import time

    from replay_fsm.runtime.pipeline import Pipeline as RuntimePipeline

    retake = RuntimePipeline._retake_lock.__code__
    first = next(i for i in dis.get_instructions(retake) if i.argval == "acquire")
    line = first.positions.lineno if first.positions else None
    main = threading.main_thread()
    assert threading.current_thread() is main and line is not None

    def retaking() -> Any:
        """The main thread's frame taking the lock back, None outside it."""
        frame = sys._current_frames().get(main.ident or 0)
        while frame is not None and frame.f_code is not retake:
            frame = frame.f_back
        return frame

    rb = ReplayBuffer(4096, 4, 2)
    rb.add_packed(torch.randn(2000, rb.width))
    # external, never attached: the learner packs the batch itself
    pipe = Pipeline(rb, sample_count=64, collector="external", liveness_timeout=60)
    pipe.start_prepare(0, 64)
    packed, holding = threading.Event(), threading.Event()
    # What failed on either thread, raised by the test: a daemon thread's error is only
    # printed, and the library may take the learner's as its pack's and go on.
    failed: list[BaseException] = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            failed.append(AssertionError(f"{what} within {MARGIN_S} s"))
            raise failed[-1]

    take_chunks = pipe._link.take

    def take_then_let_the_holder_in(*args: Any, **kwargs: Any) -> Any:
        took = take_chunks(*args, **kwargs)  # its pack-done message needs the lock
        packed.set()
        # the holder takes the lock the learner let go of
        check(holding.wait(MARGIN_S), "the holder took no lock")
        return took

    pipe._link.take = take_then_let_the_holder_in  # type: ignore[method-assign]

    def poll(done: Callable[[], bool], what: str) -> None:
        """Until ``done()``: the main thread's frame, which nothing signals."""
        deadline = time.monotonic() + MARGIN_S
        while not done():
            check(time.monotonic() < deadline, what)
            time.sleep(0.001)

    def waits_to_take_it_back() -> bool:
        frame = retaking()
        return frame is not None and frame.f_lineno == line

    def raised_there() -> bool:  # the wait ended, or the handler raised in it
        frame = retaking()
        return frame is None or frame.f_locals.get("interrupted") is not None

    def hold_the_lock_and_interrupt() -> None:
        check(packed.wait(MARGIN_S), "the learner packed nothing")
        with pipe._lock:
            holding.set()
            poll(waits_to_take_it_back, "the learner did not wait to take the lock back")
            signal.pthread_kill(main.ident or 0, signal.SIGINT)
            poll(raised_there, "the SIGINT did not raise in the learner's wait")

    def holder_body() -> None:
        try:
            hold_the_lock_and_interrupt()
        except BaseException as exc:  # noqa: BLE001 - raised by the test below
            if exc not in failed:
                failed.append(exc)

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    holder = threading.Thread(target=holder_body, daemon=True)
    holder.start()
    try:
        with pytest.raises(KeyboardInterrupt) as info:
            pipe.sample_large_batch(0, 64)
    finally:
        signal.signal(signal.SIGINT, before)
        holder.join(MARGIN_S)
        if failed:
            raise failed[0]
    assert type(info.value) is KeyboardInterrupt and not holder.is_alive()
    assert pipe.closed
    pipe.close()
    assert pipe.forced == []
