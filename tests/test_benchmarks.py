"""Keep the benchmark scripts alive: one quick smoke run, no timing assertion."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from .support import MARGIN_S

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.deep  # about 3 minutes: make verify runs it, CI does not
@pytest.mark.timeout(900)  # every benchmark once, on a machine that may be busy
def test_bench_quick_runs_and_writes_results() -> None:
    out = subprocess.run([sys.executable, "benchmarks/run_all.py", "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    for name in ("core_overhead", "packing", "learner_overhead", "learner_loop",
                 "cpu_split", "interference", "cost_model", "checkpoint"):
        data = json.loads((ROOT / "benchmarks/results" / f"{name}-quick.json").read_text())
        assert data["quick"] and data["figures"] and data["machine"]["torch"]
    assert "synchronous sampling" in out.stdout
    loop = json.loads((ROOT / "benchmarks/results/learner_loop-quick.json").read_text())
    for regime in ("compute-bound", "balanced", "data-bound"):
        columns = loop["figures"][regime]["columns"]
        assert set(columns) == {"load0", "load1"}
        assert "bare double buffer (floor)" in columns["load0"]  # the co-run floor
    assert loop["figures"]["verdicts"]  # the budget's claims are checked, pass or not


def test_readme_performance_section_is_generated_from_the_json() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import readme_perf
    finally:
        sys.path.pop(0)
    readme = (ROOT / "README.md").read_text()
    assert readme_perf.section() in readme
    assert readme_perf.checkpoint_section() in readme


def _load_benchmark(name: str):  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


def test_verdicts_come_from_the_medians_and_record_each_round() -> None:
    """A claim holds on the rounds' medians; its detail keeps each round's ratio, and
    the README counts a claim whose rounds straddle its bound as undecided."""
    loop = _load_benchmark("learner_loop")
    readme_perf = _load_benchmark("readme_perf")

    def row(*round_ms: float) -> dict[str, object]:
        ordered = sorted(round_ms)
        return {"mean_tick_ms": ordered[len(ordered) // 2], "round_ms": list(round_ms),
                "tick_over_ideal": 1.0}

    def column(ours: tuple[float, float, float]) -> dict[str, object]:
        return {"compute only (ideal)": row(10, 10, 10), "bare gather only": row(5, 5, 5),
                "synchronous sampling": row(20, 20, 20),
                "torchrl ReplayBuffer prefetch=1": row(30, 30, 30),
                "torchrl ReplayBuffer prefetch=2": {"missing": "not installed"},
                loop.BareDoubleBuffer.name: row(10, 10, 10), loop.LIKE_FOR_LIKE: row(*ours),
                loop.PINNED: row(10, 10, 10),
                loop.NO_LEARNER_PACKS: row(99, 99, 99)}  # the control: never held to it

    result = {regime: {"columns": {"load0": column((10, 10.1, 10.1)),
                                   "load1": column((19, 21, 22))}}
              for regime in loop.REGIMES}
    verdicts = loop.verdicts(result)
    detail = result["verdict_detail"]
    every = "balanced load1: every replay_fsm row <= synchronous"
    assert verdicts[every] is False  # median 21 > 20, though round 0 was below
    assert detail[every]["ratio"] == 21 / 20 and detail[every]["bound"] == 1.0
    assert detail[every]["rounds"] == [19 / 20, 21 / 20, 22 / 20]
    like = (f"compute-bound load0: {loop.LIKE_FOR_LIKE} <= 1.02 x bare double buffer "
            "(the pipeline adds nothing to the co-run floor)")
    assert verdicts[like] is True and detail[like]["ratio"] == 10.1 / 10
    assert verdicts["data-bound load0: best replay_fsm row (pinned included) <= 1.05 x "
                    "max(compute, bare gather)"] is True
    assert verdicts["balanced load1: best replay_fsm <= every other prefetcher"] is True
    result["balanced"]["columns"]["load1"]["compute only (ideal)"]["round_ms"] = [8, 10, 12]
    spread = readme_perf._round_spread(result, list(loop.REGIMES))
    assert spread == (0.0, 0.5)  # every column still, but one: 12 / 8 - 1
    text = "\n".join(readme_perf._verdicts(verdicts, detail, spread))
    assert "- **missed**: " + every + ": 1.050 (bound 1.00; rounds 0.950-1.100)" in text
    # The three "every row" claims at load1 straddle 1.0; nothing else does.
    assert f"In 3 of these {len(verdicts)} claims the rounds fall on both sides" in text
    assert "varied by 0% to 50% between its fastest and slowest round" in text


@pytest.mark.deep  # about a minute: make verify runs it, CI does not
@pytest.mark.timeout(600)  # four fresh processes, two of them spawn a packer
def test_compare_revisions_measures_each_revision_in_its_own_process() -> None:
    """Comparing HEAD with this checkout: one round measures the library of each
    revision (the measuring process refuses a replay_fsm from anywhere else), records
    which commit was the base, gives every figure a ratio, and leaves no worktree."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout.strip()
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=ROOT, check=True,
                               capture_output=True, text=True).stdout
    out = subprocess.run([sys.executable, "benchmarks/compare_revisions.py", "HEAD",
                          "--rounds", "1", "--quick"], cwd=ROOT, capture_output=True,
                         text=True, timeout=540)  # before the test's own timeout
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads((ROOT / "benchmarks/results/compare_revisions-quick.json")
                      .read_text())
    assert data["config"]["base_sha"] == data["config"]["head_sha"] == head
    figures = data["figures"]
    assert set(figures) == {"warm_thread", "warm_process", "cold_thread",
                            "cold_process", "cold_handoff"}
    for f in figures.values():
        assert f["base_us"] > 0 and f["this_us"] > 0
        assert f["ratio_median"] == pytest.approx(f["this_us"] / f["base_us"])
    assert subprocess.run(["git", "worktree", "list"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout == worktrees


def test_compare_revisions_refuses_a_library_from_elsewhere(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The measuring side checks where replay_fsm came from: a figure measured on
    the wrong revision would be a ratio of the same code."""
    compare = _load_benchmark("compare_revisions")
    with pytest.raises(RuntimeError, match="replay_fsm came from"):
        compare.measure(tmp_path, quick=True)
    with pytest.raises(SystemExit) as exit_info:
        compare.main(["no-such-revision-anywhere"])
    assert exit_info.value.code == 2
    assert "'no-such-revision-anywhere' is not a revision" in capsys.readouterr().err


@pytest.mark.timeout(300)  # seconds here; a busy machine may take minutes
def test_compare_revisions_paired_measures_both_revisions_in_one_process() -> None:
    """--paired imports BASE's package and this checkout's (twice: the A/A control)
    side by side in this process and reports A/B and A/A ratios per figure, each the
    median of its rounds' ratios. With BASE the same code as this checkout, the run
    says so, and its A/B is built as its A/A is: three copies of one code. No worktree
    and no copy's modules are left behind."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    import statistics
    compare = _load_benchmark("compare_revisions")
    git = ["git", "-C", str(ROOT)]
    worktrees = subprocess.run([*git, "worktree", "list"], check=True,
                               capture_output=True, text=True).stdout
    clean = not subprocess.run([*git, "status", "--porcelain", "--", "replay_fsm"],
                               check=True, capture_output=True, text=True).stdout
    result = compare.paired("HEAD", rounds=3, quick=True, collectors=("thread",))
    assert result["mode"] == "paired" and result["base_sha"] == result["head_sha"]
    sides = result["sides"]
    assert [sides[s]["module"] for s in ("base", "this", "this_again")] == [
        "replay_fsm_base", "replay_fsm", "replay_fsm_again"]
    assert sides["this"]["package_digest"] == sides["this_again"]["package_digest"]
    assert result["same_code"] is clean is (
        sides["base"]["package_digest"] == sides["this"]["package_digest"])
    assert set(result["figures"]) == {"warm_thread", "cold_thread", "cold_handoff"}
    for key, f in result["figures"].items():
        rounds = result["by_round"][key]
        assert len(rounds) == 3
        for ratio, over in (("ab", "base"), ("aa", "this_again")):
            ratios = [r["this"] / r[over] for r in rounds]
            assert f[f"{ratio}_ratio_median"] == statistics.median(ratios)
            assert f[f"{ratio}_ratio_min"] == min(ratios) > 0
            assert f[f"{ratio}_ratio_max"] == max(ratios)
        for side in ("base", "this", "this_again"):
            assert f[f"{side}_us"] == statistics.median(r[side] for r in rounds) > 0
    assert not [m for m in sys.modules if m.split(".")[0] in ("replay_fsm_base",
                                                               "replay_fsm_again")]
    assert subprocess.run([*git, "worktree", "list"], check=True, capture_output=True,
                          text=True).stdout == worktrees


def test_compare_revisions_paired_blocks_and_ratios() -> None:
    """Each round measures every side twice, ABCCBA, the first side rotating; a
    figure's A/B is this checkout over BASE and its A/A this checkout over its second
    copy; a pipeline holding another copy's object is found."""
    compare = _load_benchmark("compare_revisions")
    orders = [compare.block_order(r) for r in range(3)]
    assert orders[0] == ["base", "this", "this_again", "this_again", "this", "base"]
    assert sorted(o[0] for o in orders) == ["base", "this", "this_again"]
    for order in orders:
        assert order[3:] == order[2::-1] and sorted(order[:3]) == sorted(compare.SIDES)
    f = compare.summarize([{"base": 20.0, "this": 10.0, "this_again": 10.0},
                           {"base": 40.0, "this": 10.0, "this_again": 12.5}])
    assert (f["ab_ratio_min"], f["ab_ratio_max"]) == (0.25, 0.5)
    assert (f["aa_ratio_min"], f["aa_ratio_max"], f["aa_ratio_median"]) == (0.8, 1.0, 0.9)
    assert f["base_us"] == 30.0

    class Part:  # stands for a class of another copy of the package
        pass
    Part.__module__ = "replay_fsm_base.runtime.links"
    holder = type("Pipe", (), {})()
    holder.__class__.__module__ = "replay_fsm.runtime.pipeline"
    holder.link = [Part()]  # type: ignore[attr-defined]
    family = ("replay_fsm", "replay_fsm_base", "replay_fsm_again")
    assert compare.foreign_parts(holder, "replay_fsm", family) == [
        "replay_fsm_base.runtime.links." + Part.__qualname__]
    assert compare.foreign_parts(holder, "replay_fsm_base", family) == [
        "replay_fsm.runtime.pipeline.Pipe"]


def test_compare_revisions_stops_a_measuring_process_that_outruns_its_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A measuring process past its time is stopped with its whole process group,
    and the timeout reaches the caller."""
    compare = _load_benchmark("compare_revisions")
    monkeypatch.setattr(compare, "MEASURE_TIMEOUT_S", 0.5)
    started: list[subprocess.Popen[str]] = []
    popen = subprocess.Popen

    def recording(*args: Any, **kwargs: Any) -> subprocess.Popen[str]:
        started.append(popen(*args, **kwargs))
        return started[-1]
    monkeypatch.setattr(compare.subprocess, "Popen", recording)
    with pytest.raises(subprocess.TimeoutExpired):
        compare.run_one(ROOT, quick=True)
    (child,) = started
    assert child.returncode is not None  # stopped and reaped
    # What it started leaves too: its resource tracker ends once it is gone. A
    # process of another parent cannot be waited on, so its group is polled.
    deadline = time.monotonic() + MARGIN_S
    while True:
        try:
            os.killpg(child.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "a process of its group outlived it"
        time.sleep(0.05)


def test_cpu_split_counts_each_thread_under_its_role() -> None:
    """The split names each thread's CPU: the double buffer's gather thread, the
    collectors' packer thread or process and transfer thread, and none under another's
    role; a thread that ran before the contender opened is not counted as its own."""
    import threading

    import torch

    from replay_fsm import ReplayBuffer

    split = _load_benchmark("cpu_split")
    loop = _load_benchmark("learner_loop")
    if split.unsupported() is not None:
        pytest.skip(split.unsupported())
    rb = ReplayBuffer(4096, 40, 4)  # wider than the step's first layer reads
    rb.add_packed(torch.randn(4096, rb.width))
    dev = torch.device("cpu")
    compute = loop.make_compute(rb.width, 16, 0, dev)
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            sum(range(1000))
    # Busy, and named as a packer would be, but started before the contender opens.
    bystander = threading.Thread(target=busy, name="bystander-packer", daemon=True)
    bystander.start()
    try:
        floor = split.measure(loop.BareDoubleBuffer(rb, 1024, compute, dev), 4)
    finally:
        stop.set()
        bystander.join()
    assert floor["gather thread"] > 0 and floor["learner thread"] > 0
    assert floor["packer thread"] == floor["transfer thread"] == floor["packer process"] == 0
    # learner_packs off: on a loaded machine the learner, waiting, packed every batch
    # itself (and submitted it on its thread), and the packer and transfer threads
    # were seen with no CPU at all
    ours = split.measure(loop.ReplayFSM(rb, 1024, compute, dev, "thread", 2,
                                        learner_packs=False), 4)
    assert ours["packer thread"] > 0 and ours["transfer thread"] > 0
    assert ours["gather thread"] == ours["packer process"] == 0
    assert ours["wall"] > 0
    spawned = split.measure(loop.ReplayFSM(rb, 1024, compute, dev, "process", 2,
                                           learner_packs=False), 4)
    assert spawned["packer process"] > 0 and spawned["transfer thread"] > 0
    assert spawned["packer thread"] == spawned["gather thread"] == 0


def test_cpu_split_reads_a_process_clock_that_counts_all_its_cpu() -> None:
    """A packer process's CPU clock, read as cpu_split reads it, is the process's
    whole CPU time: read on this process around CPU work, it covers at least what
    this process's own clock counted in between."""
    import os

    split = _load_benchmark("cpu_split")
    if split.unsupported() is not None:
        pytest.skip(split.unsupported())
    outer0 = split.process_cpu_s(os.getpid())
    inner0 = time.process_time()
    sum(i * i for i in range(200_000))
    inner1 = time.process_time()
    outer1 = split.process_cpu_s(os.getpid())
    assert inner1 > inner0
    assert outer1 - outer0 >= inner1 - inner0
    assert split.process_cpu_s(2**22 + 1) is None  # above Linux's pid limit: no process


def _loop_result(cpu: str, date: str | None, verdicts: dict[str, bool],
                 floor: float) -> dict[str, Any]:
    result: dict[str, Any] = {
        "name": "learner_loop", "quick": False,
        "machine": {"cpu": cpu, "cpus": 2, "python": "3.11", "torch": "2"},
        "figures": {"verdicts": verdicts,
                    "verdict_detail": {c: {"ratio": 0.9 if ok else 1.2, "bound": 1.0,
                                           "rounds": [0.8, 1.3]}
                                       for c, ok in verdicts.items()},
                    "compute-bound": {"double_buffer": {"load0": {"over_ideal": floor}}}}}
    if date is not None:
        result["date"] = date
    return result


def test_each_kept_machine_gets_a_column_of_the_claims(tmp_path: Path, monkeypatch
                                                       ) -> None:
    """The README sets the claims of every machine kept side by side, oldest first; a
    claim a machine's run did not check says so, and one machine alone adds nothing."""
    common = _load_benchmark("common")
    readme_perf = _load_benchmark("readme_perf")
    monkeypatch.setattr(common, "BY_MACHINE", tmp_path / "by_machine")
    monkeypatch.setattr(readme_perf, "RESULTS", tmp_path)
    run = tmp_path / "learner_loop.json"
    new = _loop_result("Intel(R) Xeon(R) Processor", "2026-12-05",
                       {"a <= sync": True, "b <= 1.05 x compute": True}, 0.973)
    new["machine"]["last_level_cache_mib"] = 260.0
    run.write_text(json.dumps(new))
    kept = common.keep_by_machine(run)
    assert kept == tmp_path / "by_machine" / "learner_loop-intel-xeon-2cpu.json"
    assert json.loads(kept.read_text()) == new
    assert readme_perf._by_machine() == []  # one machine: its own tables say it all
    run.write_text(json.dumps(_loop_result("AMD EPYC 7B13 64-Core Processor", "2026-12-02",
                                           {"a <= sync": False}, 1.224)))
    assert common.keep_by_machine(run).name == "learner_loop-amd-epyc-7b13-64-core-2cpu.json"
    text = "\n".join(readme_perf._by_machine())
    assert ("| claim | AMD EPYC 7B13 64-Core, 2 cores, 2026-12-02 | Intel Xeon, 2 cores, "
            "260 MiB last-level cache, 2026-12-05 |") in text
    assert "| a <= sync | **missed** 1.200 (0.800-1.300) | holds 0.900 (0.800-1.300) |" in text
    assert "| b <= 1.05 x compute | not measured | holds 0.900 (0.800-1.300) |" in text
    assert "compute-bound, 0 bg | 1.224 | 0.973 |" in text
    assert "| claims that hold | 0 of 1 | 2 of 2 |" in text
    assert "ring depth" not in text  # neither run has the depth rows
    # The Intel run's depth-3 rows beat its depth-2 rows in 5 of its 6 cells with one
    # background process; the AMD run has no such rows.
    for regime, slower in (("compute-bound", ""), ("balanced", ""), ("data-bound", "process")):
        new["figures"][regime] = {"columns": {"load1": {
            f"replay_fsm {collector} collector, depth {depth}": {
                "mean_tick_ms": 10.0 + (depth == 3) * (1 if collector == slower else -1)}
            for collector in ("thread", "process") for depth in (2, 3)}}}
    new["figures"]["compute-bound"]["double_buffer"] = {"load0": {"over_ideal": 0.973}}
    kept.write_text(json.dumps(new))
    text = "\n".join(readme_perf._by_machine())
    assert ("| ring depth 3 ahead of depth 2, 1 bg (both collectors, every regime) | not "
            "measured | 5 of 6 |") in text
    assert "0 bg (both collectors" not in text  # no run has that column


def test_the_last_level_cache_is_read_from_the_deepest_level(tmp_path: Path) -> None:
    common = _load_benchmark("common")
    for name, level, size in (("index0", "1", "48K"), ("index3", "3", "266240K"),
                              ("index2", "2", "2M"), ("index9", "x", "1G")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "level").write_text(level + "\n")
        (tmp_path / name / "size").write_text(size + "\n")
    assert common.last_level_cache_mib(tmp_path) == 260.0  # index9's level is unreadable
    assert common.last_level_cache_mib(tmp_path / "none") is None


def test_the_learner_calls_of_each_kept_machine_are_set_side_by_side(
        tmp_path: Path, monkeypatch) -> None:
    readme_perf = _load_benchmark("readme_perf")
    monkeypatch.setattr(readme_perf, "RESULTS", tmp_path)
    (tmp_path / "by_machine").mkdir()

    def keep(cpu: str, date: str, figures: dict[str, float]) -> None:
        (tmp_path / "by_machine" / f"learner_overhead-{cpu}.json").write_text(json.dumps(
            {"name": "learner_overhead", "date": date, "figures": figures,
             "machine": {"cpu": cpu, "cpus": 2}}))

    keep("B", "2026-12-05", {"depth2_us_median": 33.8, "depth2_us_p99": 86.2,
                             "cold_thread_us_median": 137.1, "cold_thread_us_p99": 215.7,
                             "cold_thread_over_handoff": 3.35})
    assert readme_perf._overhead_by_machine() == []
    keep("A", "2026-12-02", {"depth2_us_median": 24.6, "depth2_us_p99": 42.1})
    text = "\n".join(readme_perf._overhead_by_machine())
    assert "| calls | A, 2 cores, 2026-12-02 | B, 2 cores, 2026-12-05 |" in text
    assert "| batch ready, packer idle (depth 2) | 24.6 / 42.1 | 33.8 / 86.2 |" in text
    assert ("| caches evicted, thread collector | not measured | 137.1 / 215.7 (3.4 x) |"
            in text)


def test_the_gpu_check_writes_its_scripts_and_refuses_a_machine_without_cuda(
        tmp_path: Path) -> None:
    """benchmarks/gpu_check.sh, the one script a session lent a GPU runs: its Python
    parts compile, it names the tests it selects as they are, and where torch has no
    CUDA device it says so and fails (exit 1) instead of reporting a pass."""
    script = ROOT / "benchmarks/gpu_check.sh"
    env = {**os.environ, "OUT": str(tmp_path), "PY": sys.executable}
    out = subprocess.run(["bash", str(script)], cwd=ROOT, env={**env, "GPU_CHECK_WRITE_ONLY": "1"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    for name in ("probe.py", "war.py"):
        source = (tmp_path / "scripts" / name).read_text()
        compile(source, name, "exec")
    text = script.read_text()
    for test in ("test_fields_on_the_device_are_stored_on_the_host",
                 "test_on_cuda_the_slots_are_pinned_until_close_and_each_copy_is_the_seeds_span"):
        assert test in text
        assert any(f"def {test}(" in p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: the check itself would run")
    out = subprocess.run(["bash", str(script)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1
    assert "no CUDA device" in (tmp_path / "summary.txt").read_text()


def test_run_all_refuses_a_device_before_it_runs_anything() -> None:
    """A misspelt --device, or CUDA where there is none, is refused at once (exit 2),
    not after minutes of the benchmarks that come before the learner loop, which
    alone uses it."""
    import torch
    devices = ["nosuch", "meta"] + ([] if torch.cuda.is_available() else ["cuda"])
    for device in devices:
        out = subprocess.run([sys.executable, "benchmarks/run_all.py", "--quick",
                              "--device", device], cwd=ROOT, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
        assert f"argument --device: '{device}'" in out.stderr
        assert out.stdout == ""  # no benchmark's table


def _readme_perf_copy(tmp_path: Path) -> Path:
    """readme_perf.py, the results it reads and the README, copied as they sit in the
    checkout: the script finds both from where it lies, so it runs on the copies."""
    import shutil
    (tmp_path / "benchmarks").mkdir()
    shutil.copy(ROOT / "benchmarks/readme_perf.py", tmp_path / "benchmarks")
    shutil.copytree(ROOT / "benchmarks/results", tmp_path / "benchmarks/results",
                    ignore=shutil.ignore_patterns("*-quick.*"))
    shutil.copy(ROOT / "README.md", tmp_path)
    return tmp_path / "README.md"


def test_readme_perf_help_and_check_write_nothing(tmp_path: Path) -> None:
    """`readme_perf.py --help` prints its usage, and `--check` says whether the README
    is what the results make (exit 1 with the difference when not); neither writes.
    Once the script took no arguments: any of them rewrote README.md, silently."""
    readme = _readme_perf_copy(tmp_path)
    stale = readme.read_text().replace("| compute only (ideal) | 1.000 |",
                                       "| compute only (ideal) | 9.999 |", 1)
    assert stale != readme.read_text()
    readme.write_text(stale)
    script = [sys.executable, str(tmp_path / "benchmarks/readme_perf.py")]
    out = subprocess.run([*script, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "usage:" in out.stdout and "--check" in out.stdout
    assert readme.read_text() == stale
    out = subprocess.run([*script, "--check"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "-| compute only (ideal) | 9.999 |" in out.stdout
    assert readme.read_text() == stale
    out = subprocess.run([*script, "--bogus"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unrecognized arguments: --bogus" in out.stderr
    assert readme.read_text() == stale
    out = subprocess.run(script, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "regenerated" in out.stdout
    assert "| compute only (ideal) | 1.000 |" in readme.read_text()
    out = subprocess.run([*script, "--check"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout


def test_a_result_from_another_machine_says_which(tmp_path: Path, monkeypatch) -> None:
    """The section's first line names the learner loop's machine; a result file run on
    another machine (cpu_split.json was, once) says so where it is shown, and one from
    the same machine adds nothing."""
    import shutil
    readme_perf = _load_benchmark("readme_perf")
    for path in (ROOT / "benchmarks/results").glob("*.json"):
        if not path.name.endswith("-quick.json"):
            shutil.copy(path, tmp_path)
    monkeypatch.setattr(readme_perf, "RESULTS", tmp_path)

    def set_machine(name: str, cpu: str) -> None:
        data = json.loads((tmp_path / f"{name}.json").read_text())
        data["machine"]["cpu"], data["machine"]["cpus"] = cpu, 2
        (tmp_path / f"{name}.json").write_text(json.dumps(data))

    for name in ("learner_loop", "cpu_split", "interference", "cost_model",
                 "core_overhead", "learner_overhead", "packing"):
        set_machine(name, "AMD EPYC")
    text = readme_perf.section()
    assert "Measured on AMD EPYC (2 cores)" in text and "another machine" not in text
    set_machine("cpu_split", "Intel(R) Xeon(R) Processor")
    set_machine("interference", "Intel(R) Xeon(R) Processor")
    set_machine("packing", "Intel(R) Xeon(R) Processor")
    text = readme_perf.section()
    assert ("(`benchmarks/cpu_split.py`, a run of its own on another machine (Intel Xeon, "
            "2 cores), with its own calibration") in text
    assert "shows the GIL wait; measured on another machine (Intel Xeon, 2 cores))" in text
    assert ("**Micro figures** (`packing.json` on another machine (Intel Xeon, 2 cores))"
            in text)
    assert "**Cost model**: tick" in text  # the same machine as the first line's


def test_sb3_buffer_refuses_no_rounds(capsys: pytest.CaptureFixture[str]) -> None:
    """`sb3_buffer.py --rounds 0` is refused as compare_revisions' is (exit 2, the
    option named), not with statistics' "no median for empty data" after it ran."""
    sb3 = _load_benchmark("sb3_buffer")
    for rounds in ("0", "-2"):
        with pytest.raises(SystemExit) as exit_info:
            sb3.main(["--rounds", rounds])
        assert exit_info.value.code == 2
        assert f"--rounds must be >= 1, got {rounds}" in capsys.readouterr().err


def test_every_result_file_says_the_day_it_was_measured() -> None:
    """Each kept result carries its date (README tables by machine order runs by it);
    the files written before write_result recorded one got theirs from git, and say
    so."""
    import re
    paths = [p for p in (ROOT / "benchmarks/results").rglob("*.json")
             if not p.name.endswith("-quick.json")]
    assert paths
    undated = [p.name for p in paths
               if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", str(json.loads(p.read_text())
                                                             .get("date")))]
    assert undated == []


def test_the_benchmarks_that_write_their_own_files_record_the_date(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """sb3_buffer.py and sac_mujoco.py write their result files without write_result;
    both wrote no date (and sb3_buffer no "quick")."""
    common = _load_benchmark("common")
    sb3 = _load_benchmark("sb3_buffer")
    sac = _load_benchmark("sac_mujoco")
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(sb3, "timed_learn", lambda case, pipeline, steps: 1.0)
    day = time.strftime("%Y-%m-%d", time.gmtime())  # the day before a run, or after it
    assert sb3.main(["--quick"]) == 0
    written = json.loads((tmp_path / "sb3_buffer-quick.json").read_text())
    assert written["quick"] is True and written["figures"]["SAC Pendulum-v1"]["steps"] == 200
    assert written["date"] in (day, time.strftime("%Y-%m-%d", time.gmtime()))
    result = {"runs": {"pipeline": {"updates": 1}}, "speedup_vs_sync": 1.0,
              "bit_identical": True}
    monkeypatch.setattr(sac, "compare", lambda config: dict(result))
    monkeypatch.setattr(sac, "plot", lambda runs, path, title: path)
    monkeypatch.setattr(sac, "summary", lambda result: "")
    day = time.strftime("%Y-%m-%d", time.gmtime())
    assert sac.main(["--quick", "--out", str(tmp_path), "--no-progress"]) == 0
    written = json.loads((tmp_path / "sac_mujoco-quick.json").read_text())
    assert written["date"] in (day, time.strftime("%Y-%m-%d", time.gmtime()))


def test_the_cost_model_names_in_its_json_the_plot_it_drew(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plot is drawn before the JSON is written, and the JSON names it: written
    first, it never did, and the README's section showed no plot. Where none can be
    drawn, the JSON says so and an earlier run's plot goes."""
    common = _load_benchmark("common")
    cost = _load_benchmark("cost_model")
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(cost, "RESULTS", tmp_path)
    drawn: list[Path] = []

    def plot(figures: dict[str, Any], path: Path) -> bool:
        path.write_bytes(b"png")
        drawn.append(path)
        return True
    monkeypatch.setattr(cost, "plot", plot)
    path = cost.save({"sweeps": {}}, {"ticks": 5}, quick=True)
    assert drawn == [tmp_path / "cost_model-quick.png"]
    assert json.loads(path.read_text())["figures"]["plot"] == "cost_model-quick.png"
    monkeypatch.setattr(cost, "plot", lambda figures, path: False)  # no matplotlib
    path = cost.save({"sweeps": {}}, {"ticks": 5}, quick=True)
    assert json.loads(path.read_text())["figures"]["plot"] is None
    assert not drawn[0].exists()  # not an earlier run's plot beside these figures


def test_a_cost_model_plot_that_raises_loses_none_of_the_figures(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plot drawn before the JSON is written: one that raised (matplotlib's
    own error, a full disk) lost the run's figures with it, minutes of them, where
    the JSON written first had kept them. They are written, then the error raised."""
    common = _load_benchmark("common")
    cost = _load_benchmark("cost_model")
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(cost, "RESULTS", tmp_path)

    def plot(figures: dict[str, Any], path: Path) -> bool:
        path.write_bytes(b"half a png")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(cost, "plot", plot)
    with pytest.raises(OSError, match="No space left"):
        cost.save({"sweeps": {}, "model_error_max": 0.1}, {"ticks": 5}, quick=True)
    kept = json.loads((tmp_path / "cost_model-quick.json").read_text())
    assert kept["figures"] == {"sweeps": {}, "model_error_max": 0.1, "plot": None}
    assert not (tmp_path / "cost_model-quick.png").exists()
