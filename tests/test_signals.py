"""The stop signals: helpers ignore Ctrl-C; the command line takes SIGTERM as Ctrl-C
(clean stop, files written, exit 143) whether the signal reaches the command alone
(``kill PID``, ``timeout``) or its whole process group (SLURM, systemd)."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from replay_fsm import signals

from .support import MARGIN_S


def test_interrupted_is_a_keyboard_interrupt_that_says_its_exit_code() -> None:
    term = signals.Interrupted(signal.SIGTERM)
    assert isinstance(term, KeyboardInterrupt) and str(term) == "SIGTERM"
    assert signals.exit_code(term) == 143
    assert signals.exit_code(KeyboardInterrupt()) == 130  # a plain Ctrl-C


def test_sigterm_in_the_block_raises_interrupted_and_the_handler_before_comes_back(
        ) -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(signals.Interrupted) as info:
        with signals.sigterm_as_interrupt() as taken:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10_000):  # the handler runs between bytecodes, soon
                time.sleep(0)
    assert info.value.signum == signal.SIGTERM and taken == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_handler_not_set_from_python_is_restored_as_the_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """signal.getsignal answers None for a handler installed by C code: the nearest
    Python can put back is the default, never None (which it refuses)."""
    calls: list[tuple[int, object]] = []
    real = signal.signal

    def record(signum: int, handler: object) -> object:
        calls.append((signum, handler))
        return real(signum, handler)  # type: ignore[arg-type]

    saved = real(signal.SIGUSR1, signal.SIG_IGN)
    try:
        monkeypatch.setattr(signal, "getsignal", lambda signum: None)
        monkeypatch.setattr(signal, "signal", record)
        with signals.handling((signal.SIGUSR1,), signal.SIG_IGN):
            pass
        assert calls == [(signal.SIGUSR1, signal.SIG_IGN), (signal.SIGUSR1, signal.SIG_DFL)]
    finally:
        real(signal.SIGUSR1, saved)


def test_from_another_thread_nothing_changes() -> None:
    """Only the main thread may set handlers: elsewhere the block runs as it is."""
    before, seen = signal.getsignal(signal.SIGTERM), []

    def body() -> None:
        with signals.sigterm_as_interrupt() as taken:
            seen.append((signal.getsignal(signal.SIGTERM), taken))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [(before, [])]


def test_the_suite_takes_ctrl_c_back_when_started_with_it_ignored() -> None:
    """`make test &` from a script starts pytest with SIGINT ignored; the processes
    the interrupt tests start would inherit that and never see their Ctrl-C."""
    probe = ("import signal; import tests.conftest; "
             "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)")
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True,
        cwd=Path(__file__).parent.parent, timeout=120,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert out.stdout.split() == ["True"]


@pytest.mark.parametrize("signums, ignored", [
    ((signal.SIGINT,), (True, False)),  # the packer: terminate still ends it
    (signals.STOP_SIGNALS, (True, True)),  # the demo's collector
])
def test_a_helper_process_starts_with_its_signals_held_off_and_the_learner_keeps_its_own(
        signums: tuple[int, ...], ignored: tuple[bool, bool]) -> None:
    """A signal to the whole group reaches a packer or collector process still
    importing torch too; it must not die of it. It starts with them held off
    (blocked, inherited through exec); one sent before its body's ``ignore`` does not
    end it, and after it they are ignored, not blocked. The caller's own handlers
    and mask are back once start returns."""
    import multiprocessing as mp

    from tests.collectors import report_held_then_ignore

    ctx = mp.get_context("spawn")
    answers = ctx.SimpleQueue()
    before = [signal.getsignal(s) for s in signals.STOP_SIGNALS]
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    child = ctx.Process(target=report_held_then_ignore, args=(answers, signums))
    signals.start_ignoring(child, signums)
    assert [signal.getsignal(s) for s in signals.STOP_SIGNALS] == before
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask
    child.join(60)
    assert child.exitcode == 0 and answers.get() == (ignored, ignored, (False, False))
    plain = ctx.Process(target=report_held_then_ignore, args=(answers, ()))
    plain.start()  # the control: a plain start keeps Python's default handlers
    plain.join(60)
    assert answers.get() == ((False, False), (False, False), (False, False))


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="POSIX signal masks")
@pytest.mark.parametrize("spawn_fails", [False, True], ids=["started", "start-failed"])
def test_a_ctrl_c_while_a_helper_process_starts_is_raised_once_start_returns(
        monkeypatch: pytest.MonkeyPatch, spawn_fails: bool) -> None:
    """A Ctrl-C that comes while ``start_ignoring`` starts the process (here: sent
    from inside the spawn) was lost: this process ignored SIGINT for the length of
    ``start()``, so that the child would inherit it, and the run went on (in 9 of 9
    demo runs sent in that window). It is raised once start returns, the child
    started and tracked by multiprocessing (nothing left behind), and the child
    still does not die of it; or, where the start failed, raised all the same, the
    start's error as its context."""
    import multiprocessing as mp
    from multiprocessing import util

    from tests.collectors import report_held_then_ignore

    signals.start_resource_tracker()  # before: the spawn below is the child's alone
    real = util.spawnv_passfds

    def spawn_with_a_ctrl_c(path: str, args: list[str], passfds: object) -> int:
        os.kill(os.getpid(), signal.SIGINT)  # the group's Ctrl-C, this process's share
        if spawn_fails:
            raise OSError("no more processes")
        return real(path, args, passfds)  # type: ignore[arg-type]

    ctx = mp.get_context("spawn")
    answers = ctx.SimpleQueue()
    before = signal.getsignal(signal.SIGINT)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    child = ctx.Process(target=report_held_then_ignore,
                        args=(answers, signals.STOP_SIGNALS))
    monkeypatch.setattr(util, "spawnv_passfds", spawn_with_a_ctrl_c)
    with pytest.raises(KeyboardInterrupt) as info:
        signals.start_ignoring(child, signals.STOP_SIGNALS)
    monkeypatch.undo()
    assert signal.getsignal(signal.SIGINT) is before
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask
    if spawn_fails:
        assert isinstance(info.value.__context__, OSError) and child.pid is None
        return
    assert child in mp.active_children()  # tracked: joined, or terminated at exit
    child.join(60)
    assert child.exitcode == 0
    assert answers.get() == ((True, True), (True, True), (False, False))


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="POSIX signal masks")
def test_a_stop_signal_is_not_lost_where_putting_the_handlers_back_is_cut_short(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C that comes as ``start_ignoring`` puts the handlers back runs SIGINT's,
    put back first, which raises there: SIGTERM's is never put back. SIGTERM sent
    after must still reach its handler (it stayed ignored, and was lost)."""
    real, sigint_before, taken = signal.signal, signal.getsignal(signal.SIGINT), []

    def cut_short(signum: int, handler: object) -> object:
        before = real(signum, handler)  # type: ignore[arg-type]
        if signum == signal.SIGINT and handler is sigint_before:
            raise KeyboardInterrupt  # the Ctrl-C, run by the handler just put back
        return before

    class Idle:
        def start(self) -> None:
            pass

    with signals.keeping_handlers(signals.STOP_SIGNALS):
        real(signal.SIGTERM, lambda signum, frame: taken.append(signum))
        monkeypatch.setattr(signal, "signal", cut_short)
        with pytest.raises(KeyboardInterrupt):
            signals.start_ignoring(Idle(), signals.STOP_SIGNALS)
        monkeypatch.undo()
        signal.raise_signal(signal.SIGTERM)  # to this thread; its handler runs here
    assert taken == [signal.SIGTERM]


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="POSIX signal masks")
@pytest.mark.parametrize("signums", [(signal.SIGINT,), signals.STOP_SIGNALS],
                         ids=["sigint", "stop-signals"])
def test_a_ctrl_c_taken_as_the_signals_are_blocked_leaves_none_blocked(
        monkeypatch: pytest.MonkeyPatch, signums: tuple[int, ...]) -> None:
    """``signal.pthread_sigmask`` runs the Python handlers of signals that came
    before it once it has changed the mask (CPython: PyErr_CheckSignals after the
    call): a Ctrl-C that came just before ``start_ignoring`` (or
    ``children_start_blocked``) blocks the signals is raised by that call, the mask
    already changed. The mask must be back: a main thread left with SIGINT blocked
    takes no Ctrl-C when it runs alone, and every process it starts after inherits
    the block (and the block's receiver thread must not wait on)."""
    real = signal.pthread_sigmask
    mask = real(signal.SIG_BLOCK, [])

    def handler_run_after(how: int, mask: object) -> object:
        before = real(how, mask)  # type: ignore[arg-type]
        if how == signal.SIG_BLOCK and mask:
            raise KeyboardInterrupt  # the Ctrl-C's handler, run as the call returns
        return before

    class Idle:
        started = False

        def start(self) -> None:
            self.started = True

    idle = Idle()
    signals.start_resource_tracker()  # before: its start blocks them too
    monkeypatch.setattr(signal, "pthread_sigmask", handler_run_after)
    try:
        with pytest.raises(KeyboardInterrupt):
            signals.start_ignoring(idle, signums)
        with pytest.raises(KeyboardInterrupt):
            with signals.children_start_blocked(signums):
                idle.start()
        monkeypatch.undo()
        assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask
        assert not idle.started
        assert not [t for t in threading.enumerate() if t.name == "replay_fsm-signals"
                    and t.is_alive()]
    finally:
        real(signal.SIG_SETMASK, mask)  # the next tests' mask, whatever this found


TRACKER_STARTED_WITH_A_CTRL_C = """
import os, signal, subprocess
import multiprocessing as mp
from multiprocessing import resource_tracker
from replay_fsm import signals
real = subprocess._fork_exec
def fork_exec(*args):
    os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C while the tracker starts
    return real(*args)
subprocess._fork_exec = fork_exec
try:
    signals.start_resource_tracker()
    print("lost")
except KeyboardInterrupt:
    print("raised")
subprocess._fork_exec = real
pid = resource_tracker._resource_tracker._pid
print("recorded", pid is not None and os.waitpid(pid, os.WNOHANG) == (0, 0))
signals.start_resource_tracker()
lock = mp.get_context("spawn").Lock()  # its semaphore is registered with the tracker
print("the same tracker", resource_tracker._resource_tracker._pid == pid)
status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
ignored, blocked = (int(status[k].split()[0], 16) for k in ("SigIgn", "SigBlk"))
print("held off", [bool((ignored | blocked) >> (s - 1) & 1) for s in signals.STOP_SIGNALS])
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self") or not hasattr(signal, "pthread_sigmask"),
                    reason="/proc and POSIX signal masks needed")
def test_a_ctrl_c_while_the_resource_tracker_starts_is_raised_once_it_started() -> None:
    """The library started multiprocessing's resource tracker with the stop signals
    ignored here, so that it would inherit that: a Ctrl-C then was lost, and the run
    went on (in 6 of 6 demo runs sent in that window). It is raised once the tracker
    is started and recorded: the same tracker serves every later start and
    semaphore (none started beside it, no traceback for a name it never saw), it
    still holds off the three, and the program exits cleanly. In a fresh
    interpreter, whose first start starts the tracker."""
    done = subprocess.run([sys.executable, "-c", TRACKER_STARTED_WITH_A_CTRL_C],
                          capture_output=True, text=True, timeout=MARGIN_S * 4,
                          cwd=Path(__file__).resolve().parent.parent,
                          preexec_fn=_hangup_at_default)
    assert done.stdout.split("\n") == [
        "raised", "recorded True", "the same tracker True",
        "held off [True, True, True]", ""], done.stdout + done.stderr
    assert done.returncode == 0 and done.stderr == "", done.stderr


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="POSIX signal masks")
def test_ignore_drops_a_signal_that_waited_blocked_and_unblocks_it() -> None:
    """A helper started by ``start_ignoring`` starts with the signals blocked: its
    body's ``ignore`` must drop one that came meanwhile, not deliver it, and unblock
    them (a helper whose SIGINT stayed blocked would start its own children with it
    blocked). SIGUSR1 for SIGINT, sent to this thread alone."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
    try:
        with signals.keeping_handlers((signal.SIGUSR1,)):
            signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
            assert signal.SIGUSR1 in signal.sigpending()
            signals.ignore((signal.SIGUSR1,))  # the default would end this process
            assert signal.SIGUSR1 not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
            assert signal.SIGUSR1 not in signal.sigpending()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


BLOCKED_CHILDREN = """
import multiprocessing as mp, os, signal, time
from replay_fsm import signals
from tests.collectors import report_blocked
if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    taken = []
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    with signals.handling((signal.SIGTERM,), lambda signum, frame: taken.append(signum)):
        with signals.children_start_blocked(signals.STOP_SIGNALS):
            # The first semaphore of a fresh process starts multiprocessing's resource
            # tracker, which then unblocked both in this thread: the children started
            # with them unblocked.
            answers = ctx.SimpleQueue()
            children = [ctx.Process(target=report_blocked, args=(answers,))
                        for _ in range(2)]
            for child in children:
                child.start()
            os.kill(os.getpid(), signal.SIGTERM)  # this process still takes it
            end = time.monotonic() + 60
            while not taken and time.monotonic() < end:
                time.sleep(0.01)
        print("taken", taken == [signal.SIGTERM])
    for child in children:
        child.join(60)
    print("children", [answers.get() for _ in children])
    print("mask back", signal.pthread_sigmask(signal.SIG_BLOCK, []) == before)
    plain = ctx.Process(target=report_blocked, args=(answers,))
    plain.start()
    plain.join(60)
    print("after", answers.get())
"""


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="POSIX signal masks")
def test_children_started_in_the_block_start_with_the_stop_signals_blocked() -> None:
    """What launch starts its ranks with: a stop signal sent while a rank imports
    torch waits for the rank's handlers (it killed the rank, or raised inside the
    import); the launcher itself still takes its signals meanwhile. In a fresh
    interpreter, so that its first spawn starts the resource tracker."""
    done = subprocess.run([sys.executable, "-c", BLOCKED_CHILDREN], capture_output=True,
                          text=True, timeout=MARGIN_S * 4,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.stdout.split("\n") == [
        "taken True", "children [(True, True), (True, True)]", "mask back True",
        "after (False, False)", ""], done.stdout + done.stderr


def _wait_for_tick(proc: subprocess.Popen[bytes], tick: int, deadline_s: float) -> bytes:
    """Read the progress bar on ``proc``'s stderr until it shows ``tick`` ticks done."""
    assert proc.stderr is not None
    return _read_until_tick(proc.stderr.fileno(), tick, deadline_s)


def _read_until_tick(fd: int, tick: int, deadline_s: float) -> bytes:
    """Read ``fd`` (a pipe, or a terminal's master side) until the progress bar written
    to it shows ``tick`` ticks done."""
    seen, end = b"", time.monotonic() + deadline_s
    while time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # a terminal's EIO: every process on it left
                break
            if not chunk:
                break  # it exited
            seen += chunk
            if _ticks_done(seen) >= tick:
                return seen
    raise AssertionError(f"no tick {tick} within {deadline_s} s:\n"
                         + seen.decode(errors="replace")[-2000:])


def _ticks_done(output: bytes) -> int:
    """The most ticks a tqdm bar in ``output`` shows done (0: none drawn yet)."""
    return max((int(n) for n in re.findall(rb"\| *(\d+)/\d+ \[", output)), default=0)


def _in_session(sid: int) -> dict[int, str]:
    """The processes (not zombies) in session ``sid``: pid -> command line."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue  # not a process, or gone meanwhile
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if int(fields[3]) == sid and fields[0] != "Z":
            found[int(entry.name)] = cmdline.decode(errors="replace")
    return found


def _left_in_session(sid: int, within_s: float) -> dict[int, str]:
    """What is still in session ``sid`` after waiting up to ``within_s`` seconds for
    each to exit (multiprocessing's resource tracker leaves once the last process
    holding its pipe has)."""
    end = time.monotonic() + within_s
    for pid in _in_session(sid):
        try:
            fd = os.pidfd_open(pid)  # readable once the process has exited
        except ProcessLookupError:
            continue
        try:
            select.select([fd], [], [], max(0.0, end - time.monotonic()))
        finally:
            os.close(fd)
    return _in_session(sid)


def _semaphores_of_session(sid: int) -> set[str]:
    """The /dev/shm names of the named semaphores the processes of session ``sid``
    have open (each is mapped from its file)."""
    names = set()
    for pid in _in_session(sid):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue  # gone meanwhile
        names.update(m.group(1) for m in re.finditer(r"/dev/shm/(sem\.\S+)", maps))
    return names


def _gone_from_shm(names: set[str], within_s: float) -> set[str]:
    """Which of ``names`` are still in /dev/shm after waiting up to ``within_s``
    seconds (the resource tracker, in a session of its own, frees what the run's
    processes left once the last of them has exited)."""
    end = time.monotonic() + within_s
    while (left := {n for n in names if Path("/dev/shm", n).exists()}) \
            and time.monotonic() < end:
        time.sleep(0.05)
    return left


def _hangup_at_default() -> None:
    """In a child before its exec: SIGHUP at its default, as a terminal's shell starts
    a command, whatever this suite inherited (a runner under nohup ignores it)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("signum", "to_group"), [
    (signal.SIGTERM, False), (signal.SIGTERM, True), (signal.SIGHUP, True)],
    ids=["sigterm-the-command", "sigterm-its-group", "sighup-its-group"])
def test_sigterm_stops_the_demo_as_ctrl_c_does(tmp_path: Path, signum: int,
                                                to_group: bool) -> None:
    """SIGTERM mid-run, to the command alone (kill, timeout) or to its whole process
    group with its packer and collector processes (SLURM, systemd), or SIGHUP to the
    group (a closed terminal, a dropped ssh session): the demo stops cleanly, writes
    its files with the run marked interrupted, exits with the shell's code for the
    signal (143, 129), prints no traceback (multiprocessing's resource tracker too
    lives through the hangup), and leaves no process behind."""
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "replay_fsm", "demo", "--ticks", "100000",
         "--sample-count", "1024", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        preexec_fn=_hangup_at_default)
    try:
        _wait_for_tick(proc, 5, deadline_s=240)
        if to_group:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signum, stdout.decode() + stderr.decode()
    assert b"Traceback" not in stderr, stderr.decode()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and 5 <= summary["ticks"] < 100_000
    assert summary["trace_conforms"]
    assert b"(interrupted)" in stdout
    assert _left_in_session(proc.pid, within_s=60) == {}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_under_nohup_a_hangup_leaves_the_demo_running(tmp_path: Path) -> None:
    """``nohup`` starts a command with SIGHUP ignored so that it outlives its
    terminal: the demo keeps that, and its helper processes too. Still ticking 20
    ticks after a hangup to its whole group, it stops on SIGTERM as ever."""
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "replay_fsm", "demo", "--ticks", "100000",
         "--sample-count", "1024", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        seen = _wait_for_tick(proc, 5, deadline_s=240)
        done = _ticks_done(seen)
        os.killpg(proc.pid, signal.SIGHUP)
        _wait_for_tick(proc, done + 20, deadline_s=240)  # raises if it stopped
        assert proc.poll() is None
        os.killpg(proc.pid, signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, stdout.decode() + stderr.decode()
    assert json.loads((out / "summary.json").read_text())["ticks"] >= done + 20
    assert _left_in_session(proc.pid, within_s=60) == {}


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux terminal")
def test_a_terminal_that_hangs_up_stops_the_demo_as_ctrl_c_does(tmp_path: Path) -> None:
    """The demo on a terminal that goes away (its window closed, the ssh session
    dropped): the kernel sends SIGHUP to the terminal's processes, and writes to it
    fail. The run stops as on Ctrl-C, writes its files, exits 129 (the shell's code
    for SIGHUP) with nothing more sent to the terminal, and leaves no process and no
    semaphore behind (a hangup used to kill every process of the run at once, its
    files unwritten and its semaphores left in /dev/shm)."""
    import fcntl
    import struct
    import termios

    out = tmp_path / "out"
    master, slave = os.openpty()
    # A new terminal is 0 columns wide, where tqdm draws no bar to read the ticks from.
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))

    def own_terminal() -> None:  # the terminal becomes the session's: its hangup is ours
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        _hangup_at_default()

    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "replay_fsm", "demo", "--ticks", "100000",
             "--sample-count", "1024", "--out", str(out)],
            stdin=slave, stdout=slave, stderr=slave, preexec_fn=own_terminal)
    finally:
        os.close(slave)
    try:
        _read_until_tick(master, 5, deadline_s=240)
        semaphores = _semaphores_of_session(proc.pid)  # the run's, not other programs'
    finally:
        os.close(master)  # the hangup
    try:
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signal.SIGHUP
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and 5 <= summary["ticks"] < 100_000
    assert (out / "trace.json").is_file()
    assert _left_in_session(proc.pid, within_s=60) == {}
    assert len(semaphores) >= 4, semaphores  # the request and pack-done channels' at least
    assert _gone_from_shm(semaphores, within_s=60) == set()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux terminal")
def test_output_to_a_terminal_that_hung_up_is_sent_to_devnull(tmp_path: Path) -> None:
    """What a stopping run prints after a hangup (its summary, before the files it
    writes next) raised EIO on the terminal that went; silenced, it goes to /dev/null.
    Output to a pipe or a file is never touched."""
    import fcntl
    import termios

    done = tmp_path / "done"
    child = (
        "import os, signal, sys\n"
        "signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
        "from replay_fsm.signals import hung_up, silence_hung_up_output\n"
        "print('ready', flush=True)\n"
        "try:\n    os.read(0, 1)  # until the terminal goes: EOF or EIO\n"
        "except OSError:\n    pass\n"
        "seen = [hung_up(sys.stdout), hung_up(sys.stderr)]\n"
        "silence_hung_up_output()\n"
        "print('the summary', flush=True)\n"
        "sys.stderr.write('a last line\\n')\n"
        "sys.stderr.flush()\n"
        f"open({str(done)!r}, 'w').write(repr(seen + [hung_up(sys.stdout)]))\n")
    master, slave = os.openpty()

    def own_terminal() -> None:
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    try:
        proc = subprocess.Popen([sys.executable, "-c", child], stdin=slave, stdout=slave,
                                stderr=slave, preexec_fn=own_terminal)
    finally:
        os.close(slave)
    try:
        # The whole line: print writes "ready" and its newline apart, and a hangup
        # between the two made the child's print of 'ready' raise EIO (a busy machine).
        seen = b""
        while b"\n" not in seen:
            chunk = os.read(master, 100)
            assert chunk, seen
            seen += chunk
        assert seen.startswith(b"ready"), seen
    finally:
        os.close(master)  # the hangup
    assert proc.wait(timeout=120) == 0
    assert done.read_text() == "[True, True, False]"
    with open(tmp_path / "file", "w") as f:
        assert signals.hung_up(f) is False
    r, w = os.pipe()
    with os.fdopen(r) as reader, os.fdopen(w, "w") as writer:
        assert signals.hung_up(writer) is False and reader.readable()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="/proc needed")
def test_the_resource_tracker_lives_through_a_hangup() -> None:
    """The first replay buffer starts multiprocessing's resource tracker with the
    stop signals held off: blocked from its first instruction, and SIGHUP for good,
    never delivered (it ignores SIGINT and SIGTERM itself, once started; read here
    before or after that). Killed by a hangup to the process group, it could not
    free what the run's processes left, and its successor printed a traceback for
    each semaphore it had never seen."""
    child = (
        "from multiprocessing import resource_tracker\n"
        "from replay_fsm import ReplayBuffer\n"
        "rb = ReplayBuffer(16, 2, 1)\n"
        "pid = resource_tracker._resource_tracker._pid\n"
        "for line in open(f'/proc/{pid}/status'):\n"
        "    if line.startswith(('SigIgn:', 'SigBlk:')):\n"
        "        print(line.split()[0], int(line.split()[1], 16))\n")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                         timeout=120, check=True, preexec_fn=_hangup_at_default).stdout
    masks = dict(line.split() for line in out.splitlines())
    held = int(masks["SigIgn:"]) | int(masks["SigBlk:"])
    for signum in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
        assert held >> (signum - 1) & 1, (signum, masks)


@pytest.mark.skipif(not os.path.isdir("/dev/shm") or not hasattr(os, "killpg"),
                    reason="POSIX named semaphores in /dev/shm needed")
@pytest.mark.timeout(300)
def test_the_resource_tracker_frees_what_a_sigkill_to_the_process_group_left() -> None:
    """``kill -9 -- -PGID`` kills every process of the group at once, none able to
    clean up: the tracker, in the group's session, died with them and left their
    semaphores in /dev/shm for good. In a session of its own it frees them."""
    child = (
        "import time\n"
        "from replay_fsm import ReplayBuffer\n"
        "from replay_fsm.data.channel import Channel\n"
        "rb = ReplayBuffer(16, 2, 1)\n"
        "channel = Channel(2, 2)\n"
        "print(*channel.semaphore_names, flush=True)\n"
        "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)  # a group of its own to kill
    try:
        names = proc.stdout.readline().split() if proc.stdout else []
        paths = [Path("/dev/shm", name) for name in names]
        assert len(paths) == 2 and all(p.exists() for p in paths), names
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=120)
        if proc.stdout:
            proc.stdout.close()
    left = _gone_from_shm(set(names), within_s=4 * MARGIN_S)
    for name in left:  # not to leave them for good when this fails
        Path("/dev/shm", name).unlink()
    assert not left, f"left in /dev/shm after the group's SIGKILL: {left}"


def test_the_resource_tracker_started_in_its_own_session_warns_of_nothing() -> None:
    """The tracker outlives the Popen that started it: Popen's own finalizer warned
    "subprocess N is still running" at every exit under ``-X dev`` (helper-81)."""
    done = subprocess.run(
        [sys.executable, "-X", "dev", "-W", "error", "-c",
         "from replay_fsm import signals; signals.start_resource_tracker()"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_the_interrupts_survive_pickling() -> None:
    """An exception that crosses a process boundary (a multiprocessing result, an
    error file) is pickled: its args must rebuild it."""
    import pickle

    from replay_fsm.trainers.run import RunInterrupted

    term = pickle.loads(pickle.dumps(signals.Interrupted(signal.SIGTERM)))
    assert isinstance(term, signals.Interrupted) and term.signum == signal.SIGTERM
    assert str(term) == "SIGTERM"
    run = pickle.loads(pickle.dumps(RunInterrupted(signal.SIGINT, {"ticks": 3})))
    assert run.signum == signal.SIGINT and run.result == {"ticks": 3}


def test_keeping_handlers_puts_back_what_code_inside_installed_over_them() -> None:
    """torch's elastic launcher installs its own handlers and leaves them."""
    def theirs(signum: int, frame: object) -> None:
        raise AssertionError("not ours")

    before = signal.getsignal(signal.SIGHUP)
    with signals.keeping_handlers((signal.SIGHUP,)):
        assert signal.getsignal(signal.SIGHUP) is before  # nothing installed
        signal.signal(signal.SIGHUP, theirs)
    assert signal.getsignal(signal.SIGHUP) is before


class _Starting:
    """A thread the system started whose ``start()`` a Ctrl-C cut short: ``join``
    raises until the thread has set its own started flag (here, at the third)."""

    def __init__(self, ident: int | None, raises: int) -> None:
        self.ident, self.raises, self.joins = ident, raises, 0

    def join(self, timeout: float | None = None) -> None:
        self.joins += 1
        if self.joins <= self.raises:
            raise RuntimeError("cannot join thread before it is started")


@pytest.mark.parametrize("ident, raises, joins", [(7, 2, 3), (7, 0, 1), (None, 9, 0)])
def test_join_started_waits_for_a_thread_whose_start_was_cut_short(
        ident: int | None, raises: int, joins: int) -> None:
    """The pipeline's close joined such a thread with ``Thread.join``, which raised
    "cannot join thread before it is started": close failed half done, the thread
    left running (CI's sweep of Ctrl-Cs in the constructor). One the system never
    started is not waited for."""
    thread = _Starting(ident, raises)
    signals.join_started(thread, 60.0)  # type: ignore[arg-type]
    assert thread.joins == joins


def test_join_started_gives_up_at_its_timeout() -> None:
    thread = _Starting(7, 10**9)
    signals.join_started(thread, 0.01)  # type: ignore[arg-type]
    assert 1 <= thread.joins < 10**9


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.timeout(300)
def test_a_helper_process_stopped_by_sigstop_is_killed_at_once_not_waited_for() -> None:
    """A collector stopped (SIGSTOP) cannot leave when told: the run's stop joined it
    for 30 s (a multi-rank launcher killed the rank meanwhile, its files unwritten)."""
    import multiprocessing as mp

    worker = mp.get_context("spawn").Process(target=time.sleep, args=(3600,), daemon=True)
    worker.start()
    try:
        os.kill(worker.pid, signal.SIGSTOP)
        while not signals.stopped(worker.pid):  # the kernel stops it soon after
            time.sleep(0.01)
        signals.end_worker(worker, join_s=3600)
        assert worker.exitcode == -signal.SIGKILL
    finally:
        if worker.is_alive():
            worker.kill()
            worker.join()
    assert not signals.stopped(os.getpid())


# Asks for SIGUSR1 when its parent ends (``argv[1]``: the parent it records, "mine"
# for its own), then says whether the kernel took that and which signal came.
PARENT_WATCHER = """
import os, signal, sys
from replay_fsm.signals import stop_when_parent_ends
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])  # for sigtimedwait
parent = os.getppid() if sys.argv[1] == "mine" else int(sys.argv[1])
print(stop_when_parent_ends(parent, signal.SIGUSR1), flush=True)
got = signal.sigtimedwait([signal.SIGUSR1], 60)
print("got", None if got is None else signal.Signals(got.si_signo).name, flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_a_process_gets_the_signal_it_asked_for_when_its_parent_is_killed() -> None:
    """A parent killed with SIGKILL sends nothing itself; the kernel sends the signal
    asked for (a rank's launcher killed so: helper-124). Only the watcher holds the
    pipe, which ends with it."""
    middle = subprocess.Popen(
        [sys.executable, "-c", "import os, signal, subprocess, sys; subprocess.Popen("
         f"[sys.executable, '-c', {PARENT_WATCHER!r}, 'mine']); os.close(1); signal.pause()"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert middle.stdout is not None
        assert middle.stdout.readline() == "True\n"  # asked for, its parent alive
        middle.kill()
        middle.wait()
        # the watcher holds the pipe: this waits for it, for at most its 60 s
        assert middle.stdout.read() == "got SIGUSR1\n"
    finally:
        middle.kill()
        middle.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_a_process_whose_parent_ended_before_it_asked_gets_the_signal_at_once() -> None:
    """The kernel sends nothing for a parent that ended before the request (a rank's
    launcher killed while the rank imports torch): a parent recorded that is no
    longer this process's parent is taken for ended, and the signal is sent then."""
    not_the_parent = "0"  # never a pid a process has for its parent here
    done = subprocess.run([sys.executable, "-c", PARENT_WATCHER, not_the_parent],
                          capture_output=True, text=True, timeout=MARGIN_S * 4)
    assert done.stdout == "True\ngot SIGUSR1\n", done.stderr
