"""The seed's class served by a seed-style collector (a thread, a spawned process), and
what happens when that collector dies: the learner raises instead of hanging, with
no call the seed lacked. Behaviour by behaviour: tests/test_compat_behaviour.py."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
from typing import Any

import pytest
import torch

from replay_fsm import ReplayBuffer
from replay_fsm.compat import CollectorDied, CPUPinnedDoubleBufferReplayPipeline, link
from replay_fsm.compat.link import SlotHolders
from replay_fsm.data.sampling import expected_batch
from replay_fsm.errors import CollectorDied as AnyCollectorDied

from .collectors import SeedStyleBuffer, add_rows, hold_slots, rows_of, seed_collector, seed_pack
from .drive import packed
from .support import MARGIN_S

N = 32
BASE_SEED = 77


def filled(kind: str) -> Any:
    rb: Any = (SeedStyleBuffer(4096, 4, 2, critic_dim=3) if kind == "seed-style"
               else ReplayBuffer(4096, 4, 2, critic_dim=3, region_rows=32))
    add_rows(rb, torch.randn(400, rows_of(rb)[2].shape[1]))
    return rb


class Collector:
    """A seed-style collector with its queues and slots, in a thread or a process."""

    def __init__(self, rb: Any, where: str, **behaviour: Any) -> None:
        width = rows_of(rb)[2].shape[1]
        self.slots = [torch.zeros(N, width).share_memory_() for _ in range(2)]
        if where == "thread":
            self.requests: Any = queue.Queue()
            self.ready: Any = queue.Queue()
            self.stop: Any = threading.Event()
            self.worker: Any = threading.Thread(
                target=seed_collector, args=(rb, self.requests, self.ready, self.slots,
                                             self.stop), kwargs=behaviour, daemon=True)
        else:
            ctx = mp.get_context("spawn")
            self.requests, self.ready = ctx.Queue(maxsize=1), ctx.Queue(maxsize=1)
            self.stop = ctx.Event()
            self.worker = ctx.Process(
                target=seed_collector, args=(rb, self.requests, self.ready, self.slots,
                                             self.stop), kwargs=behaviour, daemon=True)
        self.worker.start()

    def pipeline(self, rb: Any, **kw: Any) -> CPUPinnedDoubleBufferReplayPipeline:
        return CPUPinnedDoubleBufferReplayPipeline(
            rb, device="cpu", sample_count=N, base_seed=BASE_SEED,
            collector_pack_request_queue=self.requests,
            collector_pack_ready_queue=self.ready, collector_pack_shared_slots=self.slots,
            **kw)

    def finish(self) -> None:
        self.stop.set()
        self.worker.join(30)


def learn(pipe: CPUPinnedDoubleBufferReplayPipeline, rb: Any, ticks: range) -> None:
    """The seed's learner loop (UniLab's runner): ready? else wait; sample; request the
    next tick for rows not yet written; train; release. Checks every batch bit for bit."""
    for tick in ticks:
        if not pipe.batch_ready(tick, N):
            assert pipe.wait_until_ready(tick, N)
        batch = pipe.sample_large_batch(tick, N)
        hot = pipe.pipeline.hot
        assert hot is not None
        done = pipe.pipeline.pack_record(hot[0])
        assert done.seed == BASE_SEED + tick
        reference = expected_batch(rows_of(rb)[2], done.snapshot_size, N, done.seed)
        assert torch.equal(packed(batch, pipe.pipeline), reference), f"tick {tick}"
        pipe.start_prepare(tick + 1, N, min_snapshot_ptr=rows_of(rb)[0] + 8)
        add_rows(rb, torch.randn(8, rows_of(rb)[2].shape[1]))  # the collector waits for these
        pipe.after_tick()


@pytest.mark.parametrize("buffer", ["seed-style", "replay_fsm"])
@pytest.mark.parametrize("where", ["thread", "process"])
def test_a_seed_style_collector_serves_the_compat_class(where: str, buffer: str) -> None:
    rb = filled(buffer)
    collector = Collector(rb, where)
    pipe = collector.pipeline(rb)
    try:
        learn(pipe, rb, range(1, 9))
        assert pipe.start_prepare(9, N) is False  # requested by the last tick already
    finally:
        pipe.close()
        collector.finish()


@pytest.mark.parametrize("how", ["caught", "raise", "exit"])
def test_a_dead_collector_process_raises_collector_died_in_the_waiting_learner(how: str
                                                                              ) -> None:
    """INV-LIVE through the seed's API alone: the learner never calls watch(); the
    collector is the child process that holds the shared slots. UniLab's collector
    catches its exception and exits 0 ("caught"): that is a death too."""
    rb = filled("seed-style")
    collector = Collector(rb, "process", crash_after=2, how=how)
    pipe = collector.pipeline(rb)
    try:
        learn(pipe, rb, range(1, 3))
        started = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            pipe.sample_large_batch(3, N)
        assert time.monotonic() - started < 10
        died = info.value
        assert isinstance(died, CollectorDied) and isinstance(died, AnyCollectorDied)
        assert f"pid {collector.worker.pid}" in str(died) and str(died).startswith("tick 3: ")
        assert f"exited with code {collector.worker.exitcode}" in str(died)
        with pytest.raises(CollectorDied) as again:  # sticky: every later call raises it
            pipe.start_prepare(4, N)
        assert again.value is died
        with pytest.raises(CollectorDied):
            pipe.batch_ready(3, N)
    finally:
        pipe.close()
        collector.finish()


class LinkClock:
    """The compat link's ``time``: its ``monotonic_ns`` is what the test sets, so the
    collector's silence grows only when the test says (``advance``). Counts the
    link's stall checks (``SeedQueueLink._stalled``) as they come."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ns = time.monotonic_ns()
        self.checks = 0
        self._cv = threading.Condition()
        monkeypatch.setattr(link, "time", self)
        stalled = link.SeedQueueLink._stalled

        def counted(this: link.SeedQueueLink) -> Any:
            try:
                return stalled(this)
            finally:
                with self._cv:
                    self.checks += 1
                    self._cv.notify_all()

        monkeypatch.setattr(link.SeedQueueLink, "_stalled", counted)

    def monotonic_ns(self) -> int:
        return self.ns

    def advance(self, seconds: float) -> None:
        """Move the clock on, then wait for a stall check begun after the move (the
        second check from now: one may be under way)."""
        with self._cv:
            seen = self.checks
            self.ns += int(seconds * 1e9)
            assert self._cv.wait_for(lambda: self.checks >= seen + 2, MARGIN_S)


def test_a_collector_thread_that_died_ends_the_wait_after_stall_timeout() -> None:
    """No process to see: a request with no ready dict and no row added for
    stall_timeout seconds ends the wait."""
    rb = filled("seed-style")
    collector = Collector(rb, "thread", crash_after=1, how="caught")
    pipe = collector.pipeline(rb, stall_timeout=0.5)
    try:
        pipe.sample_large_batch(0, N)
        requested = time.monotonic()
        pipe.start_prepare(1, N)  # the collector takes it and dies
        pipe.after_tick()
        with pytest.raises(CollectorDied, match="stall_timeout"):
            pipe.wait_until_ready(1, N)
        assert 0.5 <= time.monotonic() - requested < MARGIN_S
    finally:
        pipe.close()
        collector.finish()


def test_the_silence_counts_from_the_request_not_from_the_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On the link's clock: the silence counts from the request, over the learner's
    training step and every wait after it (counted from each wait's start, a learner
    whose waits are shorter than stall_timeout would never learn of it). The step, a
    stretch no look saw, counts for half of stall_timeout (the whole job stopped with
    Ctrl-Z is no stall: ``looks.LookClock``); the looks after it judge."""
    clock = LinkClock(monkeypatch)
    rb = filled("seed-style")
    collector = Collector(rb, "thread", crash_after=1, how="caught")
    pipe = collector.pipeline(rb, stall_timeout=0.5)
    try:
        pipe.sample_large_batch(0, N)
        pipe.start_prepare(1, N)  # the collector takes it and dies
        pipe.after_tick()
        clock.ns += int(0.8e9)  # the learner's training step
        assert not pipe.wait_until_ready(1, N, timeout=0)  # 0.25 s of it counted
        clock.ns += int(0.2e9)
        assert not pipe.wait_until_ready(1, N, timeout=0)  # 0.45 s
        clock.ns += int(0.1e9)
        with pytest.raises(CollectorDied, match="stall_timeout"):
            pipe.wait_until_ready(1, N, timeout=0)  # 0.55 s
    finally:
        pipe.close()
        collector.finish()


def test_a_slow_collector_that_adds_rows_is_not_taken_for_dead(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On the link's clock: the collector holds the request for 1 s, over three
    stall timeouts, adding a row each 0.1 s with a stall check after each, then
    serves it. Rows coming are its sign of life (counted from the request alone, the
    check at 0.4 s would declare it dead)."""
    clock = LinkClock(monkeypatch)
    rb = filled("seed-style")
    requests: Any = queue.Queue()
    ready: Any = queue.Queue()
    slots = [torch.zeros(N, rows_of(rb)[2].shape[1]).share_memory_() for _ in range(2)]
    failed: list[BaseException] = []

    def slow_collector() -> None:
        try:
            request = requests.get(timeout=MARGIN_S)
            for _ in range(10):
                add_rows(rb, torch.zeros(1, rows_of(rb)[2].shape[1]))
                clock.advance(0.1)
            ready.put(seed_pack(rb, request, slots))
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            failed.append(exc)

    worker = threading.Thread(target=slow_collector, daemon=True)
    worker.start()
    pipe = CPUPinnedDoubleBufferReplayPipeline(
        rb, device="cpu", sample_count=N, base_seed=BASE_SEED, stall_timeout=0.3,
        collector_pack_request_queue=requests, collector_pack_ready_queue=ready,
        collector_pack_shared_slots=slots)
    try:
        assert pipe.wait_until_ready(0, N, timeout=MARGIN_S)
        assert pipe.batch_ready(0, N)
    finally:
        pipe.close()
        worker.join(MARGIN_S)
    assert not worker.is_alive() and not failed


def test_a_child_process_that_does_not_hold_the_slots_may_exit_meanwhile(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the learner's children that hold collector_pack_shared_slots are watched.
    The collector serves once the helper has exited and a look for dead slot holders
    begun after that has ended: before, it served 3 s after the request, and a helper
    slower than that to start and exit (a spawned interpreter on a loaded machine;
    1.4 s seen beside two busy loops, helper-128) was still alive then."""
    looks, count = threading.Condition(), [0]
    dead = SlotHolders.dead

    def counted(self: SlotHolders) -> Any:
        try:
            return dead(self)
        finally:
            with looks:
                count[0] += 1
                looks.notify_all()
    monkeypatch.setattr(SlotHolders, "dead", counted)
    rb = filled("seed-style")
    seen_gone = threading.Event()
    collector = Collector(rb, "thread", add_every_s=0.05, serve_when=seen_gone)
    pipe = collector.pipeline(rb)
    helper = mp.get_context("spawn").Process(target=time.sleep, args=(0.3,))

    def after_the_helper() -> None:
        helper.join(4 * MARGIN_S)
        with looks:  # the second look from now began after the exit
            after = count[0] + 2
            if looks.wait_for(lambda: count[0] >= after, MARGIN_S):
                seen_gone.set()
    try:
        helper.start()
        pipe.start_prepare(0, N)  # sees the helper alive
        threading.Thread(target=after_the_helper, daemon=True).start()
        assert pipe.wait_until_ready(0, N)
        assert helper.exitcode == 0  # it exited while the learner waited
    finally:
        pipe.close()
        collector.finish()
        helper.join(30)


def kill_and_see_it_gone(holders: SlotHolders, collector: Any) -> None:
    """SIGKILL ``collector``, a process named "collector" that holds the slots: the
    holders name it, its pid, what it holds and its exit code."""
    collector.kill()
    collector.join(30)
    gone = holders.dead()
    assert gone is not None and gone.reason == (
        f"the collector process collector (pid {collector.pid}, it holds "
        "collector_pack_shared_slots) exited with code -9")


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_a_spawned_child_holding_the_slots_is_recognised_from_its_start() -> None:
    slots = [torch.zeros(4, 3).share_memory_() for _ in range(2)]
    holders = SlotHolders(slots)
    ctx = mp.get_context("spawn")
    collector = ctx.Process(target=hold_slots, args=(slots, 60.0), name="collector")
    other = ctx.Process(target=time.sleep, args=(60.0,))
    collector.start()
    other.start()
    try:
        holders.scan()  # right away: the child is still starting its interpreter
        assert [p.pid for p in holders.collectors] == [collector.pid]
        assert holders.dead() is None
        other.kill()
        kill_and_see_it_gone(holders, collector)
    finally:
        for proc in (collector, other):
            proc.kill()
            proc.join(30)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_slots_made_without_share_memory_are_recognised_once_torch_shares_them() -> None:
    """A seed user may skip share_memory_(): torch moves the slots into shared memory
    in place when it pickles them for a spawned child. The holders made before then
    look for the slots' files again, and know that child, and its exit, as for slots
    shared from the start (it was left to stall_timeout, 60 s)."""
    slots = [torch.zeros(4, 3) for _ in range(2)]
    holders = SlotHolders(slots)
    assert holders.dead() is None  # nothing in shared memory yet
    collector = mp.get_context("spawn").Process(target=hold_slots, args=(slots, 60.0),
                                                name="collector")
    collector.start()
    try:
        assert all(s.is_shared() for s in slots)
        holders.scan()
        assert [p.pid for p in holders.collectors] == [collector.pid]
        kill_and_see_it_gone(holders, collector)
    finally:
        collector.kill()
        collector.join(30)
