"""The backend seam: who reads a storage format inside attention, chosen once per cache.

A backend implements one protocol for the formats it declares (``kvquant.formats``):
``attend(state, rule, query, mask, scaling) -> (output [B, Hq, q_len, D], Reads)``. ``torch`` (the
reference, always there, every format) is ``kvquant.formats.attend``; kernel packages register
themselves: the library names them here by module and imports one only when a cache asks for it, so
imports run one way (``kvquant`` never imports a kernels package at module level; kernel packages
import ``kvquant.formats`` and the format math, never layers, methods or caches).

A backend named ``X`` lives in the package ``kernels_X`` (its module ``kernels_X.backend`` registers it
when imported): adding one is adding a package, no list to edit (``docs/adding_a_backend.md``).
``resolve_backend`` turns ``method.backend`` (``auto``, ``torch`` or a package's name) into a ``Backend``
for one cache: ``auto`` takes, among the backends for the model's device that allow it for the cache's
format (``auto``), the one of highest ``priority`` whose kernels are built and can run the model and the
rule (one warning line otherwise, then ``torch``); an explicit kernel backend that cannot is a one-line
``InvalidParameterError``. Methods never name a backend: their caches hold the resolved one.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from kvquant.errors import InvalidParameterError

#: the kernel packages shipped here, which ``auto`` always considers (any other is named by the user first)
SHIPPED = ("cpu", "cupy")
BUILT_IN = ("auto", "torch")


def no_limits(fmt: str, geometry: Any, rule: Any) -> list[str]:
    return []


@dataclass(frozen=True)
class Backend:
    """A set of kernels: the ``formats`` it reads, the ``device_type`` it runs on, ``status()`` →
    ``(usable, why not)``, ``ops_module`` (the module whose ``attend`` implements the protocol) and
    ``limits(fmt, geometry, rule)``: what of a model (``KVGeometry``) or a rule its kernels lack, one
    phrase each (``["sliding-window layers (4096)"]``), empty when they can run it. ``auto``: the formats
    ``backend=auto`` may choose it for (``"*"``: all it reads; a format left out is opt-in, named by the
    user: kernels not yet validated on a device, or not faster there than the torch reference); ``priority``
    orders those for one device type.

    ``materializes`` (the torch reference only): a format whose read does not depend on the query is
    handed to the model's own attention as the K/V it reads (``state.read``) — the same computation as
    its ``attend``, which is what lets the model's SDPA, eager path, soft-capping and sliding masks
    apply unchanged."""

    name: str
    device_type: str
    formats: frozenset[str]
    status: Callable[[], tuple[bool, str]]
    ops_module: str
    limits: Callable[[str, Any, Any], list[str]] = no_limits
    materializes: bool = False
    auto: frozenset[str] = frozenset({"*"})
    priority: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.auto, bool):  # a backend written before ``auto`` took formats: all or none
            object.__setattr__(self, "auto", frozenset({"*"}) if self.auto else frozenset())

    def auto_for(self, fmt: str) -> bool:
        """Whether ``backend=auto`` may choose these kernels for format ``fmt``."""
        return "*" in self.auto or fmt in self.auto

    @property
    def ops(self) -> ModuleType:
        return importlib.import_module(self.ops_module)

    def attend(
        self, state: Any, rule: Any, query: torch.Tensor, mask: torch.Tensor | None, scaling: float
    ) -> tuple[torch.Tensor, Any]:
        """Attention of ``query`` ``[B, Hq, q_len, D]`` over ``state`` read by ``rule``: ``(out [B, Hq,
        q_len, D] in the query's dtype, kvquant.formats.Reads)``. ``mask`` broadcasts to ``[B, Hq, q_len,
        n]`` (bool, True = attend, or additive); None on a multi-token step means causal."""
        return self.ops.attend(state, rule, query, mask, scaling)

    def kernel(self, name: str) -> Callable | None:
        """An optional kernel beyond ``attend`` that a method may use where the backend has it (AQUA-KV's
        ``aquakv_encode`` and ``aquakv_reconstruct``), or None: the method then runs its torch code."""
        return getattr(self.ops, name, None)

    def new_state(self, cls: type, *args: Any, **kwargs: Any) -> Any:
        """A new ``cls`` state (a ``kvquant.formats`` class), as the backend's own subclass where its ops
        module keeps one in ``STATES`` (CuPy's plane store packs appends on the GPU)."""
        return getattr(self.ops, "STATES", {}).get(cls.format, cls)(*args, **kwargs)


TORCH = Backend("torch", "any", frozenset({"*"}), lambda: (True, "ok"), "kvquant.formats", materializes=True)
_BACKENDS: dict[str, Backend] = {"torch": TORCH}
_WARNED: set[str] = set()


def register_backend(backend: Backend) -> None:
    """Called by a kernels package when it is imported."""
    _BACKENDS[backend.name] = backend


def package(name: str) -> str:
    """The module that registers backend ``name``: ``kernels_<name>.backend``."""
    return f"kernels_{name}.backend"


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(f"kernels_{name}") is not None
    except (ImportError, ValueError):
        return False


def choices() -> list[str]:
    """``auto``, ``torch`` and the backends registered or shipped here (what one-line errors list)."""
    return [*BUILT_IN, *sorted({*SHIPPED, *_BACKENDS} - set(BUILT_IN))]


def check_backend(name: str) -> str:
    """``name`` if it is a backend choice (built in, registered or an importable ``kernels_<name>``
    package), else one line listing the valid ones."""
    if name in BUILT_IN or name in _BACKENDS or (name.isidentifier() and _installed(name)):
        return name
    raise InvalidParameterError(f"unknown backend '{name}'; valid backends: {', '.join(choices())}")


def get_backend(name: str) -> Backend | None:
    """The registered backend ``name`` (importing its package), or None if the package is missing."""
    if name not in _BACKENDS and name.isidentifier():
        try:
            importlib.import_module(package(name))
        except ImportError:
            return None
    return _BACKENDS.get(name)


def _why_unusable(name: str, device_type: str, fmt: str) -> str | None:
    backend = get_backend(name)
    if backend is None:
        return f"the kernels_{name} package is not installed"
    if backend.device_type != device_type:
        return f"its kernels run on {backend.device_type}, the model is on {device_type}"
    if fmt not in backend.formats:
        return f"it has no kernel for the '{fmt}' format"
    ok, why = backend.status()
    return None if ok else why


def auto_candidate(device_type: str, fmt: str) -> str | None:
    """The backend ``auto`` tries for format ``fmt`` on ``device_type``: of the shipped and registered ones
    that run there and allow ``auto`` for it, the highest ``priority`` (None: the torch reference)."""
    for name in SHIPPED:
        get_backend(name)
    found = [b for b in _BACKENDS.values() if b.device_type == device_type and b.auto_for(fmt) and not b.materializes]
    return max(found, key=lambda b: b.priority).name if found else None


def warn_once(line: str) -> None:
    """Print a warning line to stderr once per process (a fallback is said once, not per cache)."""
    if line not in _WARNED:
        _WARNED.add(line)
        print(line, file=sys.stderr, flush=True)


def resolve_backend(
    requested: str, device: torch.device | str | None, fmt: str, geometry: Any = None, rule: Any = None
) -> Backend:
    """The backend a cache of format ``fmt`` on ``device`` reads with (module docstring): ``geometry``
    (the model's ``KVGeometry``) and ``rule`` are checked against the kernels' ``limits``."""
    check_backend(requested)
    if requested == "torch":
        return TORCH
    device_type = torch.device(device).type if device is not None else "cpu"
    name = auto_candidate(device_type, fmt) if requested == "auto" else requested
    if name is None:
        opt_in = sorted(
            b.name
            for b in _BACKENDS.values()
            if b.device_type == device_type and fmt in b.formats and not b.auto_for(fmt)
        )
        if opt_in:
            choice = " or ".join(f"method.backend={name}" for name in opt_in)
            warn_once(
                f"warning: backend=auto uses torch for '{fmt}' on {device_type}: its kernels are opt-in ({choice})"
            )
        return TORCH
    why = _why_unusable(name, device_type, fmt)
    if why is not None:
        if requested != "auto":
            raise InvalidParameterError(f"backend={requested} cannot run here: {why}; use backend=auto or torch")
        warn_once(f"warning: backend=auto uses torch for '{fmt}' on {device_type}: {name} kernels unusable ({why})")
        return TORCH
    backend = get_backend(name)
    missing = backend.limits(fmt, geometry, rule) if geometry is not None else []
    if missing:
        lacks = f"the {fmt} kernels have no {' or '.join(missing)}"
        if requested != "auto":
            raise InvalidParameterError(f"backend={requested} cannot run this model: {lacks}; use backend=torch")
        warn_once(f"warning: backend=auto uses torch: the {name} kernels cannot run this model ({lacks})")
        return TORCH
    return backend


def select_backend(requested: str, device: torch.device | str | None, fmt: str) -> str:
    """The name of ``resolve_backend``'s choice for a format on a device, before any model is known."""
    return resolve_backend(requested, device, fmt).name
