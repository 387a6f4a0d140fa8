"""The SPIN model: proved at ring depth 2 and 3, its broken variant refuted, and
its skeleton generated from the table. CI sets REPLAY_FSM_REQUIRE_SPIN=1, so a
missing spin or gcc fails there instead of skipping."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from replay_fsm.spec import TRANSITIONS, Event, SlotState
from replay_fsm.verify.promela import slot_table

SPECS = Path(__file__).resolve().parent.parent / "specs"
HAVE = shutil.which("spin") is not None and shutil.which("gcc") is not None
if not HAVE and os.environ.get("REPLAY_FSM_REQUIRE_SPIN"):
    raise RuntimeError("spin and gcc are required here (REPLAY_FSM_REQUIRE_SPIN is set); "
                       "make sysdeps installs them")
needs_spin = pytest.mark.skipif(not HAVE, reason="spin or gcc not installed (make sysdeps)")
SAFETY = ["inv_hot", "inv_order", "inv_host_war", "inv_device_war", "inv_raw"]
CONFIGS = [(2, 5), (3, 7)]  # ring depth, ticks: each wraps the ring twice


def test_committed_skeleton_is_generated_from_the_table() -> None:
    assert (SPECS / "slot_table.pml").read_text() == slot_table()


def test_model_fires_only_events_of_the_table() -> None:
    model = (SPECS / "pipeline.pml").read_text()
    fired = set(re.findall(r"fire\(\w+, ev_(\w+)\)", model))
    assert fired == {e.value for e in Event} == {t.event.value for t in TRANSITIONS}
    assert set(re.findall(r"\b(IDLE|REQUESTED|SUBMITTED|READY|HOT|FAILED|CLOSED)\b",
                          model)) <= {s.name for s in SlotState}


class Pan:
    def __init__(self, tmp: Path, model: str, depth: int, ticks: int, *defines: str) -> None:
        tmp.mkdir(exist_ok=True)
        for f in SPECS.glob("*.pml"):
            shutil.copy(f, tmp)
        self.tmp, self.model = tmp, model
        self.flags = [f"-DD={depth}", f"-DT={ticks}", *(f"-D{d}" for d in defines)]
        self._run(["spin", *self.flags, "-a", model])
        self._run(["gcc", "-O2", "-DNFAIR=3", "-o", "pan", "pan.c"])

    def _run(self, cmd: list[str]) -> str:
        out = subprocess.run(cmd, cwd=self.tmp, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 or cmd[0] == "./pan", out.stdout + out.stderr
        return out.stdout + out.stderr

    def check(self, *args: str) -> tuple[int, int, str]:
        out = self._run(["./pan", *args])
        errors = int(re.search(r"errors: (\d+)", out).group(1))  # type: ignore[union-attr]
        stored = int(re.search(r"(\d+) states, stored", out).group(1))  # type: ignore[union-attr]
        return errors, stored, out

    def trail(self) -> str:
        return self._run(["spin", *self.flags, "-t", "-p", self.model])


@needs_spin
@pytest.mark.parametrize("depth,ticks", CONFIGS)
@pytest.mark.parametrize("faults", [False, True], ids=["no-faults", "faults"])
def test_spin_proves_every_claim(tmp_path: Path, depth: int, ticks: int,
                                 faults: bool) -> None:
    pan = Pan(tmp_path, "pipeline.pml", depth, ticks, *(["FAULTS"] if faults else []))
    for claim in SAFETY:
        errors, _, out = pan.check("-a", "-N", claim)
        assert errors == 0, f"{claim} at D={depth}:\n{out}"
    errors, _, out = pan.check("-a", "-f", "-N", "live")  # under weak fairness
    assert errors == 0, out
    plain = Pan(tmp_path / "noclaims", "pipeline.pml", depth, ticks, "NOCLAIMS",
                *(["FAULTS"] if faults else []))
    errors, _, out = plain.check()  # no invalid end state: deadlock freedom
    assert errors == 0 and "invalid end states\t+" in out, out


@needs_spin
@pytest.mark.parametrize("depth,ticks", CONFIGS)
def test_spin_refutes_the_seed_ordering(tmp_path: Path, depth: int, ticks: int) -> None:
    pan = Pan(tmp_path, "pipeline_broken.pml", depth, ticks)
    errors, _, out = pan.check("-a", "-N", "inv_device_war")
    assert errors == 1, out
    trail = pan.trail()
    assert "proc  4 (copy_engine" in trail or "copy_engine" in trail
    final = dict(re.findall(r"^\s+(\w+\[\d\]) = (\d+)$", trail, re.M))
    assert any(final.get(f"copying[{k}]") == "1" and final.get(f"reading[{k}]") == "1"
               for k in range(depth)), "the trail must end with a copy over a read slot"


def test_regression_from_the_spin_trail_copy_waits_for_release() -> None:
    """The broken model's counterexample, replayed on the Python pipeline: tick 0's
    kernels still read G[0] after release when tick 2 is packed into slot 0; the
    copy must wait for them (INV-DEVICE-WAR)."""
    import torch

    from replay_fsm import Pipeline, ReplayBuffer

    rb = ReplayBuffer(64, 3, 2)
    rb.add_packed(torch.randn(64, rb.width))
    with Pipeline(rb, sample_count=8, backend="manual",
                  backend_options={"hold_reads": True}) as pipe:
        backend = pipe.backend
        pipe.start_prepare(0, 8)
        assert backend.wait_submitted(0)  # type: ignore[attr-defined]
        backend.complete(0)  # type: ignore[attr-defined]
        pipe.sample_large_batch(0, 8)
        pipe.start_prepare(1, 8)
        pipe.after_tick()  # released, but the kernels of tick 0 still read G[0]
        assert backend.wait_submitted(1)  # type: ignore[attr-defined]
        backend.complete(1)  # type: ignore[attr-defined]
        pipe.sample_large_batch(1, 8)
        pipe.start_prepare(2, 8)  # into slot 0
        assert backend.wait_submitted(0)  # type: ignore[attr-defined]
        with pytest.raises(RuntimeError, match="wait for the release of tick 0"):
            backend.complete(0)  # type: ignore[attr-defined]
        backend.finish_reads(0)  # type: ignore[attr-defined]
        backend.complete(0)  # type: ignore[attr-defined]
        pipe.after_tick()
        assert pipe.batch_ready(2, 8)
