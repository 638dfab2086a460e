"""``wikitext``: WikiText-2 (raw, test) perplexity through the cache, on a fixed token budget.

The usual perplexity string (``"\\n\\n".join(rows)``) is tokenized once without special tokens and
cut into consecutive windows of ``window`` tokens; the first ``limit`` windows (``limit × window``
tokens: the budget; ``limit=null`` = the whole split) are each scored with a fresh cache, fed in
chunks of ``chunk_size`` tokens so every chunk attends to what the cache holds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvquant.data import wikitext2_test
from kvquant.eval import intervals
from kvquant.eval.engine import Engine
from kvquant.eval.suite import Evaluation, SuiteTask, check_positive, check_source
from kvquant.eval.tasks import register_task
from kvquant.eval.tinystories import check_context

KEYS = ("nll", "tokens")  # per window: mean NLL per token, tokens predicted


class WikiTextTask(SuiteTask):
    def __init__(
        self,
        limit: int | None = 4,
        window: int = 1024,
        chunk_size: int = 32,
        source: str = "bundled",
        batch_size: int = 8,
    ):
        check_source("wikitext", source, ("bundled",))
        check_positive("wikitext", limit=limit, window=window, chunk_size=chunk_size, batch_size=batch_size)
        if window < 2:
            raise ValueError("window must be >= 2")
        self.limit = None if limit is None else int(limit)
        self.window, self.chunk_size, self.source = int(window), int(chunk_size), source
        self.batch_size = int(batch_size)

    def evaluate(self, engine: Engine, progress: bool) -> Evaluation:
        check_context(engine.model, self.window, f"task.window={self.window}")
        ids = engine.tokenizer(wikitext2_test(), add_special_tokens=False).input_ids
        windows = [ids[i : i + self.window] for i in range(0, len(ids) - self.window + 1, self.window)]
        windows = windows[: self.limit] if self.limit is not None else windows
        nll, tokens, examples = 0.0, 0, []
        asks = [(f"wikitext/{i}", win) for i, win in enumerate(windows)]
        scored = engine.score_many(asks, progress=f"wikitext/{engine.method.name}" if progress else None)
        for i, (s, t) in enumerate(scored):
            nll, tokens = nll + s, tokens + t
            row = {"id": f"wikitext/{i}", "start_token": i * self.window}
            examples.append(row | {"nll": s / t, "ppl": math.exp(s / t), "tokens": t})
        mean = nll / tokens if tokens else float("nan")
        metrics = {"ppl": math.exp(mean), "nll": mean, "ppl_tokens": tokens}
        return Evaluation(metrics, examples, {"windows_available": len(ids) // self.window}, KEYS)

    def estimators(
        self, rows: Sequence[Mapping[str, Any]], keys: Sequence[str] = KEYS
    ) -> dict[str, intervals.Estimator]:
        """Token-weighted NLL and its exp over windows (``ppl_tokens`` is the budget, not a measurement)."""
        sums, tokens = [r["nll"] * r["tokens"] for r in rows], [r["tokens"] for r in rows]
        return {"nll": intervals.ratio(sums, tokens), "ppl": intervals.ratio(sums, tokens, np.exp)}


register_task("wikitext", WikiTextTask)
