"""Each state-based claim catches the bug it targets: a model with one bug (a
specs/broken/*.pml file, or pipeline_broken.pml for the seed's ordering) is refuted
by SPIN for that claim, by the claim itself rather than fire()'s table assertion,
and the counterexample ends in the state the bug produces."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from replay_fsm.verify.refinement import Pan

from .test_spin import CLAIMS, needs_spin

# Skips without spin, and fails to import where CI requires it (as test_spin.py).
pytestmark = needs_spin

Final = dict[str, str]  # the trail's last value of each global, as spin prints it


def _some_slot(final: Final, depth: int, test: Callable[[Callable[[str], str]], bool]
               ) -> bool:
    """Whether ``test`` holds for some slot k, given a lookup of name -> name[k]."""

    def slot(k: int) -> Callable[[str], str]:
        return lambda name: final.get(f"{name}[{k}]", "")

    return any(test(slot(k)) for k in range(depth))


@dataclass(frozen=True)
class Broken:
    model: str
    refutes: tuple[str, ...]
    ends_in: Callable[[Final, int], bool]
    still_holds: tuple[str, ...] = field(default=())


DEPTH, TICKS = 2, 5
BROKEN = {
    # INV-DEVICE-WAR: the seed's copy does not wait for the release of G[i].
    "seed_ordering": Broken(
        "pipeline_broken.pml", ("inv_device_war",),
        lambda f, d: _some_slot(f, d, lambda s: s("copying") == "1" and s("reading") == "1")),
    # INV-HOT: two slots HOT; the old claim on the learner's own counter passed this.
    "lazy_release": Broken(
        "broken/lazy_release.pml", ("inv_hot",),
        lambda f, d: [f[f"st[{k}]"] for k in range(d)].count("HOT") == 2),
    # INV-ORDER ring clause: the old model built ring order in (req_slot).
    "any_free_slot": Broken(
        "broken/any_free_slot.pml", ("inv_order_ring",),
        lambda f, d: any(f[f"st[{k}]"] in ("REQUESTED", "SUBMITTED", "READY", "HOT")
                         and int(f[f"tick_of[{k}]"]) % d != k for k in range(d))),
    "skip_tick": Broken(
        "broken/skip_tick.pml", ("inv_order_consecutive",),
        lambda f, d: int(f["next_req"]) - int(f["nrel"]) > sum(
            f[f"st[{k}]"] in ("REQUESTED", "SUBMITTED", "READY", "HOT") for k in range(d))),
    "out_of_order": Broken(
        "broken/out_of_order.pml", ("inv_order_acquire", "inv_order_once"),
        lambda f, d: any(f[f"st[{k}]"] == "HOT" and f[f"tick_of[{k}]"] != f["nrel"]
                         for k in range(d))),
    # INV-RAW: acquire of a SUBMITTED slot past the table, its rows already in G:
    # the data claim holds, only the state-based one sees it.
    "acquire_submitted": Broken(
        "broken/acquire_submitted.pml", ("inv_raw_ready",),
        lambda f, d: _some_slot(f, d, lambda s: s("st") == "HOT" and s("from_ready") == "0"),
        still_holds=("inv_raw", "inv_hot", "inv_order_once")),
    "complete_before_copy": Broken(
        "broken/complete_before_copy.pml", ("inv_raw",),
        lambda f, d: _some_slot(f, d, lambda s: s("st") == "HOT" and s("copying") == "1")),
    "pack_while_submitted": Broken(
        "broken/pack_while_submitted.pml", ("inv_host_war_requested", "inv_host_war_copy"),
        lambda f, d: _some_slot(f, d, lambda s: s("hwrite") == "1"
                                and s("st") == "SUBMITTED")),
    "partial_fail": Broken(
        "broken/partial_fail.pml", ("inv_sticky",),
        lambda f, d: f["failed"] == "1" and "HOT" in [f[f"st[{k}]"] for k in range(d)]),
    "close_without_drain": Broken(
        "broken/close_without_drain.pml", ("inv_close",),
        lambda f, d: f["learner_done"] == "1" and _some_slot(
            f, d, lambda s: "1" in (s("copying"), s("ordered"), s("hwrite")))),
    "swallow_failure": Broken(
        "broken/swallow_failure.pml", ("inv_sticky_raises",),
        lambda f, d: "1" in (f["failed"], f["closed"]) and f["learner_raised"] == "0"
        and int(f["nrel"]) < TICKS),
    # INV-LIVE second half: without the watchdog a dead packer hangs the learner, and
    # its unserved request never becomes READY.
    "no_watchdog": Broken(
        "broken/no_watchdog.pml",
        ("inv_live_watchdog", "inv_live", "inv_live_ready", "inv_order_every"),
        lambda f, d: f["learner_raised"] == "0" and "1" in (f["packer_dead"],
                                                             f["packer_silent"])),
    # INV-HOST-WAR, one writer per chunk: the learner's claim read and set in two
    # steps, so a chunk the packer claimed in between is claimed again: the slot's
    # C = 2 chunks count to more than two.
    "learner_claim_unlocked": Broken(
        "broken/learner_claim_unlocked.pml", ("inv_host_one_writer",),
        lambda f, d: _some_slot(f, d, lambda s: s("st") == "REQUESTED" and sum(
            int(s(name)) for name in ("left", "hwrite", "lwrite", "done")) > 2)),
    # Backends: each way one could break its ordering.
    "cuda_no_release_wait": Broken(
        "broken/cuda_no_release_wait.pml", ("inv_device_war",),
        lambda f, d: _some_slot(f, d, lambda s: s("copying") == "1" and s("reading") == "1")),
    "zerocopy_write_while_hot": Broken(
        "broken/zerocopy_write_while_hot.pml", ("inv_host_war_requested", "inv_raw"),
        lambda f, d: _some_slot(f, d, lambda s: s("hwrite") == "1" and s("st") == "HOT")),
    "zerocopy_async_reads": Broken(
        "broken/zerocopy_async_reads.pml", ("inv_device_war",),
        lambda f, d: _some_slot(f, d, lambda s: s("hwrite") == "1" and s("reading") == "1")),
    "mps_complete_before_copy": Broken(
        "broken/mps_complete_before_copy.pml", ("inv_raw",),
        lambda f, d: _some_slot(f, d, lambda s: s("st") == "HOT" and s("copying") == "1")),
    "mps_release_without_sync": Broken(
        "broken/mps_release_without_sync.pml", ("inv_device_war",),
        lambda f, d: _some_slot(f, d, lambda s: s("copying") == "1" and s("reading") == "1")),
}
def final_globals(trail: str) -> Final:
    return dict(re.findall(r"^\s+(\w+(?:\[\d+\])?) = (\S+)$", trail, re.M))


@pytest.mark.parametrize("name", BROKEN)
def test_spin_refutes_the_broken_model(tmp_path: Path, name: str) -> None:
    broken = BROKEN[name]
    pan = Pan(tmp_path, broken.model, DEPTH, TICKS)
    for claim in broken.still_holds:
        assert pan.check(claim).errors == 0, claim
    for claim in broken.refutes:
        result = pan.check(claim)
        assert result.errors == 1 and result.claim_violated, f"{claim}:\n{result.output}"
        final = final_globals(pan.trail())
        assert broken.ends_in(final, DEPTH), f"{claim}: the trail ends in {final}"


def test_without_the_watchdog_a_dead_packer_leaves_the_learner_stuck(tmp_path: Path
                                                                     ) -> None:
    result = Pan(tmp_path, "broken/no_watchdog.pml", DEPTH, TICKS, ["NOCLAIMS"],
                 ["-DSAFETY"]).run()
    assert result.errors == 1 and "invalid end state" in (result.violation or ""), (
        result.output)


def test_every_broken_model_is_exercised() -> None:
    specs = Path(__file__).resolve().parent.parent / "specs"
    on_disk = {f"broken/{p.name}" for p in (specs / "broken").glob("*.pml")}
    assert on_disk | {"pipeline_broken.pml"} == {b.model for b in BROKEN.values()}


def test_every_claim_is_refuted_by_some_broken_model() -> None:
    refuted = {claim for broken in BROKEN.values() for claim in broken.refutes}
    assert refuted == set(CLAIMS)
