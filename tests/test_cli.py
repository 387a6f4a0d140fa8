"""The command line as a stranger meets it: wrong files, unavailable devices and bad
numbers give one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replay_fsm.cli import main


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
    assert "not JSON lines" in one_line_error(capsys, main(["check-trace", str(bad)]))


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
    assert "empty" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_demo_on_a_missing_device(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    err = one_line_error(capsys, main(["demo", "--device", "cuda", "--ticks", "2",
                                       "--out", str(tmp_path), "--no-progress"]))
    assert "cuda" in err and "not" in err


def test_demo_with_bad_numbers(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    err = one_line_error(capsys, main(["demo", "--ticks", "0", "--out", str(tmp_path)]))
    assert "ticks must be an int >= 1, got 0" in err
    err = one_line_error(capsys, main(["demo", "--ring-depth", "1", "--ticks", "2",
                                       "--out", str(tmp_path), "--no-progress"]))
    assert "ring_depth" in err


def test_explore_with_a_bad_depth(capsys: pytest.CaptureFixture[str]) -> None:
    assert "ring_depth" in one_line_error(capsys, main(["explore", "--depth", "1"]))


def test_the_console_script_runs_as_installed() -> None:
    out = subprocess.run([sys.executable, "-m", "replay_fsm.cli", "diagram"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("stateDiagram-v2"), out.stderr
