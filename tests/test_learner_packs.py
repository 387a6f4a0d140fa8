"""The learner packs the chunks of a batch the packer has not reached
(Pipeline(learner_packs=True), specs/LEARNER_PACKS.md): one writer per chunk (the
claim cells), one pack-done message per request from whoever counts its last chunk,
every batch INV-DATA's whoever packed it, a failed chunk abandoning the request, a
taken request costing the packer a drop and no message, the bounds that keep a
stopped packer from overflowing the request channel, and learner_packs=False
leaving every pack to the collector."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from replay_fsm import CollectorDied, Pipeline, PipelineFailed, ReplayBuffer
from replay_fsm.data import packer as packer_module
from replay_fsm.data.channel import Channel, ChannelClosed
from replay_fsm.data.packer import (
    CHUNK_MIN_ROWS,
    MAX_CHUNKS,
    NO_CHUNK,
    Packer,
    PackerHandle,
    chunk_count,
)
from replay_fsm.errors import PackerError
from replay_fsm.runtime.links import ExternalCollector
from replay_fsm.runtime.observers import Observer
from replay_fsm.spec import Event
from replay_fsm.transfer.cpu import CpuBackend
from replay_fsm.wire import PackDone, PackRequest, TransitionRecord, decode, encode

from .drive import packed, reference, run_ticks
from .support import MARGIN_S, Exited, SlotsOnlyLink, finishes_within

N = 16
ROOT = Path(__file__).resolve().parent.parent


def buffer(rows: int = 300) -> ReplayBuffer:
    rb = ReplayBuffer(512, 5, 3, critic_dim=2, region_rows=32)
    if rows:
        rb.add_packed(torch.randn(rows, rb.width))
    return rb


def collector_died(pipe: Pipeline, tick: int) -> str:
    """The CollectorDied message of sampling ``tick`` (run it in finishes_within: a
    wait that never ends fails the test instead of hanging it)."""
    try:
        pipe.sample_large_batch(tick, N)
    except CollectorDied as exc:
        return str(exc)
    return "returned a batch"


def exact(pipe: Pipeline, tick: int, batch: dict[str, torch.Tensor]) -> bool:
    return torch.equal(packed(batch, pipe), reference(pipe, tick))


# -- the claim -----------------------------------------------------------------


@contextlib.contextmanager
def chunks_of(rows: int) -> Iterator[None]:
    """Handles created inside are split in chunks of ``rows`` rows (N // rows chunks
    of a request of N rows), so that small requests exercise several chunks."""
    with mock.patch.object(packer_module, "CHUNK_MIN_ROWS", rows):
        yield


def chunked() -> tuple[ReplayBuffer, PackerHandle]:
    """A buffer and a handle of two slots whose requests of N rows come in chunks of
    four rows."""
    with chunks_of(4):
        rb = buffer()
        return rb, PackerHandle.create(2, N, rb.width)


def request(slot: int = 0, generation: int = 1, seed: int = 0, tick: int = 0
            ) -> PackRequest:
    return PackRequest(tick=tick, slot=slot, generation=generation, seed=seed,
                       sample_count=N, min_snapshot_ptr=-1)


def test_a_request_is_split_in_at_most_max_chunks_of_at_least_min_rows() -> None:
    assert [chunk_count(r) for r in (0, 1, CHUNK_MIN_ROWS - 1, CHUNK_MIN_ROWS,
                                     2 * CHUNK_MIN_ROWS + 1, 100 * CHUNK_MIN_ROWS)] == [
        1, 1, 1, 1, 2, MAX_CHUNKS]
    with chunks_of(5):
        h = PackerHandle.create(2, N, 8)
    assert h.chunks == 3 and h.chunk_bounds == [0, 5, 10, 16]  # every row, once


def test_each_chunk_has_one_writer_and_the_last_one_written_completes_it() -> None:
    """The claim cells hand out each chunk of a generation once, in order, whoever
    asks; advance counts a written chunk and says when the last one is written; the
    request's first claim fixes the snapshot every writer uses."""
    with chunks_of(4):
        h = PackerHandle.create(2, N, 8)
    assert h.chunks == 4
    assert h.claim(1, 1, 50, 1.0) == 0
    assert h.claim(1, 1, 99, 1.0) == 1  # a second writer: the next chunk
    assert h.snapshot(1)[0] == 50  # the first claim's ptr, for both
    assert h.claim(0, 1, 7, 1.0) == 0  # another slot's cells
    assert h.advance(1, 1, 1.0) == (2, False)
    assert h.advance(1, 1, 1.0) == (3, False)
    assert h.advance(1, 1, 1.0) == (NO_CHUNK, False)
    assert h.claim(1, 1, 99, 1.0) == NO_CHUNK  # every chunk claimed
    assert h.advance(1, 1, 1.0) == (NO_CHUNK, True)  # the fourth written: the last
    assert h.claims[1].tolist()[:3] == [1, 4, 4]
    assert h.claim(1, 2, 60, 1.0) == 0  # a newer request starts over
    assert h.snapshot(1)[0] == 60
    assert h.claim(1, 1, 99, 1.0) == NO_CHUNK  # an older one never comes back
    with pytest.raises(RuntimeError, match="slot 1 holds request 2 while a chunk of "
                                           "request 1 was being written"):
        h.advance(1, 1, 1.0)


def test_stranded_is_a_request_only_a_gone_packer_could_finish() -> None:
    """``stranded`` (asked of a request a packer process that is gone read): true
    while a chunk the packer side claimed is uncounted, or, without the learner's
    packs, until the request is written whole or failed; the learner's own claims
    never strand it, and a later request in the slot means it was packed."""
    with chunks_of(4):
        h = PackerHandle.create(2, N, 8)
    assert h.stranded(0, 1, True, 1.0) is False  # unclaimed: the learner packs it all
    assert h.stranded(0, 1, False, 1.0) is True  # ... unless it packs nothing
    assert h.claim(0, 1, 50, 1.0, by_packer=False) == 0  # the learner's
    assert h.stranded(0, 1, True, 1.0) is False
    assert h.claim(0, 1, 50, 1.0) == 1  # the packer's
    assert h.stranded(0, 1, True, 1.0) is True
    assert h.advance(0, 1, 1.0) == (2, False)  # counted; it claims the next
    assert h.stranded(0, 1, True, 1.0) is True
    assert h.advance(0, 1, 1.0, by_packer=False) == (3, False)  # the learner's next
    assert h.advance(0, 1, 1.0) == (NO_CHUNK, False)  # the packer owes nothing now
    assert h.stranded(0, 1, True, 1.0) is False
    assert h.stranded(0, 1, False, 1.0) is True  # chunk 3 is the learner's to write
    assert h.advance(0, 1, 1.0, by_packer=False) == (NO_CHUNK, True)
    assert h.stranded(0, 1, False, 1.0) is False  # written whole
    assert h.claim(1, 1, 0, 1.0) == 0
    h.abandon(1, 1, 1.0)
    assert h.stranded(1, 1, False, 1.0) is False  # failed: its error was posted
    assert h.claim(0, 2, 60, 1.0) == 0  # a later request in slot 0
    assert h.stranded(0, 1, False, 1.0) is False
    assert h.stranded(0, 2, True, 1.0) is True  # the new one's claimed chunk
    assert h.claim_lock.acquire(timeout=1.0)
    try:
        assert h.stranded(0, 2, True, 0.01) is None  # the lock stayed taken
    finally:
        h.claim_lock.release()


def test_a_failed_writer_abandons_the_request() -> None:
    """After abandon no chunk is handed out and no writer completes the request (the
    failed writer posts the error); an older generation's abandon changes nothing."""
    with chunks_of(4):
        h = PackerHandle.create(2, N, 8)
    assert h.claim(0, 3, 0, 1.0) == 0
    assert h.claim(0, 3, 0, 1.0) == 1
    h.abandon(0, 2, 1.0)
    assert h.claim(0, 3, 0, 1.0) == 2
    h.abandon(0, 3, 1.0)
    assert h.claim(0, 3, 0, 1.0) == NO_CHUNK
    for _ in range(3):
        assert h.advance(0, 3, 1.0) == (NO_CHUNK, False)
    assert h.advance(0, 3, 1.0) == (NO_CHUNK, False)  # all four counted, still failed


def test_a_claim_tells_generations_apart_past_float_precision() -> None:
    """The cells are int64: a float32 cell would hold 2**24 + 1 as 2**24 and admit
    a second writer of that generation."""
    h = PackerHandle.create(2, N, 8)
    big = 2**24 + 1
    assert h.claim(0, big, 0, 1.0) == 0
    assert h.claim(0, big, 0, 1.0) == NO_CHUNK
    assert h.claims.dtype == torch.int64


def test_the_request_channel_is_sized_to_the_bound() -> None:
    """Room for one live request per slot and the ring_depth the learner may have
    packed (ChannelLink.take's bound), and no more: its rows are shared memory."""
    for depth in (2, 3):
        assert PackerHandle.create(depth, N, 8).requests.capacity == 2 * depth


def test_claims_give_up_on_a_lock_held_past_their_timeout() -> None:
    """Whoever holds the lock may have died in it: a claim or an advance waits at
    most its timeout, says so (None) and sets nothing."""
    with chunks_of(4):
        h = PackerHandle.create(2, N, 8)
    assert h.claim(0, 1, 0, 1.0) == 0
    before = h.claims.tolist()
    assert h.claim_lock.acquire(timeout=1.0)
    try:
        assert h.claim(0, 1, 0, 0.01) is None
        assert h.claim(1, 1, 0, 0.01) is None
        assert h.advance(0, 1, 0.01) is None
    finally:
        h.claim_lock.release()
    assert h.claims.tolist() == before
    assert h.advance(0, 1, 1.0) == (1, False)


def test_a_learner_never_waits_on_a_claim_lock_held_forever() -> None:
    """A packer process killed inside the lock holds it for good: the learner's take
    gives up after its timeout (no pack), and the pipeline's wait ends by the
    watchdog's verdict (here: no collector attached) instead of hanging."""
    rb = buffer()
    with Pipeline(rb, sample_count=N, collector="external", attach_timeout=0.3,
                  liveness_timeout=60) as pipe:
        handle = pipe.packer_handle()
        assert handle.claim_lock.acquire(timeout=1.0)
        try:
            ok, got = finishes_within(lambda: Packer(handle, rb).take(request(), 0.01))
            assert ok and got == [None]
            pipe.start_prepare(0, N)
            ok, got = finishes_within(lambda: collector_died(pipe, 0))
            assert ok and "Packer.attach" in got[0], got
        finally:
            handle.claim_lock.release()
        assert pipe.statistics().learner_packs == 0


def claim_there(handle: PackerHandle) -> None:
    if (handle.claim(1, 3, 0, 10.0), handle.chunks, handle.chunk_bounds) != (
            0, 4, [0, 4, 8, 12, 16]):
        raise SystemExit(3)


def test_the_claims_travel_with_the_handle() -> None:
    """A handle sent to a spawned packer process shares the claim cells and their
    lock (shared memory, a named semaphore), not copies of them, and its chunks."""
    with chunks_of(4):
        h = PackerHandle.create(2, N, 8)
    child = mp.get_context("spawn").Process(target=claim_there, args=(h,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert h.claim(1, 3, 0, 1.0) == 1 and h.claims[1].tolist()[:2] == [3, 2]


def test_a_packer_that_cannot_get_the_lock_keeps_the_request() -> None:
    """The lock held past LEARNER_CHECK_S: the packer serves nothing this call and
    keeps the request pending (not lost), and serves it once the lock is free. The
    call returns though the lock stays taken (its holder may have died in it): kills
    xǁPackerǁservice mutant 45 (the claim waits for the lock for ever)."""
    rb = buffer()
    h = PackerHandle.create(2, N, rb.width)
    packer = Packer(h, rb)
    h.requests.put(encode(request(seed=7))[0])
    assert h.claim_lock.acquire(timeout=1.0)
    try:
        ok, got = finishes_within(lambda: packer.service(timeout=0))
        assert ok and got == [False]
    finally:
        h.claim_lock.release()
    assert h.done.backlog == 0 and h.requests.backlog == 0
    assert packer.service(timeout=0) is True
    assert decode(PackDone, *h.done.get(timeout=1.0)).tick == 0  # type: ignore[misc]


def test_a_request_the_learner_packed_is_dropped_by_the_packer() -> None:
    """No second write and no second message: the packer drops a request the learner
    claimed, and still draws the next tick's indices ahead from it."""
    rb = buffer()
    h = PackerHandle.create(2, N, rb.width)
    packer, learner = Packer(h, rb), Packer(h, rb)
    first = request(seed=100)
    h.requests.put(encode(first)[0])
    assert learner.take(first, 1.0) == 1
    assert learner.take(first, 1.0) == 0  # taken once
    # Its message went to this process's consumer, not into the ring the packer's
    # process shares: a view of the channel elsewhere sees nothing.
    elsewhere = Channel.__new__(Channel)
    elsewhere.__setstate__(h.done.__getstate__())
    assert elsewhere.backlog == 0 and h.done.backlog == 1
    before = h.host_slots[0].clone()
    assert packer.service(timeout=0) is False  # dropped
    assert torch.equal(h.host_slots[0], before) and packer.packed_count == 0
    assert h.done.backlog == 1  # the learner's message only
    done = decode(PackDone, *h.done.get(timeout=1.0))  # type: ignore[misc]
    assert (done.tick, done.slot, done.generation, done.error) == (0, 0, 1, None)
    assert torch.equal(before, reference_rows(rb, done))
    assert h.done.backlog == 0
    packer.service(timeout=0.01)  # idle: draws seed 101 ahead
    second = request(slot=1, seed=101, tick=1)
    h.requests.put(encode(second)[0])
    assert packer.service(timeout=1.0) is True
    assert packer.drawn_ahead == 1 and packer.packed_count == 1
    assert learner.take(second, 1.0) == 0  # the packer has it


class Interleaved:
    """Wraps a buffer's gather: its ``at``-th call (from 1) first runs ``meanwhile``,
    as a peer would between a writer's claim and its count."""

    def __init__(self, rb: ReplayBuffer, at: int, meanwhile: Callable[[], object]
                 ) -> None:
        self.gather, self.at, self.meanwhile = rb.gather, at, meanwhile
        self.calls = 0
        self.got: list[object] = []
        self.rows: list[int] = []  # per call, in the order the gathers start

    def __call__(self, indices: torch.Tensor, out: torch.Tensor, **kw: Any) -> torch.Tensor:
        self.calls += 1
        self.rows.append(len(indices))
        if self.calls == self.at:
            self.got.append(self.meanwhile())
        return self.gather(indices, out, **kw)


def split_run(learner_first: bool, at: int = 1) -> tuple[ReplayBuffer, PackerHandle,
                                                        Packer, Packer, Interleaved]:
    rb, h = chunked()
    packer, learner = Packer(h, rb), Packer(h, rb)
    h.requests.put(encode(request(seed=5))[0])
    def peer() -> object:
        rb.add_packed(torch.randn(50, rb.width))  # the second writer sees more rows
        if learner_first:
            return packer.service(timeout=0)
        return learner.take(request(seed=5), 1.0)
    rb.gather = Interleaved(rb, at, peer)  # type: ignore[method-assign]
    return rb, h, packer, learner, rb.gather  # type: ignore[return-value]


@pytest.mark.parametrize("learner_first", [False, True])
def test_the_packer_and_the_learner_split_a_request_by_chunks(learner_first: bool) -> None:
    """The second writer arrives while the first writes chunk 0 (rows were added
    meanwhile): it takes chunks 1-3, the first writes none more, and the first (it
    counts the last chunk) posts the one message, to its own consumer; the rows are
    INV-DATA's for the first claim's snapshot, whoever wrote them."""
    rb, h, packer, learner, peer = split_run(learner_first)
    if learner_first:
        assert learner.take(request(seed=5), 1.0) == 1
        assert peer.got == [True]  # the packer wrote chunks 1-3
    else:
        assert packer.service(timeout=0) is True
        assert peer.got == [3]  # the learner wrote chunks 1-3
    assert packer.packed_count == 1 and peer.calls == 4  # four chunks, one gather each
    assert peer.rows == [N // 4] * 4  # each writes its chunk's rows, no more
    elsewhere = Channel.__new__(Channel)  # the ring the other process would read
    elsewhere.__setstate__(h.done.__getstate__())
    assert elsewhere.backlog == (0 if learner_first else 1)
    got = h.done.get(timeout=0)
    assert got is not None and h.done.get(timeout=0) is None  # one message
    done = decode(PackDone, *got)  # type: ignore[misc]
    assert (done.tick, done.generation, done.error, done.snapshot_ptr) == (0, 1, None, 300)
    assert torch.equal(h.host_slots[0], reference_rows(rb, done))
    assert h.claims[0].tolist()[:4] == [1, 4, 4, 0]


def test_a_chunk_that_fails_abandons_the_request_with_one_message() -> None:
    """The learner, writing chunks 1-3 inside the packer's chunk 0, fails on its
    second: it posts the error; the packer writes no chunk more and posts nothing."""
    rb, h, packer, learner, peer = split_run(learner_first=False)
    gather = peer.gather

    def failing(indices: torch.Tensor, out: torch.Tensor, **kw: Any) -> torch.Tensor:
        failing.calls += 1  # type: ignore[attr-defined]
        if failing.calls == 2:  # type: ignore[attr-defined]
            raise OSError("gather failed")
        return gather(indices, out, **kw)
    failing.calls = 0  # type: ignore[attr-defined]
    peer.gather = failing  # the learner's calls come through here
    assert packer.service(timeout=0) is True
    assert peer.got == [1]  # the learner wrote chunk 1, failed on chunk 2
    got = h.done.get(timeout=0)
    assert got is not None and "OSError: gather failed" in str(got[1])
    assert h.done.get(timeout=0) is None  # one message
    # The packer wrote its chunk without failing: it counts it (packed_count's
    # meaning), the learner does not; the cells say two chunks written and the
    # request failed.
    assert (packer.packed_count, learner.packed_count) == (1, 0)
    assert h.claims[0].tolist()[:4] == [1, 4, 2, 1]


def test_a_chunk_that_fails_under_a_held_claim_lock_is_still_reported() -> None:
    """A chunk raises while the claim lock is taken (its holder stopped): marking
    the request failed waits only LEARNER_CHECK_S for the lock, and the error is
    posted anyway; nothing blocks."""
    rb, h = chunked()
    learner = Packer(h, rb)

    def stuck_then_fail(indices: torch.Tensor, out: torch.Tensor, **kw: Any) -> torch.Tensor:
        assert h.claim_lock.acquire(timeout=1.0)
        raise OSError("gather failed")
    rb.gather = stuck_then_fail  # type: ignore[method-assign]
    try:
        ok, got = finishes_within(lambda: learner.take(request(), 1.0))
    finally:
        h.claim_lock.release()
    assert ok and got == [0]
    done = h.done.get(timeout=0)
    assert done is not None and "OSError: gather failed" in str(done[1])
    assert h.claims[0].tolist()[:4] == [1, 1, 0, 0]  # the lock was taken: not marked


def raised_by(fn: Callable[[], object]) -> object:
    """What ``fn`` raised, or what it returned (run it in finishes_within)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc


def stuck_count(at: int = 1) -> tuple[ReplayBuffer, PackerHandle, Packer]:
    """A learner whose ``at``-th chunk is written while the claim lock is taken and
    kept (a packer stopped inside it): that chunk cannot be counted."""
    rb, h = chunked()
    rb.gather = Interleaved(rb, at, lambda: h.claim_lock.acquire(timeout=1.0)
                            )  # type: ignore[method-assign]
    return rb, h, Packer(h, rb)


def test_a_learner_that_cannot_count_its_chunk_fails_after_its_patience() -> None:
    """The learner retries the count for HOLD_PATIENCE_S, then raises naming the
    lock's holder: the request can never complete, and nothing is posted."""
    rb, h, learner = stuck_count()
    try:
        with mock.patch.object(packer_module, "HOLD_PATIENCE_S", 0.05):
            ok, got = finishes_within(lambda: raised_by(lambda: learner.take(request(), 1.0)))
    finally:
        h.claim_lock.release()
    assert ok and isinstance(got[0], RuntimeError), got
    assert "the claim lock stayed taken for 0 s: its holder (the packer) is stopped" in str(
        got[0])
    assert h.done.get(timeout=0) is None


def test_a_learner_that_cannot_count_its_chunk_asks_give_up_at_every_retry() -> None:
    """``give_up`` (the pipeline's watchdog) is asked at every retry of the count,
    and what it raises ends the take at once. The packer process in the handle is
    alive (this process's parent stands in for it): that alone ends nothing."""
    rb, h, learner = stuck_count(at=2)
    h.packer_state[0] = os.getppid()
    asked: list[int] = []

    def give_up() -> None:
        asked.append(1)
        if len(asked) == 3:
            raise OSError("the collector is gone")
    try:
        ok, got = finishes_within(lambda: raised_by(
            lambda: learner.take(request(), 1.0, give_up)))
    finally:
        h.claim_lock.release()
    assert ok and isinstance(got[0], OSError) and len(asked) == 3, (got, asked)
    assert h.done.get(timeout=0) is None
    assert h.claims[0].tolist()[:4] == [1, 2, 1, 0]  # the second chunk never counted


def hold_and_exit(lock: Any) -> None:
    lock.acquire()  # and exit holding it, as a packer killed inside it would


def test_a_learner_that_cannot_count_its_chunk_fails_at_once_when_the_packer_died() -> None:
    """The packer process died holding the claim lock (it stays taken for good): the
    learner's count does not wait out HOLD_PATIENCE_S, it fails naming the dead
    packer as soon as it sees it gone."""
    rb, h = chunked()
    learner = Packer(h, rb)

    def die_inside() -> None:
        child = mp.get_context("spawn").Process(target=hold_and_exit, args=(h.claim_lock,))
        child.start()
        child.join(MARGIN_S)
        h.packer_state[0] = child.pid  # the attached packer, now dead
    rb.gather = Interleaved(rb, 1, die_inside)  # type: ignore[method-assign]
    ok, got = finishes_within(lambda: raised_by(lambda: learner.take(request(), 1.0)))
    assert ok and isinstance(got[0], RuntimeError), got
    assert "died holding the claim lock" in str(got[0])


def test_a_stuck_count_ends_in_the_watchdogs_verdict() -> None:
    """In the pipeline: the learner's chunk cannot be counted while the collector
    it watches has exited; the watchdog's verdict (CollectorDied) ends the take and
    the run, within the wait, not after HOLD_PATIENCE_S."""
    rb = buffer()
    with chunks_of(4):
        pipe = Pipeline(rb, sample_count=N, collector="external", liveness_timeout=60)
    with pipe:
        handle = pipe.packer_handle()

        def stop_inside() -> None:
            assert handle.claim_lock.acquire(timeout=1.0)
            pipe.watch(Exited(), "the test's collector")
        rb.gather = Interleaved(rb, 1, stop_inside)  # type: ignore[method-assign]
        pipe.start_prepare(0, N)
        try:
            ok, got = finishes_within(lambda: raised_by(
                lambda: pipe.sample_large_batch(0, N)))
        finally:
            handle.claim_lock.release()
        assert ok and isinstance(got[0], CollectorDied), got
        assert "tick 0: the test's collector (pid 4242) exited with code -9" in str(got[0])


def test_two_threads_waiting_for_one_tick_take_it_once() -> None:
    """A second thread waiting for the tick the first is packing does not take
    chunks of it too (the two would share one packer's drawn indices): it waits."""
    rb = buffer()
    with chunks_of(4):
        pipe = Pipeline(rb, sample_count=N, collector="external", liveness_timeout=60,
                        checked=True)
    with pipe:
        first = threading.current_thread()
        waited, gathered = threading.Event(), threading.Event()
        verdict = pipe._watchdog.verdict

        def watched(*args: Any) -> Any:
            if threading.current_thread() is not first:
                waited.set()  # the second thread went past the take, to the watchdog
            return verdict(*args)
        pipe._watchdog.verdict = watched  # type: ignore[method-assign]

        second: list[threading.Thread] = []

        def second_thread() -> None:
            second.append(threading.Thread(target=pipe.wait_until_ready, args=(0, N),
                                           daemon=True))
            second[0].start()
            # Either it waits (right) or it gathers a chunk (wrong); both end this.
            assert waited.wait(MARGIN_S) or gathered.is_set()
        gather = rb.gather

        def hooked(indices: torch.Tensor, out: torch.Tensor, **kw: Any) -> torch.Tensor:
            if threading.current_thread() is not first:
                gathered.set()
                waited.set()
            return gather(indices, out, **kw)
        rb.gather = hooked  # type: ignore[method-assign]
        rb.gather = Interleaved(rb, 1, second_thread)  # type: ignore[method-assign]
        pipe.start_prepare(0, N)
        assert exact(pipe, 0, pipe.sample_large_batch(0, N))
        stats = pipe.statistics()
        assert not gathered.is_set()
        assert (stats.learner_packs, stats.learner_chunks) == (1, 4)
        # Tick 0 is hot now: the second wait ends too, before close could fail it.
        second[0].join(MARGIN_S)
        assert not second[0].is_alive()


def test_a_packer_that_cannot_count_its_chunk_retries_while_its_learner_lives() -> None:
    """The claim lock is taken while the packer writes a chunk and freed once the
    packer has looked whether its learner lives: the packer counts the chunk at its
    next try and completes the request."""
    rb, h = chunked()
    packer = Packer(h, rb)
    h.requests.put(encode(request())[0])
    looked: list[bool] = []
    alive = packer._learner_alive

    def learner_alive() -> bool:
        looked.append(True)
        if len(looked) == 2:  # the first look is service's own, before the claim
            h.claim_lock.release()
        return alive()
    packer._learner_alive = learner_alive  # type: ignore[method-assign]
    rb.gather = Interleaved(rb, 1, lambda: h.claim_lock.acquire(timeout=1.0)
                            )  # type: ignore[method-assign]
    ok, got = finishes_within(lambda: packer.service(timeout=0))
    assert ok and got == [True] and len(looked) == 2
    done = h.done.get(timeout=0)
    assert done is not None and done[1] is None and packer.packed_count == 1


def test_a_packer_that_cannot_count_its_chunk_stops_when_its_channel_closes() -> None:
    """The packer's side retries the count while its learner lives; a closed channel
    (the learner stopped) ends it: no message, no error."""
    rb, h = chunked()
    packer = Packer(h, rb)
    h.requests.put(encode(request())[0])

    def stop_inside() -> None:
        assert h.claim_lock.acquire(timeout=1.0)
        h.requests.close()
    rb.gather = Interleaved(rb, 1, stop_inside)  # type: ignore[method-assign]
    try:
        ok, got = finishes_within(lambda: packer.service(timeout=0))
    finally:
        h.claim_lock.release()
    assert ok and got == [False] and h.done.backlog == 0 and packer.packed_count == 0


# -- a writer stopped inside its add --------------------------------------------


@contextlib.contextmanager
def add_in_progress(rb: ReplayBuffer) -> Iterator[None]:
    """Every region of ``rb`` marked as being written, as by a writer stopped
    (SIGSTOP, a debugger) inside its add: a gather of any row reads it again until
    the region is even. No process is recorded as the add's, so none is found dead."""
    rb._seq += 1
    try:
        yield
    finally:
        rb._seq += 1


def test_a_learners_gather_held_up_by_an_add_asks_give_up_and_abandons_its_chunk() -> None:
    """The learner's gather of its chunk waited for the add as long as the writer
    lived (a stopped one: for ever). Now it asks ``give_up`` (the pipeline's
    watchdog, a stop signal) while it reads again; what that raises ends the take,
    and the chunk is abandoned (no writer claims or completes the request)."""
    rb, h = chunked()
    learner = Packer(h, rb)
    asked: list[int] = []

    def give_up() -> None:
        asked.append(1)
        if len(asked) == 3:
            raise OSError("the collector is gone")
    with add_in_progress(rb):
        ok, got = finishes_within(lambda: raised_by(
            lambda: learner.take(request(), 1.0, give_up)))
    assert ok and isinstance(got[0], OSError) and len(asked) == 3, (got, asked)
    assert h.done.get(timeout=0) is None
    assert h.claims[0].tolist()[:4] == [1, 4, 0, 1]  # every chunk handed out, failed


def test_a_learners_gather_held_up_by_an_add_fails_after_its_patience() -> None:
    """Its patience (the pipeline's liveness_timeout) counts from the gather's first
    retry: the time a gather waits at a stretch, not since the take began."""
    rb, h = chunked()
    learner = Packer(h, rb)
    assert learner.writer_patience_s == packer_module.HOLD_PATIENCE_S
    learner.writer_patience_s = 0.05
    with add_in_progress(rb):
        ok, got = finishes_within(lambda: raised_by(lambda: learner.take(request(), 1.0)))
    assert ok and isinstance(got[0], CollectorDied), got
    assert str(got[0]).startswith("tick 0: the learner's gather of it has waited 0.")
    assert str(got[0]).endswith(" s (liveness_timeout 0.05 s) for rows an add is writing: "
                                "its writer is stopped or hung inside it")
    assert h.done.get(timeout=0) is None


def test_a_learners_patience_counts_each_wait_not_the_whole_take() -> None:
    """Each of the take's four gathers waits half its patience for an add to finish
    (the add ends then, as a live writer's does): together twice its patience, and
    the take completes, exactly."""
    rb, h = chunked()
    learner = Packer(h, rb)
    learner.writer_patience_s = 1.0
    gather, waits = rb.gather, []

    def held_up(indices: torch.Tensor, out: torch.Tensor, *,
                retrying: Callable[[float], None]) -> torch.Tensor:
        def until_half(waited_s: float) -> None:
            retrying(waited_s)
            if waited_s >= 0.5 and rb._seq[0] % 2:
                waits.append(waited_s)
                rb._seq += 1  # the add is done
        rb._seq += 1  # an add begins
        return gather(indices, out, retrying=until_half)
    rb.gather = held_up  # type: ignore[method-assign]
    ok, got = finishes_within(lambda: raised_by(lambda: learner.take(request(), 1.0)))
    assert ok and got == [4] and len(waits) == 4, (got, waits)
    done = h.done.get(timeout=0)
    assert done is not None and done[1] is None
    assert torch.equal(h.host_slots[0], reference_rows(rb, decode(PackDone, *done)))


def test_an_external_collector_silent_while_it_made_the_rows_is_not_judged_by_a_gather(
        ) -> None:
    """An external collector's silence counts only liveness_timeout after the learner
    saw the request's rows (it makes them meanwhile, between service calls). A wait
    judges it so; the learner's own gather, held up by one of the collector's adds,
    asked the watchdog as if the silence counted at once: CollectorDied, for a
    collector whose last beat was long ago but whose rows had just come."""
    rb = buffer()
    pipe = Pipeline(rb, sample_count=N, collector="external", liveness_timeout=5.0)
    with pipe:
        packer = Packer.attach(pipe.packer_handle(), rb)  # attached, serving nothing
        packer.handle.packer_state[1] = time.monotonic_ns() - 60 * 10**9  # a minute ago
        gather, calls = rb.gather, []

        def meets_an_add(indices: torch.Tensor, out: torch.Tensor, *,
                         retrying: Callable[[float], None]) -> torch.Tensor:
            def until_asked(waited_s: float) -> None:
                retrying(waited_s)  # give_up: the watchdog's verdict
                calls.append(waited_s)
                if len(calls) == 3:
                    rb._seq += 1  # the add is done
            rb._seq += 1  # an add of the collector's is under way
            return gather(indices, out, retrying=until_asked)
        rb.gather = meets_an_add  # type: ignore[method-assign]
        pipe.start_prepare(0, N)
        ok, got = finishes_within(lambda: raised_by(lambda: pipe.sample_large_batch(0, N)))
        assert ok and isinstance(got[0], dict), got
        assert len(calls) == 3 and exact(pipe, 0, got[0])


class OwnGather(ReplayBuffer):
    """A subclass whose gather predates ``retrying``."""

    def gather(self, indices: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        self.gathers = getattr(self, "gathers", 0) + 1
        return super().gather(indices, out)


@pytest.mark.parametrize("learner_packs", [True, False])
def test_a_buffer_whose_gather_takes_no_retrying_still_packs(learner_packs: bool) -> None:
    rb = OwnGather(512, 5, 3, critic_dim=2, region_rows=32)
    rb.add_packed(torch.randn(300, rb.width))
    with Pipeline(rb, sample_count=N, learner_packs=learner_packs) as pipe:
        for tick, batch in pipe.ticks(0, 3):
            assert exact(pipe, tick, batch)
    assert rb.gathers >= 3


def test_a_packers_gather_held_up_by_an_add_stops_when_its_channel_closes() -> None:
    """The packer's side waits for the add while its learner lives; a closed channel
    (the learner closed the pipeline) ends it: no message, no error, the thread free
    to leave."""
    rb, h = chunked()
    packer = Packer(h, rb)
    h.requests.put(encode(request())[0])
    got: list[bool] = []
    worker = threading.Thread(target=lambda: got.append(packer.service(timeout=0)),
                              daemon=True)
    with add_in_progress(rb):
        worker.start()
        worker.join(0.2)
        assert worker.is_alive()  # held up by the add, as long as its learner lives
        h.requests.close()
        worker.join(MARGIN_S)
        assert not worker.is_alive() and got == [False]
    assert h.done.backlog == 0 and packer.packed_count == 0


@pytest.mark.parametrize("collector", ["thread", "process"])
def test_a_writer_stopped_inside_its_add_ends_the_learners_wait_in_collector_died(
        collector: str) -> None:
    """The learner packing for itself (learner_packs=True, the default) spun in its
    gather for as long as the writer was stopped; with learner_packs=False the same
    run ended in CollectorDied within liveness_timeout (the packer, held up in its
    own gather, stops beating). Now both do, and close leaves no packer behind. Which
    verdict comes first depends on who claimed the chunk: the packer's silence, or
    the learner's own pack held up for liveness_timeout while the packer idles."""
    rb = buffer()
    pipe = Pipeline(rb, sample_count=N, collector=collector, liveness_timeout=1.0)
    with pipe:
        pipe.start_prepare(0, N)
        assert pipe.wait_until_ready(0, N, timeout=MARGIN_S)  # attached and serving
        pipe.sample_large_batch(0, N)
        pipe.after_tick()
        with add_in_progress(rb):
            pipe.start_prepare(1, N)
            ok, got = finishes_within(lambda: collector_died(pipe, 1))
            assert ok and ("no heartbeat from the packer" in got[0] or (
                "tick 1: the learner's gather of it has waited" in got[0])), got
            pipe.close()
        assert pipe.forced == []


@contextlib.contextmanager
def beating_but_never_serving(liveness_timeout: float
                              ) -> Iterator[tuple[ReplayBuffer, Pipeline]]:
    """A pipeline over ``buffer()``, its requests in chunks of four rows, and an
    external collector attached in this process that beats, as its service calls
    would, and never serves: the learner claims every chunk."""
    rb = buffer()
    with chunks_of(4):
        pipe = Pipeline(rb, sample_count=N, collector="external",
                        liveness_timeout=liveness_timeout)
    with pipe:
        packer = Packer.attach(pipe.packer_handle(), rb)  # attached, never serving
        stop = threading.Event()

        def beat() -> None:  # as a collector's service calls beat, with no request
            while not stop.wait(0.01):
                packer.handle.packer_state[1] = time.monotonic_ns()
        beating = threading.Thread(target=beat, daemon=True)
        beating.start()
        try:
            yield rb, pipe
        finally:
            stop.set()
            beating.join(MARGIN_S)


def test_a_learners_pack_held_up_while_the_packer_idles_ends_after_liveness_timeout(
        ) -> None:
    """The learner claimed every chunk (the packer, attached and beating, has none):
    only the learner waits on the add, and the watchdog sees nothing wrong. Its
    gather ends after the pipeline's liveness_timeout."""
    with beating_but_never_serving(0.5) as (rb, pipe):
        with add_in_progress(rb):
            pipe.start_prepare(0, N)
            ok, got = finishes_within(lambda: collector_died(pipe, 0))
        assert ok and got[0].startswith("the pipeline failed: tick 0: the learner's "
                                        "gather of it has waited "), got
        assert " s (liveness_timeout 0.5 s) for rows an add is writing" in got[0]


def gather_through_a_stop() -> str:
    """What ``sample_large_batch`` of tick 0 ends in when this process is stopped 2 s
    (liveness_timeout 1 s) while the learner's own gather reads again rows an add is
    writing, the add ending 0.1 s after the resume (run in a process of its own: it
    stops itself)."""
    with beating_but_never_serving(1.0) as (rb, pipe):
        with add_in_progress(rb):
            pipe.start_prepare(0, N)
            ok: list[Any] = []
            learner = threading.Thread(
                target=lambda: ok.append(collector_died(pipe, 0)), daemon=True)
            learner.start()
            # What a terminal's Ctrl-Z, 2 s, then fg, do to this process.
            subprocess.run(["sh", "-c", f"sleep 0.1; kill -STOP {os.getpid()}; "
                                        f"sleep 2; kill -CONT {os.getpid()}"], check=True)
            time.sleep(0.1)  # the writer ends its add
        learner.join(MARGIN_S)
        return ok[0] if ok else "still waiting"


@pytest.mark.slow
def test_a_learners_gather_held_up_by_an_add_while_the_job_is_stopped_goes_on() -> None:
    """Ctrl-Z and fg while the learner's own gather reads again rows an add is
    writing (``gather_through_a_stop``). The gather's patience counted on the
    monotonic clock, and the run failed in CollectorDied ("the learner's gather of it
    has waited 2.1 s", 2 of 2 runs, helper-86) at the first retry after the resume; as
    every other bound, it counts a stretch no look saw for at most half of it now, and
    the batch comes."""
    done = subprocess.run(
        [sys.executable, "-c", "from tests.test_learner_packs import gather_through_a_stop;"
                               " print(gather_through_a_stop())"],
        cwd=ROOT, capture_output=True, text=True, timeout=MARGIN_S)
    assert done.stdout.strip() == "returned a batch", done.stdout + done.stderr


def reference_rows(rb: ReplayBuffer, done: PackDone) -> torch.Tensor:
    from replay_fsm.data.sampling import expected_batch
    return expected_batch(rb.storage, done.snapshot_size, done.sample_count, done.seed)


# -- the channel's second producer ---------------------------------------------


def test_local_posts_are_taken_first_and_counted() -> None:
    ch = Channel(2, 3, text_bytes=16)
    assert ch.put([1, 2, 3], timeout=1.0)
    ch.post_local([4, 5, 6], "boom")
    assert ch.backlog == 2
    assert ch.get(timeout=1.0) == ([4, 5, 6], "boom")
    assert ch.get(timeout=1.0) == ([1, 2, 3], None)
    assert ch.get(timeout=0) is None and ch.backlog == 0
    # A local post takes no place in the ring: the ring still holds two.
    ch.post_local([7, 8, 9])
    assert ch.put([1, 1, 1], timeout=0) and ch.put([2, 2, 2], timeout=0)
    assert ch.backlog == 3
    with pytest.raises(ValueError, match=r"^this channel carries no text \(text_bytes=0\)$"):
        Channel(2, 3).post_local([1, 2, 3], "no room")
    ch.close()
    with pytest.raises(ChannelClosed):
        ch.post_local([1, 2, 3])


def test_local_posts_stay_in_their_process() -> None:
    """A pickled channel (the packer's copy) starts with no local records: they are
    for the consumer in the poster's process."""
    ch = Channel(2, 3)
    ch.post_local([4, 5, 6])
    state = ch.__getstate__()
    assert "_local" not in state
    there = Channel.__new__(Channel)
    there.__setstate__(state)
    assert there.backlog == 0 and ch.backlog == 1


# -- the pipeline --------------------------------------------------------------


def test_with_no_collector_attached_the_learner_packs_up_to_the_bound() -> None:
    """An external collector that never attaches: the learner packs the ticks it
    waits for, bit-exact, while at most ring_depth requests wait unread in the
    channel; then it waits, and the attach deadline ends the wait."""
    rb = buffer()
    with Pipeline(rb, sample_count=N, collector="external", attach_timeout=0.3,
                  liveness_timeout=60, checked=True) as pipe:
        for tick in (0, 1):
            pipe.start_prepare(tick, N)
            assert exact(pipe, tick, pipe.sample_large_batch(tick, N))
            pipe.after_tick()
        stats = pipe.statistics()
        assert (stats.packs, stats.learner_packs, stats.ticks) == (2, 2, 2)
        pipe.start_prepare(2, N)  # three requests unread: no more packs here
        with pytest.raises(CollectorDied, match="Packer.attach"):
            pipe.sample_large_batch(2, N)
        assert pipe.statistics().learner_packs == 2


def test_learner_packs_false_never_packs_on_the_learner() -> None:
    rb = buffer()
    with Pipeline(rb, sample_count=N, collector="external", attach_timeout=0.3,
                  liveness_timeout=60, learner_packs=False) as pipe:
        pipe.start_prepare(0, N)
        with pytest.raises(CollectorDied, match="Packer.attach"):
            pipe.sample_large_batch(0, N)
        assert pipe.statistics().learner_packs == 0
    with Pipeline(rb, sample_count=N, collector="thread", learner_packs=False) as pipe:
        assert run_ticks(pipe, 0, 20) == 20
        stats = pipe.statistics()
        assert (stats.packs, stats.learner_packs) == (20, 0)


def test_the_learner_waits_for_the_rows_a_request_needs() -> None:
    """min_snapshot_ptr binds the learner as it binds the packer: with the rows not
    there it packs nothing; with them there it packs."""
    rb = buffer(rows=100)
    with Pipeline(rb, sample_count=N, collector="external", attach_timeout=0.3,
                  liveness_timeout=60) as pipe:
        pipe.start_prepare(0, N, min_snapshot_ptr=rb.ptr + 10)
        ok, got = finishes_within(lambda: collector_died(pipe, 0))
        assert ok and "Packer.attach" in got[0], got
        assert pipe.statistics().learner_packs == 0
    with Pipeline(rb, sample_count=N, collector="external", attach_timeout=60,
                  liveness_timeout=60) as pipe:
        pipe.start_prepare(0, N, min_snapshot_ptr=rb.ptr)
        assert exact(pipe, 0, pipe.sample_large_batch(0, N))
        assert pipe.pack_record(0).snapshot_ptr == rb.ptr == 100


def test_a_wait_with_a_timeout_packs_nothing() -> None:
    """wait_until_ready with a timeout bounds the caller's wait: no gather inside
    it. Without one it packs, as sample_large_batch does."""
    rb = buffer()
    with Pipeline(rb, sample_count=N, collector="external", liveness_timeout=60) as pipe:
        pipe.start_prepare(0, N)
        assert pipe.wait_until_ready(0, N, timeout=0.01) is False
        assert pipe.statistics().learner_packs == 0
        assert pipe.wait_until_ready(0, N) is True
        assert pipe.statistics().learner_packs == 1
        assert exact(pipe, 0, pipe.sample_large_batch(0, N))


def test_only_the_oldest_requested_tick_is_packed_by_the_learner() -> None:
    """Taking tick 1 while tick 0 waits would delay tick 0: a wait for a younger
    tick packs nothing."""
    rb = buffer()
    with Pipeline(rb, sample_count=N, collector="external", attach_timeout=0.3,
                  liveness_timeout=60) as pipe:
        pipe.start_prepare(0, N)
        pipe.start_prepare(1, N)
        with pytest.raises(CollectorDied, match="Packer.attach"):
            pipe.wait_until_ready(1, N)
        assert pipe.statistics().learner_packs == 0


def test_the_learners_pack_shows_in_the_trace_and_the_statistics() -> None:
    """No collector attached: the learner packs tick 0's four chunks; one
    learner_pack span (inside the wait) says so, and the statistics count them."""
    rb = buffer()
    with chunks_of(4):
        pipe = Pipeline(rb, sample_count=N, collector="external", liveness_timeout=60,
                        trace=True)
    with pipe:
        pipe.start_prepare(0, N)
        assert exact(pipe, 0, pipe.sample_large_batch(0, N))
        assert pipe.tracer is not None
        spans = [e for e in pipe.tracer.events() if e["kind"] == "span"]
        mine = [e for e in spans if e["name"] == "learner_pack"]
        assert [(e["actor"], e["tick"], e["slot"], e["args"]["chunks"]) for e in mine] == [
            ("learner", 0, 0, 4)]
        wait = next(e for e in spans if e["name"] == "wait")
        assert wait["start_ns"] <= mine[0]["start_ns"] <= mine[0]["end_ns"] <= wait["end_ns"]
        stats = pipe.statistics()
        assert (stats.learner_packs, stats.learner_chunks) == (1, 4)


def test_the_learner_takes_only_the_chunks_the_packer_has_not_reached() -> None:
    """The collector's packer (a thread here) is inside chunk 0 of tick 0 when the
    learner waits for it: the learner writes chunks 1-3 meanwhile, the packer
    posts the batch, and the statistics count one learner pack of three chunks."""
    rb = buffer()
    with chunks_of(4):
        pipe = Pipeline(rb, sample_count=N, collector="external", liveness_timeout=60,
                        checked=True)
    with pipe:
        packer = Packer.attach(pipe.packer_handle(), rb)
        inside, go_on = threading.Event(), threading.Event()
        gather, learner_calls = rb.gather, []

        def hooked(indices: torch.Tensor, out: torch.Tensor, **kw: Any) -> torch.Tensor:
            if threading.current_thread() is worker:
                inside.set()
                assert go_on.wait(MARGIN_S)  # the packer sits in chunk 0 ...
            else:
                learner_calls.append(1)
                if len(learner_calls) == 3:  # ... until the learner claimed chunk 3
                    go_on.set()
            return gather(indices, out, **kw)
        rb.gather = hooked  # type: ignore[method-assign]
        pipe.start_prepare(0, N)
        worker = threading.Thread(target=packer.service, args=(MARGIN_S,), daemon=True)
        worker.start()
        assert inside.wait(MARGIN_S)
        ok, got = finishes_within(lambda: pipe.sample_large_batch(0, N))
        go_on.set()
        worker.join(MARGIN_S)
        assert ok and exact(pipe, 0, got[0])
        stats = pipe.statistics()
        assert (stats.learner_packs, stats.learner_chunks, packer.packed_count) == (1, 3, 1)


def test_a_learners_pack_that_fails_fails_the_run_chained() -> None:
    """An empty buffer: the learner's gather raises; its pack-done carries the
    traceback as the packer's would, and the run fails chained to it."""
    rb = buffer(rows=0)
    with Pipeline(rb, sample_count=N, collector="external", liveness_timeout=60) as pipe:
        pipe.start_prepare(0, N)
        with pytest.raises(PipelineFailed) as info:
            pipe.sample_large_batch(0, N)
        cause = info.value.__cause__
        assert isinstance(cause, PackerError) and "empty replay buffer" in (
            cause.traceback_text)


class RaisingTake(ExternalCollector):
    def take(self, request: PackRequest, timeout: float, *,
             give_up: Callable[[], None] | None = None) -> int | None:
        raise OSError("claim lock gone")


class LateTake(ExternalCollector):
    """Its first take cannot look now (None: the claim lock was taken, or too many
    requests waited); later ones take."""

    calls = 0

    def take(self, request: PackRequest, timeout: float, *,
             give_up: Callable[[], None] | None = None) -> int | None:
        self.calls += 1
        return None if self.calls == 1 else super().take(request, timeout,
                                                          give_up=give_up)


def test_a_take_that_could_not_look_is_tried_again() -> None:
    """A take that answered None leaves the request to take at a later slice of the
    same wait (tick 3, in slot 1: the request is found by its tick, not its slot)."""
    rb = buffer()
    link = LateTake(rb, 2, N, attach_timeout=60)
    with Pipeline(rb, sample_count=N, collector=link, liveness_timeout=60) as pipe:
        pipe.start_prepare(3, N)
        ok, got = finishes_within(lambda: pipe.sample_large_batch(3, N))
        assert ok and exact(pipe, 3, got[0])
        assert link.calls == 2 and pipe.statistics().learner_packs == 1


def test_a_take_that_raises_fails_the_run() -> None:
    """The claim may be the learner's with no message sent, so the slot could never
    fill: an error inside take fails the run at once, chained to it."""
    rb = buffer()
    link = RaisingTake(rb, 2, N, attach_timeout=60)
    with Pipeline(rb, sample_count=N, collector=link, liveness_timeout=60) as pipe:
        pipe.start_prepare(0, N)
        with pytest.raises(PipelineFailed) as info:
            pipe.sample_large_batch(0, N)
        assert isinstance(info.value.__cause__, OSError)
        with pytest.raises(PipelineFailed):
            pipe.start_prepare(1, N)


def test_a_learner_pack_against_a_closed_link_is_no_pack() -> None:
    """Stopped, or closed while the learner packs (its message cannot be posted):
    no pack either way. A link without a packer handle never packs."""
    rb = buffer()
    link = ExternalCollector(rb, 2, N, attach_timeout=60)
    link.handle.done.close()
    assert link.take(request(), 1.0) == 0
    link.stop(1.0)
    assert link.take(request(), 1.0) == 0
    assert SlotsOnlyLink(N, rb.width).take(request(), 1.0) == 0


def test_the_learner_packs_every_tick_a_dropping_packer_leaves() -> None:
    """A collector that only ever drops (its service calls come after the learner
    packed): the learner packs every tick, past the first ring, and the packer none."""
    rb = buffer()
    with Pipeline(rb, sample_count=N, collector="external", liveness_timeout=60) as pipe:
        handle = pipe.packer_handle()
        packer = Packer.attach(handle, rb)

        def run() -> int:
            for tick in range(5):
                while handle.requests.backlog:
                    packer.service(timeout=0)  # drops the ticks the learner packed
                pipe.start_prepare(tick, N)
                assert exact(pipe, tick, pipe.sample_large_batch(tick, N)), tick
                pipe.after_tick()
            return pipe.statistics().learner_packs
        ok, got = finishes_within(run)
        assert ok and got == [5] and packer.packed_count == 0


def test_learner_packs_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="learner_packs must be True or False, got 1"):
        Pipeline(buffer(), sample_count=N, learner_packs=1)  # type: ignore[arg-type]


# -- racing --------------------------------------------------------------------


@given(depth=st.sampled_from([2, 3]), chunk_rows=st.sampled_from([N, 4]),
       serves=st.lists(st.integers(0, 3), min_size=1, max_size=10))
def test_a_paused_packer_and_the_learner_share_the_ticks_exactly(
        depth: int, chunk_rows: int, serves: list[int]) -> None:
    """An attached collector that services only now and then (``serves[t]`` calls
    before tick t is sampled), requests in one chunk or four: every batch is
    INV-DATA's, each tick packed once, by the packer or by the learner."""
    rb = buffer()
    ticks = len(serves)
    with chunks_of(chunk_rows):
        pipe = Pipeline(rb, sample_count=N, collector="external", ring_depth=depth,
                        liveness_timeout=60, checked=True)
    with pipe:
        handle = pipe.packer_handle()
        packer = Packer.attach(handle, rb)
        for tick, calls in enumerate(serves):
            pipe.after_tick()
            for ahead in range(tick, min(tick + depth - 1, ticks - 1) + 1):
                pipe.start_prepare(ahead, N)
            for _ in range(calls):
                packer.service(timeout=0)
            while handle.requests.backlog > depth:  # else the learner would wait
                packer.service(timeout=0)
            assert exact(pipe, tick, pipe.sample_large_batch(tick, N)), tick
        pipe.after_tick()
        stats = pipe.statistics()
        assert stats.packs == ticks == stats.ticks
        assert stats.learner_packs + packer.packed_count == ticks
        assert stats.learner_chunks == stats.learner_packs * (N // chunk_rows)
        if serves[0] == 0:  # tick 0 unserved: the learner packed it
            assert stats.learner_packs >= 1


@pytest.mark.parametrize("chunk_rows", [N, 4])
@pytest.mark.parametrize("collector", ["thread", "process"])
def test_every_batch_is_exact_with_the_packer_racing_the_learner(
        collector: str, chunk_rows: int) -> None:
    """The seed-style loop requests a tick right before it samples it, so the
    packer and the learner race for every first request, chunk by chunk when a
    request has four; every batch is exact and every tick packed once."""
    rb = buffer()
    with chunks_of(chunk_rows):
        pipe = Pipeline(rb, sample_count=N, collector=collector, liveness_timeout=60,
                        checked=True)
    with pipe:
        for start in range(0, 60, 3):
            run_ticks(pipe, start, start + 3)
        stats = pipe.statistics()
        assert stats.packs == 60 == stats.ticks
        assert stats.learner_chunks <= stats.learner_packs * (N // chunk_rows)


# -- who submits a batch the learner packed -------------------------------------


class ThreadsOf(Observer):
    """The name of the thread each SUBMIT and COMPLETE ran on, with its tick."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, str]] = []

    def transition(self, record: TransitionRecord, time_ns: int) -> None:
        if record.event in (Event.SUBMIT, Event.COMPLETE):
            self.seen.append((record.event.value, record.tick,
                              threading.current_thread().name))


class SubmitOnWorker(CpuBackend):
    submit_on_learner = False


@pytest.mark.parametrize("backend", [CpuBackend, SubmitOnWorker])
def test_a_batch_the_learner_packs_to_its_end_is_submitted_where_the_backend_allows(
        backend: type[CpuBackend]) -> None:
    """With the CPU backend (``submit_on_learner``) the learner that wrote a batch's
    last chunk fires SUBMIT and COMPLETE itself, on its own thread, at once: no
    message to the transfer worker, whose thread would have to wake first (about a
    third of a millisecond per tick on a 2-core machine). A backend without the flag
    gets the batch from the transfer worker's thread, as a packer's. The batches are
    the same either way. The packer here reads each request only after the learner
    packed it, so the learner packs them all."""
    rb = buffer()
    threads = ThreadsOf()
    with Pipeline(rb, sample_count=N, collector="external", liveness_timeout=60,
                  backend=backend()) as pipe:
        pipe.add_observer(threads)
        packer = Packer.attach(pipe.packer_handle(), rb)
        for tick in range(4):
            pipe.start_prepare(tick, N)
            assert exact(pipe, tick, pipe.sample_large_batch(tick, N))
            pipe.after_tick()
            assert not packer.service()  # the request, packed already: dropped
        assert pipe.statistics().learner_packs == 4
    here = threading.current_thread().name
    expected = here if backend is CpuBackend else "replay_fsm-transfer"
    assert [(event, tick) for event, tick, _ in threads.seen] == [
        (event, tick) for tick in range(4) for event in ("submit", "complete")]
    assert {name for _, _, name in threads.seen} == {expected}
