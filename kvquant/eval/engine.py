"""One KV method run over evaluation requests, every request with a fresh cache from the method.

Requests run ``batch_size`` at a time behind one ``PerRowCache``: each row is its own cache from the
method and is fed exactly the chunks an unbatched run feeds it (a row sits out the forwards it has no
chunk in), so padding never enters a method's state and a row's bits stored equal the unbatched
run's; only the model's weights are applied to the batch at once. Log-likelihoods feed the text in
chunks of ``chunk_size`` tokens (a single forward never reads a quantized cache); generations are
greedy (argmax; no logits processors), the prompt in one forward or, with ``chunked_prefill``, in
chunks and then its last token. Each request is a *unit* with a stable key. Without a reference the
engine records each unit's tokens and top-k log-probabilities (``Reference``); with one it compares
every unit with it as it goes (``kvquant.eval.reference.FidelityStats``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from kvquant.analysis.memory import StepPeak, held_bytes, transient_bytes
from kvquant.attention import restore_attention
from kvquant.cache import CacheCounts
from kvquant.errors import KvquantError
from kvquant.eval.reference import FidelityStats, Reference, UnitRecord
from kvquant.per_row import PerRowCache

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


def chunks_of(ids: Sequence[int], step: int) -> list[list[int]]:
    """``ids`` cut as an unbatched feed cuts them: ``[0, step)``, ``[step, 2·step)``, …"""
    return [list(ids[i : i + step]) for i in range(0, len(ids), step)]


def schedule(chunked: Sequence[list[list[int]]], align_end: bool) -> list[list[list[int]]]:
    """Forwards of per-row chunk lists: ``out[f][b]`` is row ``b``'s chunk in forward ``f`` (``[]``: it
    sits out). Rows start together, or (``align_end``) end together, so their last chunks share a forward."""
    n = max((len(c) for c in chunked), default=0)
    out: list[list[list[int]]] = [[[] for _ in chunked] for _ in range(n)]
    for b, chunks in enumerate(chunked):
        offset = n - len(chunks) if align_end else 0
        for i, chunk in enumerate(chunks):
            out[offset + i][b] = chunk
    return out


class _Rows:
    """A batch of sequences that grow together: their ``PerRowCache`` and 2-D attention mask."""

    def __init__(self, cache: PerRowCache, mask: torch.Tensor):
        self.cache, self.mask = cache, mask

    def take(self, indices: Sequence[int], moves: Sequence[bool]) -> _Rows:
        return _Rows(self.cache.take(indices, moves), self.mask[list(indices)])


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
        # On a CPU a prompt's forward is compute-bound (batching it gains nothing and spills caches), so
        # each row's prompt and context run alone, exactly as unbatched; decode steps run batched.
        self.batch_prefill = torch.device(model.device).type != "cpu"
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad) if pad is not None else 0
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos = tokenizer.eos_token_id if eos is None else eos
        self.eos_ids = {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None}

    # ------------------------------------------------------------------ caches and forwards
    def new_cache(self):
        self.n_caches += 1
        return self.method.new_cache(self.model)

    def _retire(self, cache, key: str | None = None) -> None:
        if hasattr(cache, "counts"):
            counts = cache.counts()
            self.counts = self.counts + counts
            if key is not None:
                self.unit_counts[key] = counts

    @contextlib.contextmanager
    def _routed(self) -> Iterator[None]:
        """Batches route the model's attention through ``PerRowCache``; put back what it was after."""
        previous = self.model.config._attn_implementation
        try:
            yield
        finally:
            restore_attention(self.model, previous)

    def _rows(self, n: int) -> _Rows:
        return _Rows(PerRowCache([self.new_cache() for _ in range(n)], self.model), torch.zeros(n, 0, dtype=torch.long))

    def _take(self, rows: _Rows, indices: Sequence[int], moves: Sequence[bool]) -> _Rows:
        self.n_caches += sum(not m for m in moves)  # the copies
        return rows.take(indices, moves)

    @torch.no_grad()
    def _forward(self, rows: _Rows, chunks: Sequence[list[int]], last_only: bool) -> list[torch.Tensor]:
        """One forward of each row's ``chunk`` (left-padded to the longest; a row with ``[]`` sits out).
        Returns each row's logits (fp32, CPU) at its real tokens, or (``last_only``) at the last column."""
        width = max(len(c) for c in chunks)
        ids = torch.full((len(chunks), width), self.pad_id, dtype=torch.long)
        real = torch.zeros(len(chunks), width, dtype=torch.bool)
        for b, chunk in enumerate(chunks):
            if chunk:
                ids[b, width - len(chunk) :] = torch.tensor(chunk)
                real[b, width - len(chunk) :] = True
        before = torch.tensor(rows.cache.lengths, dtype=torch.long).view(-1, 1)
        positions = (before + real.long().cumsum(1) - 1).clamp(min=0)
        rows.mask = torch.cat([rows.mask, real.long()], dim=1)
        rows.cache.set_chunk(real)
        device = self.model.device
        logits = (
            self.model(
                input_ids=ids.to(device),
                attention_mask=rows.mask.to(device),
                position_ids=positions.to(device),
                past_key_values=rows.cache,
                use_cache=True,
                logits_to_keep=1 if last_only else 0,
            )
            .logits.float()
            .cpu()
        )
        if last_only:
            return list(logits[:, -1])
        return [logits[b, real[b]] for b in range(len(chunks))]

    def _feed_rows(
        self, rows: _Rows, seqs: Sequence[Sequence[int]], align_end: bool, step: int | None = None, keep: bool = False
    ) -> list[torch.Tensor]:
        """Feed each row's ``seqs[b]`` in its own chunks of ``step``; return its logits if ``keep``."""
        if not self.batch_prefill:
            return self._feed_alone(rows, seqs, align_end, step or self.chunk_size, keep)
        parts: list[list[torch.Tensor]] = [[] for _ in seqs]
        for chunks in schedule([chunks_of(s, step or self.chunk_size) for s in seqs], align_end):
            out = self._forward(rows, chunks, last_only=not keep)
            if keep:
                for b, chunk in enumerate(chunks):
                    if chunk:
                        parts[b].append(out[b])
        return [torch.cat(p) if p else self._no_logits() for p in parts]

    def _no_logits(self) -> torch.Tensor:
        return torch.empty(0, self.model.config.get_text_config(decoder=True).vocab_size)

    def _feed_alone(
        self, rows: _Rows, seqs: Sequence[Sequence[int]], align_end: bool, step: int, keep: bool
    ) -> list[torch.Tensor]:
        """``_feed_rows`` with each row fed through its own cache in forwards of its own."""
        out = []
        for b, seq in enumerate(seqs):
            parts: list[torch.Tensor] = []
            self.feed(seq, rows.cache.rows[b], parts.append if keep else None, step)
            out.append(torch.cat(parts) if parts else self._no_logits())
        self._record_alone(rows, [len(s) for s in seqs], align_end)
        return out

    def _prompts_alone(self, rows: _Rows, prompts: Sequence[list[int]]) -> list[torch.Tensor]:
        """Each prompt in one forward of its own through its row's cache; the last position's logits."""
        last = []
        for b, prompt in enumerate(prompts):
            ids = torch.tensor([prompt], device=self.model.device)
            out = self.model(input_ids=ids, past_key_values=rows.cache.rows[b], use_cache=True, logits_to_keep=1)
            last.append(out.logits[0, -1].float().cpu())
        self._record_alone(rows, [len(p) for p in prompts], align_end=True)
        return last

    @staticmethod
    def _record_alone(rows: _Rows, lengths: list[int], align_end: bool) -> None:
        """The batch's columns and mask for tokens its rows' caches took in forwards of their own."""
        width = max(lengths, default=0)
        block = torch.zeros(len(lengths), width, dtype=torch.long)
        for b, n in enumerate(lengths):
            start = width - n if align_end else 0
            block[b, start : start + n] = 1
        rows.cache.fed_alone(lengths, align_end)
        rows.mask = torch.cat([rows.mask, block], dim=1)

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
        for chunk in chunks_of(ids, chunk_size or self.chunk_size):
            logits = self.model(
                input_ids=torch.tensor([chunk], device=device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=0 if on_logits is not None else 1,
            ).logits[0]
            if on_logits is not None:
                on_logits(logits.float().cpu())

    def chunked_logits(self, ids: Sequence[int], cache, chunk_size: int | None = None) -> torch.Tensor:
        parts: list[torch.Tensor] = []
        self.feed(ids, cache, parts.append, chunk_size)
        return torch.cat(parts) if parts else self._no_logits()

    def _batches(self, items: Sequence, length: Callable[[Any], int], progress: str | None = None):
        """Indices of ``items`` in batches of ``batch_size``, longest first (less padding per batch); with
        ``progress``, a bar of that name over the items."""
        order = sorted(range(len(items)), key=lambda i: -length(items[i]))
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        with tqdm(total=len(items), desc=progress, disable=progress is None) as bar:
            for batch in batches:
                yield batch
                bar.update(len(batch))

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
        with self._routed():
            heads: list[tuple[list[int], list[tuple[str, int, list[int], list[int]]]]] = []
            for key, ctx, conts in requests:
                pairs = [self.fit(list(ctx), list(c)) for c in conts]
                if all(p[0] == pairs[0][0] for p in pairs):
                    heads.append((pairs[0][0], [(key, j, c, k) for j, (c, k) in enumerate(pairs)]))
                else:  # tokenisation split the context differently per choice: a context per continuation
                    heads += [(c, [(key, j, c, k)]) for j, (c, k) in enumerate(pairs)]
            scores: dict[tuple[str, int], tuple[float, bool]] = {}
            for batch in self._batches(heads, lambda h: len(h[0])):
                rows = self._rows(len(batch))
                t0 = time.perf_counter()
                self._feed_rows(rows, [heads[h][0][:-1] for h in batch], align_end=True)
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
        self, rows: _Rows, units: Sequence[tuple[str, int, list[int], list[int]]]
    ) -> dict[tuple[str, int], tuple[float, bool]]:
        """Each row continues its context with its continuation; log-prob and greedy flag per unit."""
        t0 = time.perf_counter()
        logits = self._feed_rows(rows, [c[-1:] + k[:-1] for _, _, c, k in units], align_end=False, keep=True)
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
        with self._routed():
            out: list[tuple[float, int] | None] = [None] * len(requests)
            for batch in self._batches(requests, lambda r: len(r[1]), progress):
                rows = self._rows(len(batch))
                t0 = time.perf_counter()
                logits = self._feed_rows(rows, [requests[r][1][:-1] for r in batch], align_end=False, keep=True)
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
        start: tuple[_Rows, list[torch.Tensor]] | None = None,
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
                    last = self._forward(rows, step, last_only=True)
                step_peak = peak.peak + transient_bytes(rows.cache)  # plus reused per-forward workspaces
                self.memory.append((held / len(active), step_peak / len(active)))
            else:
                last = self._forward(rows, step, last_only=True)
        if forced is None:
            self.decode_s += time.perf_counter() - t1
            self.decode_steps += sum(len(t) - 1 for t in tokens)
        return [
            (torch.tensor(t, dtype=torch.long), torch.log_softmax(torch.stack(lg), dim=-1))
            for t, lg in zip(tokens, logits, strict=True)
        ]

    def _prefill(self, prompts: Sequence[list[int]], chunked_prefill: bool, timed: bool) -> tuple[_Rows, list]:
        """Fresh rows fed ``prompts`` (all but the last token in chunks when ``chunked_prefill``) and each
        prompt's last logits: where decoding starts."""
        t0 = time.perf_counter()
        rows = self._rows(len(prompts))
        if chunked_prefill:
            self._feed_rows(rows, [p[:-1] for p in prompts], align_end=True)
            last = self._forward(rows, [p[-1:] for p in prompts], last_only=True)
        elif self.batch_prefill:
            last = self._forward(rows, list(prompts), last_only=True)
        else:
            last = self._prompts_alone(rows, prompts)
        if timed:
            self.prefill_s += time.perf_counter() - t0
            self.prefill_tokens += sum(len(p) for p in prompts)
        return rows, last

    def _kept(self, start: tuple[_Rows, list[torch.Tensor]]) -> tuple[_Rows, list[torch.Tensor]] | None:
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
        with self._routed():
            prompts = []
            for req in requests:
                room = max(1, self.max_length - req.max_new_tokens)
                if len(req.ids) > room:
                    self.truncated += 1
                prompts.append(list(req.ids)[-room:])
            out: list[str | None] = [None] * len(requests)
            for mode in (False, True):
                todo = [i for i, r in enumerate(requests) if bool(r.chunked_prefill) == mode]
                for batch in self._batches(todo, lambda i: len(prompts[i]), progress if todo else None):
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
