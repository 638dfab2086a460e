"""A name → class map shared by methods and tasks, with errors that list the valid names."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import numbers
import pkgutil
import types
import typing
from typing import Any, Generic, Literal, TypeVar, Union

from kvquant.errors import InvalidParameterError, UnknownNameError

T = TypeVar("T")


def init_params(obj: object) -> dict[str, Any]:
    """The constructor parameters of ``obj`` with their current values (what results.json records)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
    sig = inspect.signature(type(obj).__init__)
    return {p: getattr(obj, p) for p in sig.parameters if p != "self"}


def import_submodules(package: str) -> None:
    """Import every module of ``package`` so that each registers itself (no central list to edit)."""
    pkg = importlib.import_module(package)
    for info in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{package}.{info.name}")


def type_name(annotation: Any) -> str:
    """How an annotation reads in an error message (``float``, ``int or None``, ``list of float``)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin in (tuple, list):
        if origin is tuple and args and args[-1] is not Ellipsis:
            return f"{len(args)} values (" + ", ".join(type_name(a) for a in args) + ")"
        return f"a list of {type_name(args[0])}" if args else "a list"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def matches(value: Any, annotation: Any) -> bool:
    """Whether ``value`` (as Hydra or a caller passes it) fits ``annotation``.

    Lists stand for tuples (YAML has no tuples) and an int for a float; a bool is never a number.
    Annotations this does not understand accept anything, so a new type never blocks a run.
    """
    if annotation is Any or annotation is inspect.Parameter.empty:
        return True
    if annotation is type(None) or annotation is None:
        return value is None
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        return any(matches(value, a) for a in args)
    if origin is Literal:
        return value in args
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(matches(v, a) for v, a in zip(value, args, strict=True))
        return not args or all(matches(v, args[0]) for v in value)
    if annotation is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return True


def check_types(what: str, cls: type, kwargs: dict[str, Any]) -> None:
    """One line naming the first parameter whose value does not fit ``cls``'s annotation."""
    try:
        hints = typing.get_type_hints(cls if dataclasses.is_dataclass(cls) else cls.__init__)
    except (NameError, TypeError):
        return
    for key, value in kwargs.items():
        if key in hints and not matches(value, hints[key]):
            raise InvalidParameterError(
                f"{what}: parameter '{key}' expects {type_name(hints[key])}, got {value!r} ({type(value).__name__})"
            )


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
        check_types(f"{self.kind} '{name}'", cls, kwargs)
        obj = cls(**kwargs)
        object.__setattr__(obj, "name", name)  # methods are frozen dataclasses
        return obj

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries
