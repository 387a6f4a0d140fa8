"""Races of close() and of the learner's own pack (``learner_packs``) with the other
threads: the learner's take lets go of the pipeline's lock, so the wait must look
again after it; two closes at once must not run the stops side by side."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import pytest
import torch

from replay_fsm import Pipeline, ReplayBuffer
from replay_fsm.data.packer import Packer
from replay_fsm.errors import PipelineClosed, PipelineFailed
from replay_fsm.spec import SlotState
from replay_fsm.transfer.cpu import CpuBackend

N = 64


def buffer() -> ReplayBuffer:
    rb = ReplayBuffer(1000, 3, 2)
    rb.add_packed(torch.randn(200, rb.width))
    return rb


def during_take(pipe: Pipeline, act: Any) -> None:
    """Run ``act()`` to its end on another thread while the learner is inside its
    take (the pipeline's lock released), then let the take go on."""
    link: Any = pipe._link
    original = link.take

    def take(request: Any, timeout: float, *, give_up: Any = None) -> Any:
        helper = threading.Thread(target=act)
        helper.start()
        helper.join(30)
        return original(request, timeout, give_up=give_up)

    link.take = take


@pytest.mark.parametrize("collector", ["thread", "external"])
def test_a_close_while_the_learner_packs_its_batch_raises_pipeline_closed(
        collector: str) -> None:
    """INV-STICKY: a call on a pipeline another thread closed raises PipelineClosed,
    not the watchdog's verdict on the sides close stopped ("the packer thread exited",
    "the transfer worker thread exited")."""
    pipe = Pipeline(buffer(), sample_count=N, collector=collector)
    if collector == "thread":  # the packer thread must leave the request to the learner
        packer: Any = pipe._link._packer
        packer.service = lambda timeout=0.0: (threading.Event().wait(timeout), False)[1]
    during_take(pipe, pipe.close)
    pipe.start_prepare(0, N)
    with pytest.raises(PipelineClosed):
        pipe.sample_large_batch(0, N)
    pipe.close()


def test_a_batch_made_ready_during_the_learners_take_ends_the_wait_at_once() -> None:
    """The collector serves the tick while the learner's take has the lock released:
    the take finds nothing left, and the wait returns the READY batch without a wait
    slice (the copy's notify_all came while the learner was not waiting)."""
    rb = buffer()
    pipe = Pipeline(rb, sample_count=N, collector="external")
    collector = Packer.attach(pipe.packer_handle(), rb)

    def serve() -> None:
        while not collector.service(timeout=0.01):
            pass
        # the copy's notify_all, while the learner is in its take (a timed wait: no
        # take of its own)
        assert pipe.wait_until_ready(0, N, timeout=30)
        assert pipe.states[0] is SlotState.READY

    during_take(pipe, serve)
    waits: list[float | None] = []
    learner = threading.get_ident()

    class Counting(threading.Condition):
        def wait(self, timeout: float | None = None) -> bool:
            if threading.get_ident() == learner:
                waits.append(timeout)
            return super().wait(timeout)

    pipe._cv = Counting(pipe._lock)
    pipe.start_prepare(0, N)
    pipe.sample_large_batch(0, N)
    assert waits == []
    pipe.close()


class SlowClose(CpuBackend):
    """A backend whose close takes a while and counts the closes inside it at once."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = self.most = self.calls = 0

    def close(self) -> None:
        self.calls += 1
        self.inside += 1
        self.most = max(self.most, self.inside)
        time.sleep(0.2)
        self.inside -= 1


def test_two_closes_at_once_run_the_stops_once_and_both_return_closed() -> None:
    """INV-CLOSE, idempotent from two threads: the second close waits for the first
    and returns, neither raises, and the stops run once."""
    backend = SlowClose()
    pipe = Pipeline(buffer(), sample_count=N, backend=backend)
    pipe.start_prepare(0, N)
    errors: list[BaseException] = []
    stopped: list[bool] = []
    barrier = threading.Barrier(2)

    def close() -> None:
        barrier.wait()
        try:
            pipe.close()
        except BaseException as exc:  # noqa: BLE001 - the test's verdict
            errors.append(exc)
        stopped.append(pipe._stopped)

    threads = [threading.Thread(target=close) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert stopped == [True, True]
    assert (backend.calls, backend.most) == (1, 1)


class HeldClose(CpuBackend):
    """A backend whose close waits until the test lets it go."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def close(self) -> None:
        self.entered.set()
        assert self.release.wait(60)
        super().close()


def test_the_exit_hook_stops_a_pipeline_after_a_close_on_another_thread_not_beside_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter's exit hook (``_stop_at_exit``) ran the stops without the close
    lock, beside a daemon thread's close still inside them: the link and the worker
    were stopped twice at once. It now waits for that close (bounded) and finds the
    pipeline stopped."""
    import replay_fsm.runtime.pipeline as pipeline_module

    monkeypatch.setattr(pipeline_module, "STOP_TIMEOUT_S", 60.0)  # the wait's bound
    backend = HeldClose()
    pipe = Pipeline(buffer(), sample_count=N, backend=backend)
    pipe.start_prepare(0, N)
    stops: list[str] = []
    exit_hook_reached = threading.Event()  # it asked for the close lock, or stopped
    link: Any = pipe._link
    original_stop, original_lock = link.stop, pipe._close_lock

    def stop(timeout: float) -> list[str]:
        stops.append(threading.current_thread().name)
        if threading.current_thread().name == "exit-hook":
            exit_hook_reached.set()
        return original_stop(timeout)

    class SpyLock:
        def acquire(self, *args: Any, **kwargs: Any) -> bool:
            if threading.current_thread().name == "exit-hook":
                exit_hook_reached.set()
            return original_lock.acquire(*args, **kwargs)

        def release(self) -> None:
            original_lock.release()

        def __enter__(self) -> bool:  # close() takes it in a with-statement
            return self.acquire()

        def __exit__(self, *exc: object) -> None:
            self.release()

    link.stop, pipe._close_lock = stop, SpyLock()  # type: ignore[assignment]
    closer = threading.Thread(target=pipe.close, name="closer", daemon=True)
    closer.start()
    assert backend.entered.wait(60)  # the close is inside the backend's close
    hook = threading.Thread(target=pipe._stop_at_exit, name="exit-hook", daemon=True)
    hook.start()
    assert exit_hook_reached.wait(60)
    backend.release.set()
    closer.join(60)
    hook.join(60)
    assert not closer.is_alive() and not hook.is_alive()
    assert stops == ["closer"] and pipe._stopped


def test_the_exit_hook_waits_for_stuck_closes_once_not_once_per_pipeline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Pipelines whose closes on daemon threads are stuck in the backend's drain: the
    exit hook waited STOP_TIMEOUT_S for each close lock in turn (three pipelines, three
    bounds: 12 s at 4 s), then stopped each beside its close. The waits now share one
    bound (helper-70)."""
    import weakref

    import replay_fsm.runtime.pipeline as pipeline_module

    monkeypatch.setattr(pipeline_module, "STOP_TIMEOUT_S", 1.0)
    backends = [HeldClose() for _ in range(3)]
    pipes = [Pipeline(buffer(), sample_count=N, backend=b) for b in backends]
    monkeypatch.setattr(pipeline_module, "_OPEN", weakref.WeakSet(pipes))
    try:
        for pipe, backend in zip(pipes, backends, strict=True):
            pipe.start_prepare(0, N)
            threading.Thread(target=pipe.close, daemon=True).start()
            assert backend.entered.wait(60)
        began = time.monotonic()
        pipeline_module._stop_open_pipelines()
        took = time.monotonic() - began
    finally:
        for backend in backends:
            backend.release.set()
    assert took < 2.5, took


def test_the_exit_hook_ends_the_emulated_copy_engine() -> None:
    """The exit hook stopped the link and the worker, not the emulated backend's copy
    engine (a daemon thread): an order still queued (an exception raised out of the
    learner's loop) was copied while the interpreter finalized, and the engine,
    retaking the GIL inside ``Tensor.copy_``, was ended in C++ code: "terminate called
    without an active exception", exit code 134, in 2 of 6 runs (helper-91). The
    backend's ``stop_at_exit`` now ends it after the orders it has."""
    pipe = Pipeline(buffer(), sample_count=N, backend="emulated")
    try:
        pipe.start_prepare(0, N)
        engine = pipe.backend._engine  # type: ignore[attr-defined]
        assert engine is not None and engine.is_alive()
        pipe._stop_at_exit()
        assert not engine.is_alive()
    finally:
        pipe.close()


class StopAtExitRaises(CpuBackend):
    """A backend whose ``stop_at_exit`` raises, or stops the exit with ``stop``."""

    def __init__(self, stop: BaseException | None = None) -> None:
        super().__init__()
        self.stop, self.stopped_at_exit = stop, False

    def stop_at_exit(self, timeout: float) -> list[str]:
        self.stopped_at_exit = True
        raise self.stop or RuntimeError("the copy engine would not stop")


def test_a_stop_at_exit_that_raises_is_reported_not_dropped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend's stop_at_exit that raised at the interpreter's exit vanished: no word
    on standard error, exit code 0. It is a RuntimeWarning now, once every pipeline
    left open is stopped (the others were and are); a filter that makes warnings
    errors raises it then, and never in place of a Ctrl-C taken on the way."""
    import warnings
    import weakref

    import replay_fsm.runtime.pipeline as pipeline_module

    def exit_with(*backends: CpuBackend) -> list[Pipeline]:
        pipes = [Pipeline(buffer(), sample_count=N, backend=b) for b in backends]
        monkeypatch.setattr(pipeline_module, "_OPEN", weakref.WeakSet(pipes))
        return pipes

    pipes = exit_with(StopAtExitRaises(), CpuBackend())
    with pytest.warns(RuntimeWarning) as caught:
        pipeline_module._stop_open_pipelines()
    assert [str(w.message) for w in caught] == [
        "replay_fsm: a Pipeline left open, stopped at the interpreter's exit: its "
        "backend's stop_at_exit raised RuntimeError: the copy engine would not stop"]
    assert not any(pipe._worker._thread.is_alive() for pipe in pipes)
    (linked,) = exit_with(CpuBackend())
    link: Any = linked._link
    stop = link.stop

    def stop_raises(timeout: float) -> list[str]:
        stop(timeout)
        raise OSError("the packer's channel is gone")

    link.stop = stop_raises
    with pytest.warns(RuntimeWarning) as caught:
        pipeline_module._stop_open_pipelines()
    assert [str(w.message) for w in caught] == [
        "replay_fsm: a Pipeline left open, stopped at the interpreter's exit: a stop of its "
        "collector link or an observer's close raised OSError: the packer's channel is gone"]
    link.stop = stop
    backends = [StopAtExitRaises(), StopAtExitRaises(KeyboardInterrupt())]
    pipes += exit_with(*backends)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(KeyboardInterrupt):
            pipeline_module._stop_open_pipelines()
        assert all(backend.stopped_at_exit for backend in backends)
        pipes += exit_with(StopAtExitRaises())
        with pytest.raises(RuntimeWarning, match="stop_at_exit raised RuntimeError: the "
                                                 "copy engine would not stop$"):
            pipeline_module._stop_open_pipelines()
    for pipe in [*pipes, linked]:
        with contextlib.suppress(OSError):  # linked: the error its exit stop kept
            pipe.close()


def test_the_exit_hooks_report_comes_after_the_programs_own_error() -> None:
    """At a real exit, the report follows the traceback of the error that ended the
    program, whose exit code stays."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import torch
        from replay_fsm import Pipeline, ReplayBuffer
        from replay_fsm.transfer.cpu import CpuBackend

        class Raises(CpuBackend):
            def stop_at_exit(self, timeout):
                raise RuntimeError("the copy engine would not stop")

        rb = ReplayBuffer(256, 3, 2)
        rb.add_packed(torch.randn(256, rb.width))
        pipe = Pipeline(rb, sample_count=8, backend=Raises())
        pipe.start_prepare(0, 8)
        raise ValueError("the trainer's own error")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1, done.stderr
    error = done.stderr.index("ValueError: the trainer's own error")
    report = done.stderr.index("RuntimeWarning: replay_fsm: a Pipeline left open, stopped "
                               "at the interpreter's exit: its backend's stop_at_exit "
                               "raised RuntimeError: the copy engine would not stop")
    assert error < report, done.stderr


class Boom(RuntimeError):
    pass


class SubmitRaisesOnTheWorker(CpuBackend):
    def submit(self, order: Any) -> None:
        if threading.current_thread().name == "replay_fsm-transfer":
            raise Boom("the backend's submit failed")
        super().submit(order)


def test_a_failure_while_the_learner_packs_is_raised_chained_to_its_cause() -> None:
    """INV-STICKY: the transfer worker fails the run (its backend's submit raised) and
    exits while the learner is inside its take: the learner raises PipelineFailed
    chained to that error, not the watchdog's "the transfer worker thread exited"."""
    rb = buffer()
    pipe = Pipeline(rb, sample_count=N, collector="external",
                    backend=SubmitRaisesOnTheWorker())
    collector = Packer.attach(pipe.packer_handle(), rb)

    def serve_and_let_the_worker_fail() -> None:
        while not collector.service(timeout=0.01):
            pass
        pipe._worker._thread.join(30)

    during_take(pipe, serve_and_let_the_worker_fail)
    pipe.start_prepare(0, N)
    with pytest.raises(PipelineFailed) as info:
        pipe.sample_large_batch(0, N)
    assert isinstance(info.value.__cause__, Boom)
    pipe.close()


def test_the_trace_can_be_read_while_other_threads_append_to_it() -> None:
    """Tracer readers run while the pipeline's threads record transitions (a demo
    interrupted mid-run writes its files with copies still completing): an event
    appended during a read, as another thread's would be, does not break it."""
    from replay_fsm.runtime.tracer import Tracer

    tracer = Tracer(capacity=4)

    class Appends(dict):  # type: ignore[type-arg]
        """An event whose reading lets "another thread" record one more."""

        def __getitem__(self, key: str) -> Any:
            tracer._events.append(Appends(self))
            return super().__getitem__(key)

    event = {"kind": "span", "name": "pack", "actor": "packer", "start_ns": 0,
             "end_ns": 1, "tick": 0, "slot": 0, "args": {}}
    for _ in range(4):
        tracer._events.append(Appends(event))
    assert tracer.transitions() == []
    assert len(tracer.chrome_trace()["traceEvents"]) > 4


def test_close_from_another_thread_waits_for_the_learners_own_pack() -> None:
    """INV-CLOSE: no pack in flight once close() returns. A close from another
    thread while the learner packs its batch itself (the lock let go) returned
    while the learner still wrote the host slot."""
    pipe = Pipeline(buffer(), sample_count=N, collector="external")
    order: list[str] = []
    link: Any = pipe._link
    original = link.take

    def closer() -> None:
        pipe.close()
        order.append("close returned")

    closing = threading.Thread(target=closer)

    def take(request: Any, timeout: float, *, give_up: Any = None) -> Any:
        closing.start()
        closing.join(2.0)  # close returns meanwhile only if it does not wait for us
        took = original(request, timeout, give_up=give_up)
        order.append("pack ended")
        return took

    link.take = take
    pipe.start_prepare(0, N)
    with pytest.raises(PipelineClosed):
        pipe.sample_large_batch(0, N)
    closing.join(30)
    assert order == ["pack ended", "close returned"]
    assert pipe.forced == []


def test_close_ends_a_learners_pack_held_up_by_a_stopped_writer() -> None:
    """The learner's own gather reads again rows an add (a writer stopped inside it)
    is writing: a close from another thread, which waits for that pack, ends it with
    PipelineClosed (its give_up sees the close) well before liveness_timeout (60 s
    here), and forces nothing (the wait for the pack did not run out)."""
    rb = buffer()
    pipe = Pipeline(rb, sample_count=N, collector="external", liveness_timeout=60)
    link: Any = pipe._link
    original = link.take
    taking = threading.Event()

    def take(request: Any, timeout: float, *, give_up: Any = None) -> Any:
        taking.set()
        return original(request, timeout, give_up=give_up)

    link.take = take
    got: list[BaseException] = []

    def learner() -> None:
        try:
            pipe.sample_large_batch(0, N)
        except BaseException as exc:  # noqa: BLE001 - the test's verdict
            got.append(exc)

    pipe.start_prepare(0, N)
    rb._seq += 1  # every region being written, by no process found dead
    try:
        thread = threading.Thread(target=learner)
        thread.start()
        assert taking.wait(30)
        pipe.close()
        thread.join(30)
        assert not thread.is_alive()
    finally:
        rb._seq += 1
        thread.join(60)
    assert len(got) == 1 and isinstance(got[0], PipelineClosed), got
    assert pipe.forced == []


@pytest.mark.timeout(60)
def test_a_close_inside_a_step_while_another_thread_closes_does_not_deadlock() -> None:
    """INV-LIVE (close always returns): an observer's close on the transfer worker
    runs under the pipeline's lock; another thread's close, which holds the close
    lock and needs the pipeline's, started meanwhile. Waiting for the close lock
    there deadlocked both for good."""
    from replay_fsm.runtime.observers import Observer

    inside, user_holds = threading.Event(), threading.Event()
    pipes: list[Pipeline] = []

    class CloseOnTheWorker(Observer):
        def transition(self, record: Any, time_ns: int) -> None:
            if (threading.current_thread().name == "replay_fsm-transfer"
                    and not inside.is_set()):
                inside.set()
                assert user_holds.wait(30)  # the user's close holds the close lock
                pipes[0].close()

    pipe = Pipeline(buffer(), sample_count=N, collector="thread")
    pipes.append(pipe)
    closer = threading.Thread(target=lambda: pipe.close(), daemon=True)

    class Telling:
        """The close lock, saying when the user's closing thread holds it."""

        def __init__(self, lock: Any) -> None:
            self.lock = lock

        def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
            got = self.lock.acquire(blocking, timeout)
            if got and threading.current_thread() is closer:
                user_holds.set()
            return bool(got)

        def release(self) -> None:
            self.lock.release()

        def __enter__(self) -> bool:
            return self.acquire()

        def __exit__(self, *exc: object) -> None:
            self.release()

    pipe._close_lock = Telling(pipe._close_lock)  # type: ignore[assignment]
    pipe.add_observer(CloseOnTheWorker())
    pipe.start_prepare(0, N)
    assert inside.wait(30)
    closer.start()
    closer.join(20)
    assert not closer.is_alive(), "the two closes deadlocked"
    assert pipe._stopped and pipe.forced == []
