"""``passkey``: a five-digit number hidden at a controlled depth in real filler text, then asked for.

Each cell (length, depth) builds, in tokens, LongLoRA/Landmark's prompt: an instruction, filler
from the bundled WikiText-2 (or TinyStories), the needle ``The pass key is N. Remember it. N is the
pass key.`` placed at ``depth`` of the filler, more filler, and ``What is the pass key? The pass key
is``. The prompt is fed through the cache in chunks of ``chunk_size`` before decoding, so the
question reads the needle from the (quantized) cache, not from fresh fp16 K/V. Score: the first
number generated equals N. A length equal to the model's context leaves room for the answer
(the prompt is ``max_new_tokens`` shorter); longer lengths are skipped and listed.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvquant.data import corpus_ids
from kvquant.eval import intervals
from kvquant.eval.engine import Engine, Generation, bos_prefix
from kvquant.eval.scorers import first_number, passkey_match
from kvquant.eval.suite import Evaluation, SuiteTask, mean
from kvquant.eval.tasks import Positive, register_task

INSTRUCTION = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important info there.\n\n"
)
NEEDLE = "\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n"
QUESTION = "\n\nWhat is the pass key? The pass key is"
KEYS = ("correct", "length", "depth")  # what the accuracies are computed from


@dataclass(frozen=True)
class PasskeyTask(SuiteTask):
    """A pass key hidden at each (length, depth) of real filler text, asked for after the filler."""

    lengths: list[int] | None = None  # None: 1024, 2048, 4096, 8192
    depths: list[float] | None = None  # None: 0.5
    trials: Positive[int] = 1
    limit: Positive[int | None] = None
    chunk_size: Positive[int] = 256
    max_new_tokens: Positive[int] = 8
    filler: Literal["wikitext", "tinystories"] = "wikitext"
    seed: int = 0
    source: Literal["bundled"] = "bundled"
    batch_size: Positive[int] = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        lengths = [int(x) for x in (self.lengths if self.lengths is not None else [1024, 2048, 4096, 8192])]
        depths = [float(x) for x in (self.depths if self.depths is not None else [0.5])]
        if any(not 0.0 <= d <= 1.0 for d in depths):
            raise self.invalid(f"depths {depths} must lie in [0, 1]")
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "depths", depths)

    def cells(self) -> list[tuple[int, float, int]]:
        out = [(n, d, t) for n in self.lengths for d in self.depths for t in range(self.trials)]
        return out[: self.limit] if self.limit is not None else out

    def prompt(self, tokenizer, filler_ids: list[int], length: int, depth: float, trial: int) -> tuple[list[int], str]:
        """The prompt ids (exactly ``length`` tokens) and the pass key hidden in it."""
        rng = random.Random(f"{self.seed}/{length}/{depth}/{trial}")
        key = str(rng.randint(10000, 99999))

        def enc(text: str) -> list[int]:
            return tokenizer(text, add_special_tokens=False).input_ids

        head, needle, question = bos_prefix(tokenizer) + enc(INSTRUCTION), enc(NEEDLE.format(key=key)), enc(QUESTION)
        budget = length - len(head) - len(needle) - len(question)
        if budget < 0:
            raise self.invalid(f"length {length} is too short for the prompt's fixed parts")
        start = rng.randrange(0, max(1, len(filler_ids) - budget))
        filler = filler_ids[start : start + budget]
        cut = int(round(depth * len(filler)))
        return head + filler[:cut] + needle + filler[cut:] + question, key

    def evaluate(self, engine: Engine, progress: bool) -> Evaluation:
        tok = engine.tokenizer
        filler_ids = corpus_ids(tok, self.filler)
        room = engine.max_length - self.max_new_tokens
        cells = [c for c in self.cells() if c[0] <= engine.max_length]
        skipped = sorted({c[0] for c in self.cells() if c[0] > engine.max_length})
        if not cells:
            raise self.invalid(
                f"every length in {self.lengths} exceeds the model's context "
                f"({engine.max_length}); choose task.lengths at most {engine.max_length}"
            )
        built = [self.prompt(tok, filler_ids, min(length, room), depth, trial) for length, depth, trial in cells]
        asks = [
            Generation(f"passkey/{length}/{depth}/{trial}", ids, self.max_new_tokens, ("\n",), chunked_prefill=True)
            for (length, depth, trial), (ids, _) in zip(cells, built, strict=True)
        ]
        outs = engine.generate_many(asks, progress=f"passkey/{engine.method.name}" if progress else None)
        examples = []
        for (length, depth, _), (ids, key), ask, out in zip(cells, built, asks, outs, strict=True):
            uid = ask.key
            score = passkey_match(out, key)
            row = {"id": uid, "length": length, "prompt_tokens": len(ids), "depth": depth, "passkey": key}
            row["output"] = out
            examples.append(row | {"answer": first_number(out), "correct": score})
        metrics = {"passkey_acc": mean([e["correct"] for e in examples])}
        for length in sorted({e["length"] for e in examples}):
            metrics[f"acc_len_{length}"] = mean([e["correct"] for e in examples if e["length"] == length])
        for depth in sorted({e["depth"] for e in examples}):
            metrics[f"acc_depth_{depth:g}"] = mean([e["correct"] for e in examples if e["depth"] == depth])
        return Evaluation(metrics, examples, {"skipped_lengths": skipped} if skipped else {}, KEYS)

    def estimators(
        self, rows: Sequence[Mapping[str, Any]], keys: Sequence[str] = KEYS
    ) -> dict[str, intervals.Estimator]:
        """Accuracy overall and per length and depth (each over its own cells)."""
        out = {"passkey_acc": intervals.mean([r["correct"] for r in rows])}
        for length in sorted({r["length"] for r in rows}):
            out[f"acc_len_{length}"] = intervals.mean([r["correct"] for r in rows if r["length"] == length])
        for depth in sorted({r["depth"] for r in rows}):
            out[f"acc_depth_{depth:g}"] = intervals.mean([r["correct"] for r in rows if r["depth"] == depth])
        return out


register_task("passkey", PasskeyTask)
