"""Helpers shared by the tests: drive slot 0 into a state, apply one event; bound a
call that might block; stand-ins for a process that exited and for a link that only
has host slots; a Ctrl-C at each point where Python would take one."""

from __future__ import annotations

import contextlib
import dis
import gc
import os
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

from replay_fsm.core import Core
from replay_fsm.runtime.links import CollectorLink
from replay_fsm.spec import Event, SlotState
from replay_fsm.wire import PackDone

MARGIN_S = 30.0  # a loaded CI machine is slow, never this slow


class Exited:
    """A watched process that has exited (``watch`` reads pid, exitcode, is_alive)."""

    def __init__(self, pid: int = 4242, exitcode: int = -9) -> None:
        self.pid, self.exitcode = pid, exitcode

    def is_alive(self) -> bool:
        return False


class SlotsOnlyLink(CollectorLink):
    """A link with ``count`` host slots of ``rows`` x ``width`` (two by default) and
    nothing more: it has no packer handle, and nothing is sent to or received from it."""

    def __init__(self, rows: int, width: int, kind: str = "custom", *, count: int = 2
                 ) -> None:
        super().__init__()
        self.kind = kind  # type: ignore[misc]
        self.host_slots = [torch.zeros(rows, width) for _ in range(count)]

    def send(self, request: object, **kwargs: object) -> None:
        raise AssertionError("not used here")

    def receive(self, timeout: float) -> None:
        return None


def finishes_within(fn: Callable[[], Any], timeout: float = MARGIN_S
                    ) -> tuple[bool, list[Any]]:
    """Run ``fn`` in a daemon thread: whether it returned within ``timeout``, and
    ``[its result]`` if it did. What it raised within ``timeout`` is raised here, so an
    assert inside ``fn`` fails the caller (it once came back as ``(True, [])``, which a
    caller reading only the first passed). A call that blocks on stays blocked in that
    thread; what it raises after the caller stopped waiting is printed there, as any
    thread's."""
    got: list[Any] = []
    raised: list[BaseException] = []
    gave_up = threading.Event()

    def run() -> None:
        try:
            got.append(fn())
        except BaseException as exc:
            raised.append(exc)  # before the test below: no order of the two loses it
            if gave_up.is_set():
                raise

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    gave_up.set()
    if raised:
        raise raised[0]
    return not thread.is_alive(), got


def done_for(core: Core, slot: int) -> PackDone:
    tick = core.tick_of(slot)
    return PackDone(tick=-1 if tick is None else tick, slot=slot,
                    generation=core.generation_of(slot), seed=0, sample_count=1,
                    snapshot_ptr=1, snapshot_size=1)


def drive(state: SlotState, depth: int = 2, **kw: object) -> Core:
    """A core whose slot 0 holds tick 0 in ``state`` (or is IDLE/FAILED/CLOSED)."""
    core = Core(depth, **kw)  # type: ignore[arg-type]
    path = {
        SlotState.IDLE: [],
        SlotState.REQUESTED: [Event.REQUEST],
        SlotState.SUBMITTED: [Event.REQUEST, Event.SUBMIT],
        SlotState.READY: [Event.REQUEST, Event.SUBMIT, Event.COMPLETE],
        SlotState.HOT: [Event.REQUEST, Event.SUBMIT, Event.COMPLETE, Event.ACQUIRE],
        SlotState.FAILED: [Event.FAIL],
        SlotState.CLOSED: [Event.CLOSE],
    }[state]
    for event in path:
        apply(core, event)
    assert core.state(0) is state
    return core


def apply(core: Core, event: Event, slot: int = 0) -> object:
    """Fire ``event`` through the core's public step that targets ``slot``."""
    if event is Event.REQUEST:
        return core.request(0 if core.next_tick is None else core.next_tick)
    if event is Event.SUBMIT:
        return core.packed(done_for(core, slot))
    if event is Event.COMPLETE:
        return core.copied(slot)
    if event is Event.ACQUIRE:
        tick = core.tick_of(slot)
        return core.acquire(0 if tick is None else tick)
    if event is Event.RELEASE:
        return core.release()
    if event is Event.FAIL:
        return core.fail(RuntimeError("injected"))
    return core.close()


# The instructions after which Python checks for a pending signal (3.10's calls,
# 3.13's CALL_KW too).
CHECKED_AFTER = {"CALL", "CALL_KW", "CALL_FUNCTION_EX", "JUMP_BACKWARD", "CALL_FUNCTION",
                 "CALL_METHOD", "CALL_FUNCTION_KW", "JUMP_ABSOLUTE"}


# Code a sweep does not interrupt: multiprocessing's SemLock constructor, whose named
# semaphore is left in /dev/shm for good when a Ctrl-C lands between its creation and
# its finalizer's registration (the standard library's window, not ours: a sweep
# through a pipeline's constructor left a dozen files a run).
UNTOUCHED = (os.path.join("multiprocessing", "synchronize.py"),)


def _untouched(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.endswith(UNTOUCHED):
            return True
        frame = frame.f_back
    return False


def interrupted_at(k: int | None, action: Callable[[], object]
                   ) -> tuple[int, BaseException | None]:
    """Run ``action`` with KeyboardInterrupt raised at the ``k``-th point where Python
    would run a pending signal's handler (None: none): a Python frame's start or
    resumption, the instruction after a call or a jump back. Counted a little wide (a
    Python function's return is no such point), never narrow. Returns how many points
    it passed and the KeyboardInterrupt it raised (or an error of the library code it
    was handled in), None if none: what its traceback holds stays alive as long as
    the caller keeps it, as a REPL's last traceback does. Nothing inside UNTOUCHED is
    interrupted. Only the calling thread is traced, and no finalizer runs meanwhile
    (the garbage collector is off): where no other thread's work decides the path,
    the points are the same from run to run."""
    count = 0
    after_check: set[FrameType] = set()  # frames whose next instruction follows one

    def point(frame: FrameType) -> None:
        nonlocal count
        if _untouched(frame):
            return
        count += 1
        if count == k:
            raise KeyboardInterrupt

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            if frame in after_check:
                after_check.discard(frame)
                point(frame)
            if dis.opname[frame.f_code.co_code[frame.f_lasti]] in CHECKED_AFTER:
                after_check.add(frame)
        return local

    def call(frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        point(frame)
        return local

    gc.disable()
    try:
        try:
            sys.settrace(call)
            try:
                action()
            finally:
                sys.settrace(None)
        finally:
            gc.enable()
    except BaseException as exc:  # noqa: BLE001 - the interrupt's, or another's
        if not _from_interrupt(exc):
            raise
        return count, exc
    return count, None


def _from_interrupt(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a KeyboardInterrupt or was raised while one was handled:
    threading's Condition.wait, interrupted before it takes its lock back, has the
    with-block around it raise "release unlocked lock"."""
    while exc is not None:
        if isinstance(exc, KeyboardInterrupt):
            return True
        exc = exc.__context__
    return False


def adds_are_paused(rb: Any) -> bool:
    """Whether a ReplayBuffer's write lock is held now, by this thread or another:
    probed from a thread of its own (the lock is recursive: this thread would take it
    again), which gives it back at once if it was free, so a probe never pauses the
    adds."""
    took: list[bool] = []

    def probe() -> None:
        took.append(rb._write_lock.acquire(block=False))
        if took[0]:
            rb._write_lock.release()
    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return took == [False]


def threads_running_on(prefix: str, before: set[int | None]) -> list[str]:
    """The threads named ``prefix``... that were not among ``before`` (their idents)
    and are still running after each was given MARGIN_S to end. A thread whose start
    a Ctrl-C cut short before it began never runs (joining it raises)."""
    running = []
    for thread in threading.enumerate():
        if thread.name.startswith(prefix) and thread.ident not in before:
            with contextlib.suppress(RuntimeError):
                thread.join(MARGIN_S)
            if thread.is_alive():
                running.append(thread.name)
    return running


def stall_the_warm_ups(monkeypatch: Any) -> None:
    """The environments of the SAC trainer's and the demo's thread collectors hang
    at their second step, until the run ends that collector: rows stop coming while
    the learner waits for the warm-up's. Each SAC collector hangs (it looks whether it
    is told to stop); the demo's once, until the run ends its collector."""
    import time

    from replay_fsm.demo import env, runner
    from replay_fsm.trainers import collector

    sac_step, sac_calls = collector._Collector.step, {}

    def sac_hanging(self: Any, action: Any) -> None:
        sac_calls[id(self)] = sac_calls.get(id(self), 0) + 1
        if sac_calls[id(self)] == 2:
            until = time.monotonic() + MARGIN_S
            while not self.stopped and time.monotonic() < until:
                time.sleep(0.01)  # an environment hung until the trainer stops it
        sac_step(self, action)

    demo_step, demo_calls, release = env.PointMass.step, [0], threading.Event()

    def demo_hanging(self: Any, action: Any) -> Any:
        demo_calls[0] += 1
        if demo_calls[0] == 2:
            release.wait(MARGIN_S)
        return demo_step(self, action)

    end_worker = runner.end_worker

    def releasing(*args: Any, **kwargs: Any) -> None:
        release.set()
        end_worker(*args, **kwargs)

    monkeypatch.setattr(collector._Collector, "step", sac_hanging)
    monkeypatch.setattr(env.PointMass, "step", demo_hanging)
    monkeypatch.setattr(runner, "end_worker", releasing)
