"""AlignedKV's precision-alignment rules (the planes they read: ``kvquant.formats.planes``). Pure torch.

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
from collections.abc import Callable

import torch

from kvquant.bits import ZERO_EXPONENT, bits_to_fp16, floor_log2, truncate_bits
from kvquant.errors import InvalidParameterError

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


def output_exponents(s: torch.Tensor, rows_at: Callable[[torch.Tensor], torch.Tensor], topk: int) -> torch.Tensor:
    """``e(O_est[c]) + 15`` per (batch, KV head, channel) (int16), the most demanding query row's:
    ``O_est[c] = Σ_r s_r·|v8(j_r, c)|`` over the strided top-``topk`` of ``s`` ``[b, hkv, rows, L]``, summed
    by ``pairwise_sum``. ``rows_at(idx [b, hkv, m]) -> [b, hkv, m, d]``: plane A of those tokens only."""
    b, hkv, rows, _ = s.shape
    idx = strided_topk_indices(s, topk)  # [b, hkv, rows, k]
    top_s = s.gather(-1, idx)
    high = rows_at(idx.reshape(b, hkv, -1))
    top_v = high_byte_values(high).to(s.dtype).view(b, hkv, rows, -1, high.shape[-1])
    o_est = pairwise_sum(top_s.unsqueeze(-1) * top_v, dim=-2)  # [b, hkv, rows, d], a fixed order
    # e(O_est[c]) − e(v8[j, c]) = (e(O_est[c]) + 15) − exponent_field[j, c]
    return floor_log2(o_est).amin(dim=2).clamp(-(2**14), 2**14).to(torch.int16) + 15  # most demanding row


def grouped_scores(scores: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[b, q_heads, q_len, L]`` probabilities as ``[b, kv_heads, rows, L]`` (fp64 stays fp64, else fp32):
    the rows of the queries that share each KV head (GQA heads, chunk positions)."""
    b, hq, q_len, n = scores.shape
    s = scores if scores.dtype == torch.float64 else scores.float()
    return s.reshape(b, kv_heads, (hq // kv_heads) * q_len, n)


def value_widths(
    scores: torch.Tensor,
    v_high: torch.Tensor,
    thresholds: tuple[float, float],
    topk: int = 32,
    gaps: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = exponent_gaps,
) -> torch.Tensor:
    """Bits to read per (batch, KV head, token): the paper's rule.

    ``scores``: attention probabilities ``[b, q_heads, q_len, L]`` (fp64 — as the torch reference computes
    them, so that no BLAS summation order moves a width — or fp32, as the CuPy kernels do; ``O_est`` is
    summed in the same precision); ``v_high``: plane A of every value ``[b, kv_heads, L, d]`` (uint8).
    Only plane A is used, as a kernel would: ``e(|v8|)`` is its exponent field, with zeros and
    subnormals counted as 2^-15 (an upper bound). ``gaps`` computes ``exponent_gaps``
    (``kernels_cpu.exponent_gaps`` does it in one C++ pass).
    """
    d = v_high.shape[-1]
    s = grouped_scores(scores, v_high.shape[1])
    e_o = output_exponents(s, lambda idx: v_high.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, d)), topk)
    gap = gaps(e_o, v_high).float() - floor_log2(s).amax(dim=2)
    # A token no query attends to (score 0) feeds nothing: any finite threshold lets it read 8 bits.
    gap = torch.where(s.amax(dim=2) == 0, float(NO_CONTRIBUTION), gap)
    return widths_from_gap(gap, thresholds)


def block_value_widths(
    scores: torch.Tensor,
    v_exp: torch.Tensor,
    rows_at: Callable[[torch.Tensor], torch.Tensor],
    thresholds: tuple[float, float],
    topk: int,
    block: int,
    offset: int = 0,
) -> torch.Tensor:
    """The block-bound value rule (beyond the paper): one width per block of ``block`` stored tokens.

    ``v_exp`` ``[b, kv_heads, blocks, d]`` (uint8) holds, per block and channel, the largest exponent field
    of plane A, kept when the block was stored; a block's gap is ``min_c (e(O_est[c]) + 15 − v_exp[c])``
    less the largest ``e(s)`` of its tokens and query rows. Both terms bound every token's own
    (``value_widths``), so no token of a block reads fewer bits than the paper's rule gives it, and no
    pass over plane A is made beyond the top-k rows ``O_est`` needs (``rows_at``, indices into the scores'
    tokens). ``scores`` cover the tokens from ``offset`` (the store's first visible token, a sliding
    window's) on; returns the widths of the visible plane tokens ``[b, kv_heads, blocks·block − offset]``.
    """
    s = grouped_scores(scores, v_exp.shape[1])
    e_o = output_exponents(s, rows_at, topk)
    n_full = v_exp.shape[2] * block
    e_s, s_max = floor_log2(s).amax(dim=2)[..., : n_full - offset], s.amax(dim=2)[..., : n_full - offset]
    if offset:  # tokens out of the window feed nothing
        e_s = torch.nn.functional.pad(e_s, (offset, 0), value=ZERO_EXPONENT)
        s_max = torch.nn.functional.pad(s_max, (offset, 0), value=0.0)
    e_blk = e_s.unflatten(-1, (-1, block)).amax(-1)
    gap = (e_o.unsqueeze(2) - v_exp.to(torch.int16)).amin(-1).float() - e_blk
    gap = torch.where(s_max.unflatten(-1, (-1, block)).amax(-1) == 0, float(NO_CONTRIBUTION), gap)
    return widths_from_gap(gap, thresholds).repeat_interleave(block, dim=-1)[..., offset:]


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
