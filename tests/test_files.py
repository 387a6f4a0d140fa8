"""replay_fsm.files: what the library writes is whole or not there."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from replay_fsm import files
from replay_fsm.files import make_folder, replacing, write_text


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


def test_the_new_file_keeps_the_old_ones_mode_and_a_new_one_gets_the_umasks(
        tmp_path: Path) -> None:
    """A 0600 file came back 0644 (helper-47)."""
    private = tmp_path / "private.json"
    private.write_text("old")
    private.chmod(0o600)
    write_text(private, "new")
    assert stat.S_IMODE(private.stat().st_mode) == 0o600 and private.read_text() == "new"
    umask = os.umask(0o022)
    os.umask(umask)
    write_text(tmp_path / "fresh.json", "x")
    assert stat.S_IMODE((tmp_path / "fresh.json").stat().st_mode) == 0o666 & ~umask


def test_errors_name_the_path_asked_for_not_the_temporary_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as missing:
        write_text(tmp_path / "no-folder" / "t.jsonl", "x")
    assert missing.value.filename == str(tmp_path / "no-folder" / "t.jsonl")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(OSError) as loop:  # it was replaced by a regular file
        write_text(tmp_path / "loop", "x")
    assert loop.value.errno == errno.ELOOP and (tmp_path / "loop").is_symlink()
    assert loop.value.filename == str(tmp_path / "loop")


def test_a_file_of_the_users_named_like_a_part_is_left_alone(tmp_path: Path) -> None:
    """The temporary file was ``<name>.part``: a user's file of that name was taken
    and removed (helper-47); each write now has a name of its own."""
    (tmp_path / "trace.json.part").write_text("mine")
    (tmp_path / ".trace.json.part").mkdir()  # nor does a folder of any such name block it
    write_text(tmp_path / "trace.json", "{}")
    assert (tmp_path / "trace.json.part").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".trace.json.part", "trace.json", "trace.json.part"]


def test_a_link_keeps_pointing_at_the_file_written(tmp_path: Path) -> None:
    real = tmp_path / "real.mmd"
    real.write_text("old")
    link = tmp_path / "link.mmd"
    link.symlink_to(real)
    write_text(link, "new")
    assert link.is_symlink() and real.read_text() == "new"
    dangling = tmp_path / "dangling.mmd"
    dangling.symlink_to(tmp_path / "made.mmd")
    write_text(dangling, "made")
    assert dangling.is_symlink() and (tmp_path / "made.mmd").read_text() == "made"


def test_a_path_that_is_not_a_regular_file_is_written_in_place(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """/dev/null, /dev/stdout, a FIFO: renaming a file over one would replace the
    device node itself (as root, /dev/null)."""
    def never(*args: object) -> None:
        raise AssertionError("renamed over it")

    monkeypatch.setattr(files.os, "replace", never)  # a regression fails, replacing nothing
    write_text(os.devnull, "gone")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    read = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader, so the open for
    try:  # writing does not block
        write_text(fifo, "through the pipe")
        assert os.read(read, 100) == b"through the pipe"
    finally:
        os.close(read)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


def test_standard_output_redirected_to_a_file_writes_that_file_not_a_new_one(
        tmp_path: Path) -> None:
    """/dev/stdout is then a link to that file, which was replaced by a new one
    (helper-47): another file than the one the shell opened."""
    out = tmp_path / "out.txt"
    out.write_text("")
    inode = out.stat().st_ino
    code = "from replay_fsm.files import write_text; write_text('/dev/stdout', 'diagram\\n')"
    with out.open("w") as f:
        subprocess.run([sys.executable, "-c", code], stdout=f, check=True, timeout=120)
    assert out.read_text() == "diagram\n" and out.stat().st_ino == inode


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root may write anywhere")
def test_a_writable_file_in_a_folder_closed_to_new_files_is_written_in_place(
        tmp_path: Path) -> None:
    """No file can be made beside it: as open(path, "w"), not a refusal (helper-47)."""
    folder = tmp_path / "closed"
    folder.mkdir()
    (folder / "log.jsonl").write_text("old")
    folder.chmod(0o555)
    try:
        write_text(folder / "log.jsonl", "new")
        assert (folder / "log.jsonl").read_text() == "new"
        with pytest.raises(PermissionError) as info:  # a new file cannot be made there
            write_text(folder / "other.jsonl", "x")
        assert info.value.filename == str(folder / "other.jsonl")
    finally:
        folder.chmod(0o755)


def test_where_no_file_can_be_made_beside_it_an_existing_file_is_written_in_place(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same on a folder closed to new files, as root too (root may make files
    anywhere): the creation beside it refused as such a folder refuses it."""
    def refused(target: str) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", target)

    monkeypatch.setattr(files, "_create_beside", refused)
    (tmp_path / "log.jsonl").write_text("old")
    write_text(tmp_path / "log.jsonl", "new")
    assert (tmp_path / "log.jsonl").read_text() == "new"
    with pytest.raises(PermissionError) as info:
        write_text(tmp_path / "other.jsonl", "x")
    assert info.value.filename == str(tmp_path / "other.jsonl")
    (tmp_path / "log.jsonl").chmod(0o444)  # a file it may not write either: refused
    if not os.access(tmp_path / "log.jsonl", os.W_OK):
        with pytest.raises(PermissionError):
            write_text(tmp_path / "log.jsonl", "x")


def test_a_name_near_the_file_systems_limit_is_written(tmp_path: Path) -> None:
    """The temporary name is the checkpoint's (``temporary_names``), whose copy of the
    name is cut to stay under 255 bytes: ``.<250 bytes>.<pid>-<hex>.part`` was
    ENAMETOOLONG when files.py made its own."""
    path = tmp_path / ("x" * 250)
    write_text(path, "whole")
    assert path.read_text() == "whole" and os.listdir(tmp_path) == ["x" * 250]


# What a writer killed outright left --------------------------------------------------

# Another process's pid for a temporary's name (init's, unless this is init: a test
# run as a container's first process).
OTHER_PID = 1 if os.getpid() != 1 else 2


def left_behind(directory: Path, target: str, suffix: str = ".part", *,
                pid: int = OTHER_PID, age_s: float = 2 * files.STALE_AFTER_S) -> Path:
    """A temporary file as a writer of ``pid`` killed ``age_s`` ago leaves it."""
    path = directory / f".{target}.{pid}-0123abcd{suffix}"
    path.write_text("half of it")
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_the_next_write_removes_what_a_killed_writer_left(tmp_path: Path) -> None:
    """A writer killed outright (SIGKILL, the OOM killer) runs no code: its temporary
    file stayed for good (a checkpoint's as large as the buffer)."""
    stale = left_behind(tmp_path, "summary.json")
    write_text(tmp_path / "summary.json", "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
    assert not stale.exists()


def test_a_temporary_a_writer_holds_or_just_wrote_or_of_this_process_stays(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Left: one whose writer holds its lock (a save slower than a minute, in another
    process), one written less than a minute ago (made, not locked yet; or closed,
    not renamed yet), one of this process's own (a save in another thread), and
    those of other paths and of the user's."""
    monkeypatch.setattr(files, "STARTED", time.time() - 10 * files.STALE_AFTER_S)
    held = left_behind(tmp_path, "summary.json", pid=OTHER_PID)
    fd = os.open(held, os.O_WRONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another open file: as another process's lock
    fresh = left_behind(tmp_path, "summary.json", pid=OTHER_PID + 2, age_s=1.0)
    own = left_behind(tmp_path, "summary.json", pid=os.getpid())
    kept = [held, fresh, own,
            left_behind(tmp_path, "summary.json.bak"),  # another path's
            left_behind(tmp_path, "summary.json", suffix=".tmp"),  # a checkpoint's
            left_behind(tmp_path, "summary.json.7", suffix="")]  # not a temporary name
    try:
        write_text(tmp_path / "summary.json", "{}")
    finally:
        os.close(fd)
    assert all(p.exists() for p in kept)
    write_text(tmp_path / "summary.json", "{}")  # the lock is gone: so is the file
    assert not held.exists() and all(p.exists() for p in kept[1:])


def test_what_cannot_be_judged_stays_and_never_fails_the_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system without locks (flock raises), a folder that cannot be listed,
    a temporary name that is a folder or a FIFO: nothing removed, the write done."""
    stale = left_behind(tmp_path, "t.json")
    folder = tmp_path / f".t.json.{OTHER_PID}-0123abce.part"
    folder.mkdir()
    fifo = tmp_path / f".t.json.{OTHER_PID}-0123abcf.part"
    os.mkfifo(fifo)
    then = time.time() - 2 * files.STALE_AFTER_S
    os.utime(fifo, (then, then))

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    with monkeypatch.context() as m:
        m.setattr(files.fcntl, "flock", no_locks)
        write_text(tmp_path / "t.json", "1")  # its own file written unheld, too
    assert stale.exists()
    with monkeypatch.context() as m:
        m.setattr(files.os, "listdir", lambda path: (_ for _ in ()).throw(
            PermissionError(errno.EACCES, "Permission denied", path)))
        write_text(tmp_path / "t.json", "2")
    assert stale.exists()
    write_text(tmp_path / "t.json", "3")
    assert (tmp_path / "t.json").read_text() == "3"
    assert not stale.exists() and folder.is_dir() and stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_writers_temporary_is_held_while_it_writes(tmp_path: Path) -> None:
    """The lock another write tests (from another process: locks taken through two
    opens of the file conflict as between processes)."""
    with replacing(tmp_path / "log.txt") as f:
        f.write("x")
        (part,) = [p for p in tmp_path.iterdir() if p.name.endswith(".part")]
        probe = os.open(part, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
        finally:
            os.close(probe)
    assert os.listdir(tmp_path) == ["log.txt"]


def test_a_former_process_with_this_pid_left_it_it_goes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A container's process restarted after the OOM killer often has the pid of the
    one killed: a temporary with this pid, last written before this process started,
    is that one's."""
    monkeypatch.setattr(files, "STARTED", time.time() - files.STALE_AFTER_S / 2)
    former = left_behind(tmp_path, "summary.json", pid=os.getpid())
    write_text(tmp_path / "summary.json", "{}")
    assert os.listdir(tmp_path) == ["summary.json"] and not former.exists()


@pytest.mark.parametrize("remover", ["holds it", "removed it"])
def test_a_new_temporary_a_remover_took_is_given_up_for_another_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, remover: str) -> None:
    """Between the new file's open and its lock, another process's ``remove_stale``
    may take it (this process stopped for a minute there, or clocks a minute apart):
    it holds the file's shared lock, or has removed it already. The writer then took
    no lock, or wrote a file no longer there, and failed at its rename."""
    flock = fcntl.flock
    made: list[int] = []

    def taken_first(fd: int, operation: int) -> None:
        made.append(fd)
        if len(made) == 1:
            if remover == "holds it":
                raise BlockingIOError(errno.EWOULDBLOCK, "Resource temporarily unavailable")
            (part,) = [p for p in tmp_path.iterdir() if p.name.endswith(".part")]
            part.unlink()
        flock(fd, operation)

    monkeypatch.setattr(files.fcntl, "flock", taken_first)
    write_text(tmp_path / "trace.json", "{}")
    monkeypatch.undo()
    assert len(made) == 2 and (tmp_path / "trace.json").read_text() == "{}"
    given_up = [p.name for p in tmp_path.iterdir() if p.name.endswith(".part")]
    assert len(given_up) == (1 if remover == "holds it" else 0)  # the remover's to remove


def test_a_folder_no_file_can_be_made_in_is_named_before_anything_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only mount (EROFS) fails every path; a folder closed to new files
    (EACCES: another user's) fails the paths ``replacing`` could not write in place,
    those not there or not writable. The error names the folder, not a probe's
    temporary name."""
    there = tmp_path / "summary.json"
    there.write_text("{}")
    code = errno.EROFS

    def refused(*args: object, dir: str, **kwargs: object) -> None:  # noqa: A002
        raise OSError(code, os.strerror(code), os.path.join(dir, "tmpk2f9x1"))

    monkeypatch.setattr(files.tempfile, "TemporaryFile", refused)
    for paths in ([there], [tmp_path / "new.json"]):
        with pytest.raises(OSError) as info:
            files.check_writable(paths)
        assert info.value.errno == errno.EROFS and info.value.filename == str(tmp_path)
    code = errno.EACCES
    files.check_writable([there])  # written in place
    with pytest.raises(PermissionError) as denied:
        files.check_writable([there, tmp_path / "new.json"])
    assert denied.value.filename == str(tmp_path)
    there.chmod(0o444)
    if not os.access(there, os.W_OK):  # root may write it all the same
        with pytest.raises(PermissionError):
            files.check_writable([there])
    monkeypatch.undo()
    files.check_writable([tmp_path / "new.json"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]  # no probe left
    with pytest.raises(FileNotFoundError) as missing:
        files.check_writable([tmp_path / "no" / "such.json"])
    assert missing.value.filename == str(tmp_path / "no")


def test_what_replacing_writes_in_place_or_refuses_is_checked_as_it_would(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A link is written through to its target's folder; a FIFO or a path under /dev
    in place; a folder and a loop of links are refused (by ``replacing`` too, after
    the run)."""
    closed, open_ = tmp_path / "closed", tmp_path / "open"
    closed.mkdir()
    open_.mkdir()
    make = tempfile.TemporaryFile

    def refused_in_closed(*args: object, dir: str, **kwargs: object) -> object:  # noqa: A002
        if dir == str(closed):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), dir)
        return make(*args, dir=dir, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(files.tempfile, "TemporaryFile", refused_in_closed)
    (open_ / "link.json").symlink_to(closed / "target.json")  # dangling: made there
    with pytest.raises(OSError) as info:
        files.check_writable([open_ / "link.json"])
    assert info.value.filename == str(closed)
    (closed / "link.json").symlink_to(open_ / "target.json")
    files.check_writable([closed / "link.json"])  # written in the target's folder
    os.mkfifo(closed / "fifo")
    files.check_writable([closed / "fifo", "/dev/null"])  # written in place
    with pytest.raises(IsADirectoryError):
        files.check_writable([open_])
    (open_ / "loop").symlink_to(open_ / "loop")
    with pytest.raises(OSError) as loop:
        files.check_writable([open_ / "loop"])
    assert loop.value.errno == errno.ELOOP
    with pytest.raises(IsADirectoryError):  # as replacing refuses them, after a run
        write_text(open_, "x")
    with pytest.raises(OSError) as written:
        write_text(open_ / "loop", "x")
    assert written.value.errno == errno.ELOOP


def test_make_folder_names_a_link_to_nothing_on_its_way(tmp_path: Path) -> None:
    """mkdir -p's "File exists" for a dangling link, or a loop (helper-102)."""
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    dangling, loop = tmp_path / "dangling", tmp_path / "loop"
    for folder, link in ((dangling, dangling), (dangling / "a" / "b", dangling),
                         (loop, loop)):
        with pytest.raises(FileNotFoundError, match="a symbolic link to .*, which is not a "
                                                    "folder that exists") as caught:
            make_folder(folder)
        assert caught.value.filename == str(link)
    (tmp_path / "to-a-folder").symlink_to(tmp_path)
    make_folder(tmp_path / "to-a-folder" / "new")
    assert (tmp_path / "new").is_dir()
    (tmp_path / "a-file").write_text("mine")
    with pytest.raises(FileExistsError):
        make_folder(tmp_path / "a-file")
