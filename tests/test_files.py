"""replay_fsm.files: what the library writes is whole or not there."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from replay_fsm.files import replacing, write_text


def test_a_write_cut_by_an_error_keeps_the_earlier_file_and_leaves_no_part(tmp_path: Path
                                                                           ) -> None:
    path = tmp_path / "summary.json"
    path.write_text("earlier")
    with pytest.raises(OSError, match="disk full"), replacing(path) as f:
        f.write("half of it")
        raise OSError("disk full")
    assert path.read_text() == "earlier"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
    with pytest.raises(KeyboardInterrupt), replacing(tmp_path / "new.json") as f:
        f.write("half")
        raise KeyboardInterrupt  # a Ctrl-C while it writes: no file, no part
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
    assert write_text(path, "now") == path and path.read_text() == "now"


def test_a_link_keeps_pointing_at_the_file_written(tmp_path: Path) -> None:
    real = tmp_path / "real.mmd"
    real.write_text("old")
    link = tmp_path / "link.mmd"
    link.symlink_to(real)
    write_text(link, "new")
    assert link.is_symlink() and real.read_text() == "new"


def test_a_path_that_is_not_a_regular_file_is_written_in_place(tmp_path: Path) -> None:
    """/dev/null, /dev/stdout, a FIFO: renaming a file over one would replace the
    device node itself (as root, /dev/null)."""
    write_text(os.devnull, "gone")
    assert Path(os.devnull).exists() and not Path(os.devnull).is_file()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    read = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader, so the open for
    try:  # writing does not block
        write_text(fifo, "through the pipe")
        assert os.read(read, 100) == b"through the pipe"
    finally:
        os.close(read)
    assert not fifo.is_file() and fifo.exists()
