"""Stable-Baselines3 with ``PipelineReplayBuffer`` against SB3's own ``ReplayBuffer``.

The same algorithm, seed and number of steps with either buffer, in interleaved
rounds on this machine; the figure is the ratio of the median wall times (above 1:
the pipeline's buffer is faster). SB3's learner is Python-heavy and its batches are
small, so on a CPU this measures the pipeline's per-step bookkeeping as much as the
gather it hides.

    python benchmarks/sb3_buffer.py [--rounds 3] [--quick]

Writes ``benchmarks/results/sb3_buffer.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from replay_fsm.trainers.run import machine

try:
    from common import write_result
except ImportError:
    from benchmarks.common import write_result

CASES: dict[str, dict[str, Any]] = {
    # SB3's defaults for SAC (256x256 networks, batch 256), one update per step.
    "SAC Pendulum-v1": {"algo": "SAC", "env": "Pendulum-v1", "steps": 2000,
                        "kwargs": {"learning_starts": 100}},
    # rl-zoo's CartPole settings: batch 64, 128 gradient steps every 256 steps.
    "DQN CartPole-v1": {"algo": "DQN", "env": "CartPole-v1", "steps": 5000, "kwargs": {
        "learning_rate": 2.3e-3, "batch_size": 64, "buffer_size": 100_000,
        "learning_starts": 1000, "target_update_interval": 10, "train_freq": 256,
        "gradient_steps": 128, "exploration_fraction": 0.16, "exploration_final_eps": 0.04,
        "policy_kwargs": {"net_arch": [256, 256]}}},
}


def timed_learn(case: dict[str, Any], pipeline: bool, steps: int) -> float:
    import stable_baselines3
    from stable_baselines3.common.logger import Logger

    from replay_fsm.integrations.sb3 import PipelineReplayBuffer

    extra = {"replay_buffer_class": PipelineReplayBuffer} if pipeline else {}
    model = getattr(stable_baselines3, case["algo"])(
        "MlpPolicy", case["env"], seed=0, device="cpu", **case["kwargs"], **extra)
    # SB3's own logger at verbose 0 writes nothing, into a new SB3-<time> folder in
    # the temp folder at every learn: the same logger, with no folder.
    model.set_logger(Logger(folder=None, output_formats=[]))
    t0 = time.perf_counter()
    model.learn(steps)
    elapsed = time.perf_counter() - t0
    if pipeline:
        model.replay_buffer.close()
    return elapsed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a tenth of the steps, one round")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    torch.set_num_threads(1)  # the learner on one core, as in the other benchmarks
    rounds = 1 if args.quick else args.rounds
    figures: dict[str, Any] = {}
    for name, case in CASES.items():
        steps = case["steps"] // (10 if args.quick else 1)
        times: dict[str, list[float]] = {"sb3": [], "pipeline": []}
        for _ in range(rounds):  # interleaved, so drifting load hits both alike
            times["sb3"].append(timed_learn(case, False, steps))
            times["pipeline"].append(timed_learn(case, True, steps))
        med = {k: statistics.median(v) for k, v in times.items()}
        figures[name] = {"steps": steps, "seconds": times, "median_s": med,
                         "speed_ratio": med["sb3"] / med["pipeline"]}
        print(f"{name}: {steps} steps, SB3 buffer {med['sb3']:.2f} s, PipelineReplayBuffer "
              f"{med['pipeline']:.2f} s, speed ratio {figures[name]['speed_ratio']:.3f}")
    # as every benchmark's: with the day it was measured and whether it was quick
    path = write_result("sb3_buffer", {"rounds": rounds, "cases": CASES,
                                       "loadavg": machine()["loadavg"]},
                        figures, quick=args.quick)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
