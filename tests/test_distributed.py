"""One pipeline per rank under torch.distributed (gloo on CPU)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from replay_fsm.demo import DemoConfig
from replay_fsm.distributed import (
    MAX_RANKS,
    RANK_ENV,
    RANK_SEED_STRIDE,
    launch,
    local_device,
    main,
    rank_seed,
)
from replay_fsm.signals import Interrupted


def test_rank_seed_formula_and_device_choice() -> None:
    assert rank_seed(7, 0) == 7 and rank_seed(7, 3) == 7 + 3 * RANK_SEED_STRIDE
    with pytest.raises(ValueError):
        rank_seed(0, -1)
    assert rank_seed(0, MAX_RANKS - 1) == (MAX_RANKS - 1) * RANK_SEED_STRIDE < 2**32
    with pytest.raises(ValueError, match="rank 256 would draw rank 0's batches"):
        rank_seed(0, MAX_RANKS)  # its seed is rank 0's modulo 2**32
    if not torch.cuda.is_available():
        assert local_device(1) == torch.device("cpu")
        with pytest.raises(ValueError, match="CUDA"):
            local_device(0, "cuda")


@pytest.fixture(autouse=True)
def temp_folder_of_its_own(tmp_path_factory: pytest.TempPathFactory,
                           monkeypatch: pytest.MonkeyPatch) -> Path:
    """torch.multiprocessing writes a pytorch-errorfile-*.pickle into the temp folder
    for each rank that fails (these tests make ranks fail) and never removes it: here,
    in and out of process, the temp folder is one of pytest's, which pytest prunes."""
    folder = tmp_path_factory.mktemp("temp")
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    monkeypatch.setenv("TMPDIR", str(folder))
    return folder


def test_a_rank_started_without_torchrun_says_so(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for name in RANK_ENV:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as info:
        main(["--ticks", "5"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set: this is one " \
        "rank of a run that torchrun starts" in err and "Traceback" not in err


def options(out: Path, **extra: object) -> DemoConfig:
    return DemoConfig(**{"ticks": 8, "device": "cpu", "out": str(out), "sample_count": 256,
                         "capacity": 20_000, "envs": 32, "collect_steps": 40,
                         "verify_data": True, "seed": 5, **extra})  # type: ignore[arg-type]


@pytest.mark.slow
def test_two_ranks_draw_different_reproducible_batches(tmp_path: Path) -> None:
    temp = Path(tempfile.gettempdir())
    before = set(temp.glob("torchelastic_*"))
    results = launch(2, options(tmp_path))
    # the launcher's logs are the run's, not new folders left in the temp folder
    assert (tmp_path / "launcher-logs").is_dir()
    assert set(temp.glob("torchelastic_*")) <= before
    s0, s1 = results[0], results[1]
    assert (s0["rank"], s1["rank"]) == (0, 1)
    assert s0["base_seed"] == rank_seed(5, 0) and s1["base_seed"] == rank_seed(5, 1)
    # every batch of each rank checked bit for bit against its own seed (INV-DATA)
    assert s0["data_verified_ticks"] == s1["data_verified_ticks"] == 8
    assert s0["batch_fingerprint"] != s1["batch_fingerprint"]
    for rank in (0, 1):
        saved = json.loads((tmp_path / f"summary-rank{rank}.json").read_text())
        assert saved["rank"] == rank
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    names = {e["args"]["name"] for e in trace if e["name"] == "process_name"}
    assert {"rank 0 slots", "rank 1 slots", "rank 0 actors", "rank 1 actors"} <= names
    assert len({e["pid"] for e in trace}) == 4


@pytest.mark.slow
def test_a_rank_whose_collector_dies_ends_the_job(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(Exception) as info:
        launch(2, options(tmp_path, ticks=40, kill_collector_at=3, verify_data=False),
               kill_rank=1)
    assert "ChildFailedError" in type(info.value).__name__
    assert time.monotonic() - t0 < 120  # the other rank did not hang
    failed = json.loads((tmp_path / "summary-rank1.json").read_text())
    assert failed["rank"] == 1 and failed["error"].startswith("CollectorDied")


LAUNCH_AND_REPORT = """
import sys
from replay_fsm.demo import DemoConfig
from replay_fsm.distributed import launch
from replay_fsm.signals import exit_code
if __name__ == "__main__":
    config = DemoConfig(ticks=400, device="cpu", out=sys.argv[1], sample_count=256,
                        capacity=20_000, envs=32, seed=5, progress=False,
                        interrupt_at=int(sys.argv[2]), interrupt_signal=int(sys.argv[3]))
    try:
        launch(2, config, kill_rank=1)
    except KeyboardInterrupt as exc:
        print(f"launch raised KeyboardInterrupt, exit code {exit_code(exc)}")
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tick, signum", [
    (0, signal.SIGINT),  # in the warm-up's wait for rows
    (3, signal.SIGINT),
    (3, signal.SIGTERM),  # a batch scheduler's stop (SLURM, systemd: the whole group)
])
def test_ctrl_c_on_the_launcher_stops_every_rank_at_the_same_step(
        tmp_path: Path, tick: int, signum: int) -> None:
    """At ``tick`` rank 1 sends SIGINT to the whole process group, as a terminal's
    Ctrl-C does (or SIGTERM, as a batch scheduler does): the launcher, both ranks
    and their collector processes get it. The ranks stop at the same step's
    all-reduce (none is left waiting in a collective), write their summaries as an
    interrupted single-process run does and exit on their own: the launcher never
    has to kill one (it would, after 30 s). On Ctrl-C the collectors carry on (a
    rank waiting for rows must not see its collector die). launch() raises a
    KeyboardInterrupt that names the signal's exit code."""
    script = tmp_path / "launch_and_report.py"
    script.write_text(LAUNCH_AND_REPORT)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "out"), str(tick),
                          str(int(signum))],
                         capture_output=True, text=True, timeout=280,
                         start_new_session=True)  # the group it signals is its own
    assert f"launch raised KeyboardInterrupt, exit code {128 + signum}" in out.stdout, (
        out.stdout + out.stderr)
    assert "forcefully exiting" not in out.stderr, out.stderr
    saved = [json.loads((tmp_path / "out" / f"summary-rank{rank}.json").read_text())
             for rank in (0, 1)]
    assert all(s["interrupted"] for s in saved)
    assert tick <= saved[0]["ticks"] == saved[1]["ticks"] < 400  # the same step
    trace = json.loads((tmp_path / "out" / "trace.json").read_text())["traceEvents"]
    assert len({e["pid"] for e in trace}) == 4  # both ranks' tracks, merged


def test_a_launch_stopped_by_ctrl_c_or_sigterm_raises_keyboard_interrupt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher turns its own SIGINT or SIGTERM into SignalException once it has
    stopped the ranks; launch() makes that the interrupt it is, naming the signal
    (the CLI exits 130 or 143), and merges the ranks' traces all the same. Another
    signal stays the launcher's error."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.launcher import api

    def stopped_by(sig: signal.Signals):  # type: ignore[no-untyped-def]
        def elastic_launch(config, entrypoint):  # type: ignore[no-untyped-def]
            def run(*args):  # type: ignore[no-untyped-def]
                raise SignalException(f"Process 1 got signal: {sig}", sigval=sig)
            return run
        return elastic_launch

    for signum in (signal.SIGINT, signal.SIGTERM):
        monkeypatch.setattr(api, "elastic_launch", stopped_by(signum))
        with pytest.raises(Interrupted) as info:
            launch(2, options(tmp_path))
        assert info.value.signum == signum
        assert isinstance(info.value.__cause__, SignalException)
        assert (tmp_path / "trace.json").is_file()  # merged, from what the ranks wrote
        (tmp_path / "trace.json").unlink()
    monkeypatch.setattr(api, "elastic_launch", stopped_by(signal.SIGHUP))
    with pytest.raises(SignalException):
        launch(2, options(tmp_path))
