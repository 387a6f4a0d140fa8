"""INV-ROW by construction: the seqlock's writer and reader, stepped in every order.

The writer (``add_packed``) and the reader (``gather``) each run in a thread of their
own that stops after every step of the seqlock: ``SteppedBuffer`` hooks the step
methods of ``ReplayBuffer`` (mark a region range odd, copy rows in, mark it even; read
the sequence numbers, copy rows out, compare, and in the retry loop read sequence
numbers, rows and sequence numbers again). The writer's row copy and the reader's
copies are split in two column halves with a stop between them, so a half-written row
and a half-read row are both states a schedule can reach. Exactly one thread runs at a
time and the test picks which: ``every_interleaving`` runs every order of the steps of
one add and one gather, each from scratch (stateless model checking), so an ordering
bug fails on every run instead of on a lucky race. Two reductions keep it small, and
neither skips a reachable state: the writer does the same thing whatever the reader
does, and the reader's next move depends only on what it has read, so the state after
a step is (writer steps taken, reader's reads so far) and a schedule that reaches a
state already explored stops there; and after a retry round found a region still
being written, the reader yields (``time.sleep(0)`` in production) and the writer
moves first, since another round before that would read the same values again. A
lapped round (the add wrote a region whole and again while a round read it: one add
of two pieces sharing a region does) makes each later round ask the adds to yield
first, a stop of its own; the one add, begun already, goes on (an add looks for an
ask before it takes the lock: the tests after ``test_the_harness_fails_...``).

Each run checks that the gather returned whole rows (each the row before or after the
add), that the buffer ends as a numpy model of the ring says, and that the gather
read again exactly the rows whose regions the add touched between the reader's two
reads of the sequence numbers, round after round, and no other row.

Mutants of replay_fsm/data/buffer.py tried by hand, and what kills each. ``every``
is ``test_every_interleaving_is_torn_row_free``, failing in every scenario unless one is
named; ``marks`` is ``test_regions_marked_while_copying`` and ``..._for_any_write``.

1. skip the first increment (``_begin_region_write`` does nothing): the region is left
   odd, the reader never finishes (``every``: the step bound); ``marks``.
2. skip the second increment (``_end_region_write`` does nothing): the same.
3. read the sequence numbers after the copy instead of before: ``every``, a torn row.
4. treat an odd sequence number as stable (no parity test in ``_changed_since`` nor
   in the retry loop): ``every``, rows of a region being written never read again.
5. mark one region too few (``r1 = (stop - 1) // region_rows``): ``every``, a torn
   row or rows never read again; ``marks``.
6. mark one region too many (``+ 2`` instead of ``+ 1``), or start one early
   (``r0 - 1``): ``every``, rows read again that no add touched; ``marks``.
7. never retry (return ``out`` whatever ``_changed_since`` says): ``every``, rows never
   read again; ``test_the_harness_fails_a_broken_seqlock``, a torn row.
8. accept a retried row whose first sequence number is even without comparing it
   with the second: only ``every`` for ``wider than the ring``, where one add writes
   region 1 twice: rows accepted while that region was rewritten. Dropping the second
   read altogether: ``every``, a round that does not read the numbers twice.
9. in the retry loop, read the rows before the sequence numbers: ``every``, a torn row.
10. retry every row of the batch instead of those of changed regions: ``every``, rows
    read again that no add touched.
11. end the region write (even again) before copying the rows: ``every``, a torn row;
    ``marks``.
12. update ptr and size before writing the rows (in ``_append``): ``marks`` (the
    counters must still describe the old rows while rows are copied).
13. test bit 1 instead of bit 0 for "a region is being written" in
    ``_changed_since``'s fast path: ``every`` for ``into an empty buffer`` only, where
    every sequence number is 0 or 1 (found by mutmut: a buffer written before has
    counts of 2 and 3, which hid it).
14. never ask the adds to yield (a lapped round asks nothing):
    ``test_a_gather_lapped_by_adds_of_the_whole_ring_has_them_yield_for_a_round``
    (641 laps, never ending) and ``every`` for ``wider than the ring`` (no run asked).
15. ask in a thread holding the lock (its pause):
    ``test_a_gather_inside_its_threads_pause_never_asks_the_adds_to_yield``.
16. an add that ignores the ask (no ``_yield_to_lapped_gather``):
    ``test_an_add_waits_while_another_threads_lapped_gather_asks``.
17. an add that waits for its own thread's ask, or for a stamp however old or in the
    future: ``test_an_add_never_waits_for_its_own_ask_nor_an_old_or_future_one``.
18. an add that waits as long as asks come (no deadline of its own):
    ``test_an_add_waits_lapped_hold_s_at_most_while_a_reader_asks_again_and_again``.
19. ``_stop_asking`` that clears nothing: the ask left after
    ``test_a_gather_lapped_by_...`` and in ``every`` for ``wider than the ring``.
20. ``_stop_asking`` that clears another reader's ask too:
    ``test_a_gather_that_stops_asking_leaves_another_readers_ask_standing``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from replay_fsm.data import buffer
from replay_fsm.data.buffer import GatherScratch, ReplayBuffer

from .collectors import Lapping, constant_rows
from .support import MARGIN_S, finishes_within

STEP_TIMEOUT = 10.0  # a bound on each wait for a thread, not a timing assumption
MAX_STEPS = 120  # far above any correct run (about 30 steps); a spinning reader hits it


class Abandoned(BaseException):
    """Raised at a stop of an actor whose run the test gave up; unwinds its thread."""


class Actor:
    """A thread that runs ``body`` one step at a time: it stops at every ``arrive``
    until the test calls ``step``; the stops are appended to ``trace`` in order."""

    def __init__(self, name: str, body: Callable[[], object], trace: list[tuple[str, str]],
                 local: threading.local) -> None:
        self.name, self.trace, self.local = name, trace, local
        self.point = "start"
        self.done = False
        self.error: BaseException | None = None
        self._abandoned = False
        # Locks used as binary semaphores (the two sides strictly alternate): a
        # handoff through them costs a fraction of a threading.Semaphore's.
        self._go, self._arrived = threading.Lock(), threading.Lock()
        self._go.acquire()
        self._arrived.acquire()
        self._thread = threading.Thread(target=self._run, args=(body,), daemon=True)
        self._thread.start()
        self._wait()

    def _run(self, body: Callable[[], object]) -> None:
        self.local.actor = self
        try:
            self.arrive("start")
            body()
        except Abandoned:
            pass
        except BaseException as exc:  # reported by the test's thread
            self.error = exc
        finally:
            self.done, self.point = True, "done"
            self._arrived.release()

    def arrive(self, point: str) -> None:
        """In the actor's thread: stop at ``point`` until the next ``step``."""
        if point != "start":
            self.trace.append((self.name, point))
        self.point = point
        self._arrived.release()
        if not self._go.acquire(timeout=STEP_TIMEOUT) or self._abandoned:
            raise Abandoned()

    def _wait(self) -> None:
        assert self._arrived.acquire(timeout=STEP_TIMEOUT), f"{self.name} is stuck"

    def step(self) -> None:
        """In the test's thread: let the actor run to its next stop (or its end)."""
        self._go.release()
        self._wait()

    def abandon(self) -> None:
        if not self.done:
            self._abandoned = True
            self._go.release()
        self._thread.join(STEP_TIMEOUT)
        assert not self._thread.is_alive(), f"{self.name} did not stop"


class SteppedBuffer(ReplayBuffer):
    """A ReplayBuffer whose seqlock steps stop the calling actor's thread; calls from
    a thread that is no actor (the test's set-up) run straight through. ``reads``
    logs every value the reader read, in order: its state."""

    local: threading.local
    rows_read: list[list[int]]
    reads: list[tuple[str, bytes | None]]
    asks: int  # the lapped rounds' asks that the adds yield

    def _stop(self, point: str, read: torch.Tensor | None = None) -> None:
        actor = getattr(self.local, "actor", None)
        if actor is not None:
            if actor.name == "r":
                self.reads.append((point, None if read is None else
                                   read.contiguous().numpy().tobytes()))
            actor.arrive(point)

    # writer
    def _begin_region_write(self, r0: int, r1: int) -> None:
        super()._begin_region_write(r0, r1)
        self._stop("mark")

    def _copy_in(self, start: int, rows: torch.Tensor) -> None:
        half = self.width // 2
        self.storage[start:start + rows.shape[0], :half] = rows[:, :half]
        self._stop("half-written")
        super()._copy_in(start, rows)
        self._stop("written")

    def _end_region_write(self, r0: int, r1: int) -> None:
        super()._end_region_write(r0, r1)
        self._stop("unmark")

    # reader
    def _seq_snapshot(self, scratch: GatherScratch) -> torch.Tensor:
        before = super()._seq_snapshot(scratch)
        self._stop("snapshot", before)
        return before

    def _copy_out(self, indices: torch.Tensor, out: torch.Tensor) -> None:
        half = self.width // 2
        out[:, :half] = self.storage[indices, :half]
        self._stop("half-read", out[:, :half])
        out[:, half:] = self.storage[indices, half:]
        self._stop("read", out[:, half:])

    def _changed_since(self, before: torch.Tensor, scratch: GatherScratch
                       ) -> torch.Tensor | None:
        changed = super()._changed_since(before, scratch)
        self._stop("compare", changed)
        return changed

    def _seq_at(self, regions: torch.Tensor) -> torch.Tensor:
        seq = super()._seq_at(regions)
        self._stop("seq", seq)
        return seq

    def _ask_adds_to_yield(self) -> None:
        super()._ask_adds_to_yield()
        self.asks += 1
        self._stop("ask")

    def _rows_at(self, rows: torch.Tensor) -> torch.Tensor:
        self.rows_read.append(rows.tolist())
        half = self.width // 2
        data = torch.empty(rows.shape[0], self.width)
        data[:, :half] = self.storage[rows, :half]
        self._stop("half-reread", data[:, :half])
        data[:, half:] = self.storage[rows, half:]
        self._stop("reread", data[:, half:])
        return data

    def _yield_to_writer(self) -> None:
        self._stop("yield")


@dataclass(frozen=True)
class Scenario:
    """One add of ``count`` rows into a buffer whose ring is at ``start``, after
    ``laps`` whole rounds of the ring, while one gather reads ``indices``; capacity 16
    in regions of 4 rows. Into an empty buffer every sequence number is 0 or 1 (bit 1
    clear in all of them, unlike a buffer written before)."""

    name: str
    start: int
    count: int
    capacity: int = 16
    region_rows: int = 4
    laps: int = 1
    indices: tuple[int, ...] = (15, 0, 5, 9, 4, 3, 8, 12, 1, 7, 10, 2, 6, 11, 13, 14, 5)

    def pieces(self) -> list[list[int]]:
        """Positions the add writes, one list per contiguous write, in write order."""
        keep = min(self.count, self.capacity)
        first = (self.start + self.count - keep) % self.capacity
        positions = [(first + k) % self.capacity for k in range(keep)]
        cut = next((k for k in range(1, keep) if positions[k] == 0), keep)
        return [p for p in (positions[:cut], positions[cut:]) if p]


SCENARIOS = [
    Scenario("inside one region", start=5, count=2),
    Scenario("one whole region", start=4, count=4),
    Scenario("across a region boundary", start=6, count=4),
    Scenario("up to the end of the ring", start=12, count=4),
    Scenario("around the end of the ring", start=14, count=4),
    Scenario("wider than the ring", start=0, count=22),
    Scenario("into an empty buffer", start=0, count=6, laps=0),
]
OLD_ID, NEW_ID = 1000.0, 2000.0


@dataclass
class Run:
    schedule: list[str]
    decisions: list[tuple[int, str]]  # (step, the actor not chosen there)
    complete: bool  # False: stopped at a state explored before
    trace: list[tuple[str, str]]
    out: torch.Tensor
    rb: SteppedBuffer
    old: torch.Tensor
    writer_error: BaseException | None = None
    reader_error: BaseException | None = None
    rows_read: list[list[int]] = field(default_factory=list)
    asks: int = 0


def run_schedule(sc: Scenario, prefix: Sequence[str], cls: type[SteppedBuffer],
                 explored: set[object]) -> Run:
    """Run ``sc`` following ``prefix`` (actor names, one per step), then the writer
    first wherever both can move, recording the other choice at each such step; stop
    past the prefix at a state in ``explored``, and add the states reached to it."""
    rb = cls(sc.capacity, 1, 1, region_rows=sc.region_rows)
    rb.local, rb.rows_read, rb.reads, rb.asks = threading.local(), [], [], 0
    filled = sc.laps * sc.capacity + sc.start
    if filled:
        rb.add_packed(constant_rows(rb, int(OLD_ID) - filled + 1, filled))
    old = rb.storage.clone()
    indices = torch.tensor(sc.indices)
    out = torch.full((len(sc.indices), rb.width), -1.0)
    trace: list[tuple[str, str]] = []
    actors = {
        "w": Actor("w", lambda: rb.add_packed(constant_rows(rb, int(NEW_ID), sc.count)),
                   trace, rb.local),
        "r": Actor("r", lambda: rb.gather(indices, out), trace, rb.local),
    }
    schedule: list[str] = []
    decisions: list[tuple[int, str]] = []
    complete = True
    try:
        while not all(a.done for a in actors.values()):
            enabled = [n for n, a in actors.items() if not a.done]
            if actors["r"].point == "yield" and not actors["w"].done:
                enabled = ["w"]  # sleep(0): the writer moves before the next round
            name = prefix[len(schedule)] if len(schedule) < len(prefix) else enabled[0]
            assert name in enabled, (prefix, schedule)
            if len(enabled) == 2 and name == enabled[0]:
                decisions.append((len(schedule), enabled[1]))
            schedule.append(name)
            actors[name].step()
            assert len(schedule) <= MAX_STEPS, (
                f"{sc.name}: no end after {MAX_STEPS} steps (the reader spins); "
                f"trace {trace[-12:]}")
            state = (schedule.count("w"), actors["r"].done, tuple(rb.reads))
            if state in explored and len(schedule) >= len(prefix):
                complete = False
                break
            explored.add(state)
    finally:
        for actor in actors.values():
            actor.abandon()
    return Run(schedule, decisions, complete, trace, out, rb, old, actors["w"].error,
               actors["r"].error, rb.rows_read, rb.asks)


def every_interleaving(sc: Scenario,
                       cls: type[SteppedBuffer] = SteppedBuffer) -> Iterator[Run]:
    """Every schedule of ``sc`` up to the first state explored before, depth first;
    each run from a fresh buffer. Yields the runs that reached their end."""
    pending: list[list[str]] = [[]]
    explored: set[object] = set()
    while pending:
        prefix = pending.pop()
        run = run_schedule(sc, prefix, cls, explored)
        pending += [run.schedule[:step] + [other] for step, other in run.decisions
                    if step >= len(prefix)]
        if run.complete:
            yield run


def _nth(trace: list[tuple[str, str]], actor: str, point: str) -> list[int]:
    return [i for i, event in enumerate(trace) if event == (actor, point)]


def regions_written_between(sc: Scenario, trace: list[tuple[str, str]], lo: int,
                            hi: int) -> set[int]:
    """Regions that the add marked odd at any time between trace events lo and hi:
    a piece counts unless it was unmarked before lo or marked after hi."""
    marks, unmarks = _nth(trace, "w", "mark"), _nth(trace, "w", "unmark")
    touched: set[int] = set()
    for k, piece in enumerate(sc.pieces()):
        if k < len(marks) and marks[k] < hi and (k >= len(unmarks) or unmarks[k] > lo):
            touched |= {p // sc.region_rows for p in piece}
    return touched


def check_run(sc: Scenario, run: Run) -> None:
    where = f"{sc.name}, schedule {''.join(run.schedule)}"
    assert run.writer_error is None and run.reader_error is None, (
        where, run.writer_error, run.reader_error)
    # The ring after the add, from a model of it (later rows win).
    model = run.old.clone()
    for k in range(sc.count):
        model[(sc.start + k) % sc.capacity] = NEW_ID + k
    assert torch.equal(run.rb.storage, model), where
    assert run.rb.ptr == sc.laps * sc.capacity + sc.start + sc.count
    # INV-ROW: every gathered row is whole: the row before the add or after it.
    for i, idx in enumerate(sc.indices):
        row = run.out[i]
        assert torch.equal(row, run.old[idx]) or torch.equal(row, model[idx]), (
            f"INV-ROW: torn row {row.tolist()} at index {idx}; {where}")
    # Rows read again: exactly those of regions written during each round's window.
    snapshot, compare = _nth(run.trace, "r", "snapshot")[0], _nth(run.trace, "r", "compare")[0]
    todo = list(sc.indices)
    window = (snapshot, compare)
    seqs = _nth(run.trace, "r", "seq")
    assert len(seqs) == 2 * len(run.rows_read), (
        f"{len(run.rows_read)} retry rounds read the sequence numbers {len(seqs)} "
        f"times, not twice each; {where}")
    for rnd in range(len(run.rows_read) + 1):
        regions = regions_written_between(sc, run.trace, *window)
        todo = [idx for idx in todo if idx // sc.region_rows in regions]
        if rnd == len(run.rows_read):
            assert todo == [], f"rows {todo} never read again; {where}"
            break
        assert run.rows_read[rnd] == todo, (
            f"round {rnd} read again rows {run.rows_read[rnd]}, expected {todo}; {where}")
        window = (seqs[2 * rnd], seqs[2 * rnd + 1])


@pytest.mark.parametrize("sc", [
    pytest.param(sc, id=sc.name,
                 marks=[pytest.mark.slow] if sc.name == "around the end of the ring" else [])
    for sc in SCENARIOS
])
def test_every_interleaving_is_torn_row_free(sc: Scenario) -> None:
    """INV-ROW: one add and one gather, in every order of their seqlock steps."""
    runs = retried = 0
    asked = 0
    for run in every_interleaving(sc):
        check_run(sc, run)
        runs += 1
        retried += bool(run.rows_read)
        asked += bool(run.asks)
        assert not run.rb._asked_mv[0], "the ask outlived the gather"
    # The exploration reached the interesting states: gathers that had to retry,
    # and, with the writer stopped mid-row, gathers that overlapped a torn row.
    assert retried and runs > retried, (runs, retried)
    # One add that writes a region twice (two pieces) laps a round that spans both:
    # the next round asks the adds to yield, and is checked as any.
    assert bool(asked) == (sc.name == "wider than the ring"), (sc.name, asked)


def test_the_harness_fails_a_broken_seqlock() -> None:
    """The exploration reaches the orders that matter: when the gather never retries
    (mutant 7 of the module docstring) some schedule returns a torn row."""

    class NeverRetries(SteppedBuffer):
        def _changed_since(self, before: torch.Tensor, scratch: GatherScratch
                           ) -> torch.Tensor | None:
            super()._changed_since(before, scratch)
            return None

    sc = SCENARIOS[2]
    torn = sum(any(len(set(row.tolist())) > 1 for row in run.out)
               for run in every_interleaving(sc, NeverRetries))
    assert torn > 0


class Starved(Exception):
    pass


def test_a_gather_lapped_by_adds_of_the_whole_ring_has_them_yield_for_a_round() -> None:
    """Adds of the whole ring, back to back, mark every region at each add: a gather's
    round of reads lands only in the gap between two adds, and a round longer than
    that gap never did. The learner's own pack (learner_packs) spun in its gather
    until its patience ran out and failed the run in CollectorDied ("its writer is
    stopped or hung inside it") while the collector was adding. Helper-88 measured, a
    writer adding 16384 rows of 517 floats back to back and a gather of 16384 rows,
    21 of 21 gathers still reading after 3 s (process writer); 1 of 2 takes of 32768
    rows in CollectorDied after 5 s of liveness_timeout (thread writer). Once a round
    is lapped the next ones ask the adds to yield (``Lapping``'s add yields as
    another thread's does): here the second round lands, and the ask is cleared."""
    rb = Lapping(64, 1, 1, region_rows=8)
    rb.add_packed(constant_rows(rb, 1, 64))
    indices = torch.tensor([63, 0, 9, 9, 31, 40, 7])
    out = torch.empty(len(indices), rb.width)
    calls: list[float] = []

    def retrying(waited_s: float) -> None:
        calls.append(waited_s)
        if len(calls) == 10:  # 640 rounds or more
            raise Starved(f"{rb.laps} laps")
    rb.gather(indices, out, retrying=retrying)
    assert rb.laps == 2 and not calls  # the first copy's and the first round's laps
    assert torch.equal(out, rb.storage[indices])  # the last add's rows, whole
    assert torch.equal(out[:, 0], 2000.0 + indices)
    assert not bool((rb._seq & 1).any()) and not rb._write_lock._semlock._count()
    assert not rb._asked_mv[0]


class LappedInPause(ReplayBuffer):
    """Its first retry round sees region 0 written whole meanwhile (its number moves by
    2: lapped), as no live add can while the gathering thread holds the lock."""

    asks = rounds = 0

    def _rows_at(self, rows: torch.Tensor) -> torch.Tensor:
        self.rounds += 1
        if self.rounds == 1:
            self._seq[0] += 2
        return super()._rows_at(rows)

    def _ask_adds_to_yield(self) -> None:
        self.asks += 1
        super()._ask_adds_to_yield()


def test_a_gather_inside_its_threads_pause_never_asks_the_adds_to_yield() -> None:
    """A gather in a thread that holds the write lock (its adds_paused() block) never
    asks the adds to yield: none can run meanwhile. It retries rows a writer stopped
    inside its add marks, and ends when that region is even again; the pause is
    still held."""
    rb = LappedInPause(64, 1, 1, region_rows=8)
    rb.add_packed(constant_rows(rb, 1, 64))
    out = torch.empty(3, rb.width)
    calls: list[float] = []

    def retrying(waited_s: float) -> None:
        calls.append(waited_s)
        rb._seq[0] += 1  # the stopped writer's region is even again
    with rb.adds_paused():
        rb._seq[0] += 1  # as a writer stopped inside its add
        rb.gather(torch.tensor([0, 1, 20]), out, retrying=retrying)
        assert rb._write_lock._semlock._count() == 1  # the pause's, still held
    assert len(calls) == 1 and rb.asks == 0 and not rb._write_lock._semlock._count()
    assert torch.equal(out, rb.storage[torch.tensor([0, 1, 20])])


class EnteringYield(ReplayBuffer):
    """Sets ``entered`` as its add begins to wait for a lapped gather's ask."""

    entered: threading.Event

    def _yield_to_lapped_gather(self) -> None:
        self.entered.set()
        super()._yield_to_lapped_gather()


def ask_from_another_thread(rb: ReplayBuffer) -> None:
    """Stamp the ask as a lapped gather of another thread does (and let it end)."""
    asker = threading.Thread(target=rb._ask_adds_to_yield)
    asker.start()
    asker.join()


def test_an_add_waits_while_another_threads_lapped_gather_asks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An add finding another thread's ask (a lapped gather's round) waits for it to be
    cleared, holding nothing: a pause, and a gather, go on meanwhile. Its bound
    widened to 10 minutes, the wait ends with the ask only (no timing)."""
    monkeypatch.setattr(buffer, "LAPPED_HOLD_NS", 600 * 10**9)
    rb = EnteringYield(64, 1, 1, region_rows=8)
    rb.entered = threading.Event()
    rb.add_packed(constant_rows(rb, 1, 64))
    ask_from_another_thread(rb)
    writer = threading.Thread(
        target=lambda: rb.add_packed(constant_rows(rb, 100, 8)), daemon=True)
    writer.start()
    assert rb.entered.wait(MARGIN_S)
    assert rb.ptr == 64 and writer.is_alive()  # waiting in the loop: only a clear ends it
    with rb.adds_paused():  # the lock is free: the add holds nothing while it waits
        out = torch.empty(3, rb.width)
        rb.gather(torch.tensor([0, 9, 63]), out)
        assert torch.equal(out[:, 0], torch.tensor([1.0, 10.0, 64.0]))
    rb._asked_mv[0] = 0  # the gather ended
    writer.join(MARGIN_S)
    assert not writer.is_alive() and rb.ptr == 72


@pytest.mark.parametrize("ask", ["own", "old", "future"])
def test_an_add_never_waits_for_its_own_ask_nor_an_old_or_future_one(
        monkeypatch: pytest.MonkeyPatch, ask: str) -> None:
    """Never waited for, the bound widened to 10 minutes: the ask of the add's own
    thread (an add from a signal handler that interrupted a lapped gather: the gather
    cannot go on until the add ends); a stamp older than the bound (its reader died
    before it cleared it: SIGKILL, a Ctrl-C between its test and its clear); a stamp
    in the future (another time namespace's clock: no bound on it could be told)."""
    monkeypatch.setattr(buffer, "LAPPED_HOLD_NS", 600 * 10**9)
    rb = EnteringYield(64, 1, 1, region_rows=8)
    rb.entered = threading.Event()

    def add() -> int:
        now = time.monotonic_ns()
        if ask == "own":
            rb._ask_adds_to_yield()
        else:
            rb._asked_mv[0] = (now + (1 if ask == "future" else -1) * 1200 * 10**9) | 1
        rb.add_packed(constant_rows(rb, 1, 8))
        return rb.ptr
    finished, got = finishes_within(add)
    assert finished and got == [8] and rb.entered.is_set()


def test_an_add_waits_lapped_hold_s_at_most_while_a_reader_asks_again_and_again() -> None:
    """A reader asking anew without end (each round of a gather that stays lapped asks
    again; several readers take turns) cannot hold the writer off: each add waits
    LAPPED_HOLD_S at most on its own clock, and goes on (a liveness bound, MARGIN_S
    for all of them)."""
    rb = EnteringYield(64, 1, 1, region_rows=8)
    rb.entered = threading.Event()
    stop = threading.Event()

    def ask() -> None:
        while not stop.is_set():
            rb._ask_adds_to_yield()
            time.sleep(0)
    asker = threading.Thread(target=ask, daemon=True)
    asker.start()

    def adds() -> int:
        for k in range(5):
            rb.add_packed(constant_rows(rb, 1 + 8 * k, 8))
        return rb.ptr
    try:
        finished, got = finishes_within(adds)
    finally:
        stop.set()
        asker.join(MARGIN_S)
    assert finished and got == [40] and rb.entered.is_set()


def test_a_gather_that_stops_asking_leaves_another_readers_ask_standing() -> None:
    """A lapped gather ending clears the ask only if it is still its own: another
    reader's, stamped since (its gather still lapped), stays, and an add of a third
    thread waits for it. (An unconditional clear survived every other test;
    helper-92.)"""
    rb = ReplayBuffer(64, 1, 1, region_rows=8)
    rb._ask_adds_to_yield()  # this thread's gather, lapped
    mine = rb._asked_mv[0]
    ask_from_another_thread(rb)  # another reader's, later
    theirs = rb._asked_mv[0]
    assert theirs and theirs != mine
    rb._stop_asking()  # this thread's gather ends
    assert rb._asked_mv[0] == theirs
    rb._asked_mv[0] = mine
    rb._stop_asking()
    assert not rb._asked_mv[0]


class MarkRecorder(ReplayBuffer):
    """Records, at each row copy, the rows copied, the regions whose sequence number
    is odd at that moment, and ptr and size then."""

    copies: list[tuple[list[int], set[int]]]
    counters: list[tuple[int, int]]

    def _copy_in(self, start: int, rows: torch.Tensor) -> None:
        odd = {int(r) for r in (self._seq & 1).nonzero().flatten()}
        self.copies.append((list(range(start, start + rows.shape[0])), odd))
        self.counters.append((self.ptr, self.size))
        super()._copy_in(start, rows)


def marks_of(capacity: int, region_rows: int, ptr: int,
             count: int) -> tuple[MarkRecorder, torch.Tensor, tuple[int, int]]:
    """A buffer after ``ptr`` rows and then an add of ``count`` rows, whose copies
    were recorded, and its sequence numbers and (ptr, size) before that add."""
    rb = MarkRecorder(capacity, 1, 1, region_rows=region_rows)
    rb.copies, rb.counters = [], []
    if ptr:
        rb.add_packed(constant_rows(rb, 1, ptr))
    rb.copies, rb.counters = [], []
    before = rb._seq.clone()
    counters = (rb.ptr, rb.size)
    rb.add_packed(constant_rows(rb, 10_000, count))
    return rb, before, counters


def assert_marks(rb: MarkRecorder, before: torch.Tensor, counters: tuple[int, int],
                 pieces: list[list[int]]) -> None:
    r = rb.region_rows
    assert [rows for rows, _ in rb.copies] == pieces
    for rows, odd in rb.copies:
        # Exactly the regions of the rows being copied are odd, no fewer, no more.
        assert odd == {row // r for row in rows}, (rows, odd)
    assert not bool((rb._seq & 1).any()), "a region left odd"
    writes = [sum(any(row // r == region for row in rows) for rows, _ in rb.copies)
              for region in range(len(rb._seq))]
    assert (rb._seq - before).tolist() == [2 * n for n in writes]
    # Invariant of _counters: ptr and size cover only rows already written (a save
    # relies on it to know which rows an add may still be writing).
    assert rb.counters == [counters] * len(pieces)


@pytest.mark.parametrize("capacity,region_rows,ptr,count,pieces", [
    (16, 4, 0, 4, [[0, 1, 2, 3]]),                      # one region, both ends aligned
    (16, 4, 4, 8, [list(range(4, 12))]),                # two whole regions
    (16, 4, 3, 2, [[3, 4]]),                            # one row each side of a boundary
    (16, 4, 5, 1, [[5]]),                               # a single row
    (16, 4, 12, 4, [[12, 13, 14, 15]]),                 # ends exactly at the capacity
    (16, 4, 14, 4, [[14, 15], [0, 1]]),                 # wraps around
    (16, 4, 16, 4, [[0, 1, 2, 3]]),                     # second lap, aligned
    (16, 4, 6, 22, [list(range(12, 16)), list(range(0, 12))]),  # wider than the ring
    (16, 4, 0, 16, [list(range(16))]),                  # exactly the capacity
    (10, 4, 7, 3, [[7, 8, 9]]),                         # the last region is short
    (10, 4, 8, 5, [[8, 9], [0, 1, 2]]),                 # wraps out of the short region
])
def test_regions_marked_while_copying(capacity: int, region_rows: int, ptr: int,
                                      count: int, pieces: list[list[int]]) -> None:
    """While rows are copied, exactly their regions are odd; afterwards each region's
    sequence number grew by 2 per write that touched it."""
    assert_marks(*marks_of(capacity, region_rows, ptr, count), pieces)


@given(capacity=st.integers(1, 40), region_rows=st.integers(1, 9),
       ptr=st.integers(0, 90), count=st.integers(1, 90))
def test_regions_marked_for_any_write(capacity: int, region_rows: int, ptr: int,
                                      count: int) -> None:
    keep = min(count, capacity)
    first = (ptr + count - keep) % capacity
    positions = [(first + k) % capacity for k in range(keep)]
    cut = next((k for k in range(1, keep) if positions[k] == 0), keep)
    pieces = [p for p in (positions[:cut], positions[cut:]) if p]
    assert_marks(*marks_of(capacity, region_rows, ptr, count), pieces)
