"""Shared-memory tensors that cannot fit are refused up front, by name and size."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from replay_fsm import Pipeline, ReplayBuffer
from replay_fsm.data import shared
from replay_fsm.data.packer import PackerHandle


def shm_with_free(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    monkeypatch.setattr(shared.os, "statvfs",
                        lambda path: SimpleNamespace(f_bavail=free // 4096, f_frsize=4096))


def test_a_buffer_larger_than_dev_shm_is_refused_by_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A container's 64 MB /dev/shm and a 1000-row buffer of 11 floats (44000 B) fit;
    with 40 KiB free it is refused before anything is allocated."""
    shm_with_free(monkeypatch, 64 << 20)
    assert ReplayBuffer(1000, 3, 2).storage.shape == (1000, 11)
    shm_with_free(monkeypatch, 40 << 10)
    with pytest.raises(MemoryError) as info:
        ReplayBuffer(1000, 3, 2)
    assert str(info.value) == (
        "a replay buffer of 1000 rows needs 43.0 KiB of shared memory, more than the free "
        "space of /dev/shm (40.0 KiB): make it smaller, or give the machine more (a "
        "container's /dev/shm: docker run --shm-size)")


def test_host_slots_that_do_not_fit_are_refused_by_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    shm_with_free(monkeypatch, 1 << 20)
    with pytest.raises(MemoryError, match=r"^host slot 0 of 65536 rows needs 2\.8 MiB"):
        PackerHandle.create(2, 65536, 11)


def test_the_machine_memory_bounds_it_where_dev_shm_is_missing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(path: str) -> None:
        raise FileNotFoundError(path)

    monkeypatch.setattr(shared.os, "statvfs", missing)
    monkeypatch.setattr(shared, "_cgroup_room", lambda: None)  # a container's limit
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with pytest.raises(MemoryError, match="more than the machine's memory"):
        shared.shared_zeros(ram // 4 + 1, what="too much")
    assert shared.shared_zeros(2, 3, what="a little").is_shared()


def cgroup_tree(tmp_path: Path, cgroup: str, mounts: list[str],
                files: dict[str, str]) -> Path:
    """A /proc/self (its cgroup and mountinfo files) and cgroup folders under
    ``tmp_path``; in ``mounts`` and ``files``, ROOT stands for ``tmp_path``."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(
        "".join(line.replace("ROOT", str(tmp_path)) + "\n" for line in mounts))
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return proc


V2_MOUNT = "41 23 0:38 / ROOT/cg rw,relatime - cgroup2 cgroup2 rw"
V1_MOUNT = "35 31 0:32 / ROOT/memory rw,relatime - cgroup cgroup rw,memory"
NO_V1_LIMIT = "9223372036854771712"


@pytest.mark.parametrize("swap", [False, True])
def test_the_cgroup_room_is_the_tightest_limit_less_what_it_holds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swap: bool) -> None:
    """cgroup v2: the process's cgroup and each parent up to the mount; the room is a
    limit less the anonymous and shared memory held under it (none where the machine
    has swap, which could page them out), and the least room wins, not the least
    limit."""
    proc = cgroup_tree(tmp_path, "0::/pod/app\n", [V2_MOUNT], {
        "cg/pod/memory.max": "1000000\n", "cg/pod/memory.stat": "anon 300000\nfile 5\n"
                                                              "shmem 100000\n",
        "cg/pod/app/memory.max": "900000\n", "cg/pod/app/memory.stat": "anon 10\n",
        "cg/memory.max": "max\n"})
    monkeypatch.setattr(shared, "PROC_SELF", str(proc))
    monkeypatch.setattr(shared, "_has_swap", lambda: swap)
    assert shared._cgroup_room() == ((900000, 900000) if swap else (1000000, 600000))


def test_a_v1_memory_hierarchy_mounted_at_the_containers_cgroup(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """cgroup v1 as docker mounts it without a cgroup namespace: the mount shows the
    hierarchy from the container's cgroup, whose path /proc/self/cgroup names in
    full; a limit as large as v1 writes "none" is none. A mount point with a space in
    its name comes escaped in mountinfo."""
    mounts = ["35 31 0:32 /docker/abc ROOT/mem\\040cg rw - cgroup cgroup rw,memory",
              "32 31 0:29 / ROOT/cpu rw - cgroup cgroup rw,cpu"]
    proc = cgroup_tree(tmp_path, "5:cpu:/docker/abc\n4:memory:/docker/abc\n0::/\n", mounts,
                       {"mem cg/memory.limit_in_bytes": "524288000\n",
                        "mem cg/memory.stat": "cache 7\ntotal_rss 1000\ntotal_shmem 24\n",
                        "cpu/memory.limit_in_bytes": "1\n"})
    monkeypatch.setattr(shared, "PROC_SELF", str(proc))
    monkeypatch.setattr(shared, "_has_swap", lambda: False)
    assert shared._cgroup_room() == (524288000, 524288000 - 1024)
    (tmp_path / "mem cg/memory.limit_in_bytes").write_text(NO_V1_LIMIT)
    assert shared._cgroup_room() is None


@pytest.mark.parametrize("cgroup,mounts", [
    ("0::/\n", [V2_MOUNT]),                       # v2 at its root: no memory.max
    ("4:memory:/x\n", [V1_MOUNT]),                # a v1 limit of "none"
    ("4:memory:/elsewhere\n", [V1_MOUNT.replace(" / ", " /x ")]),  # a mount not ours
    ("not a cgroup line\n", [V1_MOUNT]),
    ("4:memory:/x\n", ["a mount line without its separator"]),
])
def test_no_cgroup_room_where_there_is_no_limit_to_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cgroup: str,
        mounts: list[str]) -> None:
    proc = cgroup_tree(tmp_path, cgroup, mounts, {
        "memory/x/memory.limit_in_bytes": NO_V1_LIMIT,
        "memory/memory.limit_in_bytes": NO_V1_LIMIT})
    monkeypatch.setattr(shared, "PROC_SELF", str(proc))
    assert shared._cgroup_room() is None
    monkeypatch.setattr(shared, "PROC_SELF", str(tmp_path / "no such folder"))
    assert shared._cgroup_room() is None


def test_a_buffer_past_the_cgroup_limit_is_refused_by_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared, "_cgroup_room", lambda: (4 << 20, 1 << 20))
    assert ReplayBuffer(1000, 3, 2).storage.shape == (1000, 11)
    with pytest.raises(MemoryError) as info:
        ReplayBuffer(100_000, 3, 2)
    assert str(info.value) == (
        "a replay buffer of 100000 rows needs 4.2 MiB of shared memory, more than what "
        "the memory limit of this process's cgroup (4.0 MiB) leaves (1.0 MiB): make it "
        "smaller, or raise that limit (a container's: docker run --memory, a pod's "
        "resources.limits.memory)")


V1_MEMORY = "/sys/fs/cgroup/memory"


@pytest.mark.skipif(not (os.path.isfile(f"{V1_MEMORY}/memory.limit_in_bytes")
                         and os.access(V1_MEMORY, os.W_OK) and os.path.isdir(shared.SHM)),
                    reason="needs a cgroup v1 memory hierarchy it may write (root)")
def test_a_buffer_past_a_real_cgroup_limit_is_refused_not_killed() -> None:
    """In a cgroup limited to 384 MiB, a process that made a 1 GiB buffer was
    killed by the kernel (SIGKILL, no message) and left its /dev/shm file behind; it
    is now refused with a MemoryError before anything is made."""
    code = """
import os
from replay_fsm import ReplayBuffer
from replay_fsm.data import shared
shared.SHM = "/nonexistent"  # the cgroup's room only, whatever the size of /dev/shm
try:
    ReplayBuffer(1 << 19, 250, 6)  # 524288 rows x 509 floats: 1018 MiB
except MemoryError as exc:
    print(os.getpid(), exc)
"""
    group = f"{V1_MEMORY}/replay_fsm_test_{os.getpid()}"
    os.mkdir(group)
    try:
        with open(f"{group}/memory.limit_in_bytes", "w") as f:
            f.write(str(384 << 20))  # a Python with torch takes about 150 MiB
        out = subprocess.run(["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$0" -c '
                              '"$1"', sys.executable, code],
                             capture_output=True, text=True, timeout=300)
    finally:
        os.rmdir(group)  # its one process has exited
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    pid, message = out.stdout.strip().split(" ", 1)
    assert message.startswith("a replay buffer of 524288 rows needs 1018.0 MiB of shared "
                              "memory, more than what the memory limit of this process's "
                              "cgroup (384.0 MiB) leaves ("), message
    assert not [n for n in os.listdir(shared.SHM) if n.startswith(f"torch_{pid}_")]


def test_the_allocators_refusal_is_a_memory_error_that_names_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the checks (another process took the room meanwhile), torch's own refusal
    still comes back as a MemoryError naming what was asked for."""
    def refuse(nbytes: int) -> torch.UntypedStorage:
        raise RuntimeError("unable to write to file </torch_1_2>: No space left on device")

    monkeypatch.setattr(shared, "_new_storage", refuse)
    with pytest.raises(MemoryError) as info:
        shared.shared_zeros(4, 4, what="a test tensor")
    assert str(info.value).startswith("a test tensor: 64 B of shared memory could not be "
                                      "allocated: unable to write to file")
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.parametrize("nbytes,text", [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"),
                                         (3 << 20, "3.0 MiB"), (5 << 30, "5.0 GiB"),
                                         (3 << 41, "6.0 TiB"), (1 << 61, "2.0 EiB"),
                                         (10**400, "about 10**400 B")])
def test_sizes_read_in_binary_units(nbytes: int, text: str) -> None:
    assert shared._size(nbytes) == text


def test_a_batch_past_floats_range_is_refused_with_its_size() -> None:
    """``Pipeline(sample_count=10**400)`` raised OverflowError from the message's own
    formatting of the size ("integer division result too large for a float")."""
    rb = ReplayBuffer(capacity=100, obs_dim=2, action_dim=1)
    with pytest.raises(MemoryError, match=r"needs about 10\*\*40\d B of shared memory"):
        Pipeline(rb, sample_count=10**400)


def test_another_allocator_error_stays_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a lack of room becomes a MemoryError: too many open files (a file
    descriptor per shared tensor) is not one, and keeps torch's error."""
    def refuse(nbytes: int) -> torch.UntypedStorage:
        raise RuntimeError("unable to open shared memory object: Too many open files (24)")

    monkeypatch.setattr(shared, "_new_storage", refuse)
    with pytest.raises(RuntimeError, match="Too many open files"):
        shared.shared_zeros(4, 4, what="a test tensor")


@pytest.mark.parametrize("shape,dtype", [((3, 5), torch.float32), ((7,), torch.int64),
                                         ((2, 0), torch.float32)])
def test_shared_zeros_are_zeros_in_shared_memory(shape: tuple[int, ...],
                                                 dtype: torch.dtype) -> None:
    from multiprocessing.reduction import ForkingPickler

    t = shared.shared_zeros(*shape, what="a test tensor", dtype=dtype)
    assert (t.shape, t.dtype, t.is_shared(), t.is_contiguous()) == (shape, dtype, True, True)
    assert not t.any()
    if t.numel():  # what a spawned process gets maps the same memory
        other = ForkingPickler.loads(ForkingPickler.dumps(t))
        other.view(-1)[-1] = 3
        assert t.view(-1)[-1] == 3


def test_a_torch_without_new_shared_still_gets_shared_zeros(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The classmethod that makes the shared object directly is not public: without
    it, a private tensor is zeroed and moved into shared memory, as before."""
    moved = []
    share = torch.Tensor.share_memory_

    def counted(self: torch.Tensor) -> torch.Tensor:
        moved.append(self.shape)
        return share(self)

    monkeypatch.delattr(torch.storage._StorageBase, "_new_shared")
    monkeypatch.setattr(torch.Tensor, "share_memory_", counted)
    t = shared.shared_zeros(4, 6, what="a test tensor")
    assert t.is_shared() and not t.any() and moved == [(4, 6)]


def test_a_buffer_is_made_with_no_private_copy_of_its_rows() -> None:
    """A buffer's rows take their own size in memory, at their peak too: made as
    ``torch.zeros(...).share_memory_()`` they took twice (a zeroed private tensor,
    then its copy in shared memory), and a buffer over half a container's memory
    limit was killed while it was made. The peak resident size of a fresh process,
    across making a 256 MiB buffer and writing each of its rows."""
    code = """
import torch
from replay_fsm import ReplayBuffer

def peak_kib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))

before = peak_kib()
rb = ReplayBuffer(1 << 17, 250, 6)  # 131072 rows x 509 floats
rb.storage.fill_(1.0)  # every page written, as a full buffer's are
print(rb.storage.numel() * 4 // 1024, peak_kib() - before)
"""
    if not os.path.exists("/proc/self/status"):
        pytest.skip("needs Linux's /proc")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=300)
    rows_kib, grew_kib = map(int, out.stdout.split())
    assert rows_kib > 200_000
    assert grew_kib < 1.25 * rows_kib, (rows_kib, grew_kib)


def test_shared_zeros_reserve_their_pages_when_made() -> None:
    """The pages are taken from /dev/shm when the tensor is made, before any write, as
    the copy of the old way did: a /dev/shm without room refuses it then, where a
    write into pages never reserved would die of SIGBUS later. Read from the shared
    object's own file (file_descriptor strategy: the storage keeps it open)."""
    import torch.multiprocessing

    if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
        pytest.skip("reads the object's file descriptor")
    t = shared.shared_zeros(1 << 20, 8, what="a test tensor")  # 32 MiB, never written
    fd = t.untyped_storage()._share_fd_cpu_()[-2]  # (..., fd, size)
    assert os.fstat(fd).st_blocks * 512 >= t.numel() * 4


def test_a_refused_map_leaves_no_shared_memory_behind(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch unlinks its shared-memory file only once it is mapped: a map refused
    (ENOMEM, as under ulimit -v) left the file, its pages reserved, after the
    process. The refusal is a MemoryError, and the file this process made is gone;
    another process's is left alone."""
    if not os.path.isdir(shared.SHM):
        pytest.skip("needs /dev/shm")
    mine = f"torch_{os.getpid()}_1_0"
    theirs = f"torch_{os.getpid() + 1}_1_0"

    def refuse(nbytes: int) -> torch.UntypedStorage:
        for name in (mine, theirs):
            with open(os.path.join(shared.SHM, name), "wb") as f:
                f.write(b"x" * 64)
        raise RuntimeError(f"unable to mmap 64 bytes from file </{mine}>: Cannot "
                           "allocate memory (12)")

    monkeypatch.setattr(shared, "_new_storage", refuse)
    try:
        with pytest.raises(MemoryError, match="64 B of shared memory could not be"):
            shared.shared_zeros(4, 4, what="a test tensor")
        assert not os.path.exists(os.path.join(shared.SHM, mine))
        assert os.path.exists(os.path.join(shared.SHM, theirs))
    finally:
        for name in (mine, theirs):
            if os.path.exists(os.path.join(shared.SHM, name)):
                os.unlink(os.path.join(shared.SHM, name))


def test_a_buffer_beyond_the_address_space_limit_is_refused_by_name() -> None:
    """Under ulimit -v (RLIMIT_AS) a buffer that cannot be mapped is refused before
    anything is made: a MemoryError naming the limit, nothing left in /dev/shm."""
    code = """
import os, resource
from replay_fsm import ReplayBuffer

with open("/proc/self/status") as f:
    vm = next(int(l.split()[1]) << 10 for l in f if l.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.RLIM_INFINITY))
try:
    ReplayBuffer(1 << 19, 250, 6)  # 524288 rows x 509 floats: 1 GiB
except MemoryError as exc:
    print(os.getpid(), exc)
"""
    if not os.path.exists("/proc/self/status") or not os.path.isdir(shared.SHM):
        pytest.skip("needs Linux's /proc and /dev/shm")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=300)
    pid, message = out.stdout.strip().split(" ", 1)
    assert message.startswith("a replay buffer of 524288 rows needs 1018.0 MiB of shared "
                              "memory, more than the address space this process may still "
                              "map ("), message
    assert message.endswith("): make it smaller, or raise its limit (ulimit -v)"), message
    assert not [n for n in os.listdir(shared.SHM) if n.startswith(f"torch_{pid}_")]


def test_a_buffer_beyond_the_file_size_limit_is_refused_by_name() -> None:
    """A shared-memory object is a file: under ulimit -f (RLIMIT_FSIZE) torch's
    refusal was a RuntimeError ("unable to resize file ... File too large")."""
    code = """
import os, resource
from replay_fsm import ReplayBuffer

resource.setrlimit(resource.RLIMIT_FSIZE, (100 << 10, resource.RLIM_INFINITY))
ReplayBuffer(1000, 4, 2)  # 52 KB: fits
try:
    ReplayBuffer(3000, 4, 2)  # 156 KB
except MemoryError as exc:
    print(os.getpid(), exc)
"""
    if not os.path.isdir(shared.SHM):
        pytest.skip("needs /dev/shm")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=300)
    pid, message = out.stdout.strip().split(" ", 1)
    assert message == ("a replay buffer of 3000 rows needs 152.3 KiB of shared memory, "
                       "more than the ulimit -f file size limit (100.0 KiB): make it "
                       "smaller, or raise that limit"), message
    assert not [n for n in os.listdir(shared.SHM) if n.startswith(f"torch_{pid}_")]


def test_a_refusal_past_the_file_size_limit_is_a_memory_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the limit was lowered after the check (another thread), torch's EFBIG."""
    def refuse(nbytes: int) -> torch.UntypedStorage:
        raise RuntimeError("unable to resize file </torch_1_2_3> to the right size: "
                           "File too large (27)")

    monkeypatch.setattr(shared, "_new_storage", refuse)
    with pytest.raises(MemoryError, match="64 B of shared memory could not be allocated"):
        shared.shared_zeros(4, 4, what="a test tensor")


def test_a_process_killed_while_it_reserves_a_buffer_leaves_no_shared_memory() -> None:
    """Reserving the pages of a buffer of GBs takes seconds, and a process killed
    then (SIGKILL, the OOM killer: no code of it runs) left the whole object in
    /dev/shm for good, where torch unlinks it only once it is mapped. The object is
    now unlinked before its pages are reserved: killed during the reservation (held
    there), the process leaves nothing."""
    import torch.multiprocessing

    if (torch.multiprocessing.get_sharing_strategy() != "file_descriptor"
            or not os.path.isdir(shared.SHM)):
        pytest.skip("needs /dev/shm and torch's file_descriptor sharing strategy")
    code = """
import os, sys, time
from replay_fsm import ReplayBuffer

def held(fd, offset, length):
    print(os.getpid(), flush=True)
    time.sleep(120)

os.posix_fallocate = held
ReplayBuffer(1000, 4, 2)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        pid = int(proc.stdout.readline())
        assert not [n for n in os.listdir(shared.SHM) if f"_{pid}_" in n]
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert not [n for n in os.listdir(shared.SHM) if f"_{pid}_" in n]


def test_a_process_killed_the_moment_it_opens_a_shared_object_leaves_no_name() -> None:
    """The object was a named file in /dev/shm, unlinked by a second call; a process
    SIGKILLed between the two (CI's runs left such empty files twice) left its name
    there for good. Now no name ever points to it: a process that kills itself the
    moment the object's file is open leaves nothing in /dev/shm."""
    import torch.multiprocessing

    if (torch.multiprocessing.get_sharing_strategy() != "file_descriptor"
            or not os.path.isdir(shared.SHM)):
        pytest.skip("needs /dev/shm and torch's file_descriptor sharing strategy")
    code = f"""
import os, signal, sys
from replay_fsm import ReplayBuffer

real_open = os.open

def open_and_die(path, *args, **kwargs):
    fd = real_open(path, *args, **kwargs)
    if os.fspath(path).startswith({shared.SHM!r}):
        os.kill(os.getpid(), signal.SIGKILL)
    return fd

os.open = open_and_die
print(os.getpid(), flush=True)
ReplayBuffer(1000, 4, 2)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr  # it did open one
    pid = int(proc.stdout)
    left = [n for n in os.listdir(shared.SHM) if f"_{pid}_" in n]
    for name in left:  # not this test's to keep
        os.unlink(os.path.join(shared.SHM, name))
    assert not left


@pytest.mark.parametrize("kernel", ["no O_TMPFILE", "O_TMPFILE refused"])
def test_without_o_tmpfile_a_named_file_unlinked_at_once_serves(
        kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel or file system without O_TMPFILE gets the named file, unlinked at
    once: the buffer is made, shared and leaves no name."""
    import errno

    import torch.multiprocessing

    if (torch.multiprocessing.get_sharing_strategy() != "file_descriptor"
            or not os.path.isdir(shared.SHM)):
        pytest.skip("needs /dev/shm and torch's file_descriptor sharing strategy")
    opened: list[str] = []
    real_open = os.open

    def open_(path: str, flags: int, *args: int) -> int:
        if flags & getattr(os, "O_TMPFILE", 0) == getattr(os, "O_TMPFILE", -1):
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
        opened.append(os.fspath(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", open_)
    if kernel == "no O_TMPFILE":
        monkeypatch.delattr(os, "O_TMPFILE", raising=False)
    tensor = shared.shared_zeros(1000, 4, what="the buffer")
    tensor += 1
    assert tensor.is_shared() and float(tensor.sum()) == 4000
    assert [os.path.dirname(p) for p in opened] == [shared.SHM]
    assert not os.path.exists(opened[0])


def test_a_buffer_asks_torch_for_no_named_shared_object() -> None:
    """torch's share_memory_ makes a named object in /dev/shm and unlinks it only once
    it is sized and mapped: a process SIGKILLed in between left an empty
    torch_<pid>_... file for good (strace's inject=ftruncate:signal=KILL into
    ReplayBuffer(1000, 4, 2): 3 of 3, from the buffer's counters; helper-92). Every
    object of a buffer (its rows, counters, ask, sequence numbers and holder record)
    is made with no name, and so is every object of a pipeline's handle and of the
    SAC trainer's: torch's named sharing is never asked for."""
    import torch.multiprocessing

    if (torch.multiprocessing.get_sharing_strategy() != "file_descriptor"
            or not os.path.isdir(shared.SHM)):
        pytest.skip("needs /dev/shm and torch's file_descriptor sharing strategy")
    code = """
import torch
from replay_fsm import ReplayBuffer

def named(self, *args, **kwargs):
    raise AssertionError("a named shared object")

torch.UntypedStorage._share_fd_cpu_ = named
torch.UntypedStorage._share_filename_cpu_ = named
rb = ReplayBuffer(1000, 4, 2)
rb.add_packed(torch.ones(3, rb.width))
assert rb.ptr == 3 and all(t.is_shared() for t in (rb.storage, rb._counters, rb._asked,
                                                    rb._seq, rb._owner.words))
# And every object of a pipeline's handle (its state, claims, channels and host
# slots) and of the SAC trainer's shared objects.
from replay_fsm import PackerHandle
from replay_fsm.trainers import shared
handle = PackerHandle.create(2, 16, rb.width, rb.buffer_id)
handle.close()
shared.WeightRing(8, 2), shared.EpisodeLog(4), shared.StopFlag()
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr
