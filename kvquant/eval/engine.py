"""One KV method run over evaluation requests, every request with a fresh cache from the method.

Requests run ``batch_size`` at a time, each row its own cache from the method, fed as an unbatched
run feeds it (``kvquant.eval.feeding``: padding, masks and positions), so a row's bits stored equal
the unbatched run's. Log-likelihoods feed the text in chunks of ``chunk_size`` tokens (a single
forward never reads a quantized cache); generations are greedy (argmax; no logits processors), the
prompt in one forward or, with ``chunked_prefill``, in chunks and then its last token. Each request
is a *unit* with a stable key. Without a reference the engine records each unit's tokens and top-k
log-probabilities (``Reference``); with one it compares every unit with it as it goes
(``kvquant.eval.reference.FidelityStats``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvquant.analysis.memory import StepPeak, held_bytes, transient_bytes
from kvquant.cache import CacheCounts
from kvquant.errors import KvquantError
from kvquant.eval.feeding import Feeder, Rows, batches
from kvquant.eval.reference import FidelityStats, Reference, UnitRecord

KEEP_PREFILL_BYTES = 1 << 30  # above this a batch's prefilled caches are not copied for teacher forcing


@dataclass(frozen=True)
class Generation:
    """One greedy generation request: its unit key, prompt ids, token budget and stop strings."""

    key: str
    ids: list[int]
    max_new_tokens: int
    stops: tuple[str, ...] = ()
    chunked_prefill: bool = False


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
    """Runs ``method`` on requests ``batch_size`` at a time and keeps counts, timing and fidelity.

    ``reference=None`` records a ``Reference`` (what the fp16 run provides for the others);
    otherwise each unit is compared with the reference unit of the same key. ``unit_counts`` keeps
    each unit's cache counts (a batch's rows are counted apart), ``generated`` its greedy tokens.
    """

    def __init__(
        self,
        model,
        tokenizer,
        method,
        chunk_size: int = 32,
        reference: Reference | None = None,
        max_length: int | None = None,
        batch_size: int = 1,
    ):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model, self.tokenizer, self.method = model, tokenizer, method
        self.chunk_size, self.batch_size = chunk_size, batch_size
        self.reference = reference
        self.recording = Reference() if reference is None else None
        self.fidelity = FidelityStats()
        self.max_length = max_length or getattr(model.config, "max_position_embeddings", None) or 2048
        self.counts = CacheCounts()
        self.unit_counts: dict[str, CacheCounts] = {}
        self.generated: dict[str, torch.Tensor] = {}  # each generation unit's tokens
        self.memory: list[tuple[float, float]] = []  # per first decode step: held, step peak (bytes per row)
        self.n_caches = 0
        self.truncated = 0
        self.prefill_tokens = self.decode_steps = 0
        self.prefill_s = self.decode_s = 0.0
        self.feeder = Feeder(model, tokenizer, chunk_size)
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos = tokenizer.eos_token_id if eos is None else eos
        self.eos_ids = {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None}

    # ------------------------------------------------------------------ caches
    def new_cache(self):
        self.n_caches += 1
        return self.method.new_cache(self.model)

    def _retire(self, cache, key: str | None = None) -> None:
        if hasattr(cache, "counts"):
            counts = cache.counts()
            self.counts = self.counts + counts
            if key is not None:
                self.unit_counts[key] = counts

    def _rows(self, n: int) -> Rows:
        return self.feeder.rows([self.new_cache() for _ in range(n)])

    def _take(self, rows: Rows, indices: Sequence[int], moves: Sequence[bool]) -> Rows:
        self.n_caches += sum(not m for m in moves)  # the copies
        return rows.take(indices, moves)

    def chunked_logits(self, ids: Sequence[int], cache, chunk_size: int | None = None) -> torch.Tensor:
        """Logits (fp32, CPU) at every position of ``ids`` fed through ``cache`` in chunks."""
        return self.feeder.chunked_logits(ids, cache, chunk_size)

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

    def loglikelihood(self, key: str, ctx: list[int], conts: Sequence[list[int]]) -> list[tuple[float, bool]]:
        """Log-probability of each continuation after ``ctx`` (and whether it is the greedy one)."""
        return self.loglikelihood_many([(key, ctx, conts)])[0]

    @torch.no_grad()
    def loglikelihood_many(
        self, requests: Sequence[tuple[str, list[int], Sequence[list[int]]]]
    ) -> list[list[tuple[float, bool]]]:
        """``loglikelihood`` of every ``(key, ctx, conts)``. A context goes through one cache in chunks up
        to its last token; each continuation then continues from a copy of that cache (the prefix is
        shared, the quantized state is the same for all choices). Contexts run ``batch_size`` at a
        time, then their continuations ``batch_size`` at a time."""
        with self.feeder.routed():
            heads: list[tuple[list[int], list[tuple[str, int, list[int], list[int]]]]] = []
            for key, ctx, conts in requests:
                pairs = [self.fit(list(ctx), list(c)) for c in conts]
                if all(p[0] == pairs[0][0] for p in pairs):
                    heads.append((pairs[0][0], [(key, j, c, k) for j, (c, k) in enumerate(pairs)]))
                else:  # tokenisation split the context differently per choice: a context per continuation
                    heads += [(c, [(key, j, c, k)]) for j, (c, k) in enumerate(pairs)]
            scores: dict[tuple[str, int], tuple[float, bool]] = {}
            for batch in batches(heads, self.batch_size, lambda h: len(h[0])):
                rows = self._rows(len(batch))
                t0 = time.perf_counter()
                self.feeder.feed_rows(rows, [heads[h][0][:-1] for h in batch], align_end=True)
                self.prefill_s += time.perf_counter() - t0
                self.prefill_tokens += sum(max(0, len(heads[h][0]) - 1) for h in batch)
                flat = [(i, unit) for i, h in enumerate(batch) for unit in heads[h][1]]
                last_use = {i: at for at, (i, _) in enumerate(flat)}
                for g in range(0, len(flat), self.batch_size):
                    group = flat[g : g + self.batch_size]
                    moves = [last_use[i] == g + at for at, (i, _) in enumerate(group)]
                    sub = self._take(rows, [i for i, _ in group], moves)
                    scores.update(self._continuations(sub, [unit for _, unit in group]))
            return [[scores[(key, j)] for j in range(len(conts))] for key, _, conts in requests]

    def _continuations(
        self, rows: Rows, units: Sequence[tuple[str, int, list[int], list[int]]]
    ) -> dict[tuple[str, int], tuple[float, bool]]:
        """Each row continues its context with its continuation; log-prob and greedy flag per unit."""
        t0 = time.perf_counter()
        logits = self.feeder.feed_rows(rows, [c[-1:] + k[:-1] for _, _, c, k in units], align_end=False, keep=True)
        self.prefill_s += time.perf_counter() - t0
        out = {}
        for b, (key, j, _, cont) in enumerate(units):
            self.prefill_tokens += len(cont)
            self._retire(rows.cache.rows[b], f"{key}#{j}")
            logprobs = torch.log_softmax(logits[b], dim=-1)
            target = torch.tensor(cont)
            ll = float(logprobs.gather(1, target.view(-1, 1)).sum())
            greedy = bool((logprobs.argmax(-1) == target).all())
            self._observe(f"{key}#{j}", target, logprobs, generated=False)
            out[(key, j)] = (ll, greedy)
        return out

    def score(self, key: str, ids: list[int]) -> tuple[float, int]:
        """Sum of next-token NLL over ``ids[1:]`` fed in chunks through a fresh cache (perplexity)."""
        return self.score_many([(key, ids)])[0]

    @torch.no_grad()
    def score_many(
        self, requests: Sequence[tuple[str, list[int]]], progress: str | None = None
    ) -> list[tuple[float, int]]:
        """``score`` of every ``(key, ids)``, ``batch_size`` sequences at a time."""
        with self.feeder.routed():
            out: list[tuple[float, int] | None] = [None] * len(requests)
            for batch in batches(requests, self.batch_size, lambda r: len(r[1]), progress):
                rows = self._rows(len(batch))
                t0 = time.perf_counter()
                logits = self.feeder.feed_rows(rows, [requests[r][1][:-1] for r in batch], align_end=False, keep=True)
                self.prefill_s += time.perf_counter() - t0
                for b, r in enumerate(batch):
                    key, ids = requests[r]
                    self.prefill_tokens += len(ids) - 1
                    self._retire(rows.cache.rows[b], f"{key}#0")
                    target = torch.tensor(ids[1:])
                    logprobs = torch.log_softmax(logits[b], dim=-1)
                    out[r] = (-float(logprobs.gather(1, target.view(-1, 1)).sum()), target.numel())
                    self._observe(f"{key}#0", target, logprobs, generated=False)
            return out  # type: ignore[return-value]

    # ------------------------------------------------------------------ generation
    def _decode(
        self,
        prompts: Sequence[list[int]],
        chunked_prefill: bool,
        budgets: Sequence[int],
        stops: Sequence[Sequence[str]] = (),
        forced: Sequence[torch.Tensor] | None = None,
        keys: Sequence[str] | None = None,
        start: tuple[Rows, list[torch.Tensor]] | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Greedy decoding of each prompt in one batch (or, with ``forced``, teacher forcing along those
        tokens: every forced token is one decode step, as in generation — fed in chunks, a multi-token
        forward would attend in full precision within the chunk, and KL would read ≈ 0). A row stops at
        its budget, EOS or a stop string and leaves the batch. ``start``: the prompts already fed
        (``_prefill``'s rows and last logits). Returns (tokens, log-probs) per prompt."""
        rows, last = self._prefill(prompts, chunked_prefill, timed=forced is None) if start is None else start
        t1 = time.perf_counter()
        tokens: list[list[int]] = [[] for _ in prompts]
        logits: list[list[torch.Tensor]] = [[] for _ in prompts]
        active = list(range(len(prompts)))
        while True:
            for j, b in enumerate(active):
                logits[b].append(last[j])
                tokens[b].append(int(forced[b][len(tokens[b])]) if forced is not None else int(last[j].argmax()))
            done = [self._finished(tokens[b], budgets[b], stops[b] if stops else (), forced) for b in active]
            for j, b in enumerate(active):
                if done[j]:
                    self._retire(rows.cache.rows[j], keys[b] if keys is not None else None)
            keep = [j for j in range(len(active)) if not done[j]]
            if not keep:
                break
            if len(keep) < len(active):
                rows = self._take(rows, keep, [True] * len(keep))
                active = [active[j] for j in keep]
            step = [[tokens[b][-1]] for b in active]
            if forced is None and len(tokens[active[0]]) == 1:  # the first decode step: measure its memory
                held = held_bytes(rows.cache)
                with StepPeak() as peak:
                    last = self.feeder.forward(rows, step, last_only=True)
                step_peak = peak.peak + transient_bytes(rows.cache)  # plus reused per-forward workspaces
                self.memory.append((held / len(active), step_peak / len(active)))
            else:
                last = self.feeder.forward(rows, step, last_only=True)
        if forced is None:
            self.decode_s += time.perf_counter() - t1
            self.decode_steps += sum(len(t) - 1 for t in tokens)
        return [
            (torch.tensor(t, dtype=torch.long), torch.log_softmax(torch.stack(lg), dim=-1))
            for t, lg in zip(tokens, logits, strict=True)
        ]

    def _prefill(self, prompts: Sequence[list[int]], chunked_prefill: bool, timed: bool) -> tuple[Rows, list]:
        """Fresh rows fed ``prompts`` (all but the last token in chunks when ``chunked_prefill``) and each
        prompt's last logits: where decoding starts."""
        t0 = time.perf_counter()
        rows = self._rows(len(prompts))
        last = self.feeder.prefill(rows, prompts, chunked_prefill)
        if timed:
            self.prefill_s += time.perf_counter() - t0
            self.prefill_tokens += sum(len(p) for p in prompts)
        return rows, last

    def _kept(self, start: tuple[Rows, list[torch.Tensor]]) -> tuple[Rows, list[torch.Tensor]] | None:
        """A copy of a prefilled batch, for teacher-forcing the rows that part from fp16's tokens without
        feeding their prompts again (None above ``KEEP_PREFILL_BYTES``: those rows are fed again)."""
        rows, last = start
        if held_bytes(rows.cache) > KEEP_PREFILL_BYTES:
            return None
        n = len(last)
        return rows.take(range(n), [False] * n), list(last)

    def _finished(self, tokens: list[int], budget: int, stops: Sequence[str], forced) -> bool:
        if len(tokens) >= budget:
            return True
        if forced is not None:
            return False
        if tokens[-1] in self.eos_ids:
            return True
        stops = [s for s in stops if s]
        return bool(stops) and any(s in self.tokenizer.decode(tokens) for s in stops)

    def _generate(self, ids: list[int], max_new_tokens: int, stops: Sequence[str], chunked_prefill: bool):
        """Greedy tokens and log-probs of one prompt (no truncation, no fidelity)."""
        return self._decode([list(ids)], chunked_prefill, [max_new_tokens], [stops])[0]

    def forced_logprobs(self, ids: list[int], forced: torch.Tensor, chunked_prefill: bool) -> torch.Tensor:
        """The method's next-token log-probs along ``forced`` (teacher forcing, one decode step per token)."""
        return self._decode([list(ids)], chunked_prefill, [len(forced)], forced=[forced])[0][1]

    def generate(
        self,
        key: str,
        ids: list[int],
        max_new_tokens: int,
        stops: Sequence[str] = (),
        chunked_prefill: bool = False,
    ) -> str:
        """Greedy continuation of ``ids`` (left-truncated to fit ``max_new_tokens``), cut at the first stop."""
        return self.generate_many([Generation(key, list(ids), max_new_tokens, tuple(stops), chunked_prefill)])[0]

    @torch.no_grad()
    def generate_many(self, requests: Sequence[Generation], progress: str | None = None) -> list[str]:
        """``generate`` for every request, ``batch_size`` at a time (requests that prefill alike batch
        together). A unit whose tokens part from fp16's is then teacher-forced along fp16's tokens (also
        in batches) for its KL and top-1 agreement."""
        with self.feeder.routed():
            prompts = []
            for req in requests:
                room = max(1, self.max_length - req.max_new_tokens)
                if len(req.ids) > room:
                    self.truncated += 1
                prompts.append(list(req.ids)[-room:])
            out: list[str | None] = [None] * len(requests)
            for mode in (False, True):
                todo = [i for i, r in enumerate(requests) if bool(r.chunked_prefill) == mode]
                for batch in batches(todo, self.batch_size, lambda i: len(prompts[i]), progress if todo else None):
                    idx = [todo[i] for i in batch]
                    start = self._prefill([prompts[i] for i in idx], mode, timed=True)
                    kept = self._kept(start) if self.reference is not None else None
                    results = self._decode(
                        [prompts[i] for i in idx],
                        mode,
                        [requests[i].max_new_tokens for i in idx],
                        [requests[i].stops for i in idx],
                        keys=[f"{requests[i].key}#0" for i in idx],
                        start=start,
                    )
                    self._compare(requests, prompts, idx, results, mode, kept)
                    for i, (tokens, _) in zip(idx, results, strict=True):
                        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                        out[i] = cut_at_stop(text, requests[i].stops)
            return out  # type: ignore[return-value]

    def _compare(self, requests, prompts, idx: list[int], results, chunked_prefill: bool, kept=None) -> None:
        """Record or compare each generated unit; teacher-force the ones that part from fp16's tokens
        (from ``kept``, the batch's state after its prompts, where there is one)."""
        forced: dict[int, torch.Tensor] = {}
        for i, (tokens, _) in zip(idx, results, strict=True):
            ref = self.reference.units.get(f"{requests[i].key}#0") if self.reference is not None else None
            if ref is not None and tokens.numel() and not torch.equal(tokens, ref.tokens[: tokens.numel()].long()):
                forced[i] = ref.tokens.long()
        along: dict[int, torch.Tensor] = {}
        todo = [i for i, f in forced.items() if f.numel()]
        for k in range(0, len(todo), self.batch_size):
            batch = todo[k : k + self.batch_size]
            refs = [forced[i] for i in batch]
            start = None
            if kept is not None:
                at = [idx.index(i) for i in batch]
                start = (kept[0].take(at, [True] * len(at)), [kept[1][j] for j in at])
                self.n_caches += len(at)  # the copies taken after the prompts
            runs = self._decode(
                [prompts[i] for i in batch], chunked_prefill, [len(f) for f in refs], forced=refs, start=start
            )
            along.update({i: lp for i, (_, lp) in zip(batch, runs, strict=True)})
        for i, (tokens, logprobs) in zip(idx, results, strict=True):
            key = f"{requests[i].key}#0"
            self._observe(key, tokens, logprobs, generated=True, forced=along.get(i, logprobs))

    # ------------------------------------------------------------------ bookkeeping
    def _observe(self, key: str, tokens: torch.Tensor, logprobs: torch.Tensor, generated: bool, forced=None) -> None:
        if generated:
            self.generated[key] = tokens
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

    def memory_summary(self) -> dict[str, float]:
        """Largest held bytes and largest held + step peak per sequence over the first decode step of
        every generation batch (``kvquant.analysis.memory``: measured, not by formula)."""
        if not self.memory:
            return {}
        return {
            "held_bytes": max(h for h, _ in self.memory),
            "step_peak_bytes": max(p for _, p in self.memory),
            "held_plus_step_peak_bytes": max(h + p for h, p in self.memory),
        }

    def timing(self) -> dict[str, float]:
        out = {}
        if self.prefill_s:
            out["prefill_tok_s"] = self.prefill_tokens / self.prefill_s
        if self.decode_s:
            out["decode_tok_s"] = self.decode_steps / self.decode_s
        return out
