"""Fidelity of a KV method to fp16 on the same prompts.

- ``greedy_match``: share of generated positions where the method's free-running greedy token equals
  fp16's; ``first_divergence``: mean index of the first differing token (``max_new_tokens`` if none);
  ``prompts_identical``: share of prompts whose whole continuation is identical.
- ``kl`` and ``top1_agreement``: the method is teacher-forced along fp16's greedy tokens, one decode
  step at a time through its cache, and its next-token distribution is compared with fp16's.

Near-ties. A greedy token whose top-2 log-probability margin is below ``NEAR_TIE`` can flip under
any reordering of fp32 sums (another BLAS code path, thread count or batch shape), so a check of
"same greedy output" allows a different token only there (``unexplained_flips``,
``first_flip_is_near_tie``); everywhere else a different token is a real change.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvquant.cache import CacheCounts
from kvquant.eval import intervals


@dataclass
class Decoded:
    """One greedy (or teacher-forced) continuation with its per-step log-probabilities."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    prompt_tokens: int
    prefill_s: float
    decode_s: float
    counts: CacheCounts = field(default_factory=CacheCounts)


@torch.no_grad()
def greedy_decode(
    model, prompt: torch.Tensor, cache, max_new_tokens: int, forced: torch.Tensor | None = None
) -> Decoded:
    """Prefill ``prompt`` (1-D ids) into ``cache``, then decode one token per step.

    With ``forced``, step i feeds ``forced[i]`` instead of the argmax (teacher forcing).
    """
    device = model.device
    t0 = time.perf_counter()
    ids = prompt.to(device).view(1, -1)  # the prompt's last logits only: no [n, vocab] tensor for a long prompt
    logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
    t1 = time.perf_counter()
    tokens, logprobs = [], []
    for i in range(max_new_tokens):
        lp = torch.log_softmax(logits.float(), dim=-1)
        nxt = forced[i].to(device) if forced is not None else lp.argmax()
        tokens.append(nxt)
        logprobs.append(lp)
        if i + 1 < max_new_tokens:
            logits = model(input_ids=nxt.view(1, 1), past_key_values=cache, use_cache=True).logits[0, -1]
    t2 = time.perf_counter()
    counts = cache.counts() if hasattr(cache, "counts") else CacheCounts()
    return Decoded(torch.stack(tokens).cpu(), torch.stack(logprobs).cpu(), prompt.numel(), t1 - t0, t2 - t1, counts)


NEAR_TIE = 0.01  # nats: fp16/truncation/AlignedKV tests hold at it under both of CI's summation orders


def top2_margin(logprobs: torch.Tensor) -> torch.Tensor:
    """Log-probability gap between the first and second token of each row."""
    top = logprobs.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def unexplained_flips(
    reference_tokens: torch.Tensor,
    reference_logprobs: torch.Tensor,
    forced_logprobs: torch.Tensor,
    tol: float = NEAR_TIE,
) -> list[int]:
    """Steps where a run teacher-forced along the reference's tokens ranks another token first although
    the reference's top-2 margin there is at least ``tol`` (a flip no summation order explains)."""
    differ = forced_logprobs.argmax(-1) != reference_tokens
    return (differ & (top2_margin(reference_logprobs) >= tol)).nonzero().flatten().tolist()


def first_flip_is_near_tie(
    reference_tokens: torch.Tensor, reference_logprobs: torch.Tensor, tokens: torch.Tensor, tol: float = NEAR_TIE
) -> bool:
    """Free-running greedy outputs agree up to their first difference, and that one is a near-tie of
    the reference (after it the two runs see different text, so nothing more can be compared)."""
    differ = (tokens != reference_tokens).nonzero()
    return not differ.numel() or bool(top2_margin(reference_logprobs[int(differ[0, 0])]) < tol)


def kl_divergence(ref_logprobs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """KL(ref ‖ other) per row, in nats."""
    return (ref_logprobs.exp() * (ref_logprobs - logprobs)).sum(-1).clamp_min(0.0)


@dataclass
class FidelityRun:
    """Per-prompt fidelity numbers plus the method's own free-running decodes (for bits and timing)."""

    matches: list[float] = field(default_factory=list)
    first_divergence: list[int] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    top1: list[float] = field(default_factory=list)
    decodes: list[Decoded] = field(default_factory=list)

    def add(self, reference: Decoded, free: Decoded, forced: Decoded) -> None:
        same = reference.tokens == free.tokens
        n = same.numel()
        diverged = (~same).nonzero()
        self.matches.append(same.float().mean().item())
        self.first_divergence.append(int(diverged[0, 0]) if diverged.numel() else n)
        self.kl.append(kl_divergence(reference.logprobs, forced.logprobs).mean().item())
        self.top1.append((reference.logprobs.argmax(-1) == forced.logprobs.argmax(-1)).float().mean().item())
        self.decodes.append(free)

    def per_prompt(self) -> dict[str, list[float]]:
        """Each summary number's value per prompt (what its interval resamples)."""
        n_new = self.decodes[0].tokens.numel() if self.decodes else 0
        return {
            "greedy_match": list(self.matches),
            "first_divergence": [float(d) for d in self.first_divergence],
            "prompts_identical": [float(d == n_new) for d in self.first_divergence],
            "kl": list(self.kl),
            "top1_agreement": list(self.top1),
        }

    def summary(self) -> dict[str, float]:
        def mean(xs: Sequence[float]) -> float:
            return float(sum(xs) / len(xs)) if xs else float("nan")

        return {name: mean(values) for name, values in self.per_prompt().items()}

    def estimators(self) -> dict[str, intervals.Estimator]:
        """The summary's numbers as means over prompts, for their intervals (prompts are the examples)."""
        return {name: intervals.mean(values) for name, values in self.per_prompt().items() if values}


def compare_to_reference(
    model,
    prompts: Sequence[torch.Tensor],
    new_cache: Callable[[], object],
    new_reference_cache: Callable[[], object],
    max_new_tokens: int,
    progress: Callable[[int], None] | None = None,
) -> FidelityRun:
    """Decode every prompt with the reference (fp16) and the method; collect fidelity per prompt."""
    run = FidelityRun()
    for prompt in prompts:
        reference = greedy_decode(model, prompt, new_reference_cache(), max_new_tokens)
        free = greedy_decode(model, prompt, new_cache(), max_new_tokens)
        forced = greedy_decode(model, prompt, new_cache(), max_new_tokens, forced=reference.tokens)
        run.add(reference, free, forced)
        if progress:
            progress(1)
    return run


def decode_timing(decodes: Sequence[Decoded]) -> dict[str, float]:
    """Prefill and decode throughput over a set of greedy decodes."""
    prefill_tokens = sum(d.prompt_tokens for d in decodes)
    decode_steps = sum(max(d.tokens.numel() - 1, 0) for d in decodes)
    prefill_s = sum(d.prefill_s for d in decodes)
    decode_s = sum(d.decode_s for d in decodes)
    return {
        "prefill_tok_s": prefill_tokens / prefill_s if prefill_s else float("nan"),
        "decode_tok_s": decode_steps / decode_s if decode_s else float("nan"),
    }
