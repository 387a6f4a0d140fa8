"""Files the library writes whole or not at all: a run's summary, trace and log, a
diagram. Each is written beside its path under a name of its own
(``.<name>.<pid>-<random>.part``) and renamed over it, so an error or a stop signal
while it is written (a full disk, a file-size limit, a Ctrl-C) leaves the earlier
file, or none, and never a half-written one; two writers of one path each write a
whole file (the last rename wins)."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

# Devices and the kernel's views: written in place (/dev/stdout is a link to a file
# when the output is redirected to one, and that file is not ours to replace).
IN_PLACE = ("/dev/", "/proc/")
# A temporary name's copy of NAME is cut to this many bytes, so the name stays under
# a file system's 255-byte limit.
NAME_BYTES_IN_TEMPORARY = 200


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


def temporary_names(target: str, suffix: str) -> Iterator[str]:
    """Up to 100 names ``.NAME.<pid>-<random><suffix>`` beside ``target`` (NAME cut to
    stay under a file system's 255-byte limit)."""
    directory, name = os.path.split(target)
    short = name
    while len(os.fsencode(short)) > NAME_BYTES_IN_TEMPORARY:
        short = short[:-1]
    for _ in range(100):
        yield os.path.join(directory,
                           f".{short}.{os.getpid()}-{secrets.token_hex(4)}{suffix}")


def create_temporary(tmp: str, target: str) -> int:
    """Create ``tmp`` (FileExistsError if there is one) and return its descriptor, with
    the mode the file would get from ``open(target, "w")``: the existing file's, else
    0o666 less the umask (which the kernel applies)."""
    try:
        mode: int | None = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        mode = None
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    # Never more open than the file it replaces, not even until the fchmod.
    fd = os.open(tmp, flags, 0o666 if mode is None else mode)
    if mode is not None:
        try:
            os.fchmod(fd, mode)
        except BaseException:
            os.close(fd)
            raise
    return fd


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
