"""``tinystories``: perplexity through the cache on TinyStories validation stories + greedy continuations.

Perplexity scores the first ``ppl_pieces`` stories (each separately, BOS as the tokenizer adds it,
at most ``max_tokens`` tokens), fed in chunks of ``chunk_size``; fp16's reference scores them too,
for the paired difference of perplexity (intervals resample stories). Greedy continuations of the
first ``limit`` prompts give decode timing, fidelity to fp16 and answer agreement (the share of
prompts whose whole continuation equals fp16's): prompt i is the first ``prompt_tokens`` tokens of
stories i, i+1, … joined by blank lines — long enough (256 by default) that caches with an fp16
window (KIVI's 128 tokens) quantize part of it, so fidelity measures the method, not the window.
Everything runs through an ``Engine``, ``batch_size`` sequences at a time (each row its own cache),
so bits stored/read count all the cache did: scoring and decoding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvquant.data import tinystories_pieces
from kvquant.errors import InvalidParameterError
from kvquant.eval import intervals
from kvquant.eval.engine import Engine, Generation
from kvquant.eval.perplexity import ppl_metrics
from kvquant.eval.suite import Evaluation, SuiteTask
from kvquant.eval.tasks import register_task

KEYS = ("nll", "tokens")  # per story: summed NLL, tokens predicted


def encode(tokenizer, text: str, max_tokens: int | None = None) -> torch.Tensor:
    ids = tokenizer(text).input_ids
    return torch.tensor(ids[:max_tokens] if max_tokens else ids, dtype=torch.long)


def check_context(model, needed: int, what: str) -> None:
    """Refuse lengths past the model's trained context with a one-line fix."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and needed > limit:
        raise InvalidParameterError(
            f"{what} needs {needed} tokens but the model's context is {limit}; lower it to at most {limit}"
        )


class TinyStoriesTask(SuiteTask):
    def __init__(
        self,
        limit: int = 20,
        ppl_pieces: int = 200,
        chunk_size: int = 32,
        max_tokens: int = 512,
        prompt_tokens: int = 256,
        max_new_tokens: int = 64,
        source: str = "bundled",
        batch_size: int = 8,
    ):
        if source != "bundled":
            raise InvalidParameterError(f"task tinystories: source '{source}' is not offered; use source=bundled")
        for key, value in [
            ("limit", limit),
            ("ppl_pieces", ppl_pieces),
            ("chunk_size", chunk_size),
            ("max_tokens", max_tokens),
            ("prompt_tokens", prompt_tokens),
            ("max_new_tokens", max_new_tokens),
            ("batch_size", batch_size),
        ]:
            if int(value) < (0 if key in ("limit", "ppl_pieces") else 1):
                raise InvalidParameterError(f"task tinystories: {key}={value} must be positive")
        self.limit, self.ppl_pieces, self.chunk_size = int(limit), int(ppl_pieces), int(chunk_size)
        self.max_tokens, self.prompt_tokens, self.max_new_tokens = (
            int(max_tokens),
            int(prompt_tokens),
            int(max_new_tokens),
        )
        self.source, self.batch_size = source, int(batch_size)

    def evaluate(self, engine: Engine, progress: bool) -> Evaluation:
        model, tokenizer = engine.model, engine.tokenizer
        check_context(model, self.max_tokens, f"task.max_tokens={self.max_tokens}")
        check_context(
            model,
            self.prompt_tokens + self.max_new_tokens,
            f"task.prompt_tokens+task.max_new_tokens={self.prompt_tokens}+{self.max_new_tokens}",
        )
        pieces = tinystories_pieces()
        if max(self.ppl_pieces, self.limit) > len(pieces):
            raise InvalidParameterError(f"task tinystories has {len(pieces)} stories; lower limit/ppl_pieces")
        stories = [
            (f"story/{i}", encode(tokenizer, p, self.max_tokens).tolist())
            for i, p in enumerate(pieces[: self.ppl_pieces])
        ]
        label = f"tinystories/{engine.method.name}" if progress else None
        scored = engine.score_many(stories, progress=label)
        examples = [{"id": key, "nll": nll, "tokens": n} for (key, _), (nll, n) in zip(stories, scored, strict=True)]
        asks = [
            Generation(
                f"prompt/{i}",
                encode(tokenizer, "\n\n".join(pieces[i : i + 8]), self.prompt_tokens).tolist(),
                self.max_new_tokens,
            )
            for i in range(self.limit)
        ]
        outs = engine.generate_many(asks, progress=label)
        examples += [{"id": ask.key, "output": out, "answer": out} for ask, out in zip(asks, outs, strict=True)]
        metrics = ppl_metrics([(nll, n) for nll, n in scored])
        return Evaluation(metrics, examples, {"prompts": len(asks)}, KEYS, n=len(stories))

    def estimators(
        self, rows: Sequence[Mapping[str, Any]], keys: Sequence[str] = KEYS
    ) -> dict[str, intervals.Estimator]:
        """Perplexity over the scored stories (the continuation rows carry no NLL)."""
        return ppl_estimators([(r["nll"], r["tokens"]) for r in rows if "tokens" in r])


def ppl_estimators(nlls: list[tuple[float, int]]) -> dict[str, intervals.Estimator]:
    """Token-weighted NLL and perplexity over stories (``ppl_tokens`` is the budget, not a measurement)."""
    sums, tokens = [s for s, _ in nlls], [t for _, t in nlls]
    return {"nll": intervals.ratio(sums, tokens), "ppl": intervals.ratio(sums, tokens, np.exp)}


register_task("tinystories", TinyStoriesTask)
