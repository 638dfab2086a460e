"""AlignedKV's precision-alignment rules and the plane layout they read. Pure torch.

The rules decide, per decode step, how many bits of each cached element a read needs so that the
error it adds stays below the precision of the sum it feeds (the paper's "precision alignment"):

- keys, per (KV head, channel i): ``P_i = e(max|q_i|) + e(colmax|K_i|)``; ``d_i = max P − P_i``.
- values, per (KV head, token j): ``d_j = min_c [e(O_est[c]) − e(|v8(j, c)|)] − e(s_j)``, where
  ``O_est[c] = Σ_r s_r·|v8(j_r, c)|`` over an approximate top-k of the scores and ``v8`` is the
  8-bit (plane A) read — the token must be aligned with the output in every channel it feeds.

``e`` is floor(log2|·|). A gap ``d ≥ t8`` reads 8 bits, ``d ≥ t12`` reads 12, else 16.
When several queries share a KV head (GQA, or a multi-token chunk) the decision is made for the
most demanding one: max ``|q|`` and max score, min ``O_est``. Kernels in ``kernels_cupy`` must
reproduce these functions bit for bit.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from kvquant.bits import (
    bits_to_fp16,
    floor_log2,
    fp16_bits,
    split_planes,
    truncate_bits,
)
from kvquant.errors import InvalidParameterError

if sys.byteorder != "little":  # plane reads assemble fp16 from (low, high) byte pairs
    raise ImportError("kvquant.alignment assumes a little-endian machine")

BLOCK = 64
"""Tokens per K block: a skipped plane of one channel in one block is one contiguous sector."""


NO_CONTRIBUTION = 1 << 20
"""Gap given to zero-score tokens: above any finite threshold, below an infinite one."""


def check_thresholds(thresholds: tuple[float, float] | list[float], what: str) -> tuple[float, float]:
    """``(t12, t8)`` with ``0 < t12 ≤ t8`` (equal: no 12-bit tier; ``inf``: always 16), else one line."""
    values = tuple(float(t) for t in thresholds)
    if len(values) != 2 or not 0 < values[0] <= values[1]:
        raise InvalidParameterError(
            f"{what} thresholds must be two increasing positive binade gaps (t12, t8), e.g. [4, 8]; "
            f"got {list(thresholds)}"
        )
    return values


def widths_from_gap(gap: torch.Tensor, thresholds: tuple[float, float]) -> torch.Tensor:
    """8 where ``gap ≥ t8``, 12 where ``gap ≥ t12``, else 16 (int32)."""
    t12, t8 = thresholds
    return torch.where(gap >= t8, 8, torch.where(gap >= t12, 12, 16)).to(torch.int32)


def key_widths(q: torch.Tensor, k_absmax: torch.Tensor, thresholds: tuple[float, float]) -> torch.Tensor:
    """Bits to read per (batch, KV head, channel).

    ``q``: ``[b, q_heads, q_len, d]``; ``k_absmax``: running max of ``|K|`` per channel,
    ``[b, kv_heads, d]``. Query heads sharing a KV head (GQA) and the queries of a chunk contribute
    their max ``|q|``.
    """
    b, hq, _, d = q.shape
    hkv = k_absmax.shape[1]
    if hq % hkv:
        raise InvalidParameterError(f"{hq} query heads cannot share {hkv} KV heads evenly")
    q_max = q.abs().amax(dim=2).view(b, hkv, hq // hkv, d).amax(dim=2)
    p = floor_log2(q_max) + floor_log2(k_absmax)
    return widths_from_gap(p.amax(dim=-1, keepdim=True) - p, thresholds)


def strided_topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Approximate top-k along the last dim: the argmax of each of ``k`` strided groups (j mod k)."""
    n = scores.shape[-1]
    if n <= k:
        return torch.arange(n, device=scores.device).expand(*scores.shape[:-1], n)
    pad = (-n) % k
    padded = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
    rows = padded.view(*scores.shape[:-1], -1, k).argmax(dim=-2)
    return rows * k + torch.arange(k, device=scores.device)


def high_byte_values(v_high: torch.Tensor) -> torch.Tensor:
    """|v8|: the magnitudes an 8-bit read of plane A gives (fp32)."""
    return bits_to_fp16(truncate_bits(v_high.to(torch.int32) << 8, 8)).float().abs()


def value_widths(
    scores: torch.Tensor, v_high: torch.Tensor, thresholds: tuple[float, float], topk: int = 32
) -> torch.Tensor:
    """Bits to read per (batch, KV head, token).

    ``scores``: attention probabilities ``[b, q_heads, q_len, L]``; ``v_high``: plane A of every
    value ``[b, kv_heads, L, d]`` (uint8). Only plane A is used, as a kernel would: ``e(|v8|)`` is
    its exponent field, with zeros and subnormals counted as 2^-15 (an upper bound).
    """
    b, hq, q_len, n = scores.shape
    hkv, d = v_high.shape[1], v_high.shape[-1]
    groups = hq // hkv
    s = scores.float().reshape(b, hkv, groups * q_len, n)
    idx = strided_topk_indices(s, topk)  # [b, hkv, G·q, k]
    top_s = s.gather(-1, idx)
    rows = v_high.gather(2, idx.reshape(b, hkv, -1, 1).expand(-1, -1, -1, d))
    top_v = high_byte_values(rows).view(b, hkv, groups * q_len, -1, d)
    o_est = (top_s.unsqueeze(-1) * top_v).sum(dim=-2)  # [b, hkv, G·q, d]
    # e(O_est[c]) − e(v8[j, c]) = (e(O_est[c]) + 15) − exponent_field[j, c]
    e_o = floor_log2(o_est).amin(dim=2).clamp(-(2**14), 2**14).to(torch.int16) + 15  # most demanding query
    field = ((v_high >> 2) & 0x1F).to(torch.int16)  # zeros and subnormals: field 0, i.e. 2^-15
    gap = (e_o.unsqueeze(2) - field).amin(dim=-1).float() - floor_log2(s).amax(dim=2)
    # A token no query attends to (score 0) feeds nothing: any finite threshold lets it read 8 bits.
    gap = torch.where(s.amax(dim=2) == 0, float(NO_CONTRIBUTION), gap)
    return widths_from_gap(gap, thresholds)


LOW_MASK = {8: 0x00, 12: 0xF0, 16: 0xFF}
LOW_FILL = {8: 0x80, 12: 0x08, 16: 0x00}


def _mask_fill(widths: torch.Tensor | int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-element low-byte mask and fill for reads of 8/12/16 bits."""
    w = torch.as_tensor(widths, device=device)
    if not bool(((w == 8) | (w == 12) | (w == 16)).all()):
        raise InvalidParameterError(f"plane reads take widths 8, 12 or 16, got {sorted(set(w.flatten().tolist()))}")
    mask = torch.where(w == 16, 0xFF, torch.where(w == 12, 0xF0, 0x00)).to(torch.uint8)
    fill = torch.where(w == 16, 0x00, torch.where(w == 12, 0x08, 0x80)).to(torch.uint8)
    return mask, fill


def read_low_byte(a: torch.Tensor, low: torch.Tensor, mask: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """The low byte a reader gets: kept bits plus the ``1000…`` fill, or nothing when the kept bits are
    ±0 (planes never hold inf/NaN: storage refuses them, so that exception cannot arise)."""
    kept = low & mask
    zero = ((a & 0x7F) == 0) & (kept == 0)
    return torch.where(zero, kept, kept | fill)


def _interleave_nibbles(b: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Low bytes (B<<4 | C) of the even and odd elements of nibble-packed planes."""
    even = ((b & 0x0F) << 4) | (c & 0x0F)
    odd = (b & 0xF0) | (c >> 4)
    return even, odd


@dataclass
class PlaneStore:
    """One layer's K/V in the layout the kernels read.

    K: channel-major blocks of ``BLOCK`` tokens, planes ``k_a [b, h, blocks, d, 64]`` and
    nibble-packed ``k_b``/``k_c [b, h, blocks, d, 32]``. V: token-major, ``v_a [b, h, n, d]``,
    ``v_b``/``v_c [b, h, n, d/2]``. The newest ``L mod 64`` tokens stay fp16 in ``tail_k``/``tail_v``
    until a block fills. ``k_absmax`` is the running per-channel max of ``|K|`` (fp16).
    """

    k_a: torch.Tensor | None = None
    k_b: torch.Tensor | None = None
    k_c: torch.Tensor | None = None
    v_a: torch.Tensor | None = None
    v_b: torch.Tensor | None = None
    v_c: torch.Tensor | None = None
    tail_k: torch.Tensor | None = None
    tail_v: torch.Tensor | None = None
    k_absmax: torch.Tensor | None = None
    n_tokens: int = 0
    _empty: bool = field(default=True, repr=False)

    def tensors_k(self) -> list[torch.Tensor | None]:
        return [self.k_a, self.k_b, self.k_c, self.tail_k, self.k_absmax]

    def tensors_v(self) -> list[torch.Tensor | None]:
        return [self.v_a, self.v_b, self.v_c, self.tail_v]

    @property
    def n_full(self) -> int:
        return 0 if self.v_a is None else self.v_a.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append fp16 ``k``/``v`` ``[b, h, t, d]``; every completed 64-token block moves into planes."""
        if k.shape[-1] % 2:
            raise InvalidParameterError(f"head_dim {k.shape[-1]} must be even to pack nibble planes")
        absmax = k.abs().amax(dim=2)
        if self._empty:
            self.tail_k, self.tail_v, self.k_absmax, self._empty = k, v, absmax, False
        else:
            self.tail_k = torch.cat([self.tail_k, k], dim=2)
            self.tail_v = torch.cat([self.tail_v, v], dim=2)
            self.k_absmax = torch.maximum(self.k_absmax, absmax)
        self.n_tokens += k.shape[2]
        full = (self.tail_k.shape[2] // BLOCK) * BLOCK
        if full:
            self._store_blocks(self.tail_k[:, :, :full], self.tail_v[:, :, :full])
            self.tail_k, self.tail_v = self.tail_k[:, :, full:].clone(), self.tail_v[:, :, full:].clone()

    def _store_blocks(self, k: torch.Tensor, v: torch.Tensor) -> None:
        b, h, n, d = k.shape
        k_blocks = k.view(b, h, n // BLOCK, BLOCK, d).transpose(-1, -2)  # channel-major per block
        new = (*split_planes(k_blocks), *split_planes(v))
        names = ("k_a", "k_b", "k_c", "v_a", "v_b", "v_c")
        for name, tensor in zip(names, new, strict=True):
            old = getattr(self, name)
            setattr(self, name, tensor if old is None else torch.cat([old, tensor], dim=2))

    def read_keys(self, widths: torch.Tensor | int) -> torch.Tensor:
        """All keys ``[b, h, L, d]`` (fp16), block tokens read at ``widths`` per (b, h, channel)."""
        if self.k_a is None:
            return self.tail_k
        mask, fill = _mask_fill(widths, self.k_a.device)
        if mask.dim():
            mask, fill = mask[:, :, None, :, None], fill[:, :, None, :, None]
        b, h, nb, d, _ = self.k_a.shape
        a = self.k_a.view(b, h, nb, d, BLOCK // 2, 2)
        even, odd = _interleave_nibbles(self.k_b, self.k_c)
        out = torch.empty(b, h, nb, BLOCK // 2, 2, d, 2, dtype=torch.uint8, device=self.k_a.device)
        out[..., 0, :, 0] = read_low_byte(a[..., 0], even, mask, fill).transpose(-1, -2)
        out[..., 1, :, 0] = read_low_byte(a[..., 1], odd, mask, fill).transpose(-1, -2)
        out[..., 1] = self.k_a.transpose(-1, -2).reshape(b, h, nb, BLOCK // 2, 2, d)
        keys = out.view(torch.float16).view(b, h, nb * BLOCK, d)
        return torch.cat([keys, self.tail_k], dim=2)

    def read_values(self, widths: torch.Tensor | int) -> torch.Tensor:
        """All values ``[b, h, L, d]`` (fp16), block tokens read at ``widths`` per (b, h, token)."""
        if self.v_a is None:
            return self.tail_v
        mask, fill = _mask_fill(widths, self.v_a.device)
        if mask.dim():
            mask, fill = mask[..., None], fill[..., None]
        b, h, n, d = self.v_a.shape
        a = self.v_a.view(b, h, n, d // 2, 2)
        even, odd = _interleave_nibbles(self.v_b, self.v_c)
        out = torch.empty(b, h, n, d // 2, 2, 2, dtype=torch.uint8, device=self.v_a.device)
        out[..., 0, 0] = read_low_byte(a[..., 0], even, mask, fill)
        out[..., 1, 0] = read_low_byte(a[..., 1], odd, mask, fill)
        out[..., 1] = a
        return torch.cat([out.view(torch.float16).view(b, h, n, d), self.tail_v], dim=2)

    def value_high_bytes(self) -> torch.Tensor:
        """Plane A of every value, tail included ``[b, h, L, d]`` (uint8)."""
        tail = (fp16_bits(self.tail_v) >> 8).to(torch.uint8)
        return tail if self.v_a is None else torch.cat([self.v_a, tail], dim=2)
