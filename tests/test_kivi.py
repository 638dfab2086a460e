import functools
from types import SimpleNamespace

import pytest
import torch
from conftest import assert_follows_fp16
from hypothesis import given, settings
from hypothesis import strategies as st

import kvquant.formats.codes as codes
from kvquant import get_method
from kvquant.cache import KVCache, KVGeometry
from kvquant.errors import InvalidParameterError
from kvquant.methods.kivi import KiviLayer, KiviMethod
from kvquant.methods.window import NonFiniteKVError
from kvquant.quant.integer import dequantize, quantize

pytestmark = pytest.mark.usefixtures("one_thread")


# smollm2_135m's KV shapes: 30 layers, 3 KV heads, head_dim 64
SMOLLM2 = SimpleNamespace(num_hidden_layers=30, head_dim=64, hidden_size=576, num_attention_heads=9)


def fake_model(config=SMOLLM2):
    """What ``KVMethod.new_cache`` needs of a model: its config."""
    return SimpleNamespace(config=SimpleNamespace(get_text_config=lambda decoder=True: config))


def fill(method, context: int, layers: int = SMOLLM2.num_hidden_layers, seed: int = 0) -> KVCache:
    """A cache for smollm2's shapes that has received ``context`` random tokens per layer, in one update."""
    gen = torch.Generator().manual_seed(seed)
    cache = method.new_cache(fake_model())
    for i in range(layers):
        cache.update(torch.randn(1, 3, context, 64, generator=gen), torch.randn(1, 3, context, 64, generator=gen), i)
    return cache


@functools.lru_cache(maxsize=1)
@functools.lru_cache(maxsize=1)
def real_kv(model, tokenizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K/V smollm2_135m writes for the first 2,048 WikiText-2 test tokens (shared with test_gear; captured
    once per worker: readers must not write into them)."""
    from kvquant.analysis.capture import capture_kv
    from kvquant.data import wikitext2_test

    ids = torch.tensor(tokenizer(wikitext2_test()[:40_000]).input_ids[:2048])
    assert ids.numel() == 2048
    return capture_kv(model, ids)


@functools.lru_cache(maxsize=8)
def real_error(model, tokenizer, name: str) -> float:
    """``relative_error`` of a method on ``real_kv`` (cached: test_gear compares with kivi2 too)."""
    return relative_error(name, real_kv(model, tokenizer))


def relative_error(name: str, kv, **params) -> float:
    """‖(K̂, V̂) − (K, V)‖ / ‖(K, V)‖ (Frobenius, over all layers) for the tensors a cache returns."""
    cache = get_method(name, **params).new_cache(fake_model())
    err = ref = 0.0
    for i, (k, v) in enumerate(kv):
        out_k, out_v = cache.update(k, v, i)
        err += float((out_k - k).pow(2).sum() + (out_v - v).pow(2).sum())
        ref += float(k.pow(2).sum() + v.pow(2).sum())
    return (err / ref) ** 0.5


def kivi_layer(bits: int = 2, group_size: int = 32, residual: int = 128) -> KiviLayer:
    """A lone KIVI layer (the method's parameter object is all it takes)."""
    return KiviLayer(0, KiviMethod(bits, group_size, residual))


def held(layer: KiviLayer) -> list[torch.Tensor]:
    return [t.clone() for t in layer.stored_k() + layer.stored_v()]


# --- parameters and bad input -------------------------------------------------------------------


def test_presets_are_registry_names_and_record_their_parameters():
    assert get_method("kivi2").describe() == {
        "name": "kivi2",
        "bits": 2,
        "group_size": None,
        "residual": 128,
        "backend": "auto",
    }
    assert get_method("kivi4").bits == 4
    assert get_method("kivi", bits=8, residual=64).params() == {
        "bits": 8,
        "group_size": None,
        "residual": 64,
        "backend": "auto",
    }
    assert get_method("kivi4").with_params(bits=8).name == "kivi4"


@pytest.mark.parametrize(
    "params,message",
    [
        ({"bits": 3}, "bits must be one of 2, 4, 8, got 3"),
        ({"residual": 100}, "residual (100) must be a positive multiple of group_size (32)"),
        ({"residual": 16, "group_size": 32}, "residual (16) must be a positive multiple of group_size (32)"),
        ({"residual": 0}, "positive multiple of group_size"),
        ({"group_size": 0}, "group_size must be >= 1"),
    ],
)
def test_bad_parameters_are_one_line_errors(params, message):
    with pytest.raises(
        InvalidParameterError, match="^method kivi: .*" + message.replace("(", r"\(").replace(")", r"\)")
    ) as e:
        get_method("kivi2", **params)
    assert "\n" not in str(e.value)


def test_explicit_group_size_must_divide_the_head_dim_and_the_default_adapts(stories):
    model, _ = stories  # head_dim 8
    with pytest.raises(InvalidParameterError, match="group_size 32 does not divide the model's head_dim 8") as e:
        get_method("kivi2", group_size=32).new_cache(model)
    assert "\n" not in str(e.value)
    assert get_method("kivi2", group_size=8).new_cache(model).adaptations == {}
    cache = get_method("kivi2").new_cache(model)
    assert cache.adaptations == {"group_size": [32, 8]} and cache.layers[0].group_size == 8
    assert get_method("kivi2").group_size is None


def test_non_finite_kv_names_the_layer():
    cache = get_method("kivi2").new_cache(fake_model())
    k = torch.randn(1, 3, 4, 64)
    cache.update(k, k, 0)
    bad = k.clone()
    bad[0, 1, 2, 3] = float("nan")
    with pytest.raises(NonFiniteKVError, match="kivi2: layer 7 received non-finite values"):
        cache.update(k, bad, 7)
    bad[0, 1, 2, 3] = float("inf")
    with pytest.raises(NonFiniteKVError, match="layer 3 received non-finite keys"):
        cache.update(bad, k, 3)
    bad[0, 1, 2, 3] = 7e4  # finite, but no fp16 window or scale holds it
    with pytest.raises(NonFiniteKVError, match="layer 4 received .* keys beyond fp16's ±65504"):
        cache.update(bad, k, 4)
    cache.update(torch.full_like(k, 65504.0), k, 5)  # fp16's own extreme is fine


# --- layout, flush rules, incrementality ----------------------------------------------------------


def test_windows_and_quantized_lengths_follow_the_flush_rules():
    layer = kivi_layer(bits=2, group_size=4, residual=8)
    for n in range(1, 40):
        x = torch.randn(1, 2, 1, 8)
        out_k, out_v = layer.update(x, x)
        keys_fp16 = n if n <= 8 else (n - 1) % 8 + 1
        assert layer.k_stream.window.shape[2] == keys_fp16 and layer.k_stream.store.length == n - keys_fp16
        assert layer.k_stream.store.length % 8 == 0  # keys leave in whole blocks of `residual`
        assert layer.v_stream.window.shape[2] == min(n, 8) and layer.v_stream.store.length == n - min(n, 8)
        assert out_k.shape == out_v.shape == (1, 2, n, 8) and layer.get_seq_length() == n
        # the window is returned as stored (fp16-rounded), the newest token always among it
        assert torch.equal(out_k[:, :, -1:], x.half().float()) and torch.equal(out_v[:, :, -1:], x.half().float())


def test_decode_quantizes_only_what_leaves_the_window(monkeypatch):
    calls = []

    def counting(x, bits, axis, group_size, mask=None, checked=False):
        calls.append((axis, x.shape[2]))
        return quantize(x, bits, axis, group_size, mask, checked)

    monkeypatch.setattr(codes, "quantize", counting)
    layer = kivi_layer(bits=2, group_size=8, residual=32)
    layer.update(torch.randn(1, 3, 75, 16), torch.randn(1, 3, 75, 16))
    assert sorted(calls) == [(2, 64), (3, 43)]  # prefill: two whole key blocks; values beyond the window
    for n in range(76, 180):
        before = held(layer)
        calls.clear()
        x = torch.randn(1, 3, 1, 16)
        layer.update(x, x)
        key_flush = [(2, 32)] if (n - 1) % 32 == 0 else []
        assert sorted(calls) == key_flush + [(3, 1)], n  # one value token; keys only at a block boundary
        # nothing held before was re-quantized: old codes, scales and zeros are a bit-identical prefix
        qk, qv = layer.k_stream.store.q, layer.v_stream.store.q
        for old, new in zip(before[1:4] + before[-3:], qk.tensors() + qv.tensors(), strict=True):
            assert torch.equal(new.narrow(2, 0, old.shape[2]), old)


@settings(max_examples=25, deadline=None)
@given(chunks=st.lists(st.integers(1, 40), min_size=1, max_size=8), bits=st.sampled_from([2, 4, 8]))
def test_codes_do_not_depend_on_how_the_sequence_was_chunked(chunks, bits):
    gen = torch.Generator().manual_seed(sum(chunks))
    k = torch.randn(2, 2, sum(chunks), 16, generator=gen)
    v = torch.randn(2, 2, sum(chunks), 16, generator=gen)
    whole, pieces = kivi_layer(bits, 8, 16), kivi_layer(bits, 8, 16)
    ref = whole.update(k, v)
    start = 0
    for n in chunks:
        out = pieces.update(k[:, :, start : start + n], v[:, :, start : start + n])
        start += n
    assert all(torch.equal(a, b) for a, b in zip(held(whole), held(pieces), strict=True))
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    # measured bits equal the analytic figure at this length, whatever the chunking
    method = KiviMethod(bits, 8, 16)
    counts = pieces.counts()
    assert 8 * (counts.bytes_k + counts.bytes_v) / (counts.elements_k + counts.elements_v) == pytest.approx(
        method.analytic_bits(context=sum(chunks)), rel=1e-12
    )


def test_returned_history_is_the_dequantized_store_then_the_window():
    layer = kivi_layer(bits=2, group_size=32, residual=128)
    k, v = torch.randn(1, 3, 500, 64) * 3, torch.randn(1, 3, 500, 64)
    out_k, out_v = layer.update(k, v)
    qk, qv = layer.k_stream.store.q, layer.v_stream.store.q
    assert qk.shape[2] == 384 and qv.shape[2] == 372
    assert torch.equal(out_k[:, :, :384], dequantize(qk)) and torch.equal(
        out_k[:, :, 384:], k[:, :, 384:].half().float()
    )
    assert torch.equal(out_v[:, :, :372], dequantize(qv)) and torch.equal(
        out_v[:, :, 372:], v[:, :, 372:].half().float()
    )
    # keys per channel in groups of 32 tokens, values per token in groups of 32 channels
    assert qk.scale.shape == (1, 3, 12, 1, 64) and qv.scale.shape == (1, 3, 372, 2, 1)
    assert qk.codes.dtype == torch.uint8 and qk.codes.shape == (1, 3, 384, 16)
    half = layer.update(k[:, :, :1].half(), v[:, :, :1].half())
    assert half[0].dtype == torch.float16


def test_reads_count_every_byte_held_and_the_window_at_16_bits():
    cache = fill(get_method("kivi2"), 1000, layers=2)
    stats = cache.stats()
    # one update per layer: each read everything it then held
    assert stats["bits_read"] == pytest.approx(stats["bits_stored"], rel=1e-12)
    assert set(stats["widths_k"]) == {3, 16} and stats["widths_k"][16] == pytest.approx((1000 - 896) / 1000)
    assert stats["widths_v"][16] == pytest.approx(128 / 1000)


def test_a_decode_step_codes_in_place_and_the_slack_stays_under_two_blocks():
    """A value leaving the window is written into the store's buffers, not appended by copying the coded
    history (``RowBuffer``): the held codes, scales and zeros are views of buffers whose room beyond them is
    under two blocks, and a step that fits keeps every buffer where it was."""
    layer = kivi_layer(bits=4, group_size=8, residual=16)
    k = torch.randn(2, 3, 40, 16).half()
    layer.update(k, k)
    for _ in range(20):
        layer.update(k[:, :, :1], k[:, :, :1])
    stores = (layer.k_stream.store, layer.v_stream.store)
    for store in stores:
        for rows, t in zip(store.rows, store.q.tensors(), strict=True):
            assert t.data_ptr() == rows.buffer.data_ptr() and t.shape[2] == rows.rows
            assert 0 < rows.buffer.shape[2] - rows.rows < 2 * rows.block
    before = [rows.buffer.data_ptr() for store in stores for rows in store.rows]
    layer.update(k[:, :, :1], k[:, :, :1])
    assert layer.v_stream.store.length == 60 - 16 + 1
    assert [rows.buffer.data_ptr() for store in stores for rows in store.rows] == before


def test_batch_reorder_and_reset():
    layer = kivi_layer(bits=4, group_size=8, residual=16)
    k, v = torch.randn(2, 3, 50, 16), torch.randn(2, 3, 50, 16)
    out_k, out_v = layer.update(k, v)
    layer.reorder_cache(torch.tensor([1, 0]))
    x = torch.randn(2, 3, 1, 16)
    new_k, new_v = layer.update(x, x)
    assert torch.equal(new_k[:, :, :50], out_k.flip(0))
    # value 34 has just left the window (quantized now); the rest is as before, batch rows swapped
    keep = [i for i in range(50) if i != 34]
    assert torch.equal(new_v[:, :, keep], out_v.flip(0)[:, :, keep])
    layer.batch_repeat_interleave(2)
    assert layer.update(x.repeat_interleave(2, 0), x.repeat_interleave(2, 0))[0].shape == (4, 3, 52, 16)
    layer.reset()
    assert layer.get_seq_length() == 0 and layer.counts().bytes_k == 0
    assert torch.equal(layer.update(k, v)[0], out_k)


# --- memory at 4K on smollm2 shapes ------------------------------------------------------------------


@pytest.mark.parametrize("name,ceiling", [("kivi2", 3.6), ("kivi4", 5.6)])
def test_bits_stored_at_4k_on_smollm2_shapes(name, ceiling):
    method = get_method(name)
    stats = fill(method, 4096).stats()
    analytic = method.analytic_bits(context=4096)
    print(f"{name}: measured {stats['bits_stored']:.4f} bits/element, analytic {analytic:.4f} at 4096 tokens")
    assert stats["bits_stored"] <= ceiling
    assert stats["bits_stored"] == pytest.approx(analytic, rel=0.05)
    assert stats["bytes"] < stats["bytes_fp16"] and stats["elements"] == 2 * 30 * 3 * 4096 * 64
    assert method.analytic_bits() == method.bits + 1.0  # 32 bits of scale+zero per group of 32


# --- real K/V from smollm2_135m -----------------------------------------------------------------------


@pytest.mark.slow
def test_errors_on_real_kv(smollm2):
    kv = real_kv(*smollm2)
    e2, e4 = real_error(*smollm2, "kivi2"), real_error(*smollm2, "kivi4")
    num = {axis: 0.0 for axis in (2, 3)}
    ref = 0.0
    for k, _ in kv:
        k16 = k.half().float()
        ref += float(k16.pow(2).sum())
        for axis in num:
            num[axis] += float((dequantize(quantize(k16, 2, axis, 32)) - k16).pow(2).sum())
    per_channel, per_token = (num[2] / ref) ** 0.5, (num[3] / ref) ** 0.5
    print(f"kivi2 {e2:.4f} kivi4 {e4:.4f}; 2-bit keys per channel {per_channel:.4f} per token {per_token:.4f}")
    assert e4 < e2 < 0.5
    assert per_channel < per_token  # KIVI's finding: key outliers live in channels


# --- generation ---------------------------------------------------------------------------------------


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["kivi2", "kivi4"])
def test_generate_through_the_cache(stories, name):
    model, tok = stories
    ids = tok("Once upon a time", return_tensors="pt").input_ids
    cache = get_method(name, group_size=8, residual=16).new_cache(model)
    out = model.generate(ids, max_new_tokens=32, do_sample=False, past_key_values=cache)
    plain = model.generate(ids, max_new_tokens=32, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert out.shape == plain.sequences.shape and cache.get_seq_length() == out.shape[1] - 1
    stats = cache.stats()
    assert stats["bits_stored"] < 16 and stats["bits_read"] < 16
    assert cache.layers[0].k_stream.store.length == 32  # the generation did run through quantized keys
    if name == "kivi4":  # 4-bit KIVI follows fp16's greedy path on this prompt for 16 tokens
        assert_follows_fp16(model, ids, plain, out, name, group_size=8, residual=16)


# --- beam search and batch reordering (shared with test_gear and test_aquakv) --------------------


def story_prompts(tok, n_prompts: int = 2, n_tokens: int = 150) -> torch.Tensor:
    """``[n_prompts, n_tokens]`` TinyStories prompts, longer than the default fp16 windows (128)."""
    from kvquant.data import tinystories_pieces

    rows = []
    for i in range(n_prompts):
        text = "\n\n".join(tinystories_pieces()[12 * i : 12 * i + 12])
        rows.append(tok(text, return_tensors="pt").input_ids[0][:n_tokens])
    assert all(r.numel() == n_tokens for r in rows)
    return torch.stack(rows)


def beam_search_runs(model, tok, method) -> None:
    """``generate`` with 3 beams and 2 returned sequences per prompt, through ``method``'s cache."""
    ids = story_prompts(tok)
    cache = method.new_cache(model)
    out = model.generate(
        ids, num_beams=3, num_return_sequences=2, max_new_tokens=12, do_sample=False, past_key_values=cache
    )
    assert out.shape == (2 * ids.shape[0], ids.shape[1] + 12)
    assert cache.get_seq_length() == out.shape[1] - 1 and cache.stats()["bytes"] > 0


def stored(cache) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in layer.stored_k() + layer.stored_v() if t is not None]


def check_selection_equals_rebuild(model, method, prompt: int = 100, decode_steps: int = 5) -> None:
    """``reorder_cache``/``batch_select_indices`` leave exactly the cache built from the selected rows
    (every stored tensor equal), and the next update through either returns the same history.

    K/V are random, fed layer by layer as a forward would (a prefill, then one-token steps): the
    model's own forward is not bit-identical across batch compositions on CPU, the cache must be.
    """
    geometry = KVGeometry.of(model.config)
    gen = torch.Generator().manual_seed(0)
    shape = (3, geometry.n_kv_heads, prompt + decode_steps + 1, geometry.head_dim)
    kv = [(2 * torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(geometry.n_layers)]

    def feed(cache, rows, start, stop):
        return [cache.update(k[rows, :, start:stop], v[rows, :, start:stop], i) for i, (k, v) in enumerate(kv)]

    def fill(rows):
        cache = method.new_cache(model)
        feed(cache, rows, 0, prompt)
        for t in range(prompt, prompt + decode_steps):
            feed(cache, rows, t, t + 1)
        return cache

    idx = torch.tensor([2, 0, 0])
    rebuilt = fill(idx)
    end = prompt + decode_steps
    want_next = feed(fill(idx), idx, end, end + 1)
    for select in ("reorder_cache", "batch_select_indices"):
        cache = fill(torch.arange(3))
        getattr(cache, select)(idx)
        assert cache.get_seq_length() == rebuilt.get_seq_length()
        got, want = stored(cache), stored(rebuilt)
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), select
        # What is stored is equal bit for bit; what an update returns is rebuilt from it by batched
        # matmuls (GEAR's A·Bᵀ, r ≤ 4 terms), which a BLAS may sum in another order for another batch
        # shape (seen under MKL_CBWR=COMPATIBLE): equal up to a few fp32 ulps of the values (|x| < 8).
        for (a_k, a_v), (b_k, b_v) in zip(feed(cache, idx, end, end + 1), want_next, strict=True):
            torch.testing.assert_close(a_k, b_k, rtol=0, atol=8 * 8 * 2**-23, msg=select)
            torch.testing.assert_close(a_v, b_v, rtol=0, atol=8 * 8 * 2**-23, msg=select)


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["kivi", "kivi2", "kivi4"])
def test_beam_search_with_default_parameters(stories, name):
    beam_search_runs(*stories, get_method(name))


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["kivi2", "kivi4"])
def test_batch_selection_equals_the_cache_of_the_selected_rows(stories, name):
    check_selection_equals_rebuild(stories[0], get_method(name, residual=32, backend="torch"))


def test_repeat_interleave_and_offload_map_every_tensor():
    layer = kivi_layer(bits=2, group_size=8, residual=16)
    k = torch.randn(2, 3, 50, 16)
    layer.update(k, k)
    before = held(layer)
    layer.batch_repeat_interleave(2)
    assert all(torch.equal(a, b.repeat_interleave(2, 0)) for a, b in zip(held(layer), before, strict=True))
    layer.offload()
    layer.prefetch()
    assert all(t.device == k.device for t in held(layer))


@pytest.mark.parametrize("name", ["kivi2", "gear2", "gear_l2"])
def test_crop_takes_back_the_window_and_is_one_line_beyond(name):
    from kvquant.cache import CropError

    cache = get_method(name, group_size=8, residual=16).new_cache(fake_model())
    cache.crop(-3)  # nothing held yet: nothing to refuse
    cache.update(torch.randn(1, 3, 40, 64), torch.randn(1, 3, 40, 64), 0)
    cache.crop(-3)  # keys leave in blocks of 16: the key window holds the newest 8, the value window 16
    assert cache.get_seq_length() == 37 and cache.layers[0].state.newest_fp16() == 5
    with pytest.raises(CropError, match="only 5 are still held in the fp16 window") as e:
        cache.crop(-6)
    assert "\n" not in str(e.value) and cache.get_seq_length() == 37


@pytest.mark.parametrize("chunks", [(150, 1, 1, 1), (40, 40, 40, 30, 1, 1), (20,) * 8])
def test_a_sliding_layer_returns_the_full_layers_tail_and_holds_only_its_window(chunks):
    """A sliding KIVI layer (window 32) hands attention the newest ``window − 1`` tokens plus the new
    ones, bit for bit what a full layer returns there (codes are per group, so compressing the tokens
    that leave the window apart changes none), and keeps at most ``window − 1`` values and
    ``window − 1 + group − 1`` keys."""
    method, window = KiviMethod(bits=2, group_size=8, residual=16), 32
    full, sliding = KiviLayer(0, method, 8), KiviLayer(0, method, 8, window=window)
    gen = torch.Generator().manual_seed(0)
    seen = 0
    for n in chunks:
        k, v = torch.randn(1, 2, n, 16, generator=gen), torch.randn(1, 2, n, 16, generator=gen)
        length, offset = sliding.get_mask_sizes(n)
        (fk, fv), (sk, sv) = full.update(k, v), sliding.update(k, v)
        seen += n
        assert sk.shape[2] == sv.shape[2] == length and offset == max(0, seen - n - window + 1)
        assert torch.equal(sk, fk[:, :, offset:]) and torch.equal(sv, fv[:, :, offset:])
        assert sliding.get_seq_length() == full.get_seq_length() == seen
        assert sliding.v_stream.length == min(seen, window - 1)
        assert min(seen, window - 1) <= sliding.k_stream.length <= window - 1 + 8 - 1
