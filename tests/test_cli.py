"""The command line as a stranger meets it: wrong files, unavailable devices and bad
numbers give one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from replay_fsm.cli import main

from .support import MARGIN_S, stall_the_warm_ups


def one_line_error(capsys: pytest.CaptureFixture[str], code: int, expected: int = 2) -> str:
    err = capsys.readouterr().err
    assert code == expected, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_check_trace_of_a_missing_file(capsys: pytest.CaptureFixture[str], tmp_path: Path
                                       ) -> None:
    err = one_line_error(capsys, main(["check-trace", str(tmp_path / "nope.jsonl")]))
    assert "cannot read" in err and "nope.jsonl" in err


def test_check_trace_of_a_file_that_is_not_json(capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("this is not json\n")
    assert "not JSON lines: line 1:" in one_line_error(capsys, main(["check-trace", str(bad)]))
    # the line of the file, not of the record (each record is read alone)
    bad.write_text('{"kind": "transition"}\n\n{"kind": "transition"}\n{"kind": \n')
    assert "not JSON lines: line 4:" in one_line_error(capsys, main(["check-trace", str(bad)]))
    # a file that starts with '[' was read as one JSON list, and says so
    bad.write_text('[{"slot": 0,\n "from": 1')
    assert "is not a JSON list (it starts with '['): line 2:" in one_line_error(
        capsys, main(["check-trace", str(bad)]))


def test_check_trace_of_a_chrome_trace_points_to_the_log(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    chrome = tmp_path / "trace.json"
    chrome.write_text(json.dumps({"traceEvents": [], "displayTimeUnit": "ms"}))
    err = one_line_error(capsys, main(["check-trace", str(chrome)]))
    assert "Chrome trace" in err and "transitions.jsonl" in err


def test_an_empty_trace_is_a_violation(capsys: pytest.CaptureFixture[str], tmp_path: Path
                                       ) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["check-trace", str(empty)]) == 1
    # one line: it ended in "  context:" and an empty line, with no record to show
    assert capsys.readouterr().out == ("violation: the log is empty: no transition to "
                                       "check\n")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_demo_on_a_missing_device(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    err = one_line_error(capsys, main(["demo", "--device", "cuda", "--ticks", "2",
                                       "--out", str(tmp_path), "--no-progress"]))
    assert "cuda" in err and "not" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_device_this_machine_lacks_is_named_alike_everywhere(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The demo, SAC's options and a rank's device say it in the library's words,
    before anything starts. They said it three ways (torch's list of every device
    type for 'bogus', "Torch not compiled with CUDA enabled" from sac, "requested but
    CUDA is not available" from a rank)."""
    from replay_fsm.distributed import local_device
    from replay_fsm.trainers.run import SACConfig

    for device, message in [
            ("cuda:1", "device 'cuda:1' is not available on this machine; supported here: cpu"),
            ("mps", "device 'mps' is not available on this machine; supported here: cpu"),
            ("bogus", "unknown device 'bogus'; supported: cpu, cuda[:N], mps, xpu, or any "
                      "device type torch knows")]:
        if device == "mps" and torch.backends.mps.is_available():
            continue
        code = main(["demo", "--device", device, "--ticks", "2", "--out",
                     str(tmp_path / "d"), "--no-progress"])
        assert one_line_error(capsys, code) == f"replay-fsm demo: error: {message}\n"
        with pytest.raises(ValueError) as info:
            SACConfig(device=device).validate()
        assert str(info.value) == message
        with pytest.raises(ValueError) as info:
            local_device(0, device)
        assert str(info.value) == message
    assert not (tmp_path / "d").exists()  # refused before its folder was made
    from replay_fsm.demo import DemoConfig, run  # the demo's own check, without the
    with pytest.raises(ValueError, match="^device 'cuda:1' is not available"):  # CLI's
        run(DemoConfig(device="cuda:1", out=str(tmp_path / "e"), progress=False))
    assert not (tmp_path / "e").exists()  # clean-up of empty folders


def test_demo_with_bad_numbers(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    err = one_line_error(capsys, main(["demo", "--ticks", "0", "--out", str(tmp_path)]))
    assert "ticks must be an int >= 1, got 0" in err
    err = one_line_error(capsys, main(["demo", "--ring-depth", "1", "--ticks", "2",
                                       "--out", str(tmp_path), "--no-progress"]))
    assert "--ring-depth" in err


def test_explore_with_a_bad_depth(capsys: pytest.CaptureFixture[str]) -> None:
    """The message names the option the user set, --depth, not the core's
    ring_depth (it did before)."""
    err = one_line_error(capsys, main(["explore", "--depth", "1"]))
    assert err == "replay-fsm explore: error: --depth must be an int >= 2, got 1\n", err
    err = one_line_error(capsys, main(["explore", "--depth", "99"]))
    assert err.startswith("replay-fsm explore: error: --depth must be <= 64, got 99: a ring "
                          "prefetches --depth - 1 ticks ahead"), err


def test_a_highlight_is_taken_in_any_case(capsys: pytest.CaptureFixture[str]) -> None:
    """"Hot" was refused, though "hot" and "HOT" were among the 14 spellings listed."""
    for spelling in ("hot", "HOT", "Hot"):
        assert main(["diagram", "--highlight", spelling]) == 0
        assert "class HOT highlight" in capsys.readouterr().out


def test_a_highlight_the_sequence_diagram_cannot_draw_is_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    """It was ignored: the plain sequence diagram came out, exit 0."""
    err = one_line_error(capsys, main(["diagram", "--format", "sequence",
                                       "--highlight", "hot"]))
    assert "--highlight colours a state of the state diagram" in err
    assert main(["diagram", "--format", "sequence"]) == 0


def test_the_console_script_runs_as_installed() -> None:
    out = subprocess.run([sys.executable, "-m", "replay_fsm.cli", "diagram"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("stateDiagram-v2"), out.stderr


def test_demo_with_a_rank_count_outside_1_to_256(capsys: pytest.CaptureFixture[str], tmp_path: Path
                                       ) -> None:
    # never a silent single-process run; past 256 the option's name too, not launch()'s
    # parameter's ("nproc must be in [1, 256], got 10000" beside "--nproc must be >= 1")
    for bad in ("0", "-1", "257", "10000"):
        err = one_line_error(capsys, main(["demo", "--nproc", bad, "--ticks", "2",
                                           "--out", str(tmp_path), "--no-progress"]))
        assert f"--nproc must be in [1, 256], got {bad}" in err


def test_demo_with_a_thread_collector_for_several_ranks(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Each rank runs its collector in a process: --collector thread was ignored."""
    err = one_line_error(capsys, main(["demo", "--nproc", "2", "--collector", "thread",
                                       "--ticks", "2", "--out", str(tmp_path),
                                       "--no-progress"]))
    assert "--collector thread takes one rank" in err


def test_demo_passes_its_peer_timeout_to_the_ranks(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """DemoConfig.peer_timeout had no flag: a stuck rank held the others 120 s."""
    import replay_fsm.distributed

    launched = []
    monkeypatch.setattr(replay_fsm.distributed, "launch",
                        lambda nproc, config: launched.append(config) or {})
    assert main(["demo", "--nproc", "2", "--peer-timeout", "7.5", "--out", str(tmp_path),
                 "--no-progress"]) == 0
    assert [config.peer_timeout for config in launched] == [7.5]
    for bad in ("0", "-3", "inf"):
        err = one_line_error(capsys, main(["demo", "--nproc", "2", "--peer-timeout", bad,
                                           "--out", str(tmp_path), "--no-progress"]))
        assert "--peer-timeout must be a finite number of seconds > 0" in err
    assert len(launched) == 1


def test_demo_passes_its_liveness_timeout(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """The demo's pipeline had liveness_timeout 30 written in, beside the sac
    trainer's --liveness-timeout: the flag sets DemoConfig.liveness_timeout, which
    the ranks get, and a bad value is one line."""
    import replay_fsm.distributed

    launched = []
    monkeypatch.setattr(replay_fsm.distributed, "launch",
                        lambda nproc, config: launched.append(config) or {})
    assert main(["demo", "--nproc", "2", "--liveness-timeout", "4.5", "--out",
                 str(tmp_path), "--no-progress"]) == 0
    assert [config.liveness_timeout for config in launched] == [4.5]
    assert launched[0].for_rank(1, 7, "cpu").liveness_timeout == 4.5
    for bad in ("0", "-3", "nan"):
        err = one_line_error(capsys, main(["demo", "--nproc", "2", "--liveness-timeout",
                                           bad, "--out", str(tmp_path), "--no-progress"]))
        assert "--liveness-timeout must be a finite number of seconds > 0" in err
    assert len(launched) == 1


def test_a_bad_setting_is_named_as_the_option_that_sets_it(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """The configs and the pipeline name their fields ("num_envs must be >= 1"); the
    command line said so too, where its user had typed --num-envs. A message that
    opens with another word is left as it is."""
    _as_if_sac_extras_were_there(monkeypatch)
    for argv, said in (
            (["demo", "--ticks", "0"], "--ticks must be an int >= 1, got 0"),
            (["demo", "--sample-count", "0"], "--sample-count must be an int >= 1, got 0"),
            (["demo", "--liveness-timeout", "-1"],
             "--liveness-timeout must be a finite number of seconds > 0, got -1.0"),
            (["sac", "--env", "Pendulum-v1", "--num-envs", "0"],
             "--num-envs must be >= 1, got 0"),
            (["sac", "--env", "Pendulum-v1", "--batch-size", "-1"],
             "--batch-size must be >= 1, got -1"),
            # the settings a message names inside its text, not only the one it opens
            # with ("the ticks to run (ticks 40;", "sampling='sync' reads", helper-122)
            (["sac", "--env", "Pendulum-v1", "--seed", "-1", "--ticks", "40"],
             "--seed must be an int >= 0 and at most 2**63 minus the ticks to run "
             "(--ticks 40; tick t's batch is drawn with seed + t), got -1"),
            (["sac", "--env", "Pendulum-v1", "--sampling", "sync", "--capacity", "10",
              "--ticks", "2"],
             "--sampling='sync' reads the storage while the collector appends, so the "
             "ring must not wrap: --capacity 10 < ")):
        err = one_line_error(capsys, main([*argv, "--out", str(tmp_path / "o"),
                                           "--no-progress"]))
        assert f"replay-fsm {argv[0]}: error: {said}" in err, err
    err = one_line_error(capsys, main(["explore", "--ticks", "0"]))
    assert "replay-fsm explore: error: --ticks must be an int >= 1, got 0" in err, err
    err = one_line_error(capsys, main(["demo", "--nproc", "300", "--out", str(tmp_path)]))
    assert "error: --nproc must be in [1, 256], got 300" in err  # already an option


def test_explore_with_bad_ticks(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("-1", "0"):  # not a deadlock, not "no violation" about nothing
        err = one_line_error(capsys, main(["explore", "--ticks", bad]))
        assert f"ticks must be an int >= 1, got {bad}" in err


def test_a_failed_command_leaves_no_empty_folder_behind(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The folders a failed run made for --out go again when they stayed empty; a
    folder that was there before stays, and so does anything written into one."""
    new = tmp_path / "new" / "deeper"
    one_line_error(capsys, main(["demo", "--ring-depth", "1", "--ticks", "2",
                                 "--out", str(new), "--no-progress"]))
    assert not (tmp_path / "new").exists() and tmp_path.is_dir()
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "mine.txt").write_text("a user's file")
    one_line_error(capsys, main(["demo", "--ring-depth", "1", "--ticks", "2",
                                 "--out", str(tmp_path / "kept" / "run"), "--no-progress"]))
    assert not (tmp_path / "kept" / "run").exists()
    assert (tmp_path / "kept" / "mine.txt").read_text() == "a user's file"


def _as_if_sac_extras_were_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """sac's check of its extras (gymnasium, matplotlib) passes: the tests of what it
    checks next run where the package was installed with its test extra alone."""
    from replay_fsm.trainers import cli as sac_cli

    monkeypatch.setattr(sac_cli, "find_spec", lambda name: object())


@pytest.fixture
def sac_extras(monkeypatch: pytest.MonkeyPatch) -> None:
    _as_if_sac_extras_were_there(monkeypatch)


@pytest.mark.usefixtures("sac_extras")
def test_sac_checks_its_out_before_it_trains(capsys: pytest.CaptureFixture[str],
                                             tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """An --out that cannot be written fails at once, not after the whole run."""
    from replay_fsm.trainers import run

    def never(config: object) -> None:
        raise AssertionError("trained although --out cannot be written")

    monkeypatch.setattr(run, "train", never)
    monkeypatch.setattr(run, "compare", never)
    taken = tmp_path / "a-file"
    taken.write_text("")
    for out in (taken, taken / "sac.json", tmp_path / "folder.json"):
        if out.suffix == ".json" and out.parent == tmp_path:
            out.mkdir()  # a .json path that is a folder
        err = one_line_error(capsys, main(["sac", "--env", "Pendulum-v1", "--ticks", "2",
                                           "--out", str(out), "--no-progress"]))
        assert ("a-file" if "a-file" in str(out) else "folder.json") in err, err
    # the plot written beside the result: it was found after the run (helper-38; the
    # result's own temporary file has a name of its own, which no folder takes)
    (tmp_path / "late2" / "r.png").mkdir(parents=True)
    err = one_line_error(capsys, main(["sac", "--env", "Pendulum-v1", "--ticks", "2",
                                       "--out", str(tmp_path / "late2" / "r.json"),
                                       "--no-progress"]))
    assert "r.png is a folder, where the run writes its plot" in err, err


@pytest.mark.usefixtures("sac_extras")
def test_an_out_that_is_a_file_is_named(capsys: pytest.CaptureFixture[str],
                                        tmp_path: Path) -> None:
    """demo and sac with --out naming a file: one line that says so, not errno 17."""
    taken = tmp_path / "a-file"
    taken.write_text("mine")
    for command in (["demo", "--ticks", "2"], ["sac", "--env", "Pendulum-v1", "--ticks", "2"]):
        err = one_line_error(capsys, main([*command, "--out", str(taken), "--no-progress"]))
        assert f"{taken} is a file" in err, err
    assert taken.read_text() == "mine"


@pytest.mark.usefixtures("sac_extras")
def test_an_out_through_a_dangling_link_is_named(capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path) -> None:
    """demo, sac and diagram with --out on a symbolic link to nothing: said "[Errno 17]
    File exists" of a path ``ls`` says is not there (helper-102)."""
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    for command in (["demo", "--ticks", "2", "--out", str(link), "--no-progress"],
                    ["sac", "--env", "Pendulum-v1", "--ticks", "2", "--out", str(link),
                     "--no-progress"],
                    ["diagram", "--out", str(link / "slot.mmd")]):
        err = one_line_error(capsys, main(command))
        assert f"a symbolic link to {tmp_path / 'gone'}, which is not a folder" in err, err
        assert str(link) in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link"]


def test_sac_checks_its_extras_before_it_trains(capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Without matplotlib the plot would fail after the whole run: sac refuses at once,
    naming what is missing and the extra that installs it."""
    from replay_fsm.trainers import cli as sac_cli
    from replay_fsm.trainers import run

    def never(config: object) -> None:
        raise AssertionError("trained although an extra is missing")

    monkeypatch.setattr(run, "train", never)
    monkeypatch.setattr(run, "compare", never)
    for gone in (("matplotlib",), ("gymnasium", "matplotlib")):
        monkeypatch.setattr(sac_cli, "find_spec",  # whatever this machine has installed
                            lambda name, gone=gone: None if name in gone else object())
        err = one_line_error(capsys, main(["sac", "--env", "Pendulum-v1", "--ticks", "2",
                                           "--out", str(tmp_path), "--no-progress"]))
        assert f"needs {' and '.join(gone)}: pip install 'replay-fsm[mujoco]'" in err, err


@pytest.mark.usefixtures("sac_extras")
def test_learner_threads_below_zero_is_named_as_the_option(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The error named the config's field and its None, which no command line gives."""
    for command in (["demo"], ["sac", "--env", "Pendulum-v1"]):
        err = one_line_error(capsys, main([*command, "--ticks", "2", "--learner-threads",
                                           "-1", "--out", str(tmp_path), "--no-progress"]))
        assert err.endswith("error: --learner-threads must be >= 0 (0: torch's default), "
                            "got -1\n"), err


@pytest.mark.usefixtures("sac_extras")
def test_warmup_steps_says_its_bound_in_help_readme_and_error(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--warmup-steps 0 was refused ("must be >= 1") where neither --help nor the README
    gave a bound, and the error did not say why: the first ticks draw their batches from
    the warm-up's rows, so none leaves nothing to sample (helper-104)."""
    err = one_line_error(capsys, main(["sac", "--env", "Pendulum-v1", "--ticks", "2",
                                       "--warmup-steps", "0", "--out", str(tmp_path),
                                       "--no-progress"]))
    assert err.endswith("error: --warmup-steps must be >= 1 (the first ticks' batches are "
                        "drawn from the warm-up's rows: with none there is nothing to "
                        "sample), got 0\n"), err
    with pytest.raises(SystemExit):
        main(["sac", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "before learning (>= 1: the first ticks' batches are drawn from them" in help_text
    readme = " ".join((Path(__file__).parent.parent / "README.md").read_text().split())
    assert "`--warmup-steps` (transitions of uniform random actions before learning, at " \
           "least 1:" in readme


@pytest.mark.usefixtures("sac_extras")
def test_learner_threads_past_the_bound_are_refused(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """100000 segfaulted in OpenMP (exit 139, no message) and 20000 aborted it
    (helper-69); the command says what it takes instead, before any thread starts."""
    for command in (["demo"], ["sac", "--env", "Pendulum-v1"]):
        err = one_line_error(capsys, main([*command, "--ticks", "2", "--learner-threads",
                                           "100000", "--out", str(tmp_path / "o"),
                                           "--no-progress"]))
        assert err.endswith("error: --learner-threads must be at most 256, got 100000\n")
    assert not (tmp_path / "o").exists()


@pytest.mark.usefixtures("sac_extras")
def test_sac_passes_its_liveness_timeout_to_the_run(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """The trainer's liveness_timeout (30 s) had no flag: a collector slow to build
    its environments failed the run with DataStalled, whatever the user knew."""
    import replay_fsm.trainers.run as run

    seen = []

    def train(config: Any) -> dict[str, Any]:
        seen.append(config.liveness_timeout)
        raise KeyboardInterrupt  # the run itself is not what this tests

    monkeypatch.setattr(run, "train", train)
    assert main(["sac", "--env", "Pendulum-v1", "--ticks", "2", "--liveness-timeout",
                 "90", "--out", str(tmp_path), "--no-progress"]) == 130
    assert seen == [90.0]
    capsys.readouterr()
    monkeypatch.undo()  # the real run, which checks its options first
    _as_if_sac_extras_were_there(monkeypatch)
    err = one_line_error(capsys, main(["sac", "--env", "Pendulum-v1", "--liveness-timeout",
                                       "-1", "--out", str(tmp_path), "--no-progress"]))
    assert "--liveness-timeout must be a finite number of seconds > 0, got -1.0" in err


STALLED = (r"tick 0 waits for {rows} rows \({what}\); the replay buffer has had \d+ for "
           r"\d+\.\d s \(--liveness-timeout\): is whatever adds the rows still running\?$")


@pytest.mark.usefixtures("sac_extras")
def test_a_warm_up_that_stops_filling_names_the_options_to_change(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """A collector whose environments hang in the warm-up: sac and demo said "tick 0
    waits for 64 rows (min_snapshot_ptr)", a parameter of the pipeline that no option
    sets; the rows come from --warmup-steps (sac) and --sample-count (demo). The
    bound is named as the option too, in --sampling sync's CollectorDied as well."""
    import re

    stall_the_warm_ups(monkeypatch)
    sac = ["sac", "--env", "Pendulum-v1", "--collector", "thread", "--num-envs", "2",
           "--batch-size", "32", "--updates-per-tick", "2", "--ticks", "3",
           "--warmup-steps", "64", "--hidden", "32", "--liveness-timeout", "1",
           "--no-progress"]
    err = one_line_error(capsys, main([*sac, "--out", str(tmp_path / "sac")]))
    assert re.search("replay-fsm sac: error: " + STALLED.format(
        rows=64, what=r"the warm-up's --warmup-steps, then --env-steps-per-tick x "
        r"--num-envs more a tick"), err), err
    err = one_line_error(capsys, main([*sac, "--sampling", "sync",
                                       "--out", str(tmp_path / "sync")]))
    assert re.search(r"replay-fsm sac: error: the SAC collector added no row for 1 s "
                     r"\(--liveness-timeout\) while the learner waited for 64 rows "
                     r"\(it has written \d+\)$", err), err
    err = one_line_error(capsys, main(["demo", "--collector", "thread", "--ticks", "2",
                                       "--sample-count", "1024", "--liveness-timeout", "1",
                                       "--no-progress", "--out", str(tmp_path / "demo")]))
    assert re.search("replay-fsm demo: error: " + STALLED.format(
        rows=4096, what=r"the warm-up, 4 x --sample-count"), err), err


def test_a_stall_names_the_option_whose_name_the_user_typed_as_a_value(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """``replay-fsm demo --out sample_count`` (a folder) whose warm-up stalled said
    "(the warm-up, 4 x sample_count)", 3 of 3: the rewrite of the message's text
    left alone every word the user had typed, the field's name among them. The
    message is built with the option's name now, whatever the values say; from
    Python, after the command, the config names its field again."""
    import re

    from replay_fsm.demo import DemoConfig

    stall_the_warm_ups(monkeypatch)
    monkeypatch.chdir(tmp_path)
    err = one_line_error(capsys, main(["demo", "--collector", "thread", "--ticks", "2",
                                       "--sample-count", "1024", "--liveness-timeout", "1",
                                       "--no-progress", "--out", "sample_count"]))
    assert re.search("replay-fsm demo: error: " + STALLED.format(
        rows=4096, what=r"the warm-up, 4 x --sample-count"), err), err
    with pytest.raises(ValueError, match="^sample_count must be an int >= 1, got 0$"):
        DemoConfig(sample_count=0)


def test_a_message_names_the_options_of_the_command_that_builds_it() -> None:
    """The library's messages name their settings (a stall's "(liveness_timeout)", a
    copy's "liveness_timeout 5 s"); built while a command names its options
    (``naming_settings(option_names(args))``) they name those, from any thread, and
    the settings it has no option for as they are; Python's names come back after."""
    import argparse
    import threading

    from replay_fsm.core import as_count
    from replay_fsm.errors import naming_settings, setting
    from replay_fsm.runtime.liveness import RowWatch
    from replay_fsm.trainers.cli import option_names

    args = argparse.Namespace(command="demo", fn=None, liveness_timeout=1.0,
                              sample_count=8, ticks=3, out="sample_count")
    assert option_names(args) == {"liveness_timeout": "--liveness-timeout",
                                  "sample_count": "--sample-count", "ticks": "--ticks",
                                  "out": "--out"}

    def stall() -> str:
        watch = RowWatch(1.0, setting("liveness_timeout"),
                         f"the warm-up, 4 x {setting('sample_count')}")
        assert watch.verdict(0, 32, 0, 0) is None
        return str(watch.verdict(0, 32, 0, 2_000_000_000))

    said = []
    with naming_settings(option_names(args)):
        said.append(stall())
        worker = threading.Thread(target=lambda: said.append(stall()))
        worker.start()
        worker.join()
        with pytest.raises(ValueError, match="^--ticks must be an int >= 1, got 0$"):
            as_count("ticks", 0, 1)
        with pytest.raises(ValueError, match="^capacity must be an int >= 1, got 0$"):
            as_count("capacity", 0, 1)  # no option of this command sets it
    assert said == ["tick 0 waits for 32 rows (the warm-up, 4 x --sample-count); the "
                    "replay buffer has had 0 for 2.0 s (--liveness-timeout): is whatever "
                    "adds the rows still running?"] * 2
    assert stall() == ("tick 0 waits for 32 rows (the warm-up, 4 x sample_count); the "
                       "replay buffer has had 0 for 2.0 s (liveness_timeout): is whatever "
                       "adds the rows still running?")


def test_names_of_overlapping_blocks_end_with_their_blocks() -> None:
    """Two threads' naming blocks (two commands run at once from Python) that end in
    another order than they began. Each block's end put back the names it found at
    its start: the first one's end took the second's names while it was still open
    ('second_setting', 1 of 1), and the second one's end brought back the first's,
    for every later message of the process ('--first-setting', 1 of 1). Each end
    takes back its own names only."""
    import threading

    from replay_fsm.errors import naming_settings, setting, setting_names

    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, str] = {}

    def first() -> None:
        with naming_settings({"first_setting": "--first-setting"}):
            first_in.set()
            assert second_in.wait(60)
            seen["first, both open"] = setting("second_setting")
        first_out.set()

    def second() -> None:
        assert first_in.wait(60)
        with naming_settings({"second_setting": "--second-setting"}):
            second_in.set()
            assert first_out.wait(60)
            seen["second, alone"] = setting("first_setting") + " " + setting("second_setting")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert seen == {"first, both open": "--second-setting",
                    "second, alone": "first_setting --second-setting"}
    assert (setting("first_setting"), setting("second_setting")) == ("first_setting",
                                                                     "second_setting")
    assert "first_setting" not in setting_names()


@pytest.mark.usefixtures("sac_extras")
def test_a_value_the_user_typed_is_not_written_as_an_option(
        capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder named as a field, given as a relative --out, is shown as it is: demo
    said "--sample-count is a file; --out names the output folder" of ``--out
    sample_count`` (3 of 3), sac "--num-envs is a file, not a folder" of ``--out
    num_envs/r.json``, and gymnasium's "Environment `batch_size` doesn't exist" of
    ``--env batch_size`` became "`--batch-size`" (helper-116)."""
    monkeypatch.chdir(tmp_path)
    for taken in ("sample_count", "num_envs"):
        (tmp_path / taken).write_text("mine")
    err = one_line_error(capsys, main(["demo", "--ticks", "2", "--out", "sample_count",
                                       "--no-progress"]))
    assert "error: sample_count is a file; --out names the output folder" in err, err
    err = one_line_error(capsys, main(["sac", "--env", "Pendulum-v1", "--ticks", "2",
                                       "--out", "num_envs/r.json", "--no-progress"]))
    assert "error: num_envs is a file, not a folder" in err, err
    err = one_line_error(capsys, main(["sac", "--env", "batch_size", "--ticks", "2",
                                       "--out", "o", "--no-progress"]))
    assert "Environment `batch_size` doesn't exist" in err, err


def test_python_dash_m_replay_fsm_is_the_command() -> None:
    out = subprocess.run([sys.executable, "-m", "replay_fsm", "diagram"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("stateDiagram-v2"), out.stderr


def test_version_and_defaults_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    import replay_fsm
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"replay-fsm {replay_fsm.__version__}"
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "slots in the ring (2-64) (default: 2)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["diagram", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps at the terminal's width
    assert "--out OUT a file (default: standard output) --highlight" in out, out


@pytest.mark.parametrize("command,first,after", [
    ("sac", "**1. The native API**", "**2. The seed's class**"),
    ("demo", "## The demo", "## Several GPUs")])
def test_the_readme_names_every_option_of_sac_and_demo(
        capsys: pytest.CaptureFixture[str], command: str, first: str, after: str) -> None:
    """Where the README documents the command: --env-steps-per-tick, --warmup-steps,
    --capacity, --ring-depth, --collector, --hidden, --seed, --learner-threads and
    --no-progress of sac were in its --help alone."""
    import re

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    section = readme[readme.index(first):readme.index(after)]
    with pytest.raises(SystemExit):
        main([command, "--help"])
    options = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", capsys.readouterr().out))
    options.discard("--help")
    assert len(options) > 8
    assert sorted(o for o in options if not re.search(rf"{o}(?![\w-])", section)) == []


@pytest.mark.parametrize("argv,unknown", [
    (["demo", "--bogus"], "--bogus"), (["check-trace", "a", "b"], "b"),
    (["explore", "--ticks", "2", "--depht", "3"], "--depht 3")])
def test_an_unknown_argument_gets_its_commands_usage(capsys: pytest.CaptureFixture[str],
                                                     argv: list[str], unknown: str) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: replay-fsm {argv[0]} "), err
    assert err.splitlines()[-1] == (f"replay-fsm {argv[0]}: error: unrecognized "
                                    f"arguments: {unknown}"), err


@pytest.mark.parametrize("argv", [["--bogus", "diagram"], ["--bogus", "demo", "--ticks", "3"]])
def test_an_unknown_argument_before_the_command_gets_the_top_level_usage(
        capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: replay-fsm [-h] [--version]"), err
    assert err.splitlines()[-1] == "replay-fsm: error: unrecognized arguments: --bogus", err


@pytest.mark.parametrize("argv,tail", [
    ([], ""), (["--bogus"], "; unrecognized arguments: --bogus"),
    (["--bogus", "-x"], "; unrecognized arguments: --bogus -x")])
def test_no_command_is_refused_naming_what_else_was_given(
        capsys: pytest.CaptureFixture[str], argv: list[str], tail: str) -> None:
    """argparse's own check of a required command named only the command missing, not
    an unknown argument given without one (``replay-fsm --bogus``)."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: replay-fsm [-h] [--version]"), err
    assert err.splitlines()[-1] == ("replay-fsm: error: the following arguments are "
                                    f"required: command{tail}"), err


def test_an_out_ending_in_json_in_any_case_names_the_file(tmp_path: Path) -> None:
    from replay_fsm.trainers.run import output_path

    for name in ("res.json", "res.JSON", "res.Json"):
        assert output_path(tmp_path / name) == tmp_path / name
    assert output_path(tmp_path / "res") == tmp_path / "res" / "sac.json"
    assert not (tmp_path / "res.JSON").exists()  # not made as a folder


def test_an_out_ending_in_json_and_a_slash_names_a_folder(tmp_path: Path) -> None:
    """``--out res.json/`` wrote a file res.json (Path drops the slash), not
    res.json/sac.json: the slash says folder, as the error for a folder named
    res.json tells the user to write."""
    from replay_fsm.trainers.run import output_path

    assert output_path(f"{tmp_path / 'res.json'}/") == tmp_path / "res.json" / "sac.json"
    assert (tmp_path / "res.json").is_dir()
    # "/." and "/./" say folder too (Path drops them as it drops the slash; helper-104)
    for folder in ("b.json/.", "c.json/./", "d.JSON//."):
        assert output_path(f"{tmp_path}/{folder}") == tmp_path / folder[:6] / "sac.json"
        assert (tmp_path / folder[:6]).is_dir()
    with pytest.raises(IsADirectoryError, match="write --out .*res.json/ to write into"):
        output_path(tmp_path / "res.json")


def test_a_result_is_written_when_only_its_plot_cannot_be(tmp_path: Path) -> None:
    """The paths beside the result are checked before the run, not by write(): a
    folder named like the plot, made during the run, must not cost the result."""
    from replay_fsm.trainers.run import write

    (tmp_path / "r.png").mkdir()
    assert write({"ticks": 3}, tmp_path / "r.json") == tmp_path / "r.json"
    assert json.loads((tmp_path / "r.json").read_text()) == {"ticks": 3}


@pytest.mark.parametrize("text, shown", [
    ("\n=====\nthe banner's title\n-----", "the banner's title"),  # torch's errors
    ("", "RuntimeError"),
])
def test_an_error_is_shown_by_its_first_line_that_says_something(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        text: str, shown: str) -> None:
    from replay_fsm.verify import explore

    def fails(*args: object, **kwargs: object) -> None:
        raise RuntimeError(text)

    monkeypatch.setattr(explore, "explore", fails)
    err = one_line_error(capsys, main(["explore", "--ticks", "1"]))
    assert err == f"replay-fsm explore: error: {shown}\n"


@pytest.mark.usefixtures("sac_extras")
def test_an_empty_out_is_refused_by_demo_and_sac_as_by_diagram(
        capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``--out ''`` (an unset shell variable) wrote the demo's and sac's files into the
    current folder while ``diagram`` refused it (helper-76b); it printed
    "/trace.json", a path in the root folder, before that. Refused before any run,
    with nothing written; ``--out .`` names the current folder."""
    monkeypatch.chdir(tmp_path)
    for argv in (["demo", "--ticks", "3", "--collector", "thread", "--sample-count",
                  "64", "--no-progress"], ["sac", "--ticks", "10", "--no-progress"]):
        err = one_line_error(capsys, main([*argv, "--out", ""]))
        assert "--out '' names no folder" in err and "--out ." in err, err
        assert list(tmp_path.iterdir()) == [], argv[0]


def command(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "replay_fsm", *args], capture_output=True,
                          text=True, timeout=MARGIN_S, **kw)  # type: ignore[call-overload]


def test_a_diagram_that_cannot_be_written_whole_keeps_the_earlier_file(tmp_path: Path
                                                                       ) -> None:
    """A file-size limit (or a full disk) cut the write: a half-written file was left
    in place of the earlier one (helper-43). It is written beside it, then renamed."""
    import resource

    out = tmp_path / "slot.dot"
    out.write_text("the earlier diagram\n")

    def limit() -> None:  # the dot source is 1.4 kB
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))

    done = command("diagram", "--format", "dot", "--out", str(out), preexec_fn=limit)
    assert done.returncode == 2 and "File too large" in done.stderr, done.stderr
    assert out.read_text() == "the earlier diagram\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["slot.dot"]  # no .part left
    assert main(["diagram", "--format", "dot", "--out", str(out)]) == 0
    assert out.read_text().startswith("digraph")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["slot.dot"]


def test_a_diagram_out_in_a_new_folder_makes_it(tmp_path: Path) -> None:
    """As the demo's --out: it was "[Errno 2] No such file or directory"."""
    out = tmp_path / "new" / "deeper" / "slot.mmd"
    assert main(["diagram", "--out", str(out)]) == 0
    assert out.read_text().startswith("stateDiagram-v2")


def test_a_closed_output_pipe_ends_the_command_quietly(tmp_path: Path) -> None:
    """`replay-fsm explore | head -1`: the reader left, and the command said
    "error: [Errno 32] Broken pipe", exit 2. Now the shell's code for SIGPIPE, and
    nothing on standard error."""
    import os
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes
    try:
        done = subprocess.run([sys.executable, "-m", "replay_fsm", "diagram"], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=MARGIN_S)
    finally:
        os.close(write)
    assert done.returncode == 141 and done.stderr == "", done.stderr


def test_sac_writes_its_files_when_its_output_pipe_closed(tmp_path: Path) -> None:
    """`replay-fsm sac ... | tee log` and a terminal's Ctrl-C, which ends tee too: the
    summary was printed before the files were written, so its closed pipe ended the
    command (141) with no sac.json or sac.png, the whole run lost, and an earlier
    run's files left in --out (helper-76b). The reader is gone before the run here."""
    pytest.importorskip("gymnasium")
    pytest.importorskip("matplotlib")
    import os
    out = tmp_path / "run"
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "replay_fsm", "sac", "--env", "Pendulum-v1",
             "--num-envs", "1", "--batch-size", "16", "--updates-per-tick", "1",
             "--ticks", "2", "--warmup-steps", "32", "--hidden", "8",
             "--collector", "thread", "--out", str(out), "--no-progress"],
            stdout=write, stderr=subprocess.PIPE, text=True, timeout=4 * MARGIN_S)
    finally:
        os.close(write)
    assert done.returncode == 141 and done.stderr == "", done.stderr
    assert json.loads((out / "sac.json").read_text())["ticks"] == 2
    assert (out / "sac.png").exists()


def test_a_broken_pipe_that_is_not_standard_output_is_the_commands_error(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """An --out FIFO whose reader left: every BrokenPipeError was taken for a closed
    standard output, whose descriptor was then pointed at /dev/null (in-process
    under a StringIO, it crashed on fileno(); helper-47). Only a closed standard
    output is quiet."""
    import errno

    from replay_fsm.verify import diagram

    def broken(highlight: object) -> str:
        raise BrokenPipeError(errno.EPIPE, "Broken pipe", "fifo")

    monkeypatch.setattr(diagram, "mermaid", broken)
    err = one_line_error(capsys, main(["diagram"]))
    assert "error: [Errno 32] Broken pipe: 'fifo'" in err, err


def test_a_dot_that_fails_is_quoted(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Its own message was dropped: "Command '[.../dot', '-Tsvg']' returned non-zero
    exit status 1"."""
    fake = tmp_path / "dot"
    fake.write_text("#!/bin/sh\necho 'Error: <stdin>: syntax error in line 3' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    err = one_line_error(capsys, main(["diagram", "--format", "svg"]))
    assert err.rstrip().endswith(
        "-Tsvg failed (exit code 1): Error: <stdin>: syntax error in line 3"), err


def _closing(fd: int) -> Any:
    """A ``preexec_fn`` that starts the command with ``fd`` closed (``>&-``, ``2>&-``):
    its ``sys.stdout`` or ``sys.stderr`` is None."""
    import os
    return lambda: os.close(fd)


def test_a_diagram_to_a_closed_standard_output_says_so(tmp_path: Path) -> None:
    """It said "error: 'NoneType' object has no attribute 'write'" (helper-54)."""
    done = command("diagram", preexec_fn=_closing(1))
    assert done.returncode == 2
    assert done.stderr == ("replay-fsm diagram: error: standard output is closed; name a "
                           "file with --out\n"), done.stderr


def test_a_demo_with_standard_error_closed_runs_without_its_bar(tmp_path: Path) -> None:
    """The progress bar wrote to a None stderr: the run failed at tick 0 with
    "'NoneType' object has no attribute 'write'" (helper-54). An error then went to
    standard output, into what the command writes."""
    done = command("demo", "--ticks", "3", "--collector", "thread", "--sample-count", "64",
                   "--out", str(tmp_path), preexec_fn=_closing(2))
    assert done.returncode == 0 and "error" not in done.stdout, done.stdout
    assert json.loads((tmp_path / "summary.json").read_text())["ticks"] == 3
    failed = command("check-trace", str(tmp_path / "missing.jsonl"), preexec_fn=_closing(2))
    assert failed.returncode == 2 and failed.stdout == ""


def test_a_diagram_out_under_a_file_says_it_is_a_file(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """It said "[Errno 17] File exists", the demo and sac "is a file" (helper-54)."""
    (tmp_path / "afile").write_text("x")
    err = one_line_error(capsys, main(["diagram", "--out", str(tmp_path / "afile" / "x.mmd")]))
    assert f"{tmp_path / 'afile'} is a file" in err


def test_an_empty_diagram_out_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """``--out ''`` (an unset shell variable) printed the diagram to standard output, as
    if --out had not been given (helper-63)."""
    err = one_line_error(capsys, main(["diagram", "--out", ""]))
    assert "--out '' names no file" in err and capsys.readouterr().out == ""


def test_a_demo_stopped_before_its_files_were_written_says_so(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """A second Ctrl-C while the collector is joined leaves run() before its files:
    the command ended with nothing said, and the folder's files an earlier run's."""
    import replay_fsm.demo

    def stopped(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(replay_fsm.demo, "run", stopped)
    assert main(["demo", "--ticks", "3", "--out", str(tmp_path), "--no-progress"]) == 130
    assert capsys.readouterr().out == (f"interrupted before the run's files were all "
                                       f"written; {tmp_path}/ may still hold an earlier "
                                       "run's\n")


def test_a_demo_stopped_while_it_writes_its_files_shows_them_and_the_stop(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """SIGTERM as the trace is written: every file is this run's, the summary is
    shown, and the exit code is SIGTERM's."""
    import os
    import signal

    from replay_fsm.runtime.tracer import Tracer

    write_chrome = Tracer.write_chrome

    def signalled(self: Tracer, *args: object, **kwargs: object) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        write_chrome(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Tracer, "write_chrome", signalled)
    assert main(["demo", "--ticks", "3", "--collector", "thread", "--sample-count", "64",
                 "--out", str(tmp_path), "--no-progress"]) == 143
    out = capsys.readouterr().out
    assert f"{tmp_path}/trace.json" in out and "trace conformance            ok" in out, out
    assert out.endswith("stopped by SIGTERM once its files were written\n"), out
    assert json.loads((tmp_path / "summary.json").read_text())["ticks"] == 3
