"""Process bodies for spawn-based tests (importable by the child interpreter)."""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any

import torch

from replay_fsm.data.buffer import Layout, ReplayBuffer
from replay_fsm.data.packer import Packer, PackerHandle


def constant_rows(rb: ReplayBuffer, first_id: int, n: int) -> torch.Tensor:
    ids = torch.arange(first_id, first_id + n, dtype=torch.float32)
    return ids[:, None].expand(n, rb.width).contiguous()


class Lapping(ReplayBuffer):
    """A writer that laps every read of a gather: each copy of rows out of the storage
    is followed by an add of the whole ring (on the gather's own thread, where a
    collector adding the whole ring back to back re-enters its next add within
    microseconds of the last), unless the gather asks the adds to yield then, as
    another thread's add would (``_yield_to_lapped_gather``: its own thread's add
    never waits for its own ask)."""

    laps = 0

    def _lap(self) -> None:
        if not self._asked_mv[0]:
            self.laps += 1
            self.add_packed(constant_rows(self, 1000 * self.laps, self.capacity))

    def _copy_out(self, indices: torch.Tensor, out: torch.Tensor) -> None:
        super()._copy_out(indices, out)
        self._lap()

    def _rows_at(self, rows: torch.Tensor) -> torch.Tensor:
        data = super()._rows_at(rows)
        self._lap()
        return data


def add_whole_rings(rb: ReplayBuffer, stop: Any, going: Any) -> None:
    """Writer: adds of the whole ring, back to back, until ``stop`` is set, ``going``
    set after the first; each row's columns carry its id, which is its ring position
    plus 1 modulo the capacity (ids cycle under 2**24: exact in float32)."""
    cap, first = rb.capacity, rb.ptr % rb.capacity + 1
    cycle = cap * max(1, (1 << 24) // cap - 1)
    while not stop.is_set():
        rb.add_packed(constant_rows(rb, first, cap))
        first = (first - 1 + cap) % cycle + 1
        going.set()


def write_ids(rb: ReplayBuffer, batches: int, batch: int, first_id: int = 1) -> None:
    """Writer: every column of a row carries the row's id."""
    for k in range(batches):
        rb.add_packed(constant_rows(rb, first_id + k * batch, batch))


def serve(handle: PackerHandle, rb: ReplayBuffer, count: int) -> None:
    """A collector that attaches a packer and serves ``count`` batches."""
    packer = Packer.attach(handle, rb)
    served = 0
    while served < count and not packer.closed:
        served += packer.service(timeout=0.05)


def fill_and_serve(handle: PackerHandle, rb: ReplayBuffer, rows: int) -> None:
    """A collector that adds data itself, then serves until closed."""
    write_ids(rb, 1, rows)
    packer = Packer.attach(handle, rb)
    while not packer.closed:
        packer.service(timeout=0.05)


def external_loop(handle: PackerHandle, rb: ReplayBuffer) -> None:
    """The README's external collector loop: step (here: add rows), serve, until the
    packer is closed: by the learner's close(), or because the learner died."""
    packer = Packer.attach(handle, rb)
    first = 10**6
    while not packer.closed:
        rb.add_packed(constant_rows(rb, first, 4))
        first += 4
        packer.service(timeout=0.01)


LEARNER = """
import json, multiprocessing as mp, signal, sys, time
import torch
from replay_fsm import Pipeline, ReplayBuffer
from tests.collectors import external_loop

if __name__ == "__main__":
    mode = sys.argv[1]
    rb = ReplayBuffer(4096, 4, 2)
    rb.add_packed(torch.randn(1000, rb.width))
    pipe = Pipeline(rb, sample_count=64, liveness_timeout=60,
                    collector="external" if mode == "external" else mode)
    other = pipe.collector_process
    if mode == "external":
        other = mp.get_context("spawn").Process(target=external_loop,
                                                args=(pipe.packer_handle(), rb))
        other.start()
        pipe.watch(other)
    for tick in range(5):
        pipe.start_prepare(tick, 64)
        pipe.sample_large_batch(tick, 64)
        pipe.after_tick()
    names = list(pipe.packer_handle().semaphore_names + rb.semaphore_names)
    try:  # the test interrupts us as soon as it reads the line
        print(json.dumps({"other": other.pid, "names": names}), flush=True)
        time.sleep(600)  # until the test kills or interrupts us
    except KeyboardInterrupt:
        pipe.close()
        sys.exit(130)
"""


# -- seed-style: the buffer and collector a trainer written for the seed has ----------


class SeedStyleBuffer:
    """A replay buffer laid out as the seed's users have it (UniLab's): packed rows in
    ``_storage``, one-element shared ``ptr`` and ``size`` tensors (``ptr`` counts every
    row ever written and is bumped before ``size``), the column slices as private
    attributes, and the ``_packed_cpu_storage`` flag."""

    def __init__(self, capacity: int, obs_dim: int, action_dim: int, critic_dim: int = 0,
                 *, packed: bool = True) -> None:
        layout = Layout.build(obs_dim, action_dim, critic_dim)
        self.capacity = capacity
        self._storage = torch.zeros(capacity, layout.width).share_memory_()
        self.ptr = torch.zeros(1, dtype=torch.int64).share_memory_()
        self.size = torch.zeros(1, dtype=torch.int64).share_memory_()
        self._packed_cpu_storage = packed
        self._critic_dim = critic_dim
        self._obs_sl, self._nobs_sl, self._act_sl = layout.obs, layout.next_obs, layout.actions
        self._rew_col, self._done_col = layout.rewards, layout.dones
        self._trunc_col = layout.truncated
        if critic_dim:
            self._critic_sl, self._ncritic_sl = layout.critic, layout.next_critic

    def add_rows(self, rows: torch.Tensor) -> None:
        """Ring-write packed rows ([n, width], n <= capacity)."""
        n, start = rows.shape[0], int(self.ptr[0]) % self.capacity
        first = min(n, self.capacity - start)
        self._storage[start:start + first] = rows[:first]
        self._storage[:n - first] = rows[first:]
        self.ptr[0] += n
        self.size[0] = min(int(self.size[0]) + n, self.capacity)


def rows_of(rb: Any) -> tuple[int, int, torch.Tensor]:
    """(ptr, size, storage) of a seed-style buffer or of replay_fsm's."""
    if isinstance(rb, ReplayBuffer):
        return rb.ptr, rb.size, rb.storage
    return int(rb.ptr[0]), int(rb.size[0]), rb._storage


def add_rows(rb: Any, rows: torch.Tensor) -> None:
    if isinstance(rb, ReplayBuffer):
        rb.add_packed(rows)
    else:
        rb.add_rows(rows)


def seed_pack(rb: Any, request: dict[str, Any], slots: Any) -> dict[str, Any]:
    """Serve one request as the seed's collector does: the buffer's size read now (not
    the request's snapshot), indices from a CPU generator seeded with ``sample_seed``,
    rows gathered into the request's shared slot; a target slot equal to the learner's
    hot one is refused."""
    if int(request["target_gpu_slot"]) == int(request["learner_hot_gpu_slot"]):
        raise RuntimeError("seed-style collector: target_gpu_slot must differ from "
                           "learner_hot_gpu_slot")
    ptr, size, storage = rows_of(rb)
    begin = time.perf_counter_ns()
    gen = torch.Generator(device="cpu").manual_seed(int(request["sample_seed"]))
    idx = torch.randint(0, size, (int(request["sample_count"]),), generator=gen)
    out = slots[int(request["shared_slot"])]
    if isinstance(rb, ReplayBuffer):
        rb.gather(idx, out)
    else:
        torch.index_select(storage, 0, idx, out=out)
    ready = {key: request[key] for key in ("tick_id", "sample_seed", "sample_count",
                                          "shared_slot", "target_gpu_slot",
                                          "learner_hot_gpu_slot", "pack_layout",
                                          "pack_executor")}
    ready.update(snapshot_ptr=ptr, snapshot_size=size, pack_begin_ns=begin,
                 pack_end_ns=time.perf_counter_ns())
    return ready


def hold_slots(slots: Any, seconds: float) -> None:
    """A child process that is handed the host slots and does nothing with them."""
    time.sleep(seconds)


def seed_collector(rb: Any, requests: Any, ready: Any, slots: Any, stop: Any, *,
                   crash_after: int | None = None, how: str = "raise",
                   add_every_s: float | None = None, serve_when: Any = None) -> None:
    """A seed-style collector loop (a thread or a spawned process) until ``stop`` is
    set: take a request, hold it while the buffer has fewer than ``min_snapshot_ptr``
    rows, pack it, put the ready dict.

    ``crash_after``: once that many requests are served, take the next one and die
    with it pending: ``how`` = "raise" (an exception escapes), "caught" (caught and the
    loop returns, as UniLab's collector entry point does: the process exits 0) or
    "exit" (``os._exit(3)``). ``add_every_s``: add a row that often (a live collector).
    ``serve_when``: an event; each request is held until it is set (a slow one).
    """
    served, held, last_add = 0, None, time.monotonic()
    try:
        while not stop.is_set():
            if add_every_s is not None and time.monotonic() - last_add >= add_every_s:
                add_rows(rb, torch.zeros(1, rows_of(rb)[2].shape[1]))
                last_add = time.monotonic()
            if held is None:
                try:
                    held = requests.get(timeout=0.01)
                except queue.Empty:
                    continue
            if crash_after is not None and served >= crash_after:
                if how == "exit":
                    os._exit(3)
                raise RuntimeError("the seed-style collector crashed")
            if ((serve_when is not None and not serve_when.is_set())
                    or rows_of(rb)[0] < int(held.get("min_snapshot_ptr", 0))):
                time.sleep(0.002)
                continue
            ready.put(seed_pack(rb, held, slots))
            held, served = None, served + 1
    except RuntimeError:
        if how != "caught":
            raise


def die_holding_the_queue(q) -> None:  # type: ignore[no-untyped-def]
    """A collector killed in the middle of a put: its feeder thread holds the queue's
    write lock (blocked on a pipe nobody drains) when the process ends abruptly."""
    import os
    import time
    q.put(b"x" * (1 << 20))  # far more than the pipe holds
    # Until the feeder thread holds the write lock (stuck in send: nobody drains the
    # pipe); a poll of the lock, not a wait for the thread.
    while q._wlock.acquire(False):
        q._wlock.release()
        time.sleep(0.001)
    os._exit(3)


COMPAT_EXIT = """
import multiprocessing as mp, sys
import torch
from replay_fsm import ReplayBuffer
from replay_fsm.compat import CPUPinnedDoubleBufferReplayPipeline
from tests.collectors import die_holding_the_queue

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    requests, ready = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=die_holding_the_queue, args=(ready,))
    child.start()
    child.join(60)
    rb = ReplayBuffer(64, 3, 2)
    rb.add_packed(torch.randn(64, rb.width))
    slots = [torch.zeros(8, rb.width).share_memory_() for _ in range(2)]
    pipe = CPUPinnedDoubleBufferReplayPipeline(
        rb, device="cpu", sample_count=8, collector_pack_request_queue=requests,
        collector_pack_ready_queue=ready, collector_pack_shared_slots=slots)
    pipe.close()  # puts its wake-up None on the ready queue, whose lock is held
    print("closed", child.exitcode, flush=True)
"""


def report_held_then_ignore(answers: Any, signums: tuple[int, ...]) -> None:
    """A helper's body as the library's are. Put which of SIGINT and SIGTERM this
    process started with held off (ignored, or blocked); send itself ``signums``,
    which must not end it (held off, as while it imports torch), then call
    ``ignore(signums)`` first thing, as the library's bodies do, and put which are
    ignored and which still blocked."""
    import signal

    from replay_fsm.signals import ignore
    pair = (signal.SIGINT, signal.SIGTERM)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    held = tuple(signal.getsignal(s) == signal.SIG_IGN or s in blocked for s in pair)
    for signum in signums:
        os.kill(os.getpid(), signum)
    ignore(signums)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    answers.put((held, tuple(signal.getsignal(s) == signal.SIG_IGN for s in pair),
                 tuple(s in blocked for s in pair)))


def deaf_until_killed(ready: Any) -> None:
    """A collector that never leaves: the stop signals ignored, waits for ever."""
    import signal
    import threading
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    ready.set()
    threading.Event().wait()


class Gate:
    """Unpickles only once ``opened`` (a spawn-context Event) is set, or after
    ``limit_s``: placed before a handle in a spawned process's arguments, it holds the
    child before it opens the handle's semaphores by name."""

    def __init__(self, opened: Any, limit_s: float = 120.0) -> None:
        self.opened, self.limit_s = opened, limit_s

    def __reduce__(self) -> tuple[Any, tuple[Any, float]]:
        return (_pass_gate, (self.opened, self.limit_s))


def _pass_gate(opened: Any, limit_s: float) -> Gate:
    opened.wait(limit_s)
    return Gate(opened, limit_s)


def attach_and_leave(gate: Gate, handle: PackerHandle, rb: ReplayBuffer) -> None:
    """A collector that attaches and serves until the channels are closed."""
    packer = Packer.attach(handle, rb)
    while not packer.closed:
        packer.service(timeout=0.05)


class StallingBuffer(ReplayBuffer):
    """A buffer whose add, once ``stall`` is set to two events (entered, go), copies
    the first half of its rows, sets ``entered`` and waits for ``go``: a writer that
    can be killed, or kept alive, in the middle of its add, with its regions odd and
    the write lock taken."""

    stall: Any = None

    def _copy_in(self, start: int, rows: torch.Tensor) -> None:
        if self.stall is None:
            super()._copy_in(start, rows)
            return
        entered, go = self.stall
        half = rows.shape[0] // 2
        super()._copy_in(start, rows[:half])
        entered.set()
        go.wait()
        super()._copy_in(start + half, rows[half:])



class TornMidAdd(ReplayBuffer):
    """A buffer whose every ``every``-th add after ``arm`` stops with the left half of
    each of its rows' columns written (every row of the add torn in the storage, its
    regions odd), releases ``halfway`` and waits for ``go_on`` (``patience_s`` at most:
    then the add raises) before it writes the rest; once ``free`` is set, adds go
    straight through. Its semaphores and event travel to a spawned writer with it.
    A gather's retry round that finds rows still being written (``_yield_to_writer``)
    lets a stopped add go on: the one taken from ``halfway`` (``held``) or any other,
    counted in ``let_go``."""

    halfway: Any = None
    go_on: Any = None
    free: Any = None
    patience_s = 0.0
    every = 1
    adds = 0  # the writer's adds since arm, in its process
    held = False  # the reader's: a stop taken from halfway, not yet let go
    let_go = 0  # the reader's: the stops its gathers let go on

    def arm(self, ctx: Any, patience_s: float, every: int) -> None:
        self.halfway, self.go_on = ctx.Semaphore(0), ctx.Semaphore(0)
        self.free, self.patience_s, self.every = ctx.Event(), patience_s, every

    def _copy_in(self, start: int, rows: torch.Tensor) -> None:
        if self.free is None or self.free.is_set():
            super()._copy_in(start, rows)
            return
        self.adds += 1
        if self.adds % self.every:
            super()._copy_in(start, rows)
            return
        half = self.width // 2
        self.storage[start:start + rows.shape[0], :half] = rows[:, :half]
        self.halfway.release()
        if not self.go_on.acquire(timeout=self.patience_s):
            raise AssertionError(f"no gather let the add of rows {start}.. go on within "
                                 f"{self.patience_s} s")
        super()._copy_in(start, rows)

    def _yield_to_writer(self) -> None:
        if self.held or (self.halfway is not None and self.halfway.acquire(block=False)):
            self.held, self.let_go = False, self.let_go + 1
            self.go_on.release()
        super()._yield_to_writer()


class AskThenStall(ReplayBuffer):
    """A gather of rows of region 0 that sees it written whole during its copy and
    again during its first retry round (its number moves by 2 each time: lapped), so
    that its second round asks the adds to yield; that round then sets ``stall`` (an
    event, once set) and stalls for good: a reader killed while its ask stands."""

    stall: Any = None
    rounds = 0

    def _copy_out(self, indices: torch.Tensor, out: torch.Tensor) -> None:
        super()._copy_out(indices, out)
        self._seq[0] += 2

    def _rows_at(self, rows: torch.Tensor) -> torch.Tensor:
        self.rounds += 1
        if self.rounds == 1:
            self._seq[0] += 2
        elif self.stall is not None:
            self.stall.set()
            threading.Event().wait()  # until killed
        return super()._rows_at(rows)


def gather_rows(rb: ReplayBuffer, n: int) -> None:
    """Reader: a gather of rows 0..n-1."""
    rb.gather(torch.arange(n), torch.empty(n, rb.width))


def report_blocked(answers: Any) -> None:
    """Put which of SIGINT and SIGTERM this process started with blocked."""
    import signal
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    answers.put(tuple(s in blocked for s in (signal.SIGINT, signal.SIGTERM)))


def add_while_serving(handle: PackerHandle, rb: ReplayBuffer, adds: Any) -> None:
    """A collector that adds rows and serves; ``adds`` (two shared ints) counts the
    adds begun and the adds ended."""
    packer = Packer.attach(handle, rb)
    rows = constant_rows(rb, 1, 16)
    while not packer.closed:
        adds[0] += 1
        rb.add_packed(rows)
        adds[1] += 1
        packer.service(timeout=0.0)


def hold_pause(rb: ReplayBuffer, held: Any, release: Any) -> None:
    """Hold ``rb``'s adds off (adds_paused) from this process until ``release`` is set."""
    with rb.adds_paused():
        held.set()
        release.wait()


def add_beside_own_pause(handle: PackerHandle, rb: ReplayBuffer, attached: Any,
                         seconds: float, done: Any) -> None:
    """A collector whose learner is gone: once its packer closes, one thread holds a
    pause for ``seconds`` (a rescue save under a pause) while another adds; sets
    ``done`` after both end."""
    import sys
    import threading
    packer = Packer.attach(handle, rb)
    attached.set()
    while not packer.closed:
        packer.service(timeout=0.05)
    with rb.adds_paused():
        adder = threading.Thread(target=rb.add_packed, args=(constant_rows(rb, 1, 1),))
        adder.start()
        time.sleep(seconds)
    adder.join()
    done.set()
    print("collector: its pause and its add ended", file=sys.stderr, flush=True)


def attach_and_let_go(handle: PackerHandle, rb: ReplayBuffer, answers: Any) -> None:
    """Attach to ``handle`` (which starts this process's learner-watch thread), let
    the packer go, and put how many watch threads run and whether the packer is
    gone once collected."""
    import gc
    import weakref

    packer = Packer.attach(handle, rb)
    gone = weakref.ref(packer)
    watches = sum(t.name == "replay_fsm-learner-watch" for t in threading.enumerate())
    del packer
    gc.collect()
    answers.put((watches, gone() is None))


def attach_and_count_watches(handles: list[PackerHandle], rb: ReplayBuffer,
                             attaches: int, answers: Any) -> None:
    """Attach to ``handles[0]`` ``attaches`` times, then put how many learner-watch
    threads this process runs, and how many a fork child of it runs once it attached
    to ``handles[1]`` twice (-1: its attach raised)."""
    for _ in range(attaches):
        Packer.attach(handles[0], rb)
    watches = sum(t.name == "replay_fsm-learner-watch" for t in threading.enumerate())
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: none of its parent's threads; one of its own
        mine = -1
        try:
            Packer.attach(handles[1], rb)
            Packer.attach(handles[1], rb)
            mine = sum(t.name == "replay_fsm-learner-watch" for t in threading.enumerate())
        finally:
            os.write(write, str(mine).encode())
            os._exit(0)
    os.close(write)
    child = int(os.read(read, 16))
    os.close(read)
    os.waitpid(pid, 0)
    answers.put((watches, child))


def attach_or_refused(handle: PackerHandle, rb: ReplayBuffer, answers: Any) -> None:
    """Attach to ``handle`` and put "attached", or put "refused" where the attach
    raises ProtocolError (another process is attached and lives)."""
    from replay_fsm import ProtocolError

    try:
        Packer.attach(handle, rb)
    except ProtocolError:
        answers.put("refused")
    else:
        answers.put("attached")
