"""How one AlignedKV step is laid out on the GPU: thresholds as integer tiers, how a step is split across
CTAs and query-row chunks, shared memory per launch, and the log-sum-exp merge of split softmaxes as the
kernels compute it. Pure Python and torch: tested on the CPU, where no kernel can run.
"""

from __future__ import annotations

import math

import torch

from kvquant.errors import InvalidParameterError

BLOCK = 64
THREADS = 256
INT_MAX = 2**31 - 1
TILE_STRIDE = 66  # pack.cu / qk.cu TILE_STRIDE


def tiers(thresholds: tuple[float, float]) -> tuple[int, int]:
    """Integer ``(t12, t8)``: an integer gap clears ``t`` exactly when it clears ``ceil(t)``; nothing clears inf."""
    return tuple(INT_MAX if math.isinf(t) else min(INT_MAX, math.ceil(t)) for t in thresholds)


def row_chunks(rows: int, bytes_per_row: int, fixed_bytes: int, budget: int, what: str) -> list[tuple[int, int]]:
    """``(row0, n_rows)`` launches covering ``rows`` query rows, as few as fit ``fixed + n·per_row ≤ budget``.

    A ``prefill_aligned`` chunk brings (query heads per KV head) × (tokens) rows, which can exceed
    one block's shared memory; sizes differ by at most one row, so no launch is a sliver.
    """
    fit = (budget - fixed_bytes) // bytes_per_row
    if fit < 1:
        raise InvalidParameterError(
            f"{what} needs {fixed_bytes + bytes_per_row} bytes of shared memory for one query row; "
            f"the device allows {budget}"
        )
    n = math.ceil(rows / fit)
    base, extra = divmod(rows, n)
    sizes = [base + 1] * extra + [base] * (n - extra)
    return [(sum(sizes[:i]), size) for i, size in enumerate(sizes)]


def qk_shared_bytes(d: int) -> tuple[int, int]:
    """``(per query row, fixed)`` dynamic shared memory of ``qk.cu``."""
    return d * 4, (2 * d + max(d, THREADS // 32)) * 4 + d * TILE_STRIDE * 2


def qk_warp_rows(rows: int) -> int | None:
    """Rows the warp kernel (``qk_warp_*_r{1,2,4}``) accumulates for ``rows`` query rows of a KV head, or None
    past 4 (a prefill chunk: the tile kernel takes it)."""
    return next((rt for rt in (1, 2, 4) if rows <= rt), None)


def qk_warp_shared_bytes(d: int, rows: int) -> int:
    """Dynamic shared memory of the warp kernel: the rows' queries, ``e_q``, ``w_col`` and the scratch."""
    return (rows * d + 2 * d + max(d, THREADS // 32)) * 4


def qk_warp_split(n_units: int, bh: int, sms: int) -> tuple[int, int]:
    """``(units per CTA, CTAs per KV head)`` of the warp kernel (each warp takes every 8th unit of its CTA):
    ``qk_split``'s, rounded up to whole rounds of the 8 warps past 8 units; fewer units than warps stay as
    they are (idle warps rather than idle SMs where units are scarce)."""
    per_cta, _ = qk_split(n_units, bh, sms)
    warps = THREADS // 32
    if per_cta > warps:
        per_cta = math.ceil(per_cta / warps) * warps
    return per_cta, math.ceil(n_units / per_cta)


def read8_words(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, width: int) -> torch.Tensor:
    """``planes.cuh``'s ``read8`` line for line on int64 tensors holding 32-bit words: ``a`` ``[..., 2]`` plane-A
    words (elements 0-3, 4-7, element i in byte i % 4), ``b`` / ``c`` ``[...]`` nibble words (element i at bits
    4i; zero where ``width`` does not load them) -> ``[..., 4]`` words, element 2i in the low half of word i."""
    even = ((b << 4) & 0xF0F0F0F0) | (c & 0x0F0F0F0F)
    odd = (b & 0xF0F0F0F0) | ((c >> 4) & 0x0F0F0F0F)
    fill4 = {8: 0x80808080, 12: 0x08080808, 16: 0}[width]
    lo03 = _fill_low_bytes(_byte_perm(even, odd, 0x5140), a[..., 0], fill4)
    lo47 = _fill_low_bytes(_byte_perm(even, odd, 0x7362), a[..., 1], fill4)
    words = (
        _byte_perm(lo03, a[..., 0], 0x5140),
        _byte_perm(lo03, a[..., 0], 0x7362),
        _byte_perm(lo47, a[..., 1], 0x5140),
        _byte_perm(lo47, a[..., 1], 0x7362),
    )
    return torch.stack(words, dim=-1)


def _byte_perm(x: torch.Tensor, y: torch.Tensor, selector: int) -> torch.Tensor:
    """PTX ``prmt.b32`` (selector nibbles 0-7: byte i of the result is byte ``nibble i`` of {x, y})."""
    pool = [(x >> (8 * i)) & 0xFF for i in range(4)] + [(y >> (8 * i)) & 0xFF for i in range(4)]
    out = torch.zeros_like(x)
    for i in range(4):
        out |= pool[(selector >> (4 * i)) & 0x7] << (8 * i)
    return out


def _fill_low_bytes(lo: torch.Tensor, hi: torch.Tensor, fill4: int) -> torch.Tensor:
    nonzero = (((hi & 0x7F7F7F7F) + 0x7F7F7F7F) | ((lo & 0x7F7F7F7F) + 0x7F7F7F7F) | lo) & 0x80808080
    exp31 = ((hi & 0x7C7C7C7C) + 0x04040404) & 0x80808080
    return lo | (fill4 & (((nonzero & ~exp31 & 0xFFFFFFFF) >> 7) * 0xFF))


def qk_split(n_units: int, bh: int, sms: int) -> tuple[int, int]:
    """``(blocks per CTA, CTAs per KV head)`` of a QK launch: about 16 CTAs per SM over all KV heads."""
    per_cta = max(1, math.ceil(n_units * bh / (sms * 16)))
    return per_cta, math.ceil(n_units / per_cta)


def softmax_split(n_tokens: int, topk: int, rows: int, sms: int) -> tuple[int, int]:
    """``(tokens per CTA, CTAs per query row)`` of ``softmax_topk``: about 16 CTAs per SM over all ``rows``
    (batch · KV heads · rows per head), at least 16 strided rows each; a CTA's tokens are whole strided
    rows of ``topk`` (the top-k partials of a split are residue classes restricted to its tokens)."""
    stride = topk if topk > 0 else BLOCK
    n_strided = math.ceil(n_tokens / stride)
    wanted = max(1, math.ceil(sms * 16 / rows))
    rows_per_split = max(16, math.ceil(n_strided / wanted))
    return rows_per_split * stride, math.ceil(n_strided / rows_per_split)


def sv_split(n_tokens: int, bh: int, sms: int) -> tuple[int, int]:
    """``(tokens per CTA, CTAs per KV head)`` of an SV launch: about 4 CTAs per SM over all KV heads, each
    a multiple of 64 tokens (whole value blocks; every warp's 32-token group inside one) and at least one
    group per warp."""
    wanted = max(1, math.ceil(sms * 4 / bh))
    per_cta = max(THREADS, math.ceil(n_tokens / wanted))
    per_cta = math.ceil(per_cta / BLOCK) * BLOCK
    return per_cta, math.ceil(n_tokens / per_cta)


def sv_lanes(d: int) -> tuple[int, int]:
    """``(channels per lane, lanes per token row)`` of ``sv.cu``: 16 channels (a 16-byte load of plane A)
    where ``d`` is a multiple of 16, else 8; the lanes of a row padded to a power of two."""
    cpt = 16 if d % 16 == 0 else 8
    return cpt, 1 << (d // cpt - 1).bit_length()


def sv_rows(rows: int) -> int:
    """Query rows ``sv.cu`` accumulates at once (1, 2 or 4; more rows loop over groups of 4)."""
    return 1 if rows == 1 else (2 if rows == 2 else 4)


def sv_shared_bytes(d: int, rc: int) -> int:
    return d * 4 + (THREADS // 32) * rc * d * 4


def softmax_shared_bytes(topk: int) -> int:
    return max(THREADS, topk) * 8


def merge_softmax_partials(partials: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m, l)`` of a row from per-split ``(m_i, l_i)`` ``[..., n, 2]``, in split order as ``softmax.cu``:
    ``m = max m_i``, ``l = Σ l_i · exp(m_i − m)`` (splits with ``m_i = −inf`` add nothing)."""
    m_i, l_i = partials[..., 0], partials[..., 1]
    m = m_i.amax(dim=-1)
    total = torch.zeros_like(m)
    finite = m != float("-inf")
    for i in range(partials.shape[-2]):
        term = torch.where(m_i[..., i] != float("-inf"), l_i[..., i] * torch.exp(m_i[..., i] - m), 0.0)
        total = torch.where(finite, total + term, total)
    return m, total


def split_softmax(logits: torch.Tensor, tokens_per_split: int) -> torch.Tensor:
    """fp32 probabilities from logits ``[..., L]`` as QK and ``softmax.cu`` compute them: per split of
    ``tokens_per_split`` tokens ``(max, Σ exp(x − max))``, merged by ``merge_softmax_partials``, then
    ``exp(x − m) / l``; 0 where ``x = −inf`` or the whole row is masked. The CPU check of the merge."""
    x = logits.float()
    parts = []
    for start in range(0, x.shape[-1], tokens_per_split):
        chunk = x[..., start : start + tokens_per_split]
        m = chunk.amax(dim=-1)
        safe = torch.where(m == float("-inf"), 0.0, m)
        parts.append(torch.stack([m, torch.exp(chunk - safe.unsqueeze(-1)).sum(dim=-1)], dim=-1))
    m, total = merge_softmax_partials(torch.stack(parts, dim=-2))
    probs = torch.exp(x - torch.where(m == float("-inf"), 0.0, m).unsqueeze(-1)) / total.unsqueeze(-1)
    return torch.where((x == float("-inf")) | (m == float("-inf")).unsqueeze(-1), 0.0, probs)


def step_launches(rows: int, d: int, budget: int) -> int:
    """Kernel launches of one ``aligned_attention`` step: QK (one per row chunk), ``softmax_topk``, SV."""
    return len(row_chunks(rows, *qk_shared_bytes(d), budget, "QKᵀ")) + 2
