"""Relative error of ``QKᵀ`` and ``SV`` at a decode step: what a method reads vs full fp16 K/V.

The paper's Table 1 protocol, for any registered method: take the real query and K/V of one decode
step of the fp16 model, let a fresh store of the method hold the K/V (the prompt as prefill, the
last token as the decode step), and compare the products computed from what it hands attention
(or, for a reader such as AlignedKV, from what its rule reads) with those from fp16 K/V. ``SV``
uses the fp16 scores on both sides, so it isolates the values.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvquant.attention import capture_attention_inputs
from kvquant.cache import KVGeometry

BUCKETS = ("=0", "(0,1e-4]", "(1e-4,1e-3]", "(1e-3,1e-2]", ">1e-2")


@torch.no_grad()
def decode_step_inputs(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]:
    """Per layer ``(q, K, V, scaling)`` of the decode step that reads ``ids[-1]`` after ``ids[:-1]``.

    ``q`` is ``[1, q_heads, 1, d]``, ``K``/``V`` ``[1, kv_heads, len(ids), d]`` (post-RoPE, fp32).
    """
    ids = ids.view(1, -1).to(model.device)
    cache = DynamicCache()
    model(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True)
    with capture_attention_inputs(model) as calls:
        model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
    return [(c["query"].float(), c["key"].float(), c["value"].float(), c["scaling"]) for c in calls]


def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x.repeat_interleave(groups, dim=1)


@torch.no_grad()
def read_products(method, layer_idx: int, geometry: KVGeometry, q, k, v, scaling: float) -> dict[str, torch.Tensor]:
    """``qk_full/qk_read`` ``[1, q_heads, 1, L]`` and ``sv_full/sv_read`` ``[1, q_heads, 1, d]`` (fp32)."""
    layer = method.new_layer(layer_idx, geometry)
    layer.update(k[:, :, :-1], v[:, :, :-1])
    k_read, v_read = layer.update(k[:, :, -1:], v[:, :, -1:])
    if hasattr(layer, "aligned_read"):  # a reader decides what it loads from the query
        k_read, v_read, _, _ = layer.aligned_read(q, None, scaling)
    groups = q.shape[1] // k.shape[1]
    qk_full = q @ _expand(k.half().float(), groups).transpose(-1, -2) * scaling
    qk_read = q @ _expand(k_read.float(), groups).transpose(-1, -2) * scaling
    scores = torch.softmax(qk_full, dim=-1)
    return {
        "qk_full": qk_full,
        "qk_read": qk_read,
        "sv_full": scores @ _expand(v.half().float(), groups),
        "sv_read": scores @ _expand(v_read.float(), groups),
    }


def relative_error_buckets(full: torch.Tensor, read: torch.Tensor) -> dict[str, float]:
    """Share of elements whose relative error ``|read − full| / |full|`` falls in each of ``BUCKETS``."""
    err = (read.double() - full.double()).abs()
    rel = torch.where(full == 0, torch.where(err == 0, 0.0, float("inf")), err / full.double().abs())
    edges = [(rel == 0), (rel > 0) & (rel <= 1e-4), (rel > 1e-4) & (rel <= 1e-3), (rel > 1e-3) & (rel <= 1e-2)]
    shares = [m.double().mean().item() for m in edges]
    return dict(zip(BUCKETS, [*shares, (rel > 1e-2).double().mean().item()], strict=True))


def relative_error_table(model, ids: torch.Tensor, methods: dict[str, object]) -> dict[str, dict[str, dict]]:
    """For each named method: bucket shares of ``QKᵀ`` and ``SV`` over all layers of one decode step."""
    geometry = KVGeometry.of(model.config)
    inputs = decode_step_inputs(model, ids)
    table = {}
    for name, method in methods.items():
        products = [read_products(method, i, geometry, *step) for i, step in enumerate(inputs)]
        table[name] = {
            kind: relative_error_buckets(
                torch.cat([p[f"{kind}_full"].flatten() for p in products]),
                torch.cat([p[f"{kind}_read"].flatten() for p in products]),
            )
            for kind in ("qk", "sv")
        }
    return table
