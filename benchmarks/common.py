"""Shared helpers: machine facts, timing, result files and tables."""

from __future__ import annotations

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
    return info


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


def write_result(name: str, config: dict[str, Any], figures: dict[str, Any],
                 *, quick: bool = False) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}{'-quick' if quick else ''}.json"
    path.write_text(json.dumps({"name": name, "machine": machine(), "config": config,
                                "figures": figures, "quick": quick}, indent=2) + "\n")
    return path


def table(title: str, rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True))  # noqa: E731
    out = [title, line(header), line(tuple("-" * w for w in widths))]
    out += [line(r) for r in rows]
    return "\n".join(out)
