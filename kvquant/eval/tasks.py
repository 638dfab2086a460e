"""Tasks: a small base class and the registry that maps ``task=<name>`` to a class."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from kvquant.cache import CacheCounts
from kvquant.registry import Registry, import_submodules, init_params


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


class Task(ABC):
    """A task runs a model with a KV method and returns a ``TaskResult``; it knows nothing about Hydra."""

    name: str = ""

    @abstractmethod
    def run(
        self, model, tokenizer, method, reference_method=None, progress: bool = False, reference_dir=None
    ) -> TaskResult:
        """Evaluate ``method``; when ``reference_method`` is given, also measure fidelity to it.

        ``reference_dir``, where given, caches the reference's outputs on disk across runs.
        """

    def params(self) -> dict[str, Any]:
        return init_params(self)


TASKS: Registry[Task] = Registry("task")


def register_task(name: str, cls: type[Task], **preset: Any) -> None:
    TASKS.register(name, cls, **preset)


def get_task(name: str, **params: Any) -> Task:
    import_submodules("kvquant.eval")
    return TASKS.create(name, **params)


def task_names() -> list[str]:
    import_submodules("kvquant.eval")
    return TASKS.names()
