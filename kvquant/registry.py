"""A name → class map shared by methods and tasks, with errors that list the valid names."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Any, Generic, TypeVar

from kvquant.errors import InvalidParameterError, UnknownNameError

T = TypeVar("T")


def init_params(obj: object) -> dict[str, Any]:
    """The constructor parameters of ``obj`` with their current values (what results.json records)."""
    sig = inspect.signature(type(obj).__init__)
    return {p: getattr(obj, p) for p in sig.parameters if p != "self"}


def import_submodules(package: str) -> None:
    """Import every module of ``package`` so that each registers itself (no central list to edit)."""
    pkg = importlib.import_module(package)
    for info in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{package}.{info.name}")


class Registry(Generic[T]):
    """Maps config names to classes plus preset parameters (``kivi2`` = ``kivi`` with ``bits=2``)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, tuple[type[T], dict[str, Any]]] = {}

    def register(self, name: str, cls: type[T], **preset: Any) -> None:
        if name in self._entries:
            raise ValueError(f"{self.kind} '{name}' is registered twice")
        self._entries[name] = (cls, dict(preset))

    def create(self, name: str, **params: Any) -> T:
        """Instantiate ``name``; unknown or missing parameters raise a one-line error."""
        try:
            cls, preset = self._entries[name]
        except KeyError:
            raise UnknownNameError(self.kind, name, self.names()) from None
        kwargs = {**preset, **params}
        try:
            inspect.signature(cls).bind(**kwargs)
        except TypeError as exc:
            accepted = [p for p in inspect.signature(cls).parameters]
            raise InvalidParameterError(
                f"{self.kind} '{name}': {exc}; its parameters are: {', '.join(accepted) or 'none'}"
            ) from None
        obj = cls(**kwargs)
        obj.name = name
        return obj

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries
