"""A Hypothesis state machine that drives a real ``Pipeline`` beside a reference
model; run it on your own configuration in a few lines::

    from replay_fsm.testing import pipeline_machine
    TestMyPipeline = pipeline_machine(device="cuda", ring_depth=3, obs_dim=64,
                                      action_dim=6, sample_count=256).TestCase

Rules: the collector adds rows, the learner requests, re-requests, samples and
releases, copies complete in any order (manual backend) or on real threads
(the others), faults are injected. Invariants: the slot states agree with the
model, INV-HOT, INV-ORDER, INV-STICKY, and INV-DATA bit for bit on every batch.
The adds never wrap the ring (capacity is sized for it), so a sampled row never
changes between the pack and the check and INV-DATA can be checked exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from .data.buffer import ReplayBuffer
from .errors import PipelineFailed
from .runtime.pipeline import Pipeline
from .spec import SlotState

MAX_ADD = 32


class InjectedFault(RuntimeError):
    """The fault the machine injects; later calls must raise chained to it."""


class PipelineMachine(RuleBasedStateMachine):
    """Configure by subclassing (class attributes) or with ``pipeline_machine``."""

    device = "cpu"
    backend: str | None = "manual"
    backend_options: dict[str, Any] = {}
    ring_depth = 2
    sample_count = 16
    obs_dim, action_dim, critic_dim = 3, 2, 0
    collector = "thread"
    max_steps = 200

    @initialize(seed=st.integers(0, 2**16))
    def setup(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.rb = ReplayBuffer(MAX_ADD * self.max_steps + 64, self.obs_dim,
                               self.action_dim, self.critic_dim)
        self.rows: list[np.ndarray] = []
        self._add(8)
        self.pipe = Pipeline(self.rb, device=self.device, backend=self.backend,
                             backend_options=dict(self.backend_options),
                             sample_count=self.sample_count, base_seed=seed,
                             ring_depth=self.ring_depth, collector=self.collector,
                             checked=True, liveness_timeout=60.0)
        self.next_tick = 0
        self.pending: list[int] = []
        self.hot: int | None = None
        self.acquired: list[int] = []
        self.fault: InjectedFault | None = None

    def teardown(self) -> None:
        if hasattr(self, "pipe"):
            self.pipe.close()

    # -- model helpers --------------------------------------------------------

    def _add(self, n: int) -> None:
        rows = self.rng.standard_normal((n, self.rb.width)).astype(np.float32)
        self.rb.add_packed(torch.from_numpy(rows))
        self.rows.append(rows)

    def _live(self) -> bool:
        return self.fault is None

    def _can_request(self) -> bool:
        return self._live() and len(self.pending) + (self.hot is not None) < self.ring_depth

    def _manual(self) -> bool:
        return self.pipe.backend.name == "manual"

    # -- rules ----------------------------------------------------------------

    @precondition(lambda self: self._live())
    @rule(n=st.integers(1, MAX_ADD))
    def collector_adds(self, n: int) -> None:
        self._add(n)

    @precondition(lambda self: self._can_request())
    @rule()
    def learner_requests(self) -> None:
        assert self.pipe.start_prepare(self.next_tick, self.sample_count) is True
        self.pending.append(self.next_tick)
        self.next_tick += 1

    @precondition(lambda self: self._live() and bool(self.pending))
    @rule(data=st.data())
    def learner_requests_again(self, data: st.DataObject) -> None:
        tick = data.draw(st.sampled_from(self.pending))
        assert self.pipe.start_prepare(tick, self.sample_count) is False

    @precondition(lambda self: self._live() and self._manual())
    @rule(slot=st.integers(0, 7))
    def copy_completes(self, slot: int) -> None:
        # The draw must not depend on what the transfer thread has submitted so far
        # (thread timing): Hypothesis replays a failing example draw for draw.
        slot %= self.ring_depth
        if slot in self.pipe.backend.submitted:  # type: ignore[attr-defined]
            self.pipe.backend.complete(slot)  # type: ignore[attr-defined]

    @precondition(lambda self: self._live() and self.hot is None and bool(self.pending))
    @rule()
    def learner_samples(self) -> None:
        tick = self.pending[0]
        if self._manual():
            slot = self.pipe.slot_of(tick)
            assert slot is not None
            if not self.pipe.batch_ready(tick, self.sample_count):
                assert self.pipe.backend.wait_submitted(slot, 60)  # type: ignore[attr-defined]
                self.pipe.backend.complete(slot)  # type: ignore[attr-defined]
        batch = self.pipe.sample_large_batch(tick, self.sample_count)
        self.pending.pop(0)
        self.hot = tick
        self.acquired.append(tick)
        self._check_data(tick, batch)

    @precondition(lambda self: self._live() and self.hot is not None)
    @rule()
    def learner_releases(self) -> None:
        self.pipe.after_tick()
        self.hot = None

    @precondition(lambda self: self._live())
    @rule()
    def fault_injected(self) -> None:
        self.fault = InjectedFault("injected by the state machine")
        self.pipe.fail(self.fault)

    @precondition(lambda self: not self._live())
    @rule()
    def calls_after_fault_raise_chained(self) -> None:
        for call in (lambda: self.pipe.start_prepare(self.next_tick, self.sample_count),
                     lambda: self.pipe.batch_ready(0, self.sample_count),
                     self.pipe.after_tick):
            try:
                call()
            except PipelineFailed as exc:
                assert exc.__cause__ is self.fault, "INV-STICKY: not chained to the cause"
            else:
                raise AssertionError("INV-STICKY: a call after the failure did not raise")

    # -- checks ---------------------------------------------------------------

    def _check_data(self, tick: int, batch: dict[str, torch.Tensor]) -> None:
        done = self.pipe.pack_record(tick)
        assert done.tick == tick and done.seed == self.pipe.base_seed + tick
        history = np.concatenate(self.rows)[: done.snapshot_size]
        gen = torch.Generator().manual_seed(self.pipe.base_seed + tick)
        idx = torch.randint(0, done.snapshot_size, (self.sample_count,), generator=gen)
        expected = torch.from_numpy(history)[idx]
        got = self.rb.layout.pack(batch)
        assert torch.equal(got, expected), f"INV-DATA: batch of tick {tick} differs"

    @invariant()
    def states_agree_with_the_model(self) -> None:
        if not hasattr(self, "pipe"):
            return
        states = self.pipe.states
        if not self._live():
            assert all(s is SlotState.FAILED for s in states), states
            return
        assert sum(s is SlotState.HOT for s in states) == (self.hot is not None)  # INV-HOT
        busy = sum(s is not SlotState.IDLE for s in states)
        assert busy == len(self.pending) + (self.hot is not None), (states, self.pending)
        assert [t for t, _ in self.pipe.pending] == self.pending  # INV-ORDER

    @invariant()
    def acquired_in_order(self) -> None:
        if hasattr(self, "acquired"):
            assert self.acquired == list(range(len(self.acquired)))  # INV-ORDER


def pipeline_machine(**config: Any) -> type[PipelineMachine]:
    """A PipelineMachine subclass for ``config`` (device, backend, backend_options,
    ring_depth, sample_count, obs_dim, action_dim, critic_dim, collector).

    Raises:
        ValueError: an unknown configuration key.
    """
    unknown = set(config) - {"device", "backend", "backend_options", "ring_depth",
                             "sample_count", "obs_dim", "action_dim", "critic_dim",
                             "collector", "max_steps"}
    if unknown:
        raise ValueError(f"unknown pipeline_machine options: {sorted(unknown)}")
    if "device" in config and "backend" not in config:
        config["backend"] = None  # the device's own backend
    name = "PipelineMachine_" + "_".join(f"{k}_{v}" for k, v in sorted(config.items())
                                         if k != "backend_options")
    return type(name.replace(":", "_").replace("-", "_"), (PipelineMachine,), config)
