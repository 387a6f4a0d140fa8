"""The SPIN model: every claim of specs/claims.pml proved for every backend variant,
with and without faults, at ring depth 2 and, in the deep tier (make verify), 3; every
witness refuted (so no claim holds vacuously); no invalid end state; the skeleton
generated from the table.
CI sets REPLAY_FSM_REQUIRE_SPIN=1, so a missing spin or gcc fails there instead of
skipping."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from replay_fsm.spec import INVARIANTS, TRANSITIONS, Event, SlotState
from replay_fsm.verify.promela import slot_table
from replay_fsm.verify.refinement import SPECS, Pan, PanResult

from .tiers import is_set, tier_runs

HAVE = shutil.which("spin") is not None and shutil.which("gcc") is not None
if not HAVE and is_set("REPLAY_FSM_REQUIRE_SPIN"):
    raise RuntimeError("spin and gcc are required here (REPLAY_FSM_REQUIRE_SPIN is set); "
                       "make sysdeps installs them")
needs_spin = pytest.mark.skipif(not HAVE, reason="spin or gcc not installed (make sysdeps)")

# ring depth, ticks: each wraps the ring twice. Depth 3 is the deep tier (make verify).
CONFIGS = [(2, 5), (3, 7)]
DEEP = {(3, 7)}
CONFIG_PARAMS = [pytest.param(*c, marks=pytest.mark.deep) if c in DEEP else c for c in CONFIGS]
BACKENDS = [None, "CUDA", "ZEROCOPY", "MPS"]  # None: the emulated/manual backends
FAULTS = [(), ("FAULTS",), ("PACKER_FAULTS",)]
# Deadlock freedom is searched with both kinds of faults at once: their runs include
# every run without them (the fault process may skip, the packer may live).
DEADLOCK_DEFINES = ("FAULTS", "PACKER_FAULTS", "NOCLAIMS")

# Each claim and the invariant it checks; expected_witnesses() lists the witnesses
# that show the claims' situations are reachable. specs/INVARIANTS.md lists the
# same; a test below keeps them in step.
CLAIMS: dict[str, str] = {
    "inv_hot": "INV-HOT",
    "inv_order_consecutive": "INV-ORDER",
    "inv_order_ring": "INV-ORDER",
    "inv_order_acquire": "INV-ORDER",
    "inv_order_once": "INV-ORDER",
    "inv_order_every": "INV-ORDER",
    "inv_host_war_requested": "INV-HOST-WAR",
    "inv_host_war_copy": "INV-HOST-WAR",
    "inv_host_one_writer": "INV-HOST-WAR",
    "inv_device_war": "INV-DEVICE-WAR",
    "inv_raw": "INV-RAW",
    "inv_raw_ready": "INV-RAW",
    "inv_live": "INV-LIVE",
    "inv_live_ready": "INV-LIVE",
    "inv_live_watchdog": "INV-LIVE",
    "inv_sticky": "INV-STICKY",
    "inv_sticky_raises": "INV-STICKY",
    "inv_close": "INV-CLOSE",
}
NOT_ORDERING = {"INV-DATA", "INV-ROW"}  # data properties, tested on the runtime


def expected_claims(backend: str | None, faults: tuple[str, ...]) -> set[str]:
    names = set(CLAIMS)
    if "PACKER_FAULTS" not in faults:
        names.discard("inv_live_watchdog")
    if not faults:
        names -= {"inv_sticky", "inv_sticky_raises"}
    return names


def expected_witnesses(backend: str | None, faults: tuple[str, ...]) -> set[str]:
    names = {"w_hot_beside_ready", "w_ring_full", "w_ring_wraps", "w_two_ready",
             "w_oldest_submitted", "w_wait_under_write", "w_pack_during_reads",
             "w_learner_waits", "w_learner_packs", "w_two_writers", "w_shared_request"}
    if backend != "ZEROCOPY":
        names |= {"w_pack_during_copy", "w_copy_during_reads"}
    if backend in (None, "CUDA"):
        names |= {"w_reads_outlive_release", "w_copy_waits_for_release"}
    if backend == "CUDA":
        names.add("w_submit_blocks")
    if backend == "MPS":
        names.add("w_pump_while_waiting")
    if "FAULTS" in faults or (faults and backend in (None, "CUDA")):
        # the watchdog fires while the learner waits: with synchronous reads (and on
        # MPS, where the learner runs the copies) nothing is read or copied then
        names.add("w_fail_while_read")
        if backend != "ZEROCOPY":
            names.add("w_fail_during_copy")
    if "FAULTS" in faults:
        names |= {"w_close_in_flight", "w_fail_during_write"}
    if "PACKER_FAULTS" in faults:
        names |= {"w_dead_packer_request", "w_silent_packer_request"}
    return names


def run_all(pan: Pan, claims: list[str]) -> dict[str, PanResult]:
    """pan for each claim, in parallel: each run is a separate process."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return dict(zip(claims, pool.map(pan.check, claims), strict=True))


Builder = Callable[..., Pan]


@pytest.fixture(scope="session")
def build(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Builder]:
    """Builds each (model, depth, ticks, defines, cflags) once per session. The builds
    the tests below need are started at once, in parallel (gcc is most of their
    cost), and each test waits only for its own."""
    pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1)
    cache: dict[tuple[object, ...], Future[Pan]] = {}

    def start(model: str, depth: int, ticks: int, *defines: str,
              cflags: tuple[str, ...] = ()) -> Future[Pan]:
        key = (model, depth, ticks, defines, cflags)
        if key not in cache:
            where = tmp_path_factory.mktemp("pan")
            cache[key] = pool.submit(Pan, where, model, depth, ticks, defines, cflags)
        return cache[key]

    if HAVE:
        for depth, ticks in CONFIGS:
            if (depth, ticks) in DEEP and not tier_runs("deep"):
                continue  # skipped: not built
            for backend in BACKENDS:
                chosen = (backend,) if backend else ()
                for faults in FAULTS:
                    start("pipeline.pml", depth, ticks, *chosen, *faults)
                start("pipeline.pml", depth, ticks, *chosen, *DEADLOCK_DEFINES,
                      cflags=("-DSAFETY",))
    yield lambda *args, **kw: start(*args, **kw).result()
    pool.shutdown(cancel_futures=True)


def _id(value: object) -> str:
    if isinstance(value, tuple):
        return "+".join(value).lower() or "no-faults"
    return str(value or "default").lower()


def test_committed_skeleton_is_generated_from_the_table() -> None:
    assert (SPECS / "slot_table.pml").read_text() == slot_table()


def test_model_changes_slot_states_only_through_the_table() -> None:
    model = re.sub(r"/\*.*?\*/", "", (SPECS / "pipeline.pml").read_text(), flags=re.S)
    # step() is the one caller of fire(); every event of the table is stepped.
    assert re.findall(r"\bfire\(", model) == ["fire("]
    stepped = set(re.findall(r"step\(\w+, ev_(\w+)\)", model))
    assert stepped == {e.value for e in Event} == {t.event.value for t in TRANSITIONS}
    assert not re.search(r"(?<!mtype )\bst\[[^\]]*\]\s*=[^=]", model), (
        "st[] assigned outside fire()")
    assert set(re.findall(r"\b(IDLE|REQUESTED|SUBMITTED|READY|HOT|FAILED|CLOSED)\b",
                          model)) <= {s.name for s in SlotState}


def test_every_ordering_invariant_has_claims_listed_in_the_catalogue() -> None:
    assert set(CLAIMS.values()) == set(INVARIANTS) - NOT_ORDERING
    catalogue = (SPECS / "INVARIANTS.md").read_text()
    claims = (SPECS / "claims.pml").read_text()
    declared = set(re.findall(r"^ltl (\w+)", claims, re.M))
    witnesses = set().union(*(expected_witnesses(b, f) for b in BACKENDS for f in FAULTS))
    assert declared == set(CLAIMS) | witnesses
    for name in declared:
        assert f"`{name}`" in catalogue, f"{name} is not in specs/INVARIANTS.md"


@needs_spin
@pytest.mark.parametrize("faults", FAULTS, ids=_id)
@pytest.mark.parametrize("backend", BACKENDS, ids=_id)
@pytest.mark.parametrize("depth,ticks", CONFIG_PARAMS)
def test_spin_proves_every_claim_and_refutes_every_witness(
        build: Builder, depth: int, ticks: int, backend: str | None,
        faults: tuple[str, ...]) -> None:
    defines = (*([backend] if backend else []), *faults)
    pan = build("pipeline.pml", depth, ticks, *defines)
    claims = [c for c in pan.claims if c.startswith("inv_")]
    witnesses = [c for c in pan.claims if c.startswith("w_")]
    assert set(claims) == expected_claims(backend, faults)
    assert set(witnesses) == expected_witnesses(backend, faults)
    results = run_all(pan, claims + witnesses)
    for claim in claims:  # liveness ones under weak fairness (-f)
        assert results[claim].errors == 0, f"{claim}, {defines}:\n{results[claim].output}"
    for witness in witnesses:  # the situation is reachable: pan finds it
        r = results[witness]
        assert r.errors == 1 and r.claim_violated, f"{witness}, {defines}:\n{r.output}"


@needs_spin
@pytest.mark.parametrize("backend", BACKENDS, ids=_id)
@pytest.mark.parametrize("depth,ticks", CONFIG_PARAMS)
def test_spin_finds_no_invalid_end_state(build: Builder, depth: int, ticks: int,
                                         backend: str | None) -> None:
    """No invalid end state, in one search that covers all three fault settings."""
    defines = (*([backend] if backend else []), *DEADLOCK_DEFINES)
    result = build("pipeline.pml", depth, ticks, *defines, cflags=("-DSAFETY",)).run()
    assert result.errors == 0 and "invalid end states\t+" in result.output, result.output


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


def test_a_model_outside_a_clone_is_named_not_left_to_spin(tmp_path: Path) -> None:
    """From an installed package, whose SPECS points where no specs/ lies, spin failed
    with "cc1: fatal error: pipeline.pml: No such file or directory"."""
    with pytest.raises(FileNotFoundError, match="the models live in the repository's "
                       "specs/ folder, which an installed package does not hold"):
        Pan(tmp_path / "work", "pipeline.pml", 2, 3, specs=tmp_path / "site-packages")
    assert not (tmp_path / "work").exists()  # nothing made
