"""The demo trainer end to end (what `make demo` runs), kept small."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from replay_fsm.demo import DemoConfig, format_summary, run
from replay_fsm.verify.conformance import check, load


@pytest.mark.parametrize("collector", [
    "thread", pytest.param("process", marks=pytest.mark.slow)])
def test_demo_trains_and_writes_its_files(collector: str, tmp_path: Path) -> None:
    summary = run(DemoConfig(ticks=25, collector=collector, out=tmp_path, checked=True,
                             sample_count=512, capacity=20_000, envs=64, progress=False))
    assert summary["ticks"] == 25 and summary["trace_conforms"]
    assert summary["checked_mode_checks"] > 0 and summary["bytes_moved"] > 0
    for name in ("trace.json", "transitions.jsonl", "slot.mmd", "summary.json"):
        assert (tmp_path / name).exists(), name
    assert json.loads((tmp_path / "summary.json").read_text())["ticks"] == 25
    assert check(load(tmp_path / "transitions.jsonl")).ok
    assert "speed-up over synchronous" in format_summary(summary, tmp_path)
    # The run's figures are its own ticks': the comparison after them (which copies
    # batches of its own) is reported apart, under "compare".
    assert summary["bytes_moved"] == 25 * _slot_bytes(512)
    assert summary["compare"]["ticks_each"] > 0


def test_the_demos_speed_up_comes_with_the_spread_of_its_blocks(tmp_path: Path) -> None:
    """The comparison's speed-up is printed with the lowest and highest of its pairs
    of blocks: on a busy 2-core machine they spread by more than the stall the
    pipeline removes (four runs beside other work: 0.96 to 1.23 x, with 2 to 4 ms of
    stall a tick removed from ticks of 50 to 90 ms), and a single figure read as a
    gain or a loss that was noise."""
    summary = run(DemoConfig(ticks=5, collector="thread", out=tmp_path, sample_count=256,
                             capacity=10_000, envs=32, progress=False))
    c = summary["compare"]
    assert len(c["block_ratios"]) == c["blocks"]
    assert all(r > 0 for r in c["block_ratios"])
    assert min(c["block_ratios"]) <= c["speedup_vs_sync"] <= max(c["block_ratios"])
    assert json.loads((tmp_path / "summary.json").read_text())["compare"] == c
    c.update(speedup_vs_sync=1.04, block_ratios=[0.9, 1.234, 1.01])
    assert ("  speed-up over synchronous  1.04x (blocks 0.90 to 1.23)"
            in format_summary(summary, tmp_path))


def test_a_run_longer_than_its_trace_is_reported_not_checked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's trace holds the whole run up to TRACE_MAX_EVENTS; past that its
    conformance is "not checked" (it was a false violation, and exit code 1), and
    the command still exits 0."""
    from replay_fsm.cli import main
    from replay_fsm.demo import runner

    assert runner.trace_capacity(300) == 1 << 16
    assert runner.trace_capacity(20_000) >= runner.TRACE_EVENTS_PER_TICK * 20_000
    assert runner.trace_capacity(10**7) == runner.TRACE_MAX_EVENTS
    monkeypatch.setattr(runner, "TRACE_MAX_EVENTS", 100)
    assert main(["demo", "--ticks", "25", "--out", str(tmp_path), "--sample-count", "256",
                 "--no-progress"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["trace_conforms"] is None and summary["ticks"] == 25
    assert summary["trace_conformance"].startswith(
        "not checked: the tracer kept only its last 100 events and dropped the first ")
    first = json.loads((tmp_path / "transitions.jsonl").read_text().splitlines()[0])
    assert first["kind"] == "truncated"


def _slot_bytes(sample_count: int) -> int:
    from replay_fsm.data.buffer import Layout
    from replay_fsm.demo.env import ACT, OBS

    return sample_count * Layout.build(OBS, ACT, 0).width * 4  # float32 rows


def test_ctrl_c_during_the_comparison_keeps_the_runs_figures(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C in the comparison after the run's ticks: every tick was done, the run
    is reported as interrupted in the comparison (its ticks are not marked), and its
    figures are the run's ticks' alone."""
    from replay_fsm.demo import Learner

    real_step = Learner.step
    calls = {"n": 0}

    def step(self: Learner, batch: dict, all_reduce: object = None) -> float:
        calls["n"] += 1
        if calls["n"] == 20 + 5:  # the comparison's fifth pipelined tick
            raise KeyboardInterrupt
        return real_step(self, batch, all_reduce)  # type: ignore[arg-type]

    monkeypatch.setattr(Learner, "step", step)
    summary = run(DemoConfig(ticks=20, collector="thread", out=tmp_path, sample_count=256,
                             capacity=10_000, envs=32, progress=False))
    assert summary["interrupted"] and summary["ticks"] == 20
    assert summary["interrupted_in"] == "comparison"
    assert summary["compare"] == {} and summary["trace_conforms"]
    assert summary["bytes_moved"] == 20 * _slot_bytes(256)
    text = format_summary(summary, tmp_path)
    assert "not measured: interrupted after the run's ticks" in text
    assert "(interrupted)" not in text  # every tick of the run was done


def test_ctrl_c_stops_cleanly_and_still_writes_the_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from replay_fsm.demo import Learner

    real_step = Learner.step
    calls = {"n": 0}

    def step(self: Learner, batch: dict, all_reduce: object = None) -> float:
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt  # what Ctrl-C raises in the learner's thread
        return real_step(self, batch, all_reduce)  # type: ignore[arg-type]

    monkeypatch.setattr(Learner, "step", step)
    summary = run(DemoConfig(ticks=50, collector="thread", out=tmp_path, sample_count=256,
                             capacity=10_000, envs=32, progress=False))
    assert summary["interrupted"] and summary["ticks"] == 5
    assert summary["interrupted_in"] == "run" and summary["trace_conforms"]
    assert "5 (interrupted)" in format_summary(summary, tmp_path)
    for name in ("trace.json", "transitions.jsonl", "summary.json"):
        assert (tmp_path / name).exists(), name


@pytest.mark.parametrize("collector", ["thread", "process"])
def test_ctrl_c_during_start_up_still_writes_the_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, collector: str) -> None:
    """Ctrl-C while the learner is being made (its first torch.optim import takes
    seconds), the collector just started: the run stops with no tick done, the
    collector is stopped and joined, and the files are written (as the README says)."""
    from replay_fsm.demo import runner
    from replay_fsm.demo.learner import Learner

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt  # what Ctrl-C raises in the learner's thread

    workers: list = []
    make = runner._make_collector
    monkeypatch.setattr(Learner, "create", interrupted)
    monkeypatch.setattr(runner, "_make_collector",
                        lambda *a: workers.append(make(*a)) or workers[-1])
    summary = run(DemoConfig(ticks=5, collector=collector, out=tmp_path, sample_count=256,
                             capacity=10_000, envs=32, progress=False))
    assert summary["interrupted"] and summary["ticks"] == 0
    assert summary["trace_conforms"]  # the close's transitions, and nothing else
    assert len(workers) == 1 and not workers[0].is_alive()
    if collector == "process":
        assert workers[0].exitcode == 0  # it attached, found the channels closed, left
    for name in ("trace.json", "transitions.jsonl", "summary.json"):
        assert (tmp_path / name).exists(), name


def test_a_ctrl_c_as_the_collector_process_starts_leaves_it_the_semaphores_it_opens(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C that came while the collector process started is raised as its start
    returns (``signals.start_ignoring``), before the pipeline watched it: closed
    with no watched collector alive, the pipeline let its channels' semaphores go,
    and the child, still starting, died opening them (a FileNotFoundError traceback
    from its unpickling, exit code 1). Watched all the same, it attaches, finds the
    channels closed and leaves."""
    from replay_fsm.demo import runner

    workers: list = []
    make, start = runner._make_collector, runner.start_ignoring

    def started_then_interrupted(process: object, signums: tuple[int, ...]) -> None:
        start(process, signums)
        raise KeyboardInterrupt  # as one noted during the start is raised at its end

    monkeypatch.setattr(runner, "_make_collector",
                        lambda *a: workers.append(make(*a)) or workers[-1])
    monkeypatch.setattr(runner, "start_ignoring", started_then_interrupted)
    summary = run(DemoConfig(ticks=5, collector="process", out=tmp_path, sample_count=256,
                             capacity=10_000, envs=32, progress=False))
    assert summary["interrupted"] and summary["ticks"] == 0
    assert len(workers) == 1 and workers[0].exitcode == 0


def test_sigterm_injected_with_no_handler_is_refused_before_anything_starts(
        tmp_path: Path) -> None:
    """SIGTERM's default would kill the caller outright (a test runner too): the
    injection needs a handler, as the CLI installs."""
    with pytest.raises(ValueError, match="SIGTERM would kill this process"):
        run(DemoConfig(ticks=5, collector="thread", out=tmp_path / "out", progress=False,
                       interrupt_at=1, interrupt_signal=signal.SIGTERM))
    assert not (tmp_path / "out").exists()


def test_sigterm_under_the_clis_handler_stops_as_ctrl_c_does(tmp_path: Path) -> None:
    from replay_fsm.signals import sigterm_as_interrupt

    with sigterm_as_interrupt() as taken:
        summary = run(DemoConfig(ticks=50, collector="thread", out=tmp_path,
                                 sample_count=256, capacity=10_000, envs=32,
                                 progress=False, interrupt_at=4,
                                 interrupt_signal=signal.SIGTERM))
    assert taken == [signal.SIGTERM]
    assert summary["interrupted"] and 4 <= summary["ticks"] < 50
    assert summary["trace_conforms"] and (tmp_path / "summary.json").exists()


def test_a_run_stopped_by_an_error_writes_its_files_and_names_the_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error at tick 3 (the collector died, a CUDA error): the trace, the log and
    a summary naming the error are written, over an earlier run's, and the error
    is raised. Before, nothing was written, and the earlier run's summary.json
    stayed, looking current."""
    from replay_fsm.demo.learner import Learner
    from replay_fsm.errors import CollectorDied

    (tmp_path / "summary.json").write_text('{"ticks": 300, "interrupted": false}\n')
    calls = [0]
    step = Learner.step

    def failing(self: Learner, *args: object) -> float:
        calls[0] += 1
        if calls[0] == 4:
            raise CollectorDied("tick 3: injected")
        return step(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(Learner, "step", failing)
    from replay_fsm.demo import runner
    ended: list[bool] = []
    end_worker = runner.end_worker

    def recorded(worker: object, join_s: float, *, hung: bool = False) -> None:
        ended.append(hung)
        end_worker(worker, join_s, hung=hung)

    monkeypatch.setattr(runner, "end_worker", recorded)
    with pytest.raises(CollectorDied, match="injected") as info:
        run(DemoConfig(ticks=20, collector="thread", out=tmp_path, sample_count=256,
                       capacity=10_000, envs=32, progress=False))
    # A collector found dead is not waited for (a process: SIGKILLed at once; it was
    # joined for 30 s first, which a stopped one never leaves).
    assert ended == [True]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert info.value.summary == summary  # type: ignore[attr-defined]
    assert summary["error"] == "CollectorDied: tick 3: injected"
    assert summary["interrupted"] and summary["interrupted_in"] is None
    assert summary["ticks"] == 3 and summary["compare"] == {}
    assert summary["trace_conforms"]  # the failure's transitions follow the table
    assert (tmp_path / "transitions.jsonl").stat().st_size > 0
    assert (tmp_path / "trace.json").exists()
    assert "3 (stopped by an error)" in format_summary(summary, tmp_path)


def test_a_failed_runs_error_keeps_its_cause_and_is_kept_by_what_follows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's own error is raised with its cause (PipelineFailed's is the original
    error) when its files cannot be written, the write's error as its context; a
    second Ctrl-C while the collector is stopped keeps the run's error as its own
    context. Before, the cause was dropped (``from None``), and the Ctrl-C lost the
    error, which it had kept when the error was still propagating."""
    from replay_fsm.demo import runner
    from replay_fsm.demo.learner import Learner
    from replay_fsm.errors import PipelineFailed

    cause = ValueError("the original error")

    def failing(self: Learner, *args: object) -> float:
        raise PipelineFailed("injected") from cause

    def full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Learner, "step", failing)
    monkeypatch.setattr(runner, "_write_files", full)
    config = DemoConfig(ticks=5, collector="thread", out=tmp_path, sample_count=256,
                        capacity=10_000, envs=32, progress=False)
    with pytest.raises(PipelineFailed) as info:
        run(config)
    assert info.value.__cause__ is cause
    assert isinstance(info.value.__context__, OSError)
    monkeypatch.undo()
    monkeypatch.setattr(Learner, "step", failing)
    stop = runner._stop_collector

    def interrupted_stop(*args: object, **kwargs: object) -> None:
        stop(*args, **kwargs)  # type: ignore[arg-type]
        raise KeyboardInterrupt  # a second Ctrl-C, as the collector is joined

    monkeypatch.setattr(runner, "_stop_collector", interrupted_stop)
    with pytest.raises(KeyboardInterrupt) as stopped:
        run(config)
    assert isinstance(stopped.value.__context__, PipelineFailed)
    assert stopped.value.__context__.__cause__ is cause


def test_the_cli_shows_a_failed_runs_summary_then_its_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Where its files are and what it did, on stdout; the error in one line on
    stderr, exit 2. Before, the error alone: nothing said files were written."""
    from replay_fsm.cli import main
    from replay_fsm.demo.learner import Learner
    from replay_fsm.errors import CollectorDied

    def failing(self: Learner, *args: object) -> float:
        raise CollectorDied("tick 0: injected")

    monkeypatch.setattr(Learner, "step", failing)
    code = main(["demo", "--ticks", "5", "--collector", "thread", "--sample-count", "256",
                 "--out", str(tmp_path), "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 2 and err == "replay-fsm demo: error: tick 0: injected\n"
    assert "0 (stopped by an error)" in out and f"{tmp_path}/trace.json" in out


def test_a_stop_signal_while_the_pipeline_is_made_still_writes_the_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C or SIGTERM (under the CLI's handlers) while run() makes its buffer and
    pipeline waits for them, then stops the run at its first instruction: the files
    are written, as the README says. Before, the interrupt left run() with none."""
    from replay_fsm.demo import runner
    from replay_fsm.signals import sigterm_as_interrupt

    made = runner.Pipeline

    def signalled(*args: object, **kwargs: object) -> object:
        os.kill(os.getpid(), signal.SIGTERM)  # lands inside the constructor
        return made(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(runner, "Pipeline", signalled)
    try:
        with sigterm_as_interrupt() as terms:
            summary = run(DemoConfig(ticks=5, collector="thread", out=tmp_path,
                                     sample_count=256, capacity=10_000, envs=32,
                                     progress=False))
    except KeyboardInterrupt as exc:  # not on to pytest, which would stop the session
        pytest.fail(f"the stop left run() before it wrote its files: {exc!r}")
    assert terms == [signal.SIGTERM]
    assert summary["interrupted_in"] == "run" and summary["ticks"] == 0
    assert summary["error"] is None and summary["trace_conforms"]
    for name in ("trace.json", "transitions.jsonl", "summary.json"):
        assert (tmp_path / name).exists(), name


def test_a_stop_signal_while_the_files_are_written_waits_for_the_last_of_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM (or Ctrl-C) under the CLI's handlers as the trace is written: the run's
    other files are written too, then the stop goes on. Before, it left this run's
    trace beside an earlier run's transition log and summary (helper-54), and the CLI
    showed no summary."""
    from replay_fsm.runtime.tracer import Tracer
    from replay_fsm.signals import sigterm_as_interrupt

    (tmp_path / "summary.json").write_text('{"ticks": -1}\n')  # an earlier run's
    write_chrome = Tracer.write_chrome

    def signalled(self: Tracer, *args: object, **kwargs: object) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # lands as trace.json is written
        write_chrome(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Tracer, "write_chrome", signalled)
    with sigterm_as_interrupt() as terms:
        with pytest.raises(KeyboardInterrupt) as info:  # by run(), not by what follows
            run(DemoConfig(ticks=5, collector="thread", out=tmp_path, sample_count=256,
                           capacity=10_000, envs=32, progress=False))
    assert terms == [signal.SIGTERM] and info.value.summary["ticks"] == 5
    assert json.loads((tmp_path / "summary.json").read_text())["ticks"] == 5
    assert check(load(tmp_path / "transitions.jsonl")).ok


def test_an_out_folder_no_file_can_be_made_in_fails_before_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only mount: the run went to its end, then failed to write its files
    (helper-54). Now it fails before the collector starts, naming the folder."""
    import errno

    from replay_fsm import files
    from replay_fsm.demo import runner

    def read_only(*args: object, dir: str, **kwargs: object) -> None:  # noqa: A002
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.path.join(dir, "tmp1"))

    def never(*args: object) -> None:
        raise AssertionError("the run started")

    monkeypatch.setattr(files.tempfile, "TemporaryFile", read_only)
    monkeypatch.setattr(runner, "_make_collector", never)
    with pytest.raises(OSError) as info:
        run(DemoConfig(ticks=5, collector="thread", out=tmp_path / "out", progress=False))
    assert info.value.errno == errno.EROFS
    assert info.value.filename == str(tmp_path / "out")


@pytest.mark.slow
def test_a_failure_before_the_first_tick_still_ends_the_collector_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The collector process ignores SIGTERM: one left running would hang the
    interpreter's exit (multiprocessing terminates, then joins without a timeout).
    Whatever stops run() once it has started (here the learner's creation), the
    collector is ended."""
    import multiprocessing as mp

    from replay_fsm.demo import Learner

    def create(*args: object) -> Learner:
        raise RuntimeError("CUDA out of memory (injected)")

    before = set(mp.active_children())
    monkeypatch.setattr(Learner, "create", create)
    with pytest.raises(RuntimeError, match="injected"):
        run(DemoConfig(ticks=5, collector="process", out=tmp_path, sample_count=256,
                       capacity=10_000, envs=32, progress=False))
    assert set(mp.active_children()) - before == set()


@pytest.mark.slow
def test_a_collector_that_does_not_leave_is_killed_even_when_close_is_interrupted(
        ) -> None:
    """A second Ctrl-C inside the pipeline's close: the collector is still joined,
    then SIGKILLed when it does not leave, and the Ctrl-C goes on to the caller."""
    import multiprocessing as mp
    import threading

    from replay_fsm.demo.runner import _stop_collector
    from replay_fsm.signals import STOP_SIGNALS, start_ignoring
    from tests.collectors import deaf_until_killed

    class Pipe:
        def close(self) -> None:
            raise KeyboardInterrupt  # the second Ctrl-C

    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    deaf = ctx.Process(target=deaf_until_killed, args=(ready,), daemon=True)
    start_ignoring(deaf, STOP_SIGNALS)
    assert ready.wait(120)
    stop = threading.Event()
    with pytest.raises(KeyboardInterrupt):
        _stop_collector(Pipe(), stop, deaf, join_s=0.1)  # type: ignore[arg-type]
    assert stop.is_set() and not deaf.is_alive() and deaf.exitcode == -9


def test_the_demo_collector_process_gathers_on_one_torch_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's default team (a thread per core) spans the learner's core: the
    collector's gathers waited on it, and the pipelined stall per tick was above
    synchronous sampling's (1.25-2.61 ms against 0.99-1.25 ms on 2 cores)."""
    import torch

    from replay_fsm.demo import collector
    from replay_fsm.signals import STOP_SIGNALS

    seen: list[int] = []
    monkeypatch.setattr(collector, "collect",
                        lambda *args: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads(), [signal.getsignal(s) for s in STOP_SIGNALS]
    torch.set_num_threads(2)
    try:
        collector.collect_process(None, None, 1, 0)  # type: ignore[arg-type]
    finally:
        torch.set_num_threads(before[0])
        for signum, handler in zip(STOP_SIGNALS, before[1], strict=True):
            signal.signal(signum, handler)
    assert seen == [1]


def test_the_mean_tick_leaves_out_the_first_ticks_warm_up_even_in_a_short_run() -> None:
    """A run of fewer than 10 ticks counted tick 0 (its wait for warm-up data, or in
    SAC the collector's start-up: a 3-tick run's mean was 50 times its steady one)."""
    from replay_fsm.runtime.observers import steady_ticks

    assert steady_ticks([9.0, 1.0, 2.0]) == [1.0, 2.0]
    assert steady_ticks([9.0]) == [9.0]  # all there is
    assert steady_ticks([]) == []
    assert steady_ticks([float(t) for t in range(30)])[0] == 3.0  # the first tenth


def test_the_demo_pipeline_takes_the_configs_liveness_timeout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DemoConfig.liveness_timeout reaches the pipeline (it was 30 s written in), and
    a bad one is refused when the config is made."""
    from replay_fsm.demo import runner

    made: list[float] = []
    pipeline = runner.Pipeline

    def recorded(*args: object, **kwargs: object) -> object:
        made.append(kwargs["liveness_timeout"])  # type: ignore[arg-type]
        return pipeline(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(runner, "Pipeline", recorded)
    run(DemoConfig(ticks=4, collector="thread", out=tmp_path, sample_count=256,
                   capacity=10_000, envs=32, progress=False, liveness_timeout=7.5))
    assert made == [7.5]
    with pytest.raises(ValueError, match="liveness_timeout must be a finite number"):
        DemoConfig(liveness_timeout=0)


def test_the_configs_bounds_are_kept_as_floats() -> None:
    """A peer_timeout or liveness_timeout read as a Decimal was refused ("must be a
    finite number of seconds > 0, got Decimal('5')"); one of numpy's was taken, then
    kept as it was, and a rank makes its process group with
    timedelta(seconds=peer_timeout), which refuses it ("unsupported type for timedelta
    seconds component: numpy.float32")."""
    import datetime
    from decimal import Decimal

    import numpy as np

    for value in (Decimal("5"), np.float32(5.0), np.int64(5)):
        config = DemoConfig(peer_timeout=value, liveness_timeout=value)
        for seconds in (config.peer_timeout, config.liveness_timeout):
            assert type(seconds) is float and seconds == 5.0
        assert datetime.timedelta(seconds=config.for_rank(1, 7, "cpu").peer_timeout)
    with pytest.raises(ValueError, match=r"peer_timeout must be at most 1e\+09 s .*got "
                                         r"Decimal\('1E\+10'\)$"):
        DemoConfig(peer_timeout=Decimal("1e10"))


def test_rows_that_stop_coming_fail_the_run_after_its_liveness_timeout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--liveness-timeout bounds the wait for rows that stopped coming too (README,
    DemoConfig): a collector whose environment stalls before the warm-up rows are
    there for 5 s was waited out (the pipeline's default stall_timeout is 60 s). The
    error names the config's fields to change, not the pipeline's stall_timeout and
    min_snapshot_ptr (helper-104); nor the command line's --liveness-timeout, which a
    DemoConfig's user did not type (the CLI writes its options: test_cli). The
    environment hangs until the run ends its collector (not for a fixed 5 s, which a
    loaded machine's looks might not have covered for 1 s of the bound)."""
    from replay_fsm.errors import DataStalled

    from .support import stall_the_warm_ups

    stall_the_warm_ups(monkeypatch)
    with pytest.raises(DataStalled, match=r"^tick 0 waits for 32768 rows \(the warm-up, 4 x "
                       r"sample_count\); the replay buffer has had \d+ for \d+\.\d s "
                       r"\(liveness_timeout\): "):
        run(DemoConfig(ticks=3, collector="thread", liveness_timeout=1.0,
                       out=str(tmp_path), progress=False))


@pytest.mark.parametrize("fields,error,said", [
    ({"seed": -1}, ValueError, "seed must be an int >= 0, got -1"),
    ({"seed": True}, TypeError, "seed must be an int (or numpy integer) >= 0, got True"),
    ({"seed": 2**63}, ValueError, "seed must be an int in [0, 2**63)"),
    ({"base_seed": -5}, ValueError, "base_seed must be an int >= 0, got -5")])
def test_a_seed_out_of_range_is_refused_when_the_config_is_made(
        fields: dict[str, object], error: type[Exception], said: str) -> None:
    """A seed the pipeline refuses is refused by the config, naming the field the user
    set: DemoConfig(seed=-1) was taken, and the run failed once started, naming
    base_seed (helper-122)."""
    with pytest.raises(error) as info:
        DemoConfig(**fields)  # type: ignore[arg-type]
    assert str(info.value).startswith(said), info.value


def test_the_configs_counts_take_numpy_integers_as_plain_ints_and_no_bool() -> None:
    """A count read from numpy (np.int64(5) ticks) was refused ("ticks must be an int
    >= 1, got np.int64(5)") where SACConfig takes it; a numpy ring_depth was taken and
    kept as it was, and the run's summary.json holds it ("Object of type int64 is not
    JSON serializable"). Each is kept as a plain int, as SACConfig keeps its own; a
    bool is still refused."""
    import dataclasses

    import numpy as np

    counts = {"ticks": 5, "sample_count": 64, "capacity": 1000, "envs": 2,
              "learner_threads": 1, "ring_depth": 3, "seed": 4, "rank": 1, "base_seed": 9,
              "collect_steps": 6, "kill_collector_at": 2, "freeze_collector_at": 3,
              "freeze_at": 4, "interrupt_at": 1}
    config = DemoConfig(**{name: np.int64(value) for name, value in counts.items()})
    kept = {name: getattr(config, name) for name in counts}
    assert kept == counts and {type(value) for value in kept.values()} == {int}
    json.dumps({**dataclasses.asdict(config), "out": str(config.out)})
    for name in ("ticks", "sample_count", "capacity", "envs"):
        with pytest.raises(ValueError, match=f"^{name} must be an int >= 1, got True$"):
            DemoConfig(**{name: True})
        with pytest.raises(ValueError, match=f"^{name} must be an int >= 1, got 2.0$"):
            DemoConfig(**{name: 2.0})
    with pytest.raises(ValueError, match="^learner_threads must be None or an int >= 1, "
                                         "got True$"):
        DemoConfig(learner_threads=True)
    with pytest.raises(TypeError, match="^ring_depth must be an int"):
        DemoConfig(ring_depth=True)
