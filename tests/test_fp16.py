import copy
from collections import Counter

import pytest
import torch
from conftest import require_kernels_cpu
from hypothesis import given, settings
from hypothesis import strategies as st

from kvquant import get_method
from kvquant.backends import get_backend
from kvquant.cache import CropError, KVCache
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
    assert method.analytic_bits() == 16.0 and method.describe() == {"name": "fp16", "backend": "auto"}


@settings(max_examples=40, deadline=None)
@given(
    chunks=st.lists(st.integers(1, 12), min_size=1, max_size=12),
    window=st.integers(2, 20),  # 1: transformers keeps everything (its slice is [-0:])
    block=st.sampled_from([1, 2, 3, 256]),
    seed=st.integers(0, 2**16),
)
def test_sliding_layer_behaves_as_transformers_sliding_layer(chunks, window, block, seed):
    """Same K/V handed to attention, same mask sizes and length as ``DynamicSlidingWindowLayer``
    (fed the same fp16-rounded states); between steps only the newest ``window − 1`` tokens are held."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    gen = torch.Generator().manual_seed(seed)
    ours, theirs = Fp16Layer(window=window, block=block), DynamicSlidingWindowLayer(sliding_window=window)
    assert ours.is_sliding and ours.get_max_length() == window
    for n in chunks:
        assert ours.get_mask_sizes(n) == theirs.get_mask_sizes(n)
        k, v = torch.randn(1, 2, n, 4, generator=gen), torch.randn(1, 2, n, 4, generator=gen)
        got, want = ours.update(k, v), theirs.update(k.half().float(), v.half().float())
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert ours.get_seq_length() == theirs.get_seq_length()
        held = min(ours.get_seq_length(), window - 1)
        assert ours.keys.shape[-2] == held and ours.counts().bytes_k == 2 * 2 * held * 4


def test_sliding_layer_crops_until_its_window_fills():
    layer = Fp16Layer(window=8)
    layer.update(torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4))
    layer.crop(-2)
    assert layer.get_seq_length() == 3 and layer.keys.shape[-2] == 3
    layer.update(torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4))
    with pytest.raises(CropError, match="layer None: a sliding-window layer keeps only its window"):
        layer.crop(-1)


# --- the store: one buffer per K and V, appended in place ------------------------------------------


def kv(n, batch=1, heads=2, dim=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, n, dim, generator=gen), torch.randn(batch, heads, n, dim, generator=gen)


def capacity_tokens(layer):
    return layer.state.buffers[0].shape[-2]


def test_decode_appends_in_place_until_the_block_fills():
    """Prefill 5 with block 8: capacity 5 + 7 rounded up to 8s = 16; 11 decode steps write into it,
    the 12th moves the 16 tokens into a buffer of 17 + 7 → 24."""
    layer = Fp16Layer(block=8)
    k, v = kv(5)
    layer.update(k, v)
    assert capacity_tokens(layer) == 16 and layer.reserved_bytes() == 2 * (1 * 2 * 16 * 4) * 2
    ptr, ks = layer.state.buffers[0].data_ptr(), [k]
    for i in range(11):
        k1, v1 = kv(1, seed=i + 1)
        out_k, _ = layer.update(k1.half(), v1.half())  # fp16 compute: attention gets the view itself
        ks.append(k1)
        assert layer.state.buffers[0].data_ptr() == ptr and out_k.data_ptr() == ptr and layer.keys.data_ptr() == ptr
        assert out_k.shape[-2] == 6 + i
    assert capacity_tokens(layer) == layer.get_seq_length() == 16
    k1, v1 = kv(1, seed=99)
    layer.update(k1, v1)
    ks.append(k1)
    assert layer.state.buffers[0].data_ptr() != ptr and capacity_tokens(layer) == 24
    assert torch.equal(layer.keys, torch.cat(ks, -2).half())


@settings(max_examples=60, deadline=None)
@given(
    chunks=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    block=st.sampled_from([1, 4, 16, 256]),
    batch=st.integers(1, 2),
    seed=st.integers(0, 2**16),
)
def test_store_equals_a_concatenation_and_reserves_under_two_blocks(chunks, block, batch, seed):
    layer, ks, vs, moves, ptr = Fp16Layer(block=block), [], [], 0, None
    for i, n in enumerate(chunks):
        k, v = kv(n, batch, seed=seed + i)
        ks.append(k)
        vs.append(v)
        out_k, out_v = layer.update(k, v)
        used = sum(chunks[: i + 1])
        want_k, want_v = torch.cat(ks, -2).half(), torch.cat(vs, -2).half()
        assert torch.equal(out_k, want_k.float()) and torch.equal(layer.keys, want_k)
        assert torch.equal(out_v, want_v.float()) and torch.equal(layer.values, want_v)
        cap = capacity_tokens(layer)
        assert used <= cap < used + 2 * block  # the slack: under two blocks
        assert layer.reserved_bytes() == 2 * 2 * (batch * 2 * cap * 4)
        moves += layer.state.buffers[0].data_ptr() != ptr
        ptr = layer.state.buffers[0].data_ptr()
        stats = layer.counts().summary()
        assert stats["bits_stored"] == 16.0 and stats["bytes"] == 2 * 2 * batch * 2 * used * 4
    # a move happens only when a chunk does not fit, and leaves at least a block free
    assert moves <= 1 + sum(chunks) // block


def test_decoding_moves_once_per_block():
    """Capacity 128 after a 100-token prompt (100 + 15 rounded up to 16s), then 144, 160, ..., 400:
    one move per 16 decode steps (a move allocates before it frees, so consecutive addresses differ)."""
    layer = Fp16Layer(block=16)
    layer.update(*kv(100))
    caps, ptrs = Counter(), [layer.state.buffers[0].data_ptr()]
    for i in range(300):
        layer.update(*kv(1, seed=i))
        caps[capacity_tokens(layer)] += 1
        ptrs.append(layer.state.buffers[0].data_ptr())
    assert caps == {128: 28, **{c: 16 for c in range(144, 401, 16)}} and layer.get_seq_length() == 400
    assert sum(a != b for a, b in zip(ptrs, ptrs[1:], strict=False)) == 17


def test_sliding_layer_keeps_its_window_in_a_bounded_buffer():
    """Window 8, block 4: resting capacity 8 + 3 → 12; a 30-token chunk grows it, then it shrinks back;
    decoding moves the 7 held tokens to the front once per 5 steps and attention sees them in order."""
    layer = Fp16Layer(window=8, block=4)
    k, v = kv(30)
    out_k, _ = layer.update(k, v)
    assert out_k.shape[-2] == 30 and capacity_tokens(layer) == 12 and layer.keys.shape[-2] == 7
    assert torch.equal(layer.keys, k[..., -7:, :].half())
    hist, ptrs = [k], []
    for i in range(20):
        k1, v1 = kv(1, seed=i + 1)
        hist.append(k1)
        out_k, _ = layer.update(k1, v1)
        assert torch.equal(out_k, torch.cat(hist, -2)[..., -8:, :].half().float())
        assert capacity_tokens(layer) == 12 and layer.keys.shape[-2] == 7
        ptrs.append(layer.state.buffers[0].data_ptr())
    assert sum(a != b for a, b in zip(ptrs, ptrs[1:], strict=False)) == 3  # steps 6, 11, 16: 5 slots per move
    assert layer.counts().summary()["bits_stored"] == 16.0 and layer.counts().bytes_k == 2 * 2 * 7 * 4
    assert layer.reserved_bytes() == 2 * 2 * (2 * 12 * 4)


def test_crop_then_append_writes_over_the_cropped_tokens():
    layer = Fp16Layer(block=8)
    k, v = kv(10)
    layer.update(k, v)
    ptr = layer.state.buffers[0].data_ptr()
    layer.crop(-4)
    assert layer.get_seq_length() == 6 and torch.equal(layer.keys, k[..., :6, :].half())
    k2, v2 = kv(3, seed=5)
    out_k, out_v = layer.update(k2, v2)
    assert layer.state.buffers[0].data_ptr() == ptr
    assert torch.equal(out_k, torch.cat([k[..., :6, :], k2], -2).half().float())
    assert torch.equal(out_v, torch.cat([v[..., :6, :], v2], -2).half().float())
    layer.crop(4)  # legacy form: the length to keep
    assert layer.get_seq_length() == 4 and layer.counts().bytes_k == 2 * 2 * 4 * 4


def test_batch_maps_keep_the_capacity_and_append_in_place_after():
    """Beam reorder, batch selection and repeat act on the whole buffers (slack included)."""
    layer = Fp16Layer(block=8)
    k, v = kv(5, batch=3)
    layer.update(k, v)
    beam = torch.tensor([2, 0, 0])
    layer.reorder_cache(beam)
    assert capacity_tokens(layer) == 16 and torch.equal(layer.keys, k[beam].half())
    ptr = layer.state.buffers[0].data_ptr()
    k1, v1 = kv(1, batch=3, seed=1)
    out_k, out_v = layer.update(k1, v1)
    assert layer.state.buffers[0].data_ptr() == ptr
    assert torch.equal(out_k, torch.cat([k[beam], k1], -2).half().float())
    assert torch.equal(out_v, torch.cat([v[beam], v1], -2).half().float())
    layer.batch_select_indices(torch.tensor([1]))
    assert layer.keys.shape == (1, 2, 6, 4) and torch.equal(layer.keys, torch.cat([k[:1], k1[1:2]], -2).half())
    layer.batch_repeat_interleave(2)
    assert layer.keys.shape == (2, 2, 6, 4) and capacity_tokens(layer) == 16
    assert torch.equal(layer.keys[0], layer.keys[1]) and layer.counts().bytes_k == 2 * 2 * 2 * 6 * 4


def test_a_deep_copy_owns_its_buffers():
    cache = KVCache([Fp16Layer(block=8), Fp16Layer(block=8, window=4)])
    k, v = kv(5)
    for i in range(2):
        cache.update(k, v, layer_idx=i)
    fork = copy.deepcopy(cache)
    for layer, copied in zip(cache.layers, fork.layers, strict=True):
        assert torch.equal(copied.keys, layer.keys) and copied.reserved_bytes() == layer.reserved_bytes()
        assert copied.keys.untyped_storage().data_ptr() == copied.state.buffers[0].data_ptr()  # still a view of it
        assert copied.state.buffers[0].data_ptr() != layer.state.buffers[0].data_ptr()
    k1, v1 = kv(1, seed=1)
    k2, v2 = kv(1, seed=2)
    for i in range(2):
        cache.update(k1, v1, layer_idx=i)
        fork.update(k2, v2, layer_idx=i)
    full, fork_full = cache.layers[0], fork.layers[0]
    assert torch.equal(full.keys, torch.cat([k, k1], -2).half())
    assert torch.equal(fork_full.keys, torch.cat([k, k2], -2).half())
    assert torch.equal(fork.layers[1].keys, torch.cat([k, k2], -2)[..., -3:, :].half())


def test_reset_forgets_the_buffers():
    layer = Fp16Layer(block=8)
    layer.update(*kv(5))
    layer.reset()
    assert layer.reserved_bytes() == 0 and layer.get_seq_length() == 0 and layer.keys is None
    k, v = kv(3, batch=2)
    out_k, _ = layer.update(k, v)
    assert torch.equal(out_k, k.half().float()) and capacity_tokens(layer) == 16


@pytest.mark.parametrize("window", [None, 6])
def test_the_cpu_kernel_reads_the_view_in_place(window):
    """The kernel takes ``[B, H, L, D]`` with any batch/head/token strides (only D contiguous): it gets
    the view of the buffer, not a copy, and gives what it gives on a contiguous copy."""
    require_kernels_cpu()
    from kernels_cpu import ops

    layer = Fp16Layer(backend=get_backend("cpu"), block=8, window=window)
    q = torch.randn(1, 4, 1, 4, generator=torch.Generator().manual_seed(3))
    layer.update(*kv(5))
    for i in range(9):
        layer.update(*kv(1, seed=i + 1))
        keys, values = layer.state.step
        assert keys.data_ptr() >= layer.state.buffers[0].data_ptr() and not keys.is_contiguous()
        want = ops.attend_fp16(q, keys.contiguous(), values.contiguous()).transpose(1, 2)
        got, _ = layer.attend(None, q, None)
        assert torch.equal(got, want)
