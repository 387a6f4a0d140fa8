"""Checkpoint figures, all in one run on the same disk:
- ReplayBuffer.save (chunked, checksummed, fsync, rename, directory fsync) vs a raw
  torch.save of the same rows followed by fsync vs a dd-like sequential write of the
  same bytes with fsync (the disk's speed);
- ReplayBuffer.load vs torch.load vs a sequential read of the same bytes, cold (the
  file's pages dropped from the page cache with posix_fadvise, which touches no other
  file) and warm; and within our load, the part spent reading and checking the rows
  (the rest is constructing the buffer: its shared memory made);
- the longest an add waits while a save runs and a thread keeps adding, flat out (a
  worst case: the catch-up passes cannot converge and the locked pass writes every
  row again) and paced at about 100k rows/s (an environment-bound collector).

GB/s are bytes of rows (size x width x 4) per second. Rounds interleave the
contenders so drift hits them alike; figures are medians over rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from replay_fsm.data import checkpoint
from replay_fsm.data.buffer import ReplayBuffer

try:
    from common import table, write_result
except ImportError:
    from benchmarks.common import table, write_result

CHUNK = 16 << 20


def drop_cache(path: Path) -> None:
    """Evict ``path``'s (clean, fsynced) pages so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def dd_write(path: Path, data: memoryview) -> None:
    """Sequential write of ``data`` in 16 MiB blocks, then fsync: the disk's speed."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for i in range(0, len(data), CHUNK):
            os.write(fd, data[i:i + CHUNK])
        os.fsync(fd)
    finally:
        os.close(fd)


def dd_read(path: Path, into: memoryview) -> None:
    with open(path, "rb", buffering=0) as f:
        for i in range(0, len(into), CHUNK):
            f.readinto(into[i:i + CHUNK])


def torch_save(path: Path, rows: torch.Tensor) -> None:
    with open(path, "wb") as f:
        torch.save(rows, f)
        f.flush()
        os.fsync(f.fileno())  # the same durability as the other two


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - t0
    del result  # freeing a loaded 1 GB buffer is not part of loading it
    return elapsed


def remove(path: Path) -> None:
    """Delete ``path`` and commit that, so that no write pays for freeing the blocks of
    the file it replaces (on a filesystem mounted with discard that costs as much as
    a write)."""
    if path.exists():
        path.unlink()
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def add_wait_during_save(rb: ReplayBuffer, path: Path,
                         pause_s: float) -> tuple[float, float, int]:
    """Max and median seconds one add of 256 rows takes while ``rb`` is saved, with
    ``pause_s`` between adds, and the rows added during the save."""
    rows = torch.randn(256, rb.width)
    stop = threading.Event()
    waits: list[float] = []

    def collector() -> None:
        while not stop.is_set():
            waits.append(timed(lambda: rb.add_packed(rows)))
            if pause_s:
                time.sleep(pause_s)  # the environment steps between adds

    thread = threading.Thread(target=collector)
    before = rb.ptr
    thread.start()
    try:
        ck = rb.save(path)
    finally:
        stop.set()
        thread.join()
    return max(waits), statistics.median(waits), ck.ptr - before


def time_reading_rows(into: list[float]) -> None:
    """Append to ``into`` the seconds each load spends reading and checking rows."""
    read_rows = checkpoint._read_rows

    def timed_read_rows(*args: Any) -> None:
        into.append(timed(lambda: read_rows(*args)))

    checkpoint._read_rows = timed_read_rows  # type: ignore[assignment]


def fs_of(directory: Path) -> str:
    best = ("", "?")
    with open("/proc/mounts") as f:
        for line in f:
            _, mount, fstype = line.split()[:3]
            if str(directory.resolve()).startswith(mount) and len(mount) > len(best[0]):
                best = (mount, fstype)
    return f"{best[1]} on {best[0]}"


def main(quick: bool = False, directory: str | None = None) -> dict[str, float]:
    rows, width = (32_000, 500) if quick else (500_000, 500)  # 64 MB / 1 GB of rows
    rounds = 2 if quick else 5
    work = Path(tempfile.mkdtemp(prefix="replay_fsm_ckpt_", dir=directory))
    o = (width - 3) // 2 - 1
    rb = ReplayBuffer(rows, o, width - 3 - 2 * o)
    assert rb.width == width
    rb.add_packed(torch.randn(rows, width))
    nbytes = rows * width * 4
    raw = memoryview(rb.storage.numpy()).cast("B")
    scratch = torch.empty(rows, width)
    into = memoryview(scratch.numpy()).cast("B")
    paths = {"ours": work / "rb.ckpt", "torch": work / "rb.pt", "dd": work / "rb.raw"}
    writes: dict[str, Callable[[], object]] = {
        "ours": lambda: rb.save(paths["ours"]),
        "torch": lambda: torch_save(paths["torch"], rb.storage),
        "dd": lambda: dd_write(paths["dd"], raw),
    }
    reads: dict[str, Callable[[], object]] = {
        "ours": lambda: ReplayBuffer.load(paths["ours"]),
        "torch": lambda: torch.load(paths["torch"]),
        "dd": lambda: dd_read(paths["dd"], into),
    }
    samples: dict[str, list[float]] = {f"{k}_{w}": [] for k in writes
                                       for w in ("save", "load_cold", "load_warm")}
    reading: list[float] = []
    time_reading_rows(reading)
    try:
        for r in range(rounds):
            order = list(writes) if r % 2 == 0 else list(reversed(writes))
            for name in order:
                remove(paths[name])
                samples[f"{name}_save"].append(timed(writes[name]))
            for name in order:
                drop_cache(paths[name])
                samples[f"{name}_load_cold"].append(timed(reads[name]))
                samples[f"{name}_load_warm"].append(timed(reads[name]))
            samples.setdefault("ours_read_rows_cold", []).append(reading[-2])
            samples.setdefault("ours_read_rows_warm", []).append(reading[-1])
        assert torch.equal(ReplayBuffer.load(paths["ours"]).storage, rb.storage)
        file_bytes = paths["ours"].stat().st_size
        flat_out = add_wait_during_save(rb, paths["ours"], 0.0)
        paced = add_wait_during_save(rb, paths["ours"], 256 / 100_000)
    finally:
        for p in work.iterdir():
            p.unlink()
        work.rmdir()
    figures: dict[str, float] = {}
    for key, values in samples.items():
        figures[f"{key}_s"] = statistics.median(values)
        figures[f"{key}_GBps"] = nbytes / statistics.median(values) / 1e9
    figures["save_vs_disk"] = figures["ours_save_GBps"] / figures["dd_save_GBps"]
    figures["save_vs_torch_save"] = figures["ours_save_GBps"] / figures["torch_save_GBps"]
    figures["load_cold_vs_disk"] = figures["ours_load_cold_GBps"] / figures["dd_load_cold_GBps"]
    figures["load_cold_vs_torch_load"] = (figures["ours_load_cold_GBps"]
                                          / figures["torch_load_cold_GBps"])
    figures["file_overhead_bytes"] = file_bytes - nbytes
    figures["read_rows_share_of_warm_load"] = (figures["ours_read_rows_warm_s"]
                                               / figures["ours_load_warm_s"])
    for name, (max_wait, median_wait, rows_added) in (("flat_out", flat_out),
                                                      ("paced", paced)):
        figures[f"add_max_wait_during_save_{name}_ms"] = max_wait * 1e3
        figures[f"add_median_wait_during_save_{name}_ms"] = median_wait * 1e3
        figures[f"rows_added_during_save_{name}"] = rows_added
    config = {"rows": rows, "width": width, "bytes": nbytes, "rounds": rounds,
              "chunk_bytes": 16 << 20, "filesystem": fs_of(work.parent),
              "writes": "each to a new file (the previous one deleted before timing)",
              "torch_save": "torch.save into an open file, then fsync",
              "cold": "posix_fadvise(DONTNEED) on the file before the read"}
    write_result("checkpoint", config, figures, quick=quick)
    g = figures
    print(table(f"checkpoint of {nbytes / 1e9:.2f} GB of rows ({rows} x {width} float32), "
                f"{config['filesystem']} (median of {rounds})", [
        ("ReplayBuffer.save / load", f"{g['ours_save_GBps']:.2f}",
         f"{g['ours_load_cold_GBps']:.2f}", f"{g['ours_load_warm_GBps']:.2f}"),
        ("torch.save + fsync / torch.load", f"{g['torch_save_GBps']:.2f}",
         f"{g['torch_load_cold_GBps']:.2f}", f"{g['torch_load_warm_GBps']:.2f}"),
        ("disk: sequential write + fsync / read", f"{g['dd_save_GBps']:.2f}",
         f"{g['dd_load_cold_GBps']:.2f}", f"{g['dd_load_warm_GBps']:.2f}"),
    ], ("contender", "save GB/s", "load cold GB/s", "load warm GB/s")))
    print(f"save vs disk {g['save_vs_disk']:.2f}, vs torch.save {g['save_vs_torch_save']:.2f};"
          f" cold load vs disk {g['load_cold_vs_disk']:.2f}, vs torch.load "
          f"{g['load_cold_vs_torch_load']:.2f}")
    print(f"within our load, reading and checking the rows: {g['ours_read_rows_cold_GBps']:.2f}"
          f" GB/s cold, {g['ours_read_rows_warm_GBps']:.2f} warm; constructing the buffer is "
          f"{1 - g['read_rows_share_of_warm_load']:.0%} of a warm load")
    for name in ("flat_out", "paced"):
        print(f"add of 256 rows during a save, collector {name.replace('_', ' ')}: max "
              f"{g[f'add_max_wait_during_save_{name}_ms']:.1f} ms, median "
              f"{g[f'add_median_wait_during_save_{name}_ms']:.3f} ms "
              f"({g[f'rows_added_during_save_{name}']:.0f} rows added during the save)")
    return figures


def _args() -> Any:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    return ap.parse_args()


if __name__ == "__main__":
    args = _args()
    main(args.quick, args.dir)
