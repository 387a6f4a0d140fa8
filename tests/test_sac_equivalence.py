"""The SAC trainer through the pipeline is bit-identical to the same trainer sampling
synchronously with ``expected_batch`` (INV-DATA at trainer level), on the CPU, with
the lock-step collector: ring depth 2 and 3, collector thread and process."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

pytest.importorskip("gymnasium")

from replay_fsm.trainers.run import SACConfig, train  # noqa: E402
from replay_fsm.trainers.sac import SAC  # noqa: E402

# Pendulum: a classic-control task, no MuJoCo; small networks keep each run ~1 s.
SMALL = SACConfig(env="Pendulum-v1", num_envs=2, batch_size=32, updates_per_tick=2,
                  env_steps_per_tick=1, ticks=40, warmup_steps=64, capacity=4096,
                  hidden=32, seed=3, progress=False)
_sync_runs: dict[int, dict[str, Any]] = {}


def sync_run(depth: int) -> dict[str, Any]:
    """The synchronous reference on the same schedule (computed once per depth)."""
    if depth not in _sync_runs:
        _sync_runs[depth] = train(replace(SMALL, sampling="sync", ring_depth=depth,
                                          collector="thread"))
    return _sync_runs[depth]


@pytest.mark.parametrize("collector", ["thread", "process"])
@pytest.mark.parametrize("depth", [2, 3])
def test_pipeline_learner_is_bit_identical_to_synchronous_sampling(depth: int,
                                                                   collector: str) -> None:
    pipelined = train(replace(SMALL, ring_depth=depth, collector=collector))
    reference = sync_run(depth)
    assert pipelined["updates"] == reference["updates"] == SMALL.ticks * SMALL.updates_per_tick
    assert pipelined["pipeline"]["packs"] >= SMALL.ticks
    # Learning moved every network away from its initialisation...
    assert pipelined["digest"] != SAC(3, 1, hidden=SMALL.hidden, seed=SMALL.seed).digest()
    # ...and along exactly the same path: every parameter, bit for bit.
    assert pipelined["digest"] == reference["digest"]
    # Collection is deterministic too: the same episodes with the same returns.
    assert [(e["env_steps"], e["return"]) for e in pipelined["episodes"]] == [
        (e["env_steps"], e["return"]) for e in reference["episodes"]]


def test_the_digest_sees_a_different_data_schedule() -> None:
    """The comparison can fail: sampling one phase later changes the learner."""
    assert sync_run(2)["digest"] != sync_run(3)["digest"]


def test_snapshot_schedule() -> None:
    config = replace(SMALL, num_envs=4, warmup_steps=10, env_steps_per_tick=2, ring_depth=3)
    warm = 3 * 4  # 10 transitions round up to 3 vector steps of 4 envs
    assert [config.snapshot_ptr(t) for t in range(5)] == [warm, warm, warm, warm + 8,
                                                          warm + 16]


@pytest.mark.parametrize("change, message", [
    ({"ring_depth": 1}, "ring_depth"),
    ({"sampling": "sometimes"}, "sampling"),
    ({"batch_size": 0}, "batch_size"),
    ({"sampling": "sync", "capacity": 100}, "must not wrap"),
])
def test_bad_options_are_refused_early(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        train(replace(SMALL, **change))


def test_compare_interleaves_both_trainers_and_times_each_on_its_own_clock() -> None:
    from replay_fsm.trainers.run import compare

    # 32 warm-up + 30 ticks x 6 vector steps: Pendulum's 200-step episodes end.
    result = compare(replace(SMALL, ticks=30, env_steps_per_tick=6, collector="thread"),
                     block=10)
    assert result["bit_identical"]
    assert len(result["round_ratios"]) == 3 and result["speedup_vs_sync"] > 0
    for run in result["runs"].values():
        assert run["ticks"] == 30 and run["blocks"] == 3
        assert len(run["episodes"]) == 2
        assert all(0 <= e["wall_s"] <= run["loop_s"] for e in run["episodes"])


@pytest.mark.parametrize("sampling", ["pipeline", "sync"])
def test_a_collector_that_fails_stops_the_learner_with_collector_died(
        sampling: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from replay_fsm import CollectorDied
    from replay_fsm.trainers import collector

    real_step = collector._Collector.step
    calls = {"n": 0}

    def step(self: collector._Collector, action: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 50:  # after warm-up (32 steps): mid-run
            raise RuntimeError("the simulator crashed")
        real_step(self, action)

    monkeypatch.setattr(collector._Collector, "step", step)
    with pytest.raises(CollectorDied) as info:
        train(replace(SMALL, sampling=sampling, collector="thread"))
    assert "the simulator crashed" in repr(info.value) + repr(info.value.__cause__)
