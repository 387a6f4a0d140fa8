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
