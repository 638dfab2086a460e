"""``wikitext``: WikiText-2 (raw, test) perplexity through the cache, on a fixed token budget.

The usual perplexity string (``"\\n\\n".join(rows)``) is tokenized once without special tokens and
cut into consecutive windows of ``window`` tokens; the first ``limit`` windows (``limit × window``
tokens: the budget; ``limit=null`` = the whole split) are each scored with a fresh cache, fed in
chunks of ``chunk_size`` tokens so every chunk attends to what the cache holds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from kvquant.data import corpus_ids
from kvquant.eval import intervals
from kvquant.eval.engine import Engine
from kvquant.eval.perplexity import ppl_estimators, ppl_metrics
from kvquant.eval.suite import Evaluation, SuiteTask
from kvquant.eval.tasks import AtLeast, Positive, register_task

KEYS = ("nll", "tokens")  # per window: mean NLL per token, tokens predicted


@dataclass(frozen=True)
class WikiTextTask(SuiteTask):
    """WikiText-2 perplexity over ``limit`` windows of ``window`` tokens, each with a fresh cache."""

    limit: Positive[int | None] = 4
    window: Annotated[int, AtLeast(2)] = 1024
    chunk_size: Positive[int] = 32
    source: Literal["bundled"] = "bundled"
    batch_size: Positive[int] = 8

    def evaluate(self, engine: Engine, progress: bool) -> Evaluation:
        self.check_context(engine.model, self.window, f"task.window={self.window}")
        ids = corpus_ids(engine.tokenizer, "wikitext")
        windows = [ids[i : i + self.window] for i in range(0, len(ids) - self.window + 1, self.window)]
        windows = windows[: self.limit] if self.limit is not None else windows
        examples = []
        asks = [(f"wikitext/{i}", win) for i, win in enumerate(windows)]
        scored = engine.score_many(asks, progress=f"wikitext/{engine.method.name}" if progress else None)
        for i, (s, t) in enumerate(scored):
            row = {"id": f"wikitext/{i}", "start_token": i * self.window}
            examples.append(row | {"nll": s / t, "ppl": math.exp(s / t), "tokens": t})
        return Evaluation(ppl_metrics(scored), examples, {"windows_available": len(ids) // self.window}, KEYS)

    def estimators(
        self, rows: Sequence[Mapping[str, Any]], keys: Sequence[str] = KEYS
    ) -> dict[str, intervals.Estimator]:
        """Token-weighted NLL and its exp over windows."""
        return ppl_estimators([(r["nll"] * r["tokens"], r["tokens"]) for r in rows])


register_task("wikitext", WikiTextTask)
