"""Microseconds per full tick cycle of the sans-IO core (request, packed, copied,
acquire, release) at ring depth 2: the core as shipped (TableMachine, one driver
lock, what the pipeline does), the core on a plain transitions Machine, and on a
LockedMachine per slot. Budget: <= 25 us per cycle."""

from __future__ import annotations

import argparse
import threading

from transitions import Machine
from transitions.extensions import LockedMachine

from replay_fsm.core import Core
from replay_fsm.wire import PackDone

try:
    from common import median_time, table, write_result
except ImportError:  # run as a module
    from benchmarks.common import median_time, table, write_result


class LockedCore(Core):
    machine_class = LockedMachine


class PlainMachineCore(Core):
    machine_class = Machine


def cycle_fn(core: Core, lock: threading.Lock | None) -> object:
    state = {"tick": 0}

    def one() -> None:
        tick = state["tick"]
        if lock is None:
            req = core.request(tick)
            core.packed(PackDone(tick, req.slot, req.generation, req.seed, 1, 1, 1))
            core.copied(req.slot)
            core.acquire(tick)
            core.release()
        else:
            with lock:
                req = core.request(tick)
            with lock:
                core.packed(PackDone(tick, req.slot, req.generation, req.seed, 1, 1, 1))
            with lock:
                core.copied(req.slot)
            with lock:
                core.acquire(tick)
            with lock:
                core.release()
        state["tick"] = tick + 1
    return one


def main(quick: bool = False) -> dict[str, float]:
    number, repeat = (200, 5) if quick else (5000, 9)
    figures = {
        "core_us_per_cycle": median_time(cycle_fn(Core(2), None), repeat=repeat,
                                         number=number) * 1e6,
        "core_with_driver_lock_us_per_cycle": median_time(
            cycle_fn(Core(2), threading.Lock()), repeat=repeat, number=number) * 1e6,
        "locked_machine_us_per_cycle": median_time(cycle_fn(LockedCore(2), None),
                                                   repeat=repeat, number=number) * 1e6,
        "plain_machine_us_per_cycle": median_time(cycle_fn(PlainMachineCore(2), None),
                                                  repeat=repeat, number=number) * 1e6,
    }
    figures["core_us_per_transition"] = figures["core_us_per_cycle"] / 5
    figures["locked_machine_us_per_transition"] = figures["locked_machine_us_per_cycle"] / 5
    figures["locked_over_plain"] = (figures["locked_machine_us_per_cycle"]
                                    / figures["plain_machine_us_per_cycle"])
    figures["budget_us_per_cycle"] = 25.0
    write_result("core_overhead", {"ring_depth": 2, "cycles": number * repeat}, figures,
                 quick=quick)
    print(table("core overhead (depth 2, median)", [
        ("core (TableMachine)", f"{figures['core_us_per_cycle']:.1f}",
         f"{figures['core_us_per_transition']:.2f}"),
        ("core + driver lock", f"{figures['core_with_driver_lock_us_per_cycle']:.1f}", ""),
        ("core on a plain Machine", f"{figures['plain_machine_us_per_cycle']:.1f}",
         f"{figures['plain_machine_us_per_cycle'] / 5:.2f}"),
        ("LockedMachine per slot", f"{figures['locked_machine_us_per_cycle']:.1f}",
         f"{figures['locked_machine_us_per_transition']:.2f}"),
    ], ("variant", "us/cycle", "us/transition")))
    return figures


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    main(ap.parse_args().quick)
