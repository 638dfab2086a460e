"""Tasks, typed like methods: a frozen dataclass of its parameters, validated in ``__post_init__``.

A task's fields are the parameters ``conf/task/<name>.yaml`` sets. Their types say what is allowed
and the base's ``__post_init__`` checks it, so no task repeats the checks by hand: ``Positive[int]``
(at least 1), ``NonNegative[int]`` (at least 0), ``Annotated[int, AtLeast(n)]``, ``Literal[...]``
(one of some choices; ``None`` passes where the type allows it). A task's own ``__post_init__`` calls
``super().__post_init__()``, then refuses what types cannot say with ``raise self.invalid(...)`` and
may normalize a value (``object.__setattr__``: ``params()`` and results.json record it). Every error
is one line that names the task: ``task gsm8k: batch_size=0 must be positive``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from kvquant.cache import CacheCounts
from kvquant.errors import InvalidParameterError
from kvquant.registry import Registry, import_submodules, init_params

T = TypeVar("T")


@dataclass(frozen=True)
class AtLeast:
    """The smallest value a number parameter may take (``Annotated[int, AtLeast(2)]``)."""

    minimum: int

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is refused, or None (None itself passes: the type says whether it may be None)."""
        if value is None or value >= self.minimum:
            return None
        if self.minimum == 1:
            return "must be positive"
        return "must not be negative" if self.minimum == 0 else f"must be at least {self.minimum}"


Positive = Annotated[T, AtLeast(1)]
NonNegative = Annotated[T, AtLeast(0)]


@dataclass
class TaskResult:
    """What a task measured: task metrics, fidelity to fp16 (None for fp16 itself), cache counts, timing.

    ``examples`` are per-example outputs (written as JSONL beside results.json), ``info`` extra facts
    for the task block (e.g. prompts truncated), ``n_caches`` how many caches the counts add over.
    ``memory`` is measured memory per sequence (held by the cache, a decode step's allocation peak).
    ``ci95``, ``n_by_key`` and ``paired`` are results.json's blocks of the same names
    (``kvquant.eval.intervals.blocks``): 95% intervals and example counts keyed ``metrics/<name>``,
    ``fidelity/<name>``, ``paired/<name>``, and each metric's difference to fp16 on the same examples.
    """

    metrics: dict[str, float]
    n: int
    counts: CacheCounts
    timing: dict[str, float] = field(default_factory=dict)
    fidelity: dict[str, float] | None = None
    examples: list[dict[str, Any]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    n_caches: int | None = None
    ci95: dict[str, list[float]] = field(default_factory=dict)
    n_by_key: dict[str, int] = field(default_factory=dict)
    paired: dict[str, float] = field(default_factory=dict)
    memory: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Task(ABC):
    """A task runs a model with a KV method and returns a ``TaskResult``; it knows nothing about Hydra.

    Subclasses are ``@dataclass(frozen=True)`` whose fields are the parameters a config sets.
    ``name`` is the registry name: ``register_task`` gives it to a class that sets none, so that
    ``__post_init__``'s errors carry it.
    """

    name: ClassVar[str] = ""

    def __post_init__(self) -> None:
        """Check every field against the bound (``AtLeast``) or choices (``Literal``) of its type."""
        hints = typing.get_type_hints(type(self), include_extras=True)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            for rule in getattr(hints.get(f.name), "__metadata__", ()):
                problem = rule.problem(value) if isinstance(rule, AtLeast) else None
                if problem:
                    raise self.invalid(f"{f.name}={value} {problem}")
            choices = literal_choices(hints.get(f.name))
            if choices and value not in choices and value is not None:
                raise self.invalid(f"{f.name}={value!r} must be one of {', '.join(map(str, choices))}")

    def invalid(self, message: str) -> InvalidParameterError:
        """The one-line error for a bad parameter of this task (``raise self.invalid(...)``)."""
        return InvalidParameterError(f"task {self.name}: {message}")

    @abstractmethod
    def run(
        self, model, tokenizer, method, reference_method=None, progress: bool = False, reference_dir=None
    ) -> TaskResult:
        """Evaluate ``method``; when ``reference_method`` is given, also measure fidelity to it.

        ``reference_dir``, where given, caches the reference's outputs on disk across runs.
        """

    def params(self) -> dict[str, Any]:
        """The parameters, as recorded in results.json (and as ``conf/task/<name>.yaml`` sets them)."""
        return init_params(self)


def literal_choices(annotation: Any) -> tuple[Any, ...]:
    """The values a ``Literal[...]`` (or ``Literal[...] | None``, inside ``Annotated``) allows; ``()`` otherwise."""
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(c for a in typing.get_args(annotation) for c in literal_choices(a))
    return ()


TASKS: Registry[Task] = Registry("task")


def register_task(name: str, cls: type[Task], **preset: Any) -> None:
    """Register ``cls`` under ``name`` (and give it that name if it has none of its own)."""
    if "name" not in vars(cls):
        cls.name = name
    TASKS.register(name, cls, **preset)


def get_task(name: str, **params: Any) -> Task:
    """Build the task registered as ``name`` with ``params`` overriding its defaults."""
    import_submodules("kvquant.eval")
    return TASKS.create(name, **params)


def task_names() -> list[str]:
    import_submodules("kvquant.eval")
    return TASKS.names()
