"""Files the library writes whole or not at all: a run's summary, trace and log, a
diagram. Each is written beside its path as ``<name>.part`` and renamed over it, so
an error or a stop signal while it is written (a full disk, a file-size limit, a
Ctrl-C) leaves the earlier file, or none, and never a half-written one."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str], newline: str | None = None
              ) -> Iterator[TextIO]:
    """A text file that becomes ``path`` when the block ends without an error; on an
    error the part written is removed and ``path`` left as it was. ``newline``: as
    ``open``'s.

    A path that exists and is not a regular file (``/dev/stdout``, a FIFO) is written
    in place: it cannot be replaced, and is not a file to keep whole. A symbolic
    link's target is the file replaced; the link stays.
    """
    target = Path(path)
    if target.exists() and not target.is_file():
        with target.open("w", newline=newline) as f:
            yield f
        return
    if target.is_symlink():
        target = Path(os.path.realpath(target))
    part = target.with_name(target.name + ".part")
    try:
        with part.open("w", newline=newline) as f:
            yield f
        os.replace(part, target)
    except BaseException:
        with contextlib.suppress(OSError):
            part.unlink()
        raise


def write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` whole (``replacing``); returns ``path``."""
    with replacing(path) as f:
        f.write(text)
    return Path(path)
