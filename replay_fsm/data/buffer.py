"""The packed replay buffer in CPU shared memory, with torn-row-free gathers.

INV-ROW is kept by a per-region seqlock: ``add`` makes the sequence number of each
region it writes odd, writes, and makes it even again; ``gather`` reads the
sequence numbers, gathers, reads them again and re-gathers only the rows of
regions that changed or were being written. ``add`` never waits for a pack and a
pack never waits for an ``add``; only concurrent writers serialise (one lock held
around the row copy). One exception keeps a gather live: a gather lapped by the adds
(a retry round during which an add ended on its rows and another began, as adds of
the whole ring back to back do, which leave no gap for a round to land in but the
microseconds between two adds) asks the adds to yield. It stamps a word in shared
memory with the time (``time.monotonic_ns``) before each later round, and clears it
when it ends; an add about to take the lock finds the stamp and waits, holding
nothing, until it is cleared or ``LAPPED_HOLD_S`` old, ``LAPPED_HOLD_S`` at most
whatever the stamps. The reader never holds the write lock: a reader killed (SIGKILL)
leaves a stamp that adds ignore once it is that old. The ordering argument relies on
stores and loads not being reordered across the separate torch calls (true on
x86-64's TSO; the release and acquire points are library calls on other
architectures too); the stamp is a hint, never part of it (rows are checked as in any
round).

Each step of the writer (``_yield_to_lapped_gather``, ``_begin_region_write``,
``_copy_in``, ``_end_region_write``) and of the reader (``_seq_snapshot``,
``_copy_out``, ``_changed_since``, ``_ask_adds_to_yield``, ``_seq_at``, ``_rows_at``,
``_yield_to_writer``, ``_stop_asking``) is a method of its own, so a test subclass
can stop either side between any two steps and choose the interleaving
(``tests/test_seqlock.py``). Production pays a few Python calls per add and gather.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from ..core import as_count
from ..errors import ProtocolError, WriterDied
from ..signals import start_resource_tracker
from . import checkpoint
from .channel import semaphore_name, unlink_semaphore
from .layout import Layout
from .owner import Owner, me
from .shared import shared_zeros, small_shared_zeros

Array = Any  # torch.Tensor or np.ndarray

# A gather retrying rows that an add is writing asks, every this many retries, whether
# that add's process is alive (a /proc read): a live writer finishes a region in
# microseconds to milliseconds, a dead one never does.
WRITER_CHECK_RETRIES = 1024
# A gather's ``retrying`` hook is called this often while it reads rows again.
RETRY_CALL_EVERY = 64
# A gather lapped by the adds (see the module's docstring) asks them to yield: an add
# finding an ask younger than this waits, holding nothing, for it to be cleared, this
# long at most (on its own clock, whatever the asks: the writer goes on). A reader
# killed leaves its stamp, which adds ignore once it is this old.
LAPPED_HOLD_S = 0.1
LAPPED_HOLD_NS = int(LAPPED_HOLD_S * 1e9)
# The row numbers gather takes (torch's index_select takes these two).
_INDEX_DTYPES = (torch.int64, torch.int32)
# A pause (and so a save) or adopt_rows finding an add in progress asks this often
# whether its process is alive, until it is done, before waiting for the lock (a wait
# for the semaphore itself could not be told that its holder died).
ADD_POLL_S = 0.001


def _as_float32(name: str, value: Array, shape: tuple[int, ...]) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":
            raise TypeError(f"{name} must hold real numbers, got dtype {value.dtype}")
        if not value.dtype.isnative or not value.flags.writeable:
            # torch takes neither another byte order nor (without a warning) an array
            # it may not write, though it only reads it here: a native copy.
            value = np.array(value, dtype=value.dtype.newbyteorder("="))
        tensor = torch.from_numpy(np.ascontiguousarray(value))
    elif isinstance(value, torch.Tensor):
        if value.layout is not torch.strided or value.is_meta:
            raise TypeError(f"{name} must be a dense tensor with data, got a "
                            f"{'meta' if value.is_meta else value.layout} tensor")
        tensor = value.detach()
    else:
        raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got "
                        f"{type(value).__name__}")
    if tensor.is_complex():
        raise TypeError(f"{name} must hold real numbers, got dtype {tensor.dtype}")
    if tensor.dim() == len(shape) + 1 and len(shape) == 1 and tensor.shape[-1] == 1:
        tensor = tensor.reshape(-1)  # [n, 1] scalars are accepted as [n]
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name}: got shape {tuple(tensor.shape)}, expected {shape}")
    return tensor.to(device="cpu", dtype=torch.float32)


class ReplaySource(Protocol):
    """What the runtime reads of a replay buffer: ``ReplayBuffer`` has it, and
    ``replay_fsm.compat`` views the seed's buffer through it. (A packer of ours needs
    a ``ReplayBuffer`` itself.)"""

    @property
    def layout(self) -> Layout: ...

    @property
    def width(self) -> int: ...

    @property
    def ptr(self) -> int: ...

    @property
    def size(self) -> int: ...

    def gather(self, indices: torch.Tensor, out: torch.Tensor) -> torch.Tensor: ...


class GatherScratch:
    """What ``ReplayBuffer.gather`` checks its copy with, made once per thread that
    gathers: the sequence numbers read before the copy and their parities."""

    def __init__(self, regions: int) -> None:
        self.before = torch.empty(regions, dtype=torch.int64)
        self.odd = torch.empty(regions, dtype=torch.int64)
        self.odd_count = torch.zeros((), dtype=torch.int64)
        self.one = torch.ones((), dtype=torch.int64)  # a tensor: a Python 1 is boxed per call


# The write locks of this process's buffers, and their adds' waits (ReplayBuffer.
# _add_waits), for the fork hook below.
_WRITE_LOCKS: weakref.WeakSet[Any] = weakref.WeakSet()
_ADD_WAITS: weakref.WeakKeyDictionary[Any, dict[int, int]] = weakref.WeakKeyDictionary()
# Keys of the waits of adds (ReplayBuffer._add_waits): one per add, of any thread, a
# signal handler's add inside another's wait too. next() is one C call.
_WAIT_KEYS = itertools.count()


def _forked() -> None:
    """In a child made by os.fork: none of the write locks is held by this process (the
    lock's count of its holder's blocks is per process; multiprocessing resets it in
    its own fork children only). A pause the parent was in when it forked stays the
    parent's: the child's exit from that block raises, and releases nothing."""
    for lock in list(_WRITE_LOCKS):
        lock._semlock._after_fork()
    for waits in list(_ADD_WAITS.values()):
        waits.clear()  # the waits of the parent's other threads: none is the child's


os.register_at_fork(after_in_child=_forked)


# resized() copies the rows this many bytes at a time (a ring's end cuts one short).
RESIZE_COPY_BYTES = 16 << 20


class ReplayBuffer:
    """A ring of ``capacity`` packed float32 rows in CPU shared memory.

    Picklable to a spawned process without copying ``storage`` (it is shared).
    ``check_finite=True`` makes ``add`` and ``add_packed`` refuse rows holding NaN or
    infinity (off by default: it costs a pass over every added row).

    Raises:
        TypeError: a capacity, dimension or ``region_rows`` that is not an int or numpy
            integer (bools and floats are refused).
        ValueError: a capacity, ``obs_dim``, ``action_dim`` or ``region_rows`` below 1, or
            a negative ``critic_dim``.
        MemoryError: the rows do not fit in the machine's memory, in what the memory
            limit of the process's cgroup leaves, in the free space of /dev/shm, in the
            address space left under ``ulimit -v`` or under the file size limit of
            ``ulimit -f`` (the message names the size and the room).
    """

    # The most rows ever written the int64 counters hold (a century of adds at a
    # billion rows a second is 2**62); adopt_rows, load and add refuse to pass it.
    MAX_PTR = (1 << 63) - 1

    def __init__(self, capacity: int, obs_dim: int, action_dim: int, critic_dim: int = 0,
                 *, region_rows: int | None = None, check_finite: bool = False) -> None:
        capacity = as_count("capacity", capacity, 1)
        obs_dim = as_count("obs_dim", obs_dim, 1)
        action_dim = as_count("action_dim", action_dim, 1)
        critic_dim = as_count("critic_dim", critic_dim, 0)
        if region_rows is not None:
            region_rows = as_count("region_rows", region_rows, 1)
        if not isinstance(check_finite, bool):
            raise TypeError(f"check_finite must be a bool, got {check_finite!r}")
        self.capacity = capacity
        self.obs_dim, self.action_dim, self.critic_dim = obs_dim, action_dim, critic_dim
        self.check_finite = check_finite
        self.layout = Layout.build(obs_dim, action_dim, critic_dim)
        self.storage = shared_zeros(capacity, self.layout.width,
                                    what=f"a replay buffer of {capacity} rows")
        # Invariant: _counters = [ptr, size, adds cut short]; ptr and size written only
        # after the rows they cover. An add cut short (an exception, a Ctrl-C) may have
        # written rows it never counts: the third counts those adds, for save.
        self._counters = small_shared_zeros(3, dtype=torch.int64)
        # A lapped gather's ask that the adds yield: the time.monotonic_ns (odd) of its
        # latest round, 0 while none asks (gather, _yield_to_lapped_gather). A hint:
        # any reader may overwrite or clear it, and an add waits LAPPED_HOLD_S at most.
        self._asked = small_shared_zeros(1, dtype=torch.int64)
        self._views()
        self.region_rows = region_rows or max(64, -(-capacity // 1024))
        n_regions = -(-capacity // self.region_rows)
        # Invariant: _seq[r] is odd exactly while some add writes rows of region r.
        self._seq = small_shared_zeros(n_regions, dtype=torch.int64)
        # A recursive lock: a thread's adds_paused() blocks nest, counted by the lock.
        # Entered through its C semaphore (_semlock), whose enter and exit leave no
        # point between taking the lock and the block, or between the block and
        # releasing it, where Python would take a Ctrl-C (the Lock's own __enter__ and
        # __exit__ are Python functions: one landing there left every add waiting).
        start_resource_tracker()  # first: it must live through a hangup (SIGHUP)
        self._write_lock: Any = mp.get_context("spawn").RLock()
        _WRITE_LOCKS.add(self._write_lock)
        # Who holds _write_lock inside an add: a process killed there (SIGKILL) never
        # releases it, and its rows stay half written; waiters then fail instead.
        self._owner = Owner()
        # A random number naming this buffer in every process that holds it: a packer
        # handle made for it refuses another buffer (Packer.attach).
        self.buffer_id = int.from_bytes(os.urandom(8), "little") >> 1

    def adds_paused(self) -> contextlib.AbstractContextManager[Any]:
        """Hold off every ``add`` (in every process) for the length of the with-block;
        gathers go on. For a consistent copy of the rows (``save`` uses it, and may be
        called inside the block: it then copies under this pause). Blocks of one
        thread nest (asyncio tasks of one thread too): the pause ends when the last
        of them does. A Ctrl-C anywhere leaves no pause behind. A block ends on the
        thread that began it: a generator holding one must be finished there (ended
        on another thread, its exit raises AssertionError and the pause stays). A
        child forked (os.fork) inside the block holds nothing: leaving it there raises
        AssertionError, and the pause stays the parent's.

        Raises:
            ProtocolError: called on a thread inside an ``add`` (from a signal handler
                that interrupted it): the pause would not hold that add off.
            WriterDied: a process died inside an add, holding the lock (checked
                when called, while an add is in progress until it ends).
        """
        self._refuse_inside_add("adds_paused()")
        self._wait_out_add("adds_paused()")
        return self._write_lock._semlock

    def _refuse_inside_add(self, call: str) -> None:
        # The lock is recursive: a pause or a save from a signal handler that
        # interrupted this thread's add would take it again and copy the add's rows
        # half written.
        if self._adding and self._write_lock._semlock._is_mine():
            raise ProtocolError(f"{call} inside this thread's add (from a signal handler?) "
                                f"would see that add half done; nothing was changed. Call "
                                f"it after the add, outside the handler")

    def _wait_out_add(self, call: str) -> None:
        """Until no add holds the write lock (for a pause, so a save's last pass, and
        adopt_rows): raises WriterDied once its process is dead. (Nothing waits in the
        semaphore meanwhile, so a Ctrl-C leaves nothing held.) An add beginning after
        it, and a pause, are waited for in the semaphore, where nothing can tell the
        caller that their process died: a wait with a timeout there would leave a
        Ctrl-C a point between the acquire and the block."""
        while self._owner.held:
            self._refuse_if_writer_died(call)
            time.sleep(ADD_POLL_S)

    def _refuse_if_writer_died(self, call: str) -> None:
        if not self._owner.held:
            return  # the common case: no add holds the lock
        pid = self._owner.dead_holder()
        if pid is not None:
            raise WriterDied(self._writer_died(pid, call))

    def dead_writer(self, call: str = "add()") -> WriterDied | None:
        """The ``WriterDied`` that ``call`` (named so in its message) raises on this
        buffer now, in any process, because a process died inside an add holding the
        write lock; None while none did, or while its holder cannot be judged. For the
        learner, whose collector process died of it (which only that process's
        standard error said) and is found gone."""
        try:
            self._refuse_if_writer_died(call)
        except WriterDied as exc:
            return exc
        return None

    def _writer_died(self, pid: int, call: str) -> str:
        odd = (self._seq & 1).nonzero().flatten().tolist()
        runs: list[list[int]] = []
        for r in odd:
            if runs and runs[-1][1] == r - 1:
                runs[-1][1] = r
            else:
                runs.append([r, r])
        rows = ", ".join(f"{a * self.region_rows}-"
                         f"{min((b + 1) * self.region_rows, self.capacity) - 1}"
                         for a, b in runs)
        torn = (f"the rows it was writing ({rows}) are half written" if rows else
                "no row is half written")
        return (f"process {pid} died inside an add to this replay buffer (killed: "
                f"SIGKILL, the OOM killer?), holding its write lock; {torn}: {call} "
                f"would wait for ever. No add, pause or save of this buffer can "
                f"succeed any more, and no gather of rows being written; start again "
                f"from the last checkpoint (ReplayBuffer.load)")

    def _refuse_inside_pause(self, call: str) -> None:
        self._refuse_inside_add(call)
        if self._write_lock._semlock._is_mine():  # this thread's pause, or nothing
            raise ProtocolError(f"{call} inside this thread's adds_paused() block would "
                                f"wait for the block to end, for ever; nothing was "
                                f"changed. Call it after the block")

    def adopt_rows(self, ptr: int) -> None:
        """Say that ``ptr`` rows were ever written, rows [0, min(ptr, capacity)) of
        ``storage`` holding them: for a loader that filled ``storage`` itself. The
        counters are written after the rows, as ``add`` does.

        Raises:
            TypeError: ``ptr`` is not an int (a numpy integer is one, a bool is not).
            ValueError: ``ptr`` is negative or above ``MAX_PTR``.
            ProtocolError: called inside this thread's ``adds_paused()`` block.
            WriterDied: a process died inside an add, holding the write lock.
        """
        ptr = as_count("ptr", ptr)
        if ptr > self.MAX_PTR:
            raise ValueError(f"ptr must be in [0, {self.MAX_PTR}], got {ptr}")
        self._refuse_inside_pause("adopt_rows()")
        self._wait_out_add("adopt_rows()")
        ptr, size = int(ptr), min(int(ptr), self.capacity)  # no call between the writes
        with self._write_lock._semlock:  # see __init__
            self._counters[1] = size
            self._counters[0] = ptr

    @property
    def semaphore_names(self) -> tuple[str, ...]:
        """The /dev/shm name of the write lock's semaphore (to check none is left)."""
        return (semaphore_name(self._write_lock),)

    def unlink(self) -> None:
        """Remove the write lock's semaphore name from the system and from the
        resource tracker, from any process holding the buffer (for when its creator
        died and cannot). The buffer keeps working in the processes that hold it."""
        unlink_semaphore(self._write_lock)

    @property
    def width(self) -> int:
        """Floats per row: every field's columns together (``layout``)."""
        return self.layout.width

    @property
    def adds_cut_short(self) -> int:
        """Adds that an exception (a Ctrl-C) cut short, ever, in any process: such an
        add may have written rows without counting them in ``ptr``."""
        return int(self._counters_np[2])

    def region_writes(self) -> np.ndarray:
        """A live view of each region's write counter (INV-ROW's seqlock; region r
        holds rows [r * region_rows, (r + 1) * region_rows)): odd while an add writes
        the region, 2 more after each add that did. A row written between two reads
        lies in a region whose counter moved, one an add cut short by a Ctrl-C wrote
        (without counting it in ``ptr``) included."""
        view = self._seq.numpy()
        view.flags.writeable = False  # a write would make gathers of the region spin
        return view

    def _views(self) -> None:
        # A numpy view of the shared counters: reading one costs nanoseconds instead of
        # a torch call, and the learner and the packer read them on every tick.
        self._counters_np = self._counters.numpy()
        # The same cells as a memoryview, for ptr and size: a read returns a Python int
        # in a third of numpy's scalar read and int() (the learner reads both per tick).
        self._counters_mv = self._counters_np.data.cast("B").cast("q")
        # The ask (__init__) as a memoryview: an add reads it in tens of nanoseconds.
        self._asked_mv = self._asked.numpy().data.cast("B").cast("q")
        self._per_thread = threading.local()  # gather's scratch, one per thread
        self._adding = False  # a thread of this process is inside add, the lock taken
        # When (time.monotonic_ns) each add of this process now in progress began
        # waiting for the write lock, by a key of its own (add_waiting_s): one cell for
        # all lost a wait when another thread's add took the lock.
        self._add_waits: dict[int, int] = {}
        _ADD_WAITS[self] = self._add_waits

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickled only as a spawned process's argument (its semaphores travel by
        # inheritance only): refused first, where the write lock refused it only after
        # the whole storage was copied (27 s and 6.1 GiB for a 2 GiB buffer).
        mp.context.assert_spawning(self)
        return super().__reduce_ex__(protocol)

    def __copy__(self) -> ReplayBuffer:
        """``copy.copy``: another handle on the same shared buffer, as before."""
        new = self.__class__.__new__(self.__class__)
        new.__setstate__(self.__getstate__())
        return new

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_counters_np")  # a numpy array would pickle by value: rebuilt below
        state.pop("_counters_mv")  # the same (a memoryview does not pickle)
        state.pop("_asked_mv")
        state.pop("_per_thread")  # each process makes its own
        state.pop("_adding")
        state.pop("_add_waits")
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._views()
        _WRITE_LOCKS.add(self._write_lock)

    def add_waiting_s(self) -> float:
        """How long the longest-waiting ``add`` of this process has waited for the
        write lock (held by another process's add, or by a pause: ``adds_paused``, a
        save's last pass); 0.0 while none waits, and while a thread of this process
        holds the lock (its pause or add: alive, it ends). A waiting add cannot learn
        that the holder died outside an add (see ``Packer.attach``)."""
        starts = list(self._add_waits.values())  # one C call: no thread changes it meanwhile
        if not starts or self._write_lock._semlock._count():
            return 0.0
        return max(0.0, (time.monotonic_ns() - min(starts)) / 1e9)

    @property
    def ptr(self) -> int:
        """Rows ever written."""
        return self._counters_mv[0]

    @property
    def size(self) -> int:
        """Rows that hold data: min(ptr, capacity)."""
        return self._counters_mv[1]

    def add(self, obs: Array, actions: Array, rewards: Array, next_obs: Array,
            dones: Array, truncated: Array, *, terminal_mask: Array | None = None,
            terminal_next_obs: Array | None = None, critic: Array | None = None,
            next_critic: Array | None = None,
            terminal_next_critic: Array | None = None) -> None:
        """Append a batch of transitions from many environments (ring writes).

        Where ``terminal_mask`` is set, ``terminal_next_obs`` (and
        ``terminal_next_critic``) replace next_obs (next_critic), as in the seed.
        A batch larger than the capacity keeps its newest rows. Interrupted
        (KeyboardInterrupt) part way, it leaves the write lock free and every row
        whole, either as it was or as the add wrote it; ``ptr`` counts all of the
        add's rows or none.

        Raises:
            ValueError: a field's shape is wrong (the message names the field, the
                shape given and the one expected), a required field is missing, a
                terminal field is given without ``terminal_mask``, (``check_finite``)
                a row holds NaN or infinity (the message names the row and field),
                or the rows would take ``ptr`` past ``MAX_PTR``; nothing is written.
            TypeError: a field is not a tensor or array of real numbers.
            ProtocolError: called inside this thread's ``adds_paused()`` block.
            WriterDied: a process died inside an add, holding the write lock.
        """
        if not isinstance(obs, (torch.Tensor, np.ndarray)):
            raise TypeError(f"obs must be a torch.Tensor or numpy.ndarray, got "
                            f"{type(obs).__name__}")
        if len(obs.shape) != 2:
            raise ValueError(f"obs: got shape {tuple(obs.shape)}, "
                             f"expected (n, {self.obs_dim})")
        n = int(obs.shape[0])
        o, a, c = self.obs_dim, self.action_dim, self.critic_dim
        rows = torch.empty(n, self.width)
        lay = self.layout
        rows[:, lay.obs] = _as_float32("obs", obs, (n, o))
        rows[:, lay.next_obs] = _as_float32("next_obs", next_obs, (n, o))
        rows[:, lay.actions] = _as_float32("actions", actions, (n, a))
        rows[:, lay.rewards] = _as_float32("rewards", rewards, (n,))
        rows[:, lay.dones] = _as_float32("dones", dones, (n,))
        rows[:, lay.truncated] = _as_float32("truncated", truncated, (n,))
        mask = None
        if terminal_mask is None and (terminal_next_obs is not None
                                      or terminal_next_critic is not None):
            given = "terminal_next_obs" if terminal_next_obs is not None else (
                "terminal_next_critic")
            raise ValueError(f"{given}: given without terminal_mask, which says the rows "
                             "it replaces")
        if terminal_mask is not None:
            mask = _as_float32("terminal_mask", terminal_mask, (n,)) != 0
            if terminal_next_obs is None:
                raise ValueError("terminal_next_obs: required when terminal_mask is given")
            rows[mask, lay.next_obs] = _as_float32(
                "terminal_next_obs", terminal_next_obs, (n, o))[mask]
        if c:
            if critic is None or next_critic is None:
                raise ValueError(f"critic and next_critic: required, shape ({n}, {c}), "
                                 f"since critic_dim={c}")
            assert lay.critic is not None and lay.next_critic is not None
            rows[:, lay.critic] = _as_float32("critic", critic, (n, c))
            rows[:, lay.next_critic] = _as_float32("next_critic", next_critic, (n, c))
            if mask is not None and terminal_next_critic is not None:
                rows[mask, lay.next_critic] = _as_float32(
                    "terminal_next_critic", terminal_next_critic, (n, c))[mask]
        elif critic is not None or next_critic is not None or (
                terminal_next_critic is not None):
            raise ValueError("critic, next_critic, terminal_next_critic: given, but this "
                             "buffer has critic_dim=0")
        self._append(rows)

    def add_packed(self, rows: Array) -> None:
        """Append rows already in the packed layout: an [n, width] tensor or array of
        real numbers, stored as float32. Rows viewing ``storage`` itself are stored as
        they were before the add (copied first where it would overwrite them).

        Raises:
            ValueError: ``rows`` is not [n, width], or (``check_finite``) holds NaN or
                infinity, or would take ``ptr`` past ``MAX_PTR``; nothing is written.
            TypeError: ``rows`` is not a tensor or array of real numbers.
            ProtocolError: called inside this thread's ``adds_paused()`` block.
            WriterDied: a process died inside an add, holding the write lock.
        """
        if (isinstance(rows, torch.Tensor) and rows.dtype == torch.float32
                and rows.dim() == 2 and rows.shape[1] == self.width
                and rows.layout is torch.strided and not rows.is_meta):
            self._append(rows.detach().cpu())  # the common case, without the general checks
            return
        shape = tuple(getattr(rows, "shape", ()))
        if len(shape) != 2 or shape[1] != self.width:
            if not isinstance(rows, (torch.Tensor, np.ndarray)):
                raise TypeError(f"rows must be a torch.Tensor or numpy.ndarray, got "
                                f"{type(rows).__name__}")
            raise ValueError(f"rows: got shape {shape}, expected (n, {self.width})")
        self._append(_as_float32("rows", rows, (int(shape[0]), self.width)))

    def _refuse_non_finite(self, rows: torch.Tensor) -> None:
        finite = torch.isfinite(rows)
        if bool(finite.all()):
            return
        row, column = (int(i) for i in (~finite).nonzero()[0])
        raise ValueError(f"row {row} of the batch: {self.layout.column_name(column)} is "
                         f"{float(rows[row, column])}; this buffer has check_finite=True, "
                         f"nothing was written")

    def _append(self, rows: torch.Tensor) -> None:
        if self.check_finite:
            self._refuse_non_finite(rows)
        self._refuse_inside_pause("add()")
        self._refuse_if_writer_died("add()")
        if self._asked_mv[0]:  # a lapped gather asks the adds to yield (gather)
            self._yield_to_lapped_gather()
        n, cap = rows.shape[0], self.capacity
        # This process's identity (/proc reads at its first add, and after a fork) is
        # read before the lock: a kill between taking the lock and writing the holder
        # record leaves the lock held and unrecorded, and every later add waits for
        # ever; reading /proc there made that window most of a first add.
        me()
        waits, key = self._add_waits, next(_WAIT_KEYS)
        waits[key] = time.monotonic_ns()  # kept while it holds the lock: add_waiting_s
        try:
            with self._write_lock._semlock:  # see __init__
                self._adding = True  # no call since the lock was taken (_refuse_inside_add)
                try:
                    self._owner.hold()
                    self._append_locked(rows, n, cap)
                except BaseException:
                    self._counters[2] += 1  # its rows may be written, not counted in ptr
                    raise
                finally:
                    self._adding = False
                    self._owner.release()  # one C call: see Owner.view
        finally:
            waits.pop(key, None)  # a wait that a Ctrl-C ended, too

    def _append_locked(self, rows: torch.Tensor, n: int, cap: int) -> None:
        ptr = int(self._counters[0])
        if ptr + n > self.MAX_PTR:
            raise ValueError(f"{n} rows more would pass the {self.MAX_PTR} rows ever "
                             f"written that the counters hold (ptr={ptr}); nothing "
                             f"was written")
        keep = rows[-cap:] if n > cap else rows
        start = (ptr + n - keep.shape[0]) % cap
        first = min(keep.shape[0], cap - start)
        if self._overwrites_source(keep, start, first):
            # Rows read from this storage (add_packed(rb.storage[a:b])): a wrapped add's
            # first copy overwrote rows its second then read, and torch refuses a copy
            # onto rows overlapping its source, inside the lock (an add cut short).
            # Copied first, under the lock, so no add changes them meanwhile.
            keep = keep.clone()
        try:
            self._write_region(start, keep[:first])
            if first < keep.shape[0]:
                self._write_region(0, keep[first:])
        except BaseException:
            # A region left odd (a Ctrl-C between its two steps) would make every
            # later gather of its rows wait for a writer that has gone: even again,
            # over whole rows (the copy is one call: done or not begun). The
            # counters are not moved: a wrapped add's new rows stand in for old
            # ones, as rows the next add overwrites.
            self._seq.add_(self._seq & 1)
            raise
        self._counters[1] = min(cap, int(self._counters[1]) + n)
        self._counters[0] = ptr + n

    def _overwrites_source(self, rows: torch.Tensor, start: int, first: int) -> bool:
        """Whether writing the [n, width] ``rows`` at ``start`` (``first`` of them before
        the wrap) writes bytes that ``rows`` reads: only rows viewing this storage."""
        n, width = rows.shape
        if not n:
            return False
        # 4: the bytes of a float32, which rows are here; torch strides are never negative.
        lo = rows.data_ptr()
        hi = lo + 4 * (1 + (n - 1) * rows.stride(0) + (width - 1) * rows.stride(1))
        base, row_bytes = self.storage.data_ptr(), 4 * width
        if hi <= base or lo >= base + self.capacity * row_bytes:
            return False  # the common case: rows of the caller's own
        return ((lo < base + (start + first) * row_bytes and base + start * row_bytes < hi)
                or (first < n and lo < base + (n - first) * row_bytes))

    # The writer's steps: the first before it takes _write_lock, the others holding it.
    def _yield_to_lapped_gather(self) -> None:
        """Wait, holding nothing, while a lapped gather asks the adds to yield (see
        ``gather``): until its ask is cleared or ``LAPPED_HOLD_S`` old, and
        ``LAPPED_HOLD_S`` at most on this add's own clock whatever the asks (readers
        asking anew round after round; a stamp of another time namespace, whose
        clock is offset: seen in the future or long past, it is not waited for). An
        ask of this thread's own gather (an add from a signal handler that
        interrupted it) is never waited for: that gather cannot go on meanwhile. A
        Ctrl-C here leaves nothing held."""
        asked, own = self._asked_mv, getattr(self._per_thread, "asking", 0)
        now = time.monotonic_ns()
        deadline = now + LAPPED_HOLD_NS
        while now < deadline:
            stamp = asked[0]
            if not stamp or stamp == own or not 0 <= now - stamp < LAPPED_HOLD_NS:
                return
            time.sleep(ADD_POLL_S)
            now = time.monotonic_ns()

    def _write_region(self, start: int, rows: torch.Tensor) -> None:
        stop = start + rows.shape[0]
        r0, r1 = start // self.region_rows, (stop - 1) // self.region_rows + 1
        self._begin_region_write(r0, r1)
        self._copy_in(start, rows)
        self._end_region_write(r0, r1)

    def _begin_region_write(self, r0: int, r1: int) -> None:
        self._seq[r0:r1] += 1  # odd: readers of these regions will retry

    def _copy_in(self, start: int, rows: torch.Tensor) -> None:
        self.storage[start:start + rows.shape[0]] = rows

    def _end_region_write(self, r0: int, r1: int) -> None:
        self._seq[r0:r1] += 1  # even again

    def gather(self, indices: torch.Tensor, out: torch.Tensor, *,
               retrying: Callable[[float], None] | None = None) -> torch.Tensor:
        """``out[:] = storage[indices]`` with no torn row (INV-ROW).

        Rows of regions that an ``add`` wrote during the copy are read again, one
        region-stable row at a time, until none is being written. Once a round of
        them was lapped (an add ended on its rows and another began: adds of the
        whole ring back to back leave no gap a round can land in), the gather asks
        the adds to yield before each later round, and stops asking when it ends: an
        add about to begin waits, holding no lock, until the ask is cleared or
        ``LAPPED_HOLD_S`` old (see the module's docstring; the rows are checked all
        the same). A gather that meets no add allocates nothing after the calling
        thread's first: its check goes into that thread's ``GatherScratch``. While
        it reads again, ``retrying`` (if given) is called every ``RETRY_CALL_EVERY``
        retries with the seconds since the first: what it raises ends the gather,
        ``out`` then partly written (a writer stopped inside its add is otherwise
        waited for as long as it lives).

        Raises:
            TypeError: ``indices`` or ``out`` is not a tensor, or ``indices`` holds
                other than int64 or int32.
            ValueError: ``indices`` is not one-dimensional, or ``out`` is not float32
                [len(indices), width] (torch would resize it).
            IndexError: an index outside the storage (torch's message).
            WriterDied: rows to gather are being written by a process that died
                inside its add (checked every ``WRITER_CHECK_RETRIES`` retries).
        """
        try:
            fits = (indices.dim() == 1 and indices.dtype in _INDEX_DTYPES
                    and out.shape == (indices.shape[0], self.layout.width)
                    and out.dtype == torch.float32)
        except AttributeError:
            fits = False
        if not fits:
            if not (isinstance(indices, torch.Tensor) and isinstance(out, torch.Tensor)):
                raise TypeError(f"indices and out must be tensors, got "
                                f"{type(indices).__name__} and {type(out).__name__}")
            # Before torch sees them: its words ("index_select(): Expected dtype int32
            # or int64 for index", a RuntimeError) name neither the argument nor the fix.
            if indices.dtype not in _INDEX_DTYPES:
                raise TypeError(f"indices must hold row numbers as torch.int64 (or "
                                f"torch.int32), got {indices.dtype}")
            if indices.dim() != 1:
                raise ValueError(f"indices must be one-dimensional, got shape "
                                 f"{tuple(indices.shape)}")
            raise ValueError(f"out: got {out.dtype} of shape {tuple(out.shape)}, expected "
                             f"torch.float32 of ({indices.shape[0]}, {self.layout.width}) "
                             f"for {indices.shape[0]} indices")
        scratch = getattr(self._per_thread, "scratch", None)
        if scratch is None:
            scratch = self._per_thread.scratch = GatherScratch(self._seq.shape[0])
        before = self._seq_snapshot(scratch)
        self._copy_out(indices, out)
        changed = self._changed_since(before, scratch)
        if changed is None:
            return out
        todo = changed[indices // self.region_rows].nonzero().squeeze(1)
        retries, first = 0, time.monotonic()
        # Lapped: a round saw a region of its rows written whole and written again (its
        # number moved by 2 or more): an add ended on them and the next began before
        # the round was done. Adds of the whole ring back to back leave a round no
        # gap to land in but the few microseconds between two adds, and rounds longer
        # than that never did (the gather spun for as long as the adds went on). From
        # then on each round asks the adds to yield, anew (another reader's end may
        # have cleared the word, and an ask older than LAPPED_HOLD_S is ignored). Not
        # in a thread holding the write lock (its pause: no add runs).
        lapped = False
        try:
            while todo.numel():
                if lapped:
                    self._ask_adds_to_yield()
                rows = indices[todo]
                regions = rows // self.region_rows
                seq1 = self._seq_at(regions)
                data = self._rows_at(rows)
                seq2 = self._seq_at(regions)
                stable = (seq1 == seq2) & ((seq1 & 1) == 0)
                out[todo[stable]] = data[stable]
                todo = todo[~stable]
                if todo.numel():
                    retries += 1
                    if not lapped and bool((seq2 - seq1 >= 2).any()):
                        lapped = not self._write_lock._semlock._is_mine()
                    if not retries % WRITER_CHECK_RETRIES:
                        self._refuse_if_writer_died(f"a gather of {todo.numel()} of them")
                    if retrying is not None and not retries % RETRY_CALL_EVERY:
                        retrying(time.monotonic() - first)
                    self._yield_to_writer()
        finally:
            if lapped:
                # A Ctrl-C before the clear (or a kill) leaves the stamp: adds ignore it
                # once LAPPED_HOLD_S old, and this thread's own at once.
                self._stop_asking()
        return out

    # The reader's steps.
    def _seq_snapshot(self, scratch: GatherScratch) -> torch.Tensor:
        return scratch.before.copy_(self._seq)

    def _copy_out(self, indices: torch.Tensor, out: torch.Tensor) -> None:
        torch.index_select(self.storage, 0, indices, out=out)

    def _changed_since(self, before: torch.Tensor, scratch: GatherScratch
                       ) -> torch.Tensor | None:
        """Regions written after ``before`` was read or being written then; None if none
        (the fast path: one comparison and a count of odd numbers, into ``scratch``)."""
        torch.bitwise_and(before, scratch.one, out=scratch.odd)
        torch.sum(scratch.odd, dim=0, out=scratch.odd_count)
        if torch.equal(before, self._seq) and not int(scratch.odd_count):
            return None
        return (before != self._seq) | (scratch.odd == 1)  # odd: being written then

    def _ask_adds_to_yield(self) -> None:
        """Stamp the ask (``__init__``) with now: the adds yield to this gather's next
        round. The thread's own stamp is kept first, so that its adds never wait for
        it (``_yield_to_lapped_gather``) and its ``_stop_asking`` clears it."""
        stamp = time.monotonic_ns() | 1  # never 0: "none asks"
        self._per_thread.asking = self._asked_mv[0] = stamp  # in this order, one statement

    def _stop_asking(self) -> None:
        """Clear the ask if it is still this thread's: another reader's, stamped since,
        stays. (Stamped between the test and the clear, it is lost until that reader's
        next round asks again: a round more.)"""
        if self._asked_mv[0] == getattr(self._per_thread, "asking", 0):
            self._asked_mv[0] = 0

    def _seq_at(self, regions: torch.Tensor) -> torch.Tensor:
        return self._seq[regions]

    def _rows_at(self, rows: torch.Tensor) -> torch.Tensor:
        return self.storage[rows]

    def _yield_to_writer(self) -> None:
        time.sleep(0)  # let the writer finish its region

    def save(self, path: str | os.PathLike[str], *,
             chunk_bytes: int = 16 << 20) -> checkpoint.Checkpoint:
        """Write rows [0, size), ptr, size, dims, layout, ``region_rows`` and
        ``check_finite`` to ``path``, atomically, with checksums (format in
        ``replay_fsm.data.checkpoint``); rows are streamed ``chunk_bytes`` at a time.

        Safe while ``add`` runs in other threads or processes: the file holds exactly
        the buffer as it was after its first ``Checkpoint.ptr`` rows were added (a
        prefix of the add history). ``add`` is blocked only for a final pass over the
        rows added since the last lock-free catch-up pass. A Ctrl-C (KeyboardInterrupt)
        anywhere in a save, an ``add`` or an ``adds_paused()`` block leaves the lock
        free and every row whole. A collector killed (SIGKILL) inside ``add`` leaves
        the write lock held and rows half written: the save raises ``WriterDied``.
        A saving process killed during its final pass leaves the lock held too, and
        every later ``add`` and ``save`` then waits for ever (a pause records no
        holder; the pipeline that watches the collector, ``Pipeline.watch``, fails
        with ``CollectorDied`` meanwhile). A symlink at ``path`` is followed (its target,
        whose folder must be writable, is replaced; the link stays); the file keeps
        the mode of the one it replaces, read-only too, or gets 0o666 less the umask.
        A save killed (SIGKILL, the OOM killer) before its rename leaves nothing
        beside ``path`` where its folder takes files without a name (O_TMPFILE:
        Linux's local file systems), in which the file is written and named only
        once whole; elsewhere it leaves its temporary file, which a later save
        removes first once it is held by no process and a minute old
        (``Checkpoint.removed`` names it).

        Raises:
            ValueError: ``chunk_bytes`` is not a positive int.
            OSError: the file could not be written (the error names ``path``; a folder,
                a path ending with a slash or an empty one is refused before anything
                is written); ``path`` is left as it was. Only where syncing the folder
                after the rename fails (EIO, say) does ``path`` already hold the new
                checkpoint, and the message says so.
            ProtocolError: called on a thread inside an ``add`` (from a signal handler
                that interrupted it): the file would hold that add half done.
            WriterDied: a process died inside an add, holding the write lock.
        """
        self._refuse_inside_add("save()")
        # A dead writer refused before any row is written; an add in progress is
        # waited out by the final pass's pause, after the lock-free ones.
        self._refuse_if_writer_died("save()")
        return checkpoint.save(self, path, chunk_bytes=chunk_bytes)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, capacity: int | None = None,
             obs_dim: int | None = None, action_dim: int | None = None,
             critic_dim: int | None = None) -> ReplayBuffer:
        """A new buffer, in shared memory, holding the checkpoint at ``path``: same
        dims, rows, ptr and size, so adds continue at the same ring position and
        batches drawn with the same seeds are the same. Each dimension given must match
        the file's. Rows are read a chunk at a time (the chunks the file was saved in)
        straight into the new storage and checked against their checksums.

        Raises:
            CheckpointError: (a ValueError) the file is not a checkpoint (or a pipe, a
                device or a socket), is truncated or corrupted, has another format version,
                has a header whose fields disagree, or does not match a given
                dimension; the message names the file and what is wrong.
            TypeError, ValueError: a dimension given is not an int, or is below what
                the constructor takes (1; 0 for ``critic_dim``): the message names it,
                and the file is not read.
            MemoryError: the buffer the file describes does not fit in shared memory
                (the message names the size and the room).
            OSError: the file cannot be read (a folder: IsADirectoryError).
        """
        return checkpoint.load(path, cls, capacity=capacity, obs_dim=obs_dim,
                               action_dim=action_dim, critic_dim=critic_dim)

    def resized(self, capacity: int) -> ReplayBuffer:
        """A new buffer in shared memory, of ``capacity`` rows and this one's dims and
        ``check_finite``, holding this one's newest ``min(size, capacity)`` rows in the
        order they were added, the oldest at position 0: how a checkpoint goes on in a
        ring of another size (``ReplayBuffer.load(path).resized(capacity)``). Its
        ``ptr`` is the count of rows it holds, not this buffer's ``ptr``, so a batch
        drawn from it with a given seed is not the one this buffer gives. Adds to this
        buffer wait while the rows are copied (``adds_paused``; it may be called
        inside such a block); until this one is dropped both are in memory.

        Raises:
            TypeError, ValueError: ``capacity`` is not an int >= 1 (as the constructor).
            MemoryError: the new buffer does not fit (as the constructor).
            ProtocolError: called on a thread inside an ``add`` (``adds_paused``).
            WriterDied: a process died inside an add, holding the write lock.
        """
        new = type(self)(capacity, self.obs_dim, self.action_dim, self.critic_dim,
                         check_finite=self.check_finite)
        with self.adds_paused():
            ptr = self.ptr
            first = ptr - min(self.size, new.capacity)
            step = max(1, RESIZE_COPY_BYTES // (self.width * 4))
            start = first
            while start < ptr:
                lo = start % self.capacity
                n = min(ptr - start, step, self.capacity - lo)  # up to the ring's end
                new.add_packed(self.storage[lo:lo + n])
                start += n
        return new
