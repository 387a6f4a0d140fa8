"""INV-STICKY under interruption: a KeyboardInterrupt (what Ctrl-C raises) or any
exception at any callout a learner call makes (observers, backend hooks, the
collector link) leaves every core step done or not done. In a loop over every
callout point and every position of the interrupt: the pipeline is consistent
afterwards (its invariants hold), an interrupted learner call has closed it (no
request is left taken but unsent, nothing waits on a learner that stopped), an
interrupt on another thread fails it chained, and nothing hangs."""

from __future__ import annotations

import threading

import pytest
import torch

from replay_fsm import Pipeline, PipelineFailed, ReplayBuffer
from replay_fsm.errors import PipelineClosed
from replay_fsm.runtime.links import ThreadCollector
from replay_fsm.runtime.observers import Observer
from replay_fsm.transfer.cpu import CpuBackend

from .drive import packed, reference

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
