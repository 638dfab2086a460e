"""``tinystories``: perplexity through the cache on TinyStories validation stories + greedy continuations.

Perplexity scores the first ``ppl_pieces`` stories (each separately, BOS as the tokenizer adds it,
at most ``max_tokens`` tokens), fed in chunks of ``chunk_size``; with a reference method the stories
are scored with it too, for the paired difference of perplexity (intervals resample stories).
Greedy continuations of the first ``limit`` prompts give timing, bits read and fidelity to fp16:
prompt i is the first ``prompt_tokens`` tokens of stories i, i+1, … joined by blank lines — long
enough (256 by default) that caches with an fp16 window (KIVI's 128 tokens) quantize part of it, so
fidelity measures the method, not the window.
"""

from __future__ import annotations

import numpy as np
import torch
from tqdm.auto import tqdm

from kvquant.cache import CacheCounts
from kvquant.data import tinystories_pieces
from kvquant.errors import InvalidParameterError
from kvquant.eval import intervals
from kvquant.eval.fidelity import compare_to_reference, decode_timing, greedy_decode
from kvquant.eval.perplexity import ppl_metrics, sequence_nlls
from kvquant.eval.tasks import Task, TaskResult, register_task


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


class TinyStoriesTask(Task):
    def __init__(
        self,
        limit: int = 20,
        ppl_pieces: int = 200,
        chunk_size: int = 32,
        max_tokens: int = 512,
        prompt_tokens: int = 256,
        max_new_tokens: int = 64,
        source: str = "bundled",
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
        ]:
            if int(value) < (0 if key in ("limit", "ppl_pieces") else 1):
                raise InvalidParameterError(f"task tinystories: {key}={value} must be positive")
        self.limit, self.ppl_pieces, self.chunk_size = int(limit), int(ppl_pieces), int(chunk_size)
        self.max_tokens, self.prompt_tokens, self.max_new_tokens = (
            int(max_tokens),
            int(prompt_tokens),
            int(max_new_tokens),
        )
        self.source = source

    def run(
        self, model, tokenizer, method, reference_method=None, progress: bool = False, reference_dir=None
    ) -> TaskResult:
        check_context(model, self.max_tokens, f"task.max_tokens={self.max_tokens}")
        check_context(
            model,
            self.prompt_tokens + self.max_new_tokens,
            f"task.prompt_tokens+task.max_new_tokens={self.prompt_tokens}+{self.max_new_tokens}",
        )
        pieces = tinystories_pieces()
        if max(self.ppl_pieces, self.limit) > len(pieces):
            raise InvalidParameterError(f"task tinystories has {len(pieces)} stories; lower limit/ppl_pieces")
        sequences = [encode(tokenizer, p, self.max_tokens) for p in pieces[: self.ppl_pieces]]
        prompts = [encode(tokenizer, "\n\n".join(pieces[i : i + 8]), self.prompt_tokens) for i in range(self.limit)]

        total = len(sequences) * (1 if reference_method is None else 2) + len(prompts)
        bar = tqdm(total=total, desc=f"tinystories/{method.name}", disable=not progress)
        nlls, _ = sequence_nlls(model, sequences, lambda: method.new_cache(model), self.chunk_size, bar.update)
        metrics = ppl_metrics(nlls)
        estimators = {"metrics": ppl_estimators(nlls)}
        paired = None
        if reference_method is not None:
            ref_nlls, _ = sequence_nlls(
                model, sequences, lambda: reference_method.new_cache(model), self.chunk_size, bar.update
            )
            ref_estimators = ppl_estimators(ref_nlls)
            paired = {k: (v, ref_estimators[k]) for k, v in estimators["metrics"].items()}
        if reference_method is None:
            decodes = []
            for prompt in prompts:
                decodes.append(greedy_decode(model, prompt, method.new_cache(model), self.max_new_tokens))
                bar.update(1)
            fidelity = None
        else:
            run = compare_to_reference(
                model,
                prompts,
                lambda: method.new_cache(model),
                lambda: reference_method.new_cache(model),
                self.max_new_tokens,
                bar.update,
            )
            decodes, fidelity = run.decodes, run.summary()
            estimators["fidelity"] = run.estimators()
        bar.close()
        counts = sum((d.counts for d in decodes), start=CacheCounts())
        ci95, n_by_key, differences, problems = intervals.blocks(
            estimators, {"metrics": metrics, "fidelity": fidelity or {}}, paired
        )
        return TaskResult(
            metrics=metrics,
            n=len(sequences),
            counts=counts,
            timing=decode_timing(decodes),
            fidelity=fidelity,
            info={"interval_problems": problems} if problems else {},
            ci95=ci95,
            n_by_key=n_by_key,
            paired=differences,
        )


def ppl_estimators(nlls: list[tuple[float, int]]) -> dict[str, intervals.Estimator]:
    """Token-weighted NLL and perplexity over stories (``ppl_tokens`` is the budget, not a measurement)."""
    sums, tokens = [s for s, _ in nlls], [t for _, t in nlls]
    return {"nll": intervals.ratio(sums, tokens), "ppl": intervals.ratio(sums, tokens, np.exp)}


register_task("tinystories", TinyStoriesTask)
