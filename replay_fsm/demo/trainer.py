"""``replay-fsm demo``: a small off-policy trainer on an embedded default.

A vectorised point-mass control task in numpy steps in a collector (a spawned
process by default, or a thread), adds every step to the shared replay buffer
and serves pack requests between steps, exactly where the seed's collector
serviced its queue. The learner makes real gradient updates of a small critic
through the pipeline. At the end: a summary table, and an output folder with the
Perfetto trace, the transition log, the state diagram and ``summary.json``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..data.buffer import ReplayBuffer
from ..data.packer import Packer, PackerHandle
from ..runtime.pipeline import Pipeline
from ..spec import INVARIANTS
from ..verify import diagram
from ..verify.conformance import check

OBS, ACT = 32, 2
DYN = 8  # dynamic state; the rest of the observation is sensor features of it


class PointMass:
    """N point masses pushed by 2-D forces toward the origin (numpy); each
    observation is the 8-D dynamic state plus fixed random sensor features of it."""

    def __init__(self, n: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.n = n
        self.state = self.rng.uniform(-1, 1, (n, DYN)).astype(np.float32)
        self.t = np.zeros(n, dtype=np.int64)
        self.sensors = self.rng.standard_normal((DYN, OBS - DYN)).astype(np.float32)

    def observe(self, state: np.ndarray) -> np.ndarray:
        return np.concatenate([state, np.tanh(state @ self.sensors)], axis=1)

    def step(self, action: np.ndarray) -> tuple[np.ndarray, ...]:
        s = self.state
        nxt = s.copy()
        nxt[:, 4:6] += 0.1 * np.clip(action, -1, 1)
        nxt[:, 6:8] = 0.9 * s[:, 6:8] + 0.1 * nxt[:, 4:6]
        nxt[:, 0:4] += 0.1 * np.concatenate([nxt[:, 4:6], nxt[:, 6:8]], axis=1)
        reward = -np.square(nxt[:, :4]).sum(1) - 0.01 * np.square(action).sum(1)
        self.t += 1
        done = np.abs(nxt[:, :4]).max(1) > 3.0
        truncated = (self.t >= 200) & ~done
        reset = done | truncated
        terminal = nxt.copy()
        if reset.any():
            nxt[reset] = self.rng.uniform(-1, 1, (int(reset.sum()), DYN))
            self.t[reset] = 0
        self.state = nxt
        return (self.observe(s), reward.astype(np.float32), self.observe(nxt), done,
                truncated, reset, self.observe(terminal))


def collect(rb: ReplayBuffer, handle: PackerHandle, envs: int, seed: int,
            stop: Any = None, steps: int | None = None) -> None:
    """The collector: step, add, serve pack requests between steps, until closed.

    ``steps``: stop stepping after that many steps and only serve (tests use it to
    keep the storage still, so every batch can be checked bit for bit)."""
    try:
        _collect(rb, handle, envs, seed, stop, steps)
    except KeyboardInterrupt:
        pass  # Ctrl-C reaches the whole process group; the learner side cleans up


def _collect(rb: ReplayBuffer, handle: PackerHandle, envs: int, seed: int, stop: Any,
             steps: int | None) -> None:
    env = PointMass(envs, seed)
    packer = Packer.attach(handle, rb)
    policy = np.random.default_rng(seed + 1).standard_normal((OBS, ACT)).astype(np.float32)
    taken = 0
    while not packer.closed and not (stop is not None and stop.is_set()):
        if steps is not None and taken >= steps:
            packer.service(timeout=0.05)
            continue
        action = -env.observe(env.state) @ policy * 0.5 + env.rng.normal(0, 0.3,
                                                                           (envs, ACT))
        obs, rew, nxt, done, trunc, reset, terminal = env.step(action.astype(np.float32))
        rb.add(obs, action, rew, nxt, done, trunc, terminal_mask=reset,
               terminal_next_obs=terminal)
        taken += 1
        packer.service(timeout=0.0)
        if rb.size == rb.capacity:
            packer.service(timeout=0.002)  # a full buffer: favour serving the learner


class Critic(nn.Module):
    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(OBS + ACT, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, obs: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([obs, act], dim=1)).squeeze(1)


@dataclass
class Learner:
    critic: Critic
    target: Critic
    opt: torch.optim.Optimizer
    policy: torch.Tensor

    @classmethod
    def create(cls, device: torch.device, seed: int) -> Learner:
        torch.manual_seed(seed)
        critic = Critic().to(device)
        target = Critic().to(device)
        target.load_state_dict(critic.state_dict())
        return cls(critic, target, torch.optim.Adam(critic.parameters(), lr=3e-4),
                   torch.randn(OBS, ACT, device=device) * 0.1)

    def step(self, batch: dict[str, torch.Tensor],
             all_reduce: Callable[[list[torch.Tensor]], None] | None = None) -> float:
        with torch.no_grad():
            next_act = torch.tanh(batch["next_obs"] @ self.policy)
            target = batch["rewards"] + 0.99 * (1 - batch["dones"]) * self.target(
                batch["next_obs"], next_act)
        loss = (self.critic(batch["obs"], batch["actions"]) - target).pow(2).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if all_reduce is not None:  # data-parallel ranks average their gradients
            all_reduce([p.grad for p in self.critic.parameters() if p.grad is not None])
        self.opt.step()
        with torch.no_grad():
            for p, tp in zip(self.critic.parameters(), self.target.parameters(), strict=True):
                tp.lerp_(p, 0.005)
        return float(loss.detach())


def _sync_tick_s(rb: ReplayBuffer, learner: Learner, n: int, device: torch.device,
                 ticks: int) -> float:
    """The same loop sampled synchronously in the learner (the baseline), measured
    while the collector still runs, as it does during the pipelined ticks."""
    from ..data.sampling import sample_indices
    out = torch.empty(n, rb.width)
    times = []
    for t in range(ticks):
        t0 = time.perf_counter()
        idx = sample_indices(rb.size, n, t)
        rb.gather(idx, out)
        batch = rb.layout.views(out.to(device))
        learner.step(batch)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def run(*, ticks: int = 300, device: str = "cpu", ring_depth: int = 2,
        collector: str = "process", out: str | Path = "demo-out", checked: bool = False,
        sample_count: int = 8192, capacity: int = 200_000, envs: int = 128,
        seed: int = 0, progress: bool = True, learner_threads: int | None = 1,
        base_seed: int | None = None, rank: int | None = None,
        all_reduce: Callable[[list[torch.Tensor]], None] | None = None,
        collect_steps: int | None = None, verify_data: bool = False,
        kill_collector_at: int | None = None) -> dict[str, Any]:
    """Run the demo; returns the summary (also written to ``out/summary.json``, or
    ``summary-rank<k>.json`` for a rank of a multi-rank run).

    ``learner_threads`` (default 1) pins the learner's torch threads so that on a
    small CPU machine the collector keeps a core of its own, as it would beside a
    GPU learner; None leaves torch's default. ``base_seed`` (default ``seed``) seeds
    the batches (INV-DATA); ``all_reduce`` averages gradients across ranks;
    ``collect_steps`` stops the collector stepping after that many steps and
    ``verify_data`` then checks every batch bit for bit; ``kill_collector_at``
    SIGKILLs the collector at that tick (fault injection: CollectorDied follows).
    """
    try:
        from tqdm import tqdm
    except ImportError as exc:  # tqdm is the demo extra, not a library dependency
        raise ImportError("replay-fsm demo needs tqdm: pip install 'replay-fsm[demo]'"
                          ) from exc

    if learner_threads is not None:
        torch.set_num_threads(learner_threads)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device(device)
    rb = ReplayBuffer(capacity, OBS, ACT)
    pipe = Pipeline(rb, device=dev, sample_count=sample_count,
                    base_seed=seed if base_seed is None else base_seed,
                    ring_depth=ring_depth, collector="external", checked=checked,
                    trace=True, liveness_timeout=30.0)
    stop = threading.Event()
    if collector == "process":
        worker: Any = mp.get_context("spawn").Process(
            target=collect, args=(rb, pipe.packer_handle(), envs, seed, None, collect_steps),
            daemon=True)
    elif collector == "thread":
        worker = threading.Thread(
            target=collect, args=(rb, pipe.packer_handle(), envs, seed, stop, collect_steps),
            daemon=True)
    else:
        raise ValueError(f"collector must be 'process' or 'thread', got {collector!r}")
    worker.start()
    if collector == "process":
        pipe.watch(worker, "the demo collector process")
    learner = Learner.create(dev, seed)
    warm = 4 * sample_count if collect_steps is None else collect_steps * envs
    fingerprint: list[int] = []
    losses: list[float] = []
    tick_times: list[float] = []
    sync_s = 0.0
    done_ticks = 0
    interrupted = False
    t_start = time.perf_counter()
    bar = tqdm(total=ticks, disable=not progress, unit="tick", dynamic_ncols=True)
    try:
        pipe.start_prepare(0, sample_count, min_snapshot_ptr=warm)
        for tick in range(ticks):
            t0 = time.perf_counter()
            if kill_collector_at == tick and collector == "process":
                worker.kill()  # fault injection: the collector crashes
            batch = pipe.sample_large_batch(tick, sample_count)
            if verify_data or tick == 0:
                fingerprint.append(_check_batch(pipe, rb, tick, verify_data))
            for ahead in range(tick + 1, min(tick + ring_depth, ticks)):
                pipe.start_prepare(ahead, sample_count, min_snapshot_ptr=warm)
            with torch.profiler.record_function("replay_fsm/learner_step"):
                losses.append(learner.step(batch, all_reduce))
            pipe.after_tick()
            tick_times.append(time.perf_counter() - t0)
            done_ticks += 1
            if tick % 10 == 0 or tick == ticks - 1:
                stats = pipe.statistics()
                elapsed = time.perf_counter() - t_start
                bar.set_postfix(stall=f"{100 * stats.learner_wait_s / elapsed:.0f}%",
                                loss=f"{losses[-1]:.3f}",
                                slots="".join(s.name[0] for s in pipe.states))
            bar.update(1)
        bar.close()
        elapsed = time.perf_counter() - t_start
        sync_s = _sync_tick_s(rb, learner, sample_count, dev, min(30, ticks))
    except KeyboardInterrupt:
        interrupted = True
    finally:
        bar.close()
        elapsed = time.perf_counter() - t_start
        stats = pipe.statistics()
        pipe.close()
        stop.set()
        worker.join(timeout=30)
    assert pipe.tracer is not None
    suffix = "" if rank is None else f"-rank{rank}"
    pipe.tracer.write_chrome(out_dir / f"trace{suffix}.json",
                             process_name="replay_fsm" if rank is None else f"rank {rank}",
                             pid_base=0 if rank is None else 10 * (rank + 1))
    pipe.tracer.write_transitions(out_dir / f"transitions{suffix}.jsonl")
    (out_dir / "slot.mmd").write_text(diagram.mermaid())
    conformance = check(pipe.tracer.transitions())
    steady = tick_times[len(tick_times) // 10:]  # the first ticks wait for warm-up data
    tick_s = float(np.median(steady)) if steady else 0.0
    summary = {
        "rank": rank, "base_seed": pipe.base_seed, "batch_fingerprint": fingerprint[:1],
        "data_verified_ticks": len(fingerprint) if verify_data else 0,
        "ticks": done_ticks, "interrupted": interrupted, "device": str(dev),
        "learner_threads": torch.get_num_threads(),
        "ring_depth": ring_depth, "collector": collector, "sample_count": sample_count,
        "elapsed_s": elapsed, "tick_ms": tick_s * 1e3,
        "stall_pct": 100 * stats.learner_wait_s / elapsed if elapsed else 0.0,
        "stalls": stats.stalls, "sync_tick_ms": sync_s * 1e3,
        "speedup_vs_sync": sync_s / tick_s if tick_s and sync_s else None,
        "bytes_moved": stats.bytes_moved, "final_loss": losses[-1] if losses else None,
        "checked_mode_checks": stats.checks, "trace_conformance": str(conformance),
        "trace_conforms": conformance.ok, "invariants": list(INVARIANTS),
        "dwell_s": stats.dwell_s,
    }
    (out_dir / f"summary{suffix}.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _check_batch(pipe: Pipeline, rb: ReplayBuffer, tick: int, verify: bool) -> int:
    """The sampled indices' fingerprint; with ``verify``, INV-DATA bit for bit."""
    from ..data.sampling import sample_indices
    done = pipe.pack_record(tick)
    slot = done.slot
    indices = sample_indices(done.snapshot_size, done.sample_count, done.seed)
    if verify and not torch.equal(pipe.backend.device_slot(slot).cpu(), rb.storage[indices]):
        raise AssertionError(f"INV-DATA: the batch of tick {tick} differs")
    return int(indices.sum())


def format_summary(s: dict[str, Any], out: str | Path) -> str:
    speed = s["speedup_vs_sync"]
    rows = [
        ("ticks", f"{s['ticks']}" + (" (interrupted)" if s["interrupted"] else "")),
        ("tick time (median)", f"{s['tick_ms']:.2f} ms"),
        ("learner stall", f"{s['stall_pct']:.1f} % ({s['stalls']} waits)"),
        ("synchronous sampling tick", f"{s['sync_tick_ms']:.2f} ms"),
        ("speed-up over synchronous", "n/a" if speed is None else f"{speed:.2f}x"),
        ("bytes moved", f"{s['bytes_moved'] / 1e6:.1f} MB"),
        ("checked-mode checks", f"{s['checked_mode_checks']}"),
        ("trace conformance", s["trace_conformance"]),
        ("invariants", ", ".join(s["invariants"])),
        ("output", f"{out}/trace.json (open in ui.perfetto.dev), transitions.jsonl, "
                   "slot.mmd, summary.json"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
