"""The Pipeline's constructor as a user meets it: its defaults, and a message naming
the argument for each bad one (the calls that start threads are covered in
test_pipeline.py; these fail before any starts, or construct and close)."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from replay_fsm import Packer, Pipeline, ReplayBuffer
from replay_fsm.runtime.links import ThreadCollector
from replay_fsm.runtime.observers import Observer


def buffer() -> ReplayBuffer:
    rb = ReplayBuffer(64, 3, 2)
    rb.add_packed(torch.zeros(10, rb.width))
    return rb


def test_the_defaults() -> None:
    with Pipeline(buffer(), sample_count=8) as pipe:
        assert (pipe.base_seed, pipe.ring_depth, pipe.liveness_timeout) == (0, 2, 5.0)
        assert pipe.collector == "thread" and str(pipe.device) == "cpu"
        assert pipe.tracer is None and pipe.forced == [] and not pipe.closed
        assert [tuple(h.shape) for h in pipe.host_slots] == [(8, 11)] * 2
        assert pipe.pending == ()
        assert pipe.stall_timeout == 60.0 and pipe.stall_timeout_name == "stall_timeout"
        assert pipe.min_snapshot_ptr_name == "min_snapshot_ptr"
        pipe.start_prepare(0, 8)
        pipe.sample_large_batch(0, 8)
        assert pipe.statistics().checks == 0  # checked mode is off
    assert pipe.closed and pipe.forced == []


def test_no_stall_bound_is_none() -> None:
    with Pipeline(buffer(), sample_count=8, stall_timeout=None) as pipe:
        assert pipe.stall_timeout is None


def test_bounds_read_from_numpy_are_taken() -> None:
    """np.float32(2.0) was refused as "must be a finite number of seconds > 0"
    (helper-104): a trainer's config read with numpy holds numpy numbers."""
    import numpy as np

    with Pipeline(buffer(), sample_count=8, liveness_timeout=np.float32(2.0),
                  attach_timeout=np.int64(30), stall_timeout=np.float16(0.5)) as pipe:
        assert (pipe.liveness_timeout, pipe.stall_timeout) == (2.0, 0.5)
        assert type(pipe.liveness_timeout) is float and type(pipe.stall_timeout) is float


def test_a_device_other_than_the_backend_instances_is_refused_naming_both() -> None:
    """``device=`` beside a backend instance was ignored: the batches went to the
    instance's device whatever it said (helper-104). Left out, the pipeline's device is
    the instance's; naming that one, or its type without an index where that is the
    current device (torch's rule: cuda:0 on a machine with no CUDA), is fine."""
    from replay_fsm.transfer.emulated import EmulatedBackend

    with pytest.raises(ValueError) as info:
        Pipeline(buffer(), sample_count=8, device="meta", backend=EmulatedBackend("cpu"))
    assert str(info.value) == (
        "device 'meta' differs from the device of the backend instance, 'cpu' "
        "(EmulatedBackend), which is where the batches go: leave device out, or pass a "
        "backend built for 'meta'")
    for device in (None, "cpu", torch.device("cpu")):
        with Pipeline(buffer(), sample_count=8, device=device,
                      backend=EmulatedBackend("cpu")) as pipe:
            assert pipe.device == torch.device("cpu")
    # By the devices alone (no GPU needed): an index-less type is the current device
    # of it, not any (the batches would be on another device than the learner's).
    from replay_fsm.transfer import build_backend

    now = torch.cuda.current_device() if torch.cuda.is_available() else 0
    on_current, on_other = EmulatedBackend("cpu"), EmulatedBackend("cpu")
    on_current.device, on_other.device = (torch.device("cuda", now),
                                          torch.device("cuda", now + 1))
    assert build_backend("cuda", on_current) is on_current
    assert build_backend(f"cuda:{now + 1}", on_other) is on_other
    with pytest.raises(ValueError, match=f"^device 'cuda:{now}' differs from the device "
                                         f"of the backend instance, 'cuda:{now + 1}' "):
        build_backend(f"cuda:{now}", on_other)
    with pytest.raises(ValueError, match=rf"^device 'cuda' \(now cuda:{now}\) differs "
                                         f"from the device of the backend instance, "
                                         f"'cuda:{now + 1}' "):
        build_backend("cuda", on_other)


def test_a_type_with_one_device_is_that_device_with_an_index_or_without() -> None:
    """Pipeline(device="cpu:0", backend=CpuBackend()) was refused as "device 'cpu:0'
    differs from the device of the backend instance, 'cpu'", and "mps:0" beside an
    AcceleratorBackend("mps") as well: torch has one CPU and one MPS device, which
    either name (helper-108)."""
    from replay_fsm.transfer import build_backend
    from replay_fsm.transfer.cpu import CpuBackend
    from replay_fsm.transfer.emulated import EmulatedBackend

    for device in ("cpu:0", torch.device("cpu", 0)):
        with Pipeline(buffer(), sample_count=8, device=device, backend=CpuBackend()) as pipe:
            assert pipe.device == torch.device("cpu")
    on_mps = EmulatedBackend("cpu")
    on_mps.device = torch.device("mps")  # by the devices alone: no MPS needed
    assert build_backend("mps:0", on_mps) is on_mps
    index_less = EmulatedBackend("cpu")
    index_less.device = torch.device("cuda")  # the current one, which cuda:<now> names
    now = torch.cuda.current_device() if torch.cuda.is_available() else 0
    assert build_backend(f"cuda:{now}", index_less) is index_less
    with pytest.raises(ValueError, match=f"^device 'cuda:{now + 1}' differs from the "
                                         "device of the backend instance, 'cuda' "):
        build_backend(f"cuda:{now + 1}", index_less)


def test_a_collector_link_instance_gives_its_kind() -> None:
    rb = buffer()
    with Pipeline(rb, sample_count=8, collector=ThreadCollector(rb, 2, 8)) as pipe:
        assert pipe.collector == "thread"


def test_tracing_keeps_a_tracer_of_the_capacity_asked() -> None:
    with Pipeline(buffer(), sample_count=8, trace=True, trace_capacity=3) as pipe:
        assert pipe.tracer is not None and pipe.tracer.capacity == 3
        pipe.start_prepare(0, 8)
        pipe.sample_large_batch(0, 8)
        pipe.after_tick()
        assert len(pipe.tracer.events()) == 3  # the ring of the last 3 events


@pytest.mark.parametrize("kwargs,error,message", [
    ({"sample_count": 0}, ValueError, "sample_count must be an int >= 1, got 0"),
    ({"trace_capacity": 0}, ValueError, "trace_capacity must be an int >= 1, got 0"),
    ({"packer_threads": 0}, ValueError, "packer_threads must be an int >= 1, got 0"),
    ({"liveness_timeout": 0}, ValueError,
     "liveness_timeout must be a finite number of seconds > 0, got 0"),
    ({"liveness_timeout": float("inf")}, ValueError,
     "liveness_timeout must be a finite number of seconds > 0, got inf"),
    ({"attach_timeout": True}, ValueError,
     "attach_timeout must be a finite number of seconds > 0, got True"),
    ({"attach_timeout": "60"}, ValueError,
     "attach_timeout must be a finite number of seconds > 0, got '60'"),
    ({"stall_timeout": 0}, ValueError,
     "stall_timeout must be a finite number of seconds > 0 or None, got 0"),
    ({"stall_timeout": float("nan")}, ValueError,
     "stall_timeout must be a finite number of seconds > 0 or None, got nan"),
    ({"stall_timeout_name": ""}, TypeError,
     "stall_timeout_name must be a non-empty str, got ''"),
    ({"stall_timeout_name": None}, TypeError,
     "stall_timeout_name must be a non-empty str, got None"),
    ({"min_snapshot_ptr_name": ""}, TypeError,
     "min_snapshot_ptr_name must be a non-empty str, got ''"),
    ({"min_snapshot_ptr_name": 3}, TypeError,
     "min_snapshot_ptr_name must be a non-empty str, got 3"),
    ({"trace": "no"}, TypeError, "trace must be True or False, got 'no'"),
    ({"checked": 1}, TypeError, "checked must be True or False, got 1"),
    ({"collector": 3}, TypeError,
     "collector must be 'thread', 'process', 'external' or a CollectorLink, got int"),
    ({"collector": None}, TypeError,
     "collector must be 'thread', 'process', 'external' or a CollectorLink, got NoneType"),
    ({"backend_options": [("pin", True)]}, TypeError,
     "backend_options must be a mapping of keyword arguments, got list"),
    ({"backend": "accel"}, ValueError, "backend 'accel' is for accelerators (mps, xpu, "
     "...); for device 'cpu' use backend 'cpu' (the default there)"),
    ({"ring_depth": 65}, ValueError,
     "ring_depth must be <= 64, got 65: a ring prefetches ring_depth - 1 ticks ahead, "
     "and each slot holds a whole batch on the host and on the device"),
])
def test_a_bad_argument_is_named(kwargs: dict, error: type, message: str) -> None:
    args = {"sample_count": 8, **kwargs}
    with pytest.raises(error) as info:
        Pipeline(buffer(), **args)
    assert str(info.value) == message


@pytest.mark.parametrize("args,kwargs,error,message", [
    ((1.0, 3), {}, TypeError,
     "start must be an int (or numpy integer) >= 0, got 1.0 of type float"),
    ((0, "3"), {}, TypeError,
     "stop must be an int (or numpy integer) >= 0, got '3' of type str"),
    ((0, True), {}, TypeError,
     "stop must be an int (or numpy integer) >= 0, got True of type bool"),
    ((-1, 3), {}, ValueError, "start must be an int >= 0, got -1"),
    ((0, 3), {"min_snapshot_ptr": 2.5}, TypeError,
     "min_snapshot_ptr must be an int (or numpy integer) >= 0, got 2.5 of type float"),
])
def test_ticks_refuses_a_bad_range_at_the_call(args: tuple, kwargs: dict, error: type,
                                               message: str) -> None:
    """``ticks(1.0, 3)`` raised range()'s "'float' object cannot be interpreted as an
    integer" at the loop's first step, where every other call that takes a tick
    names it (helper-104). Now the call itself refuses it, nothing requested."""
    with Pipeline(buffer(), sample_count=8) as pipe:
        with pytest.raises(error) as info:
            pipe.ticks(*args, **kwargs)
        assert str(info.value) == message
        assert pipe.pending == ()


def test_ticks_takes_what_range_takes_but_a_bool() -> None:
    """As ``range``: numpy integers are ticks, and stop <= start yields nothing (a run
    resumed after its last tick); a bool is no tick (``ticks(0, True)`` ran tick 0)."""
    import numpy as np

    with Pipeline(buffer(), sample_count=8) as pipe:
        with pytest.raises(TypeError, match="^stop must be an int"):
            list(pipe.ticks(0, True))
        assert [t for t, _ in pipe.ticks(np.int64(0), np.int32(2))] == [0, 1]
        assert list(pipe.ticks(5, 5)) == [] and list(pipe.ticks(7, 3)) == []
        assert pipe.pending == ()


def test_the_smallest_values_are_accepted() -> None:
    with Pipeline(buffer(), sample_count=1, trace=True, trace_capacity=1,
                  packer_threads=1) as pipe:
        pipe.start_prepare(0, 1)
        assert pipe.sample_large_batch(0, 1)["obs"].shape == (1, 3)


def test_the_deepest_ring_is_accepted() -> None:
    with Pipeline(buffer(), sample_count=1, ring_depth=64) as pipe:
        assert pipe.ring_depth == 64
        for tick in range(63):
            pipe.start_prepare(tick, 1)
        assert pipe.sample_large_batch(0, 1)["obs"].shape == (1, 3)


def test_fail_refuses_what_is_not_an_exception_and_changes_nothing() -> None:
    """``fail("oops")`` would leave a cause no later call can chain to: refused."""
    with Pipeline(buffer(), sample_count=1) as pipe:
        with pytest.raises(TypeError) as info:
            pipe.fail("oops")  # type: ignore[arg-type]
        assert str(info.value) == ("fail takes the exception that broke the run, got "
                                   "'oops' of type str")
        pipe.start_prepare(0, 1)  # still usable
        assert pipe.sample_large_batch(0, 1)["obs"].shape == (1, 3)


def test_a_source_without_the_buffer_interface_is_named() -> None:
    class Partial:
        layout = width = None

    with pytest.raises(TypeError) as info:
        Pipeline(Partial(), sample_count=8)  # type: ignore[arg-type]
    assert str(info.value) == ("replay_buffer must be a replay_fsm.ReplayBuffer (or offer "
                               "its interface); Partial lacks ptr, size, gather")


def test_a_source_other_than_a_replay_buffer_needs_its_own_link() -> None:
    class Source:
        layout, width, ptr, size = buffer().layout, 11, 0, 0

        def gather(self, indices, out):  # type: ignore[no-untyped-def]
            return out

    with pytest.raises(TypeError) as info:
        Pipeline(Source(), sample_count=8)  # type: ignore[arg-type]
    assert str(info.value) == ("collector='thread' packs with a replay_fsm.ReplayBuffer; "
                               "a Source needs a CollectorLink of its own")


class NoSpan:
    def transition(self, record: object, time_ns: int) -> None:
        """Only one of the two hooks."""


@pytest.mark.parametrize("observer,lacks", [
    (object(), "object lacks transition and span"),
    (NoSpan(), "NoSpan lacks span"),
    (Observer, r"an instance: got the class Observer \(call it: Observer\(\)\)"),
])
def test_an_observer_without_its_methods_is_refused_at_once(observer: object,
                                                             lacks: str) -> None:
    """Accepted, it failed the run at the next step, or made close() raise."""
    with Pipeline(buffer(), sample_count=8) as pipe:
        with pytest.raises(TypeError, match=lacks):
            pipe.add_observer(observer)  # type: ignore[arg-type]
        pipe.start_prepare(0, 8)
        pipe.sample_large_batch(0, 8)  # nothing was added: the run goes on
    assert pipe.closed


class NotCallable:
    pid, exitcode, is_alive = 1, None, True


@pytest.mark.parametrize("process,lacks", [
    (None, "NoneType lacks is_alive, pid, exitcode"),
    (NotCallable(), "NotCallable lacks a callable is_alive"),
])
def test_watch_refuses_what_is_not_a_process_at_once(process: object, lacks: str) -> None:
    """Accepted, it raised AttributeError from close()."""
    with Pipeline(buffer(), sample_count=8) as pipe:
        with pytest.raises(TypeError, match=lacks):
            pipe.watch(process)
        pipe.start_prepare(0, 8)
        pipe.sample_large_batch(0, 8)
    assert pipe.closed


def _leaves() -> None:
    pass


def test_watch_refuses_a_closed_process_with_its_own_words() -> None:
    """A ``multiprocessing.Process`` closed (``Process.close()``) raised its own bare
    ValueError from the attribute check; now one that says what watch wanted."""
    import multiprocessing as mp

    process = mp.get_context("spawn").Process(target=_leaves)
    process.start()
    process.join(60)
    process.close()
    with Pipeline(buffer(), sample_count=8) as pipe:
        with pytest.raises(ValueError, match="^watch takes a process that is not closed: "
                                             "process object is closed$"):
            pipe.watch(process)


# The calls the README's API reference writes out with their parameters.
DOCUMENTED_CALLS: list[Callable[..., Any]] = [
    ReplayBuffer, ReplayBuffer.add, ReplayBuffer.add_packed, ReplayBuffer.gather,
    ReplayBuffer.save, ReplayBuffer.load, ReplayBuffer.resized, ReplayBuffer.adopt_rows,
    Pipeline,
    Pipeline.start_prepare, Pipeline.batch_ready, Pipeline.wait_until_ready,
    Pipeline.sample_large_batch, Pipeline.ticks, Pipeline.slot_of, Pipeline.pack_record,
    Pipeline.fail, Pipeline.add_observer, Pipeline.watch, Packer.attach, Packer.service,
]
# Defaults the README writes in words.
WRITTEN_AS = {16 << 20: "16 MiB"}


def _top_level_items(text: str) -> tuple[str, list[str]]:
    """The text up to the ``)`` that closes ``text``'s first ``(``, and its
    comma-separated items, commas inside nested parentheses kept."""
    depth, items, start = 0, [], text.index("(") + 1
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            if not depth:
                items.append(text[start:i].strip())
                return text[:i], [item for item in items if item]
            depth -= 1
        elif text[i] == "," and not depth:
            items.append(text[start:i].strip())
            start = i + 1
    raise AssertionError(f"unclosed: {text[:80]}")


@pytest.mark.parametrize("call", DOCUMENTED_CALLS, ids=lambda c: c.__qualname__)
def test_the_api_reference_gives_each_parameter_with_the_codes_default(
        call: Callable[..., Any]) -> None:
    """The README's signature of ``call`` names its parameters in order, each default
    as the code has it, and no other: a default changed or a parameter added in one
    place only fails here (``watch``'s ``what`` was in the code only, and
    ``slot_of(tick)`` and ``pack_record(tick)`` named a keyword they do not take;
    helper-98)."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    section = readme.split("\n## API reference\n", 1)[1].split("\n## ", 1)[0]
    text = " ".join(section.split())  # the signatures wrap across lines
    name = call.__name__
    found = re.search(rf"[`.]{name}\(", text)
    assert found is not None, f"the API reference has no {name}(...)"
    written, items = _top_level_items(text[found.start():])
    params = [p for p in inspect.signature(call).parameters.values()
              if p.name not in ("self", "cls")]
    names = {p.name for p in params}
    for item in items:
        word = re.match(r"\*|[A-Za-z_]\w*", item)
        assert word is not None and (word[0] == "*" or word[0] in names), (
            f"{name}: the README gives {item!r}, which the code does not take")
    at = 0
    for p in params:
        if p.default is p.empty:
            token = p.name
        elif isinstance(p.default, str):
            token = f'{p.name}="{p.default}"'
        else:
            token = f"{p.name}={WRITTEN_AS.get(p.default, repr(p.default))}"
        found_at = written.find(token, at)
        assert found_at >= 0, f"{name}: the README lacks {token} (after {written[:at]!r})"
        at = found_at + len(token)
