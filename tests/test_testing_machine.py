"""The exported Hypothesis machine, run against every backend available here."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from replay_fsm.testing import pipeline_machine

CONFIGS = [
    pytest.param({"backend": "manual", "ring_depth": 2}, id="manual-2"),
    pytest.param({"backend": "manual", "ring_depth": 3, "critic_dim": 2}, id="manual-3"),
    pytest.param({"device": "cpu", "ring_depth": 2}, id="cpu-2"),
    pytest.param({"device": "cpu", "ring_depth": 3, "backend_options": {"copy": True}},
                 id="cpu-copy-3"),
    pytest.param({"backend": "emulated", "ring_depth": 3,
                  "backend_options": {"copy_delay": (0, 0.0005),
                                      "read_delay": (0, 0.0005)}}, id="emulated-3"),
    pytest.param({"device": "cuda", "ring_depth": 2}, id="cuda-2",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                          reason="no CUDA device")),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_exported_machine_on_each_backend(config: dict) -> None:
    machine = pipeline_machine(max_steps=30, **config)
    current = settings()
    run_state_machine_as_test(machine, settings=settings(
        current, max_examples=min(current.max_examples, 40), stateful_step_count=30))


def test_unknown_option_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown pipeline_machine options"):
        pipeline_machine(colour="blue")
