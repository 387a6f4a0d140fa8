"""Transfer backends, one per device family, behind one protocol, found by name.

``device=`` picks the default backend of its device type (cpu, cuda, or the
portable ``accel`` for mps, xpu and any device torch knows); ``backend=`` names a
registered backend or passes an instance. ``register_backend`` adds a name: a
backend written in your own file is as good as a built-in one.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch

from .base import TransferBackend, available_device, parse_device

Factory = Callable[..., TransferBackend]

# Built-ins load on first use: (module, class).
_BUILTIN: dict[str, tuple[str, str]] = {
    "cpu": ("cpu", "CpuBackend"),
    "cuda": ("cuda", "CudaBackend"),
    "accel": ("accel", "AcceleratorBackend"),
    "emulated": ("emulated", "EmulatedBackend"),
    "manual": ("manual", "ManualBackend"),
}
_REGISTERED: dict[str, Factory] = {}


def register_backend(name: str, factory: Factory, *, replace: bool = False) -> None:
    """Make ``backend=name`` build ``factory(device, **backend_options)``.

    Raises:
        ValueError: ``name`` is taken (pass ``replace=True`` to rebind it).
        TypeError: ``name`` is not a non-empty str (``backend=`` takes a str as a
            name, anything else as a backend), or ``factory`` is not callable.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"a backend's name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise TypeError(f"factory must be callable, got {factory!r}")
    if not replace and name in registered_backends():
        raise ValueError(f"backend {name!r} is already registered; pass replace=True")
    _REGISTERED[name] = factory


def unregister_backend(name: str) -> None:
    """Forget a name given with ``register_backend`` (built-ins stay).

    Raises:
        KeyError: ``name`` was not registered with ``register_backend``.
    """
    del _REGISTERED[name]


def registered_backends() -> tuple[str, ...]:
    """Every name ``backend=`` accepts: the built-ins, then yours."""
    return tuple(dict.fromkeys([*_BUILTIN, *_REGISTERED]))


def default_backend(device: torch.device) -> str:
    """The backend ``device=`` picks when ``backend=`` is not given."""
    return {"cpu": "cpu", "cuda": "cuda"}.get(device.type, "accel")


def factory_of(name: str) -> Factory:
    """The factory registered as ``name``.

    Raises:
        ValueError: no backend has that name.
    """
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name in _BUILTIN:
        module, cls = _BUILTIN[name]
        return getattr(importlib.import_module(f".{module}", __name__), cls)  # type: ignore[no-any-return]
    raise ValueError(f"unknown backend {name!r}; registered: "
                     f"{', '.join(registered_backends())}")


def build_backend(device: str | torch.device | None,
                  backend: str | TransferBackend | None = None,
                  **options: Any) -> TransferBackend:
    """The backend for ``device``: an instance passed in, a registered name, or the
    device's default. ``device`` None: an instance's own device, else the CPU. Given
    with an instance, it must name the instance's device (one without an index is
    the current device of its type, as torch has it: "cuda" is "cuda:0" until
    ``torch.cuda.set_device`` chose another; "cpu:0" is "cpu", "mps:0" "mps"): the
    instance copies to its own device, and a ``device`` it ignored silently would be
    a wish not granted. So must it name the device of a backend built by name
    ("emulated" and "manual" copy to the CPU whatever they are given).

    Raises:
        ValueError: an unknown device or backend name, an option the backend does not
            take or one it needs (or a factory that does not take the device), options
            given with an instance, a device other than the instance's or than the one
            a backend built by name copies to, or a device this machine lacks.
        TypeError: ``backend`` is neither a name nor a TransferBackend, a registered
            factory built something else, or the backend has no ``device`` (an
            ``__init__`` of its own that neither set it nor called the base's).
    """
    if isinstance(backend, TransferBackend):
        if options:
            raise ValueError("backend_options configure a backend built by name; pass "
                             "them to your backend instance's constructor instead")
        own = _with_device(backend).device
        if device is not None:
            dev, own = parse_device(device), parse_device(own)
            if not _names(dev, own):
                raise ValueError(
                    f"device {_shown(dev, own)} differs from the device of the backend "
                    f"instance, {str(own)!r} ({type(backend).__name__}), which is where "
                    f"the batches go: leave device out, or pass a backend built for "
                    f"{str(dev)!r}")
        return backend
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a registered name or a TransferBackend, got "
                        f"{type(backend).__name__}")
    dev = parse_device("cpu" if device is None else device)
    name = backend or default_backend(dev)
    factory = factory_of(name)
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # no signature to check (a builtin): let it decide
        signature = None
    if signature is not None:
        try:
            signature.bind(dev, **options)
        except TypeError as exc:
            try:
                signature.bind_partial(dev)
            except TypeError:
                what = ("is built as factory(device, **backend_options) and does not "
                        "take the device")
            else:  # the device is taken: an option is not, or one it needs is missing
                what = (f"does not take the options {sorted(options)}" if options else
                        "needs backend_options, and none were given")
            raise ValueError(f"backend {name!r} {what}: {exc}; its signature: "
                             f"{signature}") from exc
    built = factory(dev, **options)
    if not isinstance(built, TransferBackend):
        raise TypeError(f"backend {name!r}: its factory returned "
                        f"{type(built).__name__}, not a TransferBackend instance")
    own = parse_device(_with_device(built).device)
    if device is not None and not _names(dev, own):
        raise ValueError(f"backend {name!r} copies to {str(own)!r}, not to the device "
                         f"asked for, {_shown(dev, own)}: leave device out, or name a backend "
                         f"that copies to {str(dev)!r}")
    return built


# Device types torch has one device of: any index names that one.
_ONE_DEVICE = ("cpu", "mps")


def _names(device: torch.device, own: torch.device) -> bool:
    """Whether ``device`` names ``own``, a backend's device: the same type, and the
    same index, where one without an index is the current device of its type
    (``current_index``), or a type with one device ("cpu:0" is "cpu")."""
    if device.type != own.type:
        return False
    return device.type in _ONE_DEVICE or _current_index(device) == _current_index(own)


def _shown(device: torch.device, own: torch.device) -> str:
    """``device`` quoted, for a refusal beside ``own``; one without an index, where
    ``own`` is of its type, with the device it is now (the index is what differs)."""
    if device.index is not None or device.type != own.type:
        return repr(str(device))
    return f"{str(device)!r} (now {device.type}:{_current_index(device)})"


def _current_index(device: torch.device) -> int:
    """``device``'s index; for one without, the current device of its type, which is
    what torch means by it (``torch.device("cuda")`` is the current CUDA device):
    torch's answer where this machine has the type, else 0, the current device of
    a process that has not chosen one."""
    if device.index is not None:
        return device.index
    module = getattr(torch, device.type, None)
    if module is None or not getattr(module, "is_available", lambda: False)():
        return 0
    current = getattr(module, "current_device", None)
    return int(current()) if callable(current) else 0


def _with_device(backend: TransferBackend) -> TransferBackend:
    """``backend``, which must have its ``device`` (the pipeline's device).

    Raises:
        TypeError: it has none: an ``__init__`` of its own that neither set
            ``self.device`` nor called ``TransferBackend.__init__``.
    """
    if not hasattr(backend, "device"):
        kind = type(backend).__name__
        raise TypeError(f"{kind} has no device: its __init__ must call "
                        f"super().__init__(device) or set self.device")
    return backend


__all__ = ["TransferBackend", "available_device", "build_backend", "default_backend",
           "factory_of", "parse_device", "register_backend", "registered_backends",
           "unregister_backend"]
