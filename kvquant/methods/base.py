"""The small base every KV method derives from, and the registry that maps config names to methods.

A method is a parameter set plus a factory for per-layer stores; it knows nothing about Hydra or
W&B. Later methods add a class and a ``register`` line, nothing else.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from kvquant.cache import KVCache, KVLayer
from kvquant.registry import Registry, import_submodules, init_params


class KVMethod(ABC):
    """A KV-cache method: ``new_cache(model)`` returns a fresh ``KVCache`` for one sequence batch."""

    name: str = ""

    @abstractmethod
    def new_layer(self, layer_idx: int, model_config: Any) -> KVLayer:
        """The store for one decoder layer."""

    def new_cache(self, model: Any) -> KVCache:
        config = model.config.get_text_config(decoder=True)
        return KVCache([self.new_layer(i, config) for i in range(config.num_hidden_layers)])

    def params(self) -> dict[str, Any]:
        """The constructor parameters, as recorded in results.json."""
        return init_params(self)

    def analytic_bits(self) -> float | None:
        """Bits per stored element by formula, where the method has one (reported beside the measured)."""
        return None

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, **self.params()}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"


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
