"""Checkpoints of a ReplayBuffer: atomic, streamed, checksummed, safe under concurrent adds.

File format, version 1 (integers little-endian)::

    [0, 4096)        header: magic b"RFSMCKPT", u32 format version, u32 JSON length,
                     u32 CRC-32 of these 4096 bytes with this field zeroed, UTF-8 JSON
                     (dims, layout, ptr, size, chunk_rows, offsets, byte order), zeros
    [4096, T)        rows [0, size) of ``storage``, float32 in the saving machine's
                     byte order (the header names it), row-major
    [T, T + 4k)      CRC-32 of each chunk of ``chunk_rows`` rows (the last may be short)
    [T + 4k, + 4)    CRC-32 of that table
    [.., + 8)        magic b"RFSMEND\\0"

Every byte is under a checksum, so a flipped byte anywhere is reported, and the header
states the file's length, so a truncated file is too.

Atomic: the file is written in the same directory (header last) as a file without a
name (O_TMPFILE), fsynced, only then given a temporary name ``.NAME.<pid>-<random>.tmp``
and at once renamed over ``path``, and the directory fsynced. A save killed before the
rename leaves ``path`` as it was; killed before the naming it leaves nothing else (the
kernel frees a file without a name with its last descriptor, which a killed process
closes), and in the instant between the two, the complete new file under that name
(it loads: rename it to recover it). Where there is no such file (no O_TMPFILE: not
Linux, NFS, FUSE, a kernel before 3.11; or no /proc/self/fd to name it through) the
file is written under the temporary name from the start (and where the kernel makes
one but refuses to name it, a sandbox's or a security policy's, the save writes it
again so, and so do later saves on that file system), and a save killed before the
rename leaves it, which load rejects unless the save got as far as writing its header.
The next save of ``path`` removes such a file once no process holds its lock and it is
a minute old (``replay_fsm.files.remove_stale``; a save holds the lock from the file's
creation until its rename): a killed save never costs the disk space of a second buffer
for good. A symlink at ``path`` is followed: its target is replaced (its folder must be
writable) and the link stays. The file keeps the mode of the one it replaces (a
read-only one too: the rename needs only the folder's permission), or gets 0o666 less
the umask, as a new file from ``open`` does.

Streamed: rows go from the shared storage to the file chunk by chunk, and are read
back into a new buffer's storage the same way; no second in-memory copy is made. A
helper thread checksums each chunk while the next I/O runs (both release the GIL).

Consistent under concurrent ``add`` (from threads or processes): rows are written
without any lock while ``add`` runs, then every chunk holding a row that an ``add``
wrote meanwhile (known from ``ptr``, since the ring is written in order) is written
again, until few remain; the last such pass holds the buffer's write lock. Where an
add was cut short meanwhile (a Ctrl-C after its copy: rows written, never counted in
``ptr``; ``ReplayBuffer.adds_cut_short`` counts such adds), that pass writes again
every chunk whose rows' regions were written since it was (their seqlock counters
moved). The file then holds exactly the buffer's rows as that pass saw
them, the buffer after its first ``ptr`` rows were added (and any rows such a cut
add wrote, as the buffer holds them): every row position not written during the save
was stable while it was copied, and every other was copied again after its last
write. ``add`` waits only during that last pass.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import queue
import stat
import struct
import sys
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core import as_count
from ..errors import ReplayFSMError
from ..files import PROC_FD, STALE_AFTER_S, remove_stale, temporaries, temporary_names
from ..files import create_temporary as _create_temporary  # a global: tests replace it
from ..files import create_unnamed as _create_unnamed  # (the same)
from .layout import Layout

if TYPE_CHECKING:
    from .buffer import ReplayBuffer

FORMAT_VERSION = 1
MAGIC = b"RFSMCKPT"
END_MAGIC = b"RFSMEND\0"
HEADER_BYTES = 4096
_PREFIX = struct.Struct("<8sIII")  # magic, version, JSON length, header CRC
_CRC_FIELD = slice(16, 20)
# Lock-free catch-up passes before the locked one: enough for a collector slower than
# the disk to be left with at most a chunk of rows to copy under the lock.
CATCH_UP_PASSES = 4
# The least of each dimension a buffer takes (ReplayBuffer's constructor): a header, and
# a dimension passed to load, below it is out of range, not a mismatch.
_DIM_LOW = {"capacity": 1, "obs_dim": 1, "action_dim": 1, "critic_dim": 0}
_HEADER_INTS = ("capacity", "obs_dim", "action_dim", "critic_dim", "width", "region_rows",
                "ptr", "size", "chunk_rows", "n_chunks", "table_offset", "file_bytes")


class CheckpointError(ReplayFSMError, ValueError):
    """A checkpoint file that cannot be loaded: not a checkpoint, truncated, corrupted,
    of another format version, or not matching the dimensions asked for."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from what the constructor takes (args holds the message), so a load
        # failing in a process pool's worker reaches the caller as itself.
        return type(self), (self.path, self.problem), vars(self)


@dataclass(frozen=True)
class Checkpoint:
    """What ``ReplayBuffer.save`` wrote: the buffer after its first ``ptr`` rows;
    ``removed``: the temporary files of killed saves of ``path`` it removed first
    (``replay_fsm.files.remove_stale``)."""

    path: str
    ptr: int
    size: int
    file_bytes: int
    removed: tuple[str, ...] = ()


def _layout_record(layout: Layout) -> dict[str, Any]:
    record: dict[str, Any] = {}
    for name, value in vars(layout).items():
        record[name] = [value.start, value.stop] if isinstance(value, slice) else value
    return record


def _ranges_written(first: int, stop: int, capacity: int) -> list[tuple[int, int]]:
    """Row positions that the adds of history rows [first, stop) wrote."""
    if stop - first >= capacity:
        return [(0, capacity)]
    lo = first % capacity
    hi = lo + (stop - first)
    return [(lo, min(hi, capacity))] + ([(0, hi - capacity)] if hi > capacity else [])


class _Checksummer:
    """``zlib.crc32`` of one buffer at a time on a thread of its own, beside the
    caller's I/O: ``submit`` one, then ``result``. Built on SimpleQueue, whose put and
    get are single C calls, not on a ThreadPoolExecutor: a Ctrl-C on the caller's
    thread could leave one of the pool's Python locks taken, and the save then hung
    in the pool's shutdown (and the interpreter at exit, joining the pool's thread)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[int | BaseException] = queue.SimpleQueue()
        # Started by the first submit, inside the caller's try: a thread started by a
        # constructor that a Ctrl-C then cut short would wait for jobs for ever.
        self._thread: threading.Thread | None = None
        # Ends the thread after the job it has (a daemon: nothing waits for it). One C
        # call, no Python frame: a Ctrl-C cannot land before the end is posted.
        self.close: Callable[[], None] = functools.partial(self._jobs.put, None)

    def _run(self) -> None:
        while (data := self._jobs.get()) is not None:
            try:
                crc: int | BaseException = zlib.crc32(data)
            except BaseException as exc:  # noqa: BLE001 - raised by result, not lost
                crc = exc
            # Let go of the chunk before its result is posted: once the caller has the
            # result, this thread holds nothing of the caller's rows. Held until the
            # next job, the view of a loaded (or saved) buffer's storage was the last
            # reference to its tensor once the caller dropped the buffer, and was freed
            # here when close's None came; with the interpreter finalizing by then,
            # this daemon thread, retaking the GIL inside torch's dealloc, was ended
            # in C++ code: "terminate called without an active exception", exit
            # code 134 (a script that loaded a checkpoint, dropped it and exited).
            del data
            self._results.put(crc)

    def submit(self, data: Any) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="checkpoint-crc",
                                            daemon=True)
            self._thread.start()
        self._jobs.put(data)

    def result(self) -> int:
        """The CRC of the buffer submitted last (each result is taken once); what
        computing it raised, raised here."""
        got = self._results.get()
        if isinstance(got, BaseException):
            raise got
        return got


class _Writer:
    """Writes rows of ``rb.storage`` into the open file ``fd`` chunk by chunk and keeps
    each chunk's CRC and the extent it covers."""

    def __init__(self, rb: ReplayBuffer, fd: int, chunk_rows: int,
                 checksummer: _Checksummer) -> None:
        self.fd = fd
        self.checksummer = checksummer
        self.chunk_rows = chunk_rows
        self.row_bytes = rb.width * 4
        self.rows = rb.storage.numpy()
        self.crcs: dict[int, tuple[int, int]] = {}  # chunk -> (rows covered, CRC)
        self.writes, self.region_rows = rb.region_writes(), rb.region_rows
        self.seen: dict[int, np.ndarray] = {}  # chunk -> its regions' counters before

    def _rows(self, k: int, size: int) -> tuple[int, int]:
        """The rows [lo, hi) chunk ``k`` holds of a buffer of ``size`` rows."""
        return k * self.chunk_rows, min((k + 1) * self.chunk_rows, size)

    def _regions(self, lo: int, hi: int) -> slice:
        return slice(lo // self.region_rows, (hi - 1) // self.region_rows + 1)

    def write_chunks(self, chunks: range, size: int) -> None:
        for k in chunks:
            self.write_chunk(k, size)

    def write_chunk(self, k: int, size: int) -> None:
        lo, hi = self._rows(k, size)
        data = self.rows[lo:hi].data.cast("B")
        self.seen[k] = self.writes[self._regions(lo, hi)].copy()
        # Checksummed while written. Should an add change these rows meanwhile, the
        # CRC may not match the bytes written; the chunk is then written again later.
        self.checksummer.submit(data)
        _pwrite_all(self.fd, data, HEADER_BYTES + lo * self.row_bytes)
        self.crcs[k] = (hi - lo, self.checksummer.result())

    def rewrite_changed(self, size: int) -> None:
        """With adds paused: write again every chunk of rows [0, size) not written
        yet, written shorter, or holding a row written since (its regions' counters
        moved), by an add counted in ``ptr`` or by one a Ctrl-C cut short."""
        for k in range(-(-size // self.chunk_rows)):
            lo, hi = self._rows(k, size)
            written = self.crcs.get(k)
            if (written is None or written[0] != hi - lo
                    or not np.array_equal(self.seen[k], self.writes[self._regions(lo, hi)])):
                self.write_chunk(k, size)

    def rewrite_written(self, first: int, stop: int, capacity: int) -> None:
        """Write again every chunk holding a row that history rows [first, stop) wrote."""
        size = min(stop, capacity)
        for lo, hi in _ranges_written(first, stop, capacity):
            if hi > lo:
                self.write_chunks(range(lo // self.chunk_rows,
                                        (hi - 1) // self.chunk_rows + 1), size)


def _tail_bytes(n_chunks: int) -> int:
    """The length of what follows the rows: the CRC table, its CRC, the end magic."""
    return 4 * n_chunks + 4 + len(END_MAGIC)


def _extent(size: int, row_bytes: int, n_chunks: int) -> tuple[int, int]:
    """Where the CRC table starts, and the file's length, for ``size`` rows."""
    table_offset = HEADER_BYTES + size * row_bytes
    return table_offset, table_offset + _tail_bytes(n_chunks)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


# errnos that say a directory cannot be synced here (not that a sync failed): a folder
# this process may write into but not read, a file system without directory fsync.
_NO_DIRECTORY_SYNC = {errno.EACCES, errno.EPERM, errno.EINVAL, errno.ENOTSUP,
                      errno.EOPNOTSUPP, errno.EBADF}


def _fsync_directory(directory: str, path: str) -> None:
    """Sync the folder after the rename, which is durable only once the folder's entry
    is on disk. Called with ``path`` already holding the new file: an error says so."""
    opened: list[int] = []  # filled by one C call: a Ctrl-C as the open returns loses none
    try:
        try:
            opened.extend(map(os.open, [directory],
                              [os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)]))
            os.fsync(opened[0])
        finally:
            for fd in opened:
                os.close(fd)
    except OSError as exc:
        if exc.errno in _NO_DIRECTORY_SYNC:
            return
        raise OSError(exc.errno, f"{exc.strerror} while syncing its folder: the file holds "
                                 f"the new checkpoint, but its rename may not survive a "
                                 f"power cut", path) from exc


def _target(path: str) -> str:
    """The file a save to ``path`` replaces: a symlink's target (the link stays, as
    with ``open(path, "w")``). Checked before anything is written.

    Raises:
        FileNotFoundError: ``path`` is empty, or a folder on its way is missing.
        NotADirectoryError: a file on its way is used as a folder.
        IsADirectoryError: ``path`` is a folder, or ends with a slash.
        OSError: ``path`` is a pipe, a device or a socket: renaming the file over
            it would replace the node itself (``/dev/null``, as root).
    """
    if not path:
        raise _os_error(errno.ENOENT, path)
    if path.endswith(os.sep) or (os.altsep and path.endswith(os.altsep)):
        raise _os_error(errno.EISDIR, path)
    try:
        # The folder as the kernel resolves it: realpath alone would drop a missing
        # folder before a "..", and write where a load of ``path`` never looks.
        folder = os.stat(os.path.dirname(path) or os.curdir)
    except OSError as exc:
        raise _os_error(exc.errno or errno.ENOENT, path) from None
    if not stat.S_ISDIR(folder.st_mode):
        raise _os_error(errno.ENOTDIR, path)
    target = os.path.realpath(path)
    if os.path.isdir(target):
        raise _os_error(errno.EISDIR, path)
    if os.path.exists(target) and not os.path.isfile(target):
        raise OSError(errno.EINVAL, "not a regular file (a pipe, a device or a socket): "
                                    "save writes a checkpoint file and renames it over "
                                    "the old one", path)
    return target


def _os_error(code: int, path: str) -> OSError:
    """The error the OS gives for ``code`` on ``path`` (OSError picks the subclass:
    FileNotFoundError, IsADirectoryError, ...)."""
    return OSError(code, os.strerror(code), path)


def save(rb: ReplayBuffer, path: str | os.PathLike[str], *,
         chunk_bytes: int = 16 << 20) -> Checkpoint:
    """Write ``rb`` to ``path`` atomically; see the module docstring and
    ``ReplayBuffer.save``.

    Raises:
        ValueError: ``chunk_bytes`` is not a positive int.
        OSError: the file could not be written; ``path`` is left as it was (the
            exception names ``path``). Only where syncing the folder after the rename
            fails (EIO, say) does ``path`` already hold the new checkpoint; the
            message says so.
    """
    try:  # the library's rule for sizes: a numpy integer is one, a bool is not
        chunk_bytes = as_count("chunk_bytes", chunk_bytes, low=1)
    except (TypeError, ValueError):
        raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}") \
            from None
    path = os.fsdecode(path)  # a str, bytes or os.PathLike path, named as a str
    target = _target(path)
    directory = os.path.dirname(target)
    chunk_rows = max(1, min(rb.capacity, chunk_bytes // (rb.width * 4)))
    removed = remove_stale(target, ".tmp")  # a killed save's, first: the room it needs
    try:
        ptr, size, file_bytes = _write(rb, path, target, chunk_rows, unnamed_first=True)
    except _NotNamed:  # made without a name, which the kernel then refused to give it
        ptr, size, file_bytes = _write(rb, path, target, chunk_rows, unnamed_first=False,
                                       refused=True)
    _fsync_directory(directory, path)
    return Checkpoint(path=path, ptr=ptr, size=size, file_bytes=file_bytes,
                      removed=tuple(removed))


class _NotNamed(Exception):
    """A file made without a name that the kernel refused to name (``_NAMING_REFUSED``):
    the save writes it again, named from the start."""


# What a link of /proc/self/fd/N raises where files made without a name cannot be
# named: a sandbox's kernel that follows no such link (EXDEV, ENOENT), a security
# policy (EPERM, EACCES), no linkat (ENOSYS, EOPNOTSUPP, EINVAL). Not room (ENOSPC):
# a named file would be refused too.
_NAMING_REFUSED = frozenset({errno.EXDEV, errno.ENOENT, errno.EPERM, errno.EACCES,
                             errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL})
# The file systems (st_dev) where such a link was refused and a named file was then
# made in the same folder (a folder removed meanwhile refuses both: that says nothing
# of its file system): later saves there name their file from the start.
_NOT_NAMEABLE: set[int] = set()


def _write(rb: ReplayBuffer, path: str, target: str, chunk_rows: int, *,
           unnamed_first: bool, refused: bool = False) -> tuple[int, int, int]:
    """Write the checkpoint file and rename it over ``target`` (``save``), without a
    name until it is whole where ``unnamed_first`` and the folder allow; returns its
    ``ptr``, ``size`` and length. ``refused``: a file made without a name was refused
    its name just before; once this one is made named, the folder's file system is
    noted in ``_NOT_NAMEABLE``.

    Raises:
        _NotNamed: made without a name, the file could not be named; nothing is left.
        OSError: as ``save``, naming ``path``.
    """
    folder = os.path.dirname(target) or os.curdir
    checksummer = _Checksummer()
    fd, tmp = -1, ""  # tmp: a name this save may have made, removed if it fails
    held = -1  # a second descriptor of it, which keeps its lock through the rename
    # A descriptor of the file as the one C call that made it left it, until fd or
    # held holds it: a Ctrl-C as a call returns would lose it with the return value.
    opened: list[int] = []
    try:
        device = os.stat(folder).st_dev
        unnamed = (unnamed_first and device not in _NOT_NAMEABLE
                   and _create_unnamed(target, opened))
        if unnamed:
            fd = opened[0]
            opened.clear()  # no point a Ctrl-C is taken at before this call's end
        else:  # named from the start (no O_TMPFILE here): a killed save leaves it
            for tmp in _names_beside(target):
                try:
                    fd = _create_temporary(tmp, target)
                except FileExistsError:
                    tmp = ""  # another's file: never removed (no call before this)
                    continue
                break
            if refused:  # names are made here: the refusal was of the link alone
                _NOT_NAMEABLE.add(device)
        writer = _Writer(rb, fd, chunk_rows, checksummer)
        cut = rb.adds_cut_short
        # size is min(ptr, capacity) by construction; deriving it from the one counter
        # read keeps the pair consistent while add updates both.
        done = rb.ptr
        writer.write_chunks(range(-(-min(done, rb.capacity) // chunk_rows)),
                            min(done, rb.capacity))
        for _ in range(CATCH_UP_PASSES):
            now = rb.ptr
            if now - done <= chunk_rows:
                break
            writer.rewrite_written(done, now, rb.capacity)
            done = now
        with rb.adds_paused():  # also inside a caller's own adds_paused() block
            ptr = rb.ptr
            size = min(ptr, rb.capacity)
            if rb.adds_cut_short == cut:
                writer.rewrite_written(done, ptr, rb.capacity)
            else:  # its rows are known only by their regions' counters
                writer.rewrite_changed(size)
        file_bytes = _write_tail(rb, fd, writer, ptr, size)
        os.fsync(fd)
        # The file's lock (flock) stays held until the rename, after the first
        # descriptor's close has reported its error, if any: a save whose fsync took
        # longer than files.STALE_AFTER_S would otherwise look like a killed one's to
        # another process's save (files.remove_stale) in between.
        opened.extend(map(os.dup, [fd]))
        held = opened[0]
        opened.clear()
        closing, fd = fd, -1  # closed even if close reports an error: never twice
        os.close(closing)
        if unnamed:  # named only now, whole and synced, and renamed at once
            for tmp in _names_beside(target):
                try:
                    # src_dir_fd, which the kernel ignores beside an absolute path,
                    # makes Python call linkat, which follows /proc's link to the file:
                    # without it Python calls link, which does not (CPython gh-81793).
                    os.link(f"{PROC_FD}/{held}", tmp, src_dir_fd=held,
                            follow_symlinks=True)
                except FileExistsError:
                    tmp = ""  # another's file: never removed (no call before this)
                    continue
                except OSError as exc:
                    if exc.errno not in _NAMING_REFUSED:
                        raise
                    tmp = ""  # none made
                    raise _NotNamed from exc
                break
        os.replace(tmp, target)
        closing, held = held, -1  # no point a Ctrl-C is taken at until the close:
        try:  # a with-block's calls would be such points, and lose the descriptor
            os.close(closing)
        except OSError:
            pass  # the file is in place, synced
    except OSError as exc:
        _discard(fd, held, tmp, opened)
        strerror = exc.strerror
        if exc.errno in _NO_ROOM and exc.strerror is not None:
            strerror = f"{exc.strerror}{_room_taken_beside(target)}"
        if exc.errno is not None and (exc.filename != path or strerror != exc.strerror):
            # A write's error names no file, the rename's and the temporary file's
            # creation the temporary one, an unnamed file's creation the folder and
            # its link /proc's: name the file asked for.
            # OSError() picks the subclass for the errno (FileExistsError, ...).
            raise OSError(exc.errno, strerror, path) from exc
        raise
    except BaseException:
        _discard(fd, held, tmp, opened)
        raise
    finally:
        checksummer.close()
    return ptr, size, file_bytes


def _names_beside(target: str) -> Iterator[str]:
    """``temporary_names`` for a save's file, then FileExistsError naming ``target``."""
    yield from temporary_names(target, ".tmp")
    raise FileExistsError(errno.EEXIST, "100 temporary names beside it were taken", target)


# errnos of a disk (or a quota) without the room for the new file beside the old one.
_NO_ROOM = {errno.ENOSPC, errno.EDQUOT}


def _room_taken_beside(target: str) -> str:
    """For a save that ran out of room: the temporary files of other saves of ``target``
    that take some of it (a killed save's, kept until it is a minute old and held by
    no process; or another save's in progress), named with their sizes, or "". Only
    named ones show: a save's file without a name (O_TMPFILE) is named only as it is
    renamed, and a killed save's is gone with the process."""
    found = []
    for tmp in temporaries(target, ".tmp"):
        with contextlib.suppress(OSError):
            found.append(f"{tmp} ({os.stat(tmp).st_size} bytes)")
    if not found:
        return ""
    return (f" (beside it, other saves' temporary files take some of the room: "
            f"{', '.join(found)}; one a killed save left is removed by the first save "
            f"after it is {STALE_AFTER_S:.0f} s old, or may be deleted by hand if no save "
            f"of this path is running)")


def _discard(fd: int, held: int, tmp: str, opened: list[int]) -> None:
    """Close ``fd`` and ``held`` (each unless -1), those in ``opened``, and any other
    descriptor of ``tmp`` (``_close_lost``), and remove the temporary file of a save
    that failed (one without a name is gone with its last descriptor). Its own
    errors are dropped: the save's is the one raised (a folder where files can be
    made but not removed keeps the temporary file)."""
    # Each number once: a Ctrl-C between taking a descriptor from ``opened`` and
    # clearing it leaves it in both, and a second close could close another's file.
    for each in dict.fromkeys((fd, held, *opened)):
        if each >= 0:
            with contextlib.suppress(OSError):
                os.close(each)
    if tmp:
        _close_lost(tmp)  # one whose number a Ctrl-C lost (its named open returning)
        with contextlib.suppress(OSError):  # FileNotFoundError: never made
            os.unlink(tmp)


def _close_lost(tmp: str) -> None:
    """Close what this process holds open of ``tmp`` (Linux: /proc/self/fd): a Ctrl-C
    as ``create_temporary`` returned lost the descriptor with the return value. The
    name is this save's own (a random part), so no other file's descriptor is closed.
    (A file made without a name, and a descriptor made by ``os.dup``, come from one C
    call that puts them in a list: none is lost so.)"""
    try:
        held = os.listdir("/proc/self/fd")
    except OSError:
        return  # not Linux: the descriptor stays open until the process ends
    for name in held:
        try:
            if os.readlink(f"/proc/self/fd/{name}") == tmp:
                os.close(int(name))
        except (OSError, ValueError):
            pass  # closed meanwhile, or not a descriptor's entry


def _write_tail(rb: ReplayBuffer, fd: int, writer: _Writer, ptr: int, size: int) -> int:
    """Write the CRC table, the end magic and then the header; return the file length."""
    n_chunks = -(-size // writer.chunk_rows)
    crcs = []
    for k in range(n_chunks):
        rows, crc = writer.crcs[k]
        # Invariant: every chunk was last written with the extent of the final size.
        assert rows == min(writer.chunk_rows, size - k * writer.chunk_rows), (k, rows)
        crcs.append(crc)
    table = struct.pack(f"<{n_chunks}I", *crcs)
    table_offset, file_bytes = _extent(size, writer.row_bytes, n_chunks)
    table_crc = zlib.crc32(table)
    tail = table + struct.pack("<I", table_crc) + END_MAGIC
    assert len(tail) == file_bytes - table_offset, (len(tail), n_chunks)
    meta = {
        "library": "replay_fsm", "capacity": rb.capacity, "obs_dim": rb.obs_dim,
        "action_dim": rb.action_dim, "critic_dim": rb.critic_dim, "width": rb.width,
        "layout": _layout_record(rb.layout), "region_rows": rb.region_rows,
        "check_finite": rb.check_finite, "dtype": "float32", "byteorder": sys.byteorder,
        "ptr": ptr, "size": size, "chunk_rows": writer.chunk_rows, "n_chunks": n_chunks,
        "table_offset": table_offset, "file_bytes": file_bytes,
        # Binds the header to these rows: a header put before another save's rows
        # and table (a copy that stopped after its first block) is refused.
        "table_crc": table_crc,
    }
    text = json.dumps(meta, sort_keys=True).encode()
    header = bytearray(HEADER_BYTES)
    assert _PREFIX.size + len(text) <= HEADER_BYTES, f"a header of {len(text)} bytes"
    _PREFIX.pack_into(header, 0, MAGIC, FORMAT_VERSION, len(text), 0)
    header[_PREFIX.size:_PREFIX.size + len(text)] = text
    header[_CRC_FIELD] = struct.pack("<I", zlib.crc32(header))
    _pwrite_all(fd, memoryview(tail), table_offset)
    # The header goes last: a file cut short anywhere before this has no valid magic.
    _pwrite_all(fd, memoryview(bytes(header)), 0)
    return file_bytes


def _read_header(path: str, f: Any, file_bytes: int) -> dict[str, Any]:
    block = f.read(HEADER_BYTES)
    if not block:
        raise CheckpointError(path, "empty file: not a replay_fsm checkpoint (a save "
                                    "that did not finish?)")
    if block[:len(MAGIC)] == bytes(len(MAGIC)):
        raise CheckpointError(path, "no header (zero bytes where it belongs): not a "
                                    "replay_fsm checkpoint (a save that did not finish?)")
    if not block.startswith(MAGIC[:len(block)]):
        raise CheckpointError(path, f"not a replay_fsm checkpoint (starts with "
                                    f"{bytes(block[:8])!r}, expected {MAGIC!r})")
    if len(block) < HEADER_BYTES:
        raise CheckpointError(path, f"truncated: {file_bytes} bytes, shorter than the "
                                    f"{HEADER_BYTES}-byte header")
    _, version, text_len, crc = _PREFIX.unpack_from(block, 0)
    zeroed = bytearray(block)
    zeroed[_CRC_FIELD] = bytes(4)
    intact = zlib.crc32(zeroed) == crc and _PREFIX.size + text_len <= HEADER_BYTES
    if version != FORMAT_VERSION:
        # Another version may checksum its header otherwise: a mismatch is only a hint.
        maybe = "" if intact else " (or a corrupted header: its checksum does not match)"
        raise CheckpointError(path, f"format version {version}; this library reads "
                                    f"version {FORMAT_VERSION}{maybe}")
    if not intact:
        raise CheckpointError(path, "header checksum mismatch: the header is corrupted")
    try:
        meta = json.loads(block[_PREFIX.size:_PREFIX.size + text_len])
    except ValueError as exc:
        raise CheckpointError(path, f"header is not JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(path, f"header is a JSON {type(meta).__name__}, not an object")
    missing = [k for k in _HEADER_INTS
               if not isinstance(meta.get(k), int) or isinstance(meta.get(k), bool)]
    if missing:
        raise CheckpointError(path, f"header lacks integer fields {missing}")
    _check_header_describes_a_file(path, meta)
    return meta


def _check_header_describes_a_file(path: str, meta: dict[str, Any]) -> None:
    """The header's fields agree with each other and with the format (a header with a
    valid checksum written by another tool, or edited by hand), before anything is
    allocated or read from where it points."""
    low = {**_DIM_LOW, "region_rows": 1, "ptr": 0, "chunk_rows": 1}
    bad = [f"{k}={meta[k]}" for k, least in low.items() if meta[k] < least]
    if bad:
        raise CheckpointError(path, f"header says {', '.join(bad)}: out of range")
    if not isinstance(meta.get("layout"), dict):
        raise CheckpointError(path, f"header's layout is {meta.get('layout')!r}, not an "
                                    f"object")
    if not isinstance(meta.get("check_finite", False), bool):
        raise CheckpointError(path, f"header's check_finite is {meta['check_finite']!r}, "
                                    f"not a bool")
    size, chunk_rows = meta["size"], meta["chunk_rows"]
    table_offset, file_bytes = _extent(size, meta["width"] * 4, meta["n_chunks"])
    if size != min(meta["ptr"], meta["capacity"]):
        raise CheckpointError(path, f"ptr={meta['ptr']} and size={size} are inconsistent "
                                    f"with capacity={meta['capacity']}")
    if meta["n_chunks"] != -(-size // chunk_rows):
        raise CheckpointError(path, f"{meta['n_chunks']} chunks cannot hold {size} rows "
                                    f"of {chunk_rows}")
    if meta["table_offset"] != table_offset or meta["file_bytes"] != file_bytes:
        raise CheckpointError(path, f"header says table_offset={meta['table_offset']} and "
                                    f"file_bytes={meta['file_bytes']}; {size} rows of "
                                    f"width {meta['width']} put them at {table_offset} and "
                                    f"{file_bytes}")


def load(path: str | os.PathLike[str], cls: type[ReplayBuffer], *,
         capacity: int | None = None, obs_dim: int | None = None,
         action_dim: int | None = None, critic_dim: int | None = None) -> ReplayBuffer:
    """A new ``cls`` buffer holding the checkpoint at ``path``; see ``ReplayBuffer.load``.

    Raises:
        CheckpointError: the file is not a checkpoint (or a pipe, a device or a
            socket), is truncated or corrupted, has another format version, has a header whose
            fields disagree, or does not match a given dimension.
        TypeError, ValueError: a dimension given is not an int, or is below what a
            buffer takes (1; 0 for ``critic_dim``): checked before the file is read.
        MemoryError: the buffer the file describes does not fit (``ReplayBuffer``).
        OSError: the file cannot be read (a folder: IsADirectoryError).
    """
    path = os.fsdecode(path)  # a str, bytes or os.PathLike path, named as a str
    asked = {"capacity": capacity, "obs_dim": obs_dim, "action_dim": action_dim,
             "critic_dim": critic_dim}
    # Checked before the file is opened: obs_dim=0 is a bad argument, which no file
    # could match, not a mismatch with this one.
    expected = {k: None if v is None else as_count(k, v, _DIM_LOW[k])
                for k, v in asked.items()}
    with _open_regular(path) as f:
        file_bytes = os.fstat(f.fileno()).st_size
        meta = _read_header(path, f, file_bytes)
        dtype, byteorder = meta.get("dtype"), meta.get("byteorder")
        if not isinstance(dtype, str) or not isinstance(byteorder, str):
            raise CheckpointError(path, f"header lacks its rows' type: dtype={dtype!r}, "
                                        f"byteorder={byteorder!r}")
        if byteorder != sys.byteorder or dtype != "float32":
            raise CheckpointError(path, f"holds {meta.get('byteorder')}-endian "
                                        f"{meta.get('dtype')} rows; this machine is "
                                        f"{sys.byteorder}-endian float32")
        wrong = [f"{k}={meta[k]} in the file, {v} asked for" for k, v in expected.items()
                 if v is not None and meta[k] != v]
        if wrong:
            raise CheckpointError(path, "does not match the buffer asked for: "
                                  + ", ".join(wrong) + _RESIZE_HINT * any(
                                      w.startswith("capacity=") for w in wrong))
        if meta["ptr"] > cls.MAX_PTR:
            raise CheckpointError(path, f"header says ptr={meta['ptr']}, more rows than "
                                        f"{cls.__name__} counts ({cls.MAX_PTR})")
        if meta["file_bytes"] != file_bytes:
            state = "truncated" if file_bytes < meta["file_bytes"] else "has trailing bytes"
            raise CheckpointError(path, f"{state}: {file_bytes} bytes, the header says "
                                        f"{meta['file_bytes']}")
        if hasattr(os, "posix_fadvise"):  # not on macOS
            # The disk starts reading the rows while the shared memory is allocated.
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
        ours = _layout_record(Layout.build(meta["obs_dim"], meta["action_dim"],
                                           meta["critic_dim"]))
        if ours != meta["layout"] or ours["width"] != meta["width"]:
            raise CheckpointError(path, f"row layout {meta['layout']} differs from this "
                                        f"library's {ours}")
        # The header's fields were checked: an error here is the class's own.
        try:
            rb = cls(meta["capacity"], meta["obs_dim"], meta["action_dim"],
                     meta["critic_dim"], region_rows=meta["region_rows"],
                     check_finite=meta.get("check_finite", False))
        except MemoryError as exc:  # the class's words, for the file asked for
            raise MemoryError(f"loading {path}: {exc}") from exc
        ptr, size, chunk_rows = meta["ptr"], meta["size"], meta["chunk_rows"]
        crcs = _read_table(path, f, meta)
        _read_rows(path, f, rb, crcs, chunk_rows, size)
        rb.adopt_rows(ptr)  # counters last, as add does: the rows they cover are in place
    return rb


# For a checkpoint asked for with another capacity: how its rows go on in that ring.
_RESIZE_HINT = ("; to go on in a ring of another capacity, load it without capacity= "
                "and call .resized(capacity) on the buffer (its newest rows, oldest "
                "first; ptr restarts at their count)")


def _open_regular(path: str) -> Any:
    """``path`` opened for reading, unbuffered; refused unless a regular file. Looked at
    before it is opened, so a named pipe with no writer is refused, not waited on (and
    opened as any file is, so that a lease another process holds is waited out)."""
    kind = stat.S_IFMT(os.stat(path).st_mode)
    if stat.S_ISDIR(kind):
        raise _os_error(errno.EISDIR, path)
    if not stat.S_ISREG(kind):
        raise CheckpointError(path, "not a regular file (a pipe, a device or a socket): "
                                    "load reads a checkpoint file, whose length it checks")
    f = open(path, "rb", buffering=0)
    try:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # replaced meanwhile
            raise CheckpointError(path, "not a regular file any more once opened")
        return f
    except BaseException:
        f.close()
        raise


def _read_rows(path: str, f: Any, rb: ReplayBuffer, crcs: list[int], chunk_rows: int,
               size: int) -> None:
    """Read rows [0, size) into ``rb.storage`` chunk by chunk, each chunk's checksum
    computed while the next one is read."""
    row_bytes = rb.width * 4
    rows = rb.storage.numpy()
    f.seek(HEADER_BYTES)
    pending: tuple[int, int, int] | None = None  # the chunk being checksummed
    checksummer = _Checksummer()
    try:
        for k, crc in enumerate(crcs):
            lo, hi = k * chunk_rows, min((k + 1) * chunk_rows, size)
            view = rows[lo:hi].data.cast("B")
            if not _readinto_all(f, view):
                raise CheckpointError(path, f"truncated while reading rows [{lo}, {hi})")
            if pending is not None:
                _check_chunk(path, checksummer.result(), *pending, row_bytes)
            checksummer.submit(view)
            pending = (crc, lo, hi)
        if pending is not None:
            _check_chunk(path, checksummer.result(), *pending, row_bytes)
    finally:
        checksummer.close()


def _check_chunk(path: str, computed: int, crc: int, lo: int, hi: int,
                 row_bytes: int) -> None:
    if computed != crc:
        raise CheckpointError(path, f"checksum mismatch in rows [{lo}, {hi}) (bytes "
                                    f"[{HEADER_BYTES + lo * row_bytes}, "
                                    f"{HEADER_BYTES + hi * row_bytes})): corrupted")


def _read_table(path: str, f: Any, meta: dict[str, Any]) -> list[int]:
    n_chunks = meta["n_chunks"]  # agrees with size and file_bytes (header checked)
    f.seek(meta["table_offset"])
    tail = f.read(_tail_bytes(n_chunks))
    table, (table_crc,) = tail[:4 * n_chunks], struct.unpack_from("<I", tail, 4 * n_chunks)
    if tail[-len(END_MAGIC):] != END_MAGIC or zlib.crc32(table) != table_crc:
        raise CheckpointError(path, "chunk checksum table is corrupted")
    if meta.get("table_crc", table_crc) != table_crc:  # absent: a file from before it
        raise CheckpointError(path, "the header is another save's than the rows and their "
                                    "checksum table (it names another table): corrupted")
    return list(struct.unpack(f"<{n_chunks}I", table))


def _readinto_all(f: Any, view: memoryview) -> bool:
    """Fill ``view`` from ``f``; False at an early end of file (it shrank while read)."""
    while view:
        got = f.readinto(view)
        if not got:
            return False
        view = view[got:]
    return True

