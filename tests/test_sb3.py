"""The Stable-Baselines3 replay buffer: INV-DATA batches, SB3's semantics, and SB3's
SAC, TD3 and DQN training with it."""

from __future__ import annotations

import functools
import pickle
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("stable_baselines3")

from gymnasium import spaces  # noqa: E402
from stable_baselines3.common.buffers import ReplayBuffer as SB3ReplayBuffer  # noqa: E402

from replay_fsm.integrations.sb3 import PipelineReplayBuffer  # noqa: E402
from replay_fsm.sampling import expected_batch  # noqa: E402

from .support import interrupted_at, threads_running_on  # noqa: E402
from .tiers import tier_runs  # noqa: E402

OBS = spaces.Box(-1e6, 1e6, (2, 3), np.float32)  # 2-D on purpose: rows are flattened
ACT = spaces.Box(-1, 1, (2,), np.float32)


@pytest.fixture(autouse=True)
def sb3_logs_in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SB3's ``learn`` makes a log folder, by default a new ``SB3-<time>`` in the
    system's temp folder that nothing removes: put it where pytest cleans up."""
    monkeypatch.setenv("SB3_LOGDIR", str(tmp_path / "sb3-logs"))


def step(rng: np.random.Generator, n_envs: int, done: Any = False,
         truncated: Any = False) -> tuple[Any, ...]:
    """One SB3 ``add`` call's arguments with unique random values."""
    dones = np.broadcast_to(np.asarray(done), (n_envs,)).astype(bool)
    truncs = np.broadcast_to(np.asarray(truncated), (n_envs,))
    infos = [{"TimeLimit.truncated": bool(t)} if d else {} for d, t in zip(dones, truncs,
                                                                          strict=True)]
    return (rng.normal(size=(n_envs, 2, 3)).astype(np.float32),
            rng.normal(size=(n_envs, 2, 3)).astype(np.float32),
            rng.uniform(-1, 1, (n_envs, 2)).astype(np.float32),
            rng.normal(size=n_envs).astype(np.float32), dones, infos)


@pytest.mark.parametrize("depth", [2, 3])
def test_batches_follow_inv_data(depth: int) -> None:
    """Gradient step k samples ``storage[randint(0, size, n, seed=base_seed + k)]``, with
    the buffer as it stood when step ``k - (depth - 1)`` sampled (first: step 0), across
    adds between samples and past the ring's wrap."""
    n_envs, n = 2, 16
    buf = PipelineReplayBuffer(40, OBS, ACT, device="cpu", n_envs=n_envs, ring_depth=depth,
                               base_seed=1234)
    rng = np.random.default_rng(0)
    asked: list[tuple[torch.Tensor, int]] = []  # (storage, size) at each sample call
    got = []
    try:
        for round_ in range(12):
            for _ in range(1 + round_ % 3):  # 20 rows fill the 40-row ring at round 8
                buf.add(*step(rng, n_envs))
            for _ in range(1 + round_ % 2):
                asked.append((buf.replay.storage.clone(), buf.replay.size))
                got.append(buf.sample(n))
    finally:
        buf.close()
    assert buf.full and buf.replay.ptr > buf.replay.capacity  # the ring wrapped
    lay = buf.replay.layout
    for k, samples in enumerate(got):
        storage, size = asked[max(0, k - (depth - 1))]
        rows = expected_batch(storage, size, n, 1234 + k)
        assert torch.equal(samples.observations.reshape(n, 6), rows[:, lay.obs]), k
        assert torch.equal(samples.next_observations.reshape(n, 6), rows[:, lay.next_obs]), k
        assert torch.equal(samples.actions, rows[:, lay.actions]), k
        assert torch.equal(samples.rewards, rows[:, lay.rewards].reshape(n, 1)), k


def sb3_rows(buf: SB3ReplayBuffer) -> dict[bytes, tuple[float, float, bytes]]:
    """SB3's own buffer as obs bytes -> (done as sampled, reward, next obs bytes)."""
    size = buf.buffer_size if buf.full else buf.pos
    dones = buf.dones[:size] * (1 - buf.timeouts[:size])
    return {buf.observations[i, e].tobytes(): (float(dones[i, e]), float(buf.rewards[i, e]),
                                               buf.next_observations[i, e].tobytes())
            for i in range(size) for e in range(buf.n_envs)}


@pytest.mark.parametrize("handle_timeouts", [True, False])
def test_samples_match_sb3_buffer_semantics(handle_timeouts: bool) -> None:
    """Row for row what SB3's ReplayBuffer holds: a time-limit cut is terminal only
    without handle_timeout_termination; shapes and dtypes are SB3's."""
    n_envs = 2
    ours = PipelineReplayBuffer(64, OBS, ACT, "cpu", n_envs,
                                handle_timeout_termination=handle_timeouts, base_seed=0)
    theirs = SB3ReplayBuffer(64, OBS, ACT, "cpu", n_envs,
                             handle_timeout_termination=handle_timeouts)
    rng = np.random.default_rng(1)
    for done, trunc in [(False, False), (True, True), (True, False), ([True, False], True)]:
        args = step(rng, n_envs, done, trunc)
        ours.add(*args)
        theirs.add(*args)
    table = sb3_rows(theirs)
    assert {d for d, _, _ in table.values()} == {0.0, 1.0}
    try:
        samples = ours.sample(64)
    finally:
        ours.close()
    reference = theirs.sample(8)
    for field in ("observations", "actions", "next_observations", "dones", "rewards"):
        mine, sb3 = getattr(samples, field), getattr(reference, field)
        assert mine.shape[1:] == sb3.shape[1:] and mine.dtype == sb3.dtype, field
    for i in range(64):
        done, reward, next_obs = table[samples.observations[i].numpy().tobytes()]
        assert float(samples.dones[i, 0]) == done
        assert float(samples.rewards[i, 0]) == reward
        assert samples.next_observations[i].numpy().tobytes() == next_obs


def test_discrete_actions_come_back_as_sb3_integers() -> None:
    buf = PipelineReplayBuffer(32, spaces.Discrete(5), spaces.Discrete(3), "cpu", 2,
                               base_seed=0)
    for a in range(3):
        buf.add(np.array([a, 4 - a]), np.array([1, 2]), np.array([a, 2 - a]),
                np.zeros(2), np.zeros(2), [{}, {}])
    try:
        samples = buf.sample(8)
    finally:
        buf.close()
    assert samples.actions.dtype == torch.int64 and samples.actions.shape == (8, 1)
    assert samples.observations.dtype == torch.int64
    assert set(samples.actions.flatten().tolist()) <= {0, 1, 2}


def test_an_integer_float32_rows_would_round_is_refused_and_nothing_added() -> None:
    """A Discrete(2**30) observation 1073741821 came back as 1073741824: silently
    wrong data. 2**24 and below come back exact."""
    big = 2**24
    buf = PipelineReplayBuffer(32, spaces.Discrete(2**30), spaces.Discrete(2**30), "cpu",
                               1, base_seed=0)
    try:
        for obs, act in ((big + 1, 0), (0, -big - 3)):
            with pytest.raises(ValueError, match=f"{abs(obs or act)} is past 2\\*\\*24"):
                buf.add(np.array([obs]), np.array([0]), np.array([act]), np.zeros(1),
                        np.zeros(1), [{}])
        assert buf.replay.ptr == 0
        buf.add(np.array([big]), np.array([big - 1]), np.array([-big]), np.zeros(1),
                np.zeros(1), [{}])
        samples = buf.sample(4)
    finally:
        buf.close()
    assert samples.observations.flatten().tolist() == [big] * 4
    assert samples.next_observations.flatten().tolist() == [big - 1] * 4
    assert samples.actions.flatten().tolist() == [-big] * 4


def test_pickles_for_save_replay_buffer_keeping_the_oldest_row_first() -> None:
    buf = PipelineReplayBuffer(6, OBS, ACT, "cpu", 2, base_seed=5)
    rng = np.random.default_rng(2)
    for _ in range(4):  # 8 rows into a 6-row ring: rows 0 and 1 were overwritten
        buf.add(*step(rng, 2))
    buf.sample(4)
    clone = pickle.loads(pickle.dumps(buf))
    try:
        assert clone.size() == buf.size() and clone.replay.size == 6
        old = buf.replay.storage
        assert torch.equal(clone.replay.storage, torch.cat([old[2:], old[:2]]))
        clone.add(*step(rng, 2))  # overwrites the two oldest rows
        assert torch.equal(clone.replay.storage[2:], torch.cat([old[4:], old[:2]]))
        assert clone.sample(4).observations.shape == (4, 2, 3)
    finally:
        buf.close()
        clone.close()


@pytest.mark.parametrize("kwargs, message", [
    ({"optimize_memory_usage": True, "handle_timeout_termination": False},
     "optimize_memory_usage"),
    ({"ring_depth": 1}, "ring_depth must be an int >= 2, got 1"),
    ({"ring_depth": 100}, "ring_depth must be <= 64, got 100"),
    ({"base_seed": -1}, "base_seed must be an int >= 0, got -1"),
    ({"base_seed": 2**63}, r"base_seed must be an int in \[0, 2\*\*63\)"),
    ({"liveness_timeout": 0}, "liveness_timeout must be a finite number of seconds > 0"),
    ({"liveness_timeout": float("inf")}, "liveness_timeout must be a finite number"),
])
def test_unsupported_options_are_refused(kwargs: dict[str, Any], message: str) -> None:
    """In the constructor, not at the first sample after learning_starts steps."""
    with pytest.raises(ValueError, match=message):
        PipelineReplayBuffer(10, OBS, ACT, **kwargs)


@pytest.mark.parametrize("base_seed", [1.5, "7", True])
def test_a_base_seed_that_is_not_an_integer_is_refused(base_seed: Any) -> None:
    """It was truncated (1.5 drew step k's batch with seed 1 + k) or failed in int()."""
    with pytest.raises(TypeError, match="base_seed must be an int"):
        PipelineReplayBuffer(10, OBS, ACT, base_seed=base_seed)


@pytest.mark.parametrize("norm_obs", [False, True])
def test_observations_through_vec_normalize_come_back_as_sb3s(norm_obs: bool) -> None:
    """With a VecNormalize that leaves observations alone, in the space's dtype (they
    came back float32); normalised, as SB3 normalises them (float32)."""
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecNormalize

    env = VecNormalize(make_vec_env("CartPole-v1", n_envs=1), norm_obs=norm_obs)
    space = spaces.Box(0, 255, (4,), np.uint8)
    ours = PipelineReplayBuffer(16, space, spaces.Discrete(2), "cpu", 1, base_seed=0)
    theirs = SB3ReplayBuffer(16, space, spaces.Discrete(2), "cpu", 1)
    rng = np.random.default_rng(3)
    for _ in range(8):
        obs, nxt = (rng.integers(0, 256, (1, 4), dtype=np.uint8) for _ in range(2))
        args = (obs, nxt, np.array([1]), np.array([0.5], np.float32), np.array([False]),
                [{}])
        ours.add(*args)
        theirs.add(*args)
    try:
        mine = ours.sample(8, env=env)
    finally:
        ours.close()
        env.close()
    reference = theirs.sample(8, env=env)
    for field in ("observations", "next_observations"):
        got, sb3 = getattr(mine, field), getattr(reference, field)
        assert got.dtype == sb3.dtype and got.shape == sb3.shape, field
    assert (mine.observations.dtype == torch.uint8) is not norm_obs


def test_td3_trains_with_it() -> None:
    from stable_baselines3 import TD3

    model = TD3("MlpPolicy", "Pendulum-v1", replay_buffer_class=PipelineReplayBuffer,
                learning_starts=64, batch_size=32, policy_kwargs={"net_arch": [32, 32]},
                seed=0, device="cpu")
    model.learn(300)
    buf = model.replay_buffer
    assert isinstance(buf, PipelineReplayBuffer) and buf.size() == 300
    assert buf._next_tick == 300 - 64  # one sample per gradient step, all through it
    buf.close()


@pytest.mark.slow
def test_sb3_sac_learns_pendulum() -> None:
    from stable_baselines3 import SAC
    from stable_baselines3.common.evaluation import evaluate_policy

    torch.set_num_threads(1)
    model = SAC("MlpPolicy", "Pendulum-v1", replay_buffer_class=PipelineReplayBuffer,
                learning_starts=200, learning_rate=1e-3, policy_kwargs={"net_arch": [64, 64]},
                seed=0, device="cpu")
    model.learn(3000)
    mean, _ = evaluate_policy(model, model.get_env(), n_eval_episodes=5, deterministic=True)
    model.replay_buffer.close()
    assert mean > -500  # a random policy scores about -1200; SAC gets ~-200 here


@pytest.mark.slow
def test_sb3_dqn_learns_cartpole() -> None:
    """DQN at 10k steps learns CartPole, then its greedy policy swings (one seed's final
    policy lasted 39 steps on one machine and 199 on another; SB3's own buffer swings
    alike): the test takes the best of three evaluations, on an environment of its own,
    late in training. A random policy lasts about 20 steps, an untrained greedy one 9-34;
    over seeds 0-7 the best of three was 129-384."""
    from stable_baselines3 import DQN
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.evaluation import evaluate_policy

    torch.set_num_threads(1)
    # rl-zoo's CartPole settings, cut to 10k steps.
    model = DQN("MlpPolicy", "CartPole-v1", replay_buffer_class=PipelineReplayBuffer,
                learning_rate=2.3e-3, batch_size=64, buffer_size=100_000,
                learning_starts=1000, target_update_interval=10, train_freq=256,
                gradient_steps=128, exploration_fraction=0.16, exploration_final_eps=0.04,
                policy_kwargs={"net_arch": [256, 256]}, seed=0, device="cpu")
    eval_env = make_vec_env("CartPole-v1", n_envs=1, seed=1)
    scores: list[float] = []

    class EvaluateLate(BaseCallback):
        def _on_step(self) -> bool:
            if self.num_timesteps in (6000, 8000, 10_000):
                scores.append(evaluate_policy(self.model, eval_env, n_eval_episodes=5,
                                              deterministic=True)[0])
            return True

    try:
        model.learn(10_000, callback=EvaluateLate())
    finally:
        model.replay_buffer.close()
    assert len(scores) == 3
    assert max(scores) > 100, scores


def test_a_ctrl_c_as_the_pipelines_constructor_returns_leaves_nothing_running(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The interrupt lands in ``sample`` just after ``Pipeline.__init__`` returned: the
    pipeline was forgotten running (its threads for good), as if its constructor had
    closed it. The sweep below found it at one of its points (every 11th, CI's stride
    then)."""
    import replay_fsm

    rng = np.random.default_rng(0)
    buf = PipelineReplayBuffer(64, OBS, ACT, device="cpu", n_envs=1, ring_depth=2)
    for _ in range(20):
        buf.add(*step(rng, 1))
    real = replay_fsm.Pipeline.__init__

    def then_interrupted(self: Any, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        raise KeyboardInterrupt
    before = {t.ident for t in threading.enumerate()}
    monkeypatch.setattr(replay_fsm.Pipeline, "__init__", then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        buf.sample(8)
    monkeypatch.undo()
    try:
        assert not threads_running_on("replay_fsm-", before)
        assert buf.sample(8).observations.shape[0] == 8  # and it goes on
    finally:
        buf.close()


# The Ctrl-C sweep's strides over the points of a sample that starts the pipeline and
# over those of one that finds it running, per tier (every point of an add in each).
# Without ee43846's fixes, every later sample raised PipelineClosed after 515 of the
# 8270 points of the first sample, 194 of the 208 of the second and 135 of the 155 of
# the add; the next sample asked for a released tick (ProtocolError) after 23 of the
# first's points (21 in a row) and 24 of the second's (17 of them within 21). The
# point just after the constructor returned (e051377, 657e0ef) is one alone, which
# each of these strides missed here; the test above finds it.
SWEEP_STRIDES = {"fast": (101, 3), "slow": (33, 3), "deep": (11, 1)}


@pytest.mark.timeout(900)  # some 1500 buffers made and interrupted in the deep tier
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # generators
def test_a_ctrl_c_anywhere_in_sample_or_add_leaves_it_usable() -> None:
    """A notebook's interrupt of ``learn()`` can land in a pipeline call, which then
    closes the pipeline: every later ``sample`` and ``add`` raised PipelineClosed, so
    ``learn()`` again failed. Interrupted at each point where Python would take a
    Ctrl-C in a ``sample`` (one that starts the pipeline and one that finds it
    running) or an ``add``, the buffer goes on: the next samples
    follow INV-DATA from where the interrupted call left the gradient steps."""
    n, seed = 8, 99
    rng = np.random.default_rng(0)
    adds = [step(rng, 1) for _ in range(30)]

    def made(warm: bool) -> PipelineReplayBuffer:
        buf = PipelineReplayBuffer(64, OBS, ACT, device="cpu", n_envs=1, ring_depth=2,
                                   base_seed=seed)
        for args in adds[:20]:
            buf.add(*args)
        if warm:
            buf.sample(n)  # and tick 1 asked for, of the buffer's 20 rows
        return buf

    def check(buf: PipelineReplayBuffer, asked: int, threads: set[int | None]) -> None:
        """Two samples and an add, after ``asked`` samples were asked for. A tick the
        pipeline asked for before the interrupt was asked of 20 rows, the others of
        the rows there now."""
        try:
            storage, lay = buf.replay.storage.clone(), buf.replay.layout
            earlier = buf._requested  # the ticks asked for before the interrupt: [0, earlier)
            for _ in range(2):
                done = buf._next_tick  # the gradient steps done so far
                assert done in (asked - 1, asked), (done, asked)
                size = 20 if done < earlier else buf.replay.size
                samples = buf.sample(n)
                rows = expected_batch(storage, size, n, seed + done)
                assert torch.equal(samples.observations.reshape(n, 6), rows[:, lay.obs])
                asked = done + 2
            buf.add(*adds[25])
            assert buf.replay.ptr in (21, 22)  # 22: the interrupted add's row is there
        finally:
            buf.close()
        # No pipeline left running that nothing would close (a Ctrl-C as one started;
        # a packer thread whose start was cut short ends on its own, its pipeline closed).
        assert not threads_running_on("replay_fsm-", threads)

    def sweep(warm: bool, call: Callable[[PipelineReplayBuffer], object], every: int
              ) -> None:
        buf = made(warm)
        total = interrupted_at(None, functools.partial(call, buf))[0]
        buf.close()
        assert total > 30
        for k in range(1, total + 1, every):
            before = {t.ident for t in threading.enumerate()}
            buf = made(warm)
            interrupted_at(k, functools.partial(call, buf))
            check(buf, 1 + warm, before)

    # A sample that starts the pipeline passes some 8000 points, most of them in the
    # pipeline's constructor (its own test checks its clean-up); the other two some
    # 150 to 450 each.
    cold, warm = SWEEP_STRIDES["deep" if tier_runs("deep") else
                               "slow" if tier_runs("slow") else "fast"]
    sweep(False, lambda buf: buf.sample(n), cold)
    sweep(True, lambda buf: buf.sample(n), warm)
    sweep(True, lambda buf: buf.add(*adds[20]), 1)
