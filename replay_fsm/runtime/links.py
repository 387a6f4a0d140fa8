"""Collector links: how the learner side reaches its packer, one kind per collector.

A link sends pack requests, receives pack-done messages, starts and stops the other
side, and answers the liveness question "is the other side alive, and if not,
why" (INV-LIVE). The pipeline asks it only while the learner waits on a REQUESTED
slot, so a collector that is merely slow to produce data (its packer still beats its
heartbeat) is never declared dead; an external collector, which beats only when it
calls ``Packer.service`` between its environment steps, is not asked about its
silence while the request waits for its rows (``beats_while_rows_come``).

- ``ThreadCollector``: a packer thread in this process;
- ``ProcessCollector``: a spawned packer-only process;
- ``ExternalCollector``: your collector process calls ``Packer.attach(handle, rb)``;
- the seed's request and ready queues: ``replay_fsm.compat.link.SeedQueueLink``.
"""

from __future__ import annotations

import abc
import multiprocessing as mp
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from ..data import owner
from ..data.buffer import ReplayBuffer
from ..data.channel import ChannelClosed
from ..data.packer import Packer, PackerHandle, process_alive, serve_forever
from ..errors import setting
from ..looks import LookClock
from ..signals import join_started, start_ignoring
from ..transfer.base import HostSlots
from ..wire import PackDone, PackRequest, decode, encode

WAIT_SLICE_S = 0.05
# How long an external collector found dead by its pid may take to be reaped, for its
# watched process's exit code: SIGKILLed with threads running, it shows as a zombie
# some milliseconds (10 to 40 here) before its last thread has exited.
REAP_WAIT_S = 1.0
Fail = Callable[[BaseException], None]

# Packer processes started here: an os.fork child inherits multiprocessing's set of
# this process's children, and at its exit multiprocessing would SIGTERM the daemon
# ones, this process's packers among them. The child forgets them.
_PACKERS: weakref.WeakSet[Any] = weakref.WeakSet()


def _forget_packers() -> None:
    for process in list(_PACKERS):
        mp.process._children.discard(process)  # type: ignore[attr-defined]


os.register_at_fork(after_in_child=_forget_packers)


@dataclass(frozen=True)
class Gone:
    """Why the other side cannot serve requests; ``cause`` is chained when known."""

    reason: str
    cause: BaseException | None = None


def _exited(process: Any, what: str) -> Gone:
    """A watched process that exited, in the one wording of every command."""
    if process.pid is None and process.exitcode is None:
        # A multiprocessing.Process watched and never started: it did not exit.
        return Gone(f"{what} was never started (no pid): call its start() before the "
                    f"learner waits for a batch")
    return Gone(f"{what} (pid {process.pid}) exited with code {process.exitcode}")


class CollectorLink(abc.ABC):
    """Base of every link. ``send`` and ``receive`` must be written; the rest defaults
    to a collector the pipeline neither starts nor stops."""

    kind: ClassVar[str] = "custom"
    # Whether the other side shows life while a request waits for its rows
    # (min_snapshot_ptr): a packer serving in a loop beats all along; an external
    # collector calls Packer.service between its environment steps, so its silence
    # counts only once the rows are there (``liveness``'s ``waiting``).
    beats_while_rows_come: ClassVar[bool] = True
    host_slots: HostSlots

    def __init__(self) -> None:
        self._watched: list[tuple[Any, str]] = []

    def start(self, fail: Fail) -> None:
        """Launch the other side, if the pipeline owns it. ``fail(exc)`` reports an
        exception on a thread of the link's own."""

    @abc.abstractmethod
    def send(self, request: PackRequest, *, snapshot: tuple[int, int],
             hot_slot: int) -> None:
        """Deliver ``request``; ``snapshot`` is the buffer's (ptr, size) now and
        ``hot_slot`` the slot the learner reads (-1: none), for seed-style collectors.

        Raises:
            ChannelClosed: the link is closed.
        """

    @abc.abstractmethod
    def receive(self, timeout: float) -> PackDone | None:
        """The next pack-done message, None after ``timeout``.

        Raises:
            ChannelClosed: the link was closed.
        """

    def take(self, request: PackRequest, timeout: float, *,
             give_up: Callable[[], None] | None = None) -> int | None:
        """Pack the part of ``request`` the collector has not reached on the calling
        (learner) thread; whoever packs its last part posts its pack-done message
        (this thread: to ``receive``, or to what ``deliver_here`` named).
        Returns how many parts (chunks) this call packed, 0 when none is left to
        take; None when it could not look now (the claim lock stayed taken for
        ``timeout`` seconds, or too many requests wait unread): ask again later.
        ``give_up`` is called while the take is held up: a part written cannot be
        counted (the collector holds the claim lock), or rows it gathers are being
        written by an add; what it raises ends the take. By default a link's
        collector cannot be relieved: 0.

        Raises:
            Exception: a part written could not be counted (``give_up``'s error, or
                a RuntimeError naming the lock's holder): the request can never
                complete, and the caller fails its run.
        """
        return 0

    def deliver_here(self, deliver: Callable[[PackDone], None]) -> None:
        """From now on, a request ``take`` packs to its end hands its pack-done message
        to ``deliver``, on the taking thread, instead of to ``receive``. By default
        a link's ``take`` packs nothing, and this does nothing."""

    def orphaned(self, slot: int) -> bool:
        """Whether the request in ``slot`` was read by a collector process gone since,
        so that only the learner can pack what is left of it (``Pipeline`` then takes
        it in any wait or poll for it, the oldest requested tick or a later one). By
        default no collector is replaced: False."""
        return False

    def watch(self, process: Any, what: str) -> None:
        """Report ``process`` (anything with ``is_alive()``, ``pid``, ``exitcode``)
        dead in ``liveness`` once it exits."""
        self._watched.append((process, what))

    def liveness(self, waiting: bool, timeout: float) -> Gone | None:
        """None while the other side can serve requests, else why not. ``waiting``:
        a request is outstanding (and, for a link that does not beat while rows come,
        owed its pack: its rows are there), so the other side's silence counts;
        ``timeout``: the pipeline's liveness bound."""
        for process, what in self._watched:
            if not process.is_alive():
                return _exited(process, what)
        return None

    def _watched_exit(self, pid: int) -> Gone | None:
        """The watched process ``pid``, found dead by its pid, named as ``liveness``
        names it once it is reaped (within ``REAP_WAIT_S``): in the window before,
        a killed collector was named another way ("is gone", no exit code). None: no
        watched process has that pid, or it was not reaped in time."""
        for process, what in self._watched:
            if process.pid == pid:
                deadline = time.monotonic() + REAP_WAIT_S
                while process.is_alive():
                    if time.monotonic() > deadline:
                        return None
                    time.sleep(0.001)
                return _exited(process, what)
        return None

    def stop(self, timeout: float) -> list[str]:
        """Close the link and stop what it started, within ``timeout`` seconds.
        Returns what had to be forced (empty when everything stopped on its own)."""
        return []


class ChannelLink(CollectorLink):
    """Shared-memory channels and host slots in a ``PackerHandle``; the packer
    beats a heartbeat into the handle at every ``service`` call and every chunk it
    writes."""

    def __init__(self, replay_buffer: ReplayBuffer, ring_depth: int, sample_count: int,
                 attach_timeout: float = 60.0, writer_patience: float | None = None
                 ) -> None:
        """``writer_patience``: how long a gather of the learner's own pack (``take``)
        waits at a stretch for rows an add is writing (the pipeline passes its
        liveness_timeout to the links it makes; None, as for a link you build: the
        packer's HOLD_PATIENCE_S)."""
        super().__init__()
        # Until a packer attaches, a request may wait at most this long from the first.
        self.attach_timeout = attach_timeout
        self._first_request_ns: int | None = None
        # The attach deadline's clock, its cap half of attach_timeout (the link's, half
        # of liveness_timeout, would let one stretch no look saw judge a shorter
        # attach_timeout on its own: helper-87).
        self._attach_looks = LookClock()
        self._handle: PackerHandle | None = PackerHandle.create(
            ring_depth, sample_count, replay_buffer.width,
            getattr(replay_buffer, "buffer_id", 0))
        self.host_slots = self._handle.host_slots
        self._ring_depth = ring_depth
        self._replay_buffer: ReplayBuffer | None = replay_buffer
        # The learner's own packs (``take``); it holds the handle too.
        self._learner_packer: Packer | None = Packer(self._handle, replay_buffer)
        if writer_patience is not None:
            self._learner_packer.writer_patience_s = writer_patience
        self._deliver: Callable[[PackDone], None] | None = None  # deliver_here's
        # Whether the learner packs what the packer has not reached (``take``); the
        # pipeline sets its learner_packs here.
        self.learner_packs = True
        # Per slot, its last request sent: (generation, tick, its number in the
        # request channel), to tell which requests a packer process that is gone read.
        self._sent: dict[int, tuple[int, int, int]] = {}
        # When liveness first found, at its looks in a row, a state that is a fault
        # only once it persists, and which one it found (``_held_s``): the key of the
        # state, and the looks' clock's ns.
        self._since: dict[str, tuple[object, int]] = {}
        # Every stretch a verdict here needs is measured on it: one that no look saw
        # counts for at most half the bound (``looks.LookClock``).
        self._looks = LookClock()

    @property
    def handle(self) -> PackerHandle:
        """The channels, host slots and heartbeat cell the packer attaches to.

        Raises:
            ChannelClosed: the link was stopped (its channels are gone).
        """
        if self._handle is None:
            raise ChannelClosed()
        return self._handle

    def send(self, request: PackRequest, *, snapshot: tuple[int, int],
             hot_slot: int) -> None:
        if self._first_request_ns is None:
            self._first_request_ns = time.monotonic_ns()
        # The ring has ring_depth places and at most ring_depth requests are pending:
        # a full channel means the packer stopped taking requests.
        handle = self._handle  # ``handle``'s, without the property's call (per tick)
        if handle is None:
            raise ChannelClosed()
        requests = handle.requests
        number = requests.sent  # the learner is the channel's one producer
        # Recorded before the put: its pack-done message may be received (the worker's
        # thread forgets it then) before this thread runs again after the put.
        self._sent[request.slot] = (request.generation, request.tick, number)
        try:
            put = requests.put(encode(request)[0], timeout=10.0)
        except BaseException:
            self._sent.pop(request.slot, None)  # not sent
            raise
        if not put:
            self._sent.pop(request.slot, None)
            lost = requests.lost_spaces
            if lost:
                # No put of the learner's is under way, and a live get holds a place
                # so for microseconds: places missing after 10 s full are lost.
                raise RuntimeError(
                    f"request channel stayed full for 10 s: {lost} of its "
                    f"{requests.capacity} places were lost by collector processes "
                    "killed (or stopped) inside their get, between counting a "
                    "request read and freeing its place, and not given back by a "
                    "restart (which gives them back only under a 64-bit x86 Python, "
                    "where every collector process attached before it is surely "
                    "gone)")
            raise RuntimeError("request channel stayed full for 10 s; the packer is stuck")

    def receive(self, timeout: float) -> PackDone | None:
        got = self.handle.done.get(timeout=timeout)
        if got is None:
            return None
        done = decode(PackDone, *got)
        self._received(done)
        return done

    def _received(self, done: PackDone) -> None:
        """``done``'s request is answered: it is no longer one to look after. (The
        slot is requested again only once this message has been handled, after.)"""
        sent = self._sent.get(done.slot)
        if sent is not None and sent[0] == done.generation:
            del self._sent[done.slot]

    def deliver_here(self, deliver: Callable[[PackDone], None]) -> None:
        self._deliver = deliver

    def take(self, request: PackRequest, timeout: float, *,
             give_up: Callable[[], None] | None = None) -> int | None:
        packer = self._learner_packer
        if packer is None:
            return 0
        # A request taken here stays in the request channel until the packer drops
        # it. Taking only while at most ring_depth requests wait there keeps those at
        # most ring_depth, so the channel (2 * ring_depth) always has room for the
        # live ones: a paused packer makes the learner wait, never overflow.
        if packer.handle.requests.backlog > self._ring_depth:
            return None
        deliver = self._deliver
        if deliver is not None:
            def deliver_received(done: PackDone, deliver: Callable[[PackDone], None]
                                 = deliver) -> None:
                self._received(done)
                deliver(done)
            deliver = deliver_received
        try:
            return packer.take(request, timeout, give_up, deliver)
        except ChannelClosed:
            return 0  # closed meanwhile: the pipeline raises PipelineClosed

    def liveness(self, waiting: bool, timeout: float) -> Gone | None:
        self._looks.look(timeout / 2)  # the stretches below count from here on
        gone = self._verdict(waiting, timeout)
        return None if gone is None else self._adds_failing(gone)

    def _verdict(self, waiting: bool, timeout: float) -> Gone | None:
        """Why the other side cannot serve requests (arguments as ``liveness``'s);
        None while it can. Here a watched process's exit; each kind of collector
        extends it, its checks in the order their verdicts come first, and
        ``liveness`` adds to any verdict what the replay buffer says of every add."""
        return super().liveness(waiting, timeout)

    def _adds_failing(self, gone: Gone) -> Gone:
        """``gone`` (any verdict), saying so when every add to the replay buffer
        raises ``WriterDied`` (a process died inside an add, holding its write lock),
        with that error as its cause: a collector that exits on it (one restarted
        after the process killed inside that add) says why only on its own standard
        error, and the learner said "is gone" and no more."""
        rb = self._replay_buffer
        died = None if rb is None else rb.dead_writer()
        if died is None:
            return gone
        return Gone(f"{gone.reason}, and every add to the replay buffer raises "
                    f"WriterDied: {died}", gone.cause or died)

    def _silence(self, who: str, waiting: bool, timeout: float,
                 why: str = "alive but not serving: hung inside a pack?") -> Gone | None:
        if self._handle is None:
            return None
        done = self._handle.done
        if done.unreleased:
            # A record counted and its item not released: a packer stopped (SIGSTOP)
            # or hung inside its put left it, and no get takes it (helper-79); its
            # silence counts then. But a live put, and the transfer worker's get
            # between its acquire and its count, show it for microseconds (a few ms
            # under the GIL): only once it has persisted for the timeout (helper-82),
            # at one position of the channel (helper-83: one seen at the last look of
            # a wait counted for another, of a later record, seen by a later wait).
            if self._held_s("unreleased", done.position) <= timeout:
                return None
        else:
            self._since.pop("unreleased", None)
            if done.backlog:
                # A pack-done message waits for the transfer worker (busy in a
                # submit): the packer served its requests and owes nothing; its
                # silence is no sign.
                return None
        beat = self._handle.heartbeat_ns
        if beat:
            # From the beat, as the looks saw time pass: a beat long before the first
            # look that finds it counts from half the bound before that look (the whole
            # job stopped and resumed: the packer had no time to beat yet). Every look
            # counts, not only those that judge it (``waiting``): an external
            # collector's looks before its rows were owed saw its silence too.
            silent = self._held_s("beat", beat, since_ns=beat)
            if waiting and silent > timeout:
                return Gone(f"no heartbeat from {who} for {silent:.1f} s ({why})")
        return None

    def _held_s(self, what: str, state: object, since_ns: int | None = None,
                looks: LookClock | None = None, cap_s: float | None = None) -> float:
        """Seconds, on the looks' clock (``looks``, its cap from now on ``cap_s``; by
        default the link's, which ``liveness`` advances), since liveness first found
        ``what`` so, in ``state``, at its looks in a row (the first records now, or
        ``since_ns``, a monotonic instant the state is known to date from;
        ``self._since.pop(what)`` when a look finds it no more). A look that finds it
        in another ``state`` starts afresh: looks are not close in time (the next wait
        may come long after the last), and a stretch the learner saw begin, and whose
        end no look saw, must not count for a fresh one found later (a transient put
        or get of a later record: helper-83)."""
        looks = self._looks if looks is None else looks
        now = looks.look(cap_s)
        seen = self._since.get(what)
        if seen is None or seen[0] != state:
            start = now if since_ns is None else looks.at(since_ns)
            seen = self._since[what] = (state, start)
        return (now - seen[1]) / 1e9

    def _attach_overdue(self) -> float | None:
        """Seconds since the first request, once past ``attach_timeout`` with no packer
        attached (heartbeats count only from its attach); else None."""
        since = self._first_request_ns
        if since is None or self._handle is None or self._handle.packer_pid:
            return None
        waited = self._held_s("attach", since, since_ns=since, looks=self._attach_looks,
                              cap_s=self.attach_timeout / 2)
        return waited if waited > self.attach_timeout else None

    def stop(self, timeout: float) -> list[str]:
        if self._handle is not None:
            self._handle.close()
            # Our last references: the channels' semaphores are freed with them.
            self._handle = self._learner_packer = self._replay_buffer = None
        return []


class ThreadCollector(ChannelLink):
    """A packer thread in the learner's process (``collector="thread"``)."""

    kind = "thread"

    def __init__(self, replay_buffer: ReplayBuffer, ring_depth: int, sample_count: int,
                 *, writer_patience: float | None = None) -> None:
        super().__init__(replay_buffer, ring_depth, sample_count,
                         writer_patience=writer_patience)
        self._packer: Packer | None = Packer.attach(self.handle, replay_buffer)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, fail: Fail) -> None:
        packer = self._packer
        assert packer is not None

        def serve() -> None:
            try:
                while not packer.closed:
                    packer.service(timeout=WAIT_SLICE_S)
            except BaseException as exc:  # noqa: BLE001 - reported to the learner
                self._error = exc
                fail(exc)

        self._thread = threading.Thread(target=serve, name="replay_fsm-packer", daemon=True)
        self._thread.start()

    def _verdict(self, waiting: bool, timeout: float) -> Gone | None:
        if self._thread is not None and not self._thread.is_alive():
            return Gone("the packer thread exited", self._error)
        return super()._verdict(waiting, timeout) or self._silence(
            "the packer thread", waiting, timeout)

    def stop(self, timeout: float) -> list[str]:
        super().stop(timeout)
        self._packer = None
        if self._thread is not None:
            join_started(self._thread, timeout)
            if self._thread.is_alive():
                return [f"the packer thread did not stop within {timeout:.0f} s (hung "
                        "inside a pack); it is a daemon thread and is left behind"]
        return []


class ProcessCollector(ChannelLink):
    """A spawned packer-only process (``collector="process"``)."""

    kind = "process"

    def __init__(self, replay_buffer: ReplayBuffer, ring_depth: int, sample_count: int,
                 threads: int | None = None, attach_timeout: float = 60.0, *,
                 writer_patience: float | None = None) -> None:
        super().__init__(replay_buffer, ring_depth, sample_count, attach_timeout,
                         writer_patience)
        self.process: Any = mp.get_context("spawn").Process(
            target=serve_forever, args=(self.handle, replay_buffer, WAIT_SLICE_S, threads),
            name="replay_fsm-packer", daemon=True)

    def start(self, fail: Fail) -> None:
        _PACKERS.add(self.process)  # first: a Ctrl-C start_ignoring raises comes after
        start_ignoring(self.process)  # the learner decides what Ctrl-C means

    def _verdict(self, waiting: bool, timeout: float) -> Gone | None:
        proc = self.process
        if not proc.is_alive():
            return Gone(f"the packer process (pid {proc.pid}) exited with code "
                        f"{proc.exitcode}")
        gone = super()._verdict(waiting, timeout) or self._silence(
            f"the packer process (pid {proc.pid})", waiting, timeout)
        if gone is None and self._handle is not None and not self._handle.done.backlog:
            waited = self._attach_overdue()
            if waited is not None:  # alive, never started serving: it never beats
                gone = Gone(f"the packer process (pid {proc.pid}) has not attached "
                            f"within {self.attach_timeout:g} s of the first request "
                            f"(attach_timeout; {waited:.1f} s): stopped, or blocked "
                            "while starting (in code of __main__ it re-imports?)")
        return gone

    def stop(self, timeout: float) -> list[str]:
        proc, forced = self.process, []
        handle = self._handle
        if handle is not None:
            handle.close()  # an attached packer sees it and exits on its own
        if proc is not None and proc.pid is not None:  # started, not stopped before
            if handle is not None and not handle.packer_pid:
                # Not attached yet (still starting Python, importing torch): it has
                # nothing to finish, and waiting for its start would only delay close.
                proc.terminate()
            proc.join(timeout * 0.6)
            for step in ("terminate", "kill"):
                if not proc.is_alive():
                    break
                forced.append(f"{step} the packer process (pid {proc.pid})")
                getattr(proc, step)()
                proc.join(timeout * 0.2)
        # Our references go only now, the channels' semaphores with them: a child that
        # is still unpickling its handle opens them by name.
        super().stop(timeout)
        # The process object keeps its arguments (the handle): let them go.
        self.process = None
        return forced


class ExternalCollector(ChannelLink):
    """Your collector process attaches with ``Packer.attach(handle, rb)``
    (``collector="external"``). Until it attaches, a request may wait at most
    ``attach_timeout`` seconds from the first request."""

    kind = "external"
    beats_while_rows_come = False

    def __init__(self, replay_buffer: ReplayBuffer, ring_depth: int, sample_count: int,
                 attach_timeout: float, *, writer_patience: float | None = None) -> None:
        super().__init__(replay_buffer, ring_depth, sample_count, attach_timeout,
                         writer_patience)
        self._unattached: PackerHandle | None = None  # kept by stop (see there)
        # ``_since`` holds here too the claim lock taken after a collector process
        # attached in place of a dead one ("claim lock").
        # (slot, generation) of requests read by a dead process, written whole, their
        # pack-done message not received: when liveness first found each so.
        self._lost_since: dict[tuple[int, int], int] = {}

    def _verdict(self, waiting: bool, timeout: float) -> Gone | None:
        gone = super()._verdict(waiting, timeout)
        if gone is not None:
            return gone
        if self._handle is None:
            return None
        pid, done = self._handle.packer_pid, self._handle.done
        # A collector killed inside its put of a pack-done message (counted, its item
        # not released) leaves a backlog no get takes (helper-74): that is no message
        # waiting for the worker. A real one (its item released) is, even from a
        # collector that exited since (it served its last request and left).
        unreleased = done.unreleased
        if pid and pid != os.getpid() and not self._attached_lives(pid) and (
                unreleased is None or unreleased or not done.backlog):
            return self._watched_exit(pid) or Gone(
                f"the collector process (pid {pid}) is gone")
        if unreleased:
            # A live collector inside its put shows this for microseconds; a process
            # attached before it, killed inside its put, for good (at one position
            # once no later message comes: each later put carries the record before
            # it through, one behind, and moves the position).
            held = self._held_s("unreleased", done.position)
            if held > timeout:
                return Gone(
                    f"a pack-done message has been counted in the done channel and not "
                    f"posted for {held:.1f} s: the process putting it died (or stopped) "
                    f"inside its put (the collector attached now is pid {pid}"
                    + (f", the one before it pid {before}" if (
                        before := self._handle.predecessor[1]) else "")
                    + "), and every later message would wait one behind")
            return None
        self._since.pop("unreleased", None)
        if done.backlog:
            return None  # a pack-done message (the learner's own?) waits for the worker
        if not pid:
            # Never attached: not silence, absence (rows still missing or not).
            if self._attach_overdue() is not None:
                return Gone(f"no collector called Packer.attach(pipe.packer_handle(), "
                            f"rb) within {self.attach_timeout:g} s of the first "
                            "request")
            return None
        return self._untakable(pid, waiting, timeout) or self._stranded(
            pid, timeout) or self._silence(
            f"the collector (pid {pid})", waiting, timeout,
            "alive but no packer.service() call: an environment step longer than "
            f"{setting('liveness_timeout')}, or hung in a step or a pack?")

    def _attached_lives(self, pid: int) -> bool:
        """Whether the attached collector, ``pid``, still runs: a live process has
        that pid, and it is the one that attached (its start time, in the record
        its attach wrote): a pid is reused, and a collector that died may have left
        its pid to another process, which was taken for it (the learner then waited
        for rows only the dead one made, until stall_timeout)."""
        handle = self._handle
        assert handle is not None
        return process_alive(pid) and owner.lives(handle.packer_record) is not False

    def orphaned(self, slot: int) -> bool:
        """Whether the last request sent to ``slot`` was read off the channel by a
        collector process gone since: the collector attached now never sees it, so
        only the learner can pack what is left of it (``Pipeline`` takes it in any
        wait or poll for it, not only in an untimed wait, and not only as the oldest
        requested tick)."""
        handle, sent = self._handle, self._sent.get(slot)
        if handle is None or sent is None:
            return False
        read_before = handle.predecessor[0]
        return sent[2] < read_before

    def _untakable(self, pid: int, waiting: bool, timeout: float) -> Gone | None:
        """Gone when the request channel's newest record can never be taken: a
        collector process killed inside its get, between taking a record's item and
        counting the record taken, left the channel one item short for good. The
        collector attached after it gives the item back (``Packer.attach``, or a
        ``service`` call of it once a send under way at the attach has ended), but not
        where it could not judge that process dead (another pid namespace): it then
        reads that record with the next item, and every later one with the item of
        the one after it, so the newest waits until the learner sends another; a
        learner waiting for that one with nothing more to send waited for ever while
        the collector beat. Judged as a half-posted
        pack-done message is: only once the shortfall has stayed, at one position of
        the channel, for ``timeout`` (a live get shows it for a moment), and only
        while the collector owes the request (``waiting``): while requests flow the
        run goes on, one behind."""
        handle = self._handle
        assert handle is not None
        requests = handle.requests
        if not requests.unreleased:
            self._since.pop("untakable", None)
            return None
        held = self._held_s("untakable", requests.position)
        if not waiting or held <= timeout:
            return None
        before = handle.predecessor[1]
        return Gone(
            f"the request channel has held a request no get can take for {held:.1f} s: "
            f"the collector process that took its item died (or stopped) inside its get, "
            f"before it counted the request taken (the collector attached now is pid "
            f"{pid}" + (f", the one before it pid {before}" if before else "") + "), "
            "and every later request would wait one behind")

    def _stranded(self, pid: int, timeout: float) -> Gone | None:
        """Gone when a request that a collector process, gone since, read off the
        channel can never complete: the collector attached now (``pid``) never sees
        it, and the learner would wait for it while the new one beats. Gone too when
        the claim lock has stayed taken for ``timeout`` seconds since such a process
        died: it died holding it (a SIGKILL inside a claim, an advance or its own
        attach), and no chunk is ever claimed again, while the new one beats."""
        handle = self._handle
        assert handle is not None
        read_before, predecessor = handle.predecessor
        if not predecessor:
            return None
        if handle.claim_lock.acquire(timeout=0.01):
            handle.claim_lock.release()
            self._since.pop("claim lock", None)
        else:
            # Keyed by the claim cells and the requests read: a holder stopped or dead
            # inside its claim moves neither; a live collector's next claim is another.
            held = self._held_s("claim lock", (handle.claims.numpy().tobytes(),
                                               handle.requests.taken))
            if held > timeout:
                return Gone(
                    f"the claim lock has stayed taken for {held:.1f} s since a collector "
                    f"process attached before pid {pid} died (the last one was pid "
                    f"{predecessor}): it died holding it, or pid {pid} is stopped or hung "
                    "inside a claim, and no request can be packed meanwhile")
            return None
        if not read_before:
            return None
        now, lost = self._looks.look(), {}
        for slot, (generation, tick, number) in list(self._sent.items()):
            if number >= read_before:
                continue
            if handle.finished(slot, generation):
                # Written whole or failed, and its pack-done message not received (it
                # is forgotten then): the dead process counted the last chunk, or
                # failed, and died before it posted the message (a posted one is
                # received within a slice, or waits in the channel, and liveness is
                # not asked then; a failure of the learner's own fails the run).
                since = lost[(slot, generation)] = self._lost_since.get(
                    (slot, generation), now)
                if (now - since) / 1e9 > timeout:
                    return Gone(
                        f"tick {tick}'s request was written whole or failed, and its "
                        f"pack-done message has not come for {(now - since) / 1e9:.1f} s: the "
                        f"collector process that wrote its last chunk, attached before "
                        f"pid {pid} and gone since (the last one was pid {predecessor}), "
                        "died before it posted it")
                continue
            if handle.stranded(slot, generation, self.learner_packs, 0.01):
                return Gone(
                    f"tick {tick}'s request was read by a collector process attached "
                    f"before pid {pid}, and gone since (the last one was pid "
                    f"{predecessor}): what it left undone of it nobody does (a restarted "
                    "collector does not take over what its predecessor had taken)")
        self._lost_since = lost
        return None

    def stop(self, timeout: float) -> list[str]:
        handle = self._handle
        if (handle is not None and not handle.packer_pid
                and any(process.is_alive() for process, _ in self._watched)):
            # No collector attached yet, and a watched one still runs: still starting,
            # it opens the channels' semaphores by name when it unpickles the handle,
            # so they stay as long as this link does; it then attaches, finds the
            # channels closed and leaves. With nothing watched alive they go now.
            self._unattached = handle
        return super().stop(timeout)


def make_link(kind: str, replay_buffer: ReplayBuffer, ring_depth: int, sample_count: int,
              *, packer_threads: int | None, attach_timeout: float,
              writer_patience: float | None = None) -> CollectorLink:
    """The link for a collector kind: "thread", "process" or "external";
    ``writer_patience`` as ``ChannelLink``'s.

    Raises:
        ValueError: an unknown kind.
    """
    if kind == "thread":
        return ThreadCollector(replay_buffer, ring_depth, sample_count,
                               writer_patience=writer_patience)
    if kind == "process":
        return ProcessCollector(replay_buffer, ring_depth, sample_count, packer_threads,
                                attach_timeout, writer_patience=writer_patience)
    if kind == "external":
        return ExternalCollector(replay_buffer, ring_depth, sample_count, attach_timeout,
                                 writer_patience=writer_patience)
    raise ValueError(f"unknown collector {kind!r}; supported: thread, process, external, "
                     "or a CollectorLink instance")
