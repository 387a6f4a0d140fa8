"""Tensors in shared memory, refused up front with an error that says what to change
when they cannot fit (a container's /dev/shm is often 64 MB), instead of torch's
allocator message from deep inside."""

from __future__ import annotations

import math
import os
import re

import torch

SHM = "/dev/shm"  # where Linux keeps shared memory (torch's sharing strategies use it)
# What torch's refusals say when the room ran out: the CPU allocator's, a full
# /dev/shm's (ENOSPC, when the shared file is written), a map refused (ENOMEM: the
# address space, ``ulimit -v``) and a shared file past ``ulimit -f`` (EFBIG).
OUT_OF_ROOM = ("can't allocate memory", "No space left on device", "Cannot allocate memory",
               "File too large")
MORE_MACHINE = "give the machine more (a container's /dev/shm: docker run --shm-size)"


def shared_zeros(*shape: int, what: str, dtype: torch.dtype = torch.float32
                 ) -> torch.Tensor:
    """``torch.zeros(*shape, dtype=dtype).share_memory_()``, checked first against the
    machine's memory, the free space of /dev/shm (where there is one) and the address
    space left under ``ulimit -v`` (``_room``), and made with no private copy
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
    storage = torch.UntypedStorage._new_shared(nbytes)
    return torch.empty(0, dtype=dtype, device="cpu").set_(storage).view(shape)


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
    """The least of the machine's memory, /dev/shm's free space, the address space
    this process may still map (``ulimit -v``) and the largest file it may write
    (``ulimit -f``), named, with what gives more; None where none can be read."""
    rooms = []
    try:
        rooms.append(("the machine's memory",
                      os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), MORE_MACHINE))
    except (ValueError, OSError, AttributeError):
        pass
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
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
