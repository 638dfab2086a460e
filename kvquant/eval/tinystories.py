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
from dataclasses import dataclass
from typing import Any, Literal

import torch

from kvquant.data import tinystories_pieces
from kvquant.eval import intervals
from kvquant.eval.engine import Engine, Generation
from kvquant.eval.perplexity import ppl_estimators, ppl_metrics
from kvquant.eval.suite import Evaluation, SuiteTask
from kvquant.eval.tasks import NonNegative, Positive, register_task

KEYS = ("nll", "tokens")  # per story: summed NLL, tokens predicted


def encode(tokenizer, text: str, max_tokens: int | None = None) -> torch.Tensor:
    ids = tokenizer(text).input_ids
    return torch.tensor(ids[:max_tokens] if max_tokens else ids, dtype=torch.long)


@dataclass(frozen=True)
class TinyStoriesTask(SuiteTask):
    """Perplexity on TinyStories stories and greedy continuations of ``limit`` prompts, through the cache."""

    limit: NonNegative[int] = 20
    ppl_pieces: NonNegative[int] = 200
    chunk_size: Positive[int] = 32
    max_tokens: Positive[int] = 512
    prompt_tokens: Positive[int] = 256
    max_new_tokens: Positive[int] = 64
    source: Literal["bundled"] = "bundled"
    batch_size: Positive[int] = 8

    def evaluate(self, engine: Engine, progress: bool) -> Evaluation:
        model, tokenizer = engine.model, engine.tokenizer
        self.check_context(model, self.max_tokens, f"task.max_tokens={self.max_tokens}")
        self.check_context(
            model,
            self.prompt_tokens + self.max_new_tokens,
            f"task.prompt_tokens+task.max_new_tokens={self.prompt_tokens}+{self.max_new_tokens}",
        )
        pieces = tinystories_pieces()
        if max(self.ppl_pieces, self.limit) > len(pieces):
            raise self.invalid(f"{len(pieces)} stories are bundled; lower task.limit/task.ppl_pieces to at most that")
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


register_task("tinystories", TinyStoriesTask)
