"""Transfer backends, one per device family, behind one protocol; chosen by device=."""

from __future__ import annotations

import torch

from .base import TransferBackend

BACKENDS = ("cpu", "cuda", "accel", "emulated", "manual")


def build_backend(device: str | torch.device, backend: str | None = None,
                  **options: object) -> TransferBackend:
    """The backend for ``device`` (or the explicit ``backend`` name).

    Raises:
        ValueError: an unknown device or backend, or one this machine lacks.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r}; supported: cpu, cuda[:N], mps, xpu, "
                         "or any device type torch knows") from exc
    name = backend or {"cpu": "cpu", "cuda": "cuda"}.get(dev.type, "accel")
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; supported: {', '.join(BACKENDS)}")
    if name == "cpu":
        from .cpu import CpuBackend
        return CpuBackend(dev, **options)  # type: ignore[arg-type]
    if name == "cuda":
        from .cuda import CudaBackend
        return CudaBackend(dev, **options)  # type: ignore[arg-type]
    if name == "emulated":
        from .emulated import EmulatedBackend
        return EmulatedBackend(dev, **options)  # type: ignore[arg-type]
    if name == "manual":
        from .manual import ManualBackend
        return ManualBackend(dev, **options)  # type: ignore[arg-type]
    from .accel import AcceleratorBackend
    module = getattr(torch, dev.type, None)
    if module is None or not getattr(module, "is_available", lambda: False)():
        raise ValueError(f"device {str(dev)!r} is not available on this machine; "
                         "supported here: cpu" + (", cuda" if torch.cuda.is_available()
                                                  else ""))
    return AcceleratorBackend(dev)


__all__ = ["BACKENDS", "TransferBackend", "build_backend"]
