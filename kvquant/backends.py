"""The backend seam: where a method's attention/read kernels come from.

``torch`` (the reference, always there) is built in; kernel packages register themselves: the
library names them here by module and imports one only when a cache asks for it, so imports run
one way (``kvquant`` never imports a kernels package at module level, and kernels packages never
import method code). A backend says which storage formats it has kernels for and whether it can
run on a device; ``select_backend`` resolves ``method.backend`` (``auto``/``torch``/``cpu``/``cupy``)
for one cache.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from kvquant.errors import InvalidParameterError

#: backends that live in kernel packages, imported on first use (each calls ``register_backend``)
KERNEL_PACKAGES = {"cpu": "kernels_cpu.backend", "cupy": "kernels_cupy.backend"}
CHOICES = ("auto", "torch", *KERNEL_PACKAGES)


@dataclass(frozen=True)
class Backend:
    """A set of kernels: ``formats`` it reads (``fp16``, ``planes``, ``kivi``, …), ``device_type`` it
    runs on, ``status()`` → ``(usable, why not)``, and ``ops`` (the module holding the kernels)."""

    name: str
    device_type: str
    formats: frozenset[str]
    status: Callable[[], tuple[bool, str]]
    ops_module: str

    @property
    def ops(self) -> ModuleType:
        return importlib.import_module(self.ops_module)


TORCH = Backend("torch", "any", frozenset({"*"}), lambda: (True, "ok"), "kvquant.backends")
_BACKENDS: dict[str, Backend] = {"torch": TORCH}
_WARNED: set[str] = set()


def register_backend(backend: Backend) -> None:
    """Called by a kernels package when it is imported."""
    _BACKENDS[backend.name] = backend


def check_backend(name: str) -> str:
    """``name`` if it is a backend choice, else one line listing the valid ones."""
    if name not in CHOICES:
        raise InvalidParameterError(f"unknown backend '{name}'; valid backends: {', '.join(CHOICES)}")
    return name


def get_backend(name: str) -> Backend | None:
    """The registered backend ``name`` (importing its package), or None if the package is missing."""
    if name not in _BACKENDS and name in KERNEL_PACKAGES:
        try:
            importlib.import_module(KERNEL_PACKAGES[name])
        except ImportError:
            return None
    return _BACKENDS.get(name)


def _usable(name: str, device_type: str, fmt: str) -> tuple[bool, str]:
    backend = get_backend(name)
    if backend is None:
        return False, f"the {KERNEL_PACKAGES[name].split('.')[0]} package is not installed"
    if backend.device_type != device_type:
        return False, f"its kernels run on {backend.device_type}, the model is on {device_type}"
    if fmt not in backend.formats:
        return False, f"it has no kernel for the '{fmt}' format"
    return backend.status()


def select_backend(requested: str, device: torch.device | str | None, fmt: str) -> str:
    """The backend a cache of format ``fmt`` on ``device`` uses.

    ``auto``: CuPy on CUDA, the C++ kernels on a CPU, where built and able to read ``fmt``; else
    ``torch`` with one warning line saying why. An explicit ``cpu``/``cupy`` that cannot run is a
    one-line ``InvalidParameterError``.
    """
    check_backend(requested)
    if requested == "torch":
        return "torch"
    device_type = torch.device(device).type if device is not None else "cpu"
    if requested == "auto":
        candidate = "cupy" if device_type == "cuda" else "cpu" if device_type == "cpu" else None
        if candidate is None:
            return "torch"
        ok, why = _usable(candidate, device_type, fmt)
        if ok:
            return candidate
        line = f"warning: backend=auto uses torch for '{fmt}' on {device_type}: {candidate} kernels unusable ({why})"
        if line not in _WARNED:
            _WARNED.add(line)
            print(line, file=sys.stderr, flush=True)
        return "torch"
    ok, why = _usable(requested, device_type, fmt)
    if not ok:
        raise InvalidParameterError(f"backend={requested} cannot run here: {why}; use backend=auto or torch")
    return requested
