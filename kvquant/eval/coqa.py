"""``coqa``: conversational QA, our own task and scorer (lm-eval's built-in CoQA imports a module
that transformers 5 removed).

No public copy of CoQA could be bundled, so the data comes from the hub only (``source: hub``,
``EleutherAI/coqa``, the copy lm-eval uses); offline, the run stops with a one-line error. As in
lm-eval's task, each story asks its last question after the earlier turns with their answers
(``story\\n\\nQ: …\\n\\nA: …\\n\\nQ: last\\n\\nA:``), greedy until ``\\nQ:``; EM and F1 follow the
official CoQA script (``kvquant.eval.scorers.coqa_scores``) over the answer and the additional answers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvquant.errors import KvquantError
from kvquant.eval import intervals
from kvquant.eval.engine import Engine, Generation
from kvquant.eval.scorers import coqa_scores
from kvquant.eval.suite import Evaluation, SuiteTask, mean
from kvquant.eval.tasks import Positive, register_task

HUB_ID = "EleutherAI/coqa"


def load_coqa(split: str = "validation") -> list[dict]:
    """CoQA from the hub (or its local Hugging Face cache); a one-line error when neither is reachable."""
    import datasets

    try:
        return list(datasets.load_dataset(HUB_ID, split=split))
    except Exception as exc:  # datasets raises several types when offline or the hub is unreachable
        raise KvquantError(
            f"task coqa needs the hub dataset {HUB_ID} (no copy is bundled), which could not be loaded "
            f"({type(exc).__name__}); run once with network access so the Hugging Face cache holds it "
            "(HF_DATASETS_OFFLINE=1 then reads that cache)"
        ) from None


def coqa_prompt(doc: dict) -> tuple[str, list[str]]:
    """The prompt for the story's last question, and its gold answers."""
    questions = doc["questions"]["input_text"]
    answers = doc["answers"]["input_text"]
    text = doc["story"] + "\n\n"
    for q, a in zip(questions[:-1], answers[:-1], strict=False):
        text += f"Q: {q}\n\nA: {a}\n\n"
    text += f"Q: {questions[-1]}\n\nA:"
    golds = [answers[-1]]
    for extra in (doc.get("additional_answers") or {}).values():
        texts = extra["input_text"] if isinstance(extra, dict) else extra
        if len(texts) >= len(questions):
            golds.append(texts[len(questions) - 1])
    return text, golds


@dataclass(frozen=True)
class CoQATask(SuiteTask):
    """The last question of each CoQA story, after the earlier turns, answered through the cache."""

    limit: Positive[int | None] = 10
    chunk_size: Positive[int] = 32
    max_gen_toks: Positive[int] = 48
    source: Literal["hub"] = "hub"
    batch_size: Positive[int] = 8

    def docs(self) -> list[dict]:
        return load_coqa()

    def evaluate(self, engine: Engine, progress: bool) -> Evaluation:
        docs = self.docs()
        docs = docs[: self.limit] if self.limit is not None else docs
        prompts = [coqa_prompt(doc) for doc in docs]
        asks = [
            Generation(f"coqa/{i}", engine.tokenizer(prompt).input_ids, self.max_gen_toks, ("\nQ:",))
            for i, (prompt, _) in enumerate(prompts)
        ]
        outs = engine.generate_many(asks, progress=f"coqa/{engine.method.name}" if progress else None)
        examples = []
        for i, ((_, golds), out) in enumerate(zip(prompts, outs, strict=True)):
            uid = f"coqa/{i}"
            answer = out.strip()
            scores = coqa_scores(answer, golds)
            examples.append({"id": uid, "output": out, "answer": answer, "golds": golds, **scores})
        metrics = {"em": 100 * mean([e["em"] for e in examples]), "f1": 100 * mean([e["f1"] for e in examples])}
        return Evaluation(metrics, examples, keys=("em", "f1"))

    def estimators(
        self, rows: Sequence[Mapping[str, Any]], keys: Sequence[str] = ("em", "f1")
    ) -> dict[str, intervals.Estimator]:
        """EM and F1 in %, as the metrics are reported."""
        return {k: intervals.mean([r[k] for r in rows], scale=100) for k in keys}


register_task("coqa", CoQATask)
