"""The oracle the kernels are checked against: ``AlignedLayer.aligned_read``'s chain in torch.

It calls the same rule and read functions as the method (``kvquant.alignment``, torch only, no
transformers) and then attends in fp64 over what was read, so a kernel's deviation is its own
fp32 rounding and nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels_cupy.ops import softmax_scores

if TYPE_CHECKING:
    from kvquant.alignment import PlaneStore


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
) -> dict[str, torch.Tensor]:
    """``{"out" (fp64), "wk", "wv", "keys", "values", "logits", "scores"}`` of one step, as the method has them."""
    from kvquant.alignment import block_key_widths, key_widths, value_widths

    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if blockwise and store.k_exp is not None:
        wk = block_key_widths(query, store.k_absmax, store.k_exp, k_thresholds)
    else:
        wk = key_widths(query, store.k_absmax, k_thresholds)
    keys = store.read_keys(wk, query.dtype)
    logits = reference_logits(query, keys, scaling)
    scores = softmax_scores(logits, attention_mask)
    wv = value_widths(scores, store.value_high_bytes(), v_thresholds, topk)[:, :, : store.n_full]
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
