"""SAC on a MuJoCo task, through the pipeline and sampling synchronously, in one run.

Both trainers make the same number of updates on the same lock-step schedule, one
after the other on this machine; the result holds both learning curves, the
wall-clock speed-up of the pipeline (a ratio of the two loop times) and whether the
two learners ended bit-identical (they should: see ``replay_fsm.trainers.run``).

    python benchmarks/sac_mujoco.py                 # HalfCheetah-v5, 5000 ticks
    python benchmarks/sac_mujoco.py --quick         # a smoke run (writes *-quick.*)

Writes ``benchmarks/results/sac_mujoco.json`` and ``sac_mujoco.png``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

from replay_fsm.trainers.cli import summary
from replay_fsm.trainers.report import plot
from replay_fsm.trainers.run import SACConfig, compare, write

RESULTS = Path(__file__).resolve().parent / "results"
QUICK = dict(num_envs=2, batch_size=64, updates_per_tick=2, ticks=150, warmup_steps=256,
             hidden=64, capacity=20_000)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", default="HalfCheetah-v5")
    ap.add_argument("--ticks", type=int, default=5_000)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--collector", choices=["process", "thread"], default="process")
    ap.add_argument("--quick", action="store_true", help="a short smoke run")
    ap.add_argument("--out", type=Path, default=RESULTS,
                    help="the folder of the result files (default: %(default)s)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    config = SACConfig(env=args.env, ticks=args.ticks, device=args.device,
                       collector=args.collector, progress=not args.no_progress)
    if args.quick:
        config = replace(config, **QUICK)
    result = compare(config)
    result["command"] = shlex.join([Path(sys.argv[0]).as_posix(), *(argv or sys.argv[1:])])
    result["date"] = time.strftime("%Y-%m-%d", time.gmtime())  # as every benchmark's
    name = "sac_mujoco" + ("-quick" if args.quick else "")
    path = write(result, args.out / f"{name}.json")
    png = plot(result["runs"], args.out / f"{name}.png",
               title=f"SAC on {config.env}: {result['runs']['pipeline']['updates']} updates, "
                     f"speed-up {result['speedup_vs_sync']:.3f}x, bit-identical "
                     f"{result['bit_identical']}")
    print(summary(result))
    print(f"wrote {path} and {png}")
    return 0 if result["bit_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
