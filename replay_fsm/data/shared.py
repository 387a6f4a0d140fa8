"""Tensors in shared memory, refused up front with an error that says what to change
when they cannot fit (a container's /dev/shm is often 64 MB; past a container's
memory limit the kernel kills the process without a word), instead of torch's
allocator message from deep inside, or none."""

from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import secrets

import torch

from ..files import NO_TMPFILE

SHM = "/dev/shm"  # where Linux keeps shared memory (torch's sharing strategies use it)
PROC_SELF = "/proc/self"  # this process's cgroups and mounts
# What torch's refusals say when the room ran out: the CPU allocator's, a full
# /dev/shm's (ENOSPC, when the shared file is written), a map refused (ENOMEM: the
# address space, ``ulimit -v``) and a shared file past ``ulimit -f`` (EFBIG).
OUT_OF_ROOM = ("can't allocate memory", "No space left on device", "Cannot allocate memory",
               "File too large")
MORE_MACHINE = "give the machine more (a container's /dev/shm: docker run --shm-size)"
MORE_CGROUP = ("raise that limit (a container's: docker run --memory, a pod's "
               "resources.limits.memory)")
# cgroup v1 writes "no limit" as the largest page-aligned int64, v2 as "max".
NO_CGROUP_LIMIT = 1 << 62


def shared_zeros(*shape: int, what: str, dtype: torch.dtype = torch.float32
                 ) -> torch.Tensor:
    """``torch.zeros(*shape, dtype=dtype).share_memory_()``, checked first against the
    machine's memory, what the memory limit of this process's cgroup leaves, the free
    space of /dev/shm (where there is one), the address space left under ``ulimit -v``
    and the file size limit (``_room``), and made with no private copy
    (``_zeros_in_shm``).

    Raises:
        MemoryError: it cannot fit; the message names ``what``, its size and the room.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    room = _room()
    if room is not None and nbytes > room[1]:
        raise MemoryError(f"{what} needs {_size(nbytes)} of shared memory, more than "
                          f"{room[0]} ({_size(room[1])}): make it smaller, or {room[2]}")
    try:
        return _zeros_in_shm(shape, dtype, nbytes)
    except RuntimeError as exc:
        _remove_left_over(str(exc))
        if not any(words in str(exc) for words in OUT_OF_ROOM):
            raise  # not a lack of memory (too many open files, say): torch's own error
        # The allocator's refusal past the checks above (another process took the room).
        raise MemoryError(f"{what}: {_size(nbytes)} of shared memory could not be "
                          f"allocated: {exc}") from exc


def small_shared_zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(*shape, dtype=dtype).share_memory_()`` for the small objects
    (counters, sequence numbers, channels, a trainer's weights), made as the rows are
    (``_zeros_in_shm``): under torch's default sharing strategy with no name in
    /dev/shm at any instant. torch's ``share_memory_`` makes a named object and unlinks
    it only once it is sized and mapped: a process SIGKILLed in between (a collector
    killed as it made its buffer) left an empty ``torch_<pid>_...`` file there for
    good. No room check (``shared_zeros``'s)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return _zeros_in_shm(shape, dtype, nbytes)


def _zeros_in_shm(shape: tuple[int, ...], dtype: torch.dtype, nbytes: int
                  ) -> torch.Tensor:
    """Zeros made straight in a new shared-memory object (the one ``share_memory_``
    would make, by torch's sharing strategy), whose pages the kernel zeroes.
    ``torch.zeros(...).share_memory_()`` zeroes a private tensor first and then copies
    it there: twice the memory at its peak (a buffer over half a container's memory
    limit was killed while it was made) and several times the time. torch reserves
    the object's pages as it makes it (posix_fallocate; a test checks it), so a
    /dev/shm without room refuses it here, not with SIGBUS at a later write. A torch
    without the classmethod (it is not public) gets the old way still."""
    if nbytes == 0 or not hasattr(torch.UntypedStorage, "_new_shared"):  # (none of 0 B)
        return torch.zeros(*shape, dtype=dtype).share_memory_()
    storage = _new_storage(nbytes)
    return torch.empty(0, dtype=dtype, device="cpu").set_(storage).view(shape)


def _new_storage(nbytes: int) -> torch.UntypedStorage:
    """A shared storage of ``nbytes``, its pages reserved. Under torch's default
    sharing strategy (``file_descriptor``, which passes the object's descriptor to
    other processes and never its name) the object is made here with no name
    (``_unnamed_file``) before its pages are reserved: torch's own ``_new_shared``
    unlinks it only once it is reserved and mapped, and a process killed in between
    (SIGKILL, the OOM killer; reserving a buffer of GBs takes seconds) left the whole
    of it in /dev/shm for good. Elsewhere (``file_system``: children open the object
    by name), torch's."""
    import torch.multiprocessing

    if (torch.multiprocessing.get_sharing_strategy() != "file_descriptor"
            or not hasattr(torch.UntypedStorage, "_new_shared_fd_cpu")
            or not hasattr(os, "posix_fallocate") or not os.path.isdir(SHM)):
        return torch.UntypedStorage._new_shared(nbytes)
    fd = _unnamed_file()
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)  # reserved now: no SIGBUS at a write
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                raise
            # torch's words for it, which shared_zeros turns into a MemoryError
            raise RuntimeError(f"unable to reserve {nbytes} bytes of shared memory: "
                               f"{os.strerror(exc.errno)}") from exc
        return torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)  # maps a dup of fd
    finally:
        os.close(fd)


def _unnamed_file() -> int:
    """A new file in /dev/shm that no name ever points to, open for reading and
    writing: O_TMPFILE, so a process killed at any instant leaves nothing there.
    Where the kernel or the file system has no O_TMPFILE, a named file unlinked at
    once; a process killed between the two calls (a collector SIGKILLed as it made
    its slots) leaves an empty file there for good."""
    if hasattr(os, "O_TMPFILE"):
        try:
            return os.open(SHM, os.O_TMPFILE | os.O_RDWR, 0o600)
        except OSError as exc:
            if exc.errno not in NO_TMPFILE:
                raise  # not a missing O_TMPFILE (too many open files, say)
    path = os.path.join(SHM, f"replay_fsm_{os.getpid()}_{secrets.token_hex(8)}")
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    finally:  # from here on nothing of it outlives this process, a Ctrl-C's too
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _remove_left_over(message: str) -> None:
    """Remove the shared-memory file a refusal of torch's names, if this process made
    it and it is still there: torch unlinks it only once it is mapped, so a map
    refused (``ulimit -v``) left it behind, its pages reserved, after the process."""
    made = re.search(r"<(/?torch_(\d+)_[^/<>]*)>", message)
    if made is None or int(made.group(2)) != os.getpid():
        return
    try:
        os.unlink(os.path.join(SHM, made.group(1).lstrip("/")))
    except OSError:
        pass  # gone already, or never made there


def _room() -> tuple[str, int, str] | None:
    """The least of the machine's memory, the memory limit of this process's cgroup
    (a container's), /dev/shm's free space, the address space this process may still
    map (``ulimit -v``) and the largest file it may write (``ulimit -f``), named, with
    what gives more; None where none can be read."""
    rooms = []
    try:
        rooms.append(("the machine's memory",
                      os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), MORE_MACHINE))
    except (ValueError, OSError, AttributeError):
        pass
    cgroup = _cgroup_room()
    if cgroup is not None:
        rooms.append((f"what the memory limit of this process's cgroup "
                      f"({_size(cgroup[0])}) leaves", cgroup[1], MORE_CGROUP))
    try:
        st = os.statvfs(SHM)
        rooms.append((f"the free space of {SHM}", st.f_bavail * st.f_frsize, MORE_MACHINE))
    except (OSError, AttributeError):
        pass
    left = _address_space_left()
    if left is not None:
        rooms.append(("the address space this process may still map", left,
                      "raise its limit (ulimit -v)"))
    largest = _soft_limit("RLIMIT_FSIZE")
    if largest is not None:  # a shared-memory object is a file: ulimit -f bounds it
        rooms.append(("the ulimit -f file size limit", largest, "raise that limit"))
    return min(rooms, key=lambda r: r[1]) if rooms else None


def _soft_limit(name: str) -> int | None:
    """The soft limit ``resource.<name>`` (``RLIMIT_AS``, ``RLIMIT_FSIZE``); None
    without one, or where it cannot be read (no ``resource`` module off Unix)."""
    try:
        import resource
        limit = resource.getrlimit(getattr(resource, name))[0]
    except (ImportError, OSError, ValueError, AttributeError):
        return None
    return None if limit == resource.RLIM_INFINITY else limit


def _cgroup_room() -> tuple[int, int] | None:
    """The memory limit of this process's cgroup, or of a cgroup above it that it
    can see, that leaves the least room, and that room: a container's limit, which
    the machine's memory does not show from inside it; None without one, or where
    none can be read. Shared memory is charged to the cgroup of the process that
    makes it, and a cgroup's process past its limit is killed by the kernel (SIGKILL,
    no message, its /dev/shm file left behind). The room is the limit less what no
    reclaim can free (the cgroup's anonymous and shared memory; where the machine has
    swap, nothing), so the check never refuses what could fit."""
    try:
        with open(os.path.join(PROC_SELF, "cgroup")) as f:
            # hierarchy-id:controllers:path; v2's has no controllers
            groups = [line.split(":", 2)[1:] for line in f.read().splitlines()]
        with open(os.path.join(PROC_SELF, "mountinfo")) as f:
            mounts = [_mount(line) for line in f.read().splitlines()
                      if " - cgroup" in line]  # of a machine's many mounts
    except (OSError, ValueError, IndexError):
        return None
    swap = _has_swap()
    rooms = []
    for controllers, path in (group for group in groups if len(group) == 2):
        for fstype, options, root, point in mounts:
            if controllers == "" and fstype == "cgroup2":
                rooms += _limits_up(point, root, path, V2, swap)
            elif (fstype == "cgroup" and "memory" in controllers.split(",")
                  and "memory" in options):
                rooms += _limits_up(point, root, path, V1, swap)
    return min(rooms, key=lambda room: room[1], default=None)


# Per cgroup version: the limit's file, and the memory.stat keys of what reclaim
# cannot free without swap (v1: this cgroup's and its children's).
V2 = ("memory.max", ("anon", "shmem"))
V1 = ("memory.limit_in_bytes", ("total_rss", "total_shmem"))


def _mount(line: str) -> tuple[str, list[str], str, str]:
    """A /proc/self/mountinfo line's file system type, super options, root and mount
    point (with its octal escapes, such as a space's, read back)."""
    fields, rest = line.split(" - ", 1)
    _, _, _, root, point = fields.split(" ")[:5]
    fstype, _, options = rest.split(" ")[:3]
    unescape = [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)
                for field in (root, point)]
    return fstype, options.split(","), unescape[0], unescape[1]


def _limits_up(point: str, root: str, path: str, version: tuple[str, tuple[str, ...]],
               swap: bool) -> list[tuple[int, int]]:
    """(limit, room) of cgroup ``path`` and of each parent up to the hierarchy's
    mount at ``point`` (which shows the hierarchy from ``root``), where a limit is
    set and readable."""
    if root != "/" and path != root and not path.startswith(root + "/"):
        return []  # this mount does not show the process's cgroup
    limit_file, held_keys = version
    folder = os.path.normpath(point + "/" + path[len(root.rstrip("/")):])
    rooms = []
    while True:
        try:
            with open(os.path.join(folder, limit_file)) as f:
                text = f.read().strip()
            limit = NO_CGROUP_LIMIT if text == "max" else int(text)
            if limit < NO_CGROUP_LIMIT:
                held = 0 if swap else _held(folder, held_keys)
                rooms.append((limit, max(limit - held, 0)))
        except (OSError, ValueError):
            pass  # the root has none; a parent outside a container may be unreadable
        if folder == os.path.normpath(point) or folder == os.path.dirname(folder):
            return rooms
        folder = os.path.dirname(folder)


def _held(folder: str, keys: tuple[str, ...]) -> int:
    """The bytes of ``keys`` in the cgroup's memory.stat; 0 where it cannot be read."""
    try:
        with open(os.path.join(folder, "memory.stat")) as f:
            stat = dict(line.split() for line in f if line.count(" ") == 1)
        return sum(int(stat.get(key, 0)) for key in keys)
    except (OSError, ValueError):
        return 0


def _has_swap() -> bool:
    """Whether the machine has swap (reclaim may then page anonymous memory out);
    True where /proc/meminfo cannot be read, which counts nothing as held."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) for line in f
                        if line.startswith("SwapTotal:")) > 0
    except (OSError, ValueError, StopIteration, IndexError):
        return True


def _address_space_left() -> int | None:
    """The soft RLIMIT_AS less the process's mapped size (``VmSize``); None without a
    limit, or where either cannot be read."""
    limit = _soft_limit("RLIMIT_AS")
    if limit is None:
        return None
    try:
        with open("/proc/self/status") as status:
            size = next(int(line.split()[1]) << 10 for line in status
                        if line.startswith("VmSize:"))
    except (OSError, ValueError, StopIteration):
        return None
    return max(limit - size, 0)


def _size(nbytes: int) -> str:
    """``nbytes`` in binary units, for a message; a size no machine has (a count of
    rows past float's range: ``Pipeline(sample_count=10**400)``) as its power of ten,
    where a float division would raise OverflowError in place of the message."""
    if nbytes >= 1 << 80:
        return f"about 10**{len(str(nbytes)) - 1} B"
    for unit, scale in (("EiB", 1 << 60), ("PiB", 1 << 50), ("TiB", 1 << 40),
                        ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
