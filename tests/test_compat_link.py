"""The seed's queues as a collector link, piece by piece: reading ``/proc`` for the
files a process maps or holds open, recognising the collector among the learner's
children (on a clock and a process list the test sets), and ``SeedQueueLink``'s
request dicts, ready dicts, stall verdict and stop. ``test_compat.py`` runs the same
with real collector processes and threads; here every edge is pinned exactly."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import queue
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from replay_fsm.compat import link as link_module
from replay_fsm.compat.link import SeedQueueLink, SlotHolders, _open_files, _shared_mappings
from replay_fsm.data.channel import ChannelClosed
from replay_fsm.runtime.links import Gone
from replay_fsm.wire import PACK_EXECUTOR, PACK_LAYOUT, PackDone, PackRequest

from .support import finishes_within

LINUX = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")


def key_of(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def address_of(mapped: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mapped))


# -- /proc ---------------------------------------------------------------------------

def reads_by_self_and_by_pid() -> tuple[dict[tuple[int, int], tuple[int, int]], ...]:
    """``_shared_mappings`` of this process read as "self" and by its pid, the pid's
    read between two reads of "self" that agree: a collection or another thread may
    unmap shared memory between two reads (15 file mappings vanished between them in
    a loaded CI run)."""
    gc.collect()
    gc.disable()
    try:
        for _ in range(10):
            before = _shared_mappings("self")
            by_pid = _shared_mappings(os.getpid())
            if _shared_mappings("self") == before:
                return before, by_pid
    finally:
        gc.enable()
    raise AssertionError("this process's shared mappings changed across 10 tries")


@LINUX
def test_shared_file_mappings_are_found_with_their_range_private_ones_are_not(
        tmp_path: Path) -> None:
    shared_file, private_file = tmp_path / "shared", tmp_path / "private"
    for path in (shared_file, private_file):
        path.write_bytes(b"\0" * mmap.PAGESIZE)
    with open(shared_file, "r+b") as f:
        shared = mmap.mmap(f.fileno(), mmap.PAGESIZE, flags=mmap.MAP_SHARED)
    with open(private_file, "r+b") as f:
        private = mmap.mmap(f.fileno(), mmap.PAGESIZE, flags=mmap.MAP_PRIVATE)
    try:
        found = _shared_mappings("self")
        lo = address_of(shared)
        assert found[key_of(shared_file)] == (lo, lo + mmap.PAGESIZE)
        assert key_of(private_file) not in found
        assert all(inode != 0 for _, inode in found)  # anonymous memory is no file
        by_self, by_pid = reads_by_self_and_by_pid()
        assert by_pid == by_self
    finally:
        shared.close()
        private.close()


@LINUX
def test_open_files_are_those_held_open_and_those_mapped(tmp_path: Path) -> None:
    held_file, mapped_file = tmp_path / "held", tmp_path / "mapped"
    for path in (held_file, mapped_file):
        path.write_bytes(b"\0" * mmap.PAGESIZE)
    with open(mapped_file, "r+b") as f:  # mapped, its descriptor closed
        mapped = mmap.mmap(f.fileno(), mmap.PAGESIZE, flags=mmap.MAP_SHARED)
    # Held open at a high descriptor: listing /proc/<pid>/fd opens a descriptor of its
    # own, below this one, which is closed (stat fails) by the time it is looked at.
    fd = os.open(held_file, os.O_RDONLY)
    high = os.dup2(fd, next(n for n in range(1000, 2000) if not is_open(n)))
    os.close(fd)
    try:
        files = _open_files(os.getpid())
        assert key_of(held_file) in files and key_of(mapped_file) in files
        assert key_of(Path(sys.executable).resolve()) not in files  # mapped privately
    finally:
        os.close(high)
        mapped.close()


@LINUX
def test_the_slots_files_are_those_mapped_at_the_slots_addresses() -> None:
    slots = [torch.zeros(1024).share_memory_() for _ in range(2)]
    other = torch.zeros(1024).share_memory_()  # shared too, but not a slot
    mine = _shared_mappings("self")
    at = {key: lo for key, (lo, _) in mine.items()}
    holders = SlotHolders(slots)
    # each slot's mapping starts at its address (lo <= address, not lo < address)
    assert {at[key] for key in holders._files} == {s.data_ptr() for s in slots}
    assert len(holders._files) == 2
    assert not any(lo <= other.data_ptr() < hi for lo, hi in
                   (mine[key] for key in holders._files))


class At:
    """A host slot at an address."""

    def __init__(self, address: int) -> None:
        self.address = address

    def data_ptr(self) -> int:
        return self.address


@LINUX
def test_a_shared_mapping_that_ends_where_a_slot_begins_is_not_the_slots(tmp_path: Path
                                                                         ) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page, map_fixed, failed = mmap.PAGESIZE, 0x10, ctypes.c_void_p(-1).value
    below_file, slot_file = tmp_path / "below", tmp_path / "slot"
    for path in (below_file, slot_file):
        path.write_bytes(b"\0" * page)
    # two pages reserved (PROT_NONE), then a file mapped shared on each: `below` ends
    # where the slot begins
    base = libc.mmap(None, 2 * page, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                     -1, 0)
    assert base != failed
    try:
        for path, address in ((below_file, base), (slot_file, base + page)):
            fd = os.open(path, os.O_RDWR)
            got = libc.mmap(address, page, mmap.PROT_READ | mmap.PROT_WRITE,
                            mmap.MAP_SHARED | map_fixed, fd, 0)
            os.close(fd)
            assert got == address
        holders = SlotHolders([At(base + page)])  # type: ignore[list-item]
        assert holders._files == {key_of(slot_file)}
    finally:
        libc.munmap(base, 2 * page)


def test_slots_outside_shared_memory_leave_nothing_to_recognise() -> None:
    holders = SlotHolders([torch.zeros(4), torch.zeros(4)])
    assert holders._files == set() and holders.dead() is None


def test_without_proc_nothing_is_recognised(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_proc(pid: Any) -> Any:
        raise FileNotFoundError("/proc/self/maps")

    monkeypatch.setattr(link_module, "_shared_mappings", no_proc)
    holders = SlotHolders([torch.zeros(4).share_memory_()])
    assert holders._files == set() and holders.dead() is None


# -- recognising the collector among the children -----------------------------------

class Clock:
    def __init__(self, now_ns: int) -> None:
        self.now_ns = now_ns

    def monotonic_ns(self) -> int:
        return self.now_ns


class Child:
    def __init__(self, pid: int | None, name: str = "child") -> None:
        self.pid, self.name, self.exitcode = pid, name, None

    def is_alive(self) -> bool:
        return self.exitcode is None


class Children:
    """``mp.active_children()`` and ``_open_files`` of a made-up process table."""

    def __init__(self, children: list[Child]) -> None:
        self.children = children
        self.files: dict[int, set[tuple[int, int]]] = {}
        self.looked_at: list[int] = []

    def active_children(self) -> list[Child]:
        return list(self.children)

    def open_files(self, pid: int) -> set[tuple[int, int]]:
        self.looked_at.append(pid)
        if pid not in self.files:
            raise FileNotFoundError(pid)  # it exited meanwhile
        return self.files[pid]


SLOT_FILE, OTHER_FILE = (1, 100), (1, 200)


@pytest.fixture
def table(monkeypatch: pytest.MonkeyPatch) -> tuple[SlotHolders, Children, Clock]:
    unnamed, gone, collector, other = Child(None), Child(13), Child(11, "Collector-1"), \
        Child(12)
    children = Children([unnamed, gone, collector, other])
    children.files = {11: {SLOT_FILE, OTHER_FILE}, 12: {OTHER_FILE}}
    # the first scan just past RESCAN_S after 0
    clock = Clock(int(link_module.RESCAN_S * 1e9) + 1)
    monkeypatch.setattr(link_module, "mp", children)
    monkeypatch.setattr(link_module, "_open_files", children.open_files)
    monkeypatch.setattr(link_module, "time", clock)
    holders = SlotHolders([torch.zeros(4)])
    holders._files = {SLOT_FILE}
    return holders, children, clock


def test_a_child_holding_a_slot_is_the_collector_others_are_looked_at_again_later(
        table: tuple[SlotHolders, Children, Clock]) -> None:
    holders, children, clock = table
    holders.scan()
    assert [c.pid for c in holders.collectors] == [11]
    assert children.looked_at == [13, 11, 12]  # no pid yet: skipped; 13 had exited
    assert holders._others == {12}
    clock.now_ns += 1
    holders.scan()  # the collector is known; 12 was looked at less than RESCAN_S ago
    assert children.looked_at == [13, 11, 12, 13]
    clock.now_ns += int(link_module.RESCAN_S * 1e9) - 1  # exactly RESCAN_S since
    holders.scan()
    assert children.looked_at == [13, 11, 12, 13, 13]
    clock.now_ns += 1  # past it: 12 again, and it holds a slot now
    children.files[12] = {SLOT_FILE}
    holders.scan()
    assert children.looked_at == [13, 11, 12, 13, 13, 13, 12]
    assert [c.pid for c in holders.collectors] == [11, 12] and holders._others == set()


def test_the_collector_that_exits_is_reported_with_its_name_pid_and_code(
        table: tuple[SlotHolders, Children, Clock]) -> None:
    holders, children, _ = table
    assert holders.dead() is None  # scans first: the collector is alive
    children.children[2].exitcode = 0  # UniLab's collector catches its error, exits 0
    assert holders.dead() == Gone("the collector process Collector-1 (pid 11, it holds "
                                  "collector_pack_shared_slots) exited with code 0")


# -- SeedQueueLink --------------------------------------------------------------------

class View:
    """The replay buffer view: only ``ptr`` is read."""

    ptr = 30


class Link:
    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, stall_timeout: float | None = 2.0,
                 requests: Any = None, ready: Any = None) -> None:
        self.clock = Clock(5 * 10**9)
        monkeypatch.setattr(link_module, "time", self.clock)
        self.requests = queue.Queue() if requests is None else requests
        self.ready = queue.Queue() if ready is None else ready
        self.view = View()
        self.sent: list[dict[str, Any]] = []
        self.link = SeedQueueLink(self.requests, self.ready, [torch.zeros(4, 3)] * 2,
                                  self.view, base_seed=100, sample_count=4,  # type: ignore
                                  stall_timeout=stall_timeout, on_request=self.sent.append)

    def send(self, number: int, tick_id: int, *, ptr: int = 30, size: int = 20) -> None:
        self.link.label(number, tick_id)
        self.link.send(PackRequest(tick=number, slot=number % 2, generation=number // 2,
                                   seed=0, sample_count=4, min_snapshot_ptr=5),
                       snapshot=(ptr, size), hot_slot=-1)

    def after(self, ns: int) -> Gone | None:
        self.clock.now_ns = 5 * 10**9 + ns
        return self.link.liveness(True, 5.0)


def ready_dict(tick_id: int, slot: int) -> dict[str, int]:
    return {"tick_id": tick_id, "snapshot_ptr": 31, "snapshot_size": 21, "sample_seed": 7,
            "sample_count": 4, "shared_slot": slot, "target_gpu_slot": slot,
            "pack_begin_ns": 111, "pack_end_ns": 222}


def test_a_request_is_the_seeds_dict_with_the_seed_tick_id_and_the_snapshot(
        monkeypatch: pytest.MonkeyPatch) -> None:
    t = Link(monkeypatch)
    t.send(1, 41, ptr=30, size=20)
    expected = {"tick_id": 41, "snapshot_ptr": 30, "snapshot_size": 20, "min_snapshot_ptr": 5,
                "sample_seed": 141, "sample_count": 4, "shared_slot": 1,
                "learner_hot_gpu_slot": 0, "target_gpu_slot": 1, "pack_layout": PACK_LAYOUT,
                "pack_executor": PACK_EXECUTOR}
    assert t.requests.get_nowait() == expected and t.sent == [expected]


def test_the_labels_of_the_request_and_the_one_before_are_kept(
        monkeypatch: pytest.MonkeyPatch) -> None:
    t = Link(monkeypatch)
    for number, tick_id in ((1, 40), (2, 50), (3, 60)):
        t.send(number, tick_id)
    assert [t.link.tick_id(n) for n in (1, 2, 3)] == [None, 50, 60]


def test_a_full_request_queue_raises_after_put_timeout(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    class Full:
        def __init__(self) -> None:
            self.timeouts: list[Any] = []

        def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
            self.timeouts.append(timeout)
            raise queue.Full

    full = Full()
    t = Link(monkeypatch, requests=full)
    with pytest.raises(RuntimeError, match="^collector_pack_request_queue stayed full for "
                       "10 s: no collector takes requests$"):
        t.send(1, 0)
    assert full.timeouts == [link_module.PUT_TIMEOUT_S]


def test_a_ready_dict_becomes_the_pack_done_of_the_outstanding_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    t = Link(monkeypatch)
    t.send(3, 41)  # slot 1, generation 1
    t.ready.put({**ready_dict(41, 1), "extra": "ignored"})
    assert t.link.receive(1.0) == PackDone(tick=3, slot=1, generation=1, seed=7,
                                           sample_count=4, snapshot_ptr=31, snapshot_size=21,
                                           pack_start_ns=111, pack_end_ns=222)
    assert t.link.readies[1] is not None and t.link.readies[1].tick_id == 41
    # nothing is outstanding now: the same dict again does not match
    t.ready.put(ready_dict(41, 1))
    with pytest.raises(RuntimeError, match="^Collector packed tick 41 does not match pending "
                       "tick None$"):
        t.link.receive(1.0)


def test_receive_returns_none_after_its_timeout_and_a_none_closes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    t = Link(monkeypatch)
    done, got = finishes_within(lambda: t.link.receive(0.01))
    assert done and got == [None]
    t.ready.put(None)
    with pytest.raises(ChannelClosed):
        t.link.receive(1.0)


def test_after_stop_receive_raises_even_with_the_wake_up_not_sent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cancelled: list[bool] = []

    class Ready(queue.Queue):  # type: ignore[type-arg]
        def cancel_join_thread(self) -> None:
            cancelled.append(True)

    ready = Ready(maxsize=1)
    t = Link(monkeypatch, ready=ready)
    t.send(1, 0)
    ready.put(ready_dict(0, 1))  # full: stop's None cannot be put
    assert t.link.stop(1.0) == []
    assert cancelled == [True]  # an mp.Queue's feeder is not joined at exit
    with pytest.raises(ChannelClosed):
        t.link.receive(1.0)


def test_no_stall_is_reported_with_nothing_outstanding_or_stall_timeout_none(
        monkeypatch: pytest.MonkeyPatch) -> None:
    t = Link(monkeypatch)
    assert t.after(10**12) is None  # nothing sent yet
    t = Link(monkeypatch, stall_timeout=None)
    t.send(1, 0)
    assert t.after(10**12) is None


def test_a_request_silent_past_stall_timeout_is_reported_to_the_nanosecond(
        monkeypatch: pytest.MonkeyPatch) -> None:
    t = Link(monkeypatch)  # stall_timeout 2 s
    t.send(1, 0, ptr=30)  # the buffer's ptr stays 30: no row added
    # Looks at most half the bound apart: each stretch between them counts in full.
    assert t.after(10**9) is None
    assert t.after(2 * 10**9) is None
    assert t.after(2 * 10**9 + 1) is not None
    gone = t.after(10**17)  # a stretch no look saw counts for half the bound
    assert gone == Gone("no ready dict on collector_pack_ready_queue and no row added to "
                        "the replay buffer for 3.0 s (stall_timeout): is a collector "
                        "still serving collector_pack_request_queue?")


def test_a_stretch_no_look_saw_counts_for_half_of_stall_timeout_at_most(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole job stopped (Ctrl-Z) and resumed (fg): the collector, stopped too,
    had no time to answer when the learner looked. The first look after it is no sign
    of a stall; the looks after it are."""
    t = Link(monkeypatch)  # stall_timeout 2 s
    t.send(1, 0, ptr=30)
    assert t.after(10**9) is None
    assert t.after(3600 * 10**9) is None  # an hour stopped: 1 s of it counted
    assert t.after(3600 * 10**9 + 1) is not None


def test_rows_added_to_the_buffer_count_as_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    t = Link(monkeypatch)
    t.send(1, 0, ptr=30)
    t.view.ptr = 35
    assert t.after(1 * 10**9) is None  # progress seen at 1 s
    assert t.after(2 * 10**9) is None
    assert t.after(3 * 10**9) is None  # 2 s since
    assert t.after(3 * 10**9 + 1) is not None


def test_a_dead_collector_is_reported_with_nothing_outstanding(
        monkeypatch: pytest.MonkeyPatch) -> None:
    t = Link(monkeypatch)

    class Holders:
        def dead(self) -> Gone:
            return Gone("the collector died")

        def scan(self) -> None:
            pass

    t.link.holders = Holders()  # type: ignore[assignment]
    assert t.link.liveness(False, 5.0) == Gone("the collector died")
