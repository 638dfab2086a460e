"""``longbench``: the LongBench (v1) tasks bundled in ``kvquant/assets/datasets/longbench``.

LongBench's own prompt templates (``dataset2prompt.json``), maximum generation lengths
(``dataset2maxlen.json``) and per-task metrics (``kvquant.eval.scorers.LONGBENCH_METRICS``: QA F1,
ROUGE-L, classification, retrieval, count, code edit similarity). A prompt longer than ``max_length``
tokens keeps its first and last ``max_length/2`` tokens (LongBench's middle truncation); such
prompts are counted. ``max_length`` is also capped so prompt + generation fit the model's context.
``max_gen_tokens`` caps LongBench's per-task generation lengths (512 for the summarization tasks) so
the laptop default fits in minutes; capped examples are counted, ``null`` restores LongBench's lengths.
Plain prompts, no chat template (LongBench's ``build_chat`` is model-specific). ``limit`` is per task.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvquant.data import longbench, longbench_config, longbench_tasks
from kvquant.eval import intervals
from kvquant.eval.engine import Engine, Generation
from kvquant.eval.scorers import LONGBENCH_METRICS, longbench_score
from kvquant.eval.suite import Evaluation, SuiteTask, mean
from kvquant.eval.tasks import Positive, register_task

TAIL = 400
KEYS = ("task", "score")  # what the scores are computed from


def middle_truncate(ids: list[int], max_length: int) -> list[int]:
    """LongBench's truncation: keep the first and the last ``max_length // 2`` tokens."""
    if len(ids) <= max_length:
        return ids
    half = max_length // 2
    return ids[:half] + ids[len(ids) - half :]


@dataclass(frozen=True)
class LongBenchTask(SuiteTask):
    """LongBench's prompts through the method's cache, scored by each task's own metric."""

    limit: Positive[int | None] = 1
    tasks: list[str] | None = None  # None: every bundled task
    max_length: Positive[int] = 1024
    chunk_size: Positive[int] = 32
    source: Literal["bundled"] = "bundled"
    max_gen_tokens: Positive[int | None] = None
    batch_size: Positive[int] = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        available = longbench_tasks()
        chosen = list(self.tasks) if self.tasks is not None else available
        unknown = [t for t in chosen if t not in available or t not in LONGBENCH_METRICS]
        if unknown:
            raise self.invalid(f"no bundled data for {', '.join(unknown)}; bundled tasks: {', '.join(available)}")
        object.__setattr__(self, "tasks", chosen)

    def evaluate(self, engine: Engine, progress: bool) -> Evaluation:
        prompts, maxgen = longbench_config()
        tok = engine.tokenizer
        work = []
        for task in self.tasks:
            rows = longbench(task)
            work += [(task, i, row) for i, row in enumerate(rows[: self.limit] if self.limit else rows)]
        asks, middle_cut, gen_capped = [], 0, 0
        for task, i, row in work:
            gen = int(maxgen[task])
            if self.max_gen_tokens is not None and gen > self.max_gen_tokens:
                gen, gen_capped = self.max_gen_tokens, gen_capped + 1
            budget = min(self.max_length, engine.max_length - gen)
            ids = tok(prompts[task].format(**row)).input_ids
            if len(ids) > budget:
                middle_cut += 1
                ids = middle_truncate(ids, budget)
            stops = ("\n",) if task == "samsum" else ()
            asks.append(Generation(f"longbench/{task}/{i}", ids, gen, stops))
        outs = engine.generate_many(asks, progress=f"longbench/{engine.method.name}" if progress else None)
        examples = []
        for (task, _, row), ask, out in zip(work, asks, outs, strict=True):
            uid, ids = ask.key, ask.ids
            score = longbench_score(task, out, row["answers"], row.get("all_classes") or [])
            examples.append(
                {
                    "id": uid,
                    "task": task,
                    "_id": row.get("_id"),
                    "prompt_tokens": len(ids),
                    "prompt_tail": tok.decode(ids[-64:]),
                    "output": out,
                    "answers": row["answers"],
                    "answer": out.strip(),
                    "score": score,
                }
            )
        metrics, n_by_task = {}, {}
        for task in self.tasks:
            scores = [e["score"] for e in examples if e["task"] == task]
            if scores:
                metrics[task] = 100 * mean(scores)
                n_by_task[task] = len(scores)
        metrics["longbench_avg"] = mean([metrics[t] for t in n_by_task])
        info = {"n_by_task": n_by_task, "middle_truncated": middle_cut, "generation_capped": gen_capped}
        return Evaluation(metrics, examples, info, KEYS)

    def estimators(
        self, rows: Sequence[Mapping[str, Any]], keys: Sequence[str] = KEYS
    ) -> dict[str, intervals.Estimator]:
        """Each task's score ×100, and their average: resampled within each task (so every task keeps its n)."""
        out = {}
        for task in dict.fromkeys(r["task"] for r in rows):
            out[task] = intervals.mean([r["score"] for r in rows if r["task"] == task], scale=100)
        if rows:
            out["longbench_avg"] = intervals.mean([r["score"] for r in rows], 100, [r["task"] for r in rows])
        return out


register_task("longbench", LongBenchTask)
