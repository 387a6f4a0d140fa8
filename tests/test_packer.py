"""The sampling contract (INV-DATA), the packer, its channels and process mode."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from replay_fsm.data.buffer import ReplayBuffer
from replay_fsm.data.channel import STORES_IN_ORDER, Channel, ChannelClosed
from replay_fsm.data.packer import Packer, PackerHandle
from replay_fsm.data.sampling import expected_batch, sample_indices
from replay_fsm.wire import PackDone, PackRequest, decode, encode

from .collectors import constant_rows, fill_and_serve, serve
from .support import MARGIN_S, finishes_within

# restore_taken gives nothing back where the CPU may reorder a put's stores
IN_ORDER = pytest.mark.skipif(not STORES_IN_ORDER, reason="64-bit x86 only: restore_taken "
                              "gives nothing back on a weakly ordered CPU")


@given(size=st.integers(1, 10_000), n=st.integers(1, 300), seed=st.integers(0, 2**40))
def test_sampling_contract_is_torch_randint_with_a_seeded_generator(
        size: int, n: int, seed: int) -> None:
    """INV-DATA: exactly torch.randint with Generator().manual_seed(base_seed + tick)."""
    ref = torch.randint(0, size, (n,), generator=torch.Generator().manual_seed(seed))
    assert torch.equal(sample_indices(size, n, seed), ref)
    out, gen = torch.empty(n, dtype=torch.int64), torch.Generator()
    sample_indices(size + 1, n, seed + 1, out=out, generator=gen)  # dirty the reused state
    assert torch.equal(sample_indices(size, n, seed, out=out, generator=gen), ref)


def test_empty_buffer_is_a_clear_error() -> None:
    """The message names the fix. Kills replay_fsm.data.sampling.x_sample_indices
    mutants 4 and 6-9 (a piece of the message altered)."""
    with pytest.raises(ValueError, match="empty replay buffer") as info:
        sample_indices(0, 4, 0)
    assert ("add transitions first, or pass min_snapshot_ptr (to start_prepare or "
            "ticks) to wait for them") in str(info.value)


@pytest.mark.parametrize("count", [0, -3])
def test_sample_count_must_be_positive(count: int) -> None:
    """Zero rows is a caller's mistake, not an empty batch. Kills
    x_sample_indices mutants 10 (``<= 0`` made ``< 0``) and 12 (the message dropped)."""
    with pytest.raises(ValueError, match=f"sample_count must be positive, got {count}"):
        sample_indices(10, count, 0)


def test_sampling_reuses_the_packers_buffers() -> None:
    """The packer passes its index tensor and generator so that a tick allocates
    nothing (DESIGN: no allocation per tick in steady state): the indices are drawn
    from that generator into that tensor. Kills x_sample_indices mutants 15 (a new
    generator every call) and 23, 28 (``out`` not passed on)."""
    out, gen = torch.empty(8, dtype=torch.int64), torch.Generator()
    got = sample_indices(100, 8, 1234, out=out, generator=gen)
    assert got.data_ptr() == out.data_ptr()
    assert gen.initial_seed() == 1234
    assert torch.equal(out, sample_indices(100, 8, 1234))


def torch_allocations(fn: Callable[[], object]) -> list[tuple[str, int]]:
    """The torch CPU allocations ``fn()`` makes (op name, bytes), from the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        fn()
    return [(e.name, e.cpu_memory_usage) for e in prof.events() if e.cpu_memory_usage > 0]


def test_a_steady_gather_allocates_nothing() -> None:
    """The seqlock's check (sequence numbers before the copy, their parities) goes into
    the calling thread's ``GatherScratch``, made at its first gather: none after that,
    in this thread or another, nor in a copy of the buffer unpickled elsewhere."""
    rb = ReplayBuffer(1024, 4, 2, region_rows=16)
    rb.add_packed(constant_rows(rb, 1, 1000))
    indices = sample_indices(1000, 64, 3)
    out = torch.empty(64, rb.width)
    first = torch_allocations(lambda: rb.gather(indices, out))
    assert first != []  # the probe sees this thread's scratch being made
    assert torch_allocations(lambda: rb.gather(indices, out)) == []
    assert torch.equal(out, rb.storage[indices])
    seen: list[list[tuple[str, int]]] = []

    def in_another_thread() -> None:
        rb.gather(indices, out)
        seen.append(torch_allocations(lambda: rb.gather(indices, out)))
    thread = threading.Thread(target=in_another_thread)
    thread.start()
    thread.join()
    assert seen == [[]]
    copy = ReplayBuffer.__new__(ReplayBuffer)  # as unpickled in a packer process
    copy.__setstate__(rb.__getstate__())
    assert "_per_thread" not in rb.__getstate__()
    copy.gather(indices, out)
    assert torch_allocations(lambda: copy.gather(indices, out)) == []


def test_a_steady_pack_allocates_nothing_on_either_side() -> None:
    """DESIGN: no allocation per tick in steady state, and the learner's calls are
    measured that way (benchmarks/learner_overhead.py). That covers the learner's own
    packs (``take``) as well as the packer's: both draw into reused indices, and
    their gathers' checks into reused scratch."""
    rb, h = make(rows=200, n=64)
    packer, learner = Packer(h, rb), Packer(h, rb)

    def by_packer(tick: int) -> None:
        h.requests.put(request(tick, tick % 2, 64))
        assert packer.service(timeout=1.0)
        assert h.done.get(timeout=1.0) is not None

    def by_learner(tick: int) -> None:
        assert learner.take(decode(PackRequest, request(tick, tick % 2, 64)), 1.0) == 1
        assert h.done.get(timeout=1.0) is not None

    for tick in range(2):  # first calls may set torch up
        by_packer(tick)
    assert torch_allocations(lambda: by_packer(2)) == []
    for tick in range(3, 5):
        by_learner(tick)
    assert torch_allocations(lambda: by_learner(5)) == []
    assert torch.equal(h.host_slots[1], expected_batch(rb.storage, 200, 64, 5))


def request(tick: int, slot: int, n: int, *, min_ptr: int = -1, seed: int | None = None
            ) -> list[int]:
    return encode(PackRequest(tick=tick, slot=slot, generation=tick + 1,
                                      seed=tick if seed is None else seed,
                                      sample_count=n, min_snapshot_ptr=min_ptr))[0]


def make(rows: int = 100, n: int = 32, depth: int = 2) -> tuple[ReplayBuffer, PackerHandle]:
    rb = ReplayBuffer(256, 4, 2, region_rows=16)
    if rows:
        rb.add_packed(constant_rows(rb, 1, rows))
    return rb, PackerHandle.create(depth, n, rb.width)


def test_packer_fills_the_slot_bit_exact() -> None:
    rb, h = make()
    packer = Packer(h, rb)
    for tick in range(5):
        h.requests.put(request(tick, tick % 2, 32, seed=1000 + tick))
        assert packer.service(timeout=1.0)
        got = h.done.get(timeout=1.0)
        assert got is not None
        done = decode(PackDone, *got)
        assert (done.tick, done.slot, done.snapshot_size, done.error) == (tick, tick % 2,
                                                                          100, None)
        assert torch.equal(h.host_slots[tick % 2],
                           expected_batch(rb.storage, 100, 32, 1000 + tick))
    assert packer.packed_count == 5  # kills xǁPackerǁ_pack mutants 53 and 54


def test_min_snapshot_ptr_keeps_the_request_pending() -> None:
    rb, h = make(rows=10)
    packer = Packer(h, rb)
    h.requests.put(request(0, 0, 32, min_ptr=50))
    assert not packer.service(timeout=0.0)
    assert not packer.service(timeout=0.0)  # still pending, not lost
    rb.add_packed(constant_rows(rb, 11, 40))
    assert packer.service(timeout=0.0)
    done = decode(PackDone, *h.done.get(timeout=1.0))  # type: ignore[misc]
    assert (done.snapshot_ptr, done.snapshot_size) == (50, 50)
    assert torch.equal(h.host_slots[0], expected_batch(rb.storage, 50, 32, 0))


def test_packing_error_is_sent_back_with_its_traceback() -> None:
    rb, h = make(rows=0)
    packer = Packer(h, rb)
    h.requests.put(request(3, 1, 32))
    assert packer.service(timeout=1.0)  # served: the failure is its answer
    assert packer.packed_count == 0
    done = decode(PackDone, *h.done.get(timeout=1.0))  # type: ignore[misc]
    assert done.tick == 3 and done.error is not None
    assert "Traceback" in done.error and "empty replay buffer" in done.error


def test_channel_is_bounded_and_loses_nothing() -> None:
    ch = Channel(3, 2, text_bytes=8)
    for k in range(3):
        assert ch.put([k, -k], text=None if k % 2 else f"m{k}")
    assert not ch.put([9, 9], timeout=0.01)  # full
    got = [ch.get(timeout=1) for _ in range(3)]
    assert got == [([0, 0], "m0"), ([1, -1], None), ([2, -2], "m2")]
    assert ch.get(timeout=0.01) is None
    ch.close()
    with pytest.raises(ChannelClosed):
        ch.put([1, 1])
    with pytest.raises(ChannelClosed):
        ch.get(timeout=1)


def test_process_mode_with_spawn_end_to_end() -> None:
    rb, h = make(rows=0, n=64, depth=3)
    proc = mp.get_context("spawn").Process(target=fill_and_serve, args=(h, rb, 200))
    proc.start()
    try:
        for tick in range(6):
            h.requests.put(request(tick, tick % 3, 64, min_ptr=200), timeout=30)
            got = h.done.get(timeout=60)
            assert got is not None
            done = decode(PackDone, *got)
            assert done.error is None and done.snapshot_size == 200
            assert torch.equal(h.host_slots[tick % 3],
                               expected_batch(rb.storage, 200, 64, tick))
        assert h.packer_pid == proc.pid and h.heartbeat_ns > 0
    finally:
        h.close()
        proc.join(30)
    assert proc.exitcode == 0


def test_attach_to_a_spawned_collector_serving_a_count() -> None:
    rb, h = make(rows=100, n=16)
    proc = mp.get_context("spawn").Process(target=serve, args=(h, rb, 2))
    proc.start()
    for tick in range(2):
        h.requests.put(request(tick, tick, 16), timeout=30)
        assert decode(PackDone, *h.done.get(timeout=60)).error is None  # type: ignore[misc]
    proc.join(30)
    assert proc.exitcode == 0


def test_process_alive_tells_running_exited_and_zombie_processes_apart() -> None:
    """A packer's learner check: a running process is alive; one that exited is gone,
    also while it is a zombie nobody has reaped (``kill(pid, 0)`` still succeeds
    then), and also when its name holds ") Z " (the state field is the one after the
    last parenthesis of /proc/<pid>/stat). Kills replay_fsm.data.packer.x_process_alive
    mutants 6, 9 and 12-20."""
    import os
    import shutil
    import subprocess
    import tempfile

    from replay_fsm.data.packer import process_alive

    assert process_alive(os.getpid())
    with tempfile.TemporaryDirectory() as tmp:
        odd = os.path.join(tmp, "x) Z y")  # the kernel keeps it as the process name
        os.symlink(shutil.which("sleep") or "/bin/sleep", odd)
        running = subprocess.Popen([odd, "60"])
        try:
            assert process_alive(running.pid)
        finally:
            running.kill()
            running.wait()
    zombie = subprocess.Popen(["true"])
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
    try:
        os.kill(zombie.pid, 0)  # still answers: the case process_alive must see through
        assert not process_alive(zombie.pid)
    finally:
        zombie.wait()
    assert not process_alive(zombie.pid)  # reaped: no such process


def test_process_alive_without_proc_or_permission_trusts_kill(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where /proc is missing, or the process is another user's, ``kill(pid, 0)`` is
    all there is: a process it does not call gone is alive. Kills x_process_alive
    mutants 7 and 21."""
    import os

    from replay_fsm.data import packer as packer_module

    def no_proc(*args: object, **kwargs: object) -> object:
        raise FileNotFoundError("/proc is not mounted here")

    monkeypatch.setattr(packer_module, "open", no_proc, raising=False)
    assert packer_module.process_alive(os.getpid())
    monkeypatch.undo()

    def not_yours(pid: int, sig: int) -> None:
        raise PermissionError(f"pid {pid} belongs to another user")

    monkeypatch.setattr(packer_module.os, "kill", not_yours)
    assert packer_module.process_alive(1)


def test_a_handles_pickled_state_rebuilds_its_views() -> None:
    """What a spawned collector unpickles: the state carries the shared tensors and
    semaphores but not the numpy views over them, which ``__setstate__`` rebuilds over
    the same memory. (Semaphores pickle only while spawning, so the test calls the
    two halves of the protocol itself.) Kills xǁPackerHandleǁ__setstate__ and
    xǁChannelǁ__setstate__ mutant 1 (the state not restored)."""
    _, h = make(n=4)
    state = h.__getstate__()
    assert "_state_np" not in state
    assert not {"_buf_np", "_text_np", "_idx_np"} & set(h.requests.__getstate__())
    clone = PackerHandle.__new__(PackerHandle)
    clone.__setstate__(state)
    for name in ("requests", "done"):
        channel = getattr(h, name)
        copy = Channel.__new__(Channel)
        copy.__setstate__(channel.__getstate__())
        setattr(clone, name, copy)
    clone.requests.put(request(0, 1, 4))
    assert decode(PackRequest, h.requests.get(timeout=1.0)[0]).slot == 1  # type: ignore[index]
    h.packer_state[0] = 77
    assert clone.packer_pid == 77


def forget_spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Record what the resource tracker is told to forget (and tell it)."""
    from multiprocessing import resource_tracker

    told: list[tuple[str, str]] = []
    unregister = resource_tracker.unregister

    def spy(name: str, rtype: str) -> None:
        told.append((name, rtype))
        unregister(name, rtype)

    monkeypatch.setattr(resource_tracker, "unregister", spy)
    return told


def test_an_orphaned_packer_closes_and_removes_every_shared_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The learner that created the handle is gone: the packer closes the channels
    and removes the semaphores' names, from the system and from the resource
    tracker (which would otherwise report them leaked at exit). Kills the mutants
    of xǁReplayBufferǁunlink and xǁChannelǁunlink 1, 2 and 4-9."""
    import os
    import subprocess

    rb, h = make()
    gone = subprocess.Popen(["true"])
    gone.wait()
    h.packer_state[2] = gone.pid  # the learner's pid, exited and reaped
    names = rb.semaphore_names + h.semaphore_names
    told = forget_spy(monkeypatch)
    packer = Packer(h, rb)
    assert not packer.service(timeout=0.0)
    assert packer.closed
    if os.path.isdir("/dev/shm"):
        assert set(names).isdisjoint(os.listdir("/dev/shm"))
    assert sorted(told) == sorted(("/" + n.removeprefix("sem."), "semaphore") for n in names)
    rb.unlink()  # already gone: nothing to do, nothing raised
    rb.add_packed(constant_rows(rb, 1, 2))  # the buffer keeps working here


def test_channel_unlink_goes_on_past_a_name_already_gone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A name already removed does not stop the unlinking of the others."""
    import _multiprocessing
    import os
    from multiprocessing import resource_tracker

    ch = Channel(2, 3)
    first, second = ("/" + n.removeprefix("sem.") for n in ch.semaphore_names)
    _multiprocessing.sem_unlink(first)
    resource_tracker.unregister(first, "semaphore")
    told = forget_spy(monkeypatch)
    ch.unlink()
    assert told == [(second, "semaphore")]
    if os.path.isdir("/dev/shm"):
        assert not set(ch.semaphore_names) & set(os.listdir("/dev/shm"))


UNLINK_IN_THE_CREATOR = """
import os
from replay_fsm import ReplayBuffer
from replay_fsm.data.packer import PackerHandle
rb = ReplayBuffer(16, 1, 1)
h = PackerHandle.create(2, 8, rb.width)
names = rb.semaphore_names + h.semaphore_names
shm = os.path.isdir("/dev/shm")
assert not shm or set(names) <= set(os.listdir("/dev/shm")), names
h.close()
# (before unlink)
h.unlink()
rb.unlink()
rb.unlink()  # twice: nothing left to do
assert not shm or set(names).isdisjoint(os.listdir("/dev/shm")), names
print("unlinked", len(names))
"""


def test_unlink_in_the_creating_process_leaves_nothing_to_report_at_exit() -> None:
    """``unlink`` in the process that made the semaphores (a learner cleaning up by
    hand): the names go at once, and the process exits without multiprocessing's own
    clean-up reporting them gone (a FileNotFoundError traceback per name) or the
    resource tracker reporting a leak."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", UNLINK_IN_THE_CREATOR],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["unlinked", "6"]
    assert "Traceback" not in done.stderr and "leaked" not in done.stderr, done.stderr


def test_unlink_in_a_bare_fork_child_removes_the_names() -> None:
    """A child of os.fork() inherits its parent's finalizer registry: the entries are
    the parent's, and unlink there removes the names as any other process does."""
    import os

    ch = Channel(2, 3)
    names = set(ch.semaphore_names)
    pid = os.fork()
    if pid == 0:  # the child: unlink, say by exit code whether the names went
        try:
            ch.unlink()
            gone = not os.path.isdir("/dev/shm") or names.isdisjoint(os.listdir("/dev/shm"))
        finally:
            os._exit(0 if gone else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    ch.unlink()  # here too: the parent's own clean-up finds them gone, and says nothing


def test_unlink_without_multiprocessing_internals_still_removes_the_names() -> None:
    """Where multiprocessing lacks the finalizer internals unlink looks for (another
    Python), unlink removes the names as any process does; only the exit-time report
    comes back."""
    import subprocess
    import sys

    script = UNLINK_IN_THE_CREATOR.replace(
        "# (before unlink)", "import multiprocessing.synchronize as s\n"
        "del s.SemLock._cleanup  # the finalizers made so far keep their own reference")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["unlinked", "6"]


def test_serve_forever_serves_until_its_learner_dies() -> None:
    """The packer-only process body: it ignores Ctrl-C (the learner decides), uses the
    torch threads it is given, serves requests, and ends on its own once its learner
    is gone, also while no request comes. Kills x_serve_forever mutants 2-14."""
    import signal
    import subprocess
    import threading

    from replay_fsm.data.packer import serve_forever

    rb, h = make(n=16)
    learner = subprocess.Popen(["sleep", "60"])  # stands in for the learner process
    h.packer_state[2] = learner.pid
    served: list[PackDone] = []
    ended_by_packer: list[bool] = []

    def learner_side() -> None:
        for tick in range(3):
            h.requests.put(request(tick, tick % 2, 16))
            served.append(decode(PackDone, *h.done.get(timeout=30)))  # type: ignore[misc]
        learner.kill()  # the learner dies; no request will come again
        try:
            h.done.get(timeout=30)  # the packer's close wakes this
            ended_by_packer.append(False)
        except ChannelClosed:
            ended_by_packer.append(True)
        h.close()  # in case it did not: lets serve_forever return

    before = signal.getsignal(signal.SIGINT), torch.get_num_threads()
    torch.set_num_threads(2)
    thread = threading.Thread(target=learner_side)
    thread.start()
    try:
        serve_forever(h, rb, poll_s=0.01, threads=1)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert torch.get_num_threads() == 1
    finally:
        signal.signal(signal.SIGINT, before[0])
        torch.set_num_threads(before[1])
        h.close()
        thread.join()
        learner.kill()
        learner.wait()
    assert [(d.tick, d.error) for d in served] == [(0, None), (1, None), (2, None)]
    assert ended_by_packer == [True]


class AskedWith:
    """A request channel that records the timeout of every ``get``."""

    def __init__(self, channel: Channel) -> None:
        self.channel, self.timeouts = channel, []  # type: list[float | None]

    def get(self, timeout: float | None = None) -> object:
        self.timeouts.append(timeout)
        # None (wait for ever) is recorded and not waited: a service that asks so
        # fails its test's check instead of hanging it.
        return self.channel.get(timeout=0.0 if timeout is None else timeout)

    def __getattr__(self, name: str) -> object:
        return getattr(self.channel, name)


def test_service_does_not_wait_unless_asked() -> None:
    """README: ``packer.service()`` between environment steps is non-blocking: with
    nothing to serve it asks the channel without waiting and says it served nothing;
    ``service(timeout)`` waits that long. Kills xǁPackerǁservice mutants 1 (a default of
    1 s), 14 and 21 (the first or the idle ask waits for ever), 15 (the first waits 1 s)
    and 16 (nothing served, True)."""
    rb, h = make()
    asked = AskedWith(h.requests)
    h.requests = asked  # type: ignore[assignment]
    packer = Packer(h, rb)
    assert packer.service() is False
    assert packer.service(timeout=0.02) is False
    # service(0.02) first asks without waiting (a request already there is served at
    # once), then, idle, draws the next indices ahead and waits
    assert asked.timeouts == [0.0, 0.0, 0.02]


def test_an_idle_packer_draws_the_next_ticks_indices_ahead() -> None:
    """Index drawing off the critical path: while idle, the packer draws the next
    tick's indices (seed + 1, current size); the pack uses them only when the request
    matches, so every batch is still INV-DATA's, hit or miss."""
    rb, h = make(rows=100)
    packer = Packer(h, rb)
    for tick in range(6):
        assert packer.service(timeout=0.01) is False  # idle: draws ahead (not at 0)
        if tick == 3:
            rb.add_packed(constant_rows(rb, 500, 7))  # the size moved since: a miss
        h.requests.put(request(tick, tick % 2, 32, seed=1000 + tick))
        assert packer.service(timeout=1.0)
        done = decode(PackDone, *h.done.get(timeout=1.0))  # type: ignore[misc]
        assert torch.equal(h.host_slots[tick % 2],
                           expected_batch(rb.storage, done.snapshot_size, 32, 1000 + tick))
    # tick 0 had no previous seed and tick 3 saw the size change: 4 drawn ahead
    assert packer.drawn_ahead == 4


def test_a_packers_error_text_that_utf8_cannot_encode_still_arrives() -> None:
    """A traceback can hold a lone surrogate (a file name decoded with
    surrogateescape); the channel replaces it rather than lose the error."""
    ch = Channel(2, 3, text_bytes=64)
    assert ch.put([1, 2, 3], "open('/data/\udc80x') failed", timeout=1.0)
    assert ch.get(timeout=1.0) == ([1, 2, 3], "open('/data/?x') failed")
    with pytest.raises(ValueError, match=r"^this channel carries no text \(text_bytes=0\)$"):
        Channel(2, 3).put([1, 2, 3], "no room for this")
    ch.close()


def test_asking_whether_a_process_lives_sends_it_no_signal() -> None:
    """``kill(pid, 0)`` only asks; any other signal would reach the process (SIGHUP
    ends a ``sleep``)."""
    import subprocess

    from replay_fsm.data.packer import process_alive

    child = subprocess.Popen(["sleep", "60"])
    try:
        assert process_alive(child.pid)
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=1.0)  # still running: nothing was sent to it
    finally:
        child.kill()
        child.wait()


def test_a_buffers_pickled_state_rebuilds_its_views() -> None:
    """What a spawned collector unpickles (semaphores pickle only while spawning, so
    the test calls the two halves itself): the counters are views of the same
    shared memory again."""
    rb = ReplayBuffer(16, 3, 2)
    rb.add_packed(constant_rows(rb, 1, 5))
    clone = ReplayBuffer.__new__(ReplayBuffer)
    clone.__setstate__(rb.__getstate__())
    assert (clone.ptr, clone.size) == (5, 5)
    rb.add_packed(constant_rows(rb, 6, 2))
    assert (clone.ptr, clone.size) == (7, 7)  # the same memory, not a copy


def test_a_channel_needs_room_for_one_record_of_one_field() -> None:
    ch = Channel(1, 1)  # the smallest channel
    assert ch.put([7]) and ch.get(timeout=1.0) == ([7], None)
    for capacity, width in ((0, 3), (2, 0)):
        with pytest.raises(ValueError) as info:
            Channel(capacity, width)
        assert str(info.value) == "capacity and width must be >= 1"


@pytest.mark.parametrize("values,message", [
    ([1, 2, 3], "a record of this channel has at most 2 values, got 3"),
    ([2**63, 1], "a record's values must be ints in the int64 range, got [9223372036854775808, 1]"),
    ([1.5, 1], "a record's values must be ints in the int64 range, got [1.5, 1]"),
])
def test_a_record_the_channel_cannot_carry_is_refused_and_takes_no_space(
        values: list, message: str) -> None:
    """A record is at most the channel's width of int64 values (a shorter one reads
    back zero-padded, from the ring and from ``post_local`` alike). One value too
    many would land on the text's length; refused before it takes a space, a bad
    record leaves the channel its room and its order."""
    ch = Channel(1, 2)
    for put in (ch.put, ch.post_local):
        with pytest.raises(ValueError) as info:
            put(values)
        assert str(info.value) == message
    assert ch.backlog == 0
    assert ch.put([4], timeout=1.0) and ch.get(timeout=1.0) == ([4, 0], None)
    assert ch.put([5, 6], timeout=1.0) and ch.get(timeout=1.0) == ([5, 6], None)
    ch.post_local([7])
    assert ch.get(timeout=1.0) == ([7, 0], None)


def test_an_empty_text_is_a_text_and_not_none() -> None:
    """A packer's error text may be empty; it must still read as an error."""
    ch = Channel(2, 1, text_bytes=8)
    ch.put([1], "")
    ch.put([2])
    assert [ch.get(timeout=1.0), ch.get(timeout=1.0)] == [([1], ""), ([2], None)]


def test_a_get_on_an_empty_channel_waits_no_longer_than_asked() -> None:
    ch = Channel(2, 1)
    finished, got = finishes_within(lambda: ch.get(timeout=0.01))
    ch.close()  # wakes a get that waits on (it raises ChannelClosed in there)
    assert finished and got == [None]


def test_a_channel_keeps_count_past_float_precision() -> None:
    """The head and tail counters are int64: a learner can run for billions of ticks.
    (As float32 they would stop advancing at 2**24, about 16.8 million messages.)"""
    ch = Channel(2, 1)
    ch._idx_np[:2] = 2**24  # as if 2**24 messages had gone through
    for k in range(3):
        assert ch.put([k]) and ch.backlog == 1
        assert ch.get(timeout=1.0) == ([k], None) and ch.backlog == 0
    assert int(ch._idx_np[0]) == 2**24 + 3


def test_a_packer_refuses_host_slots_of_another_width() -> None:
    rb = ReplayBuffer(64, 4, 2)
    with pytest.raises(ValueError) as info:
        Packer(PackerHandle.create(2, 8, rb.width + 1), rb)
    assert str(info.value) == (f"host slots are {rb.width + 1} columns wide but the "
                               f"replay buffer rows are {rb.width}")


def test_a_request_for_another_batch_size_fails_that_tick_by_name() -> None:
    rb, h = make(n=32)
    packer = Packer(h, rb)
    h.requests.put(request(0, 0, 5))
    assert packer.service(timeout=1.0)
    done = decode(PackDone, *h.done.get(timeout=1.0))  # type: ignore[misc]
    assert done.error is not None
    assert done.error.rstrip().endswith("ValueError: request for 5 rows, host slots hold 32")


def test_a_pack_is_timed_on_the_system_wide_clock() -> None:
    import time

    rb, h = make()
    packer = Packer(h, rb)
    before = time.monotonic_ns()
    h.requests.put(request(0, 0, 32))
    assert packer.service(timeout=1.0)
    done = decode(PackDone, *h.done.get(timeout=1.0))  # type: ignore[misc]
    assert before <= done.pack_start_ns <= done.pack_end_ns <= time.monotonic_ns()


def test_attaching_beats_the_heartbeat_and_names_the_packer() -> None:
    import os
    import time

    rb, h = make()
    learner = h.learner_pid
    assert (h.packer_pid, h.heartbeat_ns) == (0, 0)
    before = time.monotonic_ns()
    Packer.attach(h, rb)
    assert h.packer_pid == os.getpid() and h.learner_pid == learner
    assert before <= h.heartbeat_ns <= time.monotonic_ns()


def test_a_second_process_cannot_attach_while_the_first_lives() -> None:
    """Two collectors attached to one handle read one request channel, which has one
    reader: requests were lost or read twice, and the learner waited for ever with
    both alive (helper-58). A second attach raises while the first process lives;
    once it died, a restarted collector attaches, and so does this process again."""
    import os
    import subprocess

    from replay_fsm import ProtocolError
    from replay_fsm.data import owner

    rb, h = make()
    other = subprocess.Popen(["sleep", "600"])  # the first collector, alive
    try:
        h.packer_state[0] = other.pid
        with pytest.raises(ProtocolError) as info:
            Packer.attach(h, rb)
        assert str(info.value).startswith(
            f"process {other.pid} is attached to this packer handle already: one packer "
            "process per pipeline")
        assert h.packer_pid == other.pid  # unchanged
        # Its record, as its attach wrote it, names it by pid and start time: alive.
        pid_bits = owner.PID_BITS
        token, pid_ns, time_ns = owner.me()
        start = owner._stat(other.pid)[2]
        h.packer_state[3:6] = torch.tensor([other.pid | start << pid_bits, pid_ns, time_ns])
        with pytest.raises(ProtocolError):
            Packer.attach(h, rb)
        # The pid names another process since (reused after a SIGKILL): attaches.
        h.packer_state[3] = other.pid | (start + 1) << pid_bits
        Packer.attach(h, rb)
        assert h.packer_pid == os.getpid() and h.packer_record == owner.me()
        h.packer_state[0], h.packer_state[3:6] = other.pid, torch.zeros(3)
    finally:
        other.kill()
        other.wait()  # exited and reaped: its pid names no process
    Packer.attach(h, rb)
    assert h.packer_pid == os.getpid()
    Packer.attach(h, rb)  # this process again: its own attach, not another's
    assert h.packer_pid == os.getpid()


def answer_of(target: Callable[..., None], *args: object) -> object:
    """What ``target(*args, answers)`` puts on ``answers`` in a spawned process, which
    must then exit with 0 (it is killed if it has not within a minute)."""
    ctx = mp.get_context("spawn")
    answers = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, answers))
    proc.start()
    try:
        answer = answers.get(timeout=120)
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert proc.exitcode == 0
    return answer


def test_attaching_again_starts_no_more_learner_watch_threads() -> None:
    """Each ``Packer.attach`` in a collector process started another learner-watch
    thread, each looking every 0.25 s for as long as the learner lived: 5 attaches,
    5 threads (20, 20; helper-104). One per learner and replay buffer now; a fork
    child of the collector, which has none of its threads, starts its own."""
    from .collectors import attach_and_count_watches

    rb, h = make()
    other = PackerHandle.create(2, 32, rb.width)  # the fork child's: one packer a handle
    assert answer_of(attach_and_count_watches, [h, other], rb, 5) == (1, 1)


def test_the_learner_watch_thread_keeps_no_packer_alive() -> None:
    """The learner-watch thread ran a bound method of the first packer attached in
    the process, which it kept, with its handle's channels and host slots, for the
    process's life (helper-104). It holds the learner's pid and the buffer only."""
    from .collectors import attach_and_let_go

    rb, h = make()
    assert answer_of(attach_and_let_go, h, rb) == (1, True)


def test_a_pipelines_handle_refuses_another_buffer_of_the_same_width() -> None:
    """A collector that built its own buffer (same width, other dims) instead of using
    the learner's: attaching it to the pipeline's handle raises, where the batches
    came from either buffer depending on who packed."""
    from replay_fsm import Pipeline

    rb, other = ReplayBuffer(500, 4, 4), ReplayBuffer(500, 5, 2)
    assert rb.width == other.width and rb.buffer_id != other.buffer_id
    rb.add_packed(torch.randn(100, rb.width))
    with Pipeline(rb, sample_count=8, collector="external") as pipe:
        with pytest.raises(ValueError, match="for the pipeline of another replay buffer"):
            Packer.attach(pipe.packer_handle(), other)
        assert pipe.packer_handle().packer_pid == 0  # not attached
        Packer.attach(pipe.packer_handle(), rb)


def test_service_says_whether_it_served() -> None:
    rb, h = make(rows=10)
    packer = Packer(h, rb)
    assert packer.service(timeout=0) is False  # nothing asked
    assert packer.service(timeout=0.01) is False  # nothing came while it waited
    h.requests.put(request(0, 0, 32, min_ptr=50))  # more rows than the buffer has seen
    assert packer.service(timeout=0.01) is False  # waits (briefly) for the collector
    assert packer.service(timeout=0) is False
    rb.add_packed(constant_rows(rb, 2, 40))
    assert packer.service(timeout=0) is True
    assert h.done.get(timeout=1.0) is not None
    h.requests.put(request(1, 1, 32))
    h.close()  # the learner closed: what was asked is not served
    assert packer.service(timeout=0) is False and packer.closed


def _done_ptrs(h: PackerHandle, count: int) -> list[tuple[int, int]]:
    """(tick, snapshot_ptr) of the next ``count`` pack-done messages."""
    got = []
    for _ in range(count):
        done = decode(PackDone, *h.done.get(timeout=5.0))  # type: ignore[misc]
        got.append((done.tick, done.snapshot_ptr))
    return got


def test_serve_due_serves_every_due_request_past_a_claim_lock_that_stayed_taken(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A lock-step collector serves what is due before it adds rows: a claim whose
    lock stayed taken (a learner descheduled holding it) is retried, not left for
    after the next rows, where it would be packed at a larger ptr than it asked for
    (the SAC trainer lost its bit-identity so, on a loaded machine)."""
    rb, h = make(rows=100)
    packer = Packer(h, rb)
    real_claim, busy = h.claim, [True]

    def claim(*args: object) -> int | None:
        if busy.pop() if busy else False:
            return None  # the lock stayed taken this once
        return real_claim(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(h, "claim", claim)
    h.requests.put(request(0, 0, 32, min_ptr=100))
    h.requests.put(request(1, 1, 32, min_ptr=100))
    h.requests.put(request(2, 0, 32, min_ptr=150))  # due only after more rows
    assert packer.serve_due() == 2 and busy == []
    assert _done_ptrs(h, 2) == [(0, 100), (1, 100)]
    rb.add_packed(constant_rows(rb, 101, 50))
    assert packer.serve_due() == 1
    assert _done_ptrs(h, 1) == [(2, 150)]
    busy.append(True)  # the last request waiting, and its lock taken once
    h.requests.put(request(3, 1, 32, min_ptr=150))
    assert packer.serve_due() == 1 and busy == []
    assert _done_ptrs(h, 1) == [(3, 150)]


class _ValueUnread:
    """A semaphore whose value cannot be read, as on macOS (``sem_getvalue`` is not
    implemented there)."""

    def __init__(self, semaphore: Any) -> None:
        self._semaphore = semaphore

    def get_value(self) -> int:
        raise NotImplementedError()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._semaphore, name)


@pytest.mark.parametrize("value", ["read", "unread (macOS)"])
def test_serve_due_goes_on_past_a_request_the_learner_packed_itself(value: str) -> None:
    """The learner took every chunk of tick 0 (its own pack): the packer's service
    of it serves nothing, and the due request behind it must still be served now.
    Where the semaphore's value cannot be read (macOS), ``get_can_take`` sees no
    item there: the drop itself tells serve_due to go on."""
    rb, h = make(rows=100)
    packer, learner = Packer(h, rb), Packer(h, rb)
    if value != "read":
        h.requests._items = _ValueUnread(h.requests._items)  # type: ignore[assignment]
    first = decode(PackRequest, request(0, 0, 32, min_ptr=100))
    h.requests.put(request(0, 0, 32, min_ptr=100))
    h.requests.put(request(1, 1, 32, min_ptr=100))
    assert learner.take(first, timeout=1.0) == h.chunks  # all of tick 0
    assert packer.serve_due() == 1
    assert _done_ptrs(h, 2) == [(0, 100), (1, 100)]
    assert not h.requests.backlog


def _spin_guard(packer: Packer, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Record the timeout of each of ``packer``'s service calls; the 50th raises (a
    serve_due that retries at once, for as long as it spins)."""
    calls: list[float] = []
    real = packer.service

    def service(timeout: float = 0.0) -> bool:
        calls.append(timeout)
        if len(calls) >= 50:
            raise AssertionError(f"service called {len(calls)} times: a spin")
        return real(timeout)
    monkeypatch.setattr(packer, "service", service)
    return calls


class _PutEndsOnWait:
    """The items semaphore of a channel whose producer is held up inside its put
    (its record counted, its item not released): it runs again, and ends the put,
    once the consumer waits on the semaphore (not when it only tries it)."""

    def __init__(self, ch: Channel) -> None:
        self._ch, self._semaphore = ch, ch._items
        self.waits = 0

    def acquire(self, *args: Any, **kwargs: Any) -> bool:
        if kwargs.get("timeout") is not None:
            self.waits += 1
            if self.waits == 1:
                self._ch._items = self._semaphore
                _release_a_put(self._ch)
        return bool(self._semaphore.acquire(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._semaphore, name)


def test_serve_due_waits_for_an_item_on_its_way_on_the_semaphore(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A request counted whose item is not released yet (the learner's put held up
    between its count and its release: descheduled there, on a busy machine) is
    due and served now, as any other; serve_due retried it at once, a core spun
    for as long as the learner was held up (the very core it may need to run on).
    It waits on the channel's semaphore now, and serves it once the item comes."""
    rb, h = make(rows=100)
    packer = Packer(h, rb)
    requests = h.requests
    assert requests.put(request(0, 0, 32, min_ptr=100))
    _put_up_to_its_release(requests, *request(1, 1, 32, min_ptr=100))
    calls = _spin_guard(packer, monkeypatch)
    waiting = _PutEndsOnWait(requests)
    requests._items = waiting  # type: ignore[assignment]
    assert packer.serve_due() == 2
    assert _done_ptrs(h, 2) == [(0, 100), (1, 100)]
    assert waiting.waits == 1 and len(calls) == 4  # served, tried, waited, emptied
    assert not requests.backlog and requests._items.get_value() == 0


def test_serve_due_returns_where_no_item_comes_and_serves_the_request_later(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A request whose item a collector killed inside its get took, and nobody gave
    back (no restart measured it: this process never attached in its place), waits
    for the next request's item; serve_due spun until the learner sent one, which
    a lock-step learner only does after the rows serve_due holds off. It returns,
    and the request stays: served once the next request is sent, with that one's
    item (one behind, as ``service`` reads it)."""
    rb, h = make(rows=100)
    packer = Packer(h, rb)
    requests = h.requests
    assert requests.put(request(0, 0, 32, min_ptr=100))
    assert requests._items.acquire(timeout=1.0)  # the dead collector's get took it
    calls = _spin_guard(packer, monkeypatch)
    assert packer.serve_due() == 0 and len(calls) == 1
    assert requests.backlog == 1 and requests.unreleased == 1  # kept, not lost
    assert requests.put(request(1, 1, 32, min_ptr=100))
    assert packer.serve_due() == 1
    assert _done_ptrs(h, 1) == [(0, 100)]


def test_serve_due_returns_on_an_empty_or_closed_channel() -> None:
    rb, h = make(rows=100)
    packer = Packer(h, rb)
    assert packer.serve_due() == 0
    h.requests.put(request(0, 0, 32, min_ptr=100))
    h.close()
    assert packer.serve_due() == 0


def test_the_packer_beats_at_every_chunk_it_writes_and_the_learner_at_none(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A pack longer than ``liveness_timeout`` is not silence as long as its chunks
    come; the learner's own chunks must not beat, or they would hide a hung packer."""
    import replay_fsm.data.packer as packer_module
    from replay_fsm.data.packer import chunk_count

    clock = iter(range(1, 10**6))
    monkeypatch.setattr(packer_module.time, "monotonic_ns", lambda: next(clock))
    rb = ReplayBuffer(8192, 4, 2, region_rows=1024)
    rb.add_packed(constant_rows(rb, 1, 8192))
    n = 4096
    assert chunk_count(n) == 4
    h = PackerHandle.create(2, n, rb.width)
    beats: list[int] = []
    gather = rb.gather

    def gather_and_read_the_beat(*args: object, **kwargs: object) -> object:
        beats.append(h.heartbeat_ns)
        return gather(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(rb, "gather", gather_and_read_the_beat)
    packer = Packer(h, rb)
    h.requests.put(request(0, 0, n))
    assert packer.service(timeout=0.0)
    assert len(beats) == 4 and beats == sorted(set(beats))  # a new beat per chunk
    learner = Packer(h, rb)
    beats.clear()
    h.requests.put(request(1, 1, n))
    assert learner.take(decode(PackRequest, request(1, 1, n)), 1.0) == 4
    assert len(set(beats)) == 1  # the learner's chunks left the packer's beat alone


@IN_ORDER
def test_a_consumer_killed_inside_its_get_has_its_item_given_back() -> None:
    """A consumer killed between taking a record's item and counting the record taken
    left the items semaphore one short for good: the next get read that record with
    the next record's item, every later one a record behind, and the newest waited
    until another was put (helper-100, the restarted collector's case). A consumer in
    its place gives the item back, once, and reads every record with its own."""
    ch = Channel(4, 1)
    assert ch.put([1]) and ch.put([2])
    assert ch._items.acquire(timeout=1.0)  # the dead consumer's get: item, no count
    assert ch.unreleased == 1
    assert ch.restore_taken(1.0) == 1
    assert ch.unreleased == 0
    assert [ch.get(timeout=1.0), ch.get(timeout=1.0)] == [([1], None), ([2], None)]
    assert ch.get(timeout=0) is None
    assert ch.restore_taken(1.0) == 0  # nothing taken: nothing given back


def test_a_get_can_take_a_record_whose_item_is_there_or_on_its_way() -> None:
    """``get_can_take`` tells a record worth waiting for (its item there, or its
    put between its count and its release) from one whose item a consumer killed
    inside its get took, which no wait brings."""
    ch = Channel(4, 1)
    assert not ch.get_can_take  # empty
    assert ch.put([1])
    assert ch.get_can_take
    assert ch._items.acquire(timeout=1.0)  # the dead consumer's get: item, no count
    assert not ch.get_can_take
    _put_up_to_its_release(ch, 2)
    assert ch.get_can_take  # its release brings an item
    _release_a_put(ch)
    assert ch.get_can_take and ch.get(timeout=0) == ([1], None)
    assert not ch.get_can_take  # record 2 waits on the next put's item
    ch.post_local([3])
    assert ch.get_can_take


def test_on_a_cpu_that_may_reorder_a_puts_stores_nothing_is_given_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The reading that proves no put is between its count and its release rests on
    x86's store order; elsewhere the item stays taken (the run goes on a record
    behind, as before restore_taken), never one given back that a put still owns."""
    from replay_fsm.data import channel as channel_module

    monkeypatch.setattr(channel_module, "STORES_IN_ORDER", False)
    ch = Channel(4, 1)
    assert ch.put([1]) and ch.put([2])
    assert ch._items.acquire(timeout=1.0)  # the dead consumer's get: item, no count
    assert ch.restore_taken(1.0) == 0
    assert ch.unreleased == 1


@pytest.mark.parametrize("machine, bits, ordered", [
    ("x86_64", 64, True), ("AMD64", 64, True), ("x86_64", 32, False),
    ("i386", 32, False), ("i686", 32, False), ("aarch64", 64, False),
    ("arm64", 64, False), ("ppc64le", 64, False), ("riscv64", 64, False)])
def test_only_a_64_bit_x86_interpreter_counts_as_showing_stores_in_order(
        machine: str, bits: int, ordered: bool) -> None:
    """i386 was counted as ordered: its interpreter may store an 8-byte count in two
    halves, and restore_taken may read one between them (helper-109)."""
    from replay_fsm.data.channel import orders_stores
    assert orders_stores(machine, bits) is ordered


@IN_ORDER
def test_a_put_between_its_count_and_its_release_is_not_taken_for_a_dead_get(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A put counts its record, then releases its item: in between, the semaphore
    is one short as after a dead consumer's get. That item must not be given back
    too (a get would then take an item no record is behind), so the shortfall is
    read only once no put is in between: waited out, or, past the patience, nothing
    is given back."""
    import time
    from types import SimpleNamespace

    from replay_fsm.data import channel as channel_module

    ch = Channel(4, 1)
    assert ch.put([1])
    assert ch._items.acquire(timeout=1.0)  # as if the put had not released it yet
    ch._counters[3] -= 1
    assert ch.unreleased == 1
    assert ch.restore_taken(0.01) is None  # the put never ends: nothing given back
    assert ch.restore_taken(0.0) is None  # one reading, none under way: ask again
    assert ch.get(timeout=0) is None

    def the_put_ends(seconds: float) -> None:  # the producer runs while this one sleeps
        ch._items.release()
        ch._counters[3] += 1
    monkeypatch.setattr(channel_module, "time", SimpleNamespace(
        monotonic=time.monotonic, sleep=the_put_ends))
    assert ch.restore_taken(60.0) == 0  # read after the put ended: no get took an item
    assert ch.get(timeout=1.0) == ([1], None)
    assert ch.get(timeout=0) is None

    # Both: a dead consumer's get took record 2's item, and a put of record 3 has
    # counted it and not yet released its item.
    assert ch.put([2])
    assert ch._items.acquire(timeout=1.0)
    assert ch.put([3])
    assert ch._items.acquire(timeout=1.0)
    ch._counters[3] -= 1
    assert ch.unreleased == 2
    assert ch.restore_taken(60.0) == 1  # the dead get's item; the put's its own
    assert ch.unreleased == 0
    assert [ch.get(timeout=1.0), ch.get(timeout=1.0)] == [([2], None), ([3], None)]
    assert ch.get(timeout=0) is None


@IN_ORDER
def test_a_give_back_with_no_patience_reads_once_and_never_sleeps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A restart whose attach could not measure what was lost reads again at every
    ``service`` call (a collector's every environment step) with a patience of 0:
    one reading, never a sleep, however coarse the clock (here one that has not
    moved since the deadline was taken)."""
    from types import SimpleNamespace

    from replay_fsm.data import channel as channel_module

    def sleep(seconds: float) -> None:
        raise AssertionError(f"slept {seconds} s")
    monkeypatch.setattr(channel_module, "time", SimpleNamespace(
        monotonic=lambda: 100.0, sleep=sleep))
    ch = Channel(4, 1)
    assert ch.put([1])
    assert ch._items.acquire(timeout=1.0)  # as if the put had not released it yet
    ch._counters[3] -= 1
    assert ch.restore_taken(0.0) is None
    ch._counters[4] += 1  # the next put went for a place
    assert ch.restore_spaces(0.0) == 0  # none lost; the put may take one


class _Asked:
    """A channel's semaphore that records how each acquire was asked."""

    def __init__(self, semaphore: Any) -> None:
        self._semaphore = semaphore
        self.asked: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def acquire(self, *args: Any, **kwargs: Any) -> bool:
        self.asked.append((args, kwargs))
        return bool(self._semaphore.acquire(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._semaphore, name)


def test_a_get_with_no_time_to_wait_tries_the_semaphore_without_a_wait() -> None:
    """``get(timeout=0)``, every ``service(timeout=0)`` call of a collector between
    its environment steps, asked the items semaphore to wait 0 s: a wait for a
    deadline already past, 67-77 us a call on Linux (helper-121, 2,000 calls, an
    empty channel; 0.07 us tried without a wait). It tries it now, and still takes
    a record there."""
    ch = Channel(2, 1)
    items = _Asked(ch._items)
    ch._items = items
    assert ch.get(timeout=0) is None
    assert ch.put([1])
    assert ch.get(timeout=0) == ([1], None)
    assert ch.get(timeout=-1.0) is None
    assert ch.put([2])
    assert ch.get(timeout=1.0) == ([2], None)
    assert items.asked == [((False,), {})] * 3 + [((), {"timeout": 1.0})]


@IN_ORDER
@pytest.mark.parametrize("namespaces, given_back", [
    ((0,), 1), ((1,), 0), ((1, 0), 0)])
def test_a_restart_gives_back_the_item_a_predecessor_surely_dead_took(
        namespaces: tuple[int, ...], given_back: int) -> None:
    """The attach of a collector in place of a dead one gives back the request's
    item its predecessor took inside its get, so it reads that request next, not
    one behind. Only where the predecessor is surely dead: one of another pid
    namespace cannot be judged, and the attach goes on (it may live, inside its
    get: its item is its own). Nor after such an attach, whatever the predecessor:
    the reader before it may live on inside its get (helper-115; the item was given
    back, and that reader's count of it would make one too many)."""
    import os
    import subprocess

    from replay_fsm.data import owner

    rb, h = make()
    gone = subprocess.Popen(["true"])
    gone.wait()  # exited and reaped
    token, pid_namespace, time_namespace = owner.me()
    h.requests.put(request(0, 0, 32))
    assert h.requests._items.acquire(timeout=1.0)  # its get took the item, and it died
    for other in namespaces:
        h.packer_state[0] = gone.pid
        h.packer_state[3:6] = torch.tensor([gone.pid | 1 << owner.PID_BITS,
                                            pid_namespace + other, time_namespace])
        Packer.attach(h, rb)
        assert h.packer_pid == os.getpid() and h.predecessor == (0, gone.pid)
    assert h.requests.unreleased == 1 - given_back
    got = h.requests.get(timeout=0)
    assert (got is None) == (given_back == 0)
    if got is not None:
        assert decode(PackRequest, got[0]).tick == 0


@IN_ORDER
def test_a_restart_given_its_dead_predecessors_pid_is_a_restart() -> None:
    """A collector restarted with the pid its dead predecessor had (given again, or
    a restarted container's first process) was taken for that process attaching
    again: no predecessor recorded, so the requests the dead one read were never
    known lost, and the item it took inside its get was never given back (helper-109).
    The record tells them apart; the same process attaching again is no restart."""
    import os

    from replay_fsm.data import owner

    rb, h = make()
    token, pid_namespace, time_namespace = owner.me()
    h.requests.put(request(0, 0, 32))
    assert h.requests.get(timeout=0) is not None  # the dead one read tick 0's request
    h.requests.put(request(1, 1, 32))
    assert h.requests._items.acquire(timeout=1.0)  # and took tick 1's item, and died
    h.packer_state[0] = os.getpid()
    h.packer_state[3:6] = torch.tensor([token + (1 << owner.PID_BITS), pid_namespace,
                                        time_namespace])  # my pid, another start
    Packer.attach(h, rb)
    assert h.predecessor == (1, os.getpid())
    assert h.requests.unreleased == 0  # given back
    Packer.attach(h, rb)  # this process again: no restart
    assert h.predecessor == (1, os.getpid()) and h.requests.unreleased == 0
    got = h.requests.get(timeout=0)
    assert got is not None and decode(PackRequest, got[0]).tick == 1


@IN_ORDER
@pytest.mark.parametrize("proc", ["failed once", "unreadable"])
def test_a_process_attaching_again_after_a_record_of_no_process_is_no_restart(
        proc: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process whose first attach recorded no process (``owner.me()`` failed that
    once, out of descriptors, say, or /proc cannot be read) attaches again: that is
    no restart. Taken for one, it refused itself as another live process, or would
    give back the item its own get is taking (INV-DATA). "failed once" kills the
    mutant of ``Packer.attach`` that tells the same process by its record alone
    (``record == owner.me()``), which every other test let live."""
    import os

    from replay_fsm.data import owner

    rb, h = make()
    monkeypatch.setattr(owner, "_me", owner.UNKNOWN if proc == "unreadable" else None)
    with monkeypatch.context() as failing:
        if proc == "failed once":
            def out_of_descriptors(pid: int | str) -> tuple[int, bytes, int]:
                raise OSError(24, "Too many open files")
            failing.setattr(owner, "_stat", out_of_descriptors)
        Packer.attach(h, rb)
    assert h.packer_pid == os.getpid() and h.packer_record == owner.UNKNOWN
    if proc == "failed once":
        assert owner.me() != owner.UNKNOWN  # and reads this process now
    h.requests.put(request(0, 0, 32))
    assert h.requests._items.acquire(timeout=1.0)  # a get of this process, under way
    Packer.attach(h, rb)
    assert h.predecessor == (0, 0) and h.requests.unreleased == 1  # nothing given back


@IN_ORDER
def test_a_restart_without_the_claim_lock_gives_nothing_back() -> None:
    """An attach that could not take the claim lock (held for its whole look) goes
    on without it; two such restarts at once would each give the same item back, a
    get then taking an item no record is behind (helper-109). Without the lock,
    nothing is given back: the restart reads a request behind, as before."""
    import subprocess

    from replay_fsm.data import owner

    rb, h = make()
    gone = subprocess.Popen(["true"])
    gone.wait()
    h.requests.put(request(0, 0, 32))
    assert h.requests._items.acquire(timeout=1.0)  # its get took the item, and it died
    h.packer_state[0] = gone.pid
    h.packer_state[3:6] = torch.tensor([gone.pid | 1 << owner.PID_BITS, *owner.me()[1:]])
    assert h.claim_lock.acquire(timeout=1.0)  # held by another attach
    try:
        Packer.attach(h, rb)
    finally:
        h.claim_lock.release()
    assert h.requests.unreleased == 1


def _get_killed_after_its_count(ch: Channel) -> None:
    """What a consumer killed inside its get, between counting its record taken and
    freeing the record's place, did: took the item, counted the record, freed
    nothing."""
    assert ch._items.acquire(timeout=1.0)
    ch._counters[0] += 1


def _get_killed_before_its_count(ch: Channel) -> None:
    """What a consumer killed inside its get before counting its record taken did:
    took the item, nothing more."""
    assert ch._items.acquire(timeout=1.0)


def _count_a_put(ch: Channel, *values: int) -> None:
    """What a put that took its place does from there up to its release: writes
    its record, counts it, settles (its producer is descheduled there, say)."""
    i = ch._counters[1] % ch.capacity
    ch._bytes[i * ch._record.size:(i + 1) * ch._record.size] = ch._record.pack(*values, -1)
    ch._counters[1] += 1
    ch._counters[5] = ch._counters[4]


def _release_a_put(ch: Channel) -> None:
    """The rest of a put that counted its record: releases its item."""
    ch._items.release()
    ch._counters[3] = ch._counters[1]


def _end_a_put(ch: Channel, *values: int) -> None:
    """What a put that took its place does from there: writes its record, counts
    it, settles, releases its item."""
    _count_a_put(ch, *values)
    _release_a_put(ch)


def _put_up_to_its_release(ch: Channel, *values: int) -> None:
    """A put from its start to its release, not made: the learner's put held up
    between counting its record and releasing its item."""
    ch._counters[4] += 1
    assert ch._spaces.acquire(timeout=1.0)
    _count_a_put(ch, *values)


class _ReadAfter:
    """A channel's semaphore whose value, read the first time, is read only after
    ``first`` ran: what another process did between a reader's reads."""

    def __init__(self, semaphore: Any, first: Callable[[], None]) -> None:
        self._semaphore = semaphore
        self._first: Callable[[], None] | None = first

    def get_value(self) -> int:
        if self._first is not None:
            first, self._first = self._first, None
            first()
        return int(self._semaphore.get_value())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._semaphore, name)


@IN_ORDER
def test_a_consumer_killed_inside_its_get_after_its_count_has_its_place_given_back(
        ) -> None:
    """A consumer killed between counting a record taken and freeing its place left
    the ring a place short for good: each such death one more, until the producer's
    put waited for ever (a restarted collector's: the learner failed with "request
    channel stayed full" after 4 kills at ring_depth 2, helper-112). A consumer in
    its place gives the place back, once: the ring holds ``capacity`` records
    again."""
    ch = Channel(4, 1)
    assert ch.put([1]) and ch.put([2])
    _get_killed_after_its_count(ch)
    assert ch._spaces.get_value() == ch.capacity - ch.backlog - 1  # one place lost
    assert ch.lost_spaces == 1
    assert ch.restore_spaces(1.0) == 1
    assert ch.lost_spaces == 0
    assert [ch.put([k], timeout=0) for k in (3, 4, 5, 6)] == [True, True, True, False]
    assert ch.restore_spaces(1.0) == 0  # nothing lost: nothing given back
    assert [ch.get(timeout=0) for _ in range(5)] == [
        ([2], None), ([3], None), ([4], None), ([5], None), None]


def test_on_a_cpu_that_may_reorder_a_puts_stores_no_place_is_given_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As restore_taken: the reading that proves no put holds a place it has not
    counted rests on x86's store order; elsewhere the place stays lost."""
    from replay_fsm.data import channel as channel_module

    monkeypatch.setattr(channel_module, "STORES_IN_ORDER", False)
    ch = Channel(4, 1)
    assert ch.put([1]) and ch.put([2])
    _get_killed_after_its_count(ch)
    assert ch.restore_spaces(1.0) == 0
    assert ch.lost_spaces == 1


@IN_ORDER
def test_a_put_between_taking_its_place_and_counting_its_record_is_not_taken_for_a_lost_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A put takes a place, then counts its record: in between, the spaces semaphore
    is one short as after a dead consumer's get. That place must not be given back
    too (a later put would then write over a record not read yet, INV-DATA), so the
    shortfall is read only once no put may hold a place it has not counted: waited
    out, or, past the patience, nothing is given back."""
    import time
    from types import SimpleNamespace

    from replay_fsm.data import channel as channel_module

    ch = Channel(4, 1)

    def begin_a_put() -> None:  # Channel.put up to its acquire
        ch._counters[4] += 1
        assert ch._spaces.acquire(timeout=1.0)

    def end_the_put(value: int) -> None:  # and from there
        i = ch._counters[1] % ch.capacity
        ch._bytes[i * ch._record.size:(i + 1) * ch._record.size] = ch._record.pack(
            value, -1)
        ch._counters[1] += 1
        ch._counters[5] = ch._counters[4]
        ch._items.release()
        ch._counters[3] = ch._counters[1]

    assert ch.put([1])
    begin_a_put()
    assert ch.lost_spaces == 1
    assert ch.restore_spaces(0.01) is None  # the put never ends: nothing given back

    def the_put_ends(seconds: float) -> None:  # the producer runs while this one sleeps
        end_the_put(2)
    monkeypatch.setattr(channel_module, "time", SimpleNamespace(
        monotonic=time.monotonic, sleep=the_put_ends))
    assert ch.restore_spaces(60.0) == 0  # read after the put ended: no place lost
    assert ch.lost_spaces == 0
    assert [ch.get(timeout=0) for _ in range(3)] == [([1], None), ([2], None), None]

    # Both: a dead consumer's get lost record 3's place, and a put of record 4 has
    # taken its place and not counted its record yet.
    assert ch.put([3])
    _get_killed_after_its_count(ch)
    begin_a_put()
    assert ch.lost_spaces == 2

    def the_put_ends_once(seconds: float) -> None:
        end_the_put(4)
        monkeypatch.setattr(channel_module, "time", time)
    monkeypatch.setattr(channel_module, "time", SimpleNamespace(
        monotonic=time.monotonic, sleep=the_put_ends_once))
    assert ch.restore_spaces(60.0) == 1  # the dead get's place; the put's its own
    assert ch.lost_spaces == 0
    assert [ch.put([k], timeout=0) for k in (5, 6, 7, 8)] == [True, True, True, False]
    assert [ch.get(timeout=0) for _ in range(5)] == [
        ([4], None), ([5], None), ([6], None), ([7], None), None]


@IN_ORDER
def test_a_put_waiting_for_a_place_with_every_place_lost_gets_all_but_one_back(
        ) -> None:
    """Every place lost and no record left to get: the producer's put waits for a
    place, and no reading finds no put under way (begun stays one past settled),
    so nothing was given back, and the put waited until its timeout. With one
    producer, a put under way holds at most one place: all the places missing but
    that one are given back (None: the last may be lost too), the put gets one, and
    a reading after it gives the last back."""
    ch = Channel(4, 1)
    for k in range(4):
        assert ch.put([k])
        _get_killed_after_its_count(ch)
    assert ch.lost_spaces == 4 and ch.backlog == 0
    ch._counters[4] += 1  # a put began: it waits for a place
    assert ch.restore_spaces(0.0) is None
    assert ch._spaces.get_value() == 3
    assert ch._spaces.acquire(timeout=1.0)  # it gets a place, and puts record 4
    _end_a_put(ch, 4)
    assert ch.restore_spaces(0.0) == 1
    assert [ch.put([k], timeout=0) for k in (5, 6, 7, 8)] == [True, True, True, False]
    assert [ch.get(timeout=0) for _ in range(5)] == [
        ([4], None), ([5], None), ([6], None), ([7], None), None]


@IN_ORDER
def test_the_place_a_put_under_way_took_is_not_given_back_with_the_lost_ones() -> None:
    """A put between taking its place and counting its record shows that place
    missing as a lost one does; given back with them, a later put would write over
    a record not read yet. A reading with that put under way all through it gives
    back all the places missing but one: here the two lost, and not the put's."""
    ch = Channel(4, 1)
    assert ch.put([1]) and ch.put([2])
    _get_killed_after_its_count(ch)
    _get_killed_after_its_count(ch)
    ch._counters[4] += 1  # a put of record 3 took its place, and counted nothing
    assert ch._spaces.acquire(timeout=1.0)
    assert ch.lost_spaces == 3
    assert ch.restore_spaces(0.0) is None
    _end_a_put(ch, 3)
    assert ch.lost_spaces == 0  # the two lost ones given back, and no more
    assert ch.restore_spaces(0.0) == 0
    assert [ch.put([k], timeout=0) for k in (4, 5, 6, 7)] == [True, True, True, False]
    assert [ch.get(timeout=0) for _ in range(5)] == [
        ([3], None), ([4], None), ([5], None), ([6], None), None]

    # The put under way may end during the reading, and the next begin and take
    # its place: the reading then counts two places taken by puts, one with its
    # record counted after the tail was read. Only a reading whose begun is
    # unmoved after the semaphore's read gives back all but one.
    ch = Channel(4, 1)
    assert ch.put([1])
    _get_killed_after_its_count(ch)  # one place lost
    ch._counters[4] += 1  # the put of record 2 began
    spaces = ch._spaces

    def puts() -> None:  # between the reading's tail and its semaphore
        assert spaces.acquire(timeout=1.0)  # record 2's put goes on
        _end_a_put(ch, 2)
        ch._counters[4] += 1  # the put of record 3 begins, and takes its place
        assert spaces.acquire(timeout=1.0)
    ch._spaces = _ReadAfter(spaces, puts)
    try:
        assert ch.restore_spaces(0.0) is None
    finally:
        ch._spaces = spaces
    _end_a_put(ch, 3)  # record 3's put ends
    assert ch.backlog + spaces.get_value() <= ch.capacity


def _dead_predecessor(h: PackerHandle, namespace_step: int = 0) -> None:
    """Record as the attached packer a process that is gone (exited and reaped), of
    this pid namespace or, ``namespace_step`` away, of another (not to be judged)."""
    import subprocess

    from replay_fsm.data import owner

    gone = subprocess.Popen(["true"])
    gone.wait()
    token, pid_namespace, time_namespace = owner.me()
    h.packer_state[0] = gone.pid
    h.packer_state[3:6] = torch.tensor([gone.pid | 1 << owner.PID_BITS,
                                        pid_namespace + namespace_step, time_namespace])


def _requests_waiting_for_rows(
        rb: ReplayBuffer, requests: Channel, ticks: int,
        killed: Callable[[Channel], None] = _get_killed_after_its_count) -> int:
    """Send ticks 0 to ``ticks`` - 1, each waiting for rows no add writes (a request
    read waits: nothing is packed), then have tick 0 taken by a get ``killed`` inside
    it; returns the ``min_ptr`` they wait for."""
    unreached = rb.ptr + 10**6
    for tick in range(ticks):
        assert requests.put(request(tick, tick % 2, 32, min_ptr=unreached))
    killed(requests)
    return unreached


def _a_learner_waiting_for_a_place(
        requests: Channel, min_ptr: int = -1) -> tuple[threading.Thread, threading.Event]:
    """Send tick 4 to slot 0 from a thread, as the learner does, once no place is
    free: returns when its put began (it waits for a place), with the thread and an
    event set once the request is sent (a put the channel's close ended sets none)."""
    import time

    sent = threading.Event()

    def send() -> None:
        with contextlib.suppress(ChannelClosed):
            if requests.put(request(4, 0, 32, min_ptr=min_ptr), timeout=MARGIN_S):
                sent.set()
    began = int(requests._counters[4]) + 1
    learner = threading.Thread(target=send, daemon=True)
    learner.start()
    deadline = time.monotonic() + MARGIN_S
    while requests._counters[4] != began:
        assert time.monotonic() < deadline, "the learner's put did not begin"
        time.sleep(0.001)
    return learner, sent


@contextlib.contextmanager
def _a_get_beside_the_first_reading(h: PackerHandle) -> Iterator[Any]:
    """For the block, the first reading of the request channel's free places comes
    after a collector attaching beside (without the claim lock) set UNSURE and got
    tick 1 up to the release of its place; yields the channel's own semaphore of
    places, which it has again after the block."""
    requests = h.requests
    spaces = requests._spaces

    def beside() -> None:  # its attach, then its get of tick 1 up to the release
        h.packer_state[8] = 1  # UNSURE
        assert requests._items.acquire(timeout=1.0)
        requests._counters[0] += 1
    requests._spaces = _ReadAfter(spaces, beside)
    try:
        yield spaces
    finally:
        requests._spaces = spaces


@contextlib.contextmanager
def _an_item_taken_beside_the_first_reading(h: PackerHandle) -> Iterator[Any]:
    """For the block, the first reading of the request channel's items comes after a
    collector attaching beside (without the claim lock) set UNSURE and took an item in
    its get, not counted yet; yields the channel's own semaphore of items, which it has
    again after the block."""
    requests = h.requests
    items = requests._items

    def beside() -> None:  # its attach, and its get's acquire
        h.packer_state[8] = 1  # UNSURE
        assert items.acquire(timeout=1.0)
    requests._items = _ReadAfter(items, beside)
    try:
        yield items
    finally:
        requests._items = items


@IN_ORDER
def test_a_restart_gives_back_the_place_a_predecessor_surely_dead_lost() -> None:
    """The attach of a collector in place of one killed inside its get, after it
    counted the request read and before it freed its place, gives the place back:
    four such kills at ring_depth 2 had left the learner no place to send a
    request in. Only while every reader before is surely dead: once an attach could
    not judge its predecessor (another pid namespace), that one may live between
    its count and its release and free its place itself, one too many; no later
    restart gives a place back."""
    rb, h = make()
    h.requests.put(request(0, 0, 32))
    _get_killed_after_its_count(h.requests)
    _dead_predecessor(h)
    Packer.attach(h, rb)
    assert h.requests.lost_spaces == 0

    rb, h = make()
    h.requests.put(request(0, 0, 32))
    _get_killed_after_its_count(h.requests)
    _dead_predecessor(h, namespace_step=1)
    Packer.attach(h, rb)  # cannot judge it: the place may be its own to free
    assert h.requests.lost_spaces == 1
    _dead_predecessor(h)
    Packer.attach(h, rb)  # surely dead, but the one before it may live
    assert h.requests.lost_spaces == 1


@IN_ORDER
def test_after_a_restart_without_the_claim_lock_no_place_is_given_back() -> None:
    """An attach that could not take the claim lock may have run beside another
    (both then read the request channel, one unrecorded): no later restart gives a
    lost place back, since that reader may free it itself."""
    rb, h = make()
    assert h.claim_lock.acquire(timeout=1.0)  # held by another attach
    try:
        Packer.attach(h, rb)
    finally:
        h.claim_lock.release()
    h.requests.put(request(0, 0, 32))
    _get_killed_after_its_count(h.requests)
    _dead_predecessor(h)
    Packer.attach(h, rb)
    assert h.requests.lost_spaces == 1
    assert h.requests.get(timeout=0) is None  # the request it counted read: not again


@IN_ORDER
def test_a_get_of_a_collector_attaching_beside_the_restart_is_not_given_back(
        ) -> None:
    """A second collector attaching while the restart gives back (its wait for the
    claim lock ran out: it attaches without it) sets UNSURE and gets. UNSURE was
    read before the restart's measurement, which then counted that get, between
    its count and its release, as a place lost: the place was given back, and freed
    again by the get, one place too many (a put could then write over a request not
    read yet, INV-DATA). UNSURE is read after the measurement."""
    rb, h = make()
    requests = h.requests
    _requests_waiting_for_rows(rb, requests, 2)  # read tick 0, never freed its place
    _dead_predecessor(h)
    with _a_get_beside_the_first_reading(h) as spaces:
        Packer.attach(h, rb)
    spaces.release()  # the get beside frees its place
    assert requests.backlog + spaces.get_value() <= requests.capacity
    assert requests.lost_spaces == 1  # the dead one's, which nobody may give back now


@IN_ORDER
def test_an_item_a_collector_attaching_beside_the_restart_took_is_not_given_back(
        ) -> None:
    """As above, for items: the get beside took an item and had not counted its
    request read when the restart measured what the items semaphore lacks; that
    item was given back too, and a get then found an item with no request behind
    it (a request read twice, or a slot never written)."""
    rb, h = make()
    requests = h.requests
    _requests_waiting_for_rows(rb, requests, 2, killed=_get_killed_before_its_count)
    _dead_predecessor(h)
    with _an_item_taken_beside_the_first_reading(h) as items:
        Packer.attach(h, rb)
    requests._counters[0] += 1  # the get beside counts tick 0 read
    assert items.get_value() <= requests.backlog


@IN_ORDER
def test_a_get_of_a_collector_attaching_beside_a_later_give_back_is_not_given_back(
        ) -> None:
    """As above, at a service call's give-back: the attach kept the places back (the
    learner's put was under way), and a later call reads again. A collector
    attaching beside it then, without the claim lock, sets UNSURE and gets: read
    only before that reading, its get between its count and its release was
    counted as a place lost and given back, then freed again by the get (the
    mutant passing no ``alone`` at the service call's reading gave 5 places of 4)."""
    rb, h = make()
    requests = h.requests
    unreached = _requests_waiting_for_rows(rb, requests, 2)  # tick 0 read, not freed
    _dead_predecessor(h)
    requests._counters[4] += 1  # the learner's put of tick 2 began
    packer = Packer.attach(h, rb)
    assert packer.places_owed and requests.lost_spaces == 1  # kept back
    spaces = requests._spaces
    assert spaces.acquire(timeout=1.0)  # the put takes its place and ends
    _end_a_put(requests, *request(2, 0, 32, min_ptr=unreached))
    with _a_get_beside_the_first_reading(h):
        assert not packer.service(timeout=0)  # reads again, then gets tick 2
    spaces.release()  # the get beside frees its place
    assert requests.backlog + spaces.get_value() <= requests.capacity
    assert requests.lost_spaces == 1 and not packer.places_owed



@IN_ORDER
def test_a_restart_gives_the_item_back_once_the_learners_put_held_up_at_its_attach_ends(
        ) -> None:
    """The attach of a collector in place of one killed inside its get reads what
    the items semaphore lacks only where no put of the learner's is between
    counting its request and releasing its item. It read for 0.05 s at most, then
    gave nothing back, for good: a learner descheduled inside its put longer than
    that (a busy machine) left the restart reading every request with the next
    one's item, and the newest with none (the learner's wait for it failed the
    run: "no get can take"). The attach reads once; each ``service`` call reads
    again until the put has ended, and gives the item back then: every request is
    served, each with its own item, none twice, none lost."""
    rb, h = make()
    requests = h.requests
    assert requests.put(request(0, 0, 32))
    assert requests._items.acquire(timeout=1.0)  # its get took the item, and it died
    _put_up_to_its_release(requests, *request(1, 1, 32))  # the learner, held up
    _dead_predecessor(h)
    packer = Packer.attach(h, rb)  # all through its reading: held up longer than it
    assert not packer.service(timeout=0)  # still held up: nothing given back, or read
    assert requests.unreleased == 2 and requests.taken == 0
    _release_a_put(requests)  # the learner runs again, and its put ends
    assert packer.service(timeout=0) and packer.service(timeout=0)
    assert [decode(PackDone, *h.done.get(timeout=MARGIN_S)).tick  # type: ignore[misc]
            for _ in range(2)] == [0, 1]
    assert not packer.service(timeout=0) and h.done.get(timeout=0) is None
    assert requests.unreleased == 0 and requests._items.get_value() == 0  # none twice
    assert not packer.items_owed


@IN_ORDER
def test_an_item_a_collector_attaching_beside_a_later_give_back_took_is_not_given_back(
        ) -> None:
    """As for places: the attach could not read what the items semaphore lacks
    (the learner's put was held up between its count and its release), and a later
    ``service`` call reads again. A collector attaching beside it then, without the
    claim lock, sets UNSURE and takes an item in its get: read only before that
    reading, UNSURE would let its item be given back too (a get then takes an item
    no request is behind). Kills the mutant passing no ``alone`` at the service
    call's reading of the items."""
    rb, h = make()
    requests = h.requests
    unreached = rb.ptr + 10**6
    assert requests.put(request(0, 0, 32, min_ptr=unreached))
    assert requests._items.acquire(timeout=1.0)  # a get killed before its count
    _put_up_to_its_release(requests, *request(1, 1, 32, min_ptr=unreached))
    _dead_predecessor(h)
    packer = Packer.attach(h, rb)
    assert packer.items_owed and requests.unreleased == 2  # kept back
    _release_a_put(requests)
    with _an_item_taken_beside_the_first_reading(h) as items:
        assert not packer.service(timeout=0)  # reads again, then finds no item
    requests._counters[0] += 1  # the get beside counts tick 0 read
    assert items.get_value() <= requests.backlog
    assert not packer.items_owed


@IN_ORDER
def test_a_restart_attaching_again_before_a_service_still_gives_the_item_back() -> None:
    """The restart's attach could not read what the items semaphore lacks (the
    learner's put held up between its count and its release), and this process
    attached again before any ``service`` call (a retry: the first Packer dropped).
    What the first attach owed was its Packer object's alone: the second owed
    nothing, and read every request with the next one's item, the newest with
    none ("no get can take"). It is the handle's (``packer_state``): the second's
    service gives the item back. The first Packer, used after it (two readers in
    one process: unsupported), reads again and gives nothing more."""
    rb, h = make()
    requests = h.requests
    assert requests.put(request(0, 0, 32))
    assert requests._items.acquire(timeout=1.0)  # its get took the item, and it died
    _put_up_to_its_release(requests, *request(1, 1, 32))  # the learner, held up
    _dead_predecessor(h)
    first = Packer.attach(h, rb)
    assert first.items_owed  # kept back
    packer = Packer.attach(h, rb)  # this process again, before any service
    _release_a_put(requests)  # the learner runs again, and its put ends
    assert packer.service(timeout=0) and packer.service(timeout=0)
    assert [decode(PackDone, *h.done.get(timeout=MARGIN_S)).tick  # type: ignore[misc]
            for _ in range(2)] == [0, 1]
    assert not packer.items_owed
    assert not first.service(timeout=0) and not first.items_owed
    assert requests.unreleased == 0 and requests._items.get_value() == 0  # none twice


@IN_ORDER
def test_a_restart_attaching_again_before_a_service_still_gives_the_place_back() -> None:
    """As above, for the place a predecessor killed after counting its request read
    lost: the attach kept it back (the learner's put was under way), and the
    Packer of this process's next attach gives it back at its service call."""
    rb, h = make()
    requests = h.requests
    unreached = _requests_waiting_for_rows(rb, requests, 2)  # tick 0 read, not freed
    _dead_predecessor(h)
    requests._counters[4] += 1  # the learner's put of tick 2 began
    assert Packer.attach(h, rb).places_owed and requests.lost_spaces == 1  # kept back
    packer = Packer.attach(h, rb)  # this process again, before any service
    assert requests._spaces.acquire(timeout=1.0)  # the put takes its place and ends
    _end_a_put(requests, *request(2, 0, 32, min_ptr=unreached))
    assert not packer.service(timeout=0)  # gives the place back, gets tick 1
    assert requests.lost_spaces == 0 and not packer.places_owed
    assert requests.backlog + requests._spaces.get_value() == requests.capacity


@IN_ORDER
def test_a_restart_while_the_learner_waits_for_a_place_gives_it_back_once_it_got_one(
        ) -> None:
    """The learner, sending a request while the collector was dead, waits for a
    place: the one the dead collector lost, and the rest taken by requests. No instant
    without a put under way comes while the restart attaches (only its gets free a
    place), so nothing can be given back then; the restart gives the place back at a
    later service call, once the learner's put has its place."""
    import time

    def within(done: Callable[[], bool]) -> bool:
        deadline = time.monotonic() + MARGIN_S
        while not done():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    rb, h = make()
    requests = h.requests
    unreached = _requests_waiting_for_rows(rb, requests, 3)  # tick 0 read, not freed
    assert requests.put(request(3, 1, 32, min_ptr=unreached))  # no place free now
    learner, sent = _a_learner_waiting_for_a_place(requests, min_ptr=unreached)
    _dead_predecessor(h)
    packer = Packer.attach(h, rb)
    assert requests.lost_spaces == 1 and not sent.is_set()
    assert within(lambda: not packer.service(timeout=0.01) and requests.lost_spaces == 0)
    learner.join(MARGIN_S)
    assert sent.is_set() and requests.taken == 2  # tick 1 read, and waits for rows
    assert requests.backlog + requests._spaces.get_value() == requests.capacity


@IN_ORDER
def test_a_restart_gives_the_learner_a_place_when_every_place_was_lost(
        ) -> None:
    """Every place of the request channel lost by collectors killed after counting
    a request read, none left to read, and the learner already waiting for a place
    when the restart attaches: no reading found no put under way, no get freed a
    place, and the learner's send failed after its 10 s ("4 of its 4 places were
    lost", 3 of 3, helper-118). The restart gives back all but the place the
    learner's put may hold: the put gets one, the restart serves the request, and
    gives the last place back at a later call."""
    import time

    rb, h = make()
    requests = h.requests
    unreached = rb.ptr + 10**6
    for tick in range(4):
        assert requests.put(request(tick, tick % 2, 32, min_ptr=unreached))
        _get_killed_after_its_count(requests)
    assert requests.lost_spaces == requests.capacity and requests.backlog == 0
    learner, sent = _a_learner_waiting_for_a_place(requests)
    _dead_predecessor(h)
    packer = Packer.attach(h, rb)
    try:
        learner.join(MARGIN_S)
        assert sent.is_set()
        deadline = time.monotonic() + MARGIN_S
        while not packer.service(timeout=0.01) and time.monotonic() < deadline:
            pass
        done = h.done.get(timeout=MARGIN_S)
        assert done is not None and decode(PackDone, *done).tick == 4
        packer.service(timeout=0)
        assert requests.lost_spaces == 0 and not packer.places_owed
        assert requests.backlog + requests._spaces.get_value() == requests.capacity
    finally:
        h.close()
        learner.join(MARGIN_S)

@IN_ORDER
def test_a_second_restart_at_once_is_refused_while_the_learner_waits_for_a_place(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A restart whose predecessor lost a place, the learner waiting for one, waited
    out restore_spaces' patience (LEARNER_CHECK_S) holding the claim lock, and nothing
    it could read then: only its own gets free a place. A second restart attaching
    at once waits that long for the lock, then attached without it, read the dead
    predecessor's pid (the first stores its own last), and both read the request
    channel: two readers, which the lock is there to refuse (helper-115: two fork
    children released by one barrier both attached in 19 of 20 trials, 0 of 20 at
    565ea65). The attach reads once and leaves the rest to its ``service`` calls."""
    import os
    import time
    from types import SimpleNamespace

    from replay_fsm.data import channel as channel_module

    from .collectors import attach_or_refused

    rb, h = make()
    requests = h.requests
    unreached = _requests_waiting_for_rows(rb, requests, 3)
    assert requests.put(request(3, 1, 32, min_ptr=unreached))  # no place free now
    learner, sent = _a_learner_waiting_for_a_place(requests, min_ptr=unreached)
    _dead_predecessor(h)
    ctx = mp.get_context("spawn")
    answers = ctx.Queue()

    came: list[bool] = []

    def second_restart() -> None:
        came.append(True)
        child = ctx.Process(target=attach_or_refused, args=(h, rb, answers))
        child.start()
        child.join(MARGIN_S)

    def the_second_comes(seconds: float) -> None:  # while the first waits, if it does
        monkeypatch.setattr(channel_module, "time", time)
        second_restart()
    monkeypatch.setattr(channel_module, "time", SimpleNamespace(
        monotonic=time.monotonic, sleep=the_second_comes))
    try:
        packer = Packer.attach(h, rb)
        monkeypatch.setattr(channel_module, "time", time)
        if not came:
            second_restart()
        assert answers.get(timeout=MARGIN_S) == "refused"
        assert h.packer_pid == os.getpid() and not h.packer_state[8]  # not UNSURE
        # The place is given back at a service call once the learner's put has one.
        deadline = time.monotonic() + MARGIN_S
        while requests.lost_spaces and time.monotonic() < deadline:
            packer.service(timeout=0.01)
        learner.join(MARGIN_S)
        assert sent.is_set() and requests.lost_spaces == 0
    finally:
        h.close()
        learner.join(MARGIN_S)
