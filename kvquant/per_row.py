"""A batch whose every row is its own cache from the method, so padding never enters a method's state.

KIVI's groups, GEAR's outliers, HIGGS/AQUA-KV's sinks and predictors and AlignedKV's running maxima
are all statistics over the tokens a store holds. A batched store would mix rows (or see padding);
``PerRowCache`` instead hands each row's real tokens to that row's own cache — exactly what an
unbatched run hands it — and computes attention row by row over what that cache returns. The model's
weights (what a small model's decode step mostly reads) are still applied to the whole batch at once.

The caller says which tokens of the next forward are real (``set_chunk``; within one forward a row's
real tokens are contiguous). A row may skip forwards, so that it is fed in exactly the chunks an
unbatched run feeds it; the cache keeps the batch columns of each row's real tokens and gives each
row's attention the mask over those columns. Attention goes through ``kvquant.attention`` (the model
is routed there), which calls ``attend`` with the batch's query.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvquant.attention import causal_allowed, expect_attention, route_attention, stock_attention, take_reader
from kvquant.cache import CacheCounts
from kvquant.errors import KvquantError


class PerRowLayer(DynamicLayer):
    """Layer ``layer_idx`` of a ``PerRowCache``: sends each row's real tokens to that row's cache."""

    def __init__(self, owner: PerRowCache, layer_idx: int, seen: int = 0) -> None:
        super().__init__()
        self.owner, self.layer_idx, self.seen = owner, layer_idx, seen
        self._pending: list[tuple[int, int, int, torch.Tensor, torch.Tensor]] = []

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The batch's whole column range; each row's attention then takes its own columns from it."""
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        owner = self.owner
        n = key_states.shape[-2]
        if owner.chunk is None or owner.chunk.shape != (key_states.shape[0], n):
            raise KvquantError("PerRowCache: call set_chunk(real) with this forward's [batch, tokens] mask first")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._pending = []
        for b, (start, stop) in enumerate(owner.spans):
            if stop == start:
                continue
            k, v = key_states[b : b + 1, :, start:stop], value_states[b : b + 1, :, start:stop]
            before = owner.columns[b].numel() - (stop - start)
            given = row_kwargs(args, kwargs, b, start, stop, before, key_states.shape[0], n)
            rk, rv = owner.rows[b].update(k, v, self.layer_idx, *given[0], **given[1])
            self._pending.append((b, start, stop, rk, rv))
        self.seen += n
        shape = (key_states.shape[0], key_states.shape[1], self.seen, key_states.shape[-1])
        return expect_attention(self, shape, key_states.dtype, key_states.device)

    def attend(self, module, query: torch.Tensor, attention_mask, **kwargs):
        """Each row's queries against what its own cache returned (its reader's kernel where it has one)."""
        out = query.new_zeros((query.shape[0], query.shape[2], query.shape[1], query.shape[3]))
        for b, start, stop, rk, rv in self._pending:
            q = query[b : b + 1, :, start:stop]
            mask = row_mask(attention_mask, b, start, stop, self.owner.columns[b][-rk.shape[-2] :])
            reader = take_reader(rk)
            if reader is not None:
                o = reader.attend(module, q, mask, **kwargs)[0]
            else:
                o = stock_attention(module, q, rk, rv, mask, **kwargs)[0]
            out[b : b + 1, start:stop] = o
        self._pending = []
        return out, None


def row_kwargs(args: tuple, kwargs: dict, b: int, start: int, stop: int, before: int, batch: int, n: int):
    """What the model handed ``update`` besides K/V, cut to row ``b``'s real tokens: per-token tensors
    (``position_ids``, ``cos``/``sin``) sliced, ``cache_position`` counted from the row's own length."""

    def cut(key: Any, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: cut(k, v) for k, v in value.items()}
        if not isinstance(value, torch.Tensor):
            return value
        if key == "cache_position" and value.dim() == 1 and value.shape[0] == n:
            return torch.arange(before, before + stop - start, device=value.device, dtype=value.dtype)
        if value.dim() >= 2 and value.shape[1] == n and value.shape[0] in (1, batch):
            row = b if value.shape[0] == batch else 0
            return value[row : row + 1, start:stop]
        return value

    return tuple(cut(None, a) for a in args), {k: cut(k, v) for k, v in kwargs.items()}


def row_mask(mask: torch.Tensor | None, b: int, start: int, stop: int, columns: torch.Tensor) -> torch.Tensor | None:
    """Row ``b``'s mask over its own keys (batch ``columns``); None where an unbatched forward's mask
    would be skipped (one query, or a square causal one), so a row runs the attention it would run alone."""
    if mask is None:
        return None
    row = min(b, mask.shape[0] - 1)
    m = mask[row : row + 1, :, start:stop].index_select(-1, columns.to(mask.device))
    q, n = m.shape[-2], m.shape[-1]
    if q not in (1, n):
        return m
    allowed = m if m.dtype == torch.bool else m == 0
    if bool((allowed == causal_allowed(q, n, m.device)).all()):
        return None
    return m


class PerRowCache(Cache):
    """``rows[b]`` is row ``b``'s own cache (any method's); one ``PerRowLayer`` per model layer.

    ``columns[b]`` are the batch columns of row ``b``'s real tokens so far (its keys, in order),
    ``lengths[b]`` their number; ``spans`` the real tokens' range within the current forward.
    """

    def __init__(
        self, rows: Sequence[Cache], model, seen: int = 0, columns: Sequence[torch.Tensor] | None = None
    ) -> None:
        n_layers = len(rows[0].layers)
        super().__init__(layers=[PerRowLayer(self, i, seen) for i in range(n_layers)])
        route_attention(model)
        self.model, self.rows, self.seen = model, list(rows), seen
        empty = torch.zeros(0, dtype=torch.long)
        self.columns = list(columns) if columns is not None else [empty] * len(rows)
        self.chunk: torch.Tensor | None = None
        self.spans: list[tuple[int, int]] = []

    @property
    def lengths(self) -> list[int]:
        return [c.numel() for c in self.columns]

    def set_chunk(self, real: torch.Tensor) -> None:
        """Which tokens of the next forward (``[batch, tokens]`` bool) are real, before that forward."""
        if real.shape[0] != len(self.rows):
            raise KvquantError(f"PerRowCache: mask for {real.shape[0]} rows, the cache has {len(self.rows)}")
        spans = []
        for b, row in enumerate(real.cpu()):
            cols = row.nonzero().flatten()
            start, stop = (int(cols[0]), int(cols[-1]) + 1) if cols.numel() else (0, 0)
            if stop - start != cols.numel():
                raise KvquantError(f"PerRowCache: row {b}'s real tokens in one forward must be contiguous")
            if cols.numel():
                self.columns[b] = torch.cat([self.columns[b], cols + self.seen])
            spans.append((start, stop))
        self.chunk, self.spans = real, spans
        self.seen += real.shape[1]

    def fed_alone(self, lengths: Sequence[int], align_end: bool) -> None:
        """Record tokens fed to the rows' own caches outside the batch (each in forwards of its own): a
        block of ``max(lengths)`` columns, row ``b``'s ``lengths[b]`` real ones at its end or start."""
        width = max(lengths, default=0)
        for b, n in enumerate(lengths):
            start = self.seen + (width - n if align_end else 0)
            self.columns[b] = torch.cat([self.columns[b], torch.arange(start, start + n)])
        self.seen += width
        for layer in self.layers:
            layer.seen += width

    def take(self, indices: Sequence[int], moves: Sequence[bool]) -> PerRowCache:
        """A cache of rows ``indices``: row ``indices[j]`` itself where ``moves[j]`` (this cache must not
        use it again), else a deep copy of it (a shared prefix continued several ways)."""
        rows = [self.rows[i] if move else copy.deepcopy(self.rows[i]) for i, move in zip(indices, moves, strict=True)]
        return PerRowCache(rows, self.model, self.seen, [self.columns[i] for i in indices])

    def counts(self) -> CacheCounts:
        total = CacheCounts()
        for row in self.rows:
            total = total + row.counts()
        return total
