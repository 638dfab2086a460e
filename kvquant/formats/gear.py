"""GEAR's format: integer codes (``kvquant.formats.codes``) plus exact sparse outliers and low-rank
factors of the coding residual, per segment of tokens that left the fp16 window together.

A segment is a ``[T, D]`` matrix per (batch row, KV head), for K and V apart: its ``⌊s/2·T·D⌋`` largest
and as many smallest entries kept exact (int32 position token·D + channel within the stream's coded
history, fp16 value), ``bits``-bit codes with those left out of their groups' min/max, and the
residual ≈ ``A Bᵀ`` (fp16 ``A`` ``[T, r]``, ``B`` ``[D, r]``) from seeded power iteration. Consecutive
segments of equal length and rank are stacked into one ``LowRankRun``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvquant.formats.codes import CodesState
from kvquant.formats.window import TOKEN_AXIS
from kvquant.quant.integer import QuantizedTensor, cat, dequantize, drop_leading, quantize


@dataclass(frozen=True)
class GearCoding:
    """How a segment is coded: ``bits``-bit base, ``outlier_ratio`` kept exact, rank ``rank`` (prefill) or
    ``rank_decode`` (a segment written while decoding) from ``loops`` power iterations seeded by ``seed``."""

    bits: int
    outlier_ratio: float
    rank: int
    rank_decode: int
    loops: int
    seed: int


INDEX_DTYPE = torch.int32
SPARSE_BITS = 32 + 16  # int32 position + fp16 value


def outlier_count(ratio: float, n: int) -> int:
    """Entries kept exact on *each* side (largest and smallest) of an ``n``-entry matrix."""
    return math.floor(ratio * n / 2 + 1e-9)


def low_rank(residual: torch.Tensor, rank: int, loops: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual`` ``[..., T, D]`` ≈ ``A Bᵀ``: subspace iteration from a seeded Gaussian start, QR each loop.

    Returns ``A`` ``[..., T, r]`` (orthonormal columns) and ``B = residualᵀ A`` ``[..., D, r]``.
    """
    d = residual.shape[-1]
    gen = torch.Generator().manual_seed(seed)
    b = torch.randn(d, rank, generator=gen).to(residual.device, residual.dtype)
    a = residual.new_zeros(*residual.shape[:-1], rank)
    for _ in range(loops):
        a = torch.linalg.qr(residual @ b).Q
        b = residual.mT @ a
    return a, b


@dataclass
class LowRankRun:
    """Consecutive segments of equal length and rank, stacked so one batched matmul rebuilds them all."""

    start: int
    seg_len: int
    a: torch.Tensor  # [B, H, n_segments, seg_len, r] fp16
    b: torch.Tensor  # [B, H, n_segments, D, r] fp16

    @property
    def end(self) -> int:
        return self.start + self.a.shape[2] * self.seg_len


class GearStore:
    """GEAR's compressed history of K or V: base codes, outlier positions/values, low-rank runs."""

    def __init__(self, params: GearCoding, axis: int, group_size: int):
        self.params, self.axis, self.group_size = params, axis, group_size
        self.q: QuantizedTensor | None = None
        self.index: torch.Tensor | None = None  # [B, H, n_outliers] int32, token·D + channel
        self.value: torch.Tensor | None = None  # [B, H, n_outliers] fp16
        self.runs: list[LowRankRun] = []
        self.segments: list[tuple[int, int]] = []  # (tokens, outliers) of each segment, oldest first
        self.unit = group_size if axis == TOKEN_AXIS else 1  # a key group spans tokens
        self.length = 0

    def add(self, x: torch.Tensor, decode: bool) -> None:
        b, h, t, d = x.shape
        x = x.float()
        mask = None
        p = self.params
        k = outlier_count(p.outlier_ratio, t * d)
        if k:
            flat = x.reshape(b, h, t * d)
            pos = torch.cat([flat.topk(k, dim=-1).indices, flat.topk(k, dim=-1, largest=False).indices], dim=-1)
            value = flat.gather(-1, pos).half()
            mask = torch.zeros_like(flat, dtype=torch.bool).scatter_(-1, pos, True).view(b, h, t, d)
            index = (pos + self.length * d).to(INDEX_DTYPE)
            self.index = index if self.index is None else torch.cat([self.index, index], dim=-1)
            self.value = value if self.value is None else torch.cat([self.value, value], dim=-1)
        q = quantize(x, p.bits, self.axis, self.group_size, mask=mask, checked=True)  # the layer's check_storable
        rank = min(p.rank_decode if decode else p.rank, t, d)
        if rank:
            residual = x - dequantize(q)
            if mask is not None:
                residual.masked_fill_(mask, 0.0)
            a, bf = low_rank(residual, rank, p.loops, p.seed)
            self._append_run(a.half().unsqueeze(2), bf.half().unsqueeze(2), t)
        self.q = q if self.q is None else cat([self.q, q], dim=TOKEN_AXIS)
        self.segments.append((t, 2 * k))
        self.length += t

    def drop(self, n: int) -> int:
        """Forget the oldest whole segments within the first ``n`` tokens (factors span a segment)."""
        m = outliers = s = 0
        for tokens, k in self.segments:
            if m + tokens > n:
                break
            m, outliers, s = m + tokens, outliers + k, s + 1
        if not m:
            return 0
        self.segments = self.segments[s:]
        self.length -= m
        self.q = drop_leading(self.q, TOKEN_AXIS, m) if self.length else None
        if self.index is not None:
            d = self.q.shape[-1] if self.q is not None else 0
            self.index, self.value = self.index[..., outliers:] - m * d, self.value[..., outliers:].clone()
            if not self.index.shape[-1]:
                self.index = self.value = None
        runs = []
        for run in self.runs:
            if run.end <= m:
                continue
            skip = max(0, m - run.start) // run.seg_len  # segments are whole, so this is exact
            start = run.start + skip * run.seg_len - m
            runs.append(LowRankRun(start, run.seg_len, run.a[:, :, skip:].clone(), run.b[:, :, skip:].clone()))
        self.runs = runs
        return m

    def _append_run(self, a: torch.Tensor, b: torch.Tensor, seg_len: int) -> None:
        last = self.runs[-1] if self.runs else None
        if last is not None and last.end == self.length and last.seg_len == seg_len and last.a.shape[-1] == a.shape[-1]:
            last.a = torch.cat([last.a, a], dim=2)
            last.b = torch.cat([last.b, b], dim=2)
        else:
            self.runs.append(LowRankRun(self.length, seg_len, a, b))

    def read_into(self, out: torch.Tensor) -> None:
        if self.q is None:
            return
        dequantize(self.q, out=out)
        bsz, h, _, d = out.shape
        for run in self.runs:
            n = run.a.shape[2]
            seg = out[:, :, run.start : run.end].unflatten(2, (n, run.seg_len))
            seg.add_(run.a.to(out.dtype) @ run.b.to(out.dtype).mT)
        if self.index is not None:
            out.view(bsz, h, -1).scatter_(-1, self.index.long(), self.value.to(out.dtype))

    def tensors(self) -> list[torch.Tensor]:
        held = self.q.tensors() if self.q is not None else []
        if self.index is not None:
            held += [self.index, self.value]
        for run in self.runs:
            held += [run.a, run.b]
        return held

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.q is not None:
            self.q = self.q.map(fn)
        if self.index is not None:
            self.index, self.value = fn(self.index), fn(self.value)
        for run in self.runs:
            run.a, run.b = fn(run.a), fn(run.b)


class GearState(CodesState):
    """One layer's GEAR streams: ``CodesState`` whose stores are ``GearStore``s."""

    format: ClassVar[str] = "gear"
