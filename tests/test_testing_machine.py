"""The exported Hypothesis machine, run against every backend available here."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from replay_fsm.testing import pipeline_machine

from .backends import contract_params


def configs() -> list:
    """Every registered backend's contract configurations (tests/backends.py), at ring
    depth 2 and 3 in turn; manual also with critic columns."""
    out = []
    for k, param in enumerate(contract_params()):
        device, name, options = param.values[0]
        config = {"device": device, "backend": name, "backend_options": options,
                  "ring_depth": 2 + k % 2}
        out.append(pytest.param(config, id=f"{param.id}-{config['ring_depth']}",
                                marks=param.marks))
        if name == "manual":
            out.append(pytest.param({**config, "ring_depth": 3, "critic_dim": 2},
                                    id="manual-3-critic"))
    return out


CONFIGS = configs()


@pytest.mark.parametrize("config", CONFIGS)
def test_exported_machine_on_each_backend(config: dict) -> None:
    machine = pipeline_machine(max_steps=30, **config)
    current = settings()
    run_state_machine_as_test(machine, settings=settings(
        current, max_examples=min(current.max_examples, 40), stateful_step_count=30))


def test_unknown_option_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown pipeline_machine options"):
        pipeline_machine(colour="blue")


def _run_manual(max_examples: int) -> None:
    run_state_machine_as_test(pipeline_machine(backend="manual", ring_depth=2), settings=settings(
        max_examples=max_examples, deadline=None, derandomize=True, database=None))


def test_the_machine_catches_a_core_that_acquires_out_of_order(monkeypatch) -> None:
    """The machine offers illegal learner calls too: a core whose acquire guard lets
    any pending tick be taken (INV-ORDER) is caught."""
    from replay_fsm import core
    from replay_fsm.spec import Event

    def any_pending(c, slot, step):  # type: ignore[no-untyped-def]
        if step.tick not in [t for t, _ in c.pending]:
            return "not pending"
        return None if c.hot_slot is None else "hot"

    monkeypatch.setitem(core._GUARD_FN, Event.ACQUIRE, any_pending)
    with pytest.raises(AssertionError, match="INV-ORDER"):
        _run_manual(60)


def test_the_machine_reaches_slot_reuse_and_catches_a_release_without_fence(
        monkeypatch) -> None:
    """A release that never ends the slot's reads (no ``after_read``) bites only when
    the slot is used again; a fault injected at every chance ended most examples
    before that. The failure replays the same, run after run."""
    from replay_fsm.transfer.manual import ManualBackend

    monkeypatch.setattr(ManualBackend, "after_read", lambda self, slot: None)
    with pytest.raises(RuntimeError, match="must wait for the release"):
        _run_manual(50)


def test_a_run_longer_than_max_steps_never_wraps_the_buffer() -> None:
    """Hypothesis's stateful_step_count is not max_steps: a run of more steps than the
    buffer was sized for must not wrap it (the machine then saw a false INV-DATA)."""
    run_state_machine_as_test(pipeline_machine(backend="manual", max_steps=1), settings=settings(
        max_examples=15, stateful_step_count=25, deadline=None, derandomize=True,
        database=None))


def test_a_collector_the_machine_cannot_serve_is_refused_at_once() -> None:
    """The machine adds rows and drives the learner; nothing in it serves an external
    collector's requests. collector="external" waited 60 s for a copy never submitted,
    twice, then failed with a bare AssertionError (2 of 2 runs)."""
    with pytest.raises(ValueError, match="collector='external'.*thread or process"):
        pipeline_machine(collector="external")
    with pytest.raises(ValueError, match="collector='carrier pigeon'"):
        pipeline_machine(collector="carrier pigeon")
