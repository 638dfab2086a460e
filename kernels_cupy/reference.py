"""The oracle the kernels are checked against: ``kvquant.formats.planes.aligned_read``'s chain in torch.

It calls the same rule and read functions as the method (``kvquant.alignment``, torch only, no
transformers) and then attends in fp64 over what was read, so a kernel's deviation is its own
fp32 rounding and nothing else. ``O_est`` is summed in the method's fixed order
(``kvquant.alignment.pairwise_sum``), which the kernel streams too: torch's own CPU sum order
depends on the CPU's vector width, and neither another CPU nor a kernel could follow it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels_cupy.ops import softmax_scores
from kvquant.alignment import pairwise_sum

if TYPE_CHECKING:
    from kvquant.formats.planes import PlaneStore


def estimated_output(scores: torch.Tensor, v_high: torch.Tensor, topk: int = 32) -> torch.Tensor:
    """``O_est [b, hkv, rows, d]`` (fp32) of ``value_widths``, summed by ``pairwise_sum`` over the top-k."""
    from kvquant.alignment import high_byte_values, strided_topk_indices

    b, hq, q_len, n = scores.shape
    hkv, d = v_high.shape[1], v_high.shape[-1]
    s = scores.float().reshape(b, hkv, (hq // hkv) * q_len, n)
    idx = strided_topk_indices(s, topk)
    top_s = s.gather(-1, idx)
    rows = v_high.gather(2, idx.reshape(b, hkv, -1, 1).expand(-1, -1, -1, d))
    top_v = high_byte_values(rows).view(b, hkv, s.shape[2], -1, d)
    return pairwise_sum(top_s.unsqueeze(-1) * top_v, dim=-2)


def reference_value_widths(
    scores: torch.Tensor, v_high: torch.Tensor, thresholds: tuple[float, float], topk: int = 32
) -> torch.Tensor:
    """``kvquant.alignment.value_widths`` with ``O_est`` from ``estimated_output`` (the kernels' order)."""
    from kvquant.alignment import NO_CONTRIBUTION, floor_log2, widths_from_gap

    b, hq, q_len, n = scores.shape
    hkv = v_high.shape[1]
    s = scores.float().reshape(b, hkv, (hq // hkv) * q_len, n)
    o_est = estimated_output(scores, v_high, topk)
    e_o = floor_log2(o_est).amin(dim=2).clamp(-(2**14), 2**14).to(torch.int16) + 15
    field = ((v_high >> 2) & 0x1F).to(torch.int16)
    gap = (e_o.unsqueeze(2) - field).amin(dim=-1).float() - floor_log2(s).amax(dim=2)
    gap = torch.where(s.amax(dim=2) == 0, float(NO_CONTRIBUTION), gap)
    return widths_from_gap(gap, thresholds)


def reference_block_widths(
    scores: torch.Tensor, store: PlaneStore, thresholds: tuple[float, float], topk: int = 32
) -> torch.Tensor:
    """``kvquant.alignment.block_value_widths`` on these ``scores`` (the block rule per ``store.value_block``
    tokens, from ``store.v_exp``): what ``decide_widths`` gives with ``value_rule`` block, on any scores."""
    from kvquant.alignment import block_value_widths

    if store.v_exp is None:
        return torch.empty(*store.tail_v.shape[:2], 0, dtype=torch.int32, device=scores.device)
    return block_value_widths(scores.float(), store.v_exp, store.high_bytes_at, thresholds, topk, store.value_block)


def reference_logits(query: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """Scaled ``QKᵀ`` (fp32) ``[b, hq, q_len, L]`` of ``query`` over ``keys`` ``[b, hkv, L, d]``, GQA by reshaping."""
    b, hq, q_len, d = query.shape
    hkv, n = keys.shape[1], keys.shape[2]
    grouped = query.float().reshape(b, hkv, (hq // hkv) * q_len, d)
    return (torch.matmul(grouped, keys.float().transpose(-1, -2)) * scaling).view(b, hq, q_len, n)


def reference_attention(
    store: PlaneStore,
    query: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    k_thresholds: tuple[float, float] = (4, 8),
    v_thresholds: tuple[float, float] = (4, 8),
    topk: int = 32,
    blockwise: bool = False,
    value_rule: str = "token",
) -> dict[str, torch.Tensor]:
    """``{"out" (fp64), "wk", "wv", "keys", "values", "logits", "scores"}`` of one step, as the method has them
    (``value_rule`` block: ``reference_block_widths``)."""
    from kvquant.alignment import block_key_widths, key_widths

    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if blockwise and store.k_exp is not None:
        wk = block_key_widths(query, store.k_absmax, store.k_exp, k_thresholds)
    else:
        wk = key_widths(query, store.k_absmax, k_thresholds)
    keys = store.read_keys(wk, query.dtype)
    logits = reference_logits(query, keys, scaling)
    scores = softmax_scores(logits, attention_mask)
    if value_rule == "block":
        wv = reference_block_widths(scores, store, v_thresholds, topk)
    else:
        wv = reference_value_widths(scores, store.value_high_bytes(), v_thresholds, topk)[:, :, : store.n_full]
    values = store.read_values(wv, query.dtype)
    b, hq, q_len, _ = query.shape
    hkv, n, d = values.shape[1], values.shape[2], values.shape[3]
    out = scores.double().reshape(b, hkv, -1, n) @ values.double()
    return {
        "out": out.view(b, hq, q_len, d),
        "wk": wk,
        "wv": wv,
        "keys": keys,
        "values": values,
        "logits": logits,
        "scores": scores,
    }
