"""Files the library writes whole or not at all: a run's summary, trace and log, a
diagram. Each is written beside its path under a name of its own
(``.<name>.<pid>-<random>.part``) and renamed over it, so an error or a stop signal
while it is written (a full disk, a file-size limit, a Ctrl-C) leaves the earlier
file, or none, and never a half-written one; two writers of one path each write a
whole file (the last rename wins).

A writer holds a lock on its temporary file (``flock``) while it writes. What a writer
killed outright left (SIGKILL, the OOM killer: no code of it runs) is removed by the
next write of the same path (``remove_stale``): a temporary file no process holds,
last written more than ``STALE_AFTER_S`` ago. A checkpoint's is as large as the
buffer, and would otherwise keep that much of the disk that the next save needs; a
checkpoint is written without a name where its folder allows (``create_unnamed``),
and a save killed then leaves nothing."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TextIO

# Devices and the kernel's views: written in place (/dev/stdout is a link to a file
# when the output is redirected to one, and that file is not ours to replace).
IN_PLACE = ("/dev/", "/proc/")
# A temporary name's copy of NAME is cut to this many bytes, so the name stays under
# a file system's 255-byte limit.
NAME_BYTES_IN_TEMPORARY = 200
# A temporary file no process holds is left alone for this long after its last write:
# its writer may have made it and not taken its lock yet, or (a text file's) closed it
# and not renamed it yet. A checkpoint's save keeps its lock through the rename.
STALE_AFTER_S = 60.0
# This process's open files (Linux): a file without a name is linked to one through it.
PROC_FD = "/proc/self/fd"
# What an open with O_TMPFILE raises where the kernel or the file system has none.
NO_TMPFILE = frozenset({errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL})
# When this process started, as near as it matters: every temporary file it makes, it
# makes after importing this module.
STARTED = time.time()

try:
    import fcntl
except ImportError:  # not POSIX: no lock taken, nothing ever found stale
    fcntl = None  # type: ignore[assignment]


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str], newline: str | None = None
              ) -> Iterator[TextIO]:
    """A text file that becomes ``path`` when the block ends without an error; on an
    error the part written is removed and ``path`` left as it was. ``newline``: as
    ``open``'s.

    The new file gets the mode of the one it replaces (a new one: 0o666 less the
    umask); a symbolic link's target is the file replaced, and the link stays. Written
    in place, as ``open(path, "w")`` would: a path that is not a regular file (a
    FIFO), one under /dev or /proc, and a file in a folder where no file can be made
    but the file itself is writable.

    Raises:
        OSError: as ``open(path, "w")`` and its writes would, naming ``path`` (a
            folder, a missing folder, no room, a symbolic link loop...).
    """
    name = os.fspath(path)
    target = Path(name)
    try:
        if name.startswith(IN_PLACE) or (target.exists() and not target.is_file()):
            with target.open("w", newline=newline) as f:
                yield f
            return
        if target.is_symlink():
            with contextlib.suppress(FileNotFoundError):  # dangling: a file to make
                os.stat(target)  # a loop raises here
            target = Path(os.path.realpath(target))
        remove_stale(str(target), ".part")
        try:
            fd, part = _create_beside(str(target))
        except PermissionError:
            if not os.access(target, os.W_OK):  # none there, or not ours to write
                raise
            with target.open("w", newline=newline) as f:  # a folder we may not add to
                yield f
            return
    except OSError as exc:
        raise _naming(exc, name) from exc
    try:
        with os.fdopen(fd, "w", newline=newline) as f:
            yield f
        os.replace(part, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(part)
        if isinstance(exc, OSError):
            raise _naming(exc, name) from exc
        raise


def write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` whole (``replacing``); returns ``path``.

    Raises:
        OSError: as ``replacing``.
    """
    with replacing(path) as f:
        f.write(text)
    return Path(path)


def write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` whole (``replacing``: through its text file's binary
    buffer, empty of text); returns ``path``.

    Raises:
        OSError: as ``replacing``.
    """
    with replacing(path) as f:
        f.buffer.write(data)
    return Path(path)


def check_writable(paths: Iterable[str | os.PathLike[str]]) -> None:
    """Raise now where ``replacing`` could not write one of ``paths``, naming its
    folder: a run finds out before it runs, not once it writes its files. A file that
    is there and writable passes in a folder where no file can be made (``replacing``
    writes it in place), as does a path under /dev or /proc, or one that is neither a
    regular file nor a folder (a FIFO). Not foreseen: a rename the folder refuses (a
    sticky folder, another user's file there).

    Raises:
        IsADirectoryError: a path is a folder.
        OSError: as making a file in a path's folder raised (a read-only mount,
            another user's folder, a missing folder), naming the folder; as ``stat``
            raised for a path (a loop of symbolic links).
    """
    for given in paths:
        path = os.fspath(given)
        if path.startswith(IN_PLACE):
            continue
        try:
            mode: int | None = os.stat(path).st_mode
        except FileNotFoundError:
            mode = None  # a file to make (a dangling link's target too)
        if mode is not None and stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if mode is not None and not stat.S_ISREG(mode):
            continue
        folder = os.path.dirname(os.path.realpath(path))  # a link's target's, as written
        try:
            with tempfile.TemporaryFile(dir=folder):
                pass
        except PermissionError as exc:
            if not os.access(path, os.W_OK):
                raise _naming(exc, folder) from exc
        except OSError as exc:
            raise _naming(exc, folder) from exc


def temporary_names(target: str, suffix: str) -> Iterator[str]:
    """Up to 100 names ``.NAME.<pid>-<random><suffix>`` beside ``target`` (NAME cut to
    stay under a file system's 255-byte limit)."""
    directory, name = os.path.split(target)
    short = _short_name(name)
    for _ in range(100):
        yield os.path.join(directory,
                           f".{short}.{os.getpid()}-{secrets.token_hex(4)}{suffix}")


def _short_name(name: str) -> str:
    """NAME as ``temporary_names`` puts it in a temporary name."""
    while len(os.fsencode(name)) > NAME_BYTES_IN_TEMPORARY:
        name = name[:-1]
    return name


def _lock(fd: int) -> bool:
    """Take the exclusive lock of a new temporary file; False where a ``remove_stale``
    holds it or has removed the file. Where the file system has no locks (ENOLCK,
    EOPNOTSUPP...), the file is written unheld: True."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return True
    return os.fstat(fd).st_nlink > 0


def remove_stale(target: str, suffix: str) -> list[str]:
    """Remove the temporary files beside ``target`` (``temporary_names``, ``suffix``)
    that their writers left: held by no process (``flock``), last written more than
    ``STALE_AFTER_S`` ago, and not made by this process (a name with this pid, written
    since this process started, is a save in another of its threads; one written
    before is a former process's with the same pid, as in a container restarted).
    Returns their names. Where the lock cannot be tested (no ``fcntl``, a file system
    without locks, a file this process may not open) the file is left; so is every
    error of this clean-up, which never fails the write that calls it."""
    if fcntl is None:
        return []
    removed = []
    for path, pid in _temporaries(target, suffix):
        with contextlib.suppress(OSError):
            if _remove_if_stale(path, pid == os.getpid()):
                removed.append(path)
    return removed


def temporaries(target: str, suffix: str) -> list[str]:
    """The temporary files beside ``target`` (``temporary_names``, ``suffix``) there now,
    whoever wrote them: a save in progress, or one killed (``remove_stale``). Empty
    where the folder cannot be listed."""
    return [path for path, _ in _temporaries(target, suffix)]


def _temporaries(target: str, suffix: str) -> list[tuple[str, int]]:
    directory, name = os.path.split(target)
    pattern = re.compile(re.escape(f".{_short_name(name)}.") + r"(\d+)-[0-9a-f]{8}"
                         + re.escape(suffix))
    try:
        entries = os.listdir(directory or ".")
    except OSError:
        return []
    found = []
    for entry in entries:
        match = pattern.fullmatch(entry)
        if match is not None:
            found.append((os.path.join(directory, entry), int(match.group(1))))
    return found


def _remove_if_stale(path: str, this_pid: bool) -> bool:
    """Remove ``path`` if its writer left it (``remove_stale``); ``this_pid``: its name
    has this process's pid. Raises OSError where it cannot tell or remove."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
                 | getattr(os, "O_NONBLOCK", 0))  # a FIFO of that name: no wait
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or time.time() - st.st_mtime < STALE_AFTER_S
                or (this_pid and st.st_mtime >= STARTED)):
            return False
        try:  # shared: a writer's exclusive lock refuses it
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        os.unlink(path)  # under the lock: no writer takes it meanwhile
        return True
    finally:
        os.close(fd)


def create_temporary(tmp: str, target: str) -> int:
    """Create ``tmp`` (FileExistsError if there is one) and return its descriptor, with
    the mode the file would get from ``open(target, "w")``: the existing file's, else
    0o666 less the umask (which the kernel applies). The descriptor holds the file's
    lock (``flock``, exclusive; none where the file system has no locks): a file held
    so is never taken for one a killed writer left (``remove_stale``)."""
    mode = _mode_of(target)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    # Never more open than the file it replaces, not even until the fchmod.
    fd = os.open(tmp, flags, 0o666 if mode is None else mode)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        if fcntl is not None and not _lock(fd):
            # A remove_stale of another process's took the new file for a killed
            # writer's (its clock, or this process stopped for a minute): its name
            # is given up, as one taken.
            raise FileExistsError(errno.EEXIST, "being removed as stale", tmp)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_unnamed(target: str, opened: list[int]) -> bool:
    """Open a new file in ``target``'s folder that no name points to (O_TMPFILE), with
    the mode and the lock ``create_temporary`` gives a named one, its descriptor
    appended to ``opened`` by the one C call that opens it: a Ctrl-C as the open
    returns loses no descriptor. The caller closes what ``opened`` holds, after an
    error too. A writer killed at any instant leaves nothing of such a file on the
    disk (the kernel frees it with its last descriptor) until it links it to a name
    (``os.link`` of ``PROC_FD/<fd>``, following the link). False, nothing opened,
    where there is no such file here: no O_TMPFILE (not Linux), a kernel or a file
    system that refuses it (``NO_TMPFILE``: NFS, FUSE, a kernel before 3.11), no
    ``PROC_FD`` to link it through (a chroot or container without /proc), or, for
    a new file, no umask to read (``_umask``).

    Raises:
        OSError: as the open raised otherwise (no permission to make a file in the
            folder, no inode left, too many open files, a missing folder), naming
            the folder; as the mode's ``fchmod`` raised.
    """
    tmpfile = getattr(os, "O_TMPFILE", None)
    if tmpfile is None or not os.path.isdir(PROC_FD):
        return False
    folder = os.path.dirname(target) or os.curdir
    mode = _mode_of(target)
    if mode is None and not _default_acl(folder):
        umask = _umask()
        if umask is None:
            return False  # a named file, whose mode the kernel gives less the umask
        mode = 0o666 & ~umask
    flags = tmpfile | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0)
    try:
        # Its mode by fchmod, not here: older kernels refused an O_TMPFILE open with a
        # read-only mode (EACCES; Linux commit 69a91c237ab0), and before 6.2 one on a
        # file system without ACLs ignored the umask (ac6800e279a2): a new checkpoint
        # writable by all. No one else can open a file without a name meanwhile. In a
        # folder with a default ACL the kernel gives it its mode from the ACL, as to
        # a named file (the umask does not count there), and a fchmod would undo it.
        opened.extend(map(os.open, [folder], [flags], [0o666 if mode is None else 0o600]))
    except OSError as exc:
        if exc.errno in NO_TMPFILE:
            return False
        raise
    if mode is not None:
        os.fchmod(opened[-1], mode)
    if fcntl is not None:
        # No other file can hold the lock of a file without a name; it stays held
        # once the file is named, until the last of its descriptors closes.
        with contextlib.suppress(OSError):  # a file system without locks: unheld
            fcntl.flock(opened[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
    return True


def _umask() -> int | None:
    """The process's umask, read without setting it (``os.umask`` sets it for every
    thread meanwhile); None where ``/proc/self/status`` does not say it (a kernel
    before 4.7, no /proc)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _default_acl(folder: str) -> bool:
    """Whether ``folder`` has a default ACL, which gives a new file in it its mode
    (the umask then does not count); False where it cannot be read (no xattrs)."""
    try:
        return bool(os.getxattr(folder, "system.posix_acl_default"))
    except (OSError, AttributeError):  # none (ENODATA), no ACLs here, not Linux
        return False


def _mode_of(target: str) -> int | None:
    """The mode of the file at ``target``, which its replacement keeps; None where
    there is none (the new file gets 0o666 less the umask)."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        return None


def _create_beside(target: str) -> tuple[int, str]:
    """A new file beside ``target`` under a name of this call's (``temporary_names``,
    ``create_temporary``): its descriptor and name."""
    for part in temporary_names(target, ".part"):
        try:
            return create_temporary(part, target), part
        except FileExistsError:
            continue  # another's: never removed
        except BaseException:
            with contextlib.suppress(OSError):  # made, then its fchmod failed
                os.unlink(part)
            raise
    raise FileExistsError(errno.EEXIST, "100 temporary names beside it were taken", target)


def _naming(exc: OSError, path: str) -> OSError:
    """``exc`` naming ``path`` (its own names the temporary file, or no file)."""
    if exc.errno is None or exc.filename == path:
        return exc
    return OSError(exc.errno, exc.strerror, path)  # OSError picks the subclass


def make_folder(folder: str | os.PathLike[str]) -> None:
    """Make ``folder`` and its missing parents, as ``mkdir -p``: a command's output
    folder.

    Raises:
        FileNotFoundError: ``folder``, or a folder on its way, is a symbolic link to
            nothing (a missing target, or a loop), named with its target: mkdir said
            "File exists" of a path that ``ls`` says is not there.
        OSError: as ``Path.mkdir`` (a file on its way: NotADirectoryError...).
    """
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except FileExistsError as exc:
        link = exc.filename
        if link is None or not os.path.islink(link) or os.path.isdir(link):
            raise
        raise FileNotFoundError(errno.ENOENT, f"a symbolic link to {os.readlink(link)}, "
                                "which is not a folder that exists", link) from None


def forget(path: str | os.PathLike[str]) -> None:
    """Remove ``path`` where it is a regular file (not a link, a FIFO or a device,
    which a write replaces in place or through): the earlier output of a command
    about to write a newer one that must not stand beside it."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        if stat.S_ISREG(os.lstat(path).st_mode) and not os.fspath(path).startswith(IN_PLACE):
            os.unlink(path)
