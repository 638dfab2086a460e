"""``ruler``: RULER's synthetic long-context tasks (Hsieh et al., 2024), generated offline.

Why: needle retrieval, multi-hop tracing and aggregation over a long prompt are what a compressed
KV cache is most likely to break, and RULER measures them at a controlled length. Each
(subtask, length) cell holds ``n`` examples from ``kvquant.eval.ruler_tasks`` (seeded, so every
method sees the same prompts). The prompt is fed through the method's cache in chunks before greedy
decoding, so the answer is read from the (quantized) cache. Score: RULER's ``string_match_all``,
the share of the reference answers found in the generation, ×100. Generation lengths are RULER's
(niah 128, vt 30, fwe 50 tokens, counted in the length); ``max_new_tokens`` caps them (the count
of capped examples is reported). A length beyond the model's context is an error, not a skip.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvquant.eval import intervals
from kvquant.eval.engine import Engine, Generation
from kvquant.eval.ruler_tasks import SUBTASKS, generate, string_match_all, tokens_to_generate
from kvquant.eval.suite import Evaluation, SuiteTask
from kvquant.eval.tasks import Positive, register_task

KEYS = ("score", "subtask", "length")  # what the scores are computed from


@dataclass(frozen=True)
class RulerTask(SuiteTask):
    """RULER's subtasks at each length, the prompt read back from the method's cache."""

    subtasks: list[str] | None = None  # None: every subtask
    lengths: list[int] | None = None  # None: 1024, 2048, 4096
    n: Positive[int] = 20
    seed: int = 0
    haystack: Literal["wikitext", "tinystories"] = "wikitext"
    chunk_size: Positive[int] = 256
    max_new_tokens: Positive[int | None] = None
    source: Literal["bundled"] = "bundled"
    batch_size: Positive[int] = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        chosen = list(self.subtasks) if self.subtasks is not None else list(SUBTASKS)
        unknown = [s for s in chosen if s not in SUBTASKS]
        if unknown or not chosen:
            raise self.invalid(f"unknown subtask '{', '.join(unknown)}'; valid subtasks: {', '.join(SUBTASKS)}")
        lengths = [int(x) for x in (self.lengths if self.lengths is not None else [1024, 2048, 4096])]
        if not lengths or any(x < 1 for x in lengths):
            raise self.invalid(f"lengths {lengths} must be positive token counts")
        object.__setattr__(self, "subtasks", chosen)
        object.__setattr__(self, "lengths", lengths)

    def evaluate(self, engine: Engine, progress: bool) -> Evaluation:
        too_long = [x for x in self.lengths if x > engine.max_length]
        if too_long:
            raise self.invalid(
                f"length {too_long[0]} exceeds the model's context ({engine.max_length}, "
                f"max_position_embeddings); choose task.lengths at most {engine.max_length}"
            )
        cells = [(s, x, i) for x in self.lengths for s in self.subtasks for i in range(self.n)]
        built, asks, capped = [], [], 0
        for subtask, length, index in cells:
            ex = generate(subtask, length, index, self.seed, engine.tokenizer, self.haystack)
            gen = tokens_to_generate(subtask)
            if self.max_new_tokens is not None and gen > self.max_new_tokens:
                gen, capped = self.max_new_tokens, capped + 1
            built.append(ex)
            asks.append(Generation(f"ruler/{subtask}/{length}/{index}", ex.ids, gen, chunked_prefill=True))
        outs = engine.generate_many(asks, progress=f"ruler/{engine.method.name}" if progress else None)
        examples = []
        for (subtask, length, index), ex, ask, out in zip(cells, built, asks, outs, strict=True):
            uid = ask.key
            row = {"id": uid, "subtask": subtask, "length": length, "index": index, "prompt_tokens": len(ex.ids)}
            row |= {"depth": ex.depth, "needle_pos": ex.needle_pos, "query": ex.query, "answers": ex.answers}
            examples.append(row | {"output": out, "answer": out.strip(), "score": string_match_all(out, ex.answers)})
        metrics = {k: float(est.value) for k, est in self.estimators(examples).items()}
        # results.json's task block takes ``n`` from the parameters (per cell): the total is ``examples``
        info = {"examples": len(examples), "generation_capped": capped}
        return Evaluation(metrics, examples, info, KEYS)

    def estimators(
        self, rows: Sequence[Mapping[str, Any]], keys: Sequence[str] = KEYS
    ) -> dict[str, intervals.Estimator]:
        """Scores ×100 per (subtask, length) cell, per subtask (mean over its lengths), per length (mean
        over subtasks, RULER's headline) and overall (mean over cells): each resampled within its cells."""
        out: dict[str, intervals.Estimator] = {}
        subtasks = list(dict.fromkeys(r["subtask"] for r in rows))
        lengths = sorted({int(r["length"]) for r in rows})
        for s in subtasks:
            for x in lengths:
                scores = [r["score"] for r in rows if r["subtask"] == s and int(r["length"]) == x]
                if scores:
                    out[f"{s}_{x}"] = intervals.mean(scores, 100)
        for s in subtasks:
            mine = [r for r in rows if r["subtask"] == s]
            out[s] = intervals.mean([r["score"] for r in mine], 100, [int(r["length"]) for r in mine])
        for x in lengths:
            mine = [r for r in rows if int(r["length"]) == x]
            out[f"len_{x}"] = intervals.mean([r["score"] for r in mine], 100, [r["subtask"] for r in mine])
        if rows:
            cells = [f"{r['subtask']}/{r['length']}" for r in rows]
            out["ruler_avg"] = intervals.mean([r["score"] for r in rows], 100, cells)
        return out


register_task("ruler", RulerTask)
