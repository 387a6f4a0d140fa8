"""A Hypothesis state machine that drives a real ``Pipeline`` beside a reference
model; run it on your own configuration in a few lines::

    from replay_fsm.testing import pipeline_machine
    TestMyPipeline = pipeline_machine(device="cuda", ring_depth=3, obs_dim=64,
                                      action_dim=6, sample_count=256).TestCase

Rules: the collector adds rows, the learner requests, re-requests, samples and
releases (one tick at a time, or a whole tick as ``ticks()`` runs it), makes illegal
calls (each must raise ``ProtocolError`` and change nothing), copies complete in any
order (manual backend) or on real threads (the others), faults are injected (one
roll in eight). Invariants: the pipeline's pending and hot ticks and its slot states
agree with the model, INV-HOT, INV-ORDER, INV-STICKY, and INV-DATA bit for bit on
every batch.
The adds never wrap the ring (capacity is sized for ``max_steps`` adds, and an add
that would wrap it is not offered), so a sampled row never changes between the pack
and the check and INV-DATA can be checked exactly.
"""

from __future__ import annotations

from collections.abc import Callable
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
from .errors import PipelineFailed, ProtocolError
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
        self.completed: set[int] = set()  # ticks whose copy the machine completed (manual)
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

    def _room(self) -> bool:
        """Whether an add of up to MAX_ADD rows leaves the ring unwrapped: Hypothesis's
        ``stateful_step_count`` is not ``max_steps``, and a wrapped row changes under
        a batch already packed from it (a false INV-DATA failure)."""
        return self.rb.ptr + MAX_ADD <= self.rb.capacity

    def _can_request(self) -> bool:
        return self._live() and len(self.pending) + (self.hot is not None) < self.ring_depth

    def _manual(self) -> bool:
        return self.pipe.backend.name == "manual"

    def _owed(self) -> list[int]:
        """Pending ticks whose copy the machine has not completed (manual backend)."""
        return [t for t in self.pending if t not in self.completed]

    def _complete(self, tick: int) -> None:
        """Manual backend: wait for the transfer worker to submit the copy of ``tick``,
        then complete it."""
        slot = tick % self.ring_depth
        assert self.pipe.backend.wait_submitted(slot, 60)  # type: ignore[attr-defined]
        self.pipe.backend.complete(slot)  # type: ignore[attr-defined]
        self.completed.add(tick)

    # -- rules ----------------------------------------------------------------

    @precondition(lambda self: self._live() and self._room())
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

    @precondition(lambda self: self._live() and self.hot is None
                  and (bool(self.pending) or self._can_request()))
    @rule()
    def learner_runs_a_tick(self) -> None:
        """One step of a ``ticks()`` loop: request up to the ring's depth ahead, sample
        the oldest tick, release it. Gets an example to slot reuse in a few steps."""
        while self._can_request():
            self.learner_requests()
        self.learner_samples()
        self.learner_releases()

    @precondition(lambda self: self._live())
    @rule(kind=st.sampled_from(["skip", "again", "out_of_order"]))
    def learner_steps_out_of_order(self, kind: str) -> None:
        """An illegal learner call raises a ProtocolError and changes nothing
        (INV-ORDER's refusals, INV-STICKY's second clause)."""
        call: Callable[[int, int], object]
        if kind == "skip":  # a request that skips the next tick (the first may be any)
            if self.next_tick == 0:
                return
            call, tick = self.pipe.start_prepare, self.next_tick + 1
        elif kind == "again":  # a request of a tick acquired and released already
            done = [t for t in self.acquired if t != self.hot]
            if not done:
                return
            call, tick = self.pipe.start_prepare, done[-1]
        else:  # a sample of the second oldest tick, once it is ready
            if self.hot is not None or len(self.pending) < 2:
                return
            tick = self.pending[1]
            if self._manual() and tick not in self.completed:
                self._complete(tick)
            assert self.pipe.wait_until_ready(tick, self.sample_count, timeout=60)
            call = self.pipe.sample_large_batch
        before = (self.pipe.pending, self.pipe.hot)
        try:
            call(tick, self.sample_count)
        except ProtocolError:
            pass
        else:
            raise AssertionError(f"INV-ORDER: the illegal call ({kind}) was accepted")
        assert (self.pipe.pending, self.pipe.hot) == before, (
            "INV-STICKY: a refused call changed the pipeline")

    @precondition(lambda self: self._live() and self._manual() and bool(self._owed()))
    @rule(pick=st.integers(0, 7))
    def copy_completes(self, pick: int) -> None:
        # Neither the draw nor what it does may depend on what the transfer thread has
        # submitted so far (thread timing): Hypothesis replays a failing example draw
        # for draw, and a step that completed a copy in one run and skipped it in the
        # replay made the replay flaky. The model says which copies are owed.
        owed = self._owed()
        self._complete(owed[pick % len(owed)])

    @precondition(lambda self: self._live() and self.hot is None and bool(self.pending))
    @rule()
    def learner_samples(self) -> None:
        tick = self.pending[0]
        if self._manual() and tick not in self.completed:
            self._complete(tick)
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
    @rule(roll=st.integers(0, 7))
    def fault_injected(self, roll: int) -> None:
        # One enabled rule in eight ends the live run: a fault on every roll ended most
        # examples before any slot was used twice.
        if roll:
            return
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
        # INV-ORDER: the pipeline's pending ticks and hot tick, each in its ring slot
        depth = self.ring_depth
        assert list(self.pipe.pending) == [(t, t % depth) for t in self.pending]
        assert self.pipe.hot == (None if self.hot is None else (self.hot, self.hot % depth))


def pipeline_machine(**config: Any) -> type[PipelineMachine]:
    """A PipelineMachine subclass for ``config`` (device, backend, backend_options,
    ring_depth, sample_count, obs_dim, action_dim, critic_dim, collector, and
    max_steps: the adds the replay buffer is sized for, 200 by default; once it is
    full the machine adds no more rows, whatever Hypothesis's stateful_step_count).
    ``collector`` is "thread" or "process": nothing in the machine serves an
    external collector's requests.

    Raises:
        ValueError: an unknown configuration key, or a collector other than "thread"
            and "process".
    """
    unknown = set(config) - {"device", "backend", "backend_options", "ring_depth",
                             "sample_count", "obs_dim", "action_dim", "critic_dim",
                             "collector", "max_steps"}
    if unknown:
        raise ValueError(f"unknown pipeline_machine options: {sorted(unknown)}")
    if config.get("collector", "thread") not in ("thread", "process"):
        raise ValueError(f"collector={config['collector']!r}: the machine drives a "
                         "thread or process collector (nothing in it would serve an "
                         "external collector's requests)")
    if "device" in config and "backend" not in config:
        config["backend"] = None  # the device's own backend
    name = "PipelineMachine_" + "_".join(f"{k}_{v}" for k, v in sorted(config.items())
                                         if k != "backend_options")
    return type(name.replace(":", "_").replace("-", "_"), (PipelineMachine,), config)
