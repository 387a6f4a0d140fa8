"""Every exception the library defines survives pickling: an error raised in a worker
process (a process pool loading a checkpoint, a spawned collector) comes back to the
caller as itself, not as a broken pool or a hung ``multiprocessing.Pool``."""

from __future__ import annotations

import importlib
import inspect
import multiprocessing as mp
import pickle
import pkgutil
import signal
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import replay_fsm
from replay_fsm import CheckpointError, ReplayBuffer

# Example arguments for the classes whose constructor is not Exception's own.
EXAMPLES: dict[str, tuple[Any, ...]] = {
    "replay_fsm.data.checkpoint.CheckpointError": ("/tmp/b.ckpt", "truncated: 3 bytes"),
    "replay_fsm.errors.RankFailed": (1, -9, "no error recorded (pid 42)", (2, 3)),
    "replay_fsm.errors.PackerError": (7, "Traceback (most recent call last):\n"
                                         "  File \"x.py\", line 1\nValueError: bad row\n"),
    "replay_fsm.signals.Interrupted": (signal.SIGTERM,),
    "replay_fsm.trainers.run.RunInterrupted": (signal.SIGINT, {"ticks": 3}),
}


def exception_classes() -> dict[str, type[BaseException]]:
    """Every exception class defined in a module of the package, but for modules of
    an extra whose library is not installed (``replay_fsm.integrations.sb3`` without
    stable-baselines3)."""
    found = {}
    for info in pkgutil.walk_packages(replay_fsm.__path__, "replay_fsm."):
        try:
            module = importlib.import_module(info.name)
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.split(".")[0] == "replay_fsm":
                raise
            continue  # an optional dependency: its module defines no exception
        for name, value in vars(module).items():
            if (inspect.isclass(value) and issubclass(value, BaseException)
                    and value.__module__ == info.name):
                found[f"{info.name}.{name}"] = value
    return found


CLASSES = exception_classes()


def test_the_walk_finds_the_library_s_exceptions() -> None:
    """The control: the walk sees the errors the tests below must cover."""
    assert {"replay_fsm.errors.PipelineFailed", "replay_fsm.data.checkpoint.CheckpointError",
            "replay_fsm.errors.PackerError"} <= set(CLASSES)
    assert set(EXAMPLES) <= set(CLASSES)


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_every_exception_survives_pickling(name: str) -> None:
    cls = CLASSES[name]
    custom = cls.__init__ is not BaseException.__init__ and any(
        "__init__" in vars(base) for base in cls.__mro__
        if base.__module__.startswith("replay_fsm"))
    if custom and name not in EXAMPLES:
        pytest.fail(f"{name} has its own constructor: add example arguments to EXAMPLES")
    exc = cls(*EXAMPLES.get(name, ("what went wrong",)))
    exc.seen_in = "a worker"  # set on the way, as add_note (3.11) or a caller would
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is cls
    assert str(back) == str(exc) and back.args == exc.args
    assert vars(back) == vars(exc)  # the attributes, the one set on the way among them


def test_a_checkpoint_error_in_a_process_pool_reaches_the_caller(tmp_path: Path) -> None:
    bad = tmp_path / "not.ckpt"
    bad.write_bytes(b"hello")
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        future = pool.submit(ReplayBuffer.load, str(bad))
        with pytest.raises(CheckpointError) as info:
            future.result(timeout=120)
    assert info.value.path == str(bad) and "not a replay_fsm checkpoint" in info.value.problem
