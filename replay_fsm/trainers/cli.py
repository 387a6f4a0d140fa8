"""``replay-fsm sac``: options and entry point (torch-free until it runs)."""

from __future__ import annotations

import argparse
import sys
from importlib.util import find_spec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The SAC trainer's options, on ``parser``."""
    parser.add_argument("--env", default="HalfCheetah-v5", help="a gymnasium task id")
    parser.add_argument("--num-envs", type=int, default=8, help="environments stepped together")
    parser.add_argument("--batch-size", type=int, default=256, help="rows per SAC update")
    parser.add_argument("--updates-per-tick", type=int, default=8,
                        help="SAC updates per tick; a tick's batch holds this many batches")
    parser.add_argument("--env-steps-per-tick", type=int, default=1,
                        help="vector steps the collector takes per tick")
    parser.add_argument("--ticks", type=int, default=5_000, help="learner ticks")
    parser.add_argument("--warmup-steps", type=int, default=5_000,
                        help="transitions of uniform random actions before learning "
                        "(>= 1: the first ticks' batches are drawn from them; rounded up "
                        "to whole steps of --num-envs)")
    parser.add_argument("--capacity", type=int, default=1_000_000,
                        help="rows the replay buffer holds")
    parser.add_argument("--device", default="cpu", help="the learner's device: cpu, cuda, ...")
    parser.add_argument("--sampling", choices=["pipeline", "sync", "both"], default="pipeline",
                        help="both: the same run twice, then the speed-up and bit-identity")
    parser.add_argument("--ring-depth", type=int, default=2, help="slots in the ring (2-64)")
    parser.add_argument("--collector", choices=["process", "thread"], default="process",
                        help="where the environments step")
    parser.add_argument("--hidden", type=int, default=256, help="units per hidden layer")
    parser.add_argument("--seed", type=int, default=0, help="seeds the run and its batches")
    parser.add_argument("--learner-threads", type=int, default=1,
                        help="torch threads of the learner (0: torch's default; at most 256)")
    parser.add_argument("--liveness-timeout", type=float, default=30.0,
                        help="seconds without a row from the collector before the run "
                        "fails (CollectorDied, DataStalled)")
    parser.add_argument("--out", default="sac-out",
                        help="a folder (gets sac.json and sac.png) or a .json file (the PNG "
                        "goes beside it; res.json/ or res.json/. is a folder)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    """Run the trainer from parsed options; print a summary; write JSON and PNG."""
    from ..signals import exit_code, send_to_devnull
    from .report import plot
    from .run import RunInterrupted, SACConfig, compare, output_path, train, write

    missing = [name for name in ("gymnasium", "matplotlib") if find_spec(name) is None]
    if missing:  # now, not after the run (matplotlib draws the plot at its end)
        raise ImportError(f"replay-fsm sac needs {' and '.join(missing)}: pip install "
                          "'replay-fsm[mujoco]'")

    config = SACConfig(
        env=args.env, num_envs=args.num_envs, batch_size=args.batch_size,
        updates_per_tick=args.updates_per_tick, env_steps_per_tick=args.env_steps_per_tick,
        ticks=args.ticks, warmup_steps=args.warmup_steps, capacity=args.capacity,
        device=args.device, sampling="pipeline" if args.sampling == "both" else args.sampling,
        ring_depth=args.ring_depth, collector=args.collector, hidden=args.hidden,
        seed=args.seed, learner_threads=learner_threads(args.learner_threads),
        liveness_timeout=args.liveness_timeout, progress=progress(args))
    output_path(args.out, before_run=True)  # fails now, not after the run
    code, error = 0, None
    try:
        result = compare(config) if args.sampling == "both" else train(config)
    except RunInterrupted as exc:  # a stop signal: what was done is still written
        result, code = exc.result, exit_code(exc)
    except Exception as exc:  # an error after some ticks: written too, then raised
        if not isinstance(getattr(exc, "result", None), dict):
            raise
        result, error = exc.result, exc  # type: ignore[attr-defined]
    runs = result["runs"] if "runs" in result else {config.sampling: result}
    gone: OSError | None = None
    try:
        print(summary(result))  # first: the numbers are on the screen whatever follows
    except OSError as exc:  # its reader left (| head, a tee the job's Ctrl-C ended): the
        gone = exc  # files are still written, then the command ends as that write says
    from ..files import forget
    # The earlier run's plot goes before this run's result is written: a process
    # killed before the plot (SIGKILL) leaves none, not one that looks like this run's.
    forget(output_path(args.out).with_suffix(".png"))
    path = write(result, args.out)
    png = plot(runs, path.with_suffix(".png"), title=f"SAC on {config.env}")
    if gone is None:
        print(f"wrote {path} and {png}")
    elif error is None and not code:
        raise gone  # exit code 141, as a command that SIGPIPE ends
    else:  # the run's own end decides the code (a stop's 130, 143 or 129, an error's
        send_to_devnull(sys.stdout)  # 2); what is still buffered goes nowhere, not to a
        # warning at exit
    if error is not None:
        raise error  # the command's one-line error, exit code 2
    return code


def option_names(args: argparse.Namespace) -> dict[str, str]:
    """How a command's messages name the settings its options set, for
    ``errors.naming_settings``: each option of ``args`` (a parsed command line),
    ``num_envs`` as ``--num-envs``. The configs and the pipeline build their messages
    with those names (``errors.setting``): ``num_envs must be >= 1`` from Python,
    ``--num-envs must be >= 1`` from the command line, and a stall's
    ``(--liveness-timeout)``; a value the user typed is never rewritten, whatever it
    says (``--out sample_count``)."""
    return {name: "--" + name.replace("_", "-") for name in vars(args)
            if name not in ("command", "fn", "file")}


MAX_LEARNER_THREADS = 256


def add_demo_run_options(parser: argparse.ArgumentParser) -> None:
    """The demo's options that a torchrun rank (``python -m replay_fsm.distributed``)
    takes too, on ``parser``."""
    parser.add_argument("--ring-depth", type=int, default=2, help="slots in the ring (2-64)")
    parser.add_argument("--peer-timeout", type=float, default=120.0,
                        help="with several ranks: seconds a rank waits in an all-reduce "
                        "for a stopped or stuck peer before it fails (at most 1e9)")
    parser.add_argument("--liveness-timeout", type=float, default=30.0,
                        help="seconds the learner waits on a silent collector, or for "
                        "rows that stopped coming, before the run fails")
    parser.add_argument("--learner-threads", type=int, default=1,
                        help="torch threads of the learner (0: torch's default; at most 256)")


def learner_threads(option: int) -> int | None:
    """``--learner-threads`` as the configs take it: 0 is torch's default (None).

    Raises:
        ValueError: a negative count (named as the option: the configs' own error
            says "None or an int >= 1", which no command line can give), or one past
            MAX_LEARNER_THREADS.
    """
    if option < 0:
        raise ValueError(f"--learner-threads must be >= 0 (0: torch's default), got "
                         f"{option}")
    if option > MAX_LEARNER_THREADS:  # OpenMP aborts, or segfaults, on 20000 or 100000
        raise ValueError(f"--learner-threads must be at most {MAX_LEARNER_THREADS}, got "
                         f"{option}")
    return option or None


def progress(args: argparse.Namespace) -> bool:
    """Whether a command shows its progress bar: not ``--no-progress``, and standard
    error open (2>&-: tqdm would fail writing to it)."""
    return not args.no_progress and sys.stderr is not None


def summary(result: dict) -> str:
    """A few lines: per run, updates, wall time, final return; then the comparison."""
    runs = result.get("runs", {result.get("config", {}).get("sampling", "run"): result})
    lines = []
    for name, run in runs.items():
        final, rate = run["final_return"], run["updates_per_s"] or 0.0  # None: never ran
        tick = run["tick_ms"]["mean"]  # None: no tick done
        lines.append(f"{name:8s} {run['updates']} updates in {run['loop_s']:.1f} s "
                     f"({rate:.0f}/s, tick {'n/a' if tick is None else f'{tick:.2f} ms'} "
                     f"mean), final return {'n/a' if final is None else f'{final:.1f}'}"
                     + (" (stopped by an error)" if run.get("error") or result.get("error")
                        else " (interrupted)" if run.get("interrupted") else ""))
        if run.get("episodes_dropped"):
            lines.append(f"{'':8s} its {run['episodes_dropped']} oldest episodes were not "
                         "kept, past the episode log's capacity")
    if "speedup_vs_sync" in result:
        # Tick 0 (the collector's start-up) is in the first figure: on a short run it
        # can read as a gain the steady ticks do not have.
        steady = result.get("speedup_after_startup")
        lines.append(f"speed-up over synchronous sampling: {result['speedup_vs_sync']:.3f}x"
                     + ("" if steady is None else f" ({steady:.3f}x after tick 0, the "
                        "collector's start-up)")
                     + f"; learners bit-identical: {result['bit_identical']}")
    return "\n".join(lines)
