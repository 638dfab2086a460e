"""One KV method run over evaluation requests, every request with a fresh cache from the method.

Log-likelihoods feed the text through the cache in chunks of ``chunk_size`` tokens (a single
forward never reads a quantized cache); generations hand ``model.generate`` a fresh cache. Each
request is a *unit* with a stable key. Without a reference the engine records each unit's tokens
and top-k log-probabilities (``Reference``); with one it compares every unit with it as it goes
(``kvquant.eval.reference.FidelityStats``).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from kvquant.cache import CacheCounts
from kvquant.errors import KvquantError
from kvquant.eval.reference import FidelityStats, Reference, UnitRecord


class StopOnStrings(StoppingCriteria):
    """Stop once the generated text contains any of ``stops`` (lm-eval's ``until``)."""

    def __init__(self, tokenizer, stops: Sequence[str], prompt_len: int):
        self.tokenizer, self.stops, self.prompt_len = tokenizer, [s for s in stops if s], prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores=None, **kwargs) -> torch.BoolTensor:
        text = self.tokenizer.decode(input_ids[0, self.prompt_len :]) if self.stops else ""
        done = any(s in text for s in self.stops)
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


class _Clock(BaseStreamer):
    """Timestamps of ``generate``'s streamer calls: the prompt, then one per new token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def bos_prefix(tokenizer) -> list[int]:
    """``[bos]`` if the tokenizer starts its encodings with BOS (stories260k does, SmolLM2 does not), else ``[]``."""
    ids = tokenizer("a").input_ids
    bos = tokenizer.bos_token_id
    return [bos] if bos is not None and ids and ids[0] == bos else []


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """``text`` up to the first stop string (lm-eval's post-processing of ``until``)."""
    for stop in stops:
        if stop:
            text = text.split(stop)[0]
    return text


class Engine:
    """Runs ``method`` on one request at a time and keeps counts, timing and fidelity.

    ``reference=None`` records a ``Reference`` (what the fp16 run provides for the others);
    otherwise each unit is compared with the reference unit of the same key.
    """

    def __init__(
        self,
        model,
        tokenizer,
        method,
        chunk_size: int = 32,
        reference: Reference | None = None,
        max_length: int | None = None,
    ):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.model, self.tokenizer, self.method = model, tokenizer, method
        self.chunk_size = chunk_size
        self.reference = reference
        self.recording = Reference() if reference is None else None
        self.fidelity = FidelityStats()
        self.max_length = max_length or getattr(model.config, "max_position_embeddings", None) or 2048
        self.counts = CacheCounts()
        self.n_caches = 0
        self.truncated = 0
        self.prefill_tokens = self.decode_steps = 0
        self.prefill_s = self.decode_s = 0.0

    # ------------------------------------------------------------------ caches and forwards
    def new_cache(self):
        self.n_caches += 1
        return self.method.new_cache(self.model)

    def _retire(self, cache) -> None:
        if hasattr(cache, "counts"):
            self.counts = self.counts + cache.counts()

    @torch.no_grad()
    def feed(
        self,
        ids: Sequence[int],
        cache,
        on_logits: Callable[[torch.Tensor], None] | None = None,
        chunk_size: int | None = None,
    ) -> None:
        """Feed ``ids`` through ``cache`` ``chunk_size`` tokens at a time; hand each chunk's logits (fp32, CPU) on."""
        device = self.model.device
        step = chunk_size or self.chunk_size
        for start in range(0, len(ids), step):
            chunk = torch.tensor([list(ids[start : start + step])], dtype=torch.long, device=device)
            logits = self.model(input_ids=chunk, past_key_values=cache, use_cache=True).logits[0]
            if on_logits is not None:
                on_logits(logits.float().cpu())

    def chunked_logits(self, ids: Sequence[int], cache, chunk_size: int | None = None) -> torch.Tensor:
        parts: list[torch.Tensor] = []
        self.feed(ids, cache, parts.append, chunk_size)
        return torch.cat(parts) if parts else torch.empty(0, self.model.config.vocab_size)

    # ------------------------------------------------------------------ log-likelihood
    def fit(self, ctx: list[int], cont: list[int]) -> tuple[list[int], list[int]]:
        """Left-truncate ``ctx + cont`` to the model's context (lm-eval's rule), counting truncations."""
        room = self.max_length + 1
        if len(ctx) + len(cont) <= room:
            return ctx, cont
        self.truncated += 1
        whole = (ctx + cont)[-room:]
        cont = cont[-(room - 1) :]
        return whole[: len(whole) - len(cont)], cont

    @torch.no_grad()
    def loglikelihood(self, key: str, ctx: list[int], conts: Sequence[list[int]]) -> list[tuple[float, bool]]:
        """Log-probability of each continuation after ``ctx`` (and whether it is the greedy one).

        The context goes through the cache once in chunks; each continuation then continues from a
        copy of that cache (the prefix is shared, the quantized state is the same for all choices).
        """
        pairs = [self.fit(list(ctx), list(c)) for c in conts]
        shared = all(p[0] == pairs[0][0] for p in pairs)
        base = None
        if shared and len(pairs[0][0]) > 1:
            base = self.new_cache()
            t0 = time.perf_counter()
            self.feed(pairs[0][0][:-1], base)
            self.prefill_s += time.perf_counter() - t0
            self.prefill_tokens += len(pairs[0][0]) - 1
        out = []
        for j, (c_ids, cont) in enumerate(pairs):
            cache = None
            if base is not None:
                try:
                    cache = base if j == len(pairs) - 1 else copy.deepcopy(base)
                    self.n_caches += cache is not base
                except Exception:  # a store that cannot be copied: recompute its prefix instead
                    cache = None
            if cache is None:
                cache = self.new_cache()
                self.feed(c_ids[:-1], cache)
            t0 = time.perf_counter()
            logits = self.chunked_logits(c_ids[-1:] + cont[:-1], cache)
            self.prefill_s += time.perf_counter() - t0
            self.prefill_tokens += len(cont)
            self._retire(cache)
            logprobs = torch.log_softmax(logits, dim=-1)
            target = torch.tensor(cont)
            ll = float(logprobs.gather(1, target.view(-1, 1)).sum())
            greedy = bool((logprobs.argmax(-1) == target).all())
            self._observe(f"{key}#{j}", target, logprobs, generated=False)
            out.append((ll, greedy))
        return out

    @torch.no_grad()
    def score(self, key: str, ids: list[int]) -> tuple[float, int]:
        """Sum of next-token NLL over ``ids[1:]`` fed in chunks through a fresh cache (perplexity)."""
        cache = self.new_cache()
        target = torch.tensor(ids[1:])
        nll, pos = 0.0, 0
        logprob_parts: list[torch.Tensor] = []

        def consume(logits: torch.Tensor) -> None:
            nonlocal nll, pos
            lp = torch.log_softmax(logits, dim=-1)[: target.numel() - pos]
            nll -= float(lp.gather(1, target[pos : pos + lp.shape[0]].view(-1, 1)).sum())
            logprob_parts.append(lp)
            pos += lp.shape[0]

        t0 = time.perf_counter()
        self.feed(ids[:-1], cache, consume)
        self.prefill_s += time.perf_counter() - t0
        self.prefill_tokens += len(ids) - 1
        self._retire(cache)
        self._observe(f"{key}#0", target, torch.cat(logprob_parts), generated=False)
        return nll, target.numel()

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def _generate(self, ids: list[int], max_new_tokens: int, stops: Sequence[str], chunked_prefill: bool):
        cache = self.new_cache()
        device = self.model.device
        t0 = time.perf_counter()
        if chunked_prefill and len(ids) > 1:
            self.feed(ids[:-1], cache)
        clock = _Clock()
        prompt = torch.tensor([ids], dtype=torch.long, device=device)
        out = self.model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            past_key_values=cache,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            stopping_criteria=StoppingCriteriaList([StopOnStrings(self.tokenizer, stops, len(ids))]),
            pad_token_id=self.tokenizer.pad_token_id
            if self.tokenizer.pad_token_id is not None
            else self.tokenizer.eos_token_id,
            use_cache=True,
            output_logits=True,
            return_dict_in_generate=True,
            streamer=clock,
        )
        tokens = out.sequences[0, len(ids) :].cpu()
        logprobs = torch.log_softmax(torch.stack([x[0] for x in out.logits]).float().cpu(), dim=-1)
        if len(clock.times) >= 2:
            self.prefill_s += clock.times[1] - t0
            self.decode_s += clock.times[-1] - clock.times[1]
            self.prefill_tokens += len(ids)
            self.decode_steps += len(clock.times) - 2
        self._retire(cache)
        return tokens, logprobs

    @torch.no_grad()
    def forced_logprobs(self, ids: list[int], forced: torch.Tensor, chunked_prefill: bool) -> torch.Tensor:
        """The method's next-token log-probs along ``forced`` (teacher forcing).

        The prompt is processed as the free generation processes it, and then every forced token is
        one decode step, as in generation: fed in chunks, a multi-token forward would attend in full
        precision within the chunk (AlignedKV reads aligned only in decode), and KL would read ≈ 0.
        """
        cache = self.new_cache()
        if chunked_prefill:
            self.feed(ids[:-1], cache)
            logits = self.chunked_logits(ids[-1:] + forced[:-1].tolist(), cache, chunk_size=1)
        else:
            first = self.model(
                input_ids=torch.tensor([ids], device=self.model.device), past_key_values=cache, use_cache=True
            ).logits[0, -1:]
            logits = torch.cat([first.float().cpu(), self.chunked_logits(forced[:-1].tolist(), cache, chunk_size=1)])
        self._retire(cache)
        return torch.log_softmax(logits, dim=-1)

    def generate(
        self,
        key: str,
        ids: list[int],
        max_new_tokens: int,
        stops: Sequence[str] = (),
        chunked_prefill: bool = False,
    ) -> str:
        """Greedy continuation of ``ids`` (left-truncated to fit ``max_new_tokens``), cut at the first stop."""
        room = max(1, self.max_length - max_new_tokens)
        if len(ids) > room:
            self.truncated += 1
            ids = ids[-room:]
        tokens, logprobs = self._generate(list(ids), max_new_tokens, stops, chunked_prefill)
        ref = self.reference.units.get(f"{key}#0") if self.reference is not None else None
        if ref is not None and tokens.numel() and not torch.equal(tokens, ref.tokens[: tokens.numel()].long()):
            forced = self.forced_logprobs(list(ids), ref.tokens.long(), chunked_prefill) if ref.tokens.numel() else None
        else:
            forced = logprobs
        self._observe(f"{key}#0", tokens, logprobs, generated=True, forced=forced)
        return cut_at_stop(self.tokenizer.decode(tokens, skip_special_tokens=True), stops)

    # ------------------------------------------------------------------ bookkeeping
    def _observe(self, key: str, tokens: torch.Tensor, logprobs: torch.Tensor, generated: bool, forced=None) -> None:
        if self.recording is not None:
            self.recording.units[key] = UnitRecord.from_logprobs(tokens, logprobs, generated)
            return
        ref = self.reference.units.get(key)
        if ref is None:
            raise KvquantError(
                f"request {key} is not in the fp16 reference; the reference file is stale: delete it "
                "(under <results_dir>/references) and rerun"
            )
        self.fidelity.add(key, ref, tokens, logprobs if forced is None else forced, generated)

    def timing(self) -> dict[str, float]:
        out = {}
        if self.prefill_s:
            out["prefill_tok_s"] = self.prefill_tokens / self.prefill_s
        if self.decode_s:
            out["decode_tok_s"] = self.decode_steps / self.decode_s
        return out
