"""The small base every KV method derives from, and the registry that maps config names to methods.

A method is a frozen dataclass of its parameters (validated in ``__post_init__``) plus a factory
for per-layer stores; it knows nothing about Hydra or W&B, and nothing a model decides (head dim,
backend, analytic bits) is ever written back onto it: that goes into the cache it builds.
"""

from __future__ import annotations

import contextlib
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, ClassVar

from kvquant.backends import TORCH, Backend, resolve_backend, warn_once
from kvquant.cache import KVCache, KVGeometry, KVLayer
from kvquant.errors import InvalidParameterError
from kvquant.registry import Registry, import_submodules, init_params


@dataclasses.dataclass(frozen=True)
class KVMethod(ABC):
    """A KV-cache method: ``new_cache(model)`` returns a fresh ``KVCache`` for one sequence batch.

    Subclasses are ``@dataclass(frozen=True)``; their fields are the parameters a config sets, and
    their ``__post_init__`` validates them (``InvalidParameterError``, one line).
    ``name`` is the registry name it was built under (``kivi2``), set by the registry.
    """

    name: ClassVar[str] = ""
    #: the attention function this method's layers need (``kvquant.attention.NAME``) or None (stock)
    attention: ClassVar[str | None] = None
    #: the storage format its layers hold (``kvquant.formats``), by which backends name their kernels
    format: ClassVar[str] = ""

    @abstractmethod
    def new_layer(self, layer_idx: int, geometry: KVGeometry) -> KVLayer:
        """The store for one decoder layer."""

    def new_cache(self, model: Any) -> KVCache:
        """A fresh cache for ``model``; routes the model's attention if this method reads inside it."""
        if self.attention is not None:
            from kvquant.attention import route_attention

            route_attention(model, self.attention)
        geometry = KVGeometry.of(model.config)
        return KVCache([self.new_layer(i, geometry) for i in range(geometry.n_layers)])

    @contextlib.contextmanager
    def attach(self, model: Any) -> Iterator[Any]:
        """``with method.attach(model):`` — the model's attention as this method needs it inside the
        block, and exactly as it was (stock SDPA, eager, …) after it."""
        from kvquant.attention import restore_attention, route_attention

        previous = model.config._attn_implementation
        if self.attention is not None:
            route_attention(model, self.attention)
        try:
            yield model
        finally:
            restore_attention(model, previous)

    def rule(self, geometry: KVGeometry | None = None) -> Any:
        """How this method's layers read their state on ``geometry`` (a frozen object every backend takes;
        ``kvquant.formats``), or None where they read everything they hold as stored."""
        return None

    def resolve(self, model: Any, geometry: KVGeometry, rule: Any = None) -> Backend:
        """The backend this method's cache for ``model`` reads with (``kvquant.backends.resolve_backend``
        on its ``backend`` parameter, ``torch`` where it has none), the model's attention routed to it
        when it reads inside attention."""
        from kvquant.attention import NAME, routable, route_attention

        requested = getattr(self, "backend", "torch")
        backend = resolve_backend(requested, getattr(model, "device", None), self.format, geometry, rule)
        if backend.materializes:
            return backend
        spread = sorted({str(where) for where in (getattr(model, "hf_device_map", None) or {}).values()})
        if len(spread) > 1:  # kernels launch on one device
            lacks = f"the model is spread over several devices ({', '.join(spread)})"
            if requested != "auto":
                raise InvalidParameterError(f"backend={requested} cannot run this model: {lacks}; use backend=torch")
            warn_once(f"warning: backend=auto uses torch: {lacks}")
            return TORCH
        if not routable(model):  # kernels read inside attention: a model that cannot route has none
            lacks = f"{type(model).__name__} does not route its attention through transformers' AttentionInterface"
            if requested != "auto":
                raise InvalidParameterError(f"backend={requested} cannot run this model: {lacks}; use backend=torch")
            warn_once(f"warning: backend=auto uses torch: {lacks}")
            return TORCH
        route_attention(model, NAME)
        return backend

    def params(self) -> dict[str, Any]:
        """The parameters, as recorded in results.json (and as ``conf/method/<name>.yaml`` sets them)."""
        return init_params(self)

    def with_params(self, **changes: Any) -> KVMethod:
        """A copy with some parameters changed (validated again), keeping the registry name."""
        new = dataclasses.replace(self, **changes)
        object.__setattr__(new, "name", self.name)
        return new

    def on_backend(self, backend: str) -> KVMethod:
        """This method on ``backend`` where it has a ``backend`` parameter; itself where it has none."""
        fields = {f.name for f in dataclasses.fields(self)}
        return self.with_params(backend=backend) if "backend" in fields else self

    def analytic_bits(self, geometry: KVGeometry | None = None) -> float | None:
        """Bits per stored element by formula, where the method has one (reported beside the measured)."""
        return None

    def adaptations(self, geometry: KVGeometry) -> dict[str, Any]:
        """Parameters this method changes to fit ``geometry`` (``{"group_size": [32, 8]}``: default,
        used), as its caches record them; ``{}`` when it runs as configured."""
        return {}

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, **self.params()}


METHODS: Registry[KVMethod] = Registry("method")


def register_method(name: str, cls: type[KVMethod], **preset: Any) -> None:
    """Register ``cls`` under ``name``; ``preset`` fixes parameters (e.g. ``kivi2`` = kivi with bits=2)."""
    METHODS.register(name, cls, **preset)


def get_method(name: str, **params: Any) -> KVMethod:
    """Build the method registered as ``name`` with ``params`` overriding its preset."""
    import_submodules("kvquant.methods")
    return METHODS.create(name, **params)


def method_names() -> list[str]:
    import_submodules("kvquant.methods")
    return METHODS.names()
