import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvquant import get_method
from kvquant.cache import CropError
from kvquant.methods.fp16 import Fp16Layer


def test_generate_with_fp16_cache_matches_plain_generate(stories):
    model, tok = stories
    ids = tok("Once upon a time", return_tensors="pt").input_ids
    cache = get_method("fp16").new_cache(model)
    with_cache = model.generate(ids, max_new_tokens=40, do_sample=False, past_key_values=cache)
    plain = model.generate(ids, max_new_tokens=40, do_sample=False)
    assert torch.equal(with_cache, plain)
    stats = cache.stats()
    # 5 layers × 4 KV heads × 8 dims × (44 cached tokens) × (K and V)
    assert stats["elements"] == 5 * 4 * 8 * 44 * 2
    assert stats["bytes"] == 2 * stats["elements"]
    assert stats["bits_stored"] == stats["bits_read"] == 16.0


@settings(max_examples=40, deadline=None)
@given(
    chunks=st.lists(st.integers(1, 9), min_size=1, max_size=5),
    heads=st.integers(1, 3),
    dim=st.sampled_from([2, 8, 16]),
    seed=st.integers(0, 2**16),
)
def test_fp16_layer_stores_half_and_returns_rounded_history(chunks, heads, dim, seed):
    gen = torch.Generator().manual_seed(seed)
    layer = Fp16Layer()
    ks, vs = [], []
    for n in chunks:
        k = torch.randn(1, heads, n, dim, generator=gen) * 100
        v = torch.randn(1, heads, n, dim, generator=gen)
        ks.append(k)
        vs.append(v)
        out_k, out_v = layer.update(k, v)
        assert out_k.dtype == torch.float32
    assert layer.keys.dtype == torch.float16 and layer.values.dtype == torch.float16
    assert torch.equal(out_k, torch.cat(ks, -2).half().float())
    assert torch.equal(out_v, torch.cat(vs, -2).half().float())
    counts = layer.counts()
    total = heads * dim * sum(chunks)
    assert counts.elements_k == counts.elements_v == total
    assert counts.bytes_k == counts.bytes_v == 2 * total
    # every update reads the whole history at 16 bits
    read = heads * dim * sum(sum(chunks[: i + 1]) for i in range(len(chunks)))
    assert counts.read_k == {16: read} and counts.read_v == {16: read}


def test_fp16_reports_analytic_bits_and_its_backend():
    method = get_method("fp16")
    assert method.analytic_bits() == 16.0 and method.describe() == {"name": "fp16", "backend": "torch"}


@settings(max_examples=40, deadline=None)
@given(
    chunks=st.lists(st.integers(1, 12), min_size=1, max_size=6),
    window=st.integers(2, 20),  # 1: transformers keeps everything (its slice is [-0:])
    seed=st.integers(0, 2**16),
)
def test_sliding_layer_behaves_as_transformers_sliding_layer(chunks, window, seed):
    """Same K/V handed to attention, same mask sizes and length as ``DynamicSlidingWindowLayer``
    (fed the same fp16-rounded states); between steps only the newest ``window − 1`` tokens are held."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    gen = torch.Generator().manual_seed(seed)
    ours, theirs = Fp16Layer(window=window), DynamicSlidingWindowLayer(sliding_window=window)
    assert ours.is_sliding and ours.get_max_length() == window
    for n in chunks:
        assert ours.get_mask_sizes(n) == theirs.get_mask_sizes(n)
        k, v = torch.randn(1, 2, n, 4, generator=gen), torch.randn(1, 2, n, 4, generator=gen)
        got, want = ours.update(k, v), theirs.update(k.half().float(), v.half().float())
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert ours.get_seq_length() == theirs.get_seq_length()
        assert ours.keys.shape[-2] == min(ours.get_seq_length(), window - 1) and ours.keys.is_contiguous()
        assert ours.counts().bytes_k == ours.keys.untyped_storage().nbytes()  # no view of a longer tensor


def test_sliding_layer_crops_until_its_window_fills():
    layer = Fp16Layer(window=8)
    layer.update(torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4))
    layer.crop(-2)
    assert layer.get_seq_length() == 3 and layer.keys.shape[-2] == 3
    layer.update(torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4))
    with pytest.raises(CropError, match="layer None: a sliding-window layer keeps only its window"):
        layer.crop(-1)
