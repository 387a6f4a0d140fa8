"""What the stop signals mean, in one place (torch-free).

SIGINT (a terminal's Ctrl-C), SIGTERM (``kill``, ``timeout``, a container's or a
batch scheduler's stop) and SIGHUP (a closed terminal, a dropped ssh session: sent to
the whole process group) all ask the learner to stop; the learner decides how: it
closes its pipeline, which ends its helper processes, and writes what it has.

- Ctrl-C reaches the whole process group, so helper processes (the spawned packer,
  the demo's collector) ignore SIGINT from their first instruction (``start_ignoring``,
  ``ignore``): they start with it blocked, and ignore it first thing. The packer
  keeps SIGTERM's default: ``Process.terminate`` and multiprocessing's clean-up at
  exit end it with that. The collector processes of the demo and of the SAC
  trainer ignore SIGTERM too (SLURM and systemd send it to
  every process of the job: a learner must not find its collector dead, or killed
  inside an add to the replay buffer, before it has decided to stop); their owner
  ends them with SIGKILL if they do not leave when closed (``end_worker``).
- The command line takes SIGTERM and SIGHUP as it takes Ctrl-C
  (``sigterm_as_interrupt``): the same clean stop, its files written, and the shell's
  code for the signal (143, 129). Under ``nohup`` SIGHUP stays ignored
  (``stop_signals_taken``). The helper processes that ignore SIGTERM ignore
  SIGHUP too (they take ``STOP_SIGNALS``), and multiprocessing's resource tracker
  keeps it blocked for good; the library starts the tracker before its first
  semaphore, in a session of its own, out of reach of a SIGKILL to the process group
  (``start_resource_tracker``). On a hangup the command line sends what it prints
  after to /dev/null where the terminal is gone (``silence_hung_up_output``).
- Starting those processes, the parent never ignores a stop signal, not even for the
  milliseconds of the start: one sent then acts once the start returns (``_held``).
- A multi-rank run agrees on either (``replay_fsm.distributed.AgreedInterrupt``). A
  launcher killed with SIGKILL forwards none: on Linux its ranks get a SIGTERM from
  the kernel as it ends (``stop_when_parent_ends``).
- A stop signal taken through this module's handlers (``sigterm_as_interrupt``) waits
  for a pipeline step the main thread is in (``step``): Python runs a handler between
  any two bytecodes, and an interrupt raised inside a step would leave it half done
  (a slot changed but its trace record never written, a lock released but not taken
  back). The step's caller raises it once the step is done (or the step itself at
  its next wait slice); the same signal again is raised at once.

A library call installs no handler of its own: only the command line and the
multi-rank demo, which own their processes, do.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import CodeType, FrameType
from typing import Any, TypeVar

# SIGHUP where there is one: a closed terminal or a dropped ssh session sends it to the
# whole process group, which would die of it at once, its files unwritten and its
# semaphores left in /dev/shm.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM) + (
    (signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ())


def stop_signals_taken() -> tuple[int, ...]:
    """The stop signals this process takes: ``STOP_SIGNALS`` less SIGHUP while it is
    ignored, as ``nohup`` starts a command (the run is to outlive its terminal: a
    handler for it would undo that)."""
    hangup = getattr(signal, "SIGHUP", None)
    return tuple(s for s in STOP_SIGNALS
                 if s != hangup or signal.getsignal(s) is not signal.SIG_IGN)


F = TypeVar("F", bound=Callable[..., Any])
# The code of the functions marked ``step``: a handler finds them on the stack.
_STEPS: set[CodeType] = set()
# The stops taken while the main thread was in a step, not raised yet (the first is
# raised). The pipeline reads it after each step and at each wait slice: a plain
# list, so that the read is one truth test.
DEFERRED: list[KeyboardInterrupt] = []
# Stops that end a pipeline's wait for a batch and nothing else (the first is raised
# by the wait, at its start or at its next slice): a handler that must not raise
# inside the learner's other calls appends here (``AgreedInterrupt``: the ranks agree
# to stop at a step's all-reduce, and a rank stuck in a wait would reach it only when
# the wait ends). Read, like DEFERRED, at each wait slice.
WAIT_STOPS: list[KeyboardInterrupt] = []


class Interrupted(KeyboardInterrupt):
    """A stop signal taken as Ctrl-C: everything that cleans up on Ctrl-C runs.
    ``signum`` says which signal it was."""

    def __init__(self, signum: int) -> None:
        super().__init__(int(signum))  # its args rebuild it when unpickled
        self.signum = int(signum)

    def __str__(self) -> str:
        return signal.Signals(self.signum).name


def signum_of(exc: KeyboardInterrupt) -> int:
    """The signal behind ``exc``: its ``signum``, SIGINT for a plain Ctrl-C."""
    return int(getattr(exc, "signum", signal.SIGINT))


def exit_code(exc: KeyboardInterrupt) -> int:
    """The shell's code for the signal behind ``exc``: 128 + its number (130 for a
    plain Ctrl-C, 143 for SIGTERM, 129 for SIGHUP)."""
    return 128 + signum_of(exc)


@contextmanager
def keeping_handlers(signums: tuple[int, ...]) -> Iterator[bool]:
    """The handlers of ``signums`` as they are now, back after the with-block,
    whatever code inside installed (torch's elastic launcher installs its own and
    leaves them). Yields whether this thread may change handlers: only the main
    thread can, and elsewhere nothing is saved or restored."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    saved = {signum: signal.getsignal(signum) for signum in signums}
    try:
        yield True
    finally:
        for signum, before in saved.items():
            # None: a handler not set from Python; the default is the nearest we can do
            signal.signal(signum, signal.SIG_DFL if before is None else before)


@contextmanager
def children_start_blocked(signums: tuple[int, ...]) -> Iterator[None]:
    """For the with-block, ``signums`` blocked in this thread, so that the processes
    it starts start with them blocked (a child inherits its parent thread's signal
    mask, through exec too): one sent while a child imports its modules waits until
    the child unblocks them (``unblock_stop_signals``) where it chooses, with the
    handlers it chooses, instead of acting inside an import (Python's SIGINT handler
    raised there: a traceback, or torch swallowed it). multiprocessing starts its
    resource tracker the same way.

    This process still takes them: a thread started before the block, which does
    nothing else, receives them, and Python runs the handlers in the main thread as
    ever (at its next bytecode; a main thread in ``time.sleep`` at the sleep's end).
    Main thread only, where signals can be blocked: elsewhere nothing changes."""
    if (not hasattr(signal, "pthread_sigmask")
            or threading.current_thread() is not threading.main_thread()):
        yield
        return
    # multiprocessing starts its resource tracker at the first spawn, and then
    # unblocks SIGINT and SIGTERM in the calling thread: started here, before the block.
    start_resource_tracker()
    done = threading.Event()
    receiver = threading.Thread(target=done.wait, name="replay_fsm-signals", daemon=True)
    receiver.start()
    try:
        before = _mask_now()
    except BaseException:
        done.set()
        raise
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, signums)  # may raise, them blocked
        yield
    finally:
        done.set()  # first: a handler that raises once the mask is back (torch's
        # launcher's do) would leave the receiver waiting for ever
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
        receiver.join()


@contextmanager
def _held(signums: tuple[int, ...]) -> Iterator[None]:
    """For the with-block, ``signums`` blocked in this thread, so that a process
    started in the block starts with them blocked (a child inherits its parent
    thread's mask, through exec too), and, on the main thread, noted by a handler
    that does nothing else in place of the handlers set (one ignored stays ignored).
    None is lost and none acts inside the block: one sent meanwhile waits blocked, or
    reaches another thread and is noted; once the block is done the mask and the
    handlers from before are back and each noted one is sent again to this thread,
    where it acts as it would have (Python's Ctrl-C handler raises KeyboardInterrupt
    there, once what the block started is started and recorded). Ignoring them
    here, which a child inherits too, dropped one sent in those milliseconds.
    Nothing where signals cannot be blocked."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    taken: list[int] = []
    saved: dict[int, Any] = {}
    ended = False

    def note(signum: int, frame: FrameType | None) -> None:
        if not ended:
            taken.append(signum)
            return
        # Still in place after the block (putting the handlers back was cut short by
        # one put back first): the handler from before, and the signal to it.
        signal.signal(signum, saved[signum])
        signal.raise_signal(signum)

    before = _mask_now()
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, signums)  # may raise, them blocked
        if threading.current_thread() is threading.main_thread():
            for signum in signums:
                handler = signal.getsignal(signum)
                if handler is not signal.SIG_IGN:
                    saved[signum] = signal.SIG_DFL if handler is None else handler
                    signal.signal(signum, note)
        yield
    finally:
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)  # a pending one: to note
        finally:
            ended = True
            for signum, handler in saved.items():
                signal.signal(signum, handler)
            for signum in taken:  # after an error in the block too: a stop is no less
                signal.raise_signal(signum)


def _mask_now() -> set[int]:
    """This thread's signal mask, changed in nothing. ``pthread_sigmask`` runs the
    handlers of signals already come once it has set the mask, and a Ctrl-C's raises
    there: a block taken in the same call as the mask it restores would stay."""
    return signal.pthread_sigmask(signal.SIG_BLOCK, ())


def start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker, once per process, with the stop
    signals held off and in a session of its own; the library calls it before it
    makes its first semaphore or lock. The tracker ignores SIGINT and SIGTERM itself,
    not SIGHUP: a hangup sent to the process group killed it, so it could not free
    what a process killed with it left (semaphores stayed in /dev/shm), and the
    tracker started in its place printed a traceback for each name it had never seen
    registered. It starts with the three blocked (``_held``: the calling thread's
    mask goes through exec) and unblocks only the two it ignores: SIGHUP stays
    blocked, never delivered. This process loses none of them meanwhile: one that
    comes while the tracker starts acts once it is started and recorded (it was
    ignored here for those milliseconds, and lost). A SIGKILL to the process group
    (``kill -9 -- -PGID``) cannot be held off: in the group's session the tracker died
    with the processes it watches and every semaphore they made stayed in /dev/shm;
    in its own it frees them once the last of those processes is gone (and says so
    on standard error, as multiprocessing's tracker does). A tracker the program
    started before, by a spawn of its own, stays where it is. Nothing where
    multiprocessing has no tracker (Windows)."""
    global _TRACKER_STARTED_IN
    if _TRACKER_STARTED_IN == os.getpid() or os.name != "posix":
        return
    from multiprocessing import resource_tracker
    from multiprocessing import util as mp_util
    spawn = getattr(mp_util, "spawnv_passfds", None)
    # multiprocessing unblocks SIGINT and SIGTERM in this thread once the tracker is
    # spawned: one pending comes then, to the block's noting handler.
    with _held(STOP_SIGNALS):
        if spawn is None:  # a multiprocessing that starts it some other way
            resource_tracker.ensure_running()
        else:
            mp_util.spawnv_passfds = _spawn_in_own_session  # type: ignore[assignment]
            try:
                resource_tracker.ensure_running()
            finally:
                mp_util.spawnv_passfds = spawn
        _TRACKER_STARTED_IN = os.getpid()  # in the block: a stop it sends again finds it


def _spawn_in_own_session(path: str, args: list[str], passfds: Any) -> int:
    """``multiprocessing.util.spawnv_passfds`` (exec ``args`` with only ``passfds``
    open besides the standard streams, signal dispositions and mask as they are),
    the child in a new session: no process group's signal reaches it."""
    import subprocess

    class Detached(subprocess.Popen):  # type: ignore[type-arg]
        def __del__(self) -> None:
            """Nothing: the tracker's owner reaps it by pid. (Popen's own, run while
            the tracker outlives it, warned "subprocess N is still running" at exit
            under ``-X dev`` and left the child to subprocess's clean-up to reap.)"""

    child = Detached(args, executable=path, pass_fds=tuple(sorted(map(int, passfds))),
                     close_fds=True, restore_signals=False, start_new_session=True)
    return child.pid


# The process that started its tracker with start_resource_tracker (a fork child shares
# its parent's tracker, and a spawned one is given it).
_TRACKER_STARTED_IN: int | None = None


def hung_up(stream: Any) -> bool:
    """Whether ``stream`` (a file object) writes to a terminal that hung up: poll says
    POLLHUP on it, and writes fail with EIO. False where that cannot be told."""
    try:
        poller = select.poll()
        poller.register(stream.fileno(), select.POLLOUT)
        return any(events & select.POLLHUP for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation: a ValueError
        return False


def silence_hung_up_output() -> None:
    """Point standard output and error at /dev/null where they write to a terminal
    that hung up, so that what a stopping run prints (its summary, a progress bar's
    last line) does not raise EIO, and the files it writes after are written."""
    for stream in (sys.stdout, sys.stderr):
        if hung_up(stream):
            send_to_devnull(stream)


def send_to_devnull(stream: Any) -> None:
    """Point ``stream``'s file descriptor at /dev/null: what is written to it, and what
    its buffer still holds, goes nowhere. Nothing where it has no descriptor."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, stream.fileno())
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation: a ValueError
        pass
    finally:
        os.close(devnull)


# prctl's options: set and get the signal this process gets when the thread that
# started it ends
PR_SET_PDEATHSIG = 1
PR_GET_PDEATHSIG = 2


def _prctl() -> Any:
    """libc's ``prctl``; None where there is none (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (AttributeError, OSError):  # a libc without it
        return None


def parent_death_signal() -> int | None:
    """The signal the kernel sends this process when its parent ends (0: none, the
    default); None where it cannot be read (no prctl: not Linux). What a caller of
    ``stop_when_parent_ends`` in its own process (``rank_main`` called from Python)
    puts back with ``set_parent_death_signal`` once done."""
    prctl = _prctl()
    if prctl is None:
        return None
    import ctypes
    got = ctypes.c_int(0)
    if prctl(PR_GET_PDEATHSIG, ctypes.byref(got), 0, 0, 0) != 0:
        return None
    return got.value


def set_parent_death_signal(signum: int) -> bool:
    """Have the kernel send ``signum`` (0: none) to this process when its parent ends
    (``PR_SET_PDEATHSIG``); whether it took the request (False where there is no
    prctl)."""
    prctl = _prctl()
    if prctl is None:
        return False
    import ctypes
    return bool(prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(int(signum)), 0, 0, 0) == 0)


def stop_when_parent_ends(parent: int, signum: int = signal.SIGTERM) -> bool:
    """Have the kernel send ``signum`` to this process when its parent ends, however
    it ends (SIGKILL, the OOM killer), as if the parent had sent it: Linux's
    ``prctl(PR_SET_PDEATHSIG)``. ``parent``: the pid of the process that started this
    one, recorded before the call; where it is no longer this process's parent (it
    ended before the call: the kernel sends nothing then) ``signum`` is sent to this
    process at once. Returns whether the kernel took the request; False, and nothing
    done, where there is no prctl (not Linux): a process there outlives its parent.
    It lasts until set again (``set_parent_death_signal``, with what
    ``parent_death_signal`` read before).

    The kernel sends it when the *thread* that started this process ends: call it
    only where that thread lives as long as its parent wants this process to (the
    main thread of a launcher that waits for its children, say)."""
    if not set_parent_death_signal(signum):
        return False
    if os.getppid() != parent:
        os.kill(os.getpid(), signum)  # process-wide, as the kernel's would be
    return True


def unblock_stop_signals(signums: tuple[int, ...] = STOP_SIGNALS) -> None:
    """Unblock ``signums`` in this thread (a process that ``children_start_blocked``
    or ``start_ignoring`` started): one sent meanwhile comes now, to the handlers in
    place. Nothing where signals cannot be blocked."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signums)


@contextmanager
def handling(signums: tuple[int, ...], handler: Any) -> Iterator[None]:
    """``handler`` for ``signums`` for the length of the with-block, then the handlers
    from before (``keeping_handlers``; from a thread other than the main one nothing
    changes)."""
    with keeping_handlers(signums) as main:
        if main:
            for signum in signums:  # all saved first: a signal in between finds them so
                signal.signal(signum, handler)
        yield


def step(fn: F) -> F:
    """Mark ``fn`` as a step: a stop signal that this module's handlers take while
    the main thread runs it (or anything it calls) is deferred, not raised there.
    The caller of the outermost step raises it once the step returns or raises
    (``raise_deferred``); a step that waits raises it at its next wait slice, where
    nothing is half done. ``fn`` itself is returned unchanged: a step costs nothing
    when no signal comes."""
    _STEPS.add(fn.__code__)
    return fn


def in_step(frame: FrameType | None) -> bool:
    """Whether ``frame`` or one of its callers runs a function marked ``step``."""
    while frame is not None:
        if frame.f_code in _STEPS:
            return True
        frame = frame.f_back
    return False


def raise_deferred(*, within_step: bool = False) -> None:
    """Raise the first stop deferred past a step, if any: on the main thread (the
    one the handlers ran on), and, unless ``within_step`` (a wait between its
    slices, where nothing is half done), only outside every step (a pipeline closed
    or failed from inside another step's work leaves the stop to that step's
    caller). Elsewhere do nothing."""
    if (DEFERRED and threading.current_thread() is threading.main_thread()
            and (within_step or not in_step(sys._getframe(1)))):
        stop = DEFERRED[0]
        DEFERRED.clear()
        raise stop


def raise_wait_stop() -> None:
    """In a wait for a batch, on the main thread: raise the first of ``WAIT_STOPS``,
    if any (and forget them all). Elsewhere do nothing."""
    if WAIT_STOPS and threading.current_thread() is threading.main_thread():
        stop = WAIT_STOPS[0]
        WAIT_STOPS.clear()
        raise stop


def interrupt_after_step(make: Callable[[int], KeyboardInterrupt]
                         ) -> Callable[[int, FrameType | None], None]:
    """A handler raising ``make(signum)`` where the signal lands, or, inside a
    ``step``, once the step is done (``DEFERRED``). The same signal again while it
    is deferred is raised at once: a step that never ends still stops. Another
    signal joins it (a terminal's Ctrl-C and a wrapper's SIGTERM often come
    together). Appended first: a signal that comes while this one walks the stack
    finds it."""
    def handler(signum: int, frame: FrameType | None) -> None:
        stop = make(signum)
        again = any(signum_of(taken) == signum for taken in DEFERRED)
        DEFERRED.append(stop)
        if again or not in_step(frame):
            DEFERRED.clear()
            raise stop
    return handler


@contextmanager
def sigterm_as_interrupt() -> Iterator[list[int]]:
    """A with-block in which SIGTERM (and SIGHUP) raises ``Interrupted(signum)``, a
    KeyboardInterrupt: the command line stops on it as on Ctrl-C. Both it and
    Ctrl-C (a plain KeyboardInterrupt, as Python's own handler raises) wait for the
    pipeline step the main thread is in (``step``). It yields the list of the
    signals other than SIGINT it took (a command that catches the interrupt itself
    and reports Ctrl-C's 130 still exits with SIGTERM's 143, SIGHUP's 129)."""
    taken: list[int] = []

    def make(signum: int) -> KeyboardInterrupt:
        if signum == signal.SIGINT:
            return KeyboardInterrupt()
        if signum == getattr(signal, "SIGHUP", None):
            silence_hung_up_output()  # what is printed after goes where it can
        taken.append(signum)
        return Interrupted(signum)

    try:
        with handling(stop_signals_taken(), interrupt_after_step(make)):
            yield taken
    finally:
        late, DEFERRED[:] = DEFERRED[:], []
    if late:  # a step's caller that never asked: raised here, never lost
        raise late[0]


def start_ignoring(process: Any, signums: tuple[int, ...] = (signal.SIGINT,)) -> None:
    """Start a spawned ``process`` that ignores ``signums`` from its first instruction;
    its body's first call is ``ignore(signums)``.

    A signal sent to the whole process group reaches a helper process too, and one
    still starting Python or importing torch would die of it with a traceback (or,
    as a demo rank's collector, leave its rank waiting for rows that never come). It
    starts with them blocked (``_held``: the calling thread's mask goes through exec),
    so one sent while it starts waits, and ``ignore`` drops it: a signal set to be
    ignored is discarded even while pending. A body that never calls it keeps them
    blocked, never delivered. This process loses none of them meanwhile: one that
    comes during ``start()`` acts once it returns, the process started and tracked
    (the parent ignored them for the length of ``start()`` before, and one sent then
    was lost). From a thread other than the main one it is the same, less the noting:
    the signals go to the other threads as ever.

    A process that ignores SIGTERM must be ended with SIGKILL by its owner when it
    does not leave: ``terminate`` does nothing to it, and multiprocessing's clean-up
    at exit terminates daemon children, then joins them without a timeout.
    """
    with _held(signums):
        process.start()


def join_started(thread: threading.Thread, timeout: float) -> None:
    """``thread.join(timeout)`` for a thread whose ``start()`` a Ctrl-C may have cut
    short. One the system never started (no ident yet) is not waited for: if it runs
    later, it finds its stop flag. One it did start sets its own started flag an
    instant later, and ``join`` raises until then; it is waited for."""
    deadline = time.monotonic() + timeout
    while thread.ident is not None:
        try:
            thread.join(max(0.0, deadline - time.monotonic()))
            return
        except RuntimeError:  # "cannot join thread before it is started": not yet
            if time.monotonic() >= deadline:
                return
            time.sleep(0.001)


def end_worker(worker: Any, join_s: float, *, hung: bool = False) -> None:
    """Join a helper told to stop, a thread or a process, within ``join_s`` seconds;
    a process still alive then is SIGKILLed (one started with
    ``start_ignoring(process, STOP_SIGNALS)`` does not answer ``terminate``, and
    multiprocessing's clean-up at exit would wait for it for ever), even when the
    join is interrupted. ``hung``: the process was found dead (no heartbeat, no rows:
    stopped, or stuck) and would not leave: SIGKILLed at once (a thread, which cannot
    be killed, is joined as usual). A process never started is left as it is."""
    import multiprocessing.process  # here: the protocol layer imports without it

    if not isinstance(worker, multiprocessing.process.BaseProcess):
        worker.join(timeout=join_s)
        return
    if worker.pid is None:
        return
    try:
        # In slices: a process stopped (SIGSTOP) meanwhile cannot leave, however long
        # it is waited for, and is SIGKILLed at once too.
        end = time.monotonic() + (0.0 if hung else join_s)
        while not stopped(worker.pid):
            worker.join(timeout=max(0.0, min(JOIN_SLICE_S, end - time.monotonic())))
            if worker.exitcode is not None or time.monotonic() >= end:
                break
    finally:
        if worker.is_alive():
            worker.kill()
            worker.join()


# How often end_worker looks whether the process it waits for was stopped.
JOIN_SLICE_S = 0.1


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal (SIGSTOP, SIGTSTP: state T in
    /proc; a debugger's stop, t, is not counted). False where that cannot be told
    (no /proc, the process gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] == b"T"


def ignore(signums: tuple[int, ...] = (signal.SIGINT,)) -> None:
    """In a helper process's body, first: the learner decides what a stop signal
    means (it closes the channels, and the helper's loop ends), so the helper ignores
    it and prints no traceback. Started by ``start_ignoring``, the process started
    with them blocked: one sent since is dropped here, not delivered, and they are
    unblocked."""
    for signum in signums:
        signal.signal(signum, signal.SIG_IGN)  # first: it discards one pending
    unblock_stop_signals(signums)
