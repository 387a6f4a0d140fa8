"""The replay-fsm command: demo, sac, diagram, check-trace, explore."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import select
import signal
import sys
from pathlib import Path
from typing import Any

from .errors import first_line, naming_settings
from .signals import (
    exit_code,
    send_to_devnull,
    signum_of,
    sigterm_as_interrupt,
    silence_hung_up_output,
)
from .spec import SlotState


def _demo(args: argparse.Namespace) -> int:
    from .demo import DemoConfig
    from .trainers.cli import learner_threads, progress  # torch-free
    if args.device == "auto" and args.nproc == 1:  # as each rank of --nproc N takes it
        import torch
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.nproc > 1 and args.collector == "thread":
        raise ValueError("--collector thread takes one rank: each rank of --nproc N runs "
                         "its collector in a process of its own")
    config = DemoConfig(ticks=args.ticks, device=args.device, ring_depth=args.ring_depth,
                        collector=args.collector, out=args.out, checked=args.checked,
                        sample_count=args.sample_count,
                        progress=progress(args),
                        learner_threads=learner_threads(args.learner_threads),
                        peer_timeout=args.peer_timeout,
                        liveness_timeout=args.liveness_timeout)
    if args.nproc != 1:
        from .distributed import MAX_RANKS
        if not 1 <= args.nproc <= MAX_RANKS:
            raise ValueError(f"--nproc must be in [1, {MAX_RANKS}], got {args.nproc}")
    if args.nproc > 1:
        from .distributed import launch
        where = (f"per-rank summaries and one merged trace in {args.out}/ "
                 "(summary-rank<k>.json, trace.json)")
        earlier = _summaries(args.out)  # an earlier run's: its ranks past this run's,
        try:  # or all of them when the stop comes before launch removes them
            results = launch(args.nproc, config)
        except KeyboardInterrupt as exc:
            written = bool(_summaries(args.out).items() - earlier.items())
            print(f"interrupted; {where}" if written else
                  "interrupted before any rank wrote its files")
            return exit_code(exc)  # the shell's code: 130 Ctrl-C, 143 SIGTERM, 129 SIGHUP
        for rank, summary in sorted(results.items()):
            print(f"rank {rank}: {summary['ticks']} ticks, {summary['tick_ms']:.2f} ms/tick, "
                  f"stall {summary['stall_pct']:.1f} %, base seed {summary['base_seed']}"
                  + (", its trace does NOT conform" if summary["trace_conforms"] is False
                     else ""))
        print(where)
        # as a single run's: 1 when a rank's trace does not conform (None: not checked)
        return 1 if any(s["trace_conforms"] is False for s in results.values()) else 0
    from .demo import format_summary, run
    try:
        summary = run(config)
    except KeyboardInterrupt as exc:
        so_far = getattr(exc, "summary", None)
        with contextlib.suppress(OSError):  # a terminal gone must not replace the stop
            if isinstance(so_far, dict):  # it came while the files were written
                print(format_summary(so_far, args.out))
                print(f"stopped by {signal.Signals(signum_of(exc)).name} once its files "
                      "were written")
            else:  # a second stop, mostly (as --nproc's line)
                print(f"interrupted before the run's files were all written; "
                      f"{args.out}/ may still hold an earlier run's")
        raise
    except Exception as exc:
        if isinstance(getattr(exc, "summary", None), dict):  # the run so far, written
            print(format_summary(exc.summary, args.out))  # type: ignore[attr-defined]
        raise  # the command's one-line error, exit 2
    print(format_summary(summary, args.out))
    if summary["interrupted"]:
        return 130  # the shell's code for Ctrl-C
    return 1 if summary["trace_conforms"] is False else 0  # None: not checked


def _summaries(out: str) -> dict[str, tuple[int, int]]:
    """The ranks' summaries in ``out``: name -> (inode, mtime in ns), to tell a file
    written since from one that was there."""
    found = {}
    for path in Path(out).glob("summary-rank*.json"):
        try:
            st = path.stat()
        except OSError:
            continue  # removed meanwhile
        found[path.name] = (st.st_ino, st.st_mtime_ns)
    return found


def _sac(args: argparse.Namespace) -> int:
    from .trainers.cli import main as sac_main
    return sac_main(args)


def _diagram(args: argparse.Namespace) -> int:
    from .verify import diagram
    highlight = SlotState[args.highlight.upper()] if args.highlight else None
    if highlight is not None and args.format == "sequence":
        raise ValueError("--highlight colours a state of the state diagram; the sequence "
                         "diagram (one tick's messages) has no states to colour")
    render = {"mermaid": diagram.mermaid, "dot": diagram.dot, "svg": diagram.svg,
              "sequence": lambda h: diagram.sequence()}[args.format]
    text = render(highlight)
    out = getattr(args, "out", None)  # not given: standard output
    if out == "":  # a path of nothing (an unset shell variable, say): not a wish for stdout
        raise ValueError("--out '' names no file; leave --out out for standard output")
    if out:
        from .files import make_folder, write_text
        folder = Path(out).parent
        if folder.exists() and not folder.is_dir():  # mkdir would say "File exists"
            raise NotADirectoryError(f"{folder} is a file; --out names the diagram's file")
        make_folder(folder)  # as demo's --out
        write_text(out, text)  # whole or not at all: a failed write keeps the old file
    elif sys.stdout is None:  # started with its standard output closed (>&-)
        raise OSError("standard output is closed; name a file with --out")
    else:
        sys.stdout.write(text)
    return 0


def _check_trace(args: argparse.Namespace) -> int:
    from .verify.conformance import check, load
    report = check(load(args.file))
    print(report)
    return 0 if report.ok else 1


def _explore(args: argparse.Namespace) -> int:
    from .trainers.cli import progress as wants_progress  # torch-free
    from .verify.explore import explore
    bars: list[Any] = []  # a count of the states on standard error, once there are some

    def progress(states: int) -> None:
        if not bars:
            from tqdm import tqdm
            bars.append(tqdm(unit=" states", desc="explored", dynamic_ncols=True,
                             leave=False, initial=states))
        bars[0].update(states - bars[0].n)

    try:
        with naming_settings({"ring_depth": "--depth"}):  # the option sets the depth
            result = explore(args.depth, args.ticks, faults=args.faults,
                             progress=progress if wants_progress(args) else None)
    finally:
        for bar in bars:
            bar.close()  # erased: the summary follows on standard output
    print(result.summary())
    if result.violation:
        print("\nregression test:\n" + result.regression_test())
    return 0 if result.ok else 1


def main(argv: list[str] | None = None) -> int:
    from . import __version__
    ap = argparse.ArgumentParser(prog="replay-fsm", description=__doc__)
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    # Required, but checked below: argparse's own check names only the missing command
    # and not an unknown argument given with it (``replay-fsm --bogus``).
    sub = ap.add_subparsers(dest="command")
    commands: dict[str, argparse.ArgumentParser] = {}

    def command(name: str, help: str) -> argparse.ArgumentParser:
        # --help shows each option's default
        commands[name] = sub.add_parser(
            name, help=help, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        return commands[name]

    demo = command("demo", help="run a small off-policy trainer through the pipeline")
    demo.add_argument("--ticks", type=int, default=300,
                      help="learner ticks; the comparison with synchronous sampling then "
                      "runs 60 more of each")
    demo.add_argument("--device", default="cpu",
                      help="the learner's device: cpu, cuda, ..., or auto (cuda where there "
                      "is one)")
    demo.add_argument("--collector", choices=["process", "thread"], default="process",
                      help="where the demo's collector steps its environments")
    demo.add_argument("--out", default="demo-out",
                      help="folder for summary.json, trace.json, transitions.jsonl")
    demo.add_argument("--checked", action="store_true",
                      help="checked mode: every read and write interval checked")
    demo.add_argument("--sample-count", type=int, default=8192, help="rows per batch")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.add_argument("--nproc", type=int, default=1,
                      help="ranks on this node (torch.distributed: gloo on CPU, nccl on GPU)")
    from .trainers.cli import add_demo_run_options, option_names  # torch-free
    add_demo_run_options(demo)
    demo.set_defaults(fn=_demo)

    sac = command("sac", help="train SAC on a gymnasium task through the pipeline")
    from .trainers.cli import add_arguments as sac_arguments  # torch-free
    sac_arguments(sac)
    sac.set_defaults(fn=_sac)

    dia = command("diagram", help="draw the slot state machine from the table")
    dia.add_argument("--format", choices=["mermaid", "dot", "svg", "sequence"],
                     default="mermaid", help="svg needs graphviz's dot")
    dia.add_argument("--out", default=argparse.SUPPRESS,
                     help="a file (default: standard output)")
    dia.add_argument("--highlight", type=str.lower, choices=[s.name.lower() for s in SlotState],
                     help="a state to draw in colour (any case)")
    dia.set_defaults(fn=_diagram)

    chk = command("check-trace", help="replay a transition log against the table")
    chk.add_argument("file", help="a transitions.jsonl the demo or a tracer wrote")
    chk.set_defaults(fn=_check_trace)

    exp = command("explore", help="check every interleaving of the real core")
    exp.add_argument("--depth", type=int, default=2, help="slots in the ring (>= 2)")
    exp.add_argument("--ticks", type=int, default=5,
                     help="ticks of the learner (>= 1); a ring's behaviour repeats after a "
                     "few, so 5 to 10 is plenty: the time grows faster than the ticks, and "
                     "much faster with --depth (3 slots and 20 ticks: about a minute)")
    exp.add_argument("--faults", action="store_true", help="also explore fail and close")
    exp.add_argument("--no-progress", action="store_true",
                     help="no count of the states explored on standard error")
    exp.set_defaults(fn=_explore)

    args, unknown = ap.parse_known_args(argv)
    if args.command is None:
        ap.error("the following arguments are required: command"
                 + (f"; unrecognized arguments: {' '.join(unknown)}" if unknown else ""))
    if unknown:  # the usage of the parser they were given to: the command's, mostly
        given = sys.argv[1:] if argv is None else list(argv)
        before = given[:given.index(args.command)] if args.command in given else []
        (ap if any(a in before for a in unknown) else commands[args.command]).error(
            f"unrecognized arguments: {' '.join(unknown)}")
    made = _new_folders(getattr(args, "out", None))
    terms: list[int] = []
    try:
        with sigterm_as_interrupt() as terms:  # kill, timeout, a scheduler: as Ctrl-C
            try:
                with naming_settings(option_names(args)):  # the messages name options
                    code = _stop_code(int(args.fn(args)), terms)
            except KeyboardInterrupt as exc:
                code = _stop_code(exit_code(exc), terms)
        if code:
            _remove_if_empty(made)  # a run stopped before it wrote anything (sac on Ctrl-C)
        return code
    except KeyboardInterrupt as exc:  # a second one, while the first was handled, or
        _remove_if_empty(made)  # one a step deferred past the command's end
        return _stop_code(exit_code(exc), terms)
    except BrokenPipeError as exc:
        if not _stdout_closed():  # another pipe (an --out FIFO): the command's error
            return _failed(args.command, exc, made)
        # The reader of its output left (| head): quietly, as a command SIGPIPE ends;
        # what is still buffered goes nowhere, not to a warning at exit.
        _remove_if_empty(made)
        send_to_devnull(sys.stdout)
        return 128 + getattr(signal, "SIGPIPE", 13)
    except OSError as exc:
        hangup = getattr(signal, "SIGHUP", None)
        if exc.errno != errno.EIO or exc.filename is not None or hangup not in terms:
            return _failed(args.command, exc, made)
        # A write to the terminal that hung up, before the hangup's handler sent the
        # output elsewhere (silence_hung_up_output): the stop's code. The error goes to
        # standard error all the same, where that still writes somewhere.
        silence_hung_up_output()
        with contextlib.suppress(OSError):
            _failed(args.command, exc, made)
        return 128 + hangup
    except Exception as exc:  # noqa: BLE001 - a user-facing tool: one line, exit 2
        return _failed(args.command, exc, made)


def _stop_code(code: int, terms: list[int]) -> int:
    """``code``, or the code of the last signal other than SIGINT that
    ``sigterm_as_interrupt`` took (``terms``) where ``code`` is Ctrl-C's 130: the
    command took SIGTERM (or SIGHUP) for a Ctrl-C and said 130."""
    return 128 + terms[-1] if code == 130 and terms else code


def _failed(command: str, exc: Exception, made: list[Path]) -> int:
    """The command's error in one line on standard error, exit code 2."""
    _remove_if_empty(made)
    if os.environ.get("REPLAY_FSM_DEBUG"):
        raise exc
    text = first_line(str(exc)) or type(exc).__name__
    if sys.stderr is not None:  # closed (2>&-): print would put it in the output
        print(f"replay-fsm {command}: error: {text}", file=sys.stderr)
    return 2


def _stdout_closed() -> bool:
    """Whether this process's standard output is a pipe whose reader has left (poll
    says POLLERR on its write end); False where that cannot be told (a StringIO)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation: a ValueError
        return False


def _new_folders(out: str | None) -> list[Path]:
    """The folders a command that writes to ``out`` may make: ``out`` and its
    parents that do not exist yet, deepest first."""
    if not out:
        return []
    path, made = Path(os.path.abspath(out)), []  # normalised: "a/../b" is b
    while not os.path.lexists(path) and path != path.parent:
        made.append(path)
        path = path.parent
    return made


def _remove_if_empty(folders: list[Path]) -> None:
    """Remove the folders a failed command made and left empty, deepest first."""
    for folder in folders:
        if not folder.exists():
            continue  # never made (a file name, or a run that failed first)
        try:
            folder.rmdir()  # only an empty folder; a file of that name stays
        except OSError:
            return


if __name__ == "__main__":
    raise SystemExit(main())
