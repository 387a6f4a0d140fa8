"""The weight ring and the episode log the SAC learner shares with its collector."""

from __future__ import annotations

import pytest
import torch

from replay_fsm.data.channel import semaphore_name
from replay_fsm.trainers.shared import EpisodeLog, WeightRing


def test_versions_are_read_back_from_their_slots() -> None:
    ring = WeightRing(4, slots=3)
    out = torch.empty(4)
    for v in range(1, 4):
        ring.publish(v, torch.full((4,), float(v)))
    assert ring.version == 3
    assert ring.read(2, out).tolist() == [2.0] * 4
    assert ring.read(3, out).tolist() == [3.0] * 4


def test_versions_must_follow_each_other() -> None:
    ring = WeightRing(2, slots=2)
    with pytest.raises(ValueError, match="version 2 published after 0"):
        ring.publish(2, torch.zeros(2))
    with pytest.raises(ValueError, match="not published"):
        ring.read(1, torch.empty(2))


def test_a_reader_overtaken_by_the_learner_is_an_internal_error() -> None:
    ring = WeightRing(2, slots=2)
    ring.publish(1, torch.ones(2))
    ring.publish(2, torch.ones(2))  # slot of version 3 = slot of version 1: next write
    with pytest.raises(RuntimeError, match="internal error"):
        ring.read(1, torch.empty(2))


def test_wait_returns_once_published_and_times_out_otherwise() -> None:
    ring = WeightRing(2, slots=2)
    assert not ring.wait(1, timeout=0.01)
    ring.publish(1, torch.ones(2))
    assert ring.wait(1, timeout=0.0)


def test_episode_log_keeps_order_and_the_newest_beyond_capacity() -> None:
    """Past capacity the oldest episodes go, counted (a long run's final return and
    plot described its first 65536 episodes, silently); indices count every episode."""
    log = EpisodeLog(capacity=3)
    log.record(10, [1.5, -2.0], [5, 5])
    log.record(20, [3.0], [7])
    assert log.dropped == 0 and [r for _, _, r, _ in log.rows()] == [1.5, -2.0, 3.0]
    log.record(30, [4.0, 5.0], [9, 9])
    assert len(log) == 5 and log.dropped == 2
    assert [(s, r, n) for s, _, r, n in log.rows()] == [(20, 3.0, 7), (30, 4.0, 9),
                                                        (30, 5.0, 9)]
    assert [r for _, _, r, _ in log.rows(4)] == [5.0]
    assert log.rows(5) == []
    log.record(40, [6.0] * 7, [1] * 7)  # more than it holds in one call
    assert log.dropped == 9 and [r for _, _, r, _ in log.rows()] == [6.0] * 3


def asleep_on(pid: int, name: str, timeout: float = 60.0) -> None:
    """Return once process ``pid``'s main thread is asleep on a futex inside the
    semaphore ``name``'s mapping (its wait); skip where /proc cannot tell."""
    import platform
    import time

    futex = {"x86_64": "202", "aarch64": "98"}.get(platform.machine())
    if futex is None:
        pytest.skip(f"the futex system call's number on {platform.machine()}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            call = open(f"/proc/{pid}/syscall").read().split()
            maps = open(f"/proc/{pid}/maps").read().splitlines()
        except OSError:
            pytest.skip("needs /proc/<pid>/syscall and maps (Linux)")
        if call and call[0] == futex:  # its first argument: the futex's address
            address = int(call[1], 16)
            for line in maps:
                span, *rest = line.split()
                low, high = (int(x, 16) for x in span.split("-"))
                if low <= address < high and rest[-1].endswith(name):
                    return
        elif call and call[0] not in ("running",) and not call[0].lstrip("-").isdigit():
            pytest.skip(f"/proc/{pid}/syscall says {call[0]!r}")
        time.sleep(0.01)  # a poll of the process's state, not a wait for it
    raise AssertionError(f"process {pid} never slept in the semaphore's wait")


def _wait_for_ever(ring: WeightRing, ready: object) -> None:
    ready.set()  # type: ignore[attr-defined]
    while True:
        ring.wait(10**9, timeout=60.0)


def test_a_collector_killed_while_it_waits_for_weights_leaves_publish_free() -> None:
    """The synchronous trainer's collector spends its time asleep in ``wait``; killed
    there (SIGKILL, the OOM killer), it left the learner's next ``publish`` waiting
    for ever for it to wake (a multiprocessing Event's set), instead of the trainer
    failing with CollectorDied."""
    import multiprocessing as mp
    import threading

    ctx = mp.get_context("spawn")
    ring = WeightRing(2, slots=2)
    ready = ctx.Event()
    proc = ctx.Process(target=_wait_for_ever, args=(ring, ready), daemon=True)
    proc.start()
    try:
        assert ready.wait(60)
        asleep_on(proc.pid, semaphore_name(ring._published))
    finally:
        proc.kill()
        proc.join()
    done = threading.Event()
    publisher = threading.Thread(target=lambda: (ring.publish(1, torch.ones(2)), done.set()),
                                 daemon=True)
    publisher.start()
    assert done.wait(60), "publish hung on a dead waiter"  # a bound, not a timing
    assert ring.wait(1, timeout=1.0)
