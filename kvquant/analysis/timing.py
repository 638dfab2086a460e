"""Time of the KV part of one decode step: store the new token, read what attention needs, attend.

Every method starts from its own store holding ``context − 1`` tokens (built untimed) and is timed
on ``update`` of the last token plus attention (transformers' SDPA on what ``update`` returned, or
the reader's ``attend``), so each is charged for its own reads. Medians over repeats after warm-up.
"""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvquant.attention import READER_ATTR
from kvquant.cache import KVGeometry

SHAPES = {  # name: (query heads, KV heads, head_dim)
    "smollm2_135m": (9, 3, 64),
    "llama2_7b": (32, 32, 128),
    "llama3.1_8b": (32, 8, 128),
}


def _bits(counts) -> tuple[float, int]:
    n = sum(counts.read_k.values()) + sum(counts.read_v.values())
    bits = sum(w * c for w, c in (counts.read_k + counts.read_v).items()) + counts.meta_bits_k + counts.meta_bits_v
    return bits, n


def decode_step_time(method, shape: str, context: int, repeats: int = 5, warmup: int = 2, seed: int = 0):
    """``(median seconds, bits read per element)`` of one decode step's KV work at ``context`` tokens."""
    hq, hkv, d = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(1, hkv, context, d, generator=gen)
    v = torch.randn(1, hkv, context, d, generator=gen)
    q = torch.randn(1, hq, 1, d, generator=gen)
    geometry = KVGeometry(n_layers=1, n_heads=hq, n_kv_heads=hkv, head_dim=d)
    module = SimpleNamespace(num_key_value_groups=hq // hkv, is_causal=True, training=False)
    scaling = d**-0.5
    times, bits_read = [], float("nan")
    for i in range(warmup + repeats):
        layer = method.new_layer(0, geometry)
        layer.update(k[:, :, :-1], v[:, :, :-1])
        before = _bits(layer.counts())
        start = time.perf_counter()
        keys, values = layer.update(k[:, :, -1:], v[:, :, -1:])
        reader = getattr(keys, READER_ATTR, None)  # a layer that reads inside attention
        if reader is not None:
            reader.attend(module, q, None, scaling=scaling)
        else:
            sdpa_attention_forward(module, q, keys, values, None, scaling=scaling)
        elapsed = time.perf_counter() - start
        if i >= warmup:
            times.append(elapsed)
        after = _bits(layer.counts())
        bits_read = (after[0] - before[0]) / max(after[1] - before[1], 1)
    return statistics.median(times), bits_read
