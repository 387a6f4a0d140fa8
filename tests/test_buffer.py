"""The replay buffer: add against a numpy model, errors, sharing, INV-ROW."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from replay_fsm.data.buffer import ReplayBuffer

from .collectors import TornMidAdd, add_whole_rings, constant_rows, write_ids
from .support import MARGIN_S, finishes_within


def fields(n: int, o: int, a: int, c: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    f = {
        "obs": rng.standard_normal((n, o)), "actions": rng.standard_normal((n, a)),
        "rewards": rng.standard_normal(n), "next_obs": rng.standard_normal((n, o)),
        "dones": rng.integers(0, 2, n).astype(np.float64),
        "truncated": rng.integers(0, 2, n).astype(np.float32),
    }
    if c:
        f["critic"] = rng.standard_normal((n, c))
        f["next_critic"] = rng.standard_normal((n, c))
    return f


def model_rows(f: dict[str, np.ndarray], mask: np.ndarray | None,
               term_obs: np.ndarray | None, term_critic: np.ndarray | None) -> np.ndarray:
    next_obs = f["next_obs"].copy()
    cols = [f["obs"], next_obs, f["actions"], f["rewards"][:, None], f["dones"][:, None],
            f["truncated"][:, None]]
    if mask is not None:
        next_obs[mask] = term_obs[mask]
    if "critic" in f:
        nc = f["next_critic"].copy()
        if mask is not None and term_critic is not None:
            nc[mask] = term_critic[mask]
        cols += [f["critic"], nc]
    return np.concatenate(cols, axis=1).astype(np.float32)


@given(capacity=st.integers(1, 40), critic=st.sampled_from([0, 2]),
       batches=st.lists(st.tuples(st.integers(1, 60), st.booleans()), min_size=1,
                        max_size=8),
       seed=st.integers(0, 2**16))
def test_add_matches_a_numpy_ring(capacity: int, critic: int,
                                  batches: list[tuple[int, bool]], seed: int) -> None:
    o, a = 3, 2
    rb = ReplayBuffer(capacity, o, a, critic, region_rows=4)
    model = np.zeros((capacity, rb.width), dtype=np.float32)
    ptr = 0
    for k, (n, terminal) in enumerate(batches):
        f = fields(n, o, a, critic, seed + k)
        kw: dict[str, object] = {}
        mask = term_obs = term_critic = None
        if terminal:
            rng = np.random.default_rng(seed + 7919 * (k + 1))
            mask = rng.integers(0, 2, n).astype(bool)
            term_obs = rng.standard_normal((n, o))
            kw = {"terminal_mask": torch.from_numpy(mask), "terminal_next_obs": term_obs}
            if critic:
                term_critic = rng.standard_normal((n, critic))
                kw["terminal_next_critic"] = term_critic
        rb.add(f["obs"], f["actions"], f["rewards"], f["next_obs"], f["dones"],
               f["truncated"], critic=f.get("critic"), next_critic=f.get("next_critic"),
               **kw)  # type: ignore[arg-type]
        for j, row in enumerate(model_rows(f, mask, term_obs, term_critic)):
            model[(ptr + j) % capacity] = row
        ptr += n
        assert rb.ptr == ptr and rb.size == min(ptr, capacity)
    np.testing.assert_array_equal(rb.storage.numpy(), model)


def test_layout_is_the_seed_order() -> None:
    rb = ReplayBuffer(4, 3, 2, 1)
    lay = rb.layout
    assert (lay.obs, lay.next_obs, lay.actions) == (slice(0, 3), slice(3, 6), slice(6, 8))
    assert (lay.rewards, lay.dones, lay.truncated) == (8, 9, 10)
    assert (lay.critic, lay.next_critic, lay.width) == (slice(11, 12), slice(12, 13), 13)
    batch = lay.views(rb.storage)
    assert set(batch) == {"obs", "next_obs", "actions", "rewards", "dones", "truncated",
                          "critic", "next_critic"}
    assert batch["rewards"].shape == (4,)


@pytest.mark.parametrize("field,bad,expected", [
    ("obs", np.zeros((5, 4)), "expected (5, 3)"),
    ("actions", np.zeros((5,)), "expected (5, 2)"),
    ("rewards", np.zeros((4,)), "expected (5,)"),
    ("next_obs", np.zeros((6, 3)), "expected (5, 3)"),
    ("dones", np.zeros((5, 2)), "expected (5,)"),
])
def test_bad_shapes_name_the_field_and_write_nothing(field: str, bad: np.ndarray,
                                                     expected: str) -> None:
    rb = ReplayBuffer(8, 3, 2)
    f = fields(5, 3, 2, 0, 0)
    f[field] = bad
    with pytest.raises(ValueError, match=field) as info:
        rb.add(f["obs"], f["actions"], f["rewards"], f["next_obs"], f["dones"],
               f["truncated"])
    assert expected in str(info.value) and "got shape" in str(info.value)
    assert rb.ptr == 0 and not rb.storage.any()


def test_missing_critic_and_bad_types() -> None:
    rb = ReplayBuffer(8, 3, 2, critic_dim=2)
    f = fields(5, 3, 2, 0, 0)
    with pytest.raises(ValueError, match="critic"):
        rb.add(f["obs"], f["actions"], f["rewards"], f["next_obs"], f["dones"],
               f["truncated"])
    with pytest.raises(TypeError, match="rewards"):
        rb.add(f["obs"], f["actions"], [0.0] * 5, f["next_obs"], f["dones"],  # type: ignore[arg-type]
               f["truncated"], critic=np.zeros((5, 2)), next_critic=np.zeros((5, 2)))
    with pytest.raises(ValueError, match="terminal_next_obs"):
        rb.add(f["obs"], f["actions"], f["rewards"], f["next_obs"], f["dones"],
               f["truncated"], terminal_mask=np.ones(5), critic=np.zeros((5, 2)),
               next_critic=np.zeros((5, 2)))
    assert rb.ptr == 0



def all_fields(n: int = 5) -> dict[str, np.ndarray]:
    """Every argument of ``add`` for ReplayBuffer(8, 3, 2, critic_dim=2), valid."""
    f = fields(n, 3, 2, 2, 0)
    f["terminal_mask"] = np.array([1, 0, 1, 0, 0][:n], dtype=np.float32)
    f["terminal_next_obs"] = np.full((n, 3), 7.0)
    f["terminal_next_critic"] = np.full((n, 2), 9.0)
    return f


# A wrong shape for each field, and the shape the message must say was expected.
BAD_SHAPES = {
    "obs": ((5, 4), "(5, 3)"), "next_obs": ((5, 4), "(5, 3)"),
    "actions": ((5, 3), "(5, 2)"), "rewards": ((4,), "(5,)"), "dones": ((5, 2), "(5,)"),
    "truncated": ((6,), "(5,)"), "terminal_mask": ((5, 2), "(5,)"),
    "terminal_next_obs": ((5, 2), "(5, 3)"), "critic": ((5, 1), "(5, 2)"),
    "next_critic": ((4, 2), "(5, 2)"), "terminal_next_critic": ((5, 3), "(5, 2)"),
}


@pytest.mark.parametrize("field", list(BAD_SHAPES))
def test_every_fields_shape_error_names_it_exactly(field: str) -> None:
    """The message starts with the field's own name, then the shape given and the one
    expected. Kills the name mutants of xǁReplayBufferǁadd (``"XXobsXX"``,
    ``"TRUNCATED"``, None, ... for each field) and x__as_float32 mutant 9 (a [5, 2]
    scalar field reshaped before the check, so the message gave another shape)."""
    rb = ReplayBuffer(8, 3, 2, critic_dim=2)
    f = all_fields()
    shape, expected = BAD_SHAPES[field]
    f[field] = np.zeros(shape)
    with pytest.raises(ValueError) as info:
        rb.add(**f)  # type: ignore[arg-type]
    assert str(info.value) == f"{field}: got shape {shape}, expected {expected}"
    assert rb.ptr == 0 and not rb.storage.any()


@pytest.mark.parametrize("obs", [np.zeros(5), np.zeros((5, 3, 1))], ids=["1-d", "3-d"])
def test_obs_that_is_not_a_matrix_is_refused_by_name(obs: object) -> None:
    """The obs check and its message, naming the shape given."""
    rb = ReplayBuffer(8, 3, 2)
    f = fields(5, 3, 2, 0, 0)
    shape = tuple(obs.shape)  # type: ignore[attr-defined]
    with pytest.raises(ValueError) as info:
        rb.add(obs, f["actions"], f["rewards"], f["next_obs"], f["dones"],  # type: ignore[arg-type]
               f["truncated"])
    assert str(info.value) == f"obs: got shape {shape}, expected (n, 3)"


@pytest.mark.parametrize("obs,expected", [
    ([[0.0] * 3] * 5, "obs must be a torch.Tensor or numpy.ndarray, got list"),
    (None, "obs must be a torch.Tensor or numpy.ndarray, got NoneType"),
    (np.full((5, 3), "a"), "obs must hold real numbers, got dtype <U1"),
], ids=["list", "None", "strings"])
def test_obs_that_is_not_an_array_of_numbers_is_a_type_error(obs: object,
                                                             expected: str) -> None:
    """What the docstring promises for a field that is not a tensor or array of real
    numbers, obs included (its shape is read first), and a string array (torch
    cannot convert it)."""
    rb = ReplayBuffer(8, 3, 2)
    f = fields(5, 3, 2, 0, 0)
    with pytest.raises(TypeError) as info:
        rb.add(obs, f["actions"], f["rewards"], f["next_obs"], f["dones"],  # type: ignore[arg-type]
               f["truncated"])
    assert str(info.value) == expected
    assert rb.ptr == 0


def test_a_field_that_is_not_an_array_names_its_type() -> None:
    """Kills x__as_float32 mutant 6 (the type name in the message)."""
    rb = ReplayBuffer(8, 3, 2)
    f = fields(5, 3, 2, 0, 0)
    with pytest.raises(TypeError) as info:
        rb.add(f["obs"], f["actions"], (0.0,) * 5, f["next_obs"], f["dones"],  # type: ignore[arg-type]
               f["truncated"])
    assert str(info.value) == "rewards must be a torch.Tensor or numpy.ndarray, got tuple"


def test_scalar_fields_are_taken_as_n_by_1_too() -> None:
    """Rewards, dones, truncated and the terminal mask may come as [n, 1] (what many
    vectorised environments return); they are stored as [n] would be, and a one-wide
    obs or action is not flattened. Kills x__as_float32 mutants 8 and 10-22."""
    flat, column = ReplayBuffer(8, 3, 2, critic_dim=2), ReplayBuffer(8, 3, 2, critic_dim=2)
    f = all_fields()
    flat.add(**f)  # type: ignore[arg-type]
    for name in ("rewards", "dones", "truncated", "terminal_mask"):
        f[name] = f[name][:, None]
    column.add(**torch_fields(f))  # type: ignore[arg-type]
    assert torch.equal(column.storage, flat.storage) and column.ptr == 5
    narrow = ReplayBuffer(8, 1, 1)
    g = fields(5, 1, 1, 0, 1)
    narrow.add(g["obs"], g["actions"], g["rewards"], g["next_obs"], g["dones"],
               g["truncated"])
    assert torch.equal(narrow.storage[:5, 0], torch.from_numpy(g["obs"][:, 0]).float())



@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fields_on_the_device_are_stored_on_the_host() -> None:
    """A collector stepping its environments on the GPU passes device tensors, the
    terminal mask too; the rows land in the CPU shared storage as host tensors would.
    Kills x__as_float32 mutants 27 and 29 (``device="cpu"`` dropped), which are
    equivalent where no accelerator exists (specs/MUTATION.md)."""
    host, device = (ReplayBuffer(8, 3, 2, critic_dim=2) for _ in range(2))
    f = all_fields()
    host.add(**f)  # type: ignore[arg-type]
    device.add(**{k: v.cuda() for k, v in torch_fields(f).items()})  # type: ignore[arg-type]
    assert torch.equal(device.storage, host.storage) and device.ptr == 5


def torch_fields(f: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in f.items()}


def test_critic_fields_come_in_pairs() -> None:
    """One of critic and next_critic is not enough for a critic buffer, and either is
    refused by a buffer without one. Kills xǁReplayBufferǁadd mutants 111 and 148-153."""
    f = fields(5, 3, 2, 2, 0)
    base = [f["obs"], f["actions"], f["rewards"], f["next_obs"], f["dones"], f["truncated"]]
    with pytest.raises(ValueError) as info:
        ReplayBuffer(8, 3, 2, critic_dim=2).add(*base, critic=f["critic"])
    assert str(info.value) == ("critic and next_critic: required, shape (5, 2), since "
                               "critic_dim=2")
    for one in ({"critic": f["critic"]}, {"next_critic": f["next_critic"]},
                {"terminal_next_critic": f["next_critic"],
                 "terminal_mask": np.ones(5, bool), "terminal_next_obs": f["next_obs"]}):
        rb = ReplayBuffer(8, 3, 2)
        with pytest.raises(ValueError) as info:
            rb.add(*base, **one)
        assert str(info.value) == ("critic, next_critic, terminal_next_critic: given, but "
                                   "this buffer has critic_dim=0")
        assert rb.ptr == 0


def test_terminal_fields_need_the_mask() -> None:
    """terminal_next_obs without terminal_mask is an error's message, and so are
    terminal next-obs or next-critic values without a mask (they were dropped without
    a word: the rows they were for kept the next_obs of the reset). Kills
    xǁReplayBufferǁadd mutants 85, 100 and 136."""
    f = all_fields()
    mask = f.pop("terminal_mask")
    rb = ReplayBuffer(8, 3, 2, critic_dim=2)
    for alone in ("terminal_next_obs", "terminal_next_critic"):
        other = "terminal_next_critic" if alone == "terminal_next_obs" else (
            "terminal_next_obs")
        with pytest.raises(ValueError) as info:
            rb.add(**{k: v for k, v in f.items() if k != other})  # type: ignore[arg-type]
        assert str(info.value) == (f"{alone}: given without terminal_mask, which says "
                                   "the rows it replaces")
        assert rb.ptr == 0
    rb.add(**f, terminal_mask=np.zeros(5, bool))  # type: ignore[arg-type]
    assert torch.equal(rb.storage[:5, rb.layout.next_critic],
                       torch.from_numpy(f["next_critic"]).float())
    f.pop("terminal_next_obs")
    with pytest.raises(ValueError) as info:
        rb.add(**f, terminal_mask=mask)  # type: ignore[arg-type]
    assert str(info.value) == "terminal_next_obs: required when terminal_mask is given"


DIMS = {"capacity": 8, "obs_dim": 3, "action_dim": 2, "critic_dim": 1}


@pytest.mark.parametrize("name", list(DIMS))
@pytest.mark.parametrize("value", [np.int64(4), np.int32(4), np.uint8(4), 4])
def test_dimensions_accept_ints_and_numpy_integers(name: str, value: object) -> None:
    rb = ReplayBuffer(**{**DIMS, name: value})  # type: ignore[arg-type]
    assert getattr(rb, name) == 4 and type(getattr(rb, name)) is int
    assert rb.storage.shape == (rb.capacity, rb.width)


@pytest.mark.parametrize("name,value", [
    (name, value) for name in [*DIMS, "region_rows"]
    for value in [True, np.bool_(True), 2.0, np.float32(2), "2"]
] + [(name, None) for name in DIMS])  # None is region_rows' default
def test_dimensions_refuse_bools_floats_and_others(name: str, value: object) -> None:
    with pytest.raises(TypeError) as info:
        ReplayBuffer(**{**DIMS, name: value})  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith(name) and repr(value) in message and "int" in message


@pytest.mark.parametrize("name,value,low", [
    ("capacity", 0, 1), ("capacity", -1, 1), ("obs_dim", 0, 1), ("action_dim", -3, 1),
    ("critic_dim", -1, 0), ("region_rows", 0, 1), ("capacity", np.int64(0), 1),
])
def test_dimensions_out_of_range_name_the_argument(name: str, value: int, low: int) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must be an int >= {low}, got {value}$"):
        ReplayBuffer(**{**DIMS, name: value})  # type: ignore[arg-type]


def test_check_finite_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="check_finite"):
        ReplayBuffer(8, 3, 2, check_finite=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int16])
def test_add_packed_takes_a_numpy_array(dtype: type) -> None:
    rb = ReplayBuffer(8, 3, 2)
    rows = np.arange(5 * rb.width).reshape(5, rb.width).astype(dtype)
    rb.add_packed(rows)
    assert rb.ptr == 5
    assert torch.equal(rb.storage[:5], torch.from_numpy(rows.astype(np.float32)))


@pytest.mark.parametrize("dtype", [">f4", ">f8", ">i4", "<f8"])
@pytest.mark.parametrize("writeable", [True, False])
def test_arrays_of_either_byte_order_read_only_or_not_are_taken(
        dtype: str, writeable: bool, recwarn: pytest.WarningsRecorder) -> None:
    """torch refused a big-endian array with its own message naming no field, and
    warned of "undefined behavior" for a read-only one, which the buffer only reads."""
    rb = ReplayBuffer(8, 3, 2)
    rows = np.arange(2 * rb.width).reshape(2, rb.width).astype(dtype)
    obs, action = np.ones((2, 3), dtype=dtype), np.full((2, 2), 2, dtype=dtype)
    scalar = np.zeros(2, dtype=dtype)
    for a in (rows, obs, action, scalar):
        a.flags.writeable = writeable
    rb.add_packed(rows)
    rb.add(obs, action, scalar, obs, scalar, scalar)
    assert torch.equal(rb.storage[:2], torch.from_numpy(rows.astype(np.float32)))
    assert torch.equal(rb.storage[2:4, rb.layout.actions], torch.full((2, 2), 2.0))
    assert not [w for w in recwarn if "not writable" in str(w.message)]


@pytest.mark.parametrize("make", [lambda *shape: torch.ones(*shape).to_sparse(),
                                  lambda *shape: torch.ones(*shape, device="meta")],
                         ids=["sparse", "meta"])
def test_a_tensor_without_dense_data_is_refused_before_the_write_lock(
        make: Callable[..., torch.Tensor]) -> None:
    """A sparse one failed inside the lock (NotImplementedError), and counted as an
    add cut short, which sends every later save down its slow path."""
    rb = ReplayBuffer(8, 3, 2)
    with pytest.raises(TypeError, match="rows must be a dense tensor with data"):
        rb.add_packed(make(2, 11))
    with pytest.raises(TypeError, match="obs must be a dense tensor with data"):
        rb.add(make(2, 3), *[torch.zeros(2, 2), torch.zeros(2), torch.zeros(2, 3),
                             torch.zeros(2), torch.zeros(2)])
    assert (rb.ptr, rb.adds_cut_short) == (0, 0)


@pytest.mark.parametrize("bad,error,expected", [
    (np.zeros((5, 3)), ValueError, "rows: got shape (5, 3), expected (n, 11)"),
    (torch.zeros(2, 12), ValueError, "rows: got shape (2, 12), expected (n, 11)"),
    (torch.zeros(11), ValueError, "rows: got shape (11,), expected (n, 11)"),
    ([[0.0] * 11], TypeError, "rows must be a torch.Tensor or numpy.ndarray, got list"),
    (np.zeros((2, 11), dtype=np.complex64), TypeError, "rows must hold real numbers"),
])
def test_add_packed_refuses_bad_rows(bad: object, error: type, expected: str) -> None:
    rb = ReplayBuffer(8, 3, 2)
    with pytest.raises(error) as info:
        rb.add_packed(bad)  # type: ignore[arg-type]
    assert expected in str(info.value)
    assert rb.ptr == 0


@pytest.mark.parametrize("field,column,value", [
    ("obs", 1, np.nan), ("next_obs", 2, np.inf), ("actions", 0, -np.inf),
    ("rewards", None, np.nan), ("truncated", None, np.inf), ("critic", 1, np.nan),
    ("next_critic", 0, np.nan),
])
def test_check_finite_names_the_row_and_field_and_writes_nothing(
        field: str, column: int | None, value: float) -> None:
    rb = ReplayBuffer(16, 3, 2, critic_dim=2, check_finite=True)
    rb.add_packed(constant_rows(rb, 1, 4))
    f = fields(5, 3, 2, 2, 0)
    if column is None:
        f[field][3] = value
    else:
        f[field][3, column] = value
    with pytest.raises(ValueError) as info:
        rb.add(f["obs"], f["actions"], f["rewards"], f["next_obs"], f["dones"],
               f["truncated"], critic=f["critic"], next_critic=f["next_critic"])
    name = field if column is None else f"{field}[{column}]"
    assert str(info.value).startswith(f"row 3 of the batch: {name} is {value}")
    assert "check_finite" in str(info.value) and "nothing was written" in str(info.value)
    assert rb.ptr == 4 and torch.equal(rb.storage[:4], constant_rows(rb, 1, 4))
    assert not rb.storage[4:].any()


def test_check_finite_covers_add_packed_and_is_off_by_default() -> None:
    rows = constant_rows(ReplayBuffer(4, 3, 2), 1, 3)
    rows[2, 9] = float("nan")  # the done flag of the third row
    checked = ReplayBuffer(4, 3, 2, check_finite=True)
    with pytest.raises(ValueError, match=r"^row 2 of the batch: dones is nan"):
        checked.add_packed(rows)
    assert checked.ptr == 0
    unchecked = ReplayBuffer(4, 3, 2)
    unchecked.add_packed(rows)
    assert unchecked.ptr == 3 and torch.isnan(unchecked.storage[2, 9])
    checked.add_packed(rows[:2])  # finite rows still go in
    assert checked.ptr == 2


def test_layout_names_every_column() -> None:
    lay = ReplayBuffer(4, 2, 1, 1).layout
    names = [lay.column_name(c) for c in range(lay.width)]
    assert names == ["obs[0]", "obs[1]", "next_obs[0]", "next_obs[1]", "actions[0]",
                     "rewards", "dones", "truncated", "critic[0]", "next_critic[0]"]
    # Kills xǁLayoutǁcolumn_name mutant 32 (the message).
    with pytest.raises(IndexError, match=r"^column 10 is outside a row of width 10$"):
        lay.column_name(lay.width)


def test_storage_is_shared_with_a_spawned_process() -> None:
    rb = ReplayBuffer(64, 3, 2, region_rows=8)
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=write_ids, args=(rb, 2, 10))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    assert rb.ptr == 20 and rb.size == 20
    assert torch.equal(rb.storage[:20], constant_rows(rb, 1, 20))


def _assert_untorn(batch: torch.Tensor) -> None:
    assert torch.equal(batch, batch[:, :1].expand_as(batch)), "INV-ROW: torn row"


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_inv_row_gathers_never_see_a_torn_row(writer: str) -> None:
    """INV-ROW: rows whose every column carries the same id, written while gathered.
    Gathers go on back to back while a writer (a thread or a process) adds; every
    tenth add stops with the left half of its rows' columns written, all 1024 of
    them torn in the storage (``TornMidAdd``), until a gather's retry round lets it
    go on. So 30 gathers meet an add halfway whatever the schedule (drawn while the
    adds ran free, every gather could fall between two adds): a gather begun during
    the stop must read the add's rows again, and return them whole, none older than
    the add. Mutants of replay_fsm/data/buffer.py that fail it, thread and process,
    at the first stop: ``_changed_since`` that always answers None (no gather reads
    again) or ignores odd numbers (``before != self._seq`` only), and
    ``_end_region_write`` called before ``_copy_in`` (in ``_write_region``)."""
    ctx = mp.get_context("spawn")
    rb = TornMidAdd(4096, 120, 16, region_rows=64)
    rb.add_packed(constant_rows(rb, 1, 4096))  # row p holds id p + 1
    batches, batch, every = 300, 1024, 10  # add k: rows (k % 4) * 1024.., 10_000 + k * 1024..
    rb.arm(ctx, MARGIN_S, every)
    args = (rb, batches, batch, 10_000)
    w = (threading.Thread(target=write_ids, args=args, daemon=True) if writer == "thread"
         else ctx.Process(target=write_ids, args=args, daemon=True))
    out = torch.empty(2048, rb.width)
    gen = torch.Generator().manual_seed(0)
    start_ptr = rb.ptr

    def gathered() -> torch.Tensor:
        idx = torch.randint(0, 4096, (2048,), generator=gen)
        _assert_untorn(rb.gather(idx, out))
        assert (((out[:, 0] - 10_000) % 4096 == idx) | (out[:, 0] == idx + 1)).all()
        return idx
    w.start()
    try:
        until = time.monotonic() + MARGIN_S
        while rb.let_go < batches // every:
            gathered()  # meets the adds wherever they are (a stop too, at times)
            k = every * (rb.let_go + 1) - 1  # the add to stop next
            rb.held = rb.halfway.acquire(block=False)
            if not rb.held:
                assert time.monotonic() < until, f"add {k} never stopped halfway"
                continue
            idx = gathered()
            assert not rb.held, f"the gather met add {k} halfway and never read it again"
            new = idx // 1024 == k % 4  # the add's rows, of it or a later add: none older
            assert (out[new, 0] >= 10_000 + k * 1024).all()
            until = time.monotonic() + MARGIN_S
    finally:
        rb.free.set()
        rb.go_on.release()  # an add stopped when a check failed goes on
        w.join(MARGIN_S)
    assert rb.ptr == start_ptr + batches * batch
    assert writer == "thread" or w.exitcode == 0  # type: ignore[union-attr]


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_gathers_of_the_whole_ring_while_it_is_rewritten_back_to_back_end_whole(
        writer: str) -> None:
    """INV-ROW and the gather's liveness against a writer whose every add rewrites the
    whole ring, back to back (the lapped gather, tests/test_seqlock.py): each gather
    of every row returns whole rows, of one add or two, and none waits for the
    writer to stop (a bound, not a timing: MARGIN_S for all of them). At this size a
    gather that never asks the adds to yield ends too (helper-92): the ask itself is
    the Lapping test's (tests/test_seqlock.py); this one checks the rows it hands out
    under a real writer, thread and process."""
    rb = ReplayBuffer(4096, 120, 16, region_rows=64)
    rb.add_packed(constant_rows(rb, 1, 4096))
    ctx = mp.get_context("spawn")
    stop, going = ctx.Event(), ctx.Event()
    w = (threading.Thread(target=add_whole_rings, args=(rb, stop, going), daemon=True)
         if writer == "thread" else
         ctx.Process(target=add_whole_rings, args=(rb, stop, going), daemon=True))
    w.start()
    out = torch.empty(4096, rb.width)
    indices = torch.randperm(4096, generator=torch.Generator().manual_seed(0))

    def gathers() -> int:
        assert going.wait(MARGIN_S), "the writer never added"
        for _ in range(10):
            _assert_untorn(rb.gather(indices, out))
            assert ((out[:, 0] - 1) % 4096 == indices).all()  # each row its own slot's
        return rb.ptr
    try:
        ok, got = finishes_within(gathers)
    finally:
        stop.set()
        w.join(MARGIN_S)
    assert ok and got[0] > 4096, got


@pytest.mark.parametrize("critic", [0, 2])
def test_pack_is_the_inverse_of_views(critic: int) -> None:
    rb = ReplayBuffer(8, 3, 2, critic)
    packed = torch.arange(5 * rb.width, dtype=torch.float32).reshape(5, rb.width)
    batch = rb.layout.views(packed)
    names = {"obs", "next_obs", "actions", "rewards", "dones", "truncated"}
    assert set(batch) == (names | {"critic", "next_critic"} if critic else names)
    if not critic:
        assert rb.layout.critic is None and rb.layout.next_critic is None
    if critic:
        assert torch.equal(batch["critic"], packed[:, 11:13])
        assert torch.equal(batch["next_critic"], packed[:, 13:15])
    assert torch.equal(rb.layout.pack(batch), packed)


@pytest.mark.parametrize("capacity,rows", [(1000, 64), (65_537, 65), (102_400, 100),
                                           (102_401, 101)])
def test_the_default_region_is_a_1024th_of_the_buffer_and_at_least_64_rows(
        capacity: int, rows: int) -> None:
    rb = ReplayBuffer(capacity, 1, 1)
    assert rb.region_rows == rows and type(rb.region_rows) is int


def test_rows_ever_written_count_past_float_precision() -> None:
    """ptr counts every row ever added (int64): a long run adds far more than 2**24."""
    rb = ReplayBuffer(8, 1, 1)
    rb._counters[0] = 2**24 + 1  # as if that many rows had been added before
    rb._counters[1] = 8
    rb.add_packed(torch.zeros(2, rb.width))
    assert rb.ptr == 2**24 + 3 and rb.size == 8  # odd: no float32 is that number


def test_the_finite_check_applies_to_the_values_stored() -> None:
    """A float64 row beyond float32's range becomes infinity when stored: refused."""
    rb = ReplayBuffer(8, 3, 2, check_finite=True)
    with pytest.raises(ValueError, match=r"^row 0 of the batch: obs\[0\] is inf"):
        rb.add_packed(torch.full((1, rb.width), 1e300, dtype=torch.float64))
    assert rb.ptr == 0


@pytest.mark.parametrize("shape,dtype", [((3, 11), torch.float32), ((2, 12), torch.float32),
                                         ((2,), torch.float32), ((2, 11), torch.float64)])
def test_gather_refuses_an_out_of_the_wrong_shape(shape: tuple[int, ...],
                                                  dtype: torch.dtype) -> None:
    """torch's index_select would resize ``out`` (a warning at most): the caller's
    tensor is refused instead, untouched; so is one of another dtype."""
    rb = ReplayBuffer(8, 3, 2)
    rb.add_packed(constant_rows(rb, 1, 4))
    out = torch.full(shape, -1.0, dtype=dtype)
    with pytest.raises(ValueError) as info:
        rb.gather(torch.tensor([0, 3]), out)
    assert str(info.value) == (f"out: got {dtype} of shape {shape}, expected torch.float32 "
                               f"of (2, 11) for 2 indices")
    assert out.shape == shape and bool((out == -1).all())


def test_gather_of_what_is_not_a_tensor_is_a_type_error() -> None:
    rb = ReplayBuffer(8, 3, 2)
    rb.add_packed(constant_rows(rb, 1, 4))
    with pytest.raises(TypeError, match="^indices and out must be tensors, got list and "
                                        "Tensor$"):
        rb.gather([0, 3], torch.empty(2, rb.width))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="^indices and out must be tensors, got Tensor and "
                                        "ndarray$"):
        rb.gather(torch.tensor([0, 3]), np.empty((2, rb.width), np.float32))  # type: ignore[arg-type]


@pytest.mark.parametrize("indices, error, message", [
    (torch.tensor([0.0, 3.0]), TypeError,
     "indices must hold row numbers as torch.int64 (or torch.int32), got torch.float32"),
    (torch.tensor([True, False]), TypeError,
     "indices must hold row numbers as torch.int64 (or torch.int32), got torch.bool"),
    (torch.tensor([[0, 3]]), ValueError, "indices must be one-dimensional, got shape (1, 2)"),
    (torch.tensor(3), ValueError, "indices must be one-dimensional, got shape ()"),
])
def test_gather_refuses_indices_that_are_not_a_vector_of_row_numbers(
        indices: torch.Tensor, error: type[Exception], message: str) -> None:
    """torch's own words were a RuntimeError ("index_select(): Expected dtype int32 or
    int64 for index") or an IndexError ("Index is supposed to be a vector"; "tuple
    index out of range" for a 0-d tensor), none naming the argument (helper-89)."""
    rb = ReplayBuffer(8, 3, 2)
    rb.add_packed(constant_rows(rb, 1, 4))
    out = torch.full((2, rb.width), -1.0)
    with pytest.raises(error) as info:
        rb.gather(indices, out)
    assert str(info.value) == message
    assert bool((out == -1).all())
    assert torch.equal(rb.gather(torch.tensor([0, 3], dtype=torch.int32), out),
                       rb.storage[[0, 3]])


def test_a_buffer_pickled_outside_a_spawn_is_refused_before_its_rows_are_copied() -> None:
    """pickle.dumps (a queue, a pool) copied the whole storage before the write lock
    refused it (27 s and 6.1 GiB for a 2 GiB buffer; helper-68); copy.copy still
    gives another handle on the same rows."""
    import copy
    import pickle

    rb = ReplayBuffer(64, 2, 1)
    with pytest.raises(RuntimeError, match="ReplayBuffer objects should only be shared "
                       "between processes through inheritance"):
        pickle.dumps(rb)
    other = copy.copy(rb)
    other.add_packed(torch.ones(3, rb.width))
    assert rb.ptr == 3 and torch.equal(rb.storage[:3], torch.ones(3, rb.width))


@given(capacity=st.integers(1, 12), region_rows=st.integers(1, 4),
       ptr=st.integers(0, 40), a=st.integers(0, 12), length=st.integers(1, 12),
       step=st.sampled_from([1, 2]), kind=st.sampled_from(["tensor", "numpy"]))
@example(capacity=10, region_rows=2, ptr=17, a=2, length=6, step=1, kind="tensor")
@example(capacity=10, region_rows=2, ptr=13, a=1, length=5, step=1, kind="tensor")
@example(capacity=10, region_rows=2, ptr=17, a=2, length=6, step=1, kind="numpy")
def test_rows_added_from_the_buffers_own_storage_are_the_rows_it_held(
        capacity: int, region_rows: int, ptr: int, a: int, length: int, step: int,
        kind: str) -> None:
    """add_packed(rb.storage[a:b]): a wrapped add's first copy overwrote source rows
    its second then read (row 7 of 2..7 came back as row 2), and a copy onto rows
    overlapping its source was refused by torch inside the lock, an add cut short."""
    rb = ReplayBuffer(capacity, 1, 1, region_rows=region_rows)
    rb.add_packed(constant_rows(rb, 1, capacity))
    rb.adopt_rows(max(ptr, capacity))
    source = rb.storage[min(a, capacity - 1):a + length:step]
    model = rb.storage.clone()
    for j, row in enumerate(source.clone()):
        model[(rb.ptr + j) % capacity] = row
    rb.add_packed(source if kind == "tensor" else source.numpy())
    assert torch.equal(rb.storage, model)
    assert rb.adds_cut_short == 0


def test_add_of_fields_viewing_the_storage_copies_them_first() -> None:
    """add(...) packs its fields into rows of its own before it writes: a wrapped add
    of the buffer's own rows stores them as they were."""
    rb = ReplayBuffer(10, 1, 1, region_rows=2)
    rb.add_packed(constant_rows(rb, 1, 10))
    rb.adopt_rows(17)
    s, lay = rb.storage, rb.layout
    expected = s[2:8].clone()
    rb.add(s[2:8, lay.obs], s[2:8, lay.actions], s[2:8, lay.rewards], s[2:8, lay.next_obs],
           s[2:8, lay.dones], s[2:8, lay.truncated])
    assert torch.equal(torch.cat([s[7:], s[:3]]), expected)
