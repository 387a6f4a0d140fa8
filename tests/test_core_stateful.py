"""Every actor step is a rule; the core is checked against a plain-Python model.

Invariants cited: INV-HOT, INV-ORDER, INV-HOST-WAR, INV-DEVICE-WAR, INV-STICKY.
The model also plays the device: a copy into G[i] may start only once the
reads named by the copy order's release dependency have finished, so a core that
named the wrong dependency would let a copy overwrite a slot still being read.
"""

from __future__ import annotations

import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from replay_fsm.core import Core
from replay_fsm.errors import IllegalTransition, PipelineClosed, PipelineFailed
from replay_fsm.spec import TRANSITIONS, Event, SlotState
from replay_fsm.wire import CopyOrder, PackDone, TransitionRecord

S = SlotState


class CoreMachine(RuleBasedStateMachine):
    depth = 2
    rows: set[tuple[SlotState, object]] | None = None  # coverage sink, when set

    @initialize(first=st.integers(0, 1000), fault_after=st.integers(0, 60) | st.integers(15, 60))
    def start(self, first: int, fault_after: int = 0) -> None:
        # Faults end an example's progress, so Hypothesis picks when they may start.
        self.fault_after = fault_after
        self.steps = 0
        self.core = Core(self.depth, observer=self._observe)
        self.first = first
        self.model = [S.IDLE] * self.depth
        self.model_tick: list[int | None] = [None] * self.depth
        self.next_tick = first
        self.next_slot = first % self.depth  # ring order: tick t in slot t % depth
        self.acquired: list[int] = []
        self.host_writer = [False] * self.depth   # packer may write H[i]
        self.host_reader = [False] * self.depth   # a copy reads H[i]
        self.device_reads: set[tuple[int, int]] = set()  # (slot, tick) reads in flight
        self.copy_writing = [False] * self.depth  # a copy writes G[i]
        self.orders: dict[int, CopyOrder] = {}
        self.cause: BaseException | None = None
        self.closed = False

    def _observe(self, rec: TransitionRecord) -> None:
        if CoreMachine.rows is not None:
            CoreMachine.rows.add((rec.source, rec.event))

    def _faults_allowed(self) -> bool:
        return self.steps >= self.fault_after

    @invariant()
    def count_steps(self) -> None:
        self.steps += 1

    def _live(self) -> bool:
        return self.cause is None and not self.closed

    def _expect_rejected(self, call, error=IllegalTransition) -> None:  # type: ignore[no-untyped-def]
        before = self.core.key()
        if error is ValueError:
            pass  # a bad argument is refused before the state is looked at
        elif not self._live():
            error = PipelineFailed if self.cause is not None else PipelineClosed
        with pytest.raises(error) as info:
            call()
        if self.cause is not None and error is not ValueError:
            assert info.value.__cause__ is self.cause  # INV-STICKY
        assert self.core.key() == before  # INV-STICKY: nothing changed

    # -- model helpers --------------------------------------------------------

    def _pending(self) -> list[tuple[int, int]]:
        return sorted((t, i) for i, t in enumerate(self.model_tick)
                      if t is not None and self.model[i] in (S.REQUESTED, S.SUBMITTED,
                                                             S.READY))

    def _can_request(self) -> bool:
        return self._live() and self.model[self.next_slot] is S.IDLE

    def _can_acquire(self, tick: int) -> bool:
        pending = self._pending()
        return bool(self._live() and pending and pending[0][0] == tick
                    and self.model[pending[0][1]] is S.READY and S.HOT not in self.model)

    # -- learner --------------------------------------------------------------

    @precondition(lambda self: self._can_request())
    @rule()
    def request(self) -> None:
        slot = self.next_slot
        req = self.core.request(self.next_tick)
        assert (req.tick, req.slot, req.seed) == (self.next_tick, slot, self.next_tick)
        self.model[slot], self.model_tick[slot] = S.REQUESTED, self.next_tick
        self.host_writer[slot] = True
        self.next_tick += 1
        self.next_slot = (slot + 1) % self.depth

    @precondition(lambda self: self._pending() and self._can_acquire(self._pending()[0][0]))
    @rule()
    def acquire(self) -> None:
        tick, expected_slot = self._pending()[0]
        slot = self.core.acquire(tick)
        assert slot == expected_slot
        self.model[slot] = S.HOT
        self.acquired.append(tick)
        self.device_reads.add((slot, tick))

    @precondition(lambda self: self._live() and S.HOT in self.model)
    @rule()
    def release(self) -> None:
        slot = self.model.index(S.HOT)
        token = self.core.release()
        assert (token.slot, token.tick) == (slot, self.model_tick[slot])
        self.model[slot], self.model_tick[slot] = S.IDLE, None

    # -- transfer, copy engine, device ---------------------------------------

    def _done(self, slot: int) -> PackDone:
        return PackDone(tick=self.model_tick[slot] or 0, slot=slot,
                        generation=self.core.generation_of(slot), seed=0, sample_count=1,
                        snapshot_ptr=1, snapshot_size=1)

    @precondition(lambda self: self._live() and S.REQUESTED in self.model)
    @rule(data=st.data())
    def packed(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(
            [i for i, m in enumerate(self.model) if m is S.REQUESTED]), label="slot")
        order = self.core.packed(self._done(slot))
        self.orders[slot] = order
        self.model[slot] = S.SUBMITTED
        self.host_writer[slot] = False
        self.host_reader[slot] = True

    @precondition(lambda self: any(not self.copy_writing[i] for i in self.orders))
    @rule(data=st.data())
    def start_copy(self, data: st.DataObject) -> None:
        """The copy engine honours the order's dependency, as the backends do."""
        slot = data.draw(st.sampled_from(
            sorted(i for i in self.orders if not self.copy_writing[i])), label="slot")
        dep = self.orders[slot].after_release
        if dep is not None and (dep.slot, dep.tick) in self.device_reads:
            return  # the copy engine waits
        self.copy_writing[slot] = True

    @precondition(lambda self: self._live() and any(self.copy_writing))
    @rule(data=st.data())
    def copied(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(
            [i for i, w in enumerate(self.copy_writing) if w]), label="slot")
        self.core.copied(slot)
        self.model[slot] = S.READY
        self.host_reader[slot] = False
        self.copy_writing[slot] = False
        del self.orders[slot]

    @rule(data=st.data())
    def device_reads_finish(self, data: st.DataObject) -> None:
        done = [r for r in sorted(self.device_reads) if self.model[r[0]] is not S.HOT
                or self.model_tick[r[0]] != r[1]]
        if done:
            self.device_reads.discard(data.draw(st.sampled_from(done)))

    # -- illegal steps: each must raise and change nothing (INV-STICKY) -------

    @rule(kind=st.sampled_from(["request", "acquire", "release", "packed", "copied"]),
          offset=st.sampled_from([-1, 0, 1, 2]), slot=st.integers(0, 3))
    def illegal_step(self, kind: str, offset: int, slot: int) -> None:
        slot %= self.depth
        if kind == "request":
            tick = self.next_tick + offset
            if (offset == 0 and self._can_request()) or (
                    self._live() and self.next_tick == self.first):
                return
            self._expect_rejected(lambda: self.core.request(tick),
                                  ValueError if tick < 0 else IllegalTransition)
        elif kind == "acquire":
            pending = self._pending()
            tick = (pending[0][0] if pending else self.next_tick) + offset
            if not self._can_acquire(tick):
                self._expect_rejected(lambda: self.core.acquire(tick),
                                      ValueError if tick < 0 else IllegalTransition)
        elif kind == "release":
            if not (self._live() and S.HOT in self.model):
                self._expect_rejected(self.core.release)
        elif kind == "packed":
            if not (self._live() and self.model[slot] is S.REQUESTED):
                done = self._done(slot)
                self._expect_rejected(lambda: self.core.packed(done))
        elif not (self._live() and self.model[slot] is S.SUBMITTED):
            self._expect_rejected(lambda: self.core.copied(slot))

    # -- faults ---------------------------------------------------------------

    @precondition(lambda self: self._faults_allowed())
    @rule()
    def fail(self) -> None:
        err = RuntimeError("injected fault")
        self.core.fail(err)
        if self._live():
            self.cause = err
            self.model = [S.FAILED] * self.depth

    @precondition(lambda self: self._faults_allowed())
    @rule()
    def close(self) -> None:
        self.core.close()
        self.closed = True
        self.model = [S.CLOSED] * self.depth

    # -- invariants -----------------------------------------------------------

    @invariant()
    def matches_model(self) -> None:
        assert list(self.core.states) == self.model
        self.core.check_invariants()

    @invariant()
    def inv_hot(self) -> None:
        assert sum(s is S.HOT for s in self.core.states) <= 1

    @invariant()
    def inv_order(self) -> None:
        assert self.acquired == list(range(self.first, self.first + len(self.acquired)))

    @invariant()
    def inv_host_war(self) -> None:
        for i in range(self.depth):
            assert not (self.host_writer[i] and self.host_reader[i]), i
            if self.host_writer[i] and self._live():
                assert self.core.state(i) is S.REQUESTED

    @invariant()
    def inv_device_war(self) -> None:
        for slot, _tick in self.device_reads:
            assert not self.copy_writing[slot], f"INV-DEVICE-WAR: copy into G[{slot}]"


class Depth2(CoreMachine):
    depth = 2


class Depth3(CoreMachine):
    depth = 3


class Depth4(CoreMachine):
    depth = 4


TestDepth2 = Depth2.TestCase
TestDepth3 = Depth3.TestCase
TestDepth4 = Depth4.TestCase


def test_stateful_suite_covers_every_table_row() -> None:
    CoreMachine.rows = set()
    try:
        run_state_machine_as_test(
            Depth2, settings=settings(max_examples=500, stateful_step_count=60,
                                      derandomize=True, deadline=None))
        covered = set(CoreMachine.rows)
    finally:
        CoreMachine.rows = None
    rows = {(t.source, t.event) for t in TRANSITIONS}
    states = {s for s, _ in covered} | {t.dest for t in TRANSITIONS if (t.source, t.event)
                                        in covered}
    events = {e for _, e in covered}
    print(f"\ncoverage: rows {len(covered & rows)}/{len(rows)}, states "
          f"{len(states)}/{len(SlotState)}, events {len(events)}/{len(Event)}")
    missing = rows - covered
    assert not missing, f"rows never fired: {sorted((s.name, e.value) for s, e in missing)}"
    assert states == set(SlotState) and events == set(Event)


class _BrokenCore(Core):
    """Names no release dependency: the seed's missing fence."""

    def packed(self, done: PackDone) -> CopyOrder:
        order = super().packed(done)
        return CopyOrder(order.tick, order.slot, order.generation, after_release=None)


class BrokenMachine(CoreMachine):
    @initialize(first=st.integers(0, 3), fault_after=st.just(10_000))
    def start(self, first: int, fault_after: int = 0) -> None:
        super().start(first, fault_after)
        self.core = _BrokenCore(self.depth, observer=self._observe)


def test_the_model_catches_a_core_without_the_release_dependency() -> None:
    with pytest.raises(AssertionError, match="INV-DEVICE-WAR"):
        run_state_machine_as_test(
            BrokenMachine, settings=settings(max_examples=500, stateful_step_count=40,
                                             derandomize=True, deadline=None,
                                             print_blob=False,
                                             phases=[Phase.generate]))
