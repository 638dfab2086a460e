"""AlignedKV's precision-alignment rules and the plane layout they read. Pure torch.

The rules decide, per decode step, how many bits of each cached element a read needs so that the
error it adds stays below the precision of the sum it feeds (the paper's "precision alignment"):

- keys, per (KV head, channel i): ``P_i = e(max|q_i|) + e(colmax|K_i|)``; ``d_i = max P − P_i``.
- values, per (KV head, token j): ``d_j = min_c [e(O_est[c]) − e(|v8(j, c)|)] − e(s_j)``, where
  ``O_est[c] = Σ_r s_r·|v8(j_r, c)|`` over an approximate top-k of the scores and ``v8`` is the
  8-bit (plane A) read — the token must be aligned with the output in every channel it feeds.

``e`` is floor(log2|·|). A gap ``d ≥ t8`` reads 8 bits, ``d ≥ t12`` reads 12, else 16.
When several queries share a KV head (GQA, or a multi-token chunk) the decision is made for the
most demanding one: max ``|q|`` and max score, min ``O_est``. ``AlignedLayer`` hands the value rule
fp64 scores (so no summation order moves a width; ``kernels_cpu.attend_aligned`` reproduces it in
C++); the CuPy kernels compute them in fp32 and must reproduce these functions on fp32 scores.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvquant.bits import bits_to_fp16, floor_log2, fp16_bits, split_planes, truncate_bits
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


def pairwise_sum(x: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """Sum along ``dim`` in one fixed order (fp64 stays fp64, else fp32): adjacent pairs, zero-padded.

    ``((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + 0))`` for 7 addends: every level is one
    elementwise IEEE add, so ``O_est`` (and so the value widths) is the same bits on any CPU or GPU,
    whatever torch's own ``sum`` order there (``kernels_cupy/sv.cu``'s ``PairwiseSum`` streams the
    same tree). The addends here are ``≥ +0``, so the padding is exact.
    """
    x = x if x.dtype == torch.float64 else x.float()
    dim = dim % x.dim()
    if x.shape[dim] == 0:
        return x.sum(dim)
    while x.shape[dim] > 1:
        if x.shape[dim] % 2:
            x = torch.nn.functional.pad(x, [0, 0] * (x.dim() - 1 - dim) + [0, 1])
        pairs = x.unflatten(dim, (-1, 2))
        x = pairs.select(dim + 1, 0) + pairs.select(dim + 1, 1)
    return x.squeeze(dim)


def exponent_gaps(e_o: torch.Tensor, v_high: torch.Tensor) -> torch.Tensor:
    """``min_c (e_o[c] − exponent_field[j, c])`` per (batch, KV head, token) (int16), ``e_o`` ``[b, h, d]``
    int16; field 0 (zeros, subnormals) stands for 2^-15. Integer math: any exact kernel may replace it."""
    field = ((v_high >> 2) & 0x1F).to(torch.int16)
    return (e_o.unsqueeze(2) - field).amin(dim=-1)


def value_widths(
    scores: torch.Tensor,
    v_high: torch.Tensor,
    thresholds: tuple[float, float],
    topk: int = 32,
    gaps: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = exponent_gaps,
) -> torch.Tensor:
    """Bits to read per (batch, KV head, token).

    ``scores``: attention probabilities ``[b, q_heads, q_len, L]`` (fp64 — as ``AlignedLayer`` computes
    them, so that no BLAS summation order moves a width — or fp32, as the CuPy kernels do; ``O_est`` is
    summed in the same precision); ``v_high``: plane A of every
    value ``[b, kv_heads, L, d]`` (uint8). Only plane A is used, as a kernel would: ``e(|v8|)`` is
    its exponent field, with zeros and subnormals counted as 2^-15 (an upper bound). ``gaps``
    computes ``exponent_gaps`` (``kernels_cpu.exponent_gaps`` does it in one C++ pass).
    """
    b, hq, q_len, n = scores.shape
    hkv, d = v_high.shape[1], v_high.shape[-1]
    groups = hq // hkv
    s = (scores if scores.dtype == torch.float64 else scores.float()).reshape(b, hkv, groups * q_len, n)
    idx = strided_topk_indices(s, topk)  # [b, hkv, G·q, k]
    top_s = s.gather(-1, idx)
    rows = v_high.gather(2, idx.reshape(b, hkv, -1, 1).expand(-1, -1, -1, d))
    top_v = high_byte_values(rows).to(s.dtype).view(b, hkv, groups * q_len, -1, d)
    o_est = pairwise_sum(top_s.unsqueeze(-1) * top_v, dim=-2)  # [b, hkv, G·q, d], a fixed order
    # e(O_est[c]) − e(v8[j, c]) = (e(O_est[c]) + 15) − exponent_field[j, c]
    e_o = floor_log2(o_est).amin(dim=2).clamp(-(2**14), 2**14).to(torch.int16) + 15  # most demanding query
    gap = gaps(e_o, v_high).float() - floor_log2(s).amax(dim=2)
    # A token no query attends to (score 0) feeds nothing: any finite threshold lets it read 8 bits.
    gap = torch.where(s.amax(dim=2) == 0, float(NO_CONTRIBUTION), gap)
    return widths_from_gap(gap, thresholds)


def block_widths(widths: torch.Tensor, block: int, offset: int = 0) -> torch.Tensor:
    """Per-token widths ``[..., n]`` raised to the widest in their block of ``block`` tokens.

    Blocks start every ``block`` tokens from ``offset`` tokens before the first (the store's first
    token), so each block's rows are read at one width, contiguously; ``block`` 1 is the identity.
    """
    n = widths.shape[-1]
    if block == 1 or n == 0:
        return widths
    lead = offset % block
    padded = torch.nn.functional.pad(widths, (lead, (-(lead + n)) % block), value=8)  # 8: the narrowest read
    return padded.unflatten(-1, (-1, block)).amax(-1).repeat_interleave(block, dim=-1)[..., lead : lead + n]


def _i32(x: int) -> int:
    """An unsigned 32-bit pattern as the signed int torch's int32 ops take."""
    return x - (1 << 32) if x >= 1 << 31 else x


MASK32 = {8: 0, 12: _i32(0xF0F0F0F0), 16: -1}
FILL32 = {8: _i32(0x80808080), 12: 0x08080808, 16: 0}
_MASK_LUT = torch.zeros(17, dtype=torch.int32)
_FILL_LUT = torch.zeros(17, dtype=torch.int32)
_VALID_LUT = torch.zeros(17, dtype=torch.bool)
for _w in (8, 12, 16):
    _MASK_LUT[_w], _FILL_LUT[_w], _VALID_LUT[_w] = MASK32[_w], FILL32[_w], True


def _mask_fill32(widths: torch.Tensor | int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Low-byte keep mask and ``1000…`` fill for 8/12/16-bit reads, replicated over the 4 bytes of an int32."""
    w = torch.as_tensor(widths, device="cpu" if isinstance(widths, int) else None).long()
    if bool((w < 0).any()) or not bool(_VALID_LUT.to(w.device)[w.clamp(0, 16)].all()):
        shown = sorted(set(w.flatten().tolist()))[:8]
        raise InvalidParameterError(f"plane reads take widths 8, 12 or 16, got {shown}")
    return _MASK_LUT.to(w.device)[w].to(device), _FILL_LUT.to(w.device)[w].to(device)


def _low_bytes(b: torch.Tensor, c: torch.Tensor, mask: torch.Tensor, fill: torch.Tensor):
    """Read low bytes (B<<4 | C, masked and filled) of the even and odd elements of nibble-packed planes.

    Works four bytes at a time on int32 views; the ±0 rule is applied by the caller where needed.
    """
    b32, c32 = b.view(torch.int32), c.view(torch.int32)
    even = (((b32 & 0x0F0F0F0F) << 4) | (c32 & 0x0F0F0F0F)) & mask | fill
    odd = ((b32 & _i32(0xF0F0F0F0)) | ((c32 >> 4) & 0x0F0F0F0F)) & mask | fill
    return even.view(torch.uint8), odd.view(torch.uint8)


def _zero_rule(pairs: torch.Tensor, fill: torch.Tensor) -> None:
    """In place on assembled fp16 byte pairs ``[..., 2, 2]``: a read whose kept bits are ±0 reads as ±0.

    Works on two fp16 lanes per int32; ``fill`` is the int32-replicated fill of each lane pair's row.
    Planes never hold inf/NaN (storage refuses them), so this is the only exception to the fill.
    """
    x = pairs.view(*pairs.shape[:-2], 4).view(torch.int32)
    lane_fill = fill & 0x00FF00FF  # the fill byte at the bottom of each 16-bit lane
    if lane_fill.dim():  # same-shape contiguous operands vectorise; short broadcast rows do not
        lane_fill = lane_fill.expand(x.shape).contiguous()
    y = x & (0x7FFF7FFF & ~lane_fill)  # magnitude of the kept bits, per lane
    t = y + 0x7FFF7FFF  # in-place from here: this runs on every element of every read
    t |= y
    t &= _i32(0x80008000)  # bit 15 of each lane: kept magnitude != 0
    t ^= _i32(0x80008000)
    t >>= 15
    t &= 0x00010001
    t *= 0xFF  # 0xFF under each lane whose kept bits read as ±0
    t &= lane_fill
    x &= t.bitwise_not_()


def block_exponent_field(k_a: torch.Tensor) -> torch.Tensor:
    """Per (b, h, block, channel): the largest exponent field in the block's plane A (one byte).

    It is the exponent of the block's max ``|K|`` (fields order magnitudes), computed from the
    bytes being written, so an append kernel produces it in the same pass that writes plane A.
    """
    return ((k_a >> 2) & 0x1F).amax(dim=-1)


def block_key_widths(
    q: torch.Tensor, k_absmax: torch.Tensor, k_exp: torch.Tensor, thresholds: tuple[float, float]
) -> torch.Tensor:
    """AlignedKV+: bits per (batch, KV head, block, channel) from each block's own max ``|K|``.

    The reference ``max P`` is the whole-column one of ``key_widths``, so a block whose max equals
    its column's max gets the whole-column width and every other block can only read fewer bits.
    ``k_exp`` holds exponent fields (``block_exponent_field``); field 0 (zeros, subnormals) counts
    as 2^-15, an upper bound.
    """
    b, hq, _, d = q.shape
    hkv = k_absmax.shape[1]
    e_q = floor_log2(q.abs().amax(dim=2).view(b, hkv, hq // hkv, d).amax(dim=2))
    p_col = e_q + floor_log2(k_absmax)
    p_block = e_q[:, :, None, :] + k_exp.to(torch.int32).clamp_min(1) - 15
    return widths_from_gap(p_col.amax(dim=-1)[:, :, None, None] - p_block, thresholds)


def accumulation_margin(n: int) -> float:
    """Extra binades for a sum of ``n`` truncated addends.

    The paper's criterion bounds one addend's error by half a unit of the result's last place. With
    the ``1000…`` fill each truncation error is uniform on ``±ε/2`` (mean 0, variance ε²/12), so
    ``n`` independent ones have a standard deviation of ``ε·sqrt(n/12)``: ``sqrt(n/3)`` times the
    single-addend bound. Raising every gap by ``log2(sqrt(n/3)) = (log2 n − log2 3) / 2`` binades
    brings that deviation back to the single-addend bound. (The worst case, ``n`` errors of one sign,
    would need ``log2 n``; rounding errors of independent data do not line up.)
    """
    if n <= 3:
        return 0.0
    return (math.log2(n) - math.log2(3)) / 2


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
    tiny_k: bool = False
    tiny_v: bool = False
    block_exponents: bool = False
    k_exp: torch.Tensor | None = None
    _empty: bool = field(default=True, repr=False)

    TENSORS = ("k_a", "k_b", "k_c", "v_a", "v_b", "v_c", "tail_k", "tail_v", "k_absmax", "k_exp")

    def tensors_k(self) -> list[torch.Tensor | None]:
        return [self.k_a, self.k_b, self.k_c, self.tail_k, self.k_absmax, self.k_exp]

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace every tensor (all batch-first) by ``fn(tensor)``: beam reorder, batch select, offload."""
        for name in self.TENSORS:
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, fn(tensor))

    def tensors_v(self) -> list[torch.Tensor | None]:
        return [self.v_a, self.v_b, self.v_c, self.tail_v]

    @property
    def n_full(self) -> int:
        return 0 if self.v_a is None else self.v_a.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append fp16 ``k``/``v`` ``[b, h, t, d]``; every completed 64-token block moves into planes."""
        if k.shape[-1] % 8:
            raise InvalidParameterError(f"head_dim {k.shape[-1]} must be a multiple of 8 for the plane layout")
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

    def drop_blocks(self, n_blocks: int) -> None:
        """Forget the oldest ``n_blocks`` whole blocks (a sliding-window layer's tokens no query can
        see again); copies, so the dropped bytes are freed. ``k_absmax`` stays the running max."""
        n_blocks = min(n_blocks, self.n_full // BLOCK)
        if n_blocks <= 0:
            return
        for name in ("k_a", "k_b", "k_c", "k_exp"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name)[:, :, n_blocks:].clone())
        for name in ("v_a", "v_b", "v_c"):
            setattr(self, name, getattr(self, name)[:, :, n_blocks * BLOCK :].clone())
        self.n_tokens -= n_blocks * BLOCK

    def _store_blocks(self, k: torch.Tensor, v: torch.Tensor) -> None:
        b, h, n, d = k.shape
        k_blocks = k.view(b, h, n // BLOCK, BLOCK, d).transpose(-1, -2)  # channel-major per block
        new = (*split_planes(k_blocks), *split_planes(v))
        # Whether any element's high byte reads as ±0 (|x| < 2^-16): only then can the ±0 rule apply.
        self.tiny_k = self.tiny_k or bool(((new[0] & 0x7F) == 0).any())
        self.tiny_v = self.tiny_v or bool(((new[3] & 0x7F) == 0).any())
        if self.block_exponents:
            new = (*new, block_exponent_field(new[0]))
        names = ("k_a", "k_b", "k_c", "v_a", "v_b", "v_c", "k_exp")[: len(new)]
        for name, tensor in zip(names, new, strict=True):
            old = getattr(self, name)
            setattr(self, name, tensor if old is None else torch.cat([old, tensor], dim=2))

    def read_keys(self, widths: torch.Tensor | int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
        """All keys ``[b, h, L, d]`` in ``dtype``; block tokens read at ``widths`` per (b, h, channel)
        or per (b, h, block, channel)."""
        if self.k_a is None:
            return self.tail_k.to(dtype)
        b, h, nb, d, _ = self.k_a.shape
        mask, fill = _mask_fill32(widths, self.k_a.device)
        if mask.dim():  # per (b, h, channel) or per (b, h, block, channel), expanded to the int32 words
            if mask.dim() == 3:
                mask, fill = mask[:, :, None], fill[:, :, None]
            words = (b, h, nb, d, BLOCK // 8)
            mask = mask[..., None].expand(words).contiguous()
            fill = fill[..., None].expand(words).contiguous()
        even, odd = _low_bytes(self.k_b, self.k_c, mask, fill)
        pairs = torch.empty(b, h, nb, d, BLOCK // 2, 2, 2, dtype=torch.uint8, device=self.k_a.device)
        pairs[..., 0, 0] = even
        pairs[..., 1, 0] = odd
        pairs[..., 1] = self.k_a.view(b, h, nb, d, BLOCK // 2, 2)
        if self.tiny_k:
            _zero_rule(pairs, fill[..., :1, None] if fill.dim() else fill)
        blocks = pairs.view(torch.float16).view(b, h, nb, d, BLOCK)
        out = torch.empty(b, h, self.n_tokens, d, dtype=dtype, device=self.k_a.device)
        out[:, :, : nb * BLOCK].view(b, h, nb, BLOCK, d).copy_(blocks.transpose(-1, -2))
        out[:, :, nb * BLOCK :] = self.tail_k
        return out

    def read_values(self, widths: torch.Tensor | int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
        """All values ``[b, h, L, d]`` in ``dtype``, block tokens read at ``widths`` per (b, h, token)."""
        if self.v_a is None:
            return self.tail_v.to(dtype)
        b, h, n, d = self.v_a.shape
        mask, fill = _mask_fill32(widths, self.v_a.device)
        if mask.dim():  # per (b, h, token), expanded to the int32 words of the token's row
            mask = mask[..., None].expand(b, h, n, d // 8).contiguous()
            fill = fill[..., None].expand(b, h, n, d // 8).contiguous()
        even, odd = _low_bytes(self.v_b, self.v_c, mask, fill)
        pairs = torch.empty(b, h, n, d // 2, 2, 2, dtype=torch.uint8, device=self.v_a.device)
        pairs[..., 0, 0] = even
        pairs[..., 1, 0] = odd
        pairs[..., 1] = self.v_a.view(b, h, n, d // 2, 2)
        if self.tiny_v:
            _zero_rule(pairs, fill[..., :1, None] if fill.dim() else fill)
        out = torch.empty(b, h, self.n_tokens, d, dtype=dtype, device=self.v_a.device)
        out[:, :, :n] = pairs.view(torch.float16).view(b, h, n, d)
        out[:, :, n:] = self.tail_v
        return out

    def value_high_bytes(self) -> torch.Tensor:
        """Plane A of every value, tail included ``[b, h, L, d]`` (uint8)."""
        tail = (fp16_bits(self.tail_v) >> 8).to(torch.uint8)
        return tail if self.v_a is None else torch.cat([self.v_a, tail], dim=2)
