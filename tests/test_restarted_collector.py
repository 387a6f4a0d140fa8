"""An external collector restarted after its process died (slow tier: processes).

A collector that reads a request off the channel and dies leaves it undone; the one
attached after it never reads it. Nobody watch()ed the dead process, and the new one
beats: the learner waited for that tick for ever (helper-68, 2 of 8 random trials).
The learner now fails the run with CollectorDied where nobody can finish the request,
and goes on where it can pack the request itself (nothing of it was claimed).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from typing import Any

import pytest
import torch

from replay_fsm import CollectorDied, Pipeline, ReplayBuffer
from replay_fsm.data.channel import STORES_IN_ORDER
from replay_fsm.data.packer import Packer, PackerHandle
from replay_fsm.errors import WriterDied
from replay_fsm.spec import SlotState

from .collectors import StallingBuffer, constant_rows
from .drive import packed, reference
from .support import finishes_within

# restore_taken gives nothing back where the CPU may reorder a put's stores
IN_ORDER = pytest.mark.skipif(not STORES_IN_ORDER, reason="64-bit x86 only: restore_taken "
                              "gives nothing back on a weakly ordered CPU")

pytestmark = pytest.mark.slow
MARGIN_S = 60.0
N = 8


def buffer() -> ReplayBuffer:
    rb = ReplayBuffer(512, 5, 3)
    rb.add_packed(torch.randn(300, rb.width))
    return rb


def die_in_its_first_chunk(handle: PackerHandle, rb: ReplayBuffer) -> None:
    """Attach, read the first request and claim a chunk of it, then die before
    writing it (as a SIGKILL inside the gather would)."""
    packer = Packer.attach(handle, rb)

    def die(*args: Any, **kwargs: Any) -> None:
        os._exit(9)
    rb.gather = die  # type: ignore[method-assign]
    while not packer.closed:
        packer.service(timeout=0.05)


def die_with_it_read(handle: PackerHandle, rb: ReplayBuffer) -> None:
    """Attach and read the first request, which waits for rows (min_snapshot_ptr),
    then die holding it."""
    packer = Packer.attach(handle, rb)
    while not handle.requests.taken and not packer.closed:
        packer.service(timeout=0.05)
    os._exit(9)


def serve(handle: PackerHandle, rb: ReplayBuffer, attached: Any, go: Any = None) -> None:
    """The restarted collector: attach, say so, (given ``go``: wait until it is set,
    for the test to look at what the attach alone did), serve until closed."""
    packer = Packer.attach(handle, rb)
    attached.set()
    if go is not None:
        assert go.wait(MARGIN_S)
    while not packer.closed:
        packer.service(timeout=0.01)


def restart(pipe: Pipeline, rb: ReplayBuffer, first: Any, *, watch: bool = False
            ) -> Any:
    """Run ``first`` as the collector until it dies (``watch``: the pipeline watches
    it), then attach a new one; returns the new one's process (alive, attached)."""
    ctx = mp.get_context("spawn")
    dead = ctx.Process(target=first, args=(pipe.packer_handle(), rb))
    if watch:
        pipe.watch(dead)
    dead.start()
    dead.join(MARGIN_S)
    assert dead.exitcode == 9, dead.exitcode
    attached = ctx.Event()
    new = ctx.Process(target=serve, args=(pipe.packer_handle(), rb, attached))
    new.start()
    assert attached.wait(MARGIN_S)
    assert pipe.packer_handle().predecessor[1] == dead.pid
    return new


def stop(pipe: Pipeline, process: Any) -> None:
    pipe.close()
    process.join(MARGIN_S)
    assert process.exitcode == 0


def serve_by_timed_waits(pipe: Pipeline, ticks: range) -> None:
    """The learner's side of ``ticks``, each awaited by timed waits only (which never
    pack), each batch its tick's (INV-DATA); the next tick requested before the
    release, as a trainer does."""
    for tick in ticks:
        def ready() -> bool:
            while not pipe.wait_until_ready(tick, N, timeout=0.2):  # noqa: B023
                pass
            return True
        ok, _ = finishes_within(ready, 20.0)
        assert ok, f"tick {tick} never came"
        batch = pipe.sample_large_batch(tick, N)
        assert torch.equal(packed(batch, pipe), reference(pipe, tick)), tick
        pipe.start_prepare(tick + 1, N)
        pipe.after_tick()


def test_a_chunk_the_dead_collector_claimed_fails_the_run_not_hangs_it() -> None:
    """The dead collector claimed the request's only chunk: neither the learner nor
    the new collector may write it, and the wait ends in CollectorDied naming the
    tick and the dead process."""
    rb = buffer()
    pipe = Pipeline(rb, sample_count=N, collector="external", liveness_timeout=60)
    pipe.start_prepare(0, N)
    new = restart(pipe, rb, die_in_its_first_chunk)
    try:
        with pytest.raises(CollectorDied) as info:
            pipe.wait_until_ready(0, N, timeout=MARGIN_S)
        dead = pipe.packer_handle().predecessor[1]
        assert str(info.value).startswith(
            f"tick 0: tick 0's request was read by a collector process attached before "
            f"pid {new.pid}, and gone since (the last one was pid {dead})")
    finally:
        stop(pipe, new)


def test_a_request_read_and_left_fails_the_run_when_the_learner_packs_nothing() -> None:
    """learner_packs=False: the request the dead collector read while it waited for
    rows is nobody's once the rows come."""
    rb = buffer()
    pipe = Pipeline(rb, sample_count=N, collector="external", liveness_timeout=60,
                    learner_packs=False)
    pipe.start_prepare(0, N, min_snapshot_ptr=rb.ptr + 1)
    new = restart(pipe, rb, die_with_it_read)
    try:
        rb.add_packed(torch.randn(1, rb.width))  # the rows it waited for
        with pytest.raises(CollectorDied, match="tick 0's request was read by a collector"):
            pipe.wait_until_ready(0, N, timeout=MARGIN_S)
    finally:
        stop(pipe, new)


def test_a_request_read_and_left_is_packed_by_the_learner_and_the_run_goes_on() -> None:
    """learner_packs=True and nothing of the request claimed: the learner packs all of
    it itself, so the restart costs nothing; the new collector serves the next ticks."""
    rb = buffer()
    pipe = Pipeline(rb, sample_count=N, collector="external", liveness_timeout=60)
    pipe.start_prepare(0, N, min_snapshot_ptr=rb.ptr + 1)
    new = restart(pipe, rb, die_with_it_read)
    try:
        rb.add_packed(torch.randn(1, rb.width))
        for tick in range(4):
            ok, got = finishes_within(lambda: pipe.sample_large_batch(tick, N))  # noqa: B023
            assert ok, f"tick {tick} never came"
            assert got[0]["obs"].shape[0] == N
            pipe.start_prepare(tick + 1, N)
            pipe.after_tick()
        assert pipe.statistics().learner_packs >= 1  # tick 0 at least
    finally:
        stop(pipe, new)


def die_holding_the_claim_lock(handle: PackerHandle, rb: ReplayBuffer) -> None:
    """Attach, then die holding the claim lock (as a SIGKILL inside a claim, an
    advance, or the attach itself would): a POSIX semaphore is never given back."""
    Packer.attach(handle, rb)
    handle.claim_lock.acquire()
    os._exit(9)


def die_before_posting(handle: PackerHandle, rb: ReplayBuffer) -> None:
    """Attach, pack the first request whole, and die between counting its last chunk
    and posting its pack-done message."""
    packer = Packer.attach(handle, rb)
    _die_at_the_post(handle, packer)


def fail_and_die_before_posting(handle: PackerHandle, rb: ReplayBuffer) -> None:
    """Attach, fail the first request's pack (abandoned), and die before posting its
    error."""
    packer = Packer.attach(handle, rb)

    def fail(*args: Any, **kwargs: Any) -> None:
        raise OSError("the gather failed")
    rb.gather = fail  # type: ignore[method-assign]
    _die_at_the_post(handle, packer)


def _die_at_the_post(handle: PackerHandle, packer: Packer) -> None:
    """Serve; die where the first pack-done message (or error) would be posted."""
    def die(*args: Any, **kwargs: Any) -> None:
        os._exit(9)
    handle.done.put = die  # type: ignore[method-assign]
    while not packer.closed:
        packer.service(timeout=0.05)


@pytest.mark.parametrize("how", ["batch_ready", "timed wait", "a later tick"])
def test_a_request_read_and_left_is_packed_by_a_learner_that_polls(how: str) -> None:
    """learner_packs=True: the learner packs an unclaimed request the dead collector
    read in any wait or poll for it as the oldest requested tick, not only in an
    untimed wait (a learner that polls batch_ready, or waits with a timeout, waited
    for ever). A later tick is packed once it is the oldest: the learner samples
    (in order) the ticks before it first."""
    rb = buffer()
    pipe = Pipeline(rb, sample_count=N, collector="external", liveness_timeout=2)
    tick = 0
    if how == "a later tick":  # the dead one serves tick 0, reads tick 1 and dies
        pipe.start_prepare(0, N)
        tick = 1
    pipe.start_prepare(tick, N, min_snapshot_ptr=rb.ptr + 1)
    new = restart(pipe, rb, die_with_it_read if tick == 0 else die_with_two_read)
    try:
        rb.add_packed(torch.randn(1, rb.width))

        def ready() -> bool:
            if how == "batch_ready":
                while not pipe.batch_ready(tick, N):
                    pass
            elif how == "timed wait":
                while not pipe.wait_until_ready(tick, N, timeout=0.2):
                    pass
            else:  # tick 0, served by the dead one, first; then tick 1, by polls
                pipe.sample_large_batch(0, N)
                pipe.after_tick()
                while not pipe.batch_ready(tick, N):
                    pass
            return True
        ok, _ = finishes_within(ready, 20.0)
        assert ok, f"tick {tick} never came"
    finally:
        stop(pipe, new)


def die_with_two_read(handle: PackerHandle, rb: ReplayBuffer) -> None:
    """Attach, serve the first request, read the second (it waits for rows), die."""
    packer = Packer.attach(handle, rb)
    while handle.requests.taken < 2 and not packer.closed:
        packer.service(timeout=0.05)
    os._exit(9)


@pytest.mark.parametrize("learner_packs", [True, False])
def test_a_claim_lock_the_dead_collector_held_fails_the_run_not_hangs_it(
        learner_packs: bool) -> None:
    """Nobody ever claims a chunk again, the learner nor the new collector, which
    beats all the same: the wait ends in CollectorDied after liveness_timeout."""
    assert "claim lock has stayed taken" in collector_died_after(
        die_holding_the_claim_lock, learner_packs)


def collector_died_after(first: Any, learner_packs: bool) -> str:
    """The CollectorDied message that ends a wait for tick 0 once ``first`` died and
    another collector attached (liveness_timeout 2 s; 20 s is a hang)."""
    rb = buffer()
    pipe = Pipeline(rb, sample_count=N, collector="external", liveness_timeout=2,
                    learner_packs=learner_packs)
    pipe.start_prepare(0, N)
    new = restart(pipe, rb, first)
    try:
        ok, got = finishes_within(lambda: pytest.raises(
            CollectorDied, pipe.wait_until_ready, 0, N), 20.0)
        assert ok, "the learner waited on"
        return str(got[0].value)
    finally:
        stop(pipe, new)


@pytest.mark.parametrize(("learner_packs", "failed"),
                         [(True, False), (False, False), (True, True)])
def test_a_pack_done_the_dead_collector_never_posted_fails_the_run_not_hangs_it(
        learner_packs: bool, failed: bool) -> None:
    """Written whole (its last chunk counted) or failed (abandoned), its message never
    posted: the wait ends in CollectorDied after liveness_timeout."""
    assert "its pack-done message has not come" in collector_died_after(
        fail_and_die_before_posting if failed else die_before_posting, learner_packs)


def attach_and_die(handle: PackerHandle, rb: ReplayBuffer) -> None:
    """Attach and die having read nothing (nothing of it is left to anybody)."""
    Packer.attach(handle, rb)
    os._exit(9)


@pytest.mark.parametrize("watched", [False, True])
def test_a_watched_collector_fails_the_run_at_its_death_though_a_restart_attached(
        watched: bool) -> None:
    """A restart attached before the learner's next wait: the run goes on, unless the
    dead process was watch()ed, whose death fails the run whatever attached since
    (``Pipeline.watch``: fail fast). The README and ``Packer.attach`` said a death
    fails the run only with none attached in its place, "watched or not", and that
    watch() only names the process in that error (146fd63; helper-85)."""
    rb = buffer()
    pipe = Pipeline(rb, sample_count=N, collector="external", liveness_timeout=60)
    new = restart(pipe, rb, attach_and_die, watch=watched)  # before the next wait
    dead = pipe.packer_handle().predecessor[1]
    try:
        pipe.start_prepare(0, N, min_snapshot_ptr=rb.ptr + 1)  # waits for its rows
        if watched:
            with pytest.raises(CollectorDied, match=f"the collector process "
                               f"\\(pid {dead}\\) exited with code 9"):
                pipe.wait_until_ready(0, N, timeout=2.0)
        else:
            assert not pipe.wait_until_ready(0, N, timeout=2.0)  # no verdict
            rb.add_packed(torch.randn(1, rb.width))
            assert pipe.wait_until_ready(0, N, timeout=MARGIN_S)
    finally:
        stop(pipe, new)


@pytest.mark.parametrize("how", ["wait", "timed wait", "batch_ready"])
def test_a_later_tick_the_dead_collector_read_is_packed_by_a_learner_waiting_for_it(
        how: str) -> None:
    """Ring depth 3: the dead collector served tick 0, read tick 1 and died. The
    learner waits for tick 1 with tick 0 not acquired yet: only the learner can pack
    tick 1, and it packed only the oldest requested tick, so the wait (untimed: a
    hang; timed or polled: never True) went on for ever while the new collector beat
    (helper-100, 1 of 1 each). The batch it packs is tick 1's (INV-DATA)."""
    rb = buffer()
    pipe = Pipeline(rb, sample_count=N, collector="external", ring_depth=3,
                    liveness_timeout=60)
    pipe.start_prepare(0, N)
    pipe.start_prepare(1, N, min_snapshot_ptr=rb.ptr + 1)
    pipe.start_prepare(2, N, min_snapshot_ptr=rb.ptr + 1)
    new = restart(pipe, rb, die_with_two_read)
    try:
        rb.add_packed(torch.randn(1, rb.width))

        def ready() -> bool:
            if how == "wait":
                return pipe.wait_until_ready(1, N)
            while not (pipe.batch_ready(1, N) if how == "batch_ready"
                       else pipe.wait_until_ready(1, N, timeout=0.2)):
                pass
            return True
        ok, got = finishes_within(ready)
        assert ok and got == [True], f"the wait for tick 1 never ended: {got}"
        assert pipe.states[0] is not SlotState.HOT  # tick 0 was not acquired meanwhile
        for tick in range(3):
            batch = pipe.sample_large_batch(tick, N)
            assert torch.equal(packed(batch, pipe), reference(pipe, tick)), tick
            pipe.after_tick()
        assert pipe.statistics().learner_packs >= 1  # tick 1 at least
    finally:
        stop(pipe, new)


class _DieOnItsItem:
    """The request channel's items semaphore in a collector killed inside its get:
    the acquire that takes an item is the process's last act (the request is never
    counted taken)."""

    def __init__(self, semaphore: Any) -> None:
        self._semaphore = semaphore

    def acquire(self, *args: Any, **kwargs: Any) -> bool:
        if self._semaphore.acquire(*args, **kwargs):
            os._exit(9)
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._semaphore, name)


def die_inside_its_get(handle: PackerHandle, rb: ReplayBuffer) -> None:
    """Attach, then die inside the get of the first request, between taking its item
    and counting it taken (as a SIGKILL there would)."""
    packer = Packer.attach(handle, rb)
    handle.requests._items = _DieOnItsItem(handle.requests._items)
    while not packer.closed:
        packer.service(timeout=0.05)


@IN_ORDER
@pytest.mark.parametrize("learner_packs", [True, False])
def test_a_restart_after_a_collector_killed_inside_its_get_packs_every_request(
        learner_packs: bool) -> None:
    """The dead collector took the request's item and died before it counted the
    request taken: the new collector read it with the next request's item, every
    request one behind, and the newest never while the learner sent nothing more.
    learner_packs=False: the wait ended in CollectorDied ("no get can take") after
    liveness_timeout (helper-100); True: the learner packed every tick itself, the
    collector's pack of it a request late and dropped (20 of 20 ticks; helper-105).
    The restart gives the item back at its attach: it packs tick 0 and every later
    tick (timed waits, which never pack, all end), each batch its tick's (INV-DATA),
    and the learner packs none."""
    rb = buffer()
    pipe = Pipeline(rb, sample_count=N, collector="external", liveness_timeout=60,
                    learner_packs=learner_packs)
    pipe.start_prepare(0, N)
    new = restart(pipe, rb, die_inside_its_get)
    try:
        serve_by_timed_waits(pipe, range(4))
        assert pipe.statistics().learner_packs == 0
    finally:
        stop(pipe, new)


class _DieFreeingItsPlace:
    """The request channel's spaces semaphore in a collector killed inside its get:
    the release that frees the request's place is never made (the request was
    counted taken just before)."""

    def __init__(self, semaphore: Any) -> None:
        self._semaphore = semaphore

    def release(self, *args: Any, **kwargs: Any) -> None:
        os._exit(9)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._semaphore, name)


def die_freeing_its_place(handle: PackerHandle, rb: ReplayBuffer) -> None:
    """Attach, then die inside the get of the first request, between counting it
    taken and freeing its place in the channel (as a SIGKILL there would)."""
    packer = Packer.attach(handle, rb)
    handle.requests._spaces = _DieFreeingItsPlace(handle.requests._spaces)
    while not packer.closed:
        packer.service(timeout=0.05)


@IN_ORDER
def test_collectors_killed_inside_their_get_after_the_count_leave_no_place_lost(
        ) -> None:
    """Each collector killed between counting a request read and freeing its place
    left the request channel a place short for good: at ring_depth 2 (4 places) the
    fourth kill left none, and the learner's next request failed the run after 10 s
    with "request channel stayed full for 10 s; the packer is stuck" (helper-112: 1 of
    1, kills 1 to 4 leaving 3, 2, 1, 0 places free). Each restart gives its
    predecessor's place back: five such kills, the learner packing each request the
    dead one read, and the collector attached after them serves every tick (timed
    waits, which never pack, all end), each batch its tick's (INV-DATA)."""
    ctx = mp.get_context("spawn")
    rb = buffer()
    pipe = Pipeline(rb, sample_count=N, collector="external", liveness_timeout=60)
    handle = pipe.packer_handle()
    kills = handle.requests.capacity + 1
    pipe.start_prepare(0, N)
    new = None
    try:
        for tick in range(kills):
            dead = ctx.Process(target=die_freeing_its_place, args=(handle, rb))
            dead.start()
            dead.join(MARGIN_S)
            assert dead.exitcode == 9, dead.exitcode
            assert handle.requests.taken == tick + 1  # it counted the request read
            batch = pipe.sample_large_batch(tick, N)  # nobody else ever packs it
            assert torch.equal(packed(batch, pipe), reference(pipe, tick)), tick
            pipe.start_prepare(tick + 1, N)
            pipe.after_tick()
        attached, go = ctx.Event(), ctx.Event()
        new = ctx.Process(target=serve, args=(handle, rb, attached, go))
        new.start()
        assert attached.wait(MARGIN_S)
        # before it serves: a get of its own, between its count and its release,
        # shows a place missing for as long as it is descheduled there
        assert handle.requests.lost_spaces == 0
        go.set()
        serve_by_timed_waits(pipe, range(kills, kills + 4))
    finally:
        if new is None:
            pipe.close()
        else:
            stop(pipe, new)


def test_a_later_tick_the_dead_collector_read_is_packed_after_a_take_that_could_not_look(
        ) -> None:
    """Ring depth 3, tick 1 read by the dead collector, tick 0 not acquired: a timed
    wait for tick 1 whose take found the claim lock taken for its slice (the live
    collector descheduled inside a claim, on a loaded machine) could not look, and
    the take put the request back only for the oldest tick: later waits found no
    request to pack for tick 1 and waited for ever while the new collector beat
    (helper-101: 1 of 1, the lock held by the test for one timed wait)."""
    rb = buffer()
    pipe = Pipeline(rb, sample_count=N, collector="external", ring_depth=3,
                    liveness_timeout=60)
    pipe.start_prepare(0, N)
    pipe.start_prepare(1, N, min_snapshot_ptr=rb.ptr + 1)
    new = restart(pipe, rb, die_with_two_read)
    lock = pipe.packer_handle().claim_lock
    try:
        rb.add_packed(torch.randn(1, rb.width))
        assert lock.acquire(timeout=MARGIN_S)
        try:
            assert not pipe.wait_until_ready(1, N, timeout=0.2)  # its take cannot look
        finally:
            lock.release()

        def ready() -> bool:
            while not pipe.wait_until_ready(1, N, timeout=0.2):
                pass
            return True
        ok, _ = finishes_within(ready, 20.0)
        assert ok, "the wait for tick 1 never ended"
        for tick in range(2):
            batch = pipe.sample_large_batch(tick, N)
            assert torch.equal(packed(batch, pipe), reference(pipe, tick)), tick
            pipe.after_tick()
    finally:
        stop(pipe, new)


def die_with_two_taken(handle: PackerHandle, rb: ReplayBuffer) -> None:
    """Attach, read the first two requests off the channel (claiming nothing of
    either), die."""
    packer = Packer.attach(handle, rb)
    while handle.requests.taken < 2 and not packer.closed:
        handle.requests.get(timeout=0.05)
    os._exit(9)


def test_two_threads_packing_two_ticks_the_dead_collector_read_take_turns() -> None:
    """The dead collector read ticks 0 and 1 and claimed nothing: only the learner
    packs them. One thread packs tick 0 (the oldest) while another waits for tick 1:
    the second took tick 1 at once, beside the first, and the two shared the learner's
    one packer (its drawn indices: tick 0's batch was gathered from tick 1's), as
    two threads waiting for one tick must not (helper-101: 1 of 1, the first held
    inside its gather). The second waits for the first's pack to end."""
    rb = buffer()
    pipe = Pipeline(rb, sample_count=N, collector="external", ring_depth=2,
                    liveness_timeout=60)
    pipe.start_prepare(0, N)
    pipe.start_prepare(1, N)
    new = restart(pipe, rb, die_with_two_taken)
    inside, go_on = threading.Event(), threading.Event()
    gather = rb.gather
    held: list[threading.Thread] = []

    def hooked(indices: torch.Tensor, out: torch.Tensor, **kw: Any) -> Any:
        if not held:  # the first gather, tick 0's: held until the other wait went
            held.append(threading.current_thread())
            inside.set()
            assert go_on.wait(MARGIN_S)
        return gather(indices, out, **kw)
    rb.gather = hooked  # type: ignore[method-assign]
    first = threading.Thread(target=pipe.wait_until_ready, args=(0, N), daemon=True)
    try:
        first.start()
        assert inside.wait(MARGIN_S)
        pipe.wait_until_ready(1, N, timeout=0.5)  # True or False: both are right
        go_on.set()
        first.join(MARGIN_S)
        assert not first.is_alive()
        for tick in range(2):
            batch = pipe.sample_large_batch(tick, N)
            assert torch.equal(packed(batch, pipe), reference(pipe, tick)), tick
            pipe.after_tick()
    finally:
        go_on.set()
        stop(pipe, new)


def attach_and_add(handle: PackerHandle, rb: ReplayBuffer, rows: torch.Tensor) -> None:
    """Attach, then add ``rows`` (a StallingBuffer's add, stalled: killed inside it)."""
    Packer.attach(handle, rb)
    rb.add_packed(rows)


def attach_and_collect(handle: PackerHandle, rb: ReplayBuffer, attached: Any) -> None:
    """The restarted collector: attach, say so, then add and serve (its first add
    raises WriterDied, which ends it: a traceback on its standard error, code 1)."""
    packer = Packer.attach(handle, rb)
    attached.set()
    while not packer.closed:
        rb.add_packed(constant_rows(rb, 1000, 4))
        packer.service(timeout=0.01)


def test_a_restart_that_exits_on_writer_died_fails_the_run_saying_so() -> None:
    """The first collector is killed inside an add, holding the buffer's write lock;
    the restart's first add raises WriterDied and it exits. The learner's wait said
    "the collector process (pid N) is gone", the reason only on the restart's
    standard error (helper-105: 1 of 1); it says that every add raises WriterDied,
    naming the process killed inside its add, which is the error's cause."""
    ctx = mp.get_context("spawn")
    rb = StallingBuffer(64, 2, 1, region_rows=8)
    rb.add_packed(constant_rows(rb, 0, 64))
    pipe = Pipeline(rb, sample_count=N, collector="external", liveness_timeout=60)
    entered, go = ctx.Event(), ctx.Event()
    rb.stall = (entered, go)
    first = ctx.Process(target=attach_and_add,
                        args=(pipe.packer_handle(), rb, constant_rows(rb, 500, 8)))
    first.start()
    rb.stall = None  # this process's adds go straight through
    try:
        assert entered.wait(MARGIN_S), "the first collector never reached its add"
        os.kill(first.pid, signal.SIGKILL)
        first.join(MARGIN_S)
        attached = ctx.Event()
        second = ctx.Process(target=attach_and_collect,
                             args=(pipe.packer_handle(), rb, attached))
        second.start()
        assert attached.wait(MARGIN_S)
        second.join(MARGIN_S)
        assert second.exitcode == 1, second.exitcode
        pipe.start_prepare(0, N, min_snapshot_ptr=rb.ptr + 1)  # rows only it adds
        with pytest.raises(CollectorDied) as info:
            pipe.wait_until_ready(0, N, timeout=MARGIN_S)
        assert str(info.value).startswith(
            f"tick 0: the collector process (pid {second.pid}) is gone, and every add to "
            f"the replay buffer raises WriterDied: process {first.pid} died inside an "
            "add to this replay buffer"), info.value
        assert isinstance(info.value.__cause__, WriterDied)
    finally:
        pipe.close()
