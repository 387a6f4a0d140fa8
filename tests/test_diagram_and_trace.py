"""Diagrams drawn from the table, committed copies that must not drift, traces
that open in Perfetto, and conformance of recorded logs."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from replay_fsm import Pipeline, ReplayBuffer
from replay_fsm.cli import main
from replay_fsm.spec import TRANSITIONS, SlotState
from replay_fsm.verify import diagram
from replay_fsm.verify.conformance import TraceFileError, check, load

ROOT = Path(__file__).resolve().parent.parent


def test_mermaid_has_every_row_and_only_those() -> None:
    text = diagram.mermaid()
    arrows = re.findall(r"^    (\w+) --> (\w+): (\w+)", text, re.M)
    assert sorted(arrows) == sorted((t.source.name, t.dest.name, t.event.value)
                                    for t in TRANSITIONS)
    assert "class HOT highlight" in diagram.mermaid(SlotState.HOT)


def test_dot_has_every_row() -> None:
    text = diagram.dot(SlotState.READY)
    arrows = re.findall(r"^    (\w+) -> (\w+) \[label=\"(\w+)", text, re.M)
    assert sorted(arrows) == sorted((t.source.name, t.dest.name, t.event.value)
                                    for t in TRANSITIONS)
    assert 'READY [label="READY", style="rounded,filled"' in text


def test_committed_diagrams_match_the_table() -> None:
    """Regenerate with: replay-fsm diagram --out specs/diagrams/slot.mmd, --format svg
    --out specs/diagrams/slot.svg and --format sequence --out specs/diagrams/tick.mmd."""
    assert (ROOT / "specs/diagrams/slot.mmd").read_text() == diagram.mermaid()
    assert (ROOT / "specs/diagrams/tick.mmd").read_text() == diagram.sequence()
    svg = (ROOT / "specs/diagrams/slot.svg").read_text()
    assert f"replay_fsm dot sha256 {diagram.dot_digest()}" in svg


def test_readme_shows_the_generated_diagrams() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "```mermaid\n" + diagram.mermaid() + "```" in readme
    assert "```mermaid\n" + diagram.sequence() + "```" in readme


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz not installed")
def test_svg_renders(tmp_path: Path) -> None:
    out = tmp_path / "slot.svg"
    assert main(["diagram", "--format", "svg", "--highlight", "hot", "--out", str(out)]) == 0
    assert out.read_text().lstrip().startswith("<?xml") and "<svg" in out.read_text()


def traced_run(tmp_path: Path) -> Pipeline:
    rb = ReplayBuffer(256, 3, 2)
    rb.add_packed(torch.randn(256, rb.width))
    with Pipeline(rb, sample_count=16, ring_depth=3, trace=True, backend="emulated") as pipe:
        for _ in pipe.ticks(0, 15):
            pass
    return pipe


def test_chrome_trace_has_a_track_per_slot_and_actor(tmp_path: Path) -> None:
    pipe = traced_run(tmp_path)
    assert pipe.tracer is not None
    data = json.loads(pipe.tracer.write_chrome(tmp_path / "t.json").read_text())
    events = data["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"slot 0", "slot 1", "slot 2", "learner", "packer", "copy_engine"} <= names
    states = [e for e in events if e.get("cat") == "state"]
    assert {e["name"] for e in states} >= {"requested", "submitted", "ready", "hot", "idle"}
    assert all("tick" in e["args"] for e in states)
    spans = {e["name"] for e in events if e.get("cat") == "span"}
    assert {"pack", "copy"} <= spans
    for e in events:
        assert e["ph"] in ("M", "X", "i") and isinstance(e.get("ts", 0), (int, float))


def test_check_trace_accepts_a_real_run_and_rejects_a_tampered_one(tmp_path: Path) -> None:
    pipe = traced_run(tmp_path)
    assert pipe.tracer is not None
    path = pipe.tracer.write_transitions(tmp_path / "log.jsonl")
    report = check(load(path))
    assert report.ok, str(report)
    assert main(["check-trace", str(path)]) == 0
    recs = load(path)
    acquires = [i for i, r in enumerate(recs) if r["event"] == "acquire"]
    a, b = acquires[3], acquires[4]
    recs[a]["tick"], recs[b]["tick"] = recs[b]["tick"], recs[a]["tick"]
    report = check(recs)
    assert not report.ok and "INV-ORDER" in str(report.violation) and report.index == a
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(json.dumps(r) for r in recs))
    assert main(["check-trace", str(bad)]) == 1


def test_conformance_catches_two_hot_slots() -> None:
    recs = []
    for slot, tick in ((0, 0), (1, 1)):
        recs.append({"slot": slot, "tick": tick, "from": "idle", "to": "requested",
                     "event": "request", "actor": "learner"})
    for slot, tick in ((0, 0), (1, 1)):
        for a, b, e, who in (("requested", "submitted", "submit", "transfer"),
                             ("submitted", "ready", "complete", "copy_engine"),
                             ("ready", "hot", "acquire", "learner")):
            recs.append({"slot": slot, "tick": tick, "from": a, "to": b, "event": e,
                         "actor": who})
    report = check(recs)
    assert not report.ok and "INV-HOT" in str(report.violation)


def request_log(ticks: int) -> list[dict]:
    """A well-formed log: ``ticks`` requests into a ring of 2, the first two legal."""
    return [{"slot": t % 2, "tick": t, "from": "idle", "to": "requested", "event": "request",
             "actor": "learner"} for t in range(ticks)]


@pytest.mark.parametrize("slot,why", [
    ("x", "malformed record: slot 'x' is not an int"),
    (None, "malformed record: slot None is not an int"),
    (1.7, "malformed record: slot 1.7 is not an int"),
    (True, "malformed record: slot True is not an int"),
    (float("inf"), "malformed record: slot inf is not an int"),
    (-1, "malformed record: slot -1 is outside any ring (0 to 63)"),
    (64, "malformed record: slot 64 is outside any ring (0 to 63)"),
])
def test_a_bad_slot_is_reported_at_its_own_record(slot: object, why: str) -> None:
    """The ring's size is read from every record's slot first; a record whose slot is
    not a slot number is reported at its index, with its context, not at #0."""
    recs = request_log(2)
    recs.append({**recs[0], "slot": slot})
    report = check(recs)
    assert not report.ok and report.index == 2, str(report)
    assert str(report.violation).startswith(why), report.violation
    assert [c["index"] for c in report.context] == [0, 1, 2]


def test_a_violation_shows_its_records_cut_short() -> None:
    """A record with a 10 MB field beside a violation printed 10 MB (helper-63): the
    report shows each record and the violation's words cut at a bound, saying so."""
    recs = request_log(2)
    recs[0] = {**recs[0], "note": "x" * 10_000_000}
    recs.append({**recs[1], "slot": "y" * 1_000_000})
    report = check(recs)
    text = str(report)
    assert not report.ok and report.index == 2 and len(text) < 5_000, len(text)
    assert "characters more)" in text and "#0: {" in text
    assert report.context[0]["record"]["note"] == "x" * 10_000_000  # the report keeps it


def test_a_log_that_lost_its_start_is_refused_not_judged(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A run longer than trace_capacity holds: the tracer counts the transitions its
    bound dropped, the log it writes says so in its first record, and check-trace
    refuses that log in one line (exit 2) instead of reporting a violation at record
    #0, where the replay from every slot IDLE meets a slot mid-cycle."""
    class Count:
        transitions = 0

        def transition(self, record: object, time_ns: int) -> None:
            Count.transitions += 1

        def span(self, *args: object, **kwargs: object) -> None:
            pass

    rb = ReplayBuffer(256, 3, 2)
    rb.add_packed(torch.randn(256, rb.width))
    with Pipeline(rb, sample_count=16, ring_depth=3, trace=True, trace_capacity=37,
                  backend="emulated") as pipe:
        pipe.add_observer(Count())  # type: ignore[arg-type]
        for _ in pipe.ticks(0, 15):
            pass
    tracer = pipe.tracer
    assert tracer is not None and len(tracer.events()) == 37
    kept = len(tracer.transitions())
    assert tracer.dropped_transitions == Count.transitions - kept > 0
    path = tracer.write_transitions(tmp_path / "log.jsonl")
    first = json.loads(path.read_text().splitlines()[0])
    assert first == {"kind": "truncated", "trace_capacity": 37,
                     "dropped_transitions": tracer.dropped_transitions}
    assert len(path.read_text().splitlines()) == kept + 1
    assert main(["check-trace", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and (
        f"{path} cannot be checked: the tracer kept only its last 37 events and dropped "
        f"the first {tracer.dropped_transitions} transitions") in err, err


def test_check_trace_of_a_binary_file_names_it(capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path) -> None:
    path = tmp_path / "trace.bin"
    path.write_bytes(b"\x00\xff\xfe binary")
    assert main(["check-trace", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{path} is not text (JSON lines)" in err, err


def test_an_infinite_tick_is_a_malformed_record_not_a_crash() -> None:
    recs = request_log(3)
    recs[2]["tick"] = float("inf")  # what JSON's Infinity loads as
    report = check(recs)
    assert not report.ok and report.index == 2
    assert str(report.violation) == "malformed record: tick inf is not an int", report


def real_log(tmp_path: Path) -> list[dict]:
    pipe = traced_run(tmp_path)
    assert pipe.tracer is not None
    return pipe.tracer.transitions()


@pytest.mark.parametrize("name,value", [
    ("tick", "0"), ("tick", False), ("tick", 0.0), ("tick", 1.5),
    ("generation", 1.7), ("generation", "1"), ("generation", True),
])
@pytest.mark.parametrize("event, nth", [("request", 0), ("submit", 0), ("complete", 0),
                                        ("close", 1)])
def test_a_tick_or_generation_that_is_not_an_int_is_malformed(
        tmp_path: Path, name: str, value: object, event: str, nth: int) -> None:
    """Each was read with int() (or compared with ==), so "1", 1.7, True and 0.0 passed
    as the tick or generation they stand near (helper-43); a close's second record
    (one event, a record per slot) was not looked at (helper-47)."""
    recs = real_log(tmp_path)
    at = [i for i, r in enumerate(recs) if r["event"] == event][nth]
    assert check(recs).ok
    recs[at][name] = value
    report = check(recs)
    assert not report.ok and report.index == at, report
    assert report.violation == f"malformed record: {name} {value!r} is not an int", report


@pytest.mark.parametrize("event", ["request", "submit", "complete", "acquire"])
def test_a_generation_other_than_the_slots_is_a_violation(tmp_path: Path, event: str
                                                          ) -> None:
    """The generation logged is the slot's count of requests; one that differs from the
    core's was not compared (only a submit's was used, to match its request)."""
    recs = real_log(tmp_path)
    at = next(i for i, r in enumerate(recs) if r["event"] == event)
    recs[at]["generation"] = 99
    report = check(recs)
    assert not report.ok and report.index == at, report
    if event == "submit":  # the pack-done message it stands for is another request's
        assert "INV-ORDER" in str(report.violation), report
    else:  # ring depth 3: tick t is slot t % 3's request number t // 3 + 1
        assert str(report.violation).endswith(f"holds generation {recs[at]['tick'] // 3 + 1}"
                                              " but the record names generation 99"), report


@pytest.mark.parametrize("event", ["request", "acquire"])
@pytest.mark.parametrize("missing", ["absent", "null"])
def test_a_request_or_acquire_without_its_tick_is_malformed(
        tmp_path: Path, event: str, missing: str) -> None:
    """It was checked as tick -1, a number the file never held."""
    recs = real_log(tmp_path)
    at = next(i for i, r in enumerate(recs) if r["event"] == event)
    if missing == "null":
        recs[at]["tick"] = None
    else:
        del recs[at]["tick"]
    report = check(recs)
    assert not report.ok and report.index == at, report
    assert report.violation == f"malformed record: a {event} record must name its tick", report


@pytest.mark.parametrize("text,kind,why", [
    ('{"slot": 0, "tick": ' + "9" * 5000 + "}\n", "JSON lines", "line 1: Exceeds the limit"),
    ("[" * 100_000, "a JSON list (it starts with '[')", "maximum recursion depth exceeded"),
])
def test_a_log_json_cannot_hold_is_refused_with_the_files_name(
        tmp_path: Path, text: str, kind: str, why: str) -> None:
    path = tmp_path / "log.jsonl"
    path.write_text(text)
    with pytest.raises(TraceFileError) as info:
        load(path)
    assert str(info.value).startswith(f"{path} is not {kind}: ") and why in str(
        info.value), info.value


def test_an_empty_path_is_not_read_as_this_folder() -> None:
    with pytest.raises(TraceFileError, match="no file named: the path is empty"):
        load("")


def test_a_truncated_record_that_does_not_say_how_much_is_refused_without_nones(
        tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    path.write_text('{"kind": "truncated"}\n')
    with pytest.raises(TraceFileError) as info:
        load(path)
    assert "None" not in str(info.value) and "dropped its first transitions" in str(
        info.value), info.value


@pytest.mark.parametrize("missing", ["absent", "null"])
def test_a_submit_without_its_tick_is_checked_against_the_slots_tick(
        tmp_path: Path, missing: str) -> None:
    """A tick not logged is not a different tick: it was checked as tick -1 and
    reported as an INV-ORDER violation ("pack done for tick -1")."""
    recs = real_log(tmp_path)
    for r in recs:
        if r["event"] == "submit":
            if missing == "null":
                r["tick"] = None
            else:
                del r["tick"]
    assert check(recs).ok


@pytest.mark.parametrize("which", [0, 1, -1])
def test_a_record_naming_another_actor_than_the_core_recorded_is_a_violation(
        tmp_path: Path, which: int) -> None:
    """The actor of every record is compared, a close's included (the core takes no
    actor for close, so the first record's was never checked, nor the later records'
    of a close or a fail)."""
    recs = real_log(tmp_path)
    closes = [i for i, r in enumerate(recs) if r["event"] == "close"]
    at = closes[which]
    recs[at]["actor"] = "copy_engine"
    report = check(recs)
    assert not report.ok and report.index == at, report
    assert "the table gives close to learner" in str(report.violation), report


def svg_edges(svg: str) -> list[tuple[str, str, str]]:
    """(source, dest, label) of every labelled edge Graphviz drew in ``svg``."""
    import html
    edges = []
    for title, body in re.findall(r'<g id="edge\d+" class="edge">\s*<title>(.*?)</title>(.*?)</g>',
                                  svg, re.S):
        source, dest = html.unescape(title).split("->")
        labels = [html.unescape(t) for t in re.findall(r"<text[^>]*>(.*?)</text>", body, re.S)]
        if labels:
            edges.append((source, dest, " ".join(labels)))
    return sorted(edges)


def test_the_committed_svg_draws_the_tables_rows() -> None:
    """The digest stamped in the SVG says which DOT it was rendered from, not what it
    draws: an SVG edited after rendering (a label changed, an arrow removed) kept its
    stamp and passed test_committed_diagrams_match_the_table. Its edges are compared."""
    from replay_fsm.verify.diagram import _label
    svg = (ROOT / "specs/diagrams/slot.svg").read_text()
    assert svg_edges(svg) == sorted((t.source.name, t.dest.name, _label(t))
                                    for t in TRANSITIONS)


def test_check_trace_and_check_invariants_refuse_to_run_without_asserts(
        tmp_path: Path) -> None:
    """The core's invariant checks are assert statements: under python -O check-trace
    skipped them and said the log conforms, and Pipeline.check_invariants() passed
    whatever the state. Both refuse now, in one line."""
    import subprocess
    import sys
    log = tmp_path / "t.jsonl"
    log.write_text(json.dumps({"kind": "transition", "slot": 0, "from": "IDLE",
                               "to": "REQUESTED", "event": "request", "tick": 0}) + "\n")
    done = subprocess.run([sys.executable, "-O", "-m", "replay_fsm", "check-trace",
                           str(log)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done
    assert "python -O" in done.stderr and "Traceback" not in done.stderr, done.stderr
    script = ("import torch\n"
              "from replay_fsm import Pipeline, ReplayBuffer\n"
              "rb = ReplayBuffer(100, 3, 2)\n"
              "rb.add_packed(torch.randn(10, rb.width))\n"
              "with Pipeline(rb, sample_count=4) as pipe:\n"
              "    try:\n"
              "        pipe.check_invariants()\n"
              "    except RuntimeError as exc:\n"
              "        print('refused:', exc)\n")
    done = subprocess.run([sys.executable, "-O", "-c", script], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done
    assert done.stdout.startswith("refused: check_invariants checks the invariants with "
                                  "assert statements"), done.stdout


def test_a_log_of_a_resumed_run_written_before_close_is_checked_on_its_ring() -> None:
    """A ring of 4 resumed at tick 8 holds ticks 8, 9, 10 in slots 0, 1, 2; its log,
    written before close, names no slot 3. The largest slot named gave a ring of 3,
    where tick 10 sits in slot 1, and the valid log was refused at its first record."""
    recs = [{"slot": t % 4, "tick": t, "generation": 1, "from": "idle", "to": "requested",
             "event": "request", "actor": "learner"} for t in (8, 9, 10)]
    report = check(recs)
    assert report.ok and report.slots == 4, str(report)
    # a tick out of ring order in every ring is still refused
    recs.append({"slot": 1, "tick": 12, "generation": 1, "from": "idle",
                 "to": "requested", "event": "request", "actor": "learner"})
    assert not check(recs).ok


def test_records_swapped_out_of_their_logged_order_are_a_violation(tmp_path: Path) -> None:
    """Two records of different slots swapped may still make a legal sequence; their
    time stamps, which the tracer takes in the core's order, say they were moved."""
    pipe = traced_run(tmp_path)
    assert pipe.tracer is not None
    recs = load(pipe.tracer.write_transitions(tmp_path / "log.jsonl"))
    for i in range(len(recs) - 1):
        swapped = recs[:i] + [recs[i + 1], recs[i]] + recs[i + 2:]
        if recs[i]["slot"] != recs[i + 1]["slot"] and recs[i]["time_ns"] < recs[i + 1]["time_ns"]:
            without_times = [{k: v for k, v in r.items() if k != "time_ns"} for r in swapped]
            if check(without_times).ok:  # a legal order of the steps: only time tells
                break
    else:
        pytest.fail("no two records to swap")
    report = check(swapped)
    assert not report.ok and report.index == i + 1, str(report)
    assert "out of order" in str(report.violation)


def test_a_time_stamp_that_is_not_an_int_is_malformed(tmp_path: Path) -> None:
    """A time_ns that was not an int was skipped: a log whose stamps were floats,
    strings or NaN, running backwards, conformed (helper-76b). As a tick or a
    generation, it is malformed; one not logged (absent or null) is not checked."""
    pipe = traced_run(tmp_path)
    assert pipe.tracer is not None
    recs = load(pipe.tracer.write_transitions(tmp_path / "log.jsonl"))
    n = len(recs)
    for stamp in (float, str, lambda i: float("nan"), lambda i: True):
        report = check([dict(r, time_ns=stamp(n - i)) for i, r in enumerate(recs)])
        assert not report.ok and report.index == 0, str(report)
        assert "malformed record: time_ns" in str(report.violation), str(report)
    assert check([dict(r, time_ns=None) for r in recs]).ok
    assert check([{k: v for k, v in r.items() if k != "time_ns"} for r in recs]).ok


def test_a_closed_logs_ring_is_the_slots_it_names() -> None:
    """A closed (or failed) log names every slot: its ring is the largest slot's, not
    the smallest that fits its ticks. A closed ring of 2 with its slots swapped was
    replayed on a ring of 3 and refused at its close, not at the record out of ring
    order (helper-75)."""
    recs = [{"slot": t % 2, "tick": t, "generation": 1, "from": "idle",
             "to": "requested", "event": "request", "actor": "learner"} for t in (3, 4)]
    recs += [{"slot": k, "from": "requested", "to": "closed", "event": "close",
              "actor": "learner"} for k in (0, 1)]
    assert check(recs).ok and check(recs).slots == 2, str(check(recs))
    swapped = [dict(r, slot=1 - r["slot"]) for r in recs]
    report = check(swapped)
    assert not report.ok and report.slots == 2 and report.index == 0, str(report)
    assert "requested on slot 1, the log records idle --request--> requested on slot 0" in (
        str(report.violation))


@pytest.mark.parametrize("what", ["summary", "chrome"])
def test_a_pretty_printed_json_object_is_named_not_a_parse_error(tmp_path: Path,
                                                                 what: str) -> None:
    """The demo's summary.json, or a trace.json re-indented (``python -m json.tool``),
    was "not JSON lines: line 1: Expecting property name enclosed in double quotes"
    of a file that is valid JSON (helper-106)."""
    pipe = traced_run(tmp_path)
    assert pipe.tracer is not None
    document = (pipe.tracer.chrome_trace() if what == "chrome" else
                {"rank": None, "base_seed": 0, "ticks": 15, "tick_ms": 1.0,
                 "stall_pct": 0.0, "trace_conformance": "ok"})
    path = tmp_path / f"{what}.json"
    path.write_text(json.dumps(document, indent=2) + "\n")
    with pytest.raises(TraceFileError) as info:
        load(path)
    if what == "chrome":
        assert str(info.value) == (f"{path} is a Chrome trace (trace.json); check-trace "
                                   "reads the transition log (transitions.jsonl)")
    else:
        assert str(info.value) == (
            f"{path} is one JSON object (keys: rank, base_seed, ticks, tick_ms, "
            "stall_pct, ...), not a transition log: one record a line "
            "(transitions.jsonl), or a JSON list of them")


def test_a_log_cut_short_inside_its_last_line_says_so(tmp_path: Path) -> None:
    """It said "line 27: Expecting value", as of a line written wrong (helper-106);
    a bad line before the end says only what is wrong with it."""
    pipe = traced_run(tmp_path)
    assert pipe.tracer is not None
    text = pipe.tracer.write_transitions(tmp_path / "log.jsonl").read_text()
    lines = text.splitlines()
    cut = tmp_path / "cut.jsonl"
    cut.write_text("\n".join(lines[:4]) + "\n" + lines[4][:30])
    with pytest.raises(TraceFileError) as info:
        load(cut)
    assert str(info.value).startswith(f"{cut} is not JSON lines: line 5: ")
    assert str(info.value).endswith(" (the file's last line, with no end of line: the log "
                                    "was cut short)")
    inside = tmp_path / "inside.jsonl"
    inside.write_text("\n".join([*lines[:4], lines[4][:30], *lines[5:]]) + "\n")
    with pytest.raises(TraceFileError) as info:
        load(inside)
    assert str(info.value).startswith(f"{inside} is not JSON lines: line 5: ")
    assert "cut short" not in str(info.value)


def test_a_line_of_text_is_not_said_to_be_a_log_cut_short(tmp_path: Path) -> None:
    """A one-line text file with no end of line ('hello') was "not JSON lines: line 1:
    Expecting value (the file's last line, with no end of line: the log was cut
    short)" (helper-108): a record begins with '{', and a cut one too."""
    for text in ("hello", "not a log\nat all"):
        path = tmp_path / "notes.txt"
        path.write_text(text)
        with pytest.raises(TraceFileError) as info:
            load(path)
        assert str(info.value).startswith(f"{path} is not JSON lines: line 1: Expecting "
                                          "value")
        assert "cut short" not in str(info.value)


@pytest.mark.parametrize("key,value,word,names", [
    ("to", "pending", "state", "idle, requested, submitted, ready, hot, failed, closed"),
    ("from", "pending", "state", "idle, requested, submitted, ready, hot, failed, closed"),
    ("event", "stage", "event", "request, submit, complete, acquire, release, fail, close"),
    ("actor", "transfer_worker", "actor", "learner, packer, transfer, copy_engine"),
])
def test_a_name_this_table_lacks_is_named_as_another_versions(
        tmp_path: Path, key: str, value: str, word: str, names: str) -> None:
    """A log of a table with other names: it said "malformed record:
    ValueError(\"'stage' is not a valid Event\")", or, for a destination, that the core
    made requested where the log records pending (helper-106)."""
    recs = real_log(tmp_path)
    at = next(i for i, r in enumerate(recs) if r["event"] == "submit")
    recs[at][key] = value
    report = check(recs)
    assert not report.ok and report.index == at, report
    assert report.violation == (f"{key} {value!r} is not a {word} of this version's table "
                                f"({names}): a log of another version, or not a "
                                "replay_fsm log"), report
