"""Perplexity computed by feeding text through a KV cache in chunks.

A single full-sequence forward never reads a quantized cache (every token attends to fresh fp16
K/V); feeding ``chunk_size`` tokens at a time makes each chunk attend to what the cache holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from kvquant.cache import CacheCounts
from kvquant.eval import intervals


@torch.no_grad()
def chunked_nll(model, ids: torch.Tensor, cache, chunk_size: int) -> tuple[float, int]:
    """Sum of next-token NLL (nats) over ``ids[1:]`` and the number of predicted tokens.

    ``ids`` is 1-D; each chunk goes through ``cache``, whose state carries over between chunks.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    ids = ids.to(model.device).view(1, -1)
    n = ids.shape[1]
    total = 0.0
    for start in range(0, n - 1, chunk_size):
        chunk = ids[:, start : start + chunk_size]
        logits = model(input_ids=chunk, past_key_values=cache, use_cache=True).logits[0].float()
        targets = ids[0, start + 1 : start + 1 + chunk.shape[1]]
        total += F.cross_entropy(logits[: targets.numel()], targets, reduction="sum").item()
    return total, n - 1


def ppl_metrics(nlls: Sequence[tuple[float, int]]) -> dict[str, float]:
    """Corpus perplexity of per-sequence (summed NLL, tokens): exp of the token-weighted mean NLL."""
    nll, tokens = sum(s for s, _ in nlls), sum(t for _, t in nlls)
    mean = nll / tokens if tokens else float("nan")
    return {"ppl": math.exp(mean), "nll": mean, "ppl_tokens": tokens}


def ppl_estimators(nlls: Sequence[tuple[float, int]]) -> dict[str, intervals.Estimator]:
    """Token-weighted NLL and perplexity over sequences, to resample (``ppl_tokens`` is the budget, not
    a measurement)."""
    sums, tokens = [s for s, _ in nlls], [t for _, t in nlls]
    return {"nll": intervals.ratio(sums, tokens), "ppl": intervals.ratio(sums, tokens, np.exp)}


def perplexity(
    model,
    sequences: Sequence[torch.Tensor],
    new_cache: Callable[[], object],
    chunk_size: int = 32,
    progress: Callable[[int], None] | None = None,
) -> tuple[dict[str, float], CacheCounts]:
    """Corpus perplexity over ``sequences``, each scored separately with a fresh cache, and the caches' counts."""
    nlls: list[tuple[float, int]] = []
    counts = CacheCounts()
    for seq in sequences:
        cache = new_cache()
        nlls.append(chunked_nll(model, seq, cache, chunk_size))
        counts = counts + cache.counts()
        if progress:
            progress(1)
    return ppl_metrics(nlls), counts
