"""One pipeline per rank under torch.distributed (gloo on CPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from replay_fsm.demo import DemoConfig
from replay_fsm.distributed import (
    MAX_RANKS,
    RANK_ENV,
    RANK_SEED_STRIDE,
    RankFailed,
    launch,
    local_device,
    main,
    rank_seed,
)
from replay_fsm.signals import Interrupted

from .support import MARGIN_S


def test_rank_seed_formula_and_device_choice() -> None:
    assert rank_seed(7, 0) == 7 and rank_seed(7, 3) == 7 + 3 * RANK_SEED_STRIDE
    with pytest.raises(ValueError):
        rank_seed(0, -1)
    assert rank_seed(0, MAX_RANKS - 1) == (MAX_RANKS - 1) * RANK_SEED_STRIDE < 2**32
    with pytest.raises(ValueError, match="rank 256 would draw rank 0's batches"):
        rank_seed(0, MAX_RANKS)  # its seed is rank 0's modulo 2**32
    with pytest.raises(ValueError, match="rank must be an int >= 0, got -1"):
        rank_seed(0, -1)
    for rank in (1.7, True, "3"):  # 1.7 and True drew rank 1's seed before
        with pytest.raises(TypeError, match="rank must be an int"):
            rank_seed(0, rank)  # type: ignore[arg-type]
    assert rank_seed(0, np.int64(2)) == 2 * RANK_SEED_STRIDE
    with pytest.raises(ValueError, match="base_seed must be an int"):
        rank_seed(-5, 3)  # was 50331643, while rank 0's -5 is refused by Pipeline
    assert rank_seed(2**63 - 1 - RANK_SEED_STRIDE, 1) == 2**63 - 1
    with pytest.raises(ValueError, match="too large for rank 1: .* is 2..63 or more"):
        rank_seed(2**63 - RANK_SEED_STRIDE, 1)
    if not torch.cuda.is_available():
        assert local_device(1) == torch.device("cpu")
        for device in ("cuda", "cuda:1", "mps"):  # the library's one wording
            with pytest.raises(ValueError, match=f"^device '{device}' is not available "
                                                 "on this machine; supported here: cpu$"):
                local_device(0, device)


def test_misuse_outside_a_rank_is_named(monkeypatch: pytest.MonkeyPatch,
                                        tmp_path: Path) -> None:
    """rank_main outside torchrun raised KeyError: 'RANK'; local_device(-1) gave the
    CPU; a launch stopped before any rank wrote its trace left an empty trace.json."""
    from replay_fsm.distributed import RANK_ENV, merge_traces, rank_main
    for name in RANK_ENV:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="^RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, "
                                           "MASTER_PORT not set: rank_main is the body"):
        rank_main(options(tmp_path))
    with pytest.raises(ValueError, match="local_rank must be an int >= 0, got -1"):
        local_device(-1)
    assert merge_traces(tmp_path, 2) is None and not (tmp_path / "trace.json").exists()


def test_ranks_start_one_network_and_collect_their_own_experience() -> None:
    """Data-parallel: every rank's learner starts from the same parameters (averaged
    gradients then keep them equal); each rank's environments and batches are its
    own."""
    from replay_fsm.demo.learner import Learner
    config = DemoConfig(seed=5)
    ranks = [config.for_rank(r, rank_seed(config.batch_seed, r), "cpu") for r in range(3)]
    assert len({r.collector_seed for r in ranks}) == 3
    assert len({r.batch_seed for r in ranks}) == 3
    learners = [Learner.create(torch.device("cpu"), r.seed) for r in ranks]
    for other in learners[1:]:
        for a, b in zip(learners[0].critic.parameters(), other.critic.parameters(),
                        strict=True):
            assert torch.equal(a, b)
        assert torch.equal(learners[0].policy, other.policy)


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


def test_a_torchrun_rank_that_fails_records_its_error_for_torchrun(tmp_path: Path) -> None:
    """torchrun's report of a failed rank read "error_file: <N/A>": the module's main
    was not wrapped in torch's ``record``, which writes the error where torchrun
    reads it (TORCHELASTIC_ERROR_FILE). A one-rank world, failing as it starts (its
    --out a file: before the rendezvous now, as it should, and still recorded)."""
    import socket

    (tmp_path / "a-file").write_text("")
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               TORCHELASTIC_ERROR_FILE=str(tmp_path / "error.json"))
    done = subprocess.run([sys.executable, "-m", "replay_fsm.distributed", "--ticks", "1",
                           "--device", "cpu", "--out", str(tmp_path / "a-file")],
                          capture_output=True, text=True, timeout=MARGIN_S * 4, env=env)
    assert done.returncode == 1, done.stderr
    recorded = json.loads((tmp_path / "error.json").read_text())["message"]["message"]
    assert recorded == (f"NotADirectoryError: {tmp_path / 'a-file'} is a file; --out "
                        "names the output folder"), recorded


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


@pytest.mark.parametrize("env, argv, message", [
    ({}, ["--ticks", "-3"], "--ticks must be an int >= 1, got -3"),
    ({"RANK": "x"}, [], "RANK must be an int >= 0, got 'x'"),
    ({"RANK": "1", "WORLD_SIZE": "1"}, [], "RANK 1 is not in [0, WORLD_SIZE 1)"),  # hung
    ({"RANK": "256", "WORLD_SIZE": "300"}, [], "rank must be in [0, 256), got 256"),
    ({}, ["--sample-count", "0"], "--sample-count must be"),
    ({}, ["--device", "bogus"], "bogus"),
    ({}, ["--ring-depth", "1"], "--ring-depth must be"),
    ({}, ["--peer-timeout", "1e10"], "--peer-timeout must be at most"),
    ({}, ["--learner-threads", "-1"], "--learner-threads must be >= 0"),
    ({}, ["--out", ""], "--out '' names no folder; write --out . for the current folder"),
] + ([] if torch.cuda.is_available() else [
    ({}, ["--device", "cuda"], "device 'cuda' is not available on this machine")]))
def test_a_rank_with_wrong_input_says_so_in_one_line_before_its_rendezvous(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        env: dict[str, str], argv: list[str], message: str) -> None:
    """Each of these was a traceback (or, for a rank past the world, a rendezvous that
    waited for ever); a usage error names the input and exits 2."""
    as_rank_0(monkeypatch, 1, **env)
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def as_rank_0(monkeypatch: pytest.MonkeyPatch, world_size: int, **env: str) -> None:
    """Give this process the environment torchrun gives rank 0 of ``world_size``
    (``env`` set over it)."""
    given = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world_size),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", **env}
    for name, value in given.items():
        monkeypatch.setenv(name, value)


def rendezvous_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process is rank 0 of 2 under torchrun, and its rendezvous runs out of
    time (a peer that never came), with no network used."""
    import torch.distributed as dist

    as_rank_0(monkeypatch, 2)

    def store_timeout(*args: object, **kwargs: object) -> None:
        raise dist.DistStoreError("wait timeout after 5000ms, keys: /default_pg/0//cpu//0/1")

    monkeypatch.setattr(dist, "init_process_group", store_timeout)


def test_a_torchrun_rank_takes_the_demos_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun the rank took only --ticks, --device, --out and --sample-count:
    a multi-node run could not set the peer timeout the README describes, nor the
    ring depth, the liveness timeout or the learner's threads."""
    import replay_fsm.distributed as distributed

    as_rank_0(monkeypatch, 1)
    seen: list[DemoConfig] = []
    monkeypatch.setattr(distributed, "rank_main",
                        lambda config: seen.append(config) or {"interrupted": False})
    assert main(["--ticks", "7", "--device", "cpu", "--ring-depth", "3", "--peer-timeout",
                 "5", "--liveness-timeout", "9", "--learner-threads", "0"]) == 0
    (config,) = seen
    assert (config.ticks, config.ring_depth, config.peer_timeout, config.liveness_timeout,
            config.learner_threads) == (7, 3, 5.0, 9.0, None)


def test_a_launch_that_cannot_run_is_refused_before_any_rank_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.launcher import api

    def never(*args: object) -> None:
        raise AssertionError("ranks started")

    monkeypatch.setattr(api, "elastic_launch", never)
    with pytest.raises(ValueError, match=r"nproc must be in \[1, 256\], got 300"):
        launch(300, options(tmp_path))  # 300 ranks started before ranks 256+ failed
    with pytest.raises(ValueError, match="too large for rank 1"):
        launch(2, options(tmp_path, seed=2**63 - 2))
    with pytest.raises(ValueError, match="too large for rank 1"):  # the batches' own
        launch(2, options(tmp_path, base_seed=2**63 - 2))  # seed: it was not checked
    for nproc in (True, 2.5, "2"):  # True started one rank; 2.5 named a rank of 1.5
        with pytest.raises(TypeError, match="nproc must be an int"):
            launch(nproc, options(tmp_path))  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        for device in ("cuda", "cuda:0", "cuda:1"):  # cuda:0 started the ranks
            with pytest.raises(ValueError, match="is not available on this machine"):
                launch(2, options(tmp_path, device=device))
    (tmp_path / "a-file").write_text("")
    with pytest.raises(NotADirectoryError, match="a-file is a file; --out names the "
                       "output folder"):  # was mkdir's "[Errno 17] File exists"
        launch(2, options(tmp_path / "a-file"))
    for depth in (1, 65):  # each rank's pipeline refused it, 15 s and 40 lines later
        with pytest.raises(ValueError, match="ring_depth must be"):
            options(tmp_path, ring_depth=depth)
    for seconds in (1e10, 1e15):  # every rank failed once started (helper-78): torch's
        with pytest.raises(ValueError, match="peer_timeout must be at most"):  # ns
            options(tmp_path, peer_timeout=seconds)
    assert options(tmp_path, peer_timeout=1e9).peer_timeout == 1e9


def test_ranks_that_would_share_a_gpu_are_refused_before_any_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a node with two GPUs (made up here): a third rank wrapped round to cuda:0,
    and --device cuda:1 put every rank on cuda:1, for nccl to refuse in every rank."""
    from torch.distributed.launcher import api

    def never(*args: object) -> None:
        raise AssertionError("ranks started")

    monkeypatch.setattr(api, "elastic_launch", never)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [local_device(rank, "cuda") for rank in (0, 1)] == [
        torch.device("cuda", 0), torch.device("cuda", 1)]
    assert local_device(5, "cuda:1") == torch.device("cuda", 1)  # asked for: as given
    for device in ("cuda", "auto"):
        with pytest.raises(ValueError, match="3 ranks on 2 GPUs: nccl needs one per rank"):
            launch(3, options(tmp_path, device=device))
    with pytest.raises(ValueError, match="'cuda:1' would put all 2 ranks on one GPU"):
        launch(2, options(tmp_path, device="cuda:1"))
    # A scheduler that shows each rank its own GPU: every rank's is its cuda:0 (not a
    # refusal: helper-47).
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert local_device(3, "cuda") == torch.device("cuda", 0)


def test_the_launcher_logs_of_a_launch_keep_only_folders_with_a_file(tmp_path: Path
                                                                      ) -> None:
    """torch's launcher makes <run_id>_<random>/attempt_0/<rank>/ at every launch,
    with an error.json only for a rank that failed: the empty ones are removed, the
    other launches' folders are left alone."""
    from replay_fsm.distributed import prune_launcher_logs

    logs = tmp_path / "launcher-logs"
    for rank in (0, 1):
        (logs / "replay_fsm-aa_x1" / "attempt_0" / str(rank)).mkdir(parents=True)
        (logs / "replay_fsm-bb_y2" / "attempt_0" / str(rank)).mkdir(parents=True)
    (logs / "replay_fsm-bb_y2" / "attempt_0" / "1" / "error.json").write_text("{}")
    (logs / "replay_fsm-cc_z3").mkdir()  # another launch's
    prune_launcher_logs(logs, "replay_fsm-aa")
    prune_launcher_logs(logs, "replay_fsm-bb")
    left = sorted(str(p.relative_to(logs)) for p in logs.rglob("*"))
    assert left == ["replay_fsm-bb_y2", "replay_fsm-bb_y2/attempt_0",
                    "replay_fsm-bb_y2/attempt_0/1", "replay_fsm-bb_y2/attempt_0/1/error.json",
                    "replay_fsm-cc_z3"]
    prune_launcher_logs(tmp_path / "none", "replay_fsm-dd")  # no folder: nothing to do
    (logs / "replay_fsm-cc_z3").rmdir()
    for path in sorted(logs.rglob("error.json")):
        path.unlink()
    prune_launcher_logs(logs, "replay_fsm-bb")
    assert not logs.exists()  # emptied: removed too


def test_a_launch_prunes_the_launcher_logs_of_launchers_that_are_gone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A launcher killed (SIGKILL) never pruned its folders there, and each launch in
    the same folder added one per rank for ever. The next launch prunes those of
    launchers that are gone, judged by their lock file (flock: the kernel lets it go
    when the process ends), not by age: a launch still running, and folders with no
    lock file (a launcher from before the locks), are left alone."""
    import subprocess
    import sys

    from torch.distributed.launcher import api

    from replay_fsm.distributed import launch_lock, prune_gone_launches

    out = tmp_path / "out"
    logs = out / "launcher-logs"
    killed = """if True:
        import os, signal, sys
        from pathlib import Path
        from replay_fsm.distributed import launch_lock
        logs = Path(sys.argv[1])
        with launch_lock(logs, "replay_fsm-dead0001"):
            for rank in (0, 1):
                (logs / "replay_fsm-dead0001_q7" / "attempt_0" / str(rank)).mkdir(parents=True)
            (logs / "replay_fsm-dead0001_q7" / "attempt_0" / "1" / "error.json").write_text("{}")
            os.kill(os.getpid(), signal.SIGKILL)
    """
    done = subprocess.run([sys.executable, "-c", killed, str(logs)], timeout=120)
    assert done.returncode == -9
    assert (logs / "replay_fsm-dead0001.lock").exists()  # what a killed launcher left
    (logs / "replay_fsm-old00002_r8" / "attempt_0" / "0").mkdir(parents=True)  # no lock
    with launch_lock(logs, "replay_fsm-live0003") as held:
        (logs / "replay_fsm-live0003_s9" / "attempt_0" / "0").mkdir(parents=True)
        assert prune_gone_launches(logs) == ["replay_fsm-dead0001"]
        left = sorted(str(p.relative_to(logs)) for p in logs.rglob("*"))
        assert left == ["replay_fsm-dead0001_q7", "replay_fsm-dead0001_q7/attempt_0",
                        "replay_fsm-dead0001_q7/attempt_0/1",
                        "replay_fsm-dead0001_q7/attempt_0/1/error.json",
                        "replay_fsm-live0003.lock", "replay_fsm-live0003_s9",
                        "replay_fsm-live0003_s9/attempt_0", "replay_fsm-live0003_s9/attempt_0/0",
                        "replay_fsm-old00002_r8", "replay_fsm-old00002_r8/attempt_0",
                        "replay_fsm-old00002_r8/attempt_0/0"]
        assert held == logs / "replay_fsm-live0003.lock"
    assert not held.exists()  # its launcher ended: its lock file goes with it
    # The live launch's folders are now a gone launcher's too, as a SIGKILL leaves them.
    (logs / "replay_fsm-live0003.lock").write_text("")
    seen: list[list[str]] = []

    def looking(config, entrypoint):  # type: ignore[no-untyped-def]
        def run(*args):  # type: ignore[no-untyped-def]
            seen.append(sorted(p.name for p in logs.iterdir()))  # as the ranks start
            return {0: {"ticks": 8}}
        return run

    monkeypatch.setattr(api, "elastic_launch", looking)
    assert launch(1, options(out)) == {0: {"ticks": 8}}
    (ours,) = [name for name in seen[0] if name.endswith(".lock")]  # held while it ran
    assert seen[0] == sorted(["replay_fsm-dead0001_q7", "replay_fsm-old00002_r8", ours])
    assert sorted(p.name for p in logs.iterdir()) == ["replay_fsm-dead0001_q7",
                                                      "replay_fsm-old00002_r8"]


def test_a_lock_file_pruned_before_its_lock_is_made_again_in_its_folder_made_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch that had made its lock file and not yet locked it looks gone to a
    pruner, which removes the file, and the folder it leaves empty: the launch makes
    both again. Its retry once opened the file in a folder no longer there and the
    launch failed, 'No such file or directory'. With two processes each pruning then
    locking in one folder 20000 times, launch_lock failed 1197 to 1697 times in each,
    in three runs (this race and the next test's), none after."""
    import fcntl

    from replay_fsm.distributed import launch_lock, prune_gone_launches

    logs = tmp_path / "out" / "launcher-logs"
    pruned: list[list[str]] = []
    flock = fcntl.flock

    def pruned_first(fd: int, operation: int) -> None:
        if operation == fcntl.LOCK_EX and not pruned:  # the launch's own, blocking
            pruned.append(prune_gone_launches(logs))  # another launch's, just before
        flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", pruned_first)
    with launch_lock(logs, "replay_fsm-live0001") as held:
        assert pruned == [["replay_fsm-live0001"]]  # the race, as it was
        assert held.exists()
        monkeypatch.setattr(fcntl, "flock", flock)
        assert prune_gone_launches(logs) == []  # held now: left alone
        assert held.exists()
    assert not logs.exists()


def test_a_launcher_logs_folder_removed_as_it_is_made_is_made_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch found the launcher folder there as it made it, and another launch
    ending removed it, emptied, before the first looked whether it was a folder:
    mkdir's 'File exists' ended the launch. It is made again; a file there is still
    refused."""
    from replay_fsm.distributed import launch_lock

    logs = tmp_path / "launcher-logs"
    logs.mkdir()
    mkdir = os.mkdir

    def removed_after(path, *args):  # type: ignore[no-untyped-def]
        try:
            mkdir(path, *args)
        except FileExistsError:
            if Path(path) == logs and not removed:
                removed.append(path)
                logs.rmdir()  # the other launch's end
            raise

    removed: list[object] = []
    monkeypatch.setattr(os, "mkdir", removed_after)
    with launch_lock(logs, "replay_fsm-live0001") as held:
        assert removed and held.exists()
    logs.write_text("")
    with pytest.raises(FileExistsError):
        with launch_lock(logs, "replay_fsm-live0002"):
            pass


def test_a_launcher_logs_folder_removed_while_it_is_listed_leaves_nothing_to_prune(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch that ends removes the launcher folder it empties, which another
    launch's pruning may have found there and not yet read: that launch failed,
    'No such file or directory' (two processes each pruning then locking in one
    folder 20000 times: 165 to 313 times in each, three runs). Nothing there is
    nothing to prune."""
    from replay_fsm.distributed import prune_gone_launches

    logs = tmp_path / "launcher-logs"
    logs.mkdir()
    scandir = os.scandir

    def removed_first(path):  # type: ignore[no-untyped-def]
        if Path(path) == logs and logs.exists():
            logs.rmdir()  # the other launch's end, between the look and the read
        return scandir(path)

    monkeypatch.setattr(os, "scandir", removed_first)
    assert prune_gone_launches(logs) == []
    assert not logs.exists()


def test_a_lock_file_named_by_hand_with_a_wildcard_prunes_no_other_launch(
        tmp_path: Path) -> None:
    """A lock file left by hand, ``replay_fsm-*.lock``, no process holds: its launch
    is gone, and its run id was taken as a pattern, so the launch still running
    beside it lost its ranks' folders (an empty one is what a rank writes its
    error.json into when it fails). Only that run id's folders are pruned."""
    from replay_fsm.distributed import launch_lock, prune_gone_launches

    logs = tmp_path / "launcher-logs"
    with launch_lock(logs, "replay_fsm-live0001"):
        (logs / "replay_fsm-live0001_s9" / "attempt_0" / "0").mkdir(parents=True)
        (logs / "replay_fsm-*.lock").write_text("")
        (logs / "replay_fsm-*_a1" / "attempt_0" / "0").mkdir(parents=True)
        assert prune_gone_launches(logs) == ["replay_fsm-*"]
        assert sorted(str(p.relative_to(logs)) for p in logs.rglob("*")) == [
            "replay_fsm-live0001.lock", "replay_fsm-live0001_s9",
            "replay_fsm-live0001_s9/attempt_0", "replay_fsm-live0001_s9/attempt_0/0"]


def options(out: Path, **extra: object) -> DemoConfig:
    return DemoConfig(**{"ticks": 8, "device": "cpu", "out": str(out), "sample_count": 256,
                         "capacity": 20_000, "envs": 32, "collect_steps": 40,
                         "verify_data": True, "seed": 5, **extra})  # type: ignore[arg-type]


@pytest.mark.slow
def test_two_ranks_draw_different_reproducible_batches(tmp_path: Path) -> None:
    temp = Path(tempfile.gettempdir())
    before = set(temp.glob("torchelastic_*"))
    results = launch(2, options(tmp_path, base_seed=1000))  # the batches' seed, not 5
    # the launcher's logs are the run's, not new folders left in the temp folder, and
    # a launch where no rank failed leaves none (helper-62: a folder a launch)
    assert not (tmp_path / "launcher-logs").exists()
    assert set(temp.glob("torchelastic_*")) <= before
    s0, s1 = results[0], results[1]
    assert (s0["rank"], s1["rank"]) == (0, 1)
    assert s0["base_seed"] == rank_seed(1000, 0) and s1["base_seed"] == rank_seed(1000, 1)
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
    with pytest.raises(RankFailed) as info:
        launch(2, options(tmp_path, ticks=40, kill_collector_at=3, verify_data=False),
               kill_rank=1)
    assert (info.value.rank, info.value.exitcode) == (1, 1)
    assert str(info.value).startswith("rank 1 failed (exit code 1): CollectorDied: "), \
        str(info.value)
    assert "ChildFailedError" in type(info.value.__cause__).__name__
    assert time.monotonic() - t0 < 120  # the other rank did not hang
    failed = json.loads((tmp_path / "summary-rank1.json").read_text())
    assert failed["rank"] == 1 and failed["error"].startswith("CollectorDied")
    # the failed rank's run so far, as a single-process run that failed writes it
    assert failed["interrupted"] and failed["trace_conforms"] and failed["ticks"] >= 3
    assert (tmp_path / "transitions-rank1.jsonl").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_runs_two_ranks_of_the_module_to_the_end(tmp_path: Path) -> None:
    """The README's multi-node command, on one node: torchrun itself (not ``launch``)
    starting ``-m replay_fsm.distributed``; each rank writes its files, its trace
    conforms, and the two ranks drew their own batches. No test ran torchrun before."""
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc-per-node", "2", "-m", "replay_fsm.distributed", "--ticks", "8",
         "--device", "cpu", "--sample-count", "256", "--out", str(out)],
        capture_output=True, text=True, timeout=MARGIN_S * 8)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((out / f"summary-rank{k}.json").read_text()) for k in (0, 1)]
    for k, summary in enumerate(ranks):
        assert (summary["rank"], summary["ticks"], summary["interrupted"],
                summary["error"], summary["trace_conforms"]) == (k, 8, False, None, True)
        assert summary["base_seed"] == rank_seed(ranks[0]["base_seed"], k)
        assert (out / f"transitions-rank{k}.jsonl").stat().st_size > 0
    assert not (out / "trace.json").exists()  # torchrun merges no trace (README)


@pytest.mark.deep  # 45 s: the peer's 5 s, then torch's launcher waits its own 30 s
@pytest.mark.timeout(300)
def test_a_stuck_rank_ends_the_job_after_the_peer_timeout(tmp_path: Path) -> None:
    """Rank 2 of 3 stops (SIGSTOP) at tick 3: the others, waiting in the all-reduce,
    fail after peer_timeout instead of torch's 30 minutes, and the launcher ends the
    job. The error names the first of them, whose wait ran out, and the stopped rank
    too, as the one that wrote no files: it named only the first (helper-99)."""
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as info:
        launch(3, options(tmp_path, ticks=40, freeze_at=3, peer_timeout=5.0,
                          verify_data=False), kill_rank=2)
    assert info.value.rank in (0, 1), str(info.value)
    assert "peer_timeout" in str(info.value), str(info.value)
    assert info.value.silent == (2,), str(info.value)
    assert str(info.value).endswith("; rank 2 wrote no files (stopped, stuck, or killed "
                                    "before writing them)"), str(info.value)
    assert time.monotonic() - t0 < 240  # the peer's 5 s, then the launcher's own 30 s
    for rank in (0, 1):
        failed = json.loads((tmp_path / f"summary-rank{rank}.json").read_text())
        assert failed["interrupted"] and failed["ticks"] >= 3
        assert "peer_timeout" in failed["error"]


LAUNCH_AND_REPORT = """
import sys
from replay_fsm.demo import DemoConfig
from replay_fsm.distributed import launch
from replay_fsm.signals import exit_code
if __name__ == "__main__":
    frozen = sys.argv[4] == "frozen"  # rank 1's collector SIGSTOPped first
    config = DemoConfig(ticks=400, device="cpu", out=sys.argv[1], sample_count=256,
                        capacity=20_000, envs=32, seed=5, progress=False,
                        interrupt_at=int(sys.argv[2]), interrupt_signal=int(sys.argv[3]),
                        freeze_collector_at=int(sys.argv[2]) if frozen else None,
                        liveness_timeout=120.0 if frozen else 30.0)
    try:
        launch(2, config, kill_rank=1)
    except KeyboardInterrupt as exc:
        print(f"launch raised KeyboardInterrupt, exit code {exit_code(exc)}")
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tick, signum, collector", [
    (0, signal.SIGINT, "running"),  # in the warm-up's wait for rows
    # the deep tier's: the SIGTERM and frozen cases stop the ranks at that step too
    pytest.param(3, signal.SIGINT, "running", marks=pytest.mark.deep),
    (3, signal.SIGTERM, "running"),  # a batch scheduler's stop (SLURM, systemd)
    (3, signal.SIGINT, "frozen"),  # the run looks hung: its user presses Ctrl-C
])
def test_ctrl_c_on_the_launcher_stops_every_rank_at_the_same_step(
        tmp_path: Path, tick: int, signum: int, collector: str) -> None:
    """At ``tick`` rank 1 sends SIGINT to the whole process group, as a terminal's
    Ctrl-C does (or SIGTERM, as a batch scheduler does): the launcher, both ranks
    and their collector processes get it. The ranks stop at the same step's
    all-reduce (none is left waiting in a collective), write their summaries as an
    interrupted single-process run does and exit on their own: the launcher never
    has to kill one (it would, after 30 s). On Ctrl-C the collectors carry on (a
    rank waiting for rows must not see its collector die). launch() raises a
    KeyboardInterrupt that names the signal's exit code.

    "frozen": rank 1's collector is SIGSTOPped just before. Rank 1's wait for its
    batch (held up by the stopped collector, for up to its 120 s liveness_timeout)
    kept it from the all-reduce where the ranks agree, and its close joined the
    stopped collector for 30 s: the launcher killed both ranks first, and neither
    wrote its files. The stop ends the wait, and a stopped collector is killed at
    once."""
    script = tmp_path / "launch_and_report.py"
    script.write_text(LAUNCH_AND_REPORT)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "out"), str(tick),
                          str(int(signum)), collector],
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


def spawned_children(pid: int, marker: bytes = b"spawn_main") -> list[int]:
    """The processes ``pid`` spawned with multiprocessing (its ranks), not its resource
    tracker; those whose command line holds ``marker`` (torchrun's ranks: the module)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue  # not a process, or gone meanwhile
        if int(stat[stat.rindex(")") + 2:].split()[1]) == pid and marker in cmdline:
            found.append(int(entry.name))
    return sorted(found)


def running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def shared_memory_names(pids: list[int]) -> set[str]:
    """The names in /dev/shm that ``pids`` have mapped (semaphores: ``sem.mp-*``, made
    by them or by their launcher), less those already removed."""
    names = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue  # gone meanwhile
        for line in maps.splitlines():
            if " /dev/shm/" in line and not line.endswith("(deleted)"):
                names.add(line.split(" /dev/shm/", 1)[1])
    return names


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="a rank learns of its launcher's end from Linux's prctl")
@pytest.mark.parametrize("launcher, when", [
    ("launch", "starting"),  # as its ranks import torch
    ("torchrun", "running"),  # once its ranks run their collectors
])
def test_the_ranks_of_a_launcher_killed_with_sigkill_stop_and_free_their_semaphores(
        tmp_path: Path, launcher: str, when: str) -> None:
    """A launcher killed with SIGKILL (kill -9, the OOM killer) forwards no stop: the
    ranks of ``replay-fsm demo --nproc 2`` killed as they started ran the whole
    run on (torch's own death signal for them is set up after their start-up; 3 of 3
    still running 90 s on, helper-124), and torchrun's ranks did at any time; their
    semaphores stayed in /dev/shm until they were killed in turn. A rank now takes
    its launcher's end as a SIGTERM: before the ranks joined it ends at once, after,
    every rank stops at the same step and writes its files, its collector ends, and
    what they mapped in /dev/shm is removed."""
    out = tmp_path / "out"
    if launcher == "launch":
        command = [sys.executable, "-m", "replay_fsm", "demo", "--nproc", "2",
                   "--no-progress"]
        marker = b"spawn_main"
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "2", "-m", "replay_fsm.distributed", "--device", "cpu"]
        marker = b"replay_fsm.distributed"
    with open(tmp_path / "log", "w") as log:  # the ranks outlive the launcher: no pipe
        proc = subprocess.Popen(command + ["--ticks", "100000", "--sample-count", "256",
                                           "--out", str(out)], stdout=log, stderr=log,
                                start_new_session=True)
    ranks: list[int] = []
    collectors: list[int] = []
    try:
        end = time.monotonic() + MARGIN_S * 4
        while time.monotonic() < end and proc.poll() is None:
            ranks = spawned_children(proc.pid, marker)
            collectors = [c for r in ranks for c in spawned_children(r)]
            if len(ranks) == 2 and (when == "starting" or len(collectors) == 2):
                break
            time.sleep(0.005)  # a poll for processes to appear; nothing to wait on
        assert len(ranks) == 2 and (when == "starting" or len(collectors) == 2), (
            ranks, collectors, (tmp_path / "log").read_text())
        names = shared_memory_names([proc.pid, *ranks, *collectors])
        proc.kill()
        proc.wait()
        end = time.monotonic() + MARGIN_S * 2
        while time.monotonic() < end and any(map(running, ranks + collectors)):
            collectors += [c for r in ranks for c in spawned_children(r)
                           if c not in collectors]
            names |= shared_memory_names(ranks + collectors)
            time.sleep(0.05)  # a poll for processes to end; nothing to wait on
        assert not any(map(running, ranks + collectors)), (ranks, collectors)
        # multiprocessing's resource tracker removes the launcher's once the last
        # process that could use them has ended
        while time.monotonic() < end and any(Path("/dev/shm", n).exists() for n in names):
            time.sleep(0.05)
        assert not [n for n in names if Path("/dev/shm", n).exists()]
    finally:
        for pid in [proc.pid, *ranks, *collectors]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    if when == "running":
        saved = [json.loads((out / f"summary-rank{rank}.json").read_text())
                 for rank in (0, 1)]
        assert all(s["interrupted"] and s["error"] is None for s in saved), saved
        assert saved[0]["ticks"] == saved[1]["ticks"] < 100000  # the same step


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_a_signal_to_a_rank_as_it_starts_up_ends_the_run_at_once(
        tmp_path: Path, signum: int) -> None:
    """Sent to a rank as soon as it exists (it imports torch for a second or so):
    - a SIGTERM killed it, and the command said "rank 1 failed (killed by SIGTERM)",
      exit 2; a SIGINT was raised inside torch's import, where the rank died of it or
      torch swallowed it and the run went on (helper-45). The ranks start with both
      blocked and end on one once they have started up: an interrupt (130, 143),
      with nothing written and no traceback.
    - a SIGKILL (an OOM kill) left the other rank waiting in the rendezvous, deaf to
      the launcher's SIGTERM while its handler only recorded it: the launcher killed
      it 30 s on ("forcefully exiting"; helper-47). Now it ends at once."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "replay_fsm", "demo", "--nproc", "2",
                             "--ticks", "40", "--sample-count", "256", "--no-progress",
                             "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        end, ranks = time.monotonic() + MARGIN_S, []
        while len(ranks) < 2 and time.monotonic() < end and proc.poll() is None:
            time.sleep(0.005)  # a poll for processes to appear; nothing to wait on
            ranks = spawned_children(proc.pid)
        assert len(ranks) == 2, ranks
        os.kill(ranks[-1], signum)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "forcefully exiting" not in stderr, stderr  # torch's kill after 30 s
    # no rank's own traceback (torch's launcher logs one of its own for a failed rank)
    assert "KeyboardInterrupt" not in stderr and "spawn_main" not in stderr, stderr
    if signum == signal.SIGKILL:
        assert proc.returncode == 2, stdout + stderr
        assert "failed (killed by SIGKILL)" in stderr, stderr
    else:
        assert proc.returncode == 128 + signum, stdout + stderr
        assert stdout == "interrupted before any rank wrote its files\n", stdout + stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("signum", [  # SIGTERM takes the same way: the deep tier's
    signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.deep)])
def test_a_stop_while_the_launcher_starts_the_ranks_ends_every_one_quietly(
        tmp_path: Path, signum: int) -> None:
    """Sent to the whole job (a terminal's Ctrl-C, ``timeout``'s SIGTERM) once the
    launcher has started its first rank of four and is starting the others: the
    launcher's handler raised inside that start, before torch had noted the ranks
    it started, so it stopped none of them and exited, and its exit removed the
    semaphores the ranks were still unpickling: "FileNotFoundError" (or, for a rank
    whose start it cut short, "EOFError: Ran out of input") tracebacks from
    ``spawn_main`` (helper-99; seen at 256 ranks under ``timeout 60``). The stop
    now waits for the start, and every rank ends as one stopped later does."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "replay_fsm", "demo", "--nproc", "4",
                             "--ticks", "40", "--sample-count", "256", "--no-progress",
                             "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        end, ranks = time.monotonic() + MARGIN_S, []
        while not ranks and time.monotonic() < end and proc.poll() is None:
            time.sleep(0.002)  # a poll for processes to appear; nothing to wait on
            ranks = spawned_children(proc.pid)
        assert ranks, "no rank started"
        os.killpg(proc.pid, signum)
        # the ranks hold the pipes too: this waits for every one of them to end
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "Traceback" not in stderr and "spawn_main" not in stderr, stderr
    assert proc.returncode == 128 + signum, stdout + stderr
    assert stdout == "interrupted before any rank wrote its files\n", stdout + stderr


def test_a_launch_stopped_by_ctrl_c_or_sigterm_raises_keyboard_interrupt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher turns its own SIGINT, SIGTERM or SIGHUP into SignalException once
    it has stopped the ranks; launch() makes that the interrupt it is, naming the
    signal (the CLI exits 130, 143 or 129), and merges the ranks' traces all the same.
    Another signal (SIGQUIT) stays the launcher's error."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.launcher import api

    def stopped_by(sig: signal.Signals):  # type: ignore[no-untyped-def]
        def elastic_launch(config, entrypoint):  # type: ignore[no-untyped-def]
            def run(*args):  # type: ignore[no-untyped-def]
                # the ranks stopped together and wrote their files
                (tmp_path / "trace-rank0.json").write_text('{"traceEvents": []}')
                raise SignalException(f"Process 1 got signal: {sig}", sigval=sig)
            return run
        return elastic_launch

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        monkeypatch.setattr(api, "elastic_launch", stopped_by(signum))
        with pytest.raises(Interrupted) as info:
            launch(2, options(tmp_path))
        assert info.value.signum == signum
        assert isinstance(info.value.__cause__, SignalException)
        assert (tmp_path / "trace.json").is_file()  # merged, from what the ranks wrote
        (tmp_path / "trace.json").unlink()
    monkeypatch.setattr(api, "elastic_launch", stopped_by(signal.SIGQUIT))
    with pytest.raises(SignalException):
        launch(2, options(tmp_path))


def failing_launcher(tmp_path: Path, exitcode: int, recorded: str | None,  # type: ignore[no-untyped-def]
                     plain: bool = False, wrote: tuple[int, ...] = ()):
    """An ``elastic_launch`` whose rank 1 failed with ``exitcode``, its error file
    holding ``recorded`` as torch's error handler writes it (None: no file), or as a
    plain string message (``plain``), which torch's ``ProcessFailure`` also reads;
    the ranks ``wrote`` wrote a summary."""
    from torch.distributed.elastic.multiprocessing.errors import (
        ChildFailedError,
        ProcessFailure,
    )
    error_file = tmp_path / "error.json"
    error_file.unlink(missing_ok=True)
    if recorded is not None and plain:
        error_file.write_text(json.dumps({"message": recorded, "timestamp": 1}))
    elif recorded is not None:
        error_file.write_text(json.dumps({"message": {
            "message": recorded, "extraInfo": {"py_callstack": "", "timestamp": "1"}}}))

    def elastic_launch(config, entrypoint):  # type: ignore[no-untyped-def]
        def run(*args):  # type: ignore[no-untyped-def]
            failure = ProcessFailure(local_rank=1, pid=4242, exitcode=exitcode,
                                     error_file=str(error_file))
            for rank in wrote:
                (Path(args[0].out) / f"summary-rank{rank}.json").write_text("{}\n")
            raise ChildFailedError("rank_main", {1: failure})
        return run
    return elastic_launch


@pytest.mark.parametrize("exitcode, recorded, plain, expected", [
    (1, "CollectorDied: tick 9: the collector exited with code -9", False,
     "rank 1 failed (exit code 1): CollectorDied: tick 9: the collector exited with code -9"),
    (1, "\nValueError: a text that begins on its second line", False,
     "rank 1 failed (exit code 1): ValueError: a text that begins on its second line"),
    (1, "\n  out of cheese\n", True, "rank 1 failed (exit code 1): out of cheese"),
    (1, "", True, "rank 1 failed (exit code 1): no error recorded (pid 4242)"),
    (-9, None, False, "rank 1 failed (killed by SIGKILL): no error recorded (pid 4242)"),
    (3, None, False, "rank 1 failed (exit code 3): no error recorded (pid 4242)"),
])
def test_a_failed_rank_is_named_with_its_exit_and_its_error_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], exitcode: int, recorded: str | None,
        plain: bool, expected: str) -> None:
    """torch's ChildFailedError begins with a newline and a banner: launch() raises
    RankFailed naming the first rank to fail, and the CLI prints that line (it
    printed an empty error before). An error file whose message is a plain string
    (written by code other than torch's handler) was read as none."""
    from torch.distributed.launcher import api

    from replay_fsm.cli import main as cli_main

    monkeypatch.setattr(api, "elastic_launch",
                        failing_launcher(tmp_path, exitcode, recorded, plain, wrote=(0,)))
    with pytest.raises(RankFailed) as info:
        launch(2, options(tmp_path / "out"))
    assert str(info.value) == expected
    assert (info.value.rank, info.value.exitcode) == (1, exitcode)
    capsys.readouterr()
    code = cli_main(["demo", "--nproc", "2", "--ticks", "8", "--out",
                     str(tmp_path / "cli"), "--no-progress"])
    assert code == 2
    assert capsys.readouterr().err == f"replay-fsm demo: error: {expected}\n"


def test_the_ranks_that_neither_failed_nor_wrote_their_files_are_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank stopped (SIGSTOP) or stuck fails no collective of its own: the others'
    all-reduce runs out of peer_timeout, the first of them is named, and its error
    (gloo's "Timed out waiting ... for recv") names no peer. The ranks that neither
    failed nor wrote their files are named after it (helper-99)."""
    from torch.distributed.launcher import api

    monkeypatch.setattr(api, "elastic_launch", failing_launcher(
        tmp_path, 1, "RuntimeError: an all-reduce across the ranks failed", wrote=(3,)))
    with pytest.raises(RankFailed) as info:
        launch(4, options(tmp_path / "out"))
    assert str(info.value) == (
        "rank 1 failed (exit code 1): RuntimeError: an all-reduce across the ranks "
        "failed; ranks 0, 2 wrote no files (stopped, stuck, or killed before writing them)")
    assert info.value.silent == (0, 2)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_sent_to_one_rank_alone_is_an_interrupt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], signum: int) -> None:
    """A rank that got Ctrl-C or SIGTERM itself stops every rank at the same step and
    exits with the shell's code for it (rank_main); the launcher reports that as a
    failed rank. launch() raises the interrupt it is, the CLI exits 130 or 143."""
    from torch.distributed.launcher import api

    from replay_fsm.cli import main as cli_main

    monkeypatch.setattr(api, "elastic_launch", failing_launcher(tmp_path, 128 + signum, None))
    with pytest.raises(Interrupted) as info:
        launch(2, options(tmp_path / "out"))
    assert info.value.signum == signum
    argv = ["demo", "--nproc", "2", "--ticks", "8", "--out", str(tmp_path / "cli"),
            "--no-progress"]
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "summary-rank3.json").write_text("{}")  # an earlier run's rank 3
    assert cli_main(argv) == 128 + signum
    # This fake launch wrote no rank's files: the CLI pointed at files not there.
    assert capsys.readouterr().out == "interrupted before any rank wrote its files\n"
    real = failing_launcher(tmp_path, 128 + signum, None)

    def writing(config, entrypoint):  # type: ignore[no-untyped-def]
        def run(*args):  # type: ignore[no-untyped-def]
            (tmp_path / "cli" / "summary-rank0.json").write_text("{}")  # a rank's
            return real(config, entrypoint)(*args)
        return run

    monkeypatch.setattr(api, "elastic_launch", writing)
    assert cli_main(argv) == 128 + signum
    assert capsys.readouterr().out.startswith("interrupted; per-rank summaries")


def test_a_rank_whose_trace_does_not_conform_fails_the_command(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """As a single run's: exit 1 (it was 0 whatever the ranks' traces)."""
    from torch.distributed.launcher import api

    from replay_fsm.cli import main as cli_main

    def returning(conforms: list[bool | None]):  # type: ignore[no-untyped-def]
        def elastic_launch(config, entrypoint):  # type: ignore[no-untyped-def]
            def run(*args):  # type: ignore[no-untyped-def]
                return {rank: {"ticks": 8, "tick_ms": 1.0, "stall_pct": 0.0,
                               "base_seed": rank, "trace_conforms": c}
                        for rank, c in enumerate(conforms)}
            return run
        return elastic_launch

    argv = ["demo", "--nproc", "2", "--ticks", "8", "--out", str(tmp_path), "--no-progress"]
    for conforms, code in (([True, True], 0), ([True, None], 0), ([True, False], 1)):
        monkeypatch.setattr(api, "elastic_launch", returning(conforms))
        assert cli_main(argv) == code, conforms
        out = capsys.readouterr().out
        assert ("rank 1: 8 ticks, 1.00 ms/tick, stall 0.0 %, base seed 1, its trace does "
                "NOT conform") in out if code else "NOT" not in out


def test_an_earlier_runs_rank_files_are_not_taken_for_this_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that fails before it writes anything left the files of an earlier run
    in the same folder: its summary looked current, and its trace was merged into
    this run's trace.json. An earlier run's ranks past this run's too: a 3-rank
    run's summary-rank2.json read as this 2-rank run's (helper-78). A file of another
    name stays."""
    from torch.distributed.launcher import api

    out = tmp_path / "out"
    out.mkdir()
    stale = {"traceEvents": [{"name": "from an earlier run", "ph": "i", "ts": 0,
                              "pid": 1, "tid": 1}]}
    for rank in (0, 1):
        (out / f"trace-rank{rank}.json").write_text(json.dumps(stale))
        (out / f"summary-rank{rank}.json").write_text('{"ticks": 300}')
        (out / f"transitions-rank{rank}.jsonl").write_text("")
    (out / "trace-rank2.json").write_text(json.dumps(stale))  # not a rank of this run
    (out / "summary-rank2.json").write_text('{"ticks": 300}')
    (out / "summary-rank2.json.bak").write_text("{}")  # not the library's: stays
    (out / "trace-rank-old.json").write_text("{}")  # no rank number: stays
    (out / "trace.json").write_text(json.dumps(stale))  # a launcher killed before its
    failing = failing_launcher(tmp_path, -9, None)  # merge left the one before
    seen = []

    def looking(config, entrypoint):  # type: ignore[no-untyped-def]
        def run(*args):  # type: ignore[no-untyped-def]
            seen.append(sorted(p.name for p in out.iterdir()))  # as the ranks start
            return failing(config, entrypoint)(*args)
        return run

    monkeypatch.setattr(api, "elastic_launch", looking)
    with pytest.raises(RankFailed):
        launch(2, options(out))
    kept = ["summary-rank2.json.bak", "trace-rank-old.json"]
    assert seen == [["launcher-logs", *kept]]
    assert not (out / "trace.json").exists()  # no rank wrote one: none merged
    assert sorted(p.name for p in out.iterdir() if "rank" in p.name) == kept


def test_a_rank_that_failed_is_not_hidden_by_another_ranks_stop_signal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch stamps failures to the second, lowest rank first on a tie: rank 0's exit
    for a stop signal and rank 1's real error in the same second were reported as
    an interrupt, and the error was lost."""
    from torch.distributed.elastic.multiprocessing.errors import (
        ChildFailedError,
        ProcessFailure,
    )
    from torch.distributed.launcher import api

    error_file = tmp_path / "error.json"
    error_file.write_text(json.dumps({"message": {
        "message": "CollectorDied: gone", "extraInfo": {"py_callstack": "",
                                                         "timestamp": "0"}}}))

    def elastic_launch(config, entrypoint):  # type: ignore[no-untyped-def]
        def run(*args):  # type: ignore[no-untyped-def]
            stopped = ProcessFailure(local_rank=0, pid=1, exitcode=143,
                                     error_file=str(tmp_path / "none.json"))
            failed = ProcessFailure(local_rank=1, pid=2, exitcode=1,
                                    error_file=str(error_file))
            stopped.timestamp = failed.timestamp = 7  # the same second
            raise ChildFailedError("rank_main", {0: stopped, 1: failed})
        return run

    monkeypatch.setattr(api, "elastic_launch", elastic_launch)
    with pytest.raises(RankFailed, match=r"rank 1 failed \(exit code 1\): CollectorDied: gone"):
        launch(2, options(tmp_path / "out"))


def test_under_nohup_the_launcher_leaves_sighup_ignored() -> None:
    """torch's launcher handles SIGHUP by default and its ranks start with it at its
    default: a nohup'd launch would stop on a hangup. launch asks the launcher to
    leave the stop signals alone, and handles them itself (SIGHUP only where it is
    not ignored); the rest of torch's list stays torch's."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    from replay_fsm.distributed import _launcher_signals

    names = str(next(f.default for f in dataclasses.fields(LaunchConfig)
                     if f.name == "signals_to_handle"))
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        nohup = _launcher_signals(LaunchConfig)["signals_to_handle"]
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        plain = _launcher_signals(LaunchConfig)["signals_to_handle"]
    finally:
        signal.signal(signal.SIGHUP, before)
    assert "SIGHUP" in names.split(",") and plain == nohup
    assert plain.split(",") == [n for n in names.split(",")
                                if n not in ("SIGINT", "SIGTERM", "SIGHUP")]

    @dataclasses.dataclass
    class Older:  # a torch whose LaunchConfig has no such field: nothing is passed
        nproc_per_node: int = 1

    assert _launcher_signals(Older) == {}


def test_a_stop_during_the_start_is_raised_after_it_and_a_torch_without_that_start_runs_as_is(
) -> None:
    """The launcher's start of the ranks, wrapped for the with-block: a stop signal
    that comes inside it is raised (as torch's SignalException) once it returns, and
    the start is torch's own again after; a class without it is left as it is."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from replay_fsm.distributed import _stops_after_the_start

    class Agent:
        started: list[str] = []

        def _start_workers(self, group: str) -> str:
            signal.raise_signal(signal.SIGTERM)  # handled by the note: nothing raised here
            self.started.append(group)
            return group

    own = Agent._start_workers
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SignalException) as info, _stops_after_the_start(Agent):
        Agent()._start_workers("ranks")
    assert Agent.started == ["ranks"] and info.value.sigval == signal.SIGTERM
    assert Agent._start_workers is own and signal.getsignal(signal.SIGTERM) == before

    class Renamed:
        pass

    with _stops_after_the_start(Renamed):
        assert not hasattr(Renamed, "_start_workers")


def _main_thread_waits_for_a_batch() -> bool:
    """Whether the main thread is inside a pipeline's wait for a batch."""
    from replay_fsm.runtime.pipeline import Pipeline
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    while frame is not None:
        if frame.f_code is Pipeline._wait_locked.__code__:
            return True
        frame = frame.f_back
    return False


@pytest.mark.timeout(300)
def test_a_ranks_stop_signal_ends_its_wait_for_a_batch_and_nothing_else() -> None:
    """A rank's stop signal is only recorded: the ranks agree on it at the next
    step's all-reduce. A rank waiting for its batch (its collector stuck or stopped)
    reached that all-reduce only when the wait ended, liveness_timeout later, while
    the others waited in it and the launcher killed them all after 30 s. The signal
    now ends the rank's current or next wait for a batch, and no other learner call
    (one raising elsewhere would make the ranks stop at different steps)."""
    from replay_fsm import Pipeline, ReplayBuffer
    from replay_fsm.distributed import AgreedInterrupt

    rb = ReplayBuffer(64, 2, 1)
    rb.add_packed(torch.ones(8, rb.width))
    never = 10**9  # rows that never come: the wait ends only as asked

    def pipeline() -> Pipeline:
        pipe = Pipeline(rb, sample_count=4, collector="thread", stall_timeout=None,
                        liveness_timeout=4 * MARGIN_S)
        pipe.start_prepare(0, 4, min_snapshot_ptr=never)
        return pipe

    with AgreedInterrupt() as interrupt, pipeline() as pipe:
        signal.raise_signal(signal.SIGINT)  # between the learner's calls: recorded
        assert interrupt.requested and not pipe.closed
        assert pipe.start_prepare(1, 4, min_snapshot_ptr=never)  # not a wait: goes on
        assert not pipe.batch_ready(0, 4)  # a poll is not a wait either
        with pytest.raises(KeyboardInterrupt):  # the next wait ends at its start
            pipe.wait_until_ready(0, 4, timeout=MARGIN_S)
    with AgreedInterrupt() as interrupt, pipeline() as pipe:
        assert not interrupt.requested  # a new block starts with no stop
        main = threading.main_thread().ident or 0

        def signal_the_wait() -> None:
            while not _main_thread_waits_for_a_batch():
                time.sleep(0.01)
            signal.pthread_kill(main, signal.SIGINT)

        signaller = threading.Thread(target=signal_the_wait, daemon=True)
        signaller.start()
        try:
            with pytest.raises(KeyboardInterrupt):  # the wait under way ends
                pipe.wait_until_ready(0, 4, timeout=MARGIN_S)
        finally:
            signaller.join()
        assert interrupt.requested


def test_a_rendezvous_that_runs_out_of_the_peer_timeout_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank stopped as it started: the others failed with torch's "DistStoreError:
    wait timeout after 5000ms, keys: /default_pg/0//cpu//0/1", which named neither
    the peer timeout nor a stuck rank (helper-78)."""
    import torch.distributed as dist

    from replay_fsm.distributed import rank_main

    rendezvous_fails(monkeypatch)
    with pytest.raises(RuntimeError, match=r"did not join it for 5 s \(peer_timeout") as info:
        rank_main(DemoConfig(ticks=2, device="cpu", out=str(tmp_path), peer_timeout=5.0,
                             progress=False))
    assert isinstance(info.value.__cause__, dist.DistStoreError)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_rank_main_called_in_a_process_leaves_its_parent_death_signal_as_it_was(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """rank_main asks the kernel for a SIGTERM when its launcher ends; called from
    Python in a process of the caller's (a test, a notebook), it left that request
    on the caller for good: before 0, after 15 (helper-125)."""
    from replay_fsm.distributed import rank_main
    from replay_fsm.signals import parent_death_signal

    rendezvous_fails(monkeypatch)
    before = parent_death_signal()
    assert before is not None
    with pytest.raises(RuntimeError, match="rendezvous failed"):
        rank_main(DemoConfig(ticks=2, device="cpu", out=str(tmp_path), progress=False))
    assert parent_death_signal() == before


def test_the_agreement_all_reduce_puts_its_flags_on_the_groups_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank whose wait a stop ended joins the step's all-reduce with no tensors
    (_agree_to_stop): its flags went to the CPU, which an NCCL group (a CUDA run)
    refuses, so the rank left and its peers waited in their all-reduce for
    peer_timeout (helper-81)."""
    import torch
    import torch.distributed as dist

    from replay_fsm.distributed import AgreedInterrupt

    seen: list[str] = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: seen.append(t.device.type))
    ai = AgreedInterrupt(120.0)
    ai.device = torch.device("meta")  # stands in for the rank's CUDA device
    ai.signum = 2
    with pytest.raises((KeyboardInterrupt, RuntimeError)):  # meta: no .item()
        ai.all_reduce_mean([])
    assert seen == ["meta"], seen


def test_a_torchrun_rank_names_the_options_it_was_given(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``torchrun -m replay_fsm.distributed --peer-timeout 5`` whose rendezvous ran out
    said "(peer_timeout; stopped or stuck as it started)", 1 of 1: only the errors of
    its options' checks were written as options, not those of the rank's run. From
    Python, rank_main names the config's field as before."""
    from replay_fsm.distributed import rank_main

    rendezvous_fails(monkeypatch)
    with pytest.raises(RuntimeError, match=r"did not join it for 5 s \(--peer-timeout; "):
        main(["--ticks", "2", "--device", "cpu", "--peer-timeout", "5",
              "--out", str(tmp_path)])
    with pytest.raises(RuntimeError, match=r"did not join it for 5 s \(peer_timeout; "):
        rank_main(DemoConfig(ticks=2, device="cpu", out=str(tmp_path), peer_timeout=5.0,
                             progress=False))


def test_the_ranks_of_the_command_name_its_options(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks ``replay-fsm demo --nproc 2`` starts are fresh processes, which knew
    nothing of the command's options: their errors named the config's fields, and
    only the rewrite of the launcher's one line (dropped now) made options of some.
    launch hands each rank the names its own process gives (here run as a rank
    would be, in this process once the command has ended: a rank's rendezvous that
    ran out names --peer-timeout)."""
    import pickle

    from torch.distributed.launcher import api

    from replay_fsm.cli import main as cli_main
    from replay_fsm.distributed import rank_main

    given: list[tuple[object, ...]] = []

    def elastic_launch(config, entrypoint):  # type: ignore[no-untyped-def]
        def run(*args):  # type: ignore[no-untyped-def]
            given.append((entrypoint, *pickle.loads(pickle.dumps(args))))  # as spawned
            return {rank: {"ticks": 2, "tick_ms": 1.0, "stall_pct": 0.0, "base_seed": 0,
                           "trace_conforms": True} for rank in (0, 1)}
        return run

    monkeypatch.setattr(api, "elastic_launch", elastic_launch)
    assert cli_main(["demo", "--nproc", "2", "--ticks", "2", "--peer-timeout", "5",
                     "--out", str(tmp_path), "--no-progress"]) == 0
    ((entrypoint, *args),) = given
    assert entrypoint is rank_main
    rendezvous_fails(monkeypatch)
    with pytest.raises(RuntimeError, match=r"did not join it for 5 s \(--peer-timeout; "):
        rank_main(*args)  # type: ignore[arg-type]


# A rank's start-up as a forkserver starts it: asks for a stop when its launcher
# ends (rank_main's call), then says it is still running.
FORKSERVER_RANK = """
import multiprocessing as mp, os, sys
from replay_fsm.distributed import launcher_pid
from replay_fsm.signals import stop_when_parent_ends

def rank(out):
    stop_when_parent_ends(launcher_pid())
    with open(out, "w") as f:
        f.write("running")

if __name__ == "__main__":
    child = mp.get_context("forkserver").Process(target=rank, args=(sys.argv[1],))
    child.start()
    child.join()
    print(child.exitcode, flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_a_rank_a_forkserver_started_runs_while_its_launcher_lives(tmp_path: Path) -> None:
    """A forkserver's child has the forkserver for its parent, not the process that
    spawned it: launcher_pid named the spawner, stop_when_parent_ends took the
    launcher for gone and the rank stopped itself with SIGTERM as it started
    (elastic_launch(LaunchConfig(start_method="forkserver"), rank_main) of a 2-tick
    run: the rank's exit -15 and ChildFailedError, 3 of 3; helper-125)."""
    script = tmp_path / "forkserver_rank.py"
    script.write_text(FORKSERVER_RANK)
    out = tmp_path / "out.txt"
    done = subprocess.run([sys.executable, str(script), str(out)], capture_output=True,
                          text=True, timeout=MARGIN_S * 4)
    assert done.stdout == "0\n", (done.stdout, done.stderr)
    assert out.read_text() == "running"
