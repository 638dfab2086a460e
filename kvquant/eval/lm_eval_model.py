"""lm-eval's ``HFLM`` with the KV method in the loop.

Every request goes through a fresh cache from the method: log-likelihoods feed the context and the
continuation through it in chunks of ``chunk_size`` tokens (a plain ``HFLM`` scores each request in
one forward that never reads the cache), generations decode greedily from a fresh cache. The work is
done by ``kvquant.eval.engine.Engine`` — ``batch_size`` requests at a time, each row its own cache —
which also keeps fidelity to fp16 per request.
"""

from __future__ import annotations

import torch
from lm_eval.models.huggingface import HFLM
from tqdm.auto import tqdm

from kvquant.eval.engine import Engine, Generation, bos_prefix


class KVMethodLM(HFLM):
    """``HFLM`` over an already loaded model whose every request runs through ``engine``'s KV method."""

    def __init__(self, engine: Engine, max_gen_toks: int = 256, progress: bool = False):
        tok = engine.tokenizer
        super().__init__(
            pretrained=engine.model,
            tokenizer=tok,
            batch_size=1,
            max_length=engine.max_length,
            device=str(engine.model.device),
            add_bos_token=bool(bos_prefix(tok)),
        )
        self.engine = engine
        self._max_gen = max_gen_toks
        self.progress = progress

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """Score each (context, continuation); the choices of one question share one pass over the
        context, and questions run ``engine.batch_size`` at a time."""
        groups: dict[tuple, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault((req.task_name, req.doc_id, req.args[0]), []).append(i)
        asks, owners = [], []
        for (task, doc_id, context), idxs in groups.items():
            idxs.sort(key=lambda i: requests[i].idx)
            pairs = [self._pair(context, requests[i].args[1]) for i in idxs]
            asks.append((f"{task}/{doc_id}", pairs[0][0], [k for _, k in pairs]))
            if any(p[0] != pairs[0][0] for p in pairs):  # tokenisation split the context differently
                asks[-1:] = [(f"{task}/{doc_id}.{j}", c, [k]) for j, (c, k) in enumerate(pairs)]
                owners += [[i] for i in idxs]
            else:
                owners.append(idxs)
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        step = 8 * self.engine.batch_size  # requests handed over at once: sorted by length within them
        bar = tqdm(total=len(asks), desc="log-likelihood", disable=disable_tqdm or not self.progress)
        for start in range(0, len(asks), step):
            for idxs, scored in zip(
                owners[start : start + step], self.engine.loglikelihood_many(asks[start : start + step]), strict=True
            ):
                for i, value in zip(idxs, scored, strict=True):
                    results[i] = value
            bar.update(len(asks[start : start + step]))
        bar.close()
        return results

    def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        if context:
            return self._encode_pair(context, continuation)
        return [self.prefix_token_id], self.tok_encode(continuation, add_special_tokens=False)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        raise NotImplementedError("rolling log-likelihood is not routed through the KV cache; use task=wikitext")

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy generation with a fresh cache per request, ``engine.batch_size`` requests at a time,
        until a stop string, EOS or ``max_gen_toks``."""
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False) if self.eot_token_id is not None else ""
        asks = []
        for req in requests:
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            if eos and eos not in until:
                until.append(eos)
            max_new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            asks.append(Generation(f"{req.task_name}/{req.doc_id}", self.tok_encode(context), max_new, tuple(until)))
        out: list[str] = []
        step = 8 * self.engine.batch_size  # requests handed over at once: sorted by length within them
        for start in tqdm(range(0, len(asks), step), desc="generate", disable=disable_tqdm or not self.progress):
            out += self.engine.generate_many(asks[start : start + step])
        return out

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        """Logits of each row, fed through its own fresh cache in chunks (never one plain forward)."""
        rows = [self.engine.chunked_logits(row.tolist(), self.engine.new_cache()) for row in inps]
        return torch.stack(rows).to(inps.device)

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        """HFLM's generation, handed a fresh cache from the method."""
        generation_kwargs.setdefault("past_key_values", self.engine.new_cache())
        return super()._model_generate(context, max_length, stop, **generation_kwargs)
