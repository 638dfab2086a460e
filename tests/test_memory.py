"""``kvquant/analysis/memory.py``: held bytes and a step's allocation peak, measured, on real caches."""

import torch

from kvquant import get_method
from kvquant.analysis.memory import StepPeak, held_bytes
from kvquant.data import tinystories_pieces
from tests.conftest import require_kernels_cpu


def test_step_peak_counts_what_is_alive_at_once_and_not_what_existed_before():
    before = torch.ones(1000)
    with StepPeak() as p:
        a = torch.ones(1000)  # 4000 bytes
        b = a * 2  # 8000 alive
        del a
        view = b[:10]  # a view costs nothing
        c = torch.ones(2000)  # 4000 + 8000 = 12000 alive
        del b, view, c
        before.add_(1)  # in place on memory from before the block
        kept = torch.zeros(250)  # 1000 bytes left allocated
    assert (p.peak, p.live) == (12000, 1000) and kept.numel() == 250


def test_held_bytes_counts_each_storage_once():
    x = torch.ones(100)
    holder = {"k": [x, x[:5]], "v": (torch.zeros(3, dtype=torch.float16),), "n": 3, "s": "x"}
    assert held_bytes(holder) == 400 + 6


def prefilled(model, tok, method, n: int = 300):
    ids = tok(" ".join(tinystories_pieces()[:30])).input_ids[:n]
    cache = method.new_cache(model)
    with torch.no_grad():
        for start in range(0, n - 1, 64):
            model(input_ids=torch.tensor([ids[start : min(start + 64, n - 1)]]), past_key_values=cache)
    return cache, ids[-1]


def step_peak(model, cache, token) -> int:
    with torch.no_grad(), StepPeak() as peak:
        model(input_ids=torch.tensor([[token]]), past_key_values=cache)
    return peak.peak


def test_a_read_path_that_dequantizes_the_history_shows_in_the_step_peak(stories):
    """KIVI's torch path rebuilds each layer's whole history in fp32 for attention; its C++ kernel reads
    the codes in place. The step peak must tell them apart by at least one layer's fp32 K and V."""
    require_kernels_cpu()
    model, tok = stories
    geometry = model.config
    torch_path = get_method("kivi2", group_size=8, residual=16, backend="torch")
    kernel = get_method("kivi2", group_size=8, residual=16, backend="cpu")
    cache_t, token = prefilled(model, tok, torch_path)
    cache_k, _ = prefilled(model, tok, kernel)
    n = cache_t.get_seq_length() + 1
    layer_fp32 = 2 * 4 * n * geometry.num_key_value_heads * (geometry.hidden_size // geometry.num_attention_heads)
    peak_t, peak_k = step_peak(model, cache_t, token), step_peak(model, cache_k, token)
    assert peak_t - peak_k >= layer_fp32, (peak_t, peak_k, layer_fp32)
    stats = cache_k.stats()
    assert stats["bytes"] <= held_bytes(cache_k) < 2 * stats["bytes"] + (1 << 16)  # codes, scales, window


def test_fp16_holds_its_bytes_plus_growth_slack_only(stories):
    model, tok = stories
    cache, token = prefilled(model, tok, get_method("fp16", backend="torch"))
    step_peak(model, cache, token)
    stored = cache.stats()["bytes"]
    reserved = sum(layer.reserved_bytes() for layer in cache.layers)
    read_buffer = cache.layers[0].buffer.buffer  # the one fp32 working buffer the layers share
    assert held_bytes(cache) == reserved + read_buffer.numel() * 4
    kv_dim = model.config.num_key_value_heads * (model.config.hidden_size // model.config.num_attention_heads)
    assert stored <= reserved < stored + len(cache.layers) * 2 * 256 * 2 * kv_dim * 2  # < 2 blocks of K and V
