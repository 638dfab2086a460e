"""Capture the real K/V (and the last query-side inputs) a model writes into its cache."""

from __future__ import annotations

import torch
from transformers import DynamicCache


@torch.no_grad()
def capture_kv(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run ``ids`` (1-D or ``[batch, seq]``) through ``model`` and return each layer's ``(K, V)``.

    Tensors are ``[batch, kv_heads, seq, head_dim]`` in the model's dtype, keys after RoPE, exactly
    what a cache layer receives.
    """
    ids = ids.view(1, -1) if ids.dim() == 1 else ids
    cache = DynamicCache()
    model(input_ids=ids.to(model.device), past_key_values=cache, use_cache=True, logits_to_keep=1)  # no [seq, vocab]
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
