"""The base of the evaluation suite's tasks: run the method through an ``Engine``, compare with fp16.

A subclass implements ``evaluate(engine, progress)``: it sends its requests through the engine
(unit keys ``<example id>#<i>``) and returns metrics and per-example rows, each with an ``id`` and
the ``answer`` used for answer agreement, and ``estimators(rows, keys)``: each metric as a function
of the rows' per-example numbers (``kvquant.eval.intervals``), for its 95% interval and its paired
difference to fp16. ``run`` first loads or computes the fp16 reference (cached under
``reference_dir``, with fp16's per-example numbers), then evaluates the method against it.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvquant.eval import intervals
from kvquant.eval.engine import Engine
from kvquant.eval.intervals import Estimator
from kvquant.eval.reference import Reference, reference_path
from kvquant.eval.tasks import Task, TaskResult

log = logging.getLogger(__name__)


@dataclass
class Evaluation:
    """What one pass over a task's examples produced."""

    metrics: dict[str, float]
    examples: list[dict[str, Any]]
    info: dict[str, Any] = field(default_factory=dict)
    keys: tuple[str, ...] = ()  # the rows' fields the metrics are computed from (kept with fp16's reference)
    n: int | None = None  # the examples the metrics are over, where not every row is one (default: all rows)


@dataclass(frozen=True)
class SuiteTask(Task):
    """A task evaluated through an ``Engine``, with fidelity to a reference method.

    The engine reads the task's ``chunk_size`` (tokens per forward when text is fed through the
    cache) and ``batch_size`` (requests per batch; each row is its own cache, so results equal one at
    a time): a subclass declares both as fields, or runs with these defaults.
    """

    chunk_size = 32
    batch_size = 1

    @abstractmethod
    def evaluate(self, engine: Engine, progress: bool) -> Evaluation:
        """Send every request through ``engine``; return metrics and per-example rows (``id``, ``answer``)."""

    def estimators(self, rows: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> dict[str, Estimator]:
        """Each metric over ``rows`` (by default the mean of each of ``keys``), to bootstrap over examples."""
        return {k: intervals.mean([r[k] for r in rows]) for k in keys if all(_number(r.get(k)) for r in rows)}

    def check_context(self, model, needed: int, what: str) -> None:
        """Refuse lengths past the model's trained context with a one-line fix (``what``: the setting)."""
        limit = getattr(model.config, "max_position_embeddings", None)
        if limit is not None and needed > limit:
            raise self.invalid(
                f"{what} needs {needed} tokens but the model's context is {limit}; lower it to at most {limit}"
            )

    def _pass(self, model, tokenizer, method, reference: Reference | None, progress: bool) -> tuple[Engine, Evaluation]:
        engine = Engine(model, tokenizer, method, self.chunk_size, reference, batch_size=self.batch_size)
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
        recording.values = {str(ex["id"]): {k: ex[k] for k in evaluation.keys if k in ex} for ex in evaluation.examples}
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
        agree: dict[str, float] = {}
        if reference is None:
            if reference_dir is not None:  # a reference run (fp16) leaves its outputs for the runs that follow
                path = reference_path(reference_dir, model, self.name, self.params(), method.describe())
                self._keep(engine, evaluation, path)
        else:
            fidelity = engine.fidelity.summary()
            for ex in examples:
                ex["fidelity"] = engine.fidelity.for_prefix(str(ex["id"]))
                if "answer" not in ex:
                    continue
                ref_answer = reference.answers.get(str(ex["id"]))
                ex["fp16_answer"] = ref_answer
                ex["agrees_with_fp16"] = str(ex.get("answer")) == ref_answer
                agree[str(ex["id"])] = float(ex["agrees_with_fp16"])
            if agree:
                fidelity["answer_agreement"] = sum(agree.values()) / len(agree)
        info = {"truncated": engine.truncated, **evaluation.info}
        estimators = {"metrics": self.estimators(examples, evaluation.keys)}
        paired = None
        if reference is not None:
            ids = [str(ex["id"]) for ex in examples]
            estimators["fidelity"] = fidelity_estimators(engine.fidelity.per_unit, ids, agree)
            paired = self.paired(examples, evaluation.keys, reference)
        ci95, n_by_key, differences, problems = intervals.blocks(
            estimators, {"metrics": evaluation.metrics, "fidelity": fidelity or {}}, paired
        )
        if problems:  # an estimator that does not reproduce its metric: no interval, and the run says so
            log.warning("no interval for %s", "; ".join(problems))
            info["interval_problems"] = problems
        return TaskResult(
            metrics=evaluation.metrics,
            n=len(examples) if evaluation.n is None else evaluation.n,
            counts=engine.counts,
            timing=engine.timing(),
            fidelity=fidelity,
            examples=examples,
            info=info,
            n_caches=engine.n_caches,
            ci95=ci95,
            n_by_key=n_by_key,
            paired=differences,
            memory=engine.memory_summary(),
        )

    def paired(
        self, examples: list[dict[str, Any]], keys: Sequence[str], reference: Reference
    ) -> dict[str, tuple[Estimator, Estimator]]:
        """(method, fp16) estimators of each metric on the examples both have numbers for, in one order."""
        common = [ex for ex in examples if str(ex["id"]) in reference.values]
        if not common:
            return {}
        ref_rows = [{"id": ex["id"], **reference.values[str(ex["id"])]} for ex in common]
        try:
            mine, theirs = self.estimators(common, keys), self.estimators(ref_rows, keys)
        except KeyError:  # a reference saved without one of the fields: no paired differences
            return {}
        return {name: (est, theirs[name]) for name, est in mine.items() if name in theirs}


def fidelity_estimators(
    per_unit: Mapping[str, Mapping[str, float]], ids: Sequence[str], agree: Mapping[str, float]
) -> dict[str, Estimator]:
    """Fidelity numbers as means over units clustered by example (``<id>#<i>``, ``<id>.<j>#<i>``): the
    bootstrap resamples examples, and each resampled example brings all of its units."""
    known = set(ids)
    sums: dict[str, dict[str, float]] = {}
    counts: dict[str, dict[str, int]] = {}
    for key, row in per_unit.items():
        owner = key.rsplit("#", 1)[0]
        if owner not in known and owner.rsplit(".", 1)[0] in known:
            owner = owner.rsplit(".", 1)[0]
        for name, value in row.items():
            if value == value:  # NaN: a unit with no positions to compare
                sums.setdefault(name, {})[owner] = sums.get(name, {}).get(owner, 0.0) + value
                counts.setdefault(name, {})[owner] = counts.get(name, {}).get(owner, 0) + 1
    out = {name: intervals.ratio(list(by.values()), [counts[name][o] for o in by]) for name, by in sums.items()}
    if agree:
        out["answer_agreement"] = intervals.mean(list(agree.values()))
    return out


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
