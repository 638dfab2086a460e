"""Greedy fidelity to fp16 on WikiText-2 windows: the protocol ``table_alignedkv`` and ``table_hf_quantized`` share.

Every cache decodes ``new_tokens`` greedy tokens after each prompt (consecutive WikiText-2 windows);
its tokens are compared position by position with fp16's on the same prompt, decoded once per run.
Kept out of the runners so the two tables measure exactly the same thing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvquant.cache import CacheCounts
from kvquant.errors import InvalidParameterError, KvquantError
from kvquant.eval.fidelity import Decoded, greedy_decode


def wikitext_ids(tokenizer) -> torch.Tensor:
    """WikiText-2 (test) as one 1-D id tensor, tokenized as the scripts these tables replace did."""
    from kvquant.data import corpus_ids

    return torch.tensor(corpus_ids(tokenizer, "wikitext", add_special_tokens=True))


def windows(ids: torch.Tensor, n: int, length: int) -> list[torch.Tensor]:
    """The first ``n`` consecutive windows of ``length`` tokens; one line if the text is too short."""
    if n < 1 or length < 1:
        raise InvalidParameterError(f"need at least one prompt of at least one token (got {n} × {length})")
    if n * length > ids.numel():
        raise InvalidParameterError(f"WikiText-2 holds {ids.numel()} tokens, fewer than {n} windows of {length}")
    return [ids[i * length : (i + 1) * length] for i in range(n)]


def check_fits(model, length: int, new_tokens: int, what: str) -> None:
    """Refuse a prompt + generation longer than the model's context (one line naming the setting)."""
    limit = model.config.max_position_embeddings
    if length + new_tokens > limit:
        raise InvalidParameterError(f"{what}: {length} + {new_tokens} new tokens exceed the model's {limit} positions")


def build_methods(specs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Registry methods by label (``{label: {name: <registry name>, **params}}``, name defaulting to the
    label), and the labels that cannot be built with the one-line reason."""
    from kvquant.methods import get_method

    methods, skipped = {}, {}
    for label, spec in specs.items():
        params = dict(spec or {})
        name = params.pop("name", label)
        try:
            methods[label] = get_method(name, **params)
        except KvquantError as exc:
            skipped[label] = " ".join(str(exc).split())
    return methods, skipped


def prompt_windows(model, tokenizer, exp: Any) -> list[torch.Tensor]:
    """The ``exp.prompts`` WikiText-2 windows of ``exp.prompt_tokens`` tokens, refused (one line) when they
    and ``exp.new_tokens`` exceed the model's context."""
    check_fits(model, int(exp.prompt_tokens), int(exp.new_tokens), "experiment.prompt_tokens")
    return windows(wikitext_ids(tokenizer), int(exp.prompts), int(exp.prompt_tokens))


def references(model, prompts: list[torch.Tensor], new_tokens: int) -> list[Decoded]:
    """fp16's greedy decode of every prompt: what each cache is compared with (and timed against, so one
    untimed warm-up decode comes first)."""
    from kvquant.methods import get_method

    fp16 = get_method("fp16", backend="torch")  # the reference as transformers computes it
    with fp16.attach(model):
        greedy_decode(model, prompts[0], fp16.new_cache(model), min(new_tokens, 2))
        return [greedy_decode(model, p, fp16.new_cache(model), new_tokens) for p in prompts]


@dataclass
class Fidelity:
    """A cache's greedy decodes against fp16's on the same prompts, summed over the prompts."""

    matches: list[float]
    prefixes: list[float]
    identical: int
    decode_s: float
    counts: CacheCounts

    def row(self) -> dict[str, float]:
        """The table columns: shares averaged over prompts, bits from the summed counts."""
        n = len(self.matches)
        row = {
            "greedy_match": sum(self.matches) / n,
            "before_divergence": sum(self.prefixes) / n,
            "prompts_identical": self.identical,
            "prompts": n,
            "decode_s": self.decode_s,
        }
        if self.counts.elements_k:
            summary = self.counts.summary()
            row |= {k: summary[k] for k in ("bits_stored", "bits_read", "bits_read_k", "bits_read_v")}
        return row


def compare(
    model, prompts: list[torch.Tensor], refs: list[Decoded], make_cache: Callable[[], Any], new_tokens: int
) -> Fidelity:
    """Greedy-decode every prompt through a fresh ``make_cache()`` and compare with fp16's tokens."""
    matches, prefixes, identical, decode_s, counts = [], [], 0, 0.0, CacheCounts()
    for prompt, ref in zip(prompts, refs, strict=True):
        out = greedy_decode(model, prompt, make_cache(), new_tokens)
        equal = out.tokens == ref.tokens
        matches.append(equal.float().mean().item())
        first = (~equal).nonzero()
        prefixes.append((int(first[0, 0]) if first.numel() else new_tokens) / new_tokens)
        identical += int(bool(equal.all()))
        decode_s += out.decode_s
        counts = counts + out.counts
    return Fidelity(matches, prefixes, identical, decode_s, counts)
