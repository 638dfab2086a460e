"""The base of the evaluation suite's tasks: run the method through an ``Engine``, compare with fp16.

A subclass implements ``evaluate(engine, progress)``: it sends its requests through the engine
(unit keys ``<example id>#<i>``) and returns metrics and per-example rows, each with an ``id`` and
the ``answer`` used for answer agreement. ``run`` first loads or computes the fp16 reference
(cached under ``reference_dir``), then evaluates the method against it.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvquant.errors import InvalidParameterError
from kvquant.eval.engine import Engine
from kvquant.eval.reference import Reference, reference_path
from kvquant.eval.tasks import Task, TaskResult


@dataclass
class Evaluation:
    """What one pass over a task's examples produced."""

    metrics: dict[str, float]
    examples: list[dict[str, Any]]
    info: dict[str, Any] = field(default_factory=dict)


def check_positive(task: str, **values: int | None) -> None:
    for key, value in values.items():
        if value is not None and int(value) < 1:
            raise InvalidParameterError(f"task {task}: {key}={value} must be positive")


def check_source(task: str, source: str, offered: tuple[str, ...] = ("bundled", "hub")) -> None:
    if source not in offered:
        raise InvalidParameterError(f"task {task}: source '{source}' is not offered; use one of {', '.join(offered)}")


class SuiteTask(Task):
    """A task evaluated through an ``Engine``, with fidelity to a reference method."""

    chunk_size: int = 32

    @abstractmethod
    def evaluate(self, engine: Engine, progress: bool) -> Evaluation:
        """Send every request through ``engine``; return metrics and per-example rows (``id``, ``answer``)."""

    def _pass(self, model, tokenizer, method, reference: Reference | None, progress: bool) -> tuple[Engine, Evaluation]:
        engine = Engine(model, tokenizer, method, self.chunk_size, reference)
        return engine, self.evaluate(engine, progress)

    def reference(self, model, tokenizer, reference_method, progress: bool, reference_dir) -> Reference:
        """fp16's outputs for this task: loaded from ``reference_dir`` if computed before, else computed (and saved)."""
        path = None
        if reference_dir is not None:
            path = reference_path(reference_dir, model, self.name, self.params(), reference_method.describe())
            cached = Reference.load(path) if path.is_file() else None
            if cached is not None:
                return cached
        engine, evaluation = self._pass(model, tokenizer, reference_method, None, progress)
        return self._keep(engine, evaluation, path)

    @staticmethod
    def _keep(engine: Engine, evaluation: Evaluation, path: Path | None) -> Reference:
        recording = engine.recording
        recording.answers = {str(ex["id"]): str(ex["answer"]) for ex in evaluation.examples if "answer" in ex}
        if path is not None:
            recording.save(path)
        return recording

    def run(
        self, model, tokenizer, method, reference_method=None, progress: bool = False, reference_dir=None
    ) -> TaskResult:
        reference = None
        if reference_method is not None:
            reference = self.reference(model, tokenizer, reference_method, progress, reference_dir)
        engine, evaluation = self._pass(model, tokenizer, method, reference, progress)
        fidelity = None
        examples = evaluation.examples
        if reference is None:
            if reference_dir is not None:  # a reference run (fp16) leaves its outputs for the runs that follow
                path = reference_path(reference_dir, model, self.name, self.params(), method.describe())
                self._keep(engine, evaluation, path)
        else:
            fidelity = engine.fidelity.summary()
            agree = []
            for ex in examples:
                ex["fidelity"] = engine.fidelity.for_prefix(str(ex["id"]))
                if "answer" not in ex:
                    continue
                ref_answer = reference.answers.get(str(ex["id"]))
                ex["fp16_answer"] = ref_answer
                ex["agrees_with_fp16"] = str(ex.get("answer")) == ref_answer
                agree.append(float(ex["agrees_with_fp16"]))
            if agree:
                fidelity["answer_agreement"] = sum(agree) / len(agree)
        info = {"truncated": engine.truncated, **evaluation.info}
        return TaskResult(
            metrics=evaluation.metrics,
            n=len(examples),
            counts=engine.counts,
            timing=engine.timing(),
            fidelity=fidelity,
            examples=examples,
            info=info,
            n_caches=engine.n_caches,
        )


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
