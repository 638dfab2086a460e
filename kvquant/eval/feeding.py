"""How token chunks reach the model through one cache or a batch of per-row caches.

The one place that builds the padding, attention mask and positions of a batched forward: each row of
``Rows`` is its own cache behind one ``PerRowCache`` and is fed exactly the chunks an unbatched run
feeds it (a row with no chunk in a forward sits out), so padding never enters a method's state. On a
CPU a prompt's forward is compute-bound (batching it gains nothing and spills caches), so each row's
prompt and context run alone, exactly as unbatched; decode steps run batched. What the forwards are
for (scores, generations, fidelity) is ``kvquant.eval.engine``'s business.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from kvquant.attention import restore_attention
from kvquant.per_row import PerRowCache


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


def batches(
    items: Sequence, size: int, length: Callable[[Any], int], progress: str | None = None
) -> Iterator[list[int]]:
    """Indices of ``items`` in batches of ``size``, longest first (less padding per batch); with
    ``progress``, a bar of that name over the items."""
    order = sorted(range(len(items)), key=lambda i: -length(items[i]))
    with tqdm(total=len(items), desc=progress, disable=progress is None) as bar:
        for start in range(0, len(order), size):
            batch = order[start : start + size]
            yield batch
            bar.update(len(batch))


class Rows:
    """A batch of sequences that grow together: their ``PerRowCache`` and 2-D attention mask."""

    def __init__(self, cache: PerRowCache, mask: torch.Tensor):
        self.cache, self.mask = cache, mask

    def take(self, indices: Sequence[int], moves: Sequence[bool]) -> Rows:
        return Rows(self.cache.take(indices, moves), self.mask[list(indices)])


class Feeder:
    """Feeds ``model`` token chunks (``chunk_size`` at a time by default) and hands their logits on."""

    def __init__(self, model, tokenizer, chunk_size: int = 32):
        self.model, self.chunk_size = model, chunk_size
        self.batch_prefill = torch.device(model.device).type != "cpu"
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad) if pad is not None else 0

    def rows(self, caches: list) -> Rows:
        """Fresh rows over ``caches`` (one per sequence), with an empty mask."""
        return Rows(PerRowCache(caches, self.model), torch.zeros(len(caches), 0, dtype=torch.long))

    @contextlib.contextmanager
    def routed(self) -> Iterator[None]:
        """Batches route the model's attention through ``PerRowCache``; put back what it was after."""
        previous = self.model.config._attn_implementation
        try:
            yield
        finally:
            restore_attention(self.model, previous)

    def prefill(self, rows: Rows, prompts: Sequence[list[int]], chunked_prefill: bool) -> list[torch.Tensor]:
        """Feed ``prompts`` (all but the last token in chunks when ``chunked_prefill``); each one's last logits."""
        if chunked_prefill:
            self.feed_rows(rows, [p[:-1] for p in prompts], align_end=True)
            return self.forward(rows, [p[-1:] for p in prompts], last_only=True)
        if self.batch_prefill:
            return self.forward(rows, list(prompts), last_only=True)
        return self.prompts_alone(rows, prompts)

    @torch.no_grad()
    def forward(self, rows: Rows, chunks: Sequence[list[int]], last_only: bool) -> list[torch.Tensor]:
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

    def feed_rows(
        self, rows: Rows, seqs: Sequence[Sequence[int]], align_end: bool, step: int | None = None, keep: bool = False
    ) -> list[torch.Tensor]:
        """Feed each row's ``seqs[b]`` in its own chunks of ``step``; return its logits if ``keep``."""
        if not self.batch_prefill:
            return self._feed_alone(rows, seqs, align_end, step or self.chunk_size, keep)
        parts: list[list[torch.Tensor]] = [[] for _ in seqs]
        for chunks in schedule([chunks_of(s, step or self.chunk_size) for s in seqs], align_end):
            out = self.forward(rows, chunks, last_only=not keep)
            if keep:
                for b, chunk in enumerate(chunks):
                    if chunk:
                        parts[b].append(out[b])
        return [torch.cat(p) if p else self.no_logits() for p in parts]

    def no_logits(self) -> torch.Tensor:
        return torch.empty(0, self.model.config.get_text_config(decoder=True).vocab_size)

    def _feed_alone(
        self, rows: Rows, seqs: Sequence[Sequence[int]], align_end: bool, step: int, keep: bool
    ) -> list[torch.Tensor]:
        """``feed_rows`` with each row fed through its own cache in forwards of its own."""
        out = []
        for b, seq in enumerate(seqs):
            parts: list[torch.Tensor] = []
            self.feed(seq, rows.cache.rows[b], parts.append if keep else None, step)
            out.append(torch.cat(parts) if parts else self.no_logits())
        self._record_alone(rows, [len(s) for s in seqs], align_end)
        return out

    def prompts_alone(self, rows: Rows, prompts: Sequence[list[int]]) -> list[torch.Tensor]:
        """Each prompt in one forward of its own through its row's cache; the last position's logits."""
        last = []
        for b, prompt in enumerate(prompts):
            ids = torch.tensor([prompt], device=self.model.device)
            out = self.model(input_ids=ids, past_key_values=rows.cache.rows[b], use_cache=True, logits_to_keep=1)
            last.append(out.logits[0, -1].float().cpu())
        self._record_alone(rows, [len(p) for p in prompts], align_end=True)
        return last

    @staticmethod
    def _record_alone(rows: Rows, lengths: list[int], align_end: bool) -> None:
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
        return torch.cat(parts) if parts else self.no_logits()
