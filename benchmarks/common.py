"""Shared helpers: machine facts, timing, result files and tables."""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "platform": platform.platform(), "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    cache = last_level_cache_mib()
    if cache is not None:
        info["last_level_cache_mib"] = cache
    return info


def last_level_cache_mib(caches: Path = Path("/sys/devices/system/cpu/cpu0/cache")
                         ) -> float | None:
    """The size of CPU 0's last-level cache in MiB (Linux sysfs: ``caches``), None
    where unknown: whether a gather beside the learner's step evicts its working set
    depends on it."""
    best: tuple[int, float] | None = None
    for index in caches.glob("index*"):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 / 1024, "M": 1.0, "G": 1024.0}.get(size[-1:].upper())
        if scale is None or not size[:-1].isdigit():
            continue
        if best is None or level > best[0]:
            best = (level, int(size[:-1]) * scale)
    return None if best is None else best[1]


def steady_malloc() -> bool:
    """Make glibc malloc serve every allocation from the heap and keep freed heap
    pages, so a learner step's large temporaries reuse memory in every process alike.
    glibc's default maps large blocks fresh (page faults at every call) or not,
    depending on what the process freed before: the same matmul step took about
    3.5 ms in one process and 9 to 11 ms in another. A fixed mmap threshold is capped
    at 32 MiB, which the cost model's largest batches exceed, so no block is mapped at
    all. Returns whether it applied (glibc only); call it first."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):  # not glibc; Windows has no CDLL(None)
        return False
    m_trim_threshold, m_mmap_max = -1, -4
    mapped_off = bool(mallopt(m_mmap_max, 0))
    trim_set = bool(mallopt(m_trim_threshold, 1 << 30))
    return mapped_off and trim_set


def device_argument(name: str) -> str:
    """``--device``'s check, for argparse: ``name`` when torch can run there, so that a
    misspelt device or one this machine lacks is refused before the first benchmark
    runs, not minutes later in the learner loop (the only one that uses it).

    Raises:
        argparse.ArgumentTypeError: torch does not know the device, or this machine
            has no such device.
    """
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise argparse.ArgumentTypeError(f"{name!r} is not a torch device ({exc})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{name!r}: this torch has no CUDA device here")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(
            f"{name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{name!r}: the benchmarks run on cpu or cuda")
    return name


def median_time(fn: Callable[[], object], *, repeat: int, number: int = 1,
                warmup: int = 1) -> float:
    """Median seconds per call of ``fn`` over ``repeat`` rounds of ``number`` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - t0) / number)
    return statistics.median(samples)


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (0 <= q <= 1): the value at rank
    ``int(q * len)`` of the sorted values, the last for q = 1."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


BY_MACHINE = RESULTS / "by_machine"


def write_result(name: str, config: dict[str, Any], figures: dict[str, Any],
                 *, quick: bool = False) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}{'-quick' if quick else ''}.json"
    path.write_text(json.dumps({"name": name, "machine": machine(), "config": config,
                                "figures": figures, "quick": quick,
                                "date": time.strftime("%Y-%m-%d", time.gmtime())},
                               indent=2) + "\n")
    return path


def machine_slug(info: dict[str, Any]) -> str:
    """A file name for a machine: its CPU model and core count (``amd-epyc-2cpu``)."""
    words = "".join(c if c.isalnum() else " " for c in str(info.get("cpu", "unknown")))
    cpu = "-".join(w for w in words.lower().split() if w not in ("r", "tm", "processor"))
    return f"{cpu or 'unknown'}-{info.get('cpus', 0)}cpu"


def keep_by_machine(path: Path) -> Path:
    """Keep a full run's result file as its machine's latest too
    (``results/by_machine/<name>-<machine>.json``): the README sets the budget's claims
    side by side for every machine kept. Returns the copy's path."""
    text = path.read_text()
    result = json.loads(text)
    BY_MACHINE.mkdir(parents=True, exist_ok=True)
    copy = BY_MACHINE / f"{result['name']}-{machine_slug(result['machine'])}.json"
    copy.write_text(text)
    return copy


def table(title: str, rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True))  # noqa: E731
    out = [title, line(header), line(tuple("-" * w for w in widths))]
    out += [line(r) for r in rows]
    return "\n".join(out)
