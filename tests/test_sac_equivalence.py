"""The SAC trainer through the pipeline is bit-identical to the same trainer sampling
synchronously with ``expected_batch`` (INV-DATA at trainer level), on the CPU, with
the lock-step collector: ring depth 2 and 3, collector thread and process."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("gymnasium")

from replay_fsm.trainers.run import SACConfig, train  # noqa: E402
from replay_fsm.trainers.sac import SAC  # noqa: E402

# Pendulum: a classic-control task, no MuJoCo; small networks keep each run ~1 s.
SMALL = SACConfig(env="Pendulum-v1", num_envs=2, batch_size=32, updates_per_tick=2,
                  env_steps_per_tick=1, ticks=40, warmup_steps=64, capacity=4096,
                  hidden=32, seed=3, progress=False)
_sync_runs: dict[int, dict[str, Any]] = {}


def sync_run(depth: int) -> dict[str, Any]:
    """The synchronous reference on the same schedule (computed once per depth)."""
    if depth not in _sync_runs:
        _sync_runs[depth] = train(replace(SMALL, sampling="sync", ring_depth=depth,
                                          collector="thread"))
    return _sync_runs[depth]


@pytest.mark.parametrize("collector", ["thread", "process"])
@pytest.mark.parametrize("depth", [2, 3])
def test_pipeline_learner_is_bit_identical_to_synchronous_sampling(depth: int,
                                                                   collector: str) -> None:
    pipelined = train(replace(SMALL, ring_depth=depth, collector=collector))
    reference = sync_run(depth)
    assert pipelined["updates"] == reference["updates"] == SMALL.ticks * SMALL.updates_per_tick
    assert pipelined["pipeline"]["packs"] >= SMALL.ticks
    # Learning moved every network away from its initialisation...
    assert pipelined["digest"] != SAC(3, 1, hidden=SMALL.hidden, seed=SMALL.seed).digest()
    # ...and along exactly the same path: every parameter, bit for bit.
    assert pipelined["digest"] == reference["digest"]
    # Collection is deterministic too: the same episodes with the same returns.
    assert [(e["env_steps"], e["return"]) for e in pipelined["episodes"]] == [
        (e["env_steps"], e["return"]) for e in reference["episodes"]]


def test_the_digest_sees_a_different_data_schedule() -> None:
    """The comparison can fail: sampling one phase later changes the learner."""
    assert sync_run(2)["digest"] != sync_run(3)["digest"]


def test_snapshot_schedule() -> None:
    config = replace(SMALL, num_envs=4, warmup_steps=10, env_steps_per_tick=2, ring_depth=3)
    warm = 3 * 4  # 10 transitions round up to 3 vector steps of 4 envs
    assert [config.snapshot_ptr(t) for t in range(5)] == [warm, warm, warm, warm + 8,
                                                          warm + 16]


@pytest.mark.parametrize("change, message", [
    ({"ring_depth": 1}, "ring_depth must be between 2 and 64, got 1"),
    ({"sampling": "sync", "ring_depth": 65}, "ring_depth must be between 2 and 64, got 65"),
    ({"learner_threads": 0}, "learner_threads must be None or >= 1, got 0"),
    ({"sampling": "sometimes"}, "sampling"),
    ({"batch_size": 0}, "batch_size"),
    ({"sampling": "sync", "capacity": 100}, "must not wrap"),
    ({"seed": -1}, r"seed must be an int >= 0 and at most 2\*\*63 minus the ticks to run "
                   r"\(ticks 40; .*got -1"),
    ({"seed": 2**63 - 40 + 1}, "seed must be an int >= 0 and at most"),  # tick 39's: 2**63
    ({"sampling": "sync", "seed": 2**63 - 40 + 1}, "seed must be an int >= 0 and at most"),
    ({"seed": 1.5}, "seed must be an int >= 0 and at most"),
    ({"liveness_timeout": 0}, "liveness_timeout must be a finite number of seconds > 0"),
    # blamed the seed (helper-69)
    ({"ticks": 2**63 + 1}, r"ticks must be at most 2\*\*63, got 9223372036854775809"),
])
def test_bad_options_are_refused_early(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        train(replace(SMALL, **change))


def test_a_numpy_integer_seed_is_a_seed() -> None:
    import numpy as np

    replace(SMALL, seed=np.int64(7)).validate()  # a seed from a numpy generator


@pytest.mark.parametrize("change", [
    {"seed": 7}, {"num_envs": 2}, {"ticks": 3}, {"learner_threads": 2}, {"lr": 1e-3},
    {"gamma": 1.0}, {"tau": 0.5}])
def test_numpy_numbers_are_kept_as_the_json_numbers_of_the_result(
        change: dict[str, Any]) -> None:
    """A numpy integer seed (or count) was taken, then kept as it was, and the run's
    result ("Object of type int64 is not JSON serializable") could not be written
    where it ends (helper-110: 1 of 1). Kept as an int, or a float for a rate."""
    import json
    from dataclasses import asdict

    import numpy as np

    (name, value), = change.items()
    numpy = np.float64(value) if isinstance(value, float) else np.int64(value)
    config = replace(SMALL, **{name: numpy})
    config.validate()
    kept = getattr(config, name)
    assert type(kept) is type(value) and kept == value
    json.dumps(asdict(config))


def test_rates_are_read_as_seconds_are_a_decimal_taken_and_a_timedelta_refused() -> None:
    """The rates had a check of their own, beside ``core.seconds_of`` that the
    liveness_timeout of the same config goes through: a Decimal rate (a config read
    with parse_float=Decimal) was refused ("lr must be a real number > 0, got
    Decimal('0.001') of type Decimal") where the timeout beside it was taken, and a
    numpy timedelta64, which counts its own unit, was taken as that count (lr 3.0
    from 3 ns). Both read a real number as ``core.real_of`` does."""
    from decimal import Decimal

    import numpy as np

    config = replace(SMALL, lr=Decimal("0.001"), gamma=Decimal("0.5"),
                     liveness_timeout=Decimal("30"))
    config.validate()
    assert (config.lr, config.gamma, config.liveness_timeout) == (0.001, 0.5, 30.0)
    assert {type(config.lr), type(config.gamma)} == {float}
    with pytest.raises(TypeError, match=r"^lr must be a real number > 0, got "
                                        r"np.timedelta64\(3,'ns'\) of type timedelta64$"):
        replace(SMALL, lr=np.timedelta64(3, "ns")).validate()


@pytest.mark.parametrize("change, error, message", [
    ({"num_envs": 2.5}, TypeError, r"num_envs must be an int \(or numpy integer\), got "
                                   r"2.5 of type float"),  # was taken: 2.5 >= 1
    ({"batch_size": "8"}, TypeError, "batch_size must be an int"),  # '<' not supported
    ({"ticks": True}, TypeError, "ticks must be an int"),  # was taken as 1
    ({"learner_threads": 2.0}, TypeError, "learner_threads must be an int"),
    ({"lr": "x"}, TypeError, "lr must be a real number > 0, got 'x'"),  # was taken
    ({"lr": 0}, ValueError, "lr must be > 0, got 0.0"),
    ({"lr": float("nan")}, ValueError, "lr must be > 0, got nan"),
    ({"gamma": 1.5}, ValueError, r"gamma must be in \(0, 1\], got 1.5"),
    # SAC refuses 0 too: validate took it, the trainer then said "need 0 < gamma <= 1,
    # 0 < tau <= 1 and lr > 0" (helper-116)
    ({"gamma": 0.0}, ValueError, r"gamma must be in \(0, 1\], got 0.0"),
    ({"tau": 0}, ValueError, r"tau must be in \(0, 1\], got 0.0"),
    ({"progress": "no"}, TypeError, "progress must be a bool, got 'no'"),  # was taken
    ({"env": None}, TypeError, "env must be a str, got None"),
])
def test_options_of_the_wrong_type_or_range_are_named(
        change: dict[str, Any], error: type[Exception], message: str) -> None:
    """From Python no parser checks a config's types: a float count, a str rate, a
    str flag were taken (or failed later, in the trainer's own code)."""
    with pytest.raises(error, match=message):
        replace(SMALL, **change).validate()


def test_a_torch_device_is_kept_as_its_name() -> None:
    import json
    from dataclasses import asdict

    config = replace(SMALL, device=torch.device("cpu"))
    config.validate()
    assert config.device == "cpu"
    json.dumps(asdict(config))


def test_a_bound_taken_as_seconds_is_kept_as_a_float() -> None:
    """A liveness_timeout read as a Decimal was refused ("must be a finite number of
    seconds > 0, got Decimal('2')"); one of numpy's was taken, then kept as it was,
    where the synchronous wait computes with it and the result's JSON holds it
    ("Object of type float32 is not JSON serializable"). Both are kept as floats."""
    import json
    from dataclasses import asdict
    from decimal import Decimal

    import numpy as np

    for value in (Decimal("2"), np.float32(2.0)):
        config = replace(SMALL, liveness_timeout=value)
        config.validate()
        assert type(config.liveness_timeout) is float and config.liveness_timeout == 2.0
        json.dumps(asdict(config))
    with pytest.raises(ValueError, match=r"got Decimal\('NaN'\)$"):  # as given
        replace(SMALL, liveness_timeout=Decimal("NaN")).validate()


def test_compare_interleaves_both_trainers_and_times_each_on_its_own_clock() -> None:
    from replay_fsm.trainers.run import compare

    # 32 warm-up + 30 ticks x 6 vector steps: Pendulum's 200-step episodes end.
    result = compare(replace(SMALL, ticks=30, env_steps_per_tick=6, collector="thread"),
                     block=10)
    assert result["bit_identical"]
    assert len(result["round_ratios"]) == 3 and result["speedup_vs_sync"] > 0
    assert result["speedup_after_startup"] > 0
    for run in result["runs"].values():
        assert run["ticks"] == 30 and run["blocks"] == 3
        assert len(run["episodes"]) == 2
        assert all(0 <= e["wall_s"] <= run["loop_s"] for e in run["episodes"])


@pytest.mark.parametrize("ticks", [1, 2])
def test_the_summary_gives_the_speed_up_after_tick_0_too(ticks: int) -> None:
    """Tick 0 waits for the collector's start-up in both runs: on a short run the whole
    runs' ratio read as a gain the steady ticks did not have (1.016x printed, 0.775x
    after tick 0). With one tick there is nothing after it."""
    from replay_fsm.trainers.cli import summary
    from replay_fsm.trainers.run import _comparison

    def run(loop_s: float, startup_s: float) -> dict[str, Any]:
        return {"ticks": ticks, "updates": 2 * ticks, "loop_s": loop_s,
                "startup_s": startup_s, "updates_per_s": 1.0, "digest": "d",
                "tick_ms": {"mean": 1.0}, "final_return": None}

    text = summary(_comparison({"pipeline": run(2.0, 1.2), "sync": run(2.0, 1.4)}, 1, [1.0]))
    if ticks == 1:
        assert "speed-up over synchronous sampling: 1.000x; learners" in text
    else:
        assert "1.000x (0.750x after tick 0, the collector's start-up)" in text


@pytest.mark.parametrize("sampling", ["pipeline", "sync"])
def test_a_collector_that_fails_stops_the_learner_with_collector_died(
        sampling: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from replay_fsm import CollectorDied
    from replay_fsm.trainers import collector

    real_step = collector._Collector.step
    calls = {"n": 0}

    def step(self: collector._Collector, action: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 50:  # after warm-up (32 steps): mid-run
            raise RuntimeError("the simulator crashed")
        real_step(self, action)

    monkeypatch.setattr(collector._Collector, "step", step)
    with pytest.raises(CollectorDied) as info:
        train(replace(SMALL, sampling=sampling, collector="thread"))
    assert "the simulator crashed" in repr(info.value) + repr(info.value.__cause__)
    # The ticks done are not lost with it (they were: nothing was returned or written).
    result = info.value.result  # type: ignore[attr-defined]
    assert 0 < result["ticks"] < SMALL.ticks and result["interrupted"]
    assert result["error"].startswith("CollectorDied: ")
    assert result["updates"] == result["ticks"] * SMALL.updates_per_tick


def test_the_cli_writes_a_run_an_error_stopped_and_exits_2(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The collector fails mid-run: the summary, sac.json and sac.png of the ticks
    done are written, with the error, and the command fails with it (the folder was
    removed and every tick lost)."""
    pytest.importorskip("matplotlib")
    from replay_fsm.cli import main
    from replay_fsm.trainers import collector

    real_step = collector._Collector.step
    calls = {"n": 0}

    def step(self: collector._Collector, action: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 50:
            raise RuntimeError("the simulator crashed")
        real_step(self, action)

    monkeypatch.setattr(collector._Collector, "step", step)
    code = main(["sac", "--env", "Pendulum-v1", "--num-envs", "2", "--batch-size", "32",
                 "--updates-per-tick", "2", "--ticks", "40", "--warmup-steps", "64",
                 "--capacity", "4096", "--hidden", "32", "--collector", "thread",
                 "--out", str(tmp_path / "out"), "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 2 and "(stopped by an error)" in out
    assert err.startswith("replay-fsm sac: error: the SAC collector thread failed")
    result = json.loads((tmp_path / "out" / "sac.json").read_text())
    assert result["interrupted"] and 0 < result["ticks"] < 40
    assert "the simulator crashed" in result["error"]
    assert (tmp_path / "out" / "sac.png").is_file()


def _interrupt_at_update(monkeypatch: pytest.MonkeyPatch, n: int, signum: int) -> None:
    """The learner's ``n``-th tick raises what Ctrl-C (SIGINT) or the CLI's SIGTERM
    handler raises."""
    from replay_fsm.signals import Interrupted

    real, calls = SAC.train_tick, {"n": 0}

    def train_tick(self: SAC, *args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt if signum == 2 else Interrupted(signum)
        return real(self, *args)

    monkeypatch.setattr(SAC, "train_tick", train_tick)


@pytest.mark.parametrize("sampling", ["pipeline", "sync"])
def test_an_interrupted_run_raises_with_what_it_did(
        sampling: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from replay_fsm.trainers.run import RunInterrupted

    _interrupt_at_update(monkeypatch, 13, 15)
    with pytest.raises(RunInterrupted) as info:
        train(replace(SMALL, sampling=sampling, collector="thread"))
    assert isinstance(info.value, KeyboardInterrupt) and info.value.signum == 15
    result = info.value.result
    assert result["interrupted"] and result["ticks"] == 12 < SMALL.ticks
    assert result["updates"] == 12 * SMALL.updates_per_tick


def test_an_interrupted_comparison_keeps_both_runs_and_no_speed_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from replay_fsm.trainers.run import RunInterrupted, compare

    # ABBA blocks of 10: pipeline 1-10, sync 11-20, then sync first: its 15th tick
    _interrupt_at_update(monkeypatch, 25, 2)
    with pytest.raises(RunInterrupted) as info:
        compare(replace(SMALL, ticks=30, collector="thread"), block=10)
    result = info.value.result
    assert info.value.signum == 2 and result["interrupted"]
    assert "speedup_vs_sync" not in result and len(result["round_ratios"]) == 1
    assert {k: r["ticks"] for k, r in result["runs"].items()} == {"pipeline": 10,
                                                                "sync": 14}
    assert all(r["interrupted"] for r in result["runs"].values())


@pytest.mark.parametrize("signum", [2, 15])
def test_the_cli_writes_an_interrupted_run_and_exits_with_the_signals_code(
        signum: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C (or SIGTERM) after 12 ticks: the summary, sac.json and sac.png of the
    run so far are written, marked interrupted, and the exit code is the signal's."""
    pytest.importorskip("matplotlib")
    from replay_fsm.cli import main

    _interrupt_at_update(monkeypatch, 13, signum)
    code = main(["sac", "--env", "Pendulum-v1", "--num-envs", "2", "--batch-size", "32",
                 "--updates-per-tick", "2", "--ticks", "40", "--warmup-steps", "64",
                 "--capacity", "4096", "--hidden", "32", "--collector", "thread",
                 "--out", str(tmp_path / "out"), "--no-progress"])
    assert code == 128 + signum
    assert "(interrupted)" in capsys.readouterr().out
    result = json.loads((tmp_path / "out" / "sac.json").read_text())
    assert result["interrupted"] and result["ticks"] == 12
    assert (tmp_path / "out" / "sac.png").is_file()


def test_a_comparison_interrupted_at_its_first_tick_still_writes_its_summary(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """No tick done, the synchronous run never started: no rate, no return, no
    episode; the summary and the files say so instead of failing."""
    pytest.importorskip("matplotlib")
    from replay_fsm.cli import main

    _interrupt_at_update(monkeypatch, 1, 2)
    code = main(["sac", "--env", "Pendulum-v1", "--num-envs", "2", "--batch-size", "32",
                 "--updates-per-tick", "2", "--ticks", "40", "--warmup-steps", "64",
                 "--capacity", "4096", "--hidden", "32", "--collector", "thread",
                 "--sampling", "both", "--out", str(tmp_path), "--no-progress"])
    assert code == 130
    out = capsys.readouterr().out
    assert out.count("(interrupted)") == 2 and "final return n/a" in out
    assert "tick n/a mean" in out

    def strict(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    result = json.loads((tmp_path / "sac.json").read_text(), parse_constant=strict)
    assert [r["ticks"] for r in result["runs"].values()] == [0, 0]
    assert result["runs"]["sync"]["tick_ms"] == {"mean": None, "p50": None, "p99": None}


def test_the_collector_process_outlives_stop_signals_the_learner_decides() -> None:
    """A terminal's Ctrl-C and a scheduler's SIGTERM reach every process of the job.
    The collector process ignores both: the learner's run goes on (before, it failed
    with CollectorDied, and a collector killed inside an add left the buffer
    unwritable), and closing the trainer ends the collector."""
    import os

    from replay_fsm.signals import STOP_SIGNALS
    from replay_fsm.trainers.run import Trainer

    with Trainer(replace(SMALL, collector="process")) as trainer:
        trainer.run(2)
        for signum in STOP_SIGNALS:
            os.kill(trainer.worker.pid, signum)
        trainer.run(6)  # rows the collector adds after the signals
        assert trainer.tick == 8 and trainer.worker.is_alive()
    assert trainer.worker.exitcode == 0  # it left when told


def test_a_ctrl_c_as_the_collector_process_starts_leaves_it_the_semaphores_it_opens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C that came while the collector process started is raised as its start
    returns (``signals.start_ignoring``), before the trainer holds the worker: it ran
    on until the interpreter's exit (``Trainer.run`` raised without ending it), and
    the pipeline, closed with no watched collector alive, let its channels'
    semaphores go, so the child, still starting, died opening them
    (FileNotFoundError, exit code 1). It is told to stop and joined before the
    KeyboardInterrupt goes on."""
    from replay_fsm.trainers import collector as collector_module
    from replay_fsm.trainers.run import Trainer

    started: list[Any] = []
    start = collector_module.start_ignoring

    def started_then_interrupted(process: Any, signums: tuple[int, ...]) -> None:
        start(process, signums)
        started.append(process)
        raise KeyboardInterrupt  # as one noted during the start is raised at its end

    monkeypatch.setattr(collector_module, "start_ignoring", started_then_interrupted)
    with Trainer(replace(SMALL, collector="process")) as trainer:
        with pytest.raises(KeyboardInterrupt):
            trainer.run(2)
        (worker,) = started
        assert worker.exitcode == 0  # joined, having left when told


def test_a_warm_up_that_stops_filling_names_the_configs_fields(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A collector whose environments hang in the warm-up: a SACConfig's user was told
    of "--liveness-timeout", an option of the command line, and of min_snapshot_ptr,
    the pipeline's parameter the trainer sets; they set liveness_timeout and
    warmup_steps. In both samplings (the command line's names: test_cli)."""
    from replay_fsm import CollectorDied, DataStalled
    from replay_fsm.trainers.run import Trainer

    from .support import stall_the_warm_ups

    stall_the_warm_ups(monkeypatch)
    config = replace(SMALL, collector="thread", liveness_timeout=1.0)
    with Trainer(config) as trainer, pytest.raises(DataStalled) as stalled:
        trainer.run(2)
    stalled.match(r"^tick 0 waits for 64 rows \(the warm-up's warmup_steps, then "
                  r"env_steps_per_tick x num_envs more a tick\); the replay buffer has "
                  r"had \d+ for \d+\.\d s \(liveness_timeout\): is whatever adds the "
                  r"rows still running\?$")
    with Trainer(replace(config, sampling="sync")) as trainer, \
            pytest.raises(CollectorDied) as died:
        trainer.run(2)
    died.match(r"^the SAC collector added no row for 1 s \(liveness_timeout\) while the "
               r"learner waited for 64 rows \(it has written \d+\)$")


@pytest.mark.deep  # the collector's start-up, then a liveness bound of MARGIN_S: 33 s
def test_a_stopped_collector_is_killed_at_once_not_waited_for() -> None:
    """A collector process that stops (SIGSTOP, stuck) fails the run once no row came
    for liveness_timeout (DataStalled: the pipeline's stall_timeout had stayed at its
    60 s); the trainer then SIGKILLs it at once. It joined it first for
    COLLECTOR_JOIN_S (30 s) more, which a collector stopped so never leaves."""
    import os
    import signal

    from replay_fsm import DataStalled
    from replay_fsm.trainers.run import Trainer

    from .support import MARGIN_S

    # The collector process's start-up (spawn, torch, gymnasium) adds no row either:
    # its first row came 1.9 to 4.5 s after run() began beside two busy loops
    # (helper-128), too close to the 10 s this bound was; a loaded CI machine is slow,
    # never MARGIN_S slow.
    with Trainer(replace(SMALL, collector="process", liveness_timeout=MARGIN_S)) as trainer:
        trainer.run(2)
        worker = trainer.worker
        joins: list[float | None] = []
        join = worker.join

        def recorded(timeout: float | None = None) -> None:
            joins.append(timeout)
            join(timeout)

        worker.join = recorded
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            with pytest.raises(DataStalled, match=r"for \d+\.\d s \(liveness_timeout\)"
                               ) as stalled:
                trainer.run(SMALL.ticks)
        finally:
            if worker.is_alive():
                os.kill(worker.pid, signal.SIGCONT)
        # The silence it measured: the bound, or a little more where its look came late
        # (a fixed "30.x s" refused a look a second late); a bound of twice or more is
        # not this one (the pipeline's stall_timeout of 60 s, say).
        silent = re.search(r"for (\d+\.\d) s \(liveness_timeout\)", str(stalled.value))
        assert silent is not None and MARGIN_S <= float(silent[1]) < 2 * MARGIN_S, (
            str(stalled.value))
        assert not worker.is_alive() and worker.exitcode == -signal.SIGKILL
        # None: the join of the killed process; a positive timeout: a wait before it
        assert joins and all(t is None or t == 0.0 for t in joins), joins


def test_a_second_ctrl_c_in_the_trainers_close_still_ends_its_collector(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The collector process ignores SIGTERM: left running, it would hang the
    interpreter's exit (multiprocessing terminates, then joins without a timeout)."""
    from replay_fsm.trainers.run import Trainer

    trainer = Trainer(replace(SMALL, collector="process"))
    trainer.run(2)
    assert trainer.pipe is not None
    close = trainer.pipe.close

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer.pipe, "close", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer.close()
        assert not trainer.worker.is_alive()
    finally:
        close()


NEVER_CLOSED = """
from replay_fsm.trainers.run import SACConfig, Trainer
trainer = Trainer(SACConfig(env="Pendulum-v1", num_envs=2, batch_size=32,
                            updates_per_tick=2, env_steps_per_tick=1, ticks=40,
                            warmup_steps=64, capacity=4096, hidden=32, seed=3,
                            progress=False, collector="process", sampling="{sampling}"))
trainer.run(2)
print(trainer.worker.pid, flush=True)
# never closed: the interpreter's exit has to end the collector
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sampling", ["sync", "pipeline"])
def test_a_trainer_never_closed_does_not_hang_the_interpreters_exit(sampling: str) -> None:
    """The collector process ignores SIGTERM, which multiprocessing's clean-up at exit
    sends to daemon children before it joins them without a timeout: that exit hung
    for ever (helper-26). An exit hook ends the collector first."""
    import os
    import signal
    import subprocess
    import sys

    from .support import MARGIN_S

    child = subprocess.Popen([sys.executable, "-c", NEVER_CLOSED.format(sampling=sampling)],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, _ = child.communicate(timeout=4 * MARGIN_S)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        pytest.fail("the interpreter's exit hung")
    assert child.returncode == 0
    collector = int(out.split()[-1])
    with pytest.raises(ProcessLookupError):
        os.kill(collector, 0)  # ended and reaped before its learner exited


class _Rows:
    """What ``wait_rows`` reads of a replay buffer: ``ptr``."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class _Alive:
    exitcode = None

    def is_alive(self) -> bool:
        return True


@pytest.mark.parametrize("rows_per_step, fails, stopped", [
    (1, False, False), (0, True, False), (0, True, True)])
def test_the_synchronous_wait_for_rows_lasts_while_rows_come(
        rows_per_step: int, fails: bool, stopped: bool, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """On a set clock (each poll 0.4 s): a warm-up longer than the bound, its rows
    coming all along, is waited for (it raised CollectorDied at 1 s); a collector that
    adds no row for the bound is reported, with what it has written. ``stopped``: the
    whole job stopped an hour (Ctrl-Z) at the first poll; that stretch counts for half
    the bound (it failed at the first poll after it), the polls after it judge."""
    from replay_fsm import CollectorDied
    from replay_fsm.trainers import collector

    rb = _Rows(10)

    class Clock:
        now = 0.0

        def monotonic_ns(self) -> int:
            return round(self.now * 1e9)

        def sleep(self, seconds: float) -> None:
            self.now += 3600 if stopped and self.now == 0 else 0.4
            rb.ptr += rows_per_step

    clock = Clock()
    monkeypatch.setattr(collector, "time", clock)
    if fails:
        with pytest.raises(CollectorDied, match=r"^the SAC collector added no row for 1 s "
                                                r"\(liveness_timeout\) while the learner "
                                                r"waited for 30 rows \(it has written 10\)$"):
            collector.wait_rows(rb, 30, _Alive(), 1.0)  # type: ignore[arg-type]
        # the first poll past the bound (0.5 s of the hour counted, then 0.4 s each)
        assert clock.now == pytest.approx(3600.8 if stopped else 1.2)
    else:
        collector.wait_rows(rb, 30, _Alive(), 1.0)  # type: ignore[arg-type]
        assert rb.ptr == 30 and clock.now == pytest.approx(8.0)


def test_the_synchronous_wait_words_a_killed_collector_as_the_pipeline_does() -> None:
    """It said "the SAC collector exited with -9 while ..."; the pipelined run and the
    demo say "<collector> (pid P) exited with code -9"."""
    from replay_fsm import CollectorDied
    from replay_fsm.trainers import collector

    from .support import Exited

    with pytest.raises(CollectorDied) as info:
        collector.wait_rows(_Rows(10), 30, Exited(), 1.0)  # type: ignore[arg-type]
    assert str(info.value) == ("the SAC collector process (pid 4242) exited with code -9 "
                               "while the learner waited for 30 rows")


def test_a_plot_that_cannot_be_written_whole_keeps_the_earlier_one(tmp_path: Path) -> None:
    """savefig wrote the PNG in place: a file-size limit (or a full disk, or a stop)
    cut it, and a cut PNG took the earlier plot's place. It is written beside it, then
    renamed, as the result beside it."""
    import resource
    import subprocess
    import sys

    pytest.importorskip("matplotlib")
    out = tmp_path / "sac.png"
    out.write_bytes(b"the earlier plot")
    runs = {"pipeline": {"episodes": [{"env_steps": s, "wall_s": s / 10, "return": -s}
                                      for s in range(1, 20)],
                         "config": {"num_envs": 2}, "loop_s": 2.0, "updates": 40}}
    script = ("import json, sys\nfrom replay_fsm.trainers.report import plot\n"
              "plot(json.loads(sys.argv[1]), sys.argv[2])\n")

    def limit() -> None:  # the PNG is tens of kB
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    done = subprocess.run([sys.executable, "-c", script, json.dumps(runs), str(out)],
                          capture_output=True, text=True, preexec_fn=limit, timeout=120)
    assert done.returncode == 1 and "File too large" in done.stderr, done.stderr
    assert out.read_bytes() == b"the earlier plot"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sac.png"]  # no .part left
    from replay_fsm.trainers.report import plot

    assert plot(runs, out) == out  # type: ignore[arg-type]
    assert out.read_bytes().startswith(b"\x89PNG") and len(out.read_bytes()) > 4096


def test_a_plot_of_a_run_with_no_finished_episode_says_so() -> None:
    """Too few ticks for an episode to end drew two empty panels, with nothing to
    tell an empty run from a plot gone wrong (helper-76b). A run that has curves
    gets no such line."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from replay_fsm.trainers.report import figure

    def texts(episodes: list[dict[str, float]], sync: bool = True) -> list[list[str]]:
        run = {"episodes": episodes, "config": {"num_envs": 2}, "loop_s": 2.0,
               "updates": 40}
        fig = figure(plt, {"pipeline": run, "sync": dict(run, episodes=[])} if sync
                     else {"pipeline": run})
        try:
            return [[t.get_text() for t in ax.texts] for ax in fig.axes]
        finally:
            plt.close(fig)

    said = ("no episode finished (pipeline, synchronous sampling): more ticks, or a "
            "task with shorter episodes")
    assert texts([]) == [[said], [said]]
    one = [{"env_steps": 10, "wall_s": 1.0, "return": -3.0}]
    assert texts(one) == [[said.replace("pipeline, ", "")]] * 2
    assert texts(one, sync=False) == [[], []]


@pytest.mark.parametrize("collector", ["thread", "process"])
def test_both_samplings_end_with_the_episodes_of_the_last_phase(collector: str) -> None:
    """The last publish (weights version ``ticks``) starts a collection phase that
    ``env_steps`` counts; episodes ending in it were in the synchronous run and not
    in the pipelined one, whose close stopped the collector first. Here 100 warm-up
    steps and 100 phases end Pendulum's 200-step episodes in that phase."""
    config = replace(SMALL, ticks=100, warmup_steps=200, collector=collector)
    pipelined = train(config)
    reference = train(replace(config, sampling="sync"))
    assert pipelined["digest"] == reference["digest"]
    episodes = [(e["env_steps"], e["return"]) for e in pipelined["episodes"]]
    assert episodes == [(e["env_steps"], e["return"]) for e in reference["episodes"]]
    assert [s for s, _ in episodes] == [400, 400]
    assert pipelined["final_return"] == reference["final_return"] is not None
