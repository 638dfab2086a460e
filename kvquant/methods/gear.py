"""GEAR (Kang et al., 2024): KIVI-style quantization + exact sparse outliers + low-rank residual correction.

Each compressed *segment* — a ``[T, D]`` matrix per (batch row, KV head), for K and for V separately
— is stored as

1. **outliers**: the ``⌊s/2 · T·D⌋`` largest and the as many smallest entries of the matrix
   (``s = outlier_ratio``, a fraction of the matrix whatever its shape), kept exact: an int32 position
   (token · D + channel, within the layer's compressed history) and an fp16 value each, 48 bits;
2. **base codes**: KIVI-style ``bits``-bit quantization (keys per channel in groups of ``group_size``
   tokens, values per token in groups of ``group_size`` channels; ``2^b − 1`` steps, see
   ``kvquant.quant.integer``) with the outliers left out of their groups' min/max;
3. **low-rank**: the quantization residual (zero at the outliers) ≈ ``A Bᵀ`` with ``A`` ``[T, r]`` and
   ``B`` ``[D, r]`` in fp16, from ``loops`` rounds of seeded power (subspace) iteration with QR.
   ``r = rank`` for a segment written by a multi-token update (prefill, or a chunk of it),
   ``rank_decode`` for one written during single-token decoding (both capped at ``min(T, D)``).

Streaming (no whole-cache recompression): K and V each keep an fp16 window of the newest tokens.
When an update makes a window longer than ``residual``, its oldest whole blocks of ``residual``
tokens leave it together, as **one new segment**, compressed once and appended; the window keeps
1…``residual`` tokens. So a prompt becomes one big segment (one rank-``rank`` correction over the
whole prompt), and decoding adds one segment of ``residual`` tokens every ``residual`` steps with a
rank-``rank_decode`` correction. Segments already stored are never touched again. ``gear_l`` is the
same without the sparse part.

Reading reconstructs dequantized codes + ``A Bᵀ`` + outliers, then the window, in the input dtype;
reads are accounted as for KIVI (every byte held, spread over the compressed elements; window at 16).

Cost per compressed element, on top of KIVI's ``bits + 32/group_size``: ``48·s`` for the outliers
(0.96 bits at s = 2%) and ``16·r·(1/T + 1/D)`` for the factors — about 1 bit at r = 4 and D = 64,
since GEAR's correction is per head. ``analytic_bits`` gives the exact figure for a prompt.

Batch rows are independent: every tensor held is batch-first and an outlier position counts within
its own (batch row, head) matrix, so a beam reorder moves positions with their values and stays
valid. The window, read counting and shared parameters are ``kvquant.methods.window``'s;
``group_size`` None is the paper's 64 adapted to the model's head dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvquant.cache import KVGeometry
from kvquant.errors import InvalidParameterError
from kvquant.methods.base import register_method
from kvquant.methods.window import CHANNEL_AXIS, TOKEN_AXIS, Stream, WindowedLayer, WindowedMethod
from kvquant.quant.integer import QuantizedTensor, cat, dequantize, drop_leading, quantize

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

    def __init__(self, params: GearBase, axis: int, group_size: int):
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
        q = quantize(x, p.bits, self.axis, self.group_size, mask=mask)
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


class GearLayer(WindowedLayer):
    """One decoder layer's GEAR store (layout and streaming in the module docstring)."""

    params: GearBase

    def new_streams(self) -> tuple[Stream, Stream]:
        residual = self.params.residual
        keys = Stream(GearStore(self.params, TOKEN_AXIS, self.group_size), residual, block=residual)
        values = Stream(GearStore(self.params, CHANNEL_AXIS, self.group_size), residual, block=residual)
        return keys, values


@dataclass(frozen=True)
class GearBase(WindowedMethod):
    """What GEAR and GEAR-L share: a ``bits``-bit KIVI-style base in groups of ``group_size`` (None:
    64, adapted to the head dim) and a rank-``rank`` (prefill) / rank-``rank_decode`` (decode)
    residual correction from ``loops`` seeded power iterations; the newest tokens in an fp16 window."""

    bits: int = 4
    rank: int = 4
    rank_decode: int = 2
    loops: int = 3
    seed: int = 0

    allowed_bits = (2, 4)
    default_group_size = 64
    family = "gear"
    kernel_format = "gear"
    outlier_ratio: ClassVar[float] = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        label = f"method {self.label}"
        if not 0.0 <= self.outlier_ratio < 1.0:
            raise InvalidParameterError(f"{label}: outlier_ratio must be in [0, 1), got {self.outlier_ratio}")
        if self.rank < 0 or self.rank_decode < 0:
            raise InvalidParameterError(
                f"{label}: rank and rank_decode must be >= 0, got {self.rank} and {self.rank_decode}"
            )
        if self.loops < 1:
            raise InvalidParameterError(f"{label}: loops (power iterations) must be >= 1, got {self.loops}")

    def new_layer(self, layer_idx: int, geometry: KVGeometry, backend: str = "torch") -> GearLayer:
        return GearLayer(layer_idx, self, self.group_size_for(geometry.head_dim), geometry.window(layer_idx), backend)

    def analytic_bits(self, geometry: KVGeometry | None = None, context: int | None = None) -> float:
        """Bits per stored element for a ``context``-token prompt written in one update (one prefill
        segment of ``⌊(L−1)/R⌋·R`` tokens with a rank-``rank`` correction, the rest in the fp16 window)
        on ``geometry`` (needed for a ``context``: the factors' cost depends on the head dim);
        ``context=None``: the limit L → ∞, ``bits + 32/group_size + 48·outlier_ratio`` (low-rank
        factors and window vanish per element)."""
        g = self.group_size_for(geometry.head_dim) if geometry is not None else self.group_size
        g = g or self.default_group_size
        if context is None:
            return self.bits + 32 / g + SPARSE_BITS * self.outlier_ratio
        if context < 1:
            raise InvalidParameterError(f"context must be >= 1, got {context}")
        if geometry is None:
            raise InvalidParameterError(f"method {self.label}: analytic bits at a context need the model's geometry")
        r = self.residual
        t = (context - 1) // r * r if context > r else 0
        d = geometry.head_dim
        total = 0.0
        for meta in (t // g * d, t * (d // g)):  # keys: per channel per token group; values: per token
            codes = self.bits * t * d + 32 * meta
            sparse = 2 * outlier_count(self.outlier_ratio, t * d) * SPARSE_BITS if t else 0
            factors = 16 * min(self.rank, t, d) * (t + d) if t else 0
            total += codes + sparse + factors + 16 * (context - t) * d
        return total / (2 * context * d)


@dataclass(frozen=True)
class GearMethod(GearBase):
    """GEAR (Kang et al., 2024, "GEAR: An Efficient KV Cache Compression Recipe for Near-Lossless
    Generative Inference of LLM"): the shared base plus the ``outlier_ratio`` largest and smallest
    entries of each segment kept exact."""

    outlier_ratio: float = 0.02


@dataclass(frozen=True)
class GearLMethod(GearBase):
    """GEAR-L: GEAR without the sparse outliers (quantization + low-rank residual only)."""

    family = "gear_l"


register_method("gear", GearMethod)
register_method("gear2", GearMethod, bits=2)
register_method("gear4", GearMethod, bits=4)
register_method("gear_l", GearLMethod)
register_method("gear_l2", GearLMethod, bits=2)
register_method("gear_l4", GearLMethod, bits=4)
