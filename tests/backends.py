"""The contract configurations of every registered backend: the contract tests and
the Hypothesis machines enumerate ``replay_fsm.transfer.registered_backends()``
through this table, so a backend registered without a configuration here fails
``test_every_registered_backend_has_a_contract_config`` instead of going untested."""

from __future__ import annotations

import pytest

from replay_fsm.transfer import build_backend, registered_backends

# backend name -> (config id, device, backend options) for each configuration to run
CONTRACT: dict[str, list[tuple[str, str, dict]]] = {
    "cpu": [("cpu", "cpu", {}), ("cpu-copy", "cpu", {"copy": True})],
    "cuda": [("cuda", "cuda", {})],
    "accel": [("mps", "mps", {}), ("xpu", "xpu", {})],
    "emulated": [("emulated", "cpu", {"copy_delay": (0, 0.001), "read_delay": (0, 0.001)})],
    "manual": [("manual", "cpu", {})],
}


def available(name: str, device: str, options: dict) -> str | None:
    """None when this machine can build the backend, else why not."""
    try:
        build_backend(device, name, **options).close()
    except ValueError as exc:
        return str(exc)
    return None


def contract_params() -> list:
    """One pytest param (device, backend name, options) per configuration."""
    params = []
    for name in registered_backends():
        for cid, device, options in CONTRACT.get(name, [(name, "cpu", {})]):
            why = available(name, device, options)
            params.append(pytest.param((device, name, options), id=cid, marks=(
                [pytest.mark.skip(reason=why)] if why else [])))
    return params

