"""The compat class at its edges: the defaults a seed user relies on, which argument
goes missing, the seed's tick ids in the errors it raises, the trace slices' clock,
the verbose file beside an existing directory, and each way a call meets a request
that is not the one it names. The collector is served by hand (``Hand``), or by a
thread that answers the one request the test expects."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from replay_fsm import errors
from replay_fsm.compat import CollectorDied, CPUPinnedDoubleBufferReplayPipeline
from replay_fsm.runtime.observers import Observer
from replay_fsm.spec import Actor

from .collectors import SeedStyleBuffer, seed_pack
from .support import MARGIN_S, Exited, finishes_within
from .test_compat_behaviour import BASE_SEED, WIDTH, Hand, N


def serve_when_asked(h: Hand) -> threading.Thread:
    """A collector thread that answers the next request (within the margin)."""
    def answer() -> None:
        request = h.requests.get(timeout=MARGIN_S)
        h.ready.put(seed_pack(h.rb, request, h.slots))
    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return thread


def with_slots(slots: Any) -> CPUPinnedDoubleBufferReplayPipeline:
    """The compat class over a seed-style buffer and two new queues, given ``slots``
    as its ``collector_pack_shared_slots``."""
    return CPUPinnedDoubleBufferReplayPipeline(
        SeedStyleBuffer(64, 5, 3, critic_dim=2), device="cpu", sample_count=N,
        collector_pack_request_queue=queue.Queue(), collector_pack_ready_queue=queue.Queue(),
        collector_pack_shared_slots=slots)


# -- construction ------------------------------------------------------------------

def test_the_defaults_are_the_seeds_and_ours_as_documented() -> None:
    rb = SeedStyleBuffer(64, 5, 3, critic_dim=2)
    rb.add_rows(torch.randn(20, WIDTH))
    slots = [torch.zeros(N, WIDTH).share_memory_() for _ in range(2)]
    requests: queue.Queue[Any] = queue.Queue()
    pipe = CPUPinnedDoubleBufferReplayPipeline(
        rb, device="cpu", sample_count=N, collector_pack_request_queue=requests,
        collector_pack_ready_queue=queue.Queue(), collector_pack_shared_slots=slots)
    try:
        pipe.start_prepare(7, N)
        assert requests.get_nowait()["sample_seed"] == 7  # base_seed 0
        assert pipe.pipeline.liveness_timeout == 5.0
        assert pipe._link._stall_ns == 60 * 10**9  # stall_timeout 60 s
        # the seed's own attributes, as it set them
        assert (pipe._device_type, pipe._packed_width) == ("cpu", WIDTH)
    finally:
        pipe.close()


def test_the_timeouts_given_reach_the_pipeline_and_the_link() -> None:
    with Hand(liveness_timeout=7.5, stall_timeout=0.5) as h:  # under a second is allowed
        assert h.pipe.pipeline.liveness_timeout == 7.5
        assert h.pipe._link._stall_ns == 5 * 10**8
    with Hand(stall_timeout=None) as h:
        assert h.pipe._link._stall_ns is None
        # The seed's link bounds a wait for rows (stall_timeout); the pipeline inside
        # never adds a bound of its own, so None waits for rows for ever, as asked.
        assert h.pipe.pipeline.stall_timeout is None


@pytest.mark.parametrize("missing", ["collector_pack_request_queue",
                                     "collector_pack_ready_queue",
                                     "collector_pack_shared_slots"])
def test_each_missing_queue_or_the_slots_alone_gets_the_seeds_value_error(missing: str
                                                                          ) -> None:
    given: dict[str, Any] = {
        "collector_pack_request_queue": queue.Queue(),
        "collector_pack_ready_queue": queue.Queue(),
        "collector_pack_shared_slots": [torch.zeros(N, WIDTH) for _ in range(2)]}
    del given[missing]
    with pytest.raises(ValueError, match="^collector_thread pack executor requires collector "
                       "pack IPC queues and slots$"):
        CPUPinnedDoubleBufferReplayPipeline(SeedStyleBuffer(64, 5, 3, critic_dim=2),
                                            device="cpu", sample_count=N, **given)


@pytest.mark.parametrize("slots", [torch.zeros(N, WIDTH), torch.zeros(2 * N * WIDTH)])
def test_one_tensor_of_rows_as_the_slots_is_refused_by_name(slots: torch.Tensor) -> None:
    """One [n, width] tensor where the seed takes a list of two: iterated as slots, its
    rows were named one shape each (helper-84: 64 shapes in one message)."""
    with pytest.raises(ValueError) as info:
        with_slots(slots)
    assert str(info.value) == (
        f"collector_pack_shared_slots: one tensor of shape {tuple(slots.shape)}; the "
        "collector packs into 2 slots of (sample_count, width): a list of 2 such tensors, "
        "or one of shape (2, sample_count, width)")


@pytest.mark.parametrize("slots, error, what", [
    ([np.zeros((N, WIDTH), np.float32)] * 2, TypeError, "a list of ndarray"),
    (np.zeros((2, N, WIDTH), np.float32), TypeError, "ndarray"),
    ((torch.zeros(N, WIDTH) for _ in range(2)), TypeError, "generator"),
    ({0: torch.zeros(N, WIDTH), 1: torch.zeros(N, WIDTH)}, TypeError, "dict"),
    ([torch.zeros(N, WIDTH, device="meta")] * 2, ValueError, "tensors on meta"),
    (torch.zeros(2, N, WIDTH, device="meta"), ValueError, "a tensor on meta"),
])
def test_slots_that_are_not_tensors_in_host_memory_are_refused_by_name(
        slots: Any, error: type[Exception], what: str) -> None:
    """The collector packs into the slots on the CPU: anything else was an
    AttributeError ('numpy.ndarray' object has no attribute 'data_ptr'), a generator
    consumed before its shapes were read ('host slots have shapes []'), and slots on
    another device were taken, the collector failing at its first pack (helper-113)."""
    with pytest.raises(error) as info:
        with_slots(slots)
    assert str(info.value) == (
        f"collector_pack_shared_slots must be 2 CPU tensors of (sample_count, width), as "
        f"a list, or one CPU tensor of (2, sample_count, width), got {what}")


def test_one_tensor_of_two_slots_is_taken_as_the_slots() -> None:
    slots = torch.zeros(2, N, WIDTH).share_memory_()
    pipe = with_slots(slots)
    try:
        assert [s.data_ptr() for s in pipe.pipeline.host_slots] == [
            slots[0].data_ptr(), slots[1].data_ptr()]
    finally:
        pipe.close()


def test_a_sequence_of_tensors_other_than_a_list_is_taken_as_the_slots() -> None:
    """The signature takes a ``Sequence[torch.Tensor]``: a ``UserList`` of the slots
    served the seed's protocol as a list does (8 ticks, every batch bit for bit, 1 of
    1), until dffe562 refused it as "got UserList" (helper-116). Its elements are
    still checked."""
    from collections import UserList

    slots = UserList([torch.zeros(N, WIDTH).share_memory_() for _ in range(2)])
    pipe = with_slots(slots)
    try:
        assert [s.data_ptr() for s in pipe.pipeline.host_slots] == [
            s.data_ptr() for s in slots]
    finally:
        pipe.close()
    with pytest.raises(TypeError, match="got a UserList of ndarray$"):
        with_slots(UserList([np.zeros((N, WIDTH), np.float32)] * 2))


# -- errors in the seed's numbering -------------------------------------------------

def test_a_failure_names_the_seeds_tick_id_and_is_raised_again_as_the_same_error() -> None:
    with Hand() as h:
        h.sample(0)
        h.pipe.after_tick()
        h.pipe.start_prepare(41, N)  # request number 2
        h.pipe.watch(Exited(), "the simulator\n(second line)")
        with pytest.raises(CollectorDied) as info:
            h.pipe.wait_until_ready(41, N)
        # the whole text, several lines, with the seed's tick id for the request number
        assert str(info.value) == ("tick 41: the simulator\n(second line) (pid 4242) "
                                   "exited with code -9")
        for call in (lambda: h.pipe.batch_ready(41, N), lambda: h.pipe.start_prepare(41, N),
                     lambda: h.pipe.wait_until_ready(41, N)):
            with pytest.raises(CollectorDied) as again:
                call()
            assert again.value is info.value


# -- the trace slices' clock and the copy time ----------------------------------------

class Copies(Observer):
    def __init__(self) -> None:
        self.copies: list[tuple[int, int]] = []

    def span(self, name: str, actor: Actor, start_ns: int, end_ns: int, **args: Any) -> None:
        if name == "copy":
            self.copies.append((start_ns, end_ns))


class Timed:
    """A trace recorder that keeps each slice's times."""

    def __init__(self) -> None:
        self.slices: dict[str, list[tuple[int, int, dict[str, Any]]]] = {}

    def add_slice(self, name: str, *, category: str, start_ns: int, end_ns: int,
                  args: dict[str, Any] | None = None) -> None:
        self.slices.setdefault(name, []).append((start_ns, end_ns, args or {}))


def test_the_copy_slice_is_on_the_recorders_clock_and_its_time_is_the_copys() -> None:
    perf_a, mono_a = time.perf_counter_ns(), time.monotonic_ns()
    with Hand() as h:
        perf_b, mono_b = time.perf_counter_ns(), time.monotonic_ns()
        # monotonic -> perf_counter: their difference read while the class was built
        offset = h.pipe._clock_ns
        assert perf_a - mono_b <= offset <= perf_b - mono_a
        copies, timed = Copies(), Timed()
        h.pipe.pipeline.add_observer(copies)
        h.pipe._trace_recorder = timed
        h.sample(0)
        (start, end), = copies.copies
        assert h.pipe.last_incremental_h2d_time_s == (end - start) / 1e9
        (begin_ns, end_ns, args), = timed.slices["replay_pipeline/batch_h2d_submit"]
        assert args["tick_id"] == 0
        assert (begin_ns, end_ns) == (start + offset, end + offset)


# -- after_tick, close, verbose --------------------------------------------------------

def test_after_tick_never_raises_with_nothing_hot_or_after_close() -> None:
    with Hand() as h:
        h.pipe.after_tick()  # nothing sampled yet
        h.sample(0)
        h.pipe.after_tick()
        h.pipe.after_tick()  # released already
        h.sample(1)
        h.pipe.close()
        h.pipe.after_tick()  # hot, but closed
        assert not h.pipe.batch_ready(1, N)


def test_a_ctrl_c_that_closed_the_pipeline_underneath_gives_the_answers_after_close(
        ) -> None:
    """A Ctrl-C in a learner call closes the Pipeline underneath (as here, directly):
    the seed's answers after close apply at once, not only after close() (after_tick
    raised PipelineClosed, batch_ready and start_prepare our own message)."""
    with Hand() as h:
        h.sample(0)
        h.pipe.pipeline.close()  # what the Ctrl-C does underneath
        h.pipe.after_tick()  # hot, and never raises
        answers_after_close(h.pipe, 1)


def test_verbose_writes_its_file_into_an_existing_directory(tmp_path: Path) -> None:
    (tmp_path / "verbose").mkdir()
    (tmp_path / "verbose" / "pack_fields.csv").write_text("old\n")
    with Hand(verbose=True, verbose_output_dir=str(tmp_path)) as h:
        assert h.pipe._verbose_pack_records is not None
        h.pipe._verbose_pack_records.append((3, 0, "obs", N, 5, N * 20, 99))
    assert (tmp_path / "verbose" / "pack_fields.csv").read_text().splitlines() == [
        "tick_id,slot,field,rows,cols,bytes,dur_ns", f"3,0,obs,{N},5,{N * 20},99"]


def answers_after_close(pipe: CPUPinnedDoubleBufferReplayPipeline, tick: int) -> None:
    """The answers after close: batch_ready False (the seed's was True for the hot or
    a ready tick), the seed's messages from the calls that request or sample,
    after_tick quiet."""
    assert pipe.batch_ready(tick, N) is False
    prepare = r"^Cannot prepare replay batch after pipeline\.close\(\)$"
    with pytest.raises(errors.PipelineClosed, match=prepare):
        pipe.start_prepare(tick, N)
    with pytest.raises(errors.PipelineClosed, match=prepare):
        pipe.wait_until_ready(tick, N)
    with pytest.raises(errors.PipelineClosed, match=r"^Cannot sample a replay batch after "
                       r"pipeline\.close\(\)$"):
        pipe.sample_large_batch(tick, N)
    pipe.after_tick()


def test_batch_ready_after_close_is_false_for_the_hot_tick_too() -> None:
    """It was True, as the seed's, and the sample it promised raised: the README
    lists batch_ready False after close() among the differences on purpose."""
    with Hand() as h:
        h.sample(0)
        h.pipe.close()
        answers_after_close(h.pipe, 0)


@pytest.mark.parametrize("given, sent", [(72.0, 72), (np.float64(72.7), 72),
                                         (torch.tensor(72), 72), (-1, 0)])
def test_min_snapshot_ptr_is_taken_as_the_seed_took_it(given: Any, sent: int) -> None:
    """The seed took ``int()`` of it: a float (UniLab's ptr + num_envs * steps, from
    a float config) raised TypeError here, and a negative one ValueError."""
    with Hand() as h:
        assert h.pipe.start_prepare(0, N, min_snapshot_ptr=given)
        request = h.serve()
        assert request["min_snapshot_ptr"] == sent and type(request["min_snapshot_ptr"]) is int
        assert h.pipe.wait_until_ready(0, N)


def test_a_ctrl_c_in_the_recorder_as_the_batch_is_taken_leaves_the_class_as_the_pipeline(
        ) -> None:
    """The trace slices of a sample came after the pipeline had made the batch hot and
    before the class recorded it: a Ctrl-C in the recorder's add_slice (UniLab's
    TraceRecorder) left the class open with no hot batch, and a retry swapped its
    slots a second time, against the pipeline's hot slot."""
    with Hand() as h:
        add_slice = h.rec.add_slice

        def interrupted_once(name: str, **kw: Any) -> None:
            if name == "replay_pipeline/batch_h2d_wait" and not hasattr(h, "stopped"):
                h.stopped = True  # type: ignore[attr-defined]
                raise KeyboardInterrupt
            add_slice(name, **kw)

        h.rec.add_slice = interrupted_once  # type: ignore[method-assign]
        assert h.pipe.start_prepare(0, N)
        h.serve()
        with pytest.raises(KeyboardInterrupt):
            h.pipe.sample_large_batch(0, N)
        hot = h.pipe.pipeline.hot
        assert hot is not None and (h.pipe._has_hot_batch, h.pipe._hot) == (True, hot[1])
        again = h.pipe.sample_large_batch(0, N)  # the hot batch, not a second swap
        assert h.pipe._hot == hot[1] and set(again) == set(h.pipe._hot_batch)
        h.pipe.after_tick()
        # The interrupted sample's own slices are lost; no later one swapped again.
        assert not [a for n, a in h.rec.slices if n == "replay_pipeline/hot_cold_swap"]


def test_calls_after_close_raise_the_seeds_messages() -> None:
    with Hand() as h:
        h.pipe.close()
        answers_after_close(h.pipe, 0)


# -- a call that names a tick other than the one requested ----------------------------

def test_batch_ready_is_false_for_a_tick_not_requested() -> None:
    with Hand() as h:
        assert h.pipe.batch_ready(5, N) is False  # nothing requested
        h.pipe.start_prepare(5, N)
        h.serve()
        assert h.pipe.wait_until_ready(5, N)
        assert h.pipe.batch_ready(7, N) is False  # 5 is ready, 7 is not
        assert h.pipe.batch_ready(5, N) is True


def test_waiting_requests_the_tick_when_nothing_is_requested() -> None:
    with Hand() as h:
        collector = serve_when_asked(h)
        done, got = finishes_within(lambda: h.pipe.wait_until_ready(5, N))
        assert done and got == [True]
        collector.join(MARGIN_S)
        assert h.pipe.batch_ready(5, N)
        assert h.pipe.sample_large_batch(5, N)["obs"].shape == (N, 5)


def test_sampling_requests_the_tick_when_nothing_is_requested() -> None:
    with Hand() as h:
        collector = serve_when_asked(h)
        done, got = finishes_within(lambda: h.pipe.sample_large_batch(6, N))
        assert done and got[0]["obs"].shape == (N, 5)
        collector.join(MARGIN_S)


def test_waiting_again_for_the_ready_tick_is_true_and_for_another_raises() -> None:
    with Hand() as h:
        h.pipe.start_prepare(5, N)  # request number 1
        h.serve()
        assert h.pipe.wait_until_ready(5, N)
        assert h.pipe.wait_until_ready(5, N)  # again: still the one ready
        with pytest.raises(errors.ProtocolError, match="^Prepared replay batch tick 5 does "
                           "not match requested tick 7$"):
            h.pipe.wait_until_ready(7, N)


def test_sampling_checks_the_tick_of_the_batch_it_waited_for() -> None:
    """The request is outstanding, not yet ready, when ``sample_large_batch`` names
    another tick: it waits for that request, then refuses its batch."""
    with Hand() as h:
        h.pipe.start_prepare(5, N)
        waits: list[Any] = []

        def wait(tick_id: Any, sample_count: Any, timeout: Any = None) -> bool:
            waits.append(tick_id)  # the request comes ready only now
            h.serve()
            return h.pipe.pipeline.wait_until_ready(1, N)

        h.pipe.wait_until_ready = wait  # type: ignore[method-assign]
        with pytest.raises(errors.ProtocolError, match="^Prepared replay batch tick 5 does "
                           "not match requested tick 7$"):
            h.pipe.sample_large_batch(7, N)
        assert waits == [7]


def test_a_wait_with_a_timeout_returns_false_when_no_batch_comes() -> None:
    with Hand(stall_timeout=None) as h:
        h.pipe.start_prepare(5, N)
        done, got = finishes_within(lambda: h.pipe.wait_until_ready(5, N, timeout=0.01))
        assert done and got == [False]


def test_the_base_seed_given_is_in_every_request() -> None:
    with Hand() as h:
        h.pipe.start_prepare(2, N)
        assert h.serve()["sample_seed"] == BASE_SEED + 2


def test_a_min_snapshot_ptr_past_63_bits_is_refused_naming_the_seeds_tick() -> None:
    """The refusal came from the pipeline underneath and named its own tick, the
    request number (tick 1 for the seed's tick 10); nothing is sent either way."""
    with Hand() as h:
        with pytest.raises(ValueError, match=r"^tick 10: min_snapshot_ptr must be < 2\*\*63"):
            h.pipe.start_prepare(10, N, min_snapshot_ptr=1 << 63)
        assert h.requests.empty()
        assert h.pipe.start_prepare(10, N)  # the class is as before
        assert h.serve()["tick_id"] == 10
