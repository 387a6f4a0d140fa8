"""The runtime Pipeline: one contract test over every backend, collectors, faults,
bad inputs, and clean shutdown (INV-DATA, INV-LIVE, INV-STICKY, INV-CLOSE)."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading

import pytest
import torch

from replay_fsm import CollectorDied, PackerError, Pipeline, PipelineFailed, ReplayBuffer
from replay_fsm.errors import IllegalTransition, PipelineClosed, ProtocolError
from replay_fsm.runtime.links import ThreadCollector
from replay_fsm.spec import SlotState
from replay_fsm.transfer import registered_backends
from replay_fsm.transfer.emulated import EmulatedBackend
from replay_fsm.transfer.manual import ManualBackend

from .backends import CONTRACT, contract_params
from .collectors import fill_and_serve
from .drive import complete_copies_for, packed, reference, run_ticks
from .support import Exited, SlotsOnlyLink

BACKENDS = contract_params()  # every registered backend (tests/backends.py)


def test_every_registered_backend_has_a_contract_config() -> None:
    """A backend registered without a configuration in tests/backends.py would go
    untested by the contract; this fails first."""
    assert set(registered_backends()) <= set(CONTRACT)


def buffer(rows: int = 300, capacity: int = 512) -> ReplayBuffer:
    rb = ReplayBuffer(capacity, 5, 3, critic_dim=2, region_rows=32)
    if rows:
        rb.add_packed(torch.randn(rows, rb.width))
    return rb


@pytest.mark.parametrize("config", BACKENDS)
@pytest.mark.parametrize("depth", [2, 3])
def test_contract_inv_data_is_bit_exact(config: tuple, depth: int) -> None:
    """INV-DATA on every backend: each batch equals storage[randint(seeded)] exactly."""
    device, backend, options = config
    rb = buffer()
    with Pipeline(rb, device=device, backend=backend, backend_options=options,
                  sample_count=48, base_seed=1234, ring_depth=depth, checked=True) as pipe:
        run_ticks(pipe, 0, 12)
        # the ticks() iterator, prefetching ring_depth - 1 ahead, with data being added
        pipe.start_prepare(12, 48)
        complete_copies_for(pipe, 12)  # manual: later ticks are completed in the loop
        for tick, batch in pipe.ticks(12, 24):
            complete_copies_for(pipe, tick)
            assert torch.equal(packed(batch, pipe), reference(pipe, tick))
            rb.add_packed(torch.randn(7, rb.width))
            for ahead in range(tick + 1, tick + depth):
                if pipe.slot_of(ahead) is not None:
                    complete_copies_for(pipe, ahead)
        assert pipe.statistics().ticks == 24


def test_ticks_iterator_prefetches_and_releases() -> None:
    rb = buffer()
    with Pipeline(rb, sample_count=16, ring_depth=3) as pipe:
        it = pipe.ticks(5, 100)
        tick, _ = next(it)
        assert tick == 5
        assert [t for t, _ in pipe.pending] == [6, 7]
        assert pipe.states.count(SlotState.HOT) == 1
        it.close()  # leaving the loop releases the hot batch
        assert SlotState.HOT not in pipe.states


@pytest.mark.parametrize("collector", ["thread", "process"])
def test_collectors_end_to_end(collector: str) -> None:
    rb = buffer()
    with Pipeline(rb, sample_count=64, ring_depth=2, collector=collector,
                  liveness_timeout=60) as pipe:
        assert run_ticks(pipe, 0, 10) == 10


def test_external_collector_attaches_in_its_own_process() -> None:
    import multiprocessing as mp
    rb = buffer(rows=0)
    with Pipeline(rb, sample_count=32, collector="external", liveness_timeout=60) as pipe:
        proc = mp.get_context("spawn").Process(target=fill_and_serve,
                                               args=(pipe.packer_handle(), rb, 100))
        proc.start()
        pipe.watch(proc)
        n = 32
        for tick in range(6):
            pipe.start_prepare(tick, n, min_snapshot_ptr=100)
            batch = pipe.sample_large_batch(tick, n)
            assert torch.equal(packed(batch, pipe), reference(pipe, tick))
            pipe.after_tick()
    proc.join(30)
    assert proc.exitcode == 0  # close() closed the channels; the collector returned


def test_an_external_collector_still_starting_when_the_pipeline_closes_leaves_cleanly(
        ) -> None:
    """close() before the collector process has opened the handle's semaphores (still
    starting Python and torch, as a Ctrl-C during a run's start-up finds it): the names
    of a watched process's handle stay while the pipeline does, so the child attaches,
    finds the channels closed and returns, instead of failing in multiprocessing's
    unpickling with a traceback."""
    import gc
    import multiprocessing as mp

    from .collectors import Gate, attach_and_leave

    ctx = mp.get_context("spawn")
    opened = ctx.Event()
    rb = buffer(rows=0)
    pipe = Pipeline(rb, sample_count=32, collector="external")
    proc = ctx.Process(target=attach_and_leave,
                       args=(Gate(opened), pipe.packer_handle(), rb))
    proc.start()  # its arguments are in the pipe; the child holds before the handle
    pipe.watch(proc)  # a watched collector still running: its handle outlives close
    try:
        pipe.close()
        gc.collect()  # whatever close let go of is gone now
        opened.set()
        proc.join(120)
        assert proc.exitcode == 0
    finally:
        opened.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()


def test_sigkill_of_the_collector_raises_collector_died() -> None:
    """INV-LIVE: a dead packer process fails the learner within the liveness bound."""
    rb = buffer()
    with Pipeline(rb, sample_count=16, collector="process", liveness_timeout=60) as pipe:
        run_ticks(pipe, 0, 2)
        pipe.start_prepare(2, 16, min_snapshot_ptr=10**9)  # pends: no data will come
        pipe.collector_process.kill()
        with pytest.raises(CollectorDied, match="tick 2.*exited"):
            pipe.wait_until_ready(2, 16)  # no timeout: liveness still bounds it
        with pytest.raises(CollectorDied) as info:  # sticky, chained to the cause
            pipe.start_prepare(3, 16)
        assert isinstance(info.value.__cause__, CollectorDied)


def cpu_ticks_by_thread(pid: int) -> dict[int, int]:
    """utime + stime (clock ticks) of each thread of process ``pid``, from /proc."""
    ticks = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # fields[0] is field 3, state
        ticks[int(tid)] = int(fields[11]) + int(fields[12])
    return ticks


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or not os.path.isdir(
    "/proc/self/task"), reason="Linux affinity calls and /proc needed")
def test_pinning_the_collector_process_pins_the_packer_that_serves() -> None:
    """README's recipe for a shared machine: ``collector_process.pid`` is the pid of
    the packer that attached and serves, its gather runs on that (main) thread, so
    pinning the pid moves the gather, and a pinned packer keeps serving the INV-DATA
    batches."""
    rb = ReplayBuffer(50_000, 60, 4)
    rb.add_packed(torch.randn(50_000, rb.width))
    cpu = min(os.sched_getaffinity(0))
    with Pipeline(rb, sample_count=20_000, collector="process", packer_threads=1,
                  ring_depth=3, liveness_timeout=60, learner_packs=False) as pipe:
        run_ticks(pipe, 0, 1)  # the packer has attached
        pid = pipe.collector_process.pid
        assert pipe.packer_handle().packer_pid == pid
        os.sched_setaffinity(pid, {cpu})
        before = cpu_ticks_by_thread(pid)
        run_ticks(pipe, 1, 61)  # asserts INV-DATA on every tick
        after = cpu_ticks_by_thread(pid)
    spent = {tid: after[tid] - before.get(tid, 0) for tid in after}
    assert spent[pid] >= 3, spent  # 60 gathers of 20k rows: the main thread did them
    assert spent[pid] >= 0.8 * sum(spent.values()), spent


def test_silent_packer_raises_after_the_liveness_timeout() -> None:
    rb = buffer()
    pipe = Pipeline(rb, sample_count=16, collector="external", liveness_timeout=0.2,
                    learner_packs=False)
    with pipe:
        from replay_fsm.data.packer import Packer
        Packer.attach(pipe.packer_handle(), rb)  # attached, then never serves
        pipe.packer_handle().packer_state[1] -= 10**9  # its last heartbeat: 1 s ago
        pipe.start_prepare(0, 16)
        with pytest.raises(CollectorDied, match="no heartbeat"):
            pipe.sample_large_batch(0, 16)


def test_packer_exception_fails_the_pipeline_chained() -> None:
    rb = buffer(rows=0)  # empty: packing raises
    with Pipeline(rb, sample_count=16) as pipe:
        pipe.start_prepare(0, 16)
        with pytest.raises(PipelineFailed) as info:
            pipe.sample_large_batch(0, 16)
        cause = info.value.__cause__
        assert isinstance(cause, PackerError) and cause.tick == 0
        assert "empty replay buffer" in cause.traceback_text
        for call in (lambda: pipe.start_prepare(1, 16), lambda: pipe.batch_ready(0, 16),
                     pipe.after_tick):
            with pytest.raises(PipelineFailed) as again:
                call()
            assert again.value.__cause__ is cause  # INV-STICKY


def test_transfer_exception_fails_the_pipeline_chained() -> None:
    rb = buffer()
    boom = RuntimeError("copy engine on fire")

    class Broken(ManualBackend):
        def submit(self, order: object) -> None:
            raise boom

    with Pipeline(rb, sample_count=16, backend=Broken()) as pipe:
        pipe.start_prepare(0, 16)
        with pytest.raises(PipelineFailed) as info:
            pipe.wait_until_ready(0, 16, timeout=30)
        assert info.value.__cause__ is boom


def test_close_during_an_in_flight_copy() -> None:
    """INV-CLOSE: close drains or abandons in-flight copies and joins every thread."""
    before = {t.ident for t in threading.enumerate()}
    rb = buffer()
    pipe = Pipeline(rb, sample_count=16, backend="emulated",
                    backend_options={"copy_delay": 0.2})
    pipe.start_prepare(0, 16)
    pipe.start_prepare(1, 16)
    pipe.close()
    pipe.close()  # idempotent
    assert {t.ident for t in threading.enumerate()} <= before
    for call in (lambda: pipe.start_prepare(2, 16), lambda: pipe.sample_large_batch(0, 16),
                 pipe.after_tick, lambda: pipe.wait_until_ready(0, 16)):
        with pytest.raises(PipelineClosed):
            call()


def test_nothing_left_after_close() -> None:
    rb = buffer()
    threads_before = {t.ident for t in threading.enumerate()}
    ours: set[str] = set()  # other processes on the machine may create their own
    for collector in ("thread", "process"):
        with Pipeline(rb, sample_count=16, collector=collector, liveness_timeout=60) as pipe:
            run_ticks(pipe, 0, 3)
            proc = pipe.collector_process
            ours |= set(pipe.packer_handle().semaphore_names)
    assert not proc.is_alive()
    del proc  # the test's own reference to the process and its arguments
    assert {t.ident for t in threading.enumerate()} <= threads_before
    if os.path.isdir("/dev/shm"):
        # Per pipeline: two semaphores in each of two channels, and the claim lock.
        assert len(ours) == 10 and ours.isdisjoint(os.listdir("/dev/shm"))


@pytest.mark.parametrize("backend", ["cpu", "emulated"])
@pytest.mark.parametrize("collector", ["thread", "process"])
def test_close_lets_go_of_the_slots_at_once(collector: str, backend: str) -> None:
    """INV-CLOSE: the host slots (shared memory, counted against /dev/shm) and the
    device slots are freed when close returns, the closed pipeline still bound and
    no garbage collection run; they stayed until one found the pipeline's cycles
    (five pipelines of a retry loop held five rings)."""
    import gc
    import weakref

    gc.disable()
    try:
        with Pipeline(buffer(), sample_count=16, collector=collector, backend=backend,
                      liveness_timeout=60) as pipe:
            slots = [*pipe.host_slots, *(pipe.backend.device_slot(i) for i in range(2))]
            kept = [weakref.ref(s) for s in slots]
            del slots
            for _, batch in pipe.ticks(0, 3):
                assert batch["obs"].shape[0] == 16
            del batch  # the learner's last view of a slot
            assert all(ref() is not None for ref in kept)  # in use until close
        assert [ref() for ref in kept] == [None] * len(kept)
        assert pipe.closed
    finally:
        gc.enable()


def test_a_ctrl_c_at_the_end_of_the_constructor_leaves_nothing_running() -> None:
    """A Ctrl-C at each of the constructor's last points, where its threads start
    and it registers with the exit hook: it raises, and nothing keeps running (one
    landing in the registration, once placed after the clean-up's reach, left a
    packer and a transfer thread that nothing would stop). A pipeline the interrupt
    missed is registered, and closed here."""
    import functools

    from replay_fsm.runtime import pipeline as module

    from .support import interrupted_at, threads_running_on
    from .tiers import tier_runs

    make = functools.partial(Pipeline, buffer(), sample_count=16, liveness_timeout=60)
    make().close()  # first-call work (imports, caches) out of the count
    registered = set(module._OPEN)
    built = interrupted_at(None, make)[0]
    for pipe in set(module._OPEN) - registered:
        pipe.close()
    for k in range(max(1, built - (80 if tier_runs("slow") else 25)), built + 2):
        before = {t.ident for t in threading.enumerate()}
        registered = set(module._OPEN)
        interrupted_at(k, make)
        for pipe in set(module._OPEN) - registered:
            pipe.close()
        assert not threads_running_on("replay_fsm-", before), k


def test_a_ctrl_c_after_the_backends_setup_closes_the_backend(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C that lands in the constructor just after ``backend.setup`` (here: as
    the batch views of the device slots are made) closes the backend: the emulated
    backend's copy-engine thread stops (on CUDA: the page-locked host slots are
    unregistered). It was left running, the setup being outside the clean-up's
    reach."""
    from replay_fsm.data.layout import Layout

    from .support import threads_running_on

    set_up = []

    class Emulated(EmulatedBackend):
        def setup(self, *args: object) -> None:
            super().setup(*args)  # type: ignore[arg-type]
            set_up.append(True)

    def interrupted(self: Layout, rows: torch.Tensor) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Layout, "views", interrupted)
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(KeyboardInterrupt):
        Pipeline(buffer(), sample_count=16, backend=Emulated())
    assert set_up == [True]
    assert not threads_running_on("replay_fsm-", before)


@pytest.mark.parametrize("collector,where", [
    ("thread", "ThreadCollector"), ("process", "ProcessCollector"),
    ("thread", "threading.Thread")])
def test_a_pipeline_whose_packer_does_not_start_leaves_nothing_running(
        monkeypatch: pytest.MonkeyPatch, collector: str, where: str) -> None:
    """A packer that cannot start (a spawn refused, a Ctrl-C in its start): the
    constructor raises that, and the transfer worker it had started is stopped, not
    left waiting for pack-done messages for the life of the process."""
    from replay_fsm.runtime import links

    def refused(*args: object, **kwargs: object) -> None:
        raise OSError(24, "Too many open files")

    rb = buffer()
    threads_before = {t.ident for t in threading.enumerate()}
    if where == "threading.Thread":  # the packer thread's own start
        real_start = threading.Thread.start

        def start(self: threading.Thread) -> None:
            if self.name == "replay_fsm-packer":
                refused()
            real_start(self)
        monkeypatch.setattr(threading.Thread, "start", start)
    else:
        monkeypatch.setattr(getattr(links, where), "start", refused)
    with pytest.raises(OSError, match="Too many open files"):
        Pipeline(rb, sample_count=16, collector=collector, liveness_timeout=60)
    assert {t.ident for t in threading.enumerate()} <= threads_before


def test_a_close_cut_short_by_a_ctrl_c_is_finished_by_the_next() -> None:
    """A Ctrl-C after the pipeline was marked closed and before its threads were
    stopped: the next close returned at once (already closed) and left the packer and
    transfer threads running for the life of the process."""
    rb = buffer()
    threads_before = {t.ident for t in threading.enumerate()}
    pipe = Pipeline(rb, sample_count=16, collector="thread", liveness_timeout=60)
    run_ticks(pipe, 0, 2)
    stop = pipe._link.stop

    def interrupted(timeout: float) -> list[str]:
        pipe._link.stop = stop  # type: ignore[method-assign]
        raise KeyboardInterrupt
    pipe._link.stop = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        pipe.close()
    assert pipe.closed
    pipe.close()
    assert {t.ident for t in threading.enumerate()} <= threads_before


def test_an_error_with_an_interrupt_as_its_context_closes_only_if_raised_in_the_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """threading's Condition.wait cut short by a Ctrl-C raises RuntimeError with the
    interrupt as its context: the pipeline closes as for the interrupt. An error of a
    call made from the caller's own ``except KeyboardInterrupt`` block has that
    interrupt as its context too, and closed the pipeline."""
    rb = buffer()
    with Pipeline(rb, sample_count=16, collector="thread", liveness_timeout=60) as pipe:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            with pytest.raises(ProtocolError):
                pipe.sample_large_batch(5, 16)  # never requested
        assert not pipe.closed
        run_ticks(pipe, 0, 2)

        def cut_short(tick: int) -> None:
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt:
                raise RuntimeError("cannot release un-acquired lock") from None
        monkeypatch.setattr(pipe, "_acquire", cut_short)
        pipe.start_prepare(2, 16)
        with pytest.raises(RuntimeError, match="un-acquired"):
            pipe.sample_large_batch(2, 16)
        assert pipe.closed


def test_an_external_collector_that_never_attached_leaves_nothing_after_close() -> None:
    """With no collector attached and none watched still running (one that exited,
    here), close() lets the handle go, and the channels' semaphores with it: a handle
    is kept past close only for a watched collector that may still be starting."""
    class Exited:
        pid, exitcode = 1, 0

        def is_alive(self) -> bool:
            return False

    pipe = Pipeline(buffer(), sample_count=16, collector="external")
    names = set(pipe.packer_handle().semaphore_names)
    pipe.watch(Exited())
    pipe.close()
    if os.path.isdir("/dev/shm"):
        assert len(names) == 5 and names.isdisjoint(os.listdir("/dev/shm"))


def test_bad_inputs_raise_and_change_nothing() -> None:
    rb = buffer()
    with pytest.raises(ValueError, match="supported"):
        Pipeline(rb, device="tpu-of-dreams", sample_count=8)
    with pytest.raises(ValueError, match="collector"):
        Pipeline(rb, sample_count=8, collector="carrier-pigeon")
    with pytest.raises(ValueError, match="ring_depth"):
        Pipeline(rb, sample_count=8, ring_depth=1)
    with pytest.raises(ValueError, match="sample_count"):
        Pipeline(rb, sample_count=0)
    with Pipeline(rb, sample_count=8, ring_depth=2) as pipe:
        with pytest.raises(ValueError, match="sample_count must match"):
            pipe.start_prepare(0, 9)
        with pytest.raises(ProtocolError, match="not requested"):
            pipe.sample_large_batch(0, 8)
        with pytest.raises(ProtocolError, match="not requested"):
            pipe.wait_until_ready(0, 8)
        assert pipe.start_prepare(0, 8)
        assert not pipe.start_prepare(0, 8)  # already pending
        with pytest.raises(IllegalTransition, match="consecutive"):
            pipe.start_prepare(5, 8)
        assert pipe.pending == ((0, 0),)  # the refused request changed nothing
        assert pipe.start_prepare(1, 8)
        with pytest.raises(IllegalTransition, match="ring full"):
            pipe.start_prepare(2, 8)  # beyond the ring
        assert pipe.pending == ((0, 0), (1, 1))
        pipe.sample_large_batch(0, 8)
        with pytest.raises(ProtocolError, match="still hot"):
            pipe.sample_large_batch(1, 8)
        pipe.after_tick()
        pipe.after_tick()  # nothing hot: a no-op, as in the seed


def test_keyboard_interrupt_in_a_wait_closes_cleanly() -> None:
    rb = buffer()

    class Interrupted(ManualBackend):
        def pump(self) -> None:  # runs on the learner thread while it waits
            raise KeyboardInterrupt

    pipe = Pipeline(rb, sample_count=8, backend=Interrupted())
    pipe.start_prepare(0, 8)
    with pytest.raises(KeyboardInterrupt):
        pipe.wait_until_ready(0, 8)
    assert pipe.closed and pipe.states == (SlotState.CLOSED,) * 2


def test_checked_mode_poisons_a_released_slot() -> None:
    rb = buffer()
    with Pipeline(rb, sample_count=8, backend="manual", checked=True) as pipe:
        pipe.start_prepare(0, 8)
        complete_copies_for(pipe, 0)
        batch = pipe.sample_large_batch(0, 8)
        assert not torch.isnan(batch["obs"]).any()
        pipe.after_tick()
        assert torch.isnan(batch["obs"]).all()  # a view kept past release fails loudly


def test_a_request_that_cannot_be_sent_fails_the_pipeline() -> None:
    rb = buffer()
    boom = OSError("queue broken")

    class BrokenSend(ThreadCollector):
        def send(self, *args: object, **kw: object) -> None:
            raise boom

    with Pipeline(rb, sample_count=8, backend="manual",
                  collector=BrokenSend(rb, 2, 8)) as pipe:
        with pytest.raises(PipelineFailed) as info:
            pipe.start_prepare(0, 8)
        assert info.value.__cause__ is boom


@pytest.mark.parametrize("kwargs,error,match", [
    ({"sample_count": True}, TypeError, "sample_count"),
    ({"sample_count": 8.0}, TypeError, "sample_count"),
    ({"sample_count": 0}, ValueError, "sample_count"),
    ({"sample_count": 8, "liveness_timeout": float("nan")}, ValueError, "liveness_timeout"),
    ({"sample_count": 8, "liveness_timeout": float("inf")}, ValueError, "liveness_timeout"),
    ({"sample_count": 8, "attach_timeout": 0}, ValueError, "attach_timeout"),
    ({"sample_count": 8, "base_seed": 2**63}, ValueError, "base_seed"),
    ({"sample_count": 8, "base_seed": -1}, ValueError, "base_seed"),
    ({"sample_count": 8, "ring_depth": 2.0}, TypeError, "ring_depth"),
    ({"sample_count": 8, "ring_depth": 1}, ValueError, "ring_depth"),
    ({"sample_count": 8, "trace_capacity": 0}, ValueError, "trace_capacity"),
    ({"sample_count": 8, "packer_threads": 0}, ValueError, "packer_threads"),
    ({"sample_count": 8, "backend_options": {"copyy": True}}, ValueError, "copyy"),
])
def test_constructor_arguments_are_checked_up_front(kwargs: dict, error: type, match: str
                                                    ) -> None:
    threads = set(threading.enumerate())
    with pytest.raises(error, match=match):
        Pipeline(buffer(), **kwargs)
    assert set(threading.enumerate()) <= threads  # nothing was started


def test_numpy_integers_are_counts_and_ticks() -> None:
    np = pytest.importorskip("numpy")
    with Pipeline(buffer(), sample_count=np.int64(16), ring_depth=np.int32(2),
                  base_seed=np.int64(3)) as pipe:
        assert pipe.start_prepare(np.int64(0), np.int64(16))
        batch = pipe.sample_large_batch(np.int64(0), 16)
        assert torch.equal(packed(batch, pipe), reference(pipe, 0))


@pytest.mark.parametrize("call", ["start_prepare", "sample_large_batch", "wait_until_ready"])
@pytest.mark.parametrize("tick,error", [(1.7, TypeError), ("3", TypeError),
                                        (True, TypeError), (-1, ValueError),
                                        (2**63, ValueError)])
def test_bad_ticks_are_refused_and_change_nothing(call: str, tick: object,
                                                  error: type) -> None:
    with Pipeline(buffer(), sample_count=8, backend="manual") as pipe:
        if call != "start_prepare":
            pipe.start_prepare(0, 8)
        before = pipe.pending
        if call != "start_prepare" and tick == 2**63:
            error = ProtocolError  # an int, just never requested
        with pytest.raises(error):
            getattr(pipe, call)(tick, 8)
        assert pipe.pending == before and not pipe.closed
        assert pipe.start_prepare(len(before), 8)  # still usable


@pytest.mark.parametrize("call", ["slot_of", "pack_record"])
@pytest.mark.parametrize("tick,error", [(1.7, TypeError), ("3", TypeError),
                                        (True, TypeError), (None, TypeError),
                                        (-1, ValueError)])
def test_the_views_of_a_tick_refuse_a_bad_one(call: str, tick: object,
                                              error: type) -> None:
    """As every call that takes a tick: slot_of("3") answered None, as for a tick
    not requested, and pack_record(True) gave tick 1's record."""
    with Pipeline(buffer(), sample_count=8, backend="manual") as pipe:
        pipe.start_prepare(0, 8)
        pipe.start_prepare(1, 8)
        complete_copies_for(pipe, 0)
        complete_copies_for(pipe, 1)
        assert pipe.wait_until_ready(1, 8, timeout=60)
        with pytest.raises(error, match="tick"):
            getattr(pipe, call)(tick)
        assert pipe.slot_of(1) == 1 and pipe.pack_record(1).tick == 1


def test_a_replay_buffer_of_the_wrong_kind_is_named() -> None:
    with pytest.raises(TypeError, match="replay_buffer must be a replay_fsm.ReplayBuffer"):
        Pipeline(object(), sample_count=8)  # type: ignore[arg-type]


def test_min_snapshot_ptr_and_timeout_are_checked() -> None:
    with Pipeline(buffer(), sample_count=8, backend="manual") as pipe:
        with pytest.raises(TypeError, match="min_snapshot_ptr"):
            pipe.start_prepare(0, 8, min_snapshot_ptr=1.5)  # type: ignore[arg-type]
        # The request carries it as an int64: refused, with nothing changed (it used
        # to fail the pipeline when the request would not go into its channel).
        with pytest.raises(ValueError) as info:
            pipe.start_prepare(0, 8, min_snapshot_ptr=2**63)
        assert str(info.value) == f"tick 0: min_snapshot_ptr must be < 2**63, got {2**63}"
        assert pipe.pending == () and not pipe.closed
        pipe.start_prepare(0, 8, min_snapshot_ptr=2**63 - 1)  # the largest it can carry
        assert pipe.pending == ((0, 0),)
    with Pipeline(buffer(), sample_count=8, backend="manual") as pipe:
        pipe.start_prepare(0, 8)
        with pytest.raises(ValueError, match="timeout"):
            pipe.wait_until_ready(0, 8, timeout=float("nan"))
        with pytest.raises(ValueError, match="timeout"):
            pipe.wait_until_ready(0, 8, timeout=-1)


@pytest.mark.parametrize("config", BACKENDS)
def test_filling_one_slot_leaves_the_hot_batch_differentiable(config: tuple) -> None:
    """A layer that saves the hot batch's view for backward (nn.Linear on obs) still
    runs backward after the next slot was packed and copied: slots are separate
    tensors, so a write into one does not bump the version counter of another."""
    device, backend, options = config
    rb = buffer()
    with Pipeline(rb, device=device, backend=backend, backend_options=options,
                  sample_count=16, ring_depth=2) as pipe:
        layer = torch.nn.Linear(5, 1).to(pipe.device)
        pipe.start_prepare(0, 16)
        complete_copies_for(pipe, 0)
        loss = layer(pipe.sample_large_batch(0, 16)["obs"]).pow(2).sum()
        pipe.start_prepare(1, 16)
        complete_copies_for(pipe, 1)
        assert pipe.wait_until_ready(1, 16, timeout=60)
        loss.backward()  # raised "modified by an inplace operation" with one tensor
        assert layer.weight.grad is not None


@pytest.mark.parametrize("collector", ["thread", "process"])
@pytest.mark.parametrize("config", BACKENDS)
def test_a_graph_kept_past_after_tick_fails_autograds_in_place_check(
        config: tuple, collector: str) -> None:
    """README: a graph kept past after_tick() fails autograd's in-place check, as it
    should: the slot is the pipeline's again. It fails at once, before any refill:
    on the CPU backend the batch views the shared host slot, which a packer process
    refills without this process's version counters knowing (backward then ran on the
    next tick's rows)."""
    device, backend, options = config
    with Pipeline(buffer(), device=device, backend=backend, backend_options=options,
                  sample_count=16, ring_depth=2, collector=collector,
                  learner_packs=False) as pipe:
        layer = torch.nn.Linear(5, 1).to(pipe.device)
        pipe.start_prepare(0, 16)
        complete_copies_for(pipe, 0)
        loss = layer(pipe.sample_large_batch(0, 16)["obs"]).pow(2).sum()
        pipe.after_tick()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


@pytest.mark.parametrize("poll", ["batch_ready", "wait_until_ready(timeout=0)"])
def test_a_learner_that_only_polls_learns_of_a_dead_collector(poll: str) -> None:
    """INV-LIVE for a learner that never blocks: a poll of a tick that is not ready
    asks the watchdog as a slice of a wait does (it returned False for ever)."""
    with Pipeline(buffer(), sample_count=8, collector="external", backend="manual",
                  liveness_timeout=60) as pipe:
        pipe.watch(Exited())
        pipe.start_prepare(0, 8)
        with pytest.raises(CollectorDied, match="exited with code -9"):
            if poll == "batch_ready":
                pipe.batch_ready(0, 8)
            else:
                pipe.wait_until_ready(0, 8, timeout=0)
        with pytest.raises(CollectorDied):  # sticky
            pipe.batch_ready(0, 8)


def test_a_watched_process_that_exits_is_named() -> None:
    """INV-LIVE: ``watch`` takes anything with ``is_alive()``, ``pid`` and ``exitcode``;
    its default name is "the collector process". Kills
    replay_fsm.runtime.pipeline.xǁPipelineǁwatch mutants 1, 2 and 4."""

    # learner_packs=False: a learner that packed tick 0 itself may find it SUBMITTED
    # (the worker quicker than its next slice), and a SUBMITTED wait asks the
    # (manual) backend, never the collector: TransferFailed after 60 s.
    with Pipeline(buffer(), sample_count=8, collector="external", backend="manual",
                  liveness_timeout=60, learner_packs=False) as pipe:
        pipe.watch(Exited())
        pipe.start_prepare(0, 8)
        with pytest.raises(CollectorDied) as info:
            pipe.wait_until_ready(0, 8)
        assert str(info.value) == "tick 0: the collector process (pid 4242) exited with code -9"


def test_a_watched_process_never_started_is_named_so() -> None:
    """A collector process watched and never started (its start() forgotten) was
    named "the collector process (pid None) exited with code None" (helper-84)."""
    process = mp.get_context("spawn").Process(target=print)  # never started
    with Pipeline(buffer(), sample_count=8, learner_packs=False) as pipe:
        pipe.watch(process)
        with pytest.raises(CollectorDied, match=r"never started \(no pid\): call its "
                           r"start\(\)"):
            for _ in pipe.ticks(0, 100_000):  # the first wait for a batch judges it
                pass


class FailLink(ThreadCollector):
    """A thread collector that keeps the callback a link reports its failures with."""

    def start(self, fail: object) -> None:
        self.report = fail
        super().start(fail)  # type: ignore[arg-type]


@pytest.mark.parametrize("actor", ["packer", "transfer", "copy_engine"])
def test_a_failure_is_recorded_as_the_failing_actors(actor: str) -> None:
    """INV-STICKY, and the trace says who failed: the FAIL transitions name the actor
    whose thread reported the error, and every later call raises chained to it.
    Kills xǁPipelineǁ_fail mutants 2 and 4, and the actor and error mutants of
    _on_packer_error, _on_transfer_error and _on_backend_error."""
    from replay_fsm.runtime.observers import Observer
    from replay_fsm.spec import Actor, Event

    boom = RuntimeError(f"the {actor} broke")

    class Transfer(ManualBackend):
        def submit(self, order: object) -> None:
            raise boom

    class Log(Observer):
        def __init__(self) -> None:
            self.fails: list[object] = []

        def transition(self, record: object, time_ns: int) -> None:
            if record.event is Event.FAIL:  # type: ignore[attr-defined]
                self.fails.append(record.actor)  # type: ignore[attr-defined]

    rb, log = buffer(), Log()
    link = FailLink(rb, 2, 8)
    backend = Transfer() if actor == "transfer" else ManualBackend()
    with Pipeline(rb, sample_count=8, backend=backend, collector=link) as pipe:
        pipe.add_observer(log)
        if actor == "packer":
            link.report(boom)
        elif actor == "copy_engine":
            pipe.backend.on_error(boom)
        else:
            pipe.start_prepare(0, 8)
            with pytest.raises(PipelineFailed):
                pipe.wait_until_ready(0, 8, timeout=30)
        assert log.fails == [Actor(actor)] * 2
        with pytest.raises(PipelineFailed) as info:
            pipe.start_prepare(1, 8)
        assert info.value.__cause__ is boom


def test_an_observer_that_raises_is_dropped_and_fails_the_run() -> None:
    """An observer's bug fails the pipeline chained to it, once: the observer is dropped
    and sees none of the transitions that follow (the FAIL ones, close). Kills
    xǁPipelineǁ_observer_failed mutant 1."""
    from replay_fsm.runtime.observers import Observer

    bug = ZeroDivisionError("observer bug")

    class Buggy(Observer):
        calls = 0

        def transition(self, record: object, time_ns: int) -> None:
            Buggy.calls += 1
            raise bug

    with Pipeline(buffer(), sample_count=8, backend="manual") as pipe:
        pipe.add_observer(Buggy())
        pipe.start_prepare(0, 8)  # the request is done; the observer's error fails the run
        with pytest.raises(PipelineFailed) as info:
            pipe.start_prepare(1, 8)
        assert info.value.__cause__ is bug
    assert Buggy.calls == 1


def test_a_closed_request_channel_is_collector_died_chained_to_it() -> None:
    """A request that cannot be sent because the packer's channel is closed fails the
    pipeline with CollectorDied whose cause is the ChannelClosed. Kills
    xǁPipelineǁ_fail_locked mutants 1 and 2 (the cause not attached)."""
    from replay_fsm.data.channel import ChannelClosed

    closed = ChannelClosed()

    class Closed(ThreadCollector):
        def send(self, *args: object, **kw: object) -> None:
            raise closed

    rb = buffer()
    with Pipeline(rb, sample_count=8, backend="manual", collector=Closed(rb, 2, 8)) as pipe:
        with pytest.raises(CollectorDied) as info:
            pipe.start_prepare(0, 8)
        died = info.value.__cause__
        assert isinstance(died, CollectorDied) and died.__cause__ is closed
        assert str(died) == "tick 0: the packer's channel is closed"


def test_packer_handle_is_refused_by_name() -> None:
    """Kills xǁPipelineǁpacker_handle mutants 1-3 and 5-7 (the messages). After
    close() it is PipelineClosed, as every call then (it was a ValueError)."""
    rb = buffer()
    pipe = Pipeline(rb, sample_count=8, backend="manual")
    pipe.close()
    with pytest.raises(PipelineClosed) as info:
        pipe.packer_handle()
    assert str(info.value) == "the pipeline is closed; its packer handle is gone"
    seed_like = SlotsOnlyLink(8, rb.width, kind="seed")  # no handle, as the seed's queues
    with Pipeline(rb, sample_count=8, backend="manual", collector=seed_like) as pipe:
        with pytest.raises(ValueError) as info:
            pipe.packer_handle()
        assert str(info.value) == "this pipeline's collector (seed) has no packer handle"


def test_statistics_count_checks_only_in_checked_mode() -> None:
    """Kills xǁPipelineǁstatistics mutant 7 (checks 1 when checked mode is off)."""
    for checked in (False, True):
        with Pipeline(buffer(), sample_count=8, checked=checked) as pipe:
            run_ticks(pipe, 0, 2)
            checks = pipe.statistics().checks
            assert checks > 0 if checked else checks == 0


class Recording(ThreadCollector):
    """A thread collector that keeps every request it sends."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.sent: list[object] = []

    def send(self, request: object, **kw: object) -> None:
        self.sent.append(request)
        super().send(request, **kw)  # type: ignore[arg-type]


def test_ticks_requests_nothing_past_stop_and_passes_min_snapshot_ptr() -> None:
    """``ticks(start, stop)`` prefetches up to ring_depth - 1 ahead but never past
    ``stop``, and every request carries its ``min_snapshot_ptr``. Kills xǁPipelineǁticks
    mutants 17 (prefetch past stop), 22 and 25 (min_snapshot_ptr dropped)."""
    rb = buffer(rows=300)
    link = Recording(rb, 3, 8)
    with Pipeline(rb, sample_count=8, ring_depth=3, collector=link) as pipe:
        assert [t for t, _ in pipe.ticks(0, 4, min_snapshot_ptr=5)] == [0, 1, 2, 3]
        assert pipe.pending == () and pipe.hot is None
    assert [r.tick for r in link.sent] == [0, 1, 2, 3]  # type: ignore[attr-defined]
    assert {r.min_snapshot_ptr for r in link.sent} == {5}  # type: ignore[attr-defined]


def test_leaving_ticks_after_a_failure_raises_nothing() -> None:
    """The iterator's last release is best effort: once the pipeline failed, leaving
    the loop does not raise from its clean-up. Kills xǁPipelineǁticks mutant 30."""
    with Pipeline(buffer(), sample_count=8) as pipe:
        it = pipe.ticks(0, 5)
        next(it)
        pipe.fail(RuntimeError("the learner's own error"))
        it.close()


def test_batch_ready_is_true_only_for_a_copied_batch() -> None:
    """Never requested: False; requested, copy not complete: False; copied: True.
    Kills xǁPipelineǁ_ready mutants 3 and 6 (before: timeouts of the tests that poll it)."""
    with Pipeline(buffer(), sample_count=8, backend="manual") as pipe:
        assert not pipe.batch_ready(0, 8)
        pipe.start_prepare(0, 8)
        assert pipe.backend.wait_submitted(0, timeout=30)  # type: ignore[attr-defined]
        assert not pipe.batch_ready(0, 8)
        pipe.backend.complete(0)  # type: ignore[attr-defined]
        assert pipe.batch_ready(0, 8) and not pipe.batch_ready(1, 8)


def test_wait_until_ready_timeout_zero_returns_and_bad_timeouts_are_refused() -> None:
    """``timeout=0`` asks without waiting; a bool, a string, a negative number, NaN or
    infinity is refused. Kills wait_until_ready mutants 5, 8-10, 15 and 17 and
    _wait mutant 2 (the last three waited for the liveness bound instead)."""
    import numpy as np

    with Pipeline(buffer(), sample_count=8, backend="manual") as pipe:
        pipe.start_prepare(0, 8)
        assert pipe.backend.wait_submitted(0, timeout=30)  # type: ignore[attr-defined]
        assert pipe.wait_until_ready(0, 8, timeout=0) is False
        assert pipe.wait_until_ready(0, 8, timeout=0.001) is False
        for bad in (True, "1", -0.5, float("nan"), float("inf")):
            with pytest.raises(ValueError, match=r"^timeout must be None or a finite "
                                                 r"number of seconds >= 0, got "):
                pipe.wait_until_ready(0, 8, timeout=bad)  # type: ignore[arg-type]
        for bad in (np.bool_(False), np.float32("nan")):  # numpy's bool and nan too
            with pytest.raises(ValueError, match=r"^timeout must be None or a finite "):
                pipe.wait_until_ready(0, 8, timeout=bad)  # type: ignore[arg-type]
        # numpy's numbers are numbers: a timeout read from an array (helper-104)
        assert pipe.wait_until_ready(0, 8, timeout=np.float32(0.001)) is False
        assert pipe.wait_until_ready(0, 8, timeout=np.int64(0)) is False
        pipe.backend.complete(0)  # type: ignore[attr-defined]
        assert pipe.wait_until_ready(0, 8, timeout=0) is True


@pytest.mark.parametrize("trace", [True, False])
def test_learner_calls_show_in_torch_profiles_when_tracing(trace: bool) -> None:
    """With ``trace=True`` each learner call but ``batch_ready`` (a poll) is a
    torch.profiler range named ``replay_fsm/<call>``, so the pipeline shows beside
    the model in a profile; with tracing off there is none. Kills the range-name
    mutants of start_prepare, wait_until_ready, sample_large_batch and after_tick,
    and xǁPipelineǁ_call mutants 1 to 4 (a range for the poll, none when tracing,
    ranges when not, a range with no name)."""
    from torch.profiler import ProfilerActivity, profile

    with Pipeline(buffer(), sample_count=8, trace=trace) as pipe:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            pipe.start_prepare(0, 8)
            pipe.wait_until_ready(0, 8)
            pipe.batch_ready(0, 8)
            pipe.sample_large_batch(0, 8)
            pipe.after_tick()
    ours = {event.name for event in prof.events() if "replay_fsm" in event.name}
    assert ours == ({f"replay_fsm/{call}" for call in (
        "start_prepare", "wait_until_ready", "sample_large_batch", "after_tick")}
        if trace else set())


def test_pack_record_is_only_for_a_batch_ready_or_hot() -> None:
    """A tick never requested, or requested and not yet copied (its slot still holds
    the record of the tick before), has no record. Kills xǁPipelineǁpack_record
    mutants 4, 7, 8 and 13."""
    with Pipeline(buffer(), sample_count=8, backend="manual") as pipe:
        run_ticks(pipe, 0, 2)
        pipe.start_prepare(2, 8)
        assert pipe.backend.wait_submitted(0, timeout=30)  # type: ignore[attr-defined]
        for tick in (2, 5):
            with pytest.raises(ProtocolError) as info:
                pipe.pack_record(tick)
            assert str(info.value) == f"tick {tick} has no batch ready or hot"
        pipe.backend.complete(0)  # type: ignore[attr-defined]
        assert pipe.pack_record(2).tick == 2


# The ceiling below: the Python calls the learner's three calls made a tick when it was
# last lowered (82 before 2026-12-07; README, Performance).
LEARNER_CALLS_PER_TICK = 63


@pytest.mark.skipif("MUTANT_UNDER_TEST" in os.environ,
                    reason="mutmut's trampolines add a Python call to every function")
def test_the_learners_three_calls_make_no_more_python_calls_than_the_ceiling() -> None:
    """``sample_large_batch``, ``after_tick`` and ``start_prepare`` on a batch already
    there (ring depth 2, thread collector), their Python function calls counted with
    ``sys.setprofile`` (this thread's only): with its caches cold, as in a learner
    whose step streams megabytes between them, each call's frame and code come back
    from memory, and the calls cost about 4 x a bare double buffer's hand-off. A change
    that adds calls to them raises ``LEARNER_CALLS_PER_TICK`` knowingly."""
    counts: list[int] = []
    calls = 0

    def count(frame: object, event: str, arg: object) -> None:
        nonlocal calls
        if event == "call":
            calls += 1

    with Pipeline(buffer(), sample_count=8, ring_depth=2) as pipe:
        pipe.start_prepare(0, 8)
        for tick in range(30):
            pipe.wait_until_ready(tick, 8)
            calls = 0
            sys.setprofile(count)
            try:
                pipe.sample_large_batch(tick, 8)
                pipe.after_tick()
                pipe.start_prepare(tick + 1, 8)
            finally:
                sys.setprofile(None)
            counts.append(calls)
    steady = sorted(counts[10:])  # the first requests set clocks up
    assert steady[len(steady) // 2] <= LEARNER_CALLS_PER_TICK, counts
