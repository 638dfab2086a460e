import pytest
import torch
from conftest import assert_follows_fp16
from test_kivi import (
    beam_search_runs,
    check_selection_equals_rebuild,
    fake_model,
    fill,
    real_error,
)

import kvquant.formats.gear as gear_format
from kvquant import get_method
from kvquant.cache import KVGeometry
from kvquant.errors import InvalidParameterError
from kvquant.formats.gear import low_rank, outlier_count
from kvquant.methods.gear import GearLayer, GearMethod
from kvquant.quant.integer import quantize

SMOLLM2 = KVGeometry(n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64)


pytestmark = pytest.mark.usefixtures("one_thread")


def structured(b: int, h: int, t: int, d: int, seed: int = 0) -> torch.Tensor:
    """K-like data: per-channel offsets and scales, a low-rank component, a few large outliers."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, t, d, generator=gen) * (0.5 + torch.rand(d, generator=gen) * 3)
    x += torch.randn(b, h, t, 2, generator=gen) @ torch.randn(2, d, generator=gen)
    x += torch.randn(d, generator=gen) * 2
    flat = x.view(-1)
    flat[torch.randint(0, flat.numel(), (flat.numel() // 200,), generator=gen)] *= 12
    return x


def gear_layer(**params) -> GearLayer:
    """A lone GEAR layer; its group size resolves from the head dim of the first update (64 for 64)."""
    return GearLayer(0, GearMethod(**params))


def layer_error(layer: GearLayer, x: torch.Tensor) -> float:
    out_k, out_v = layer.update(x, x)
    x16 = x.half().float()
    return float(((out_k - x16).norm() + (out_v - x16).norm()) / (2 * x16.norm()))


def test_presets_and_parameters():
    assert get_method("gear2").describe() == {
        "name": "gear2",
        "bits": 2,
        "group_size": None,
        "residual": 128,
        "outlier_ratio": 0.02,
        "rank": 4,
        "rank_decode": 2,
        "loops": 3,
        "seed": 0,
        "backend": "auto",
    }
    assert get_method("gear4").bits == 4 and get_method("gear_l4").bits == 4
    assert "outlier_ratio" not in get_method("gear_l2").params() and get_method("gear_l2").outlier_ratio == 0.0


@pytest.mark.parametrize(
    "name,params,message",
    [
        ("gear", {"bits": 8}, "bits must be one of 2, 4, got 8"),
        ("gear2", {"residual": 96}, r"residual \(96\) must be a positive multiple of group_size \(64\)"),
        ("gear_l2", {"residual": 96}, r"residual \(96\) must be a positive multiple of group_size \(64\)"),
        ("gear2", {"outlier_ratio": 1.0}, r"outlier_ratio must be in \[0, 1\), got 1.0"),
        ("gear2", {"outlier_ratio": -0.01}, "outlier_ratio must be in"),
        ("gear2", {"rank": -1}, "rank and rank_decode must be >= 0"),
        ("gear_l2", {"rank_decode": -2}, "rank and rank_decode must be >= 0"),
        ("gear2", {"loops": 0}, "loops"),
    ],
)
def test_bad_parameters_are_one_line_errors(name, params, message):
    with pytest.raises(InvalidParameterError, match="^method gear(_l)?: " + message) as e:
        get_method(name, **params)
    assert "\n" not in str(e.value)


def test_group_size_must_divide_the_head_dim_unless_it_is_the_default(stories):
    with pytest.raises(InvalidParameterError, match="group_size 64 does not divide the model's head_dim 8"):
        get_method("gear2", group_size=64).new_cache(stories[0])
    assert get_method("gear2").new_cache(stories[0]).adaptations == {"group_size": [64, 8]}


def test_outliers_are_exact_and_a_fraction_of_each_matrix():
    x = structured(2, 3, 300, 64)
    layer = gear_layer(bits=2, group_size=64, residual=128, outlier_ratio=0.02)
    out_k, _ = layer.update(x, x)
    store = layer.k_stream.store
    t = store.length
    assert t == 256 and store.index.shape == (2, 3, 2 * outlier_count(0.02, 256 * 64)) == (2, 3, 326)
    assert store.index.dtype == torch.int32 and store.value.dtype == torch.float16
    x16 = x.half().float()
    got = out_k[:, :, :t].reshape(2, 3, -1).gather(-1, store.index.long())
    want = x16[:, :, :t].reshape(2, 3, -1).gather(-1, store.index.long())
    assert torch.equal(got, want)
    # they are each matrix's largest and smallest entries
    flat = x16[:, :, :t].reshape(2, 3, -1)
    kth = flat.topk(163, dim=-1).values[..., -1:]
    assert (want[..., :163] >= kth).all()


def test_each_part_lowers_the_error():
    x = structured(1, 3, 512, 64, seed=1)
    base = layer_error(gear_layer(bits=2, outlier_ratio=0.0, rank=0), x)
    sparse = layer_error(gear_layer(bits=2, outlier_ratio=0.02, rank=0), x)
    low = layer_error(gear_layer(bits=2, outlier_ratio=0.0, rank=4), x)
    both = layer_error(gear_layer(bits=2), x)
    assert both < sparse < base and both < low < base


def test_low_rank_is_seeded_and_projects_the_residual():
    r = torch.randn(2, 3, 200, 64)
    a, b = low_rank(r, 4, 3, seed=0)
    a2, b2 = low_rank(r, 4, 3, seed=0)
    assert torch.equal(a, a2) and torch.equal(b, b2)
    assert a.shape == (2, 3, 200, 4) and b.shape == (2, 3, 64, 4)
    assert torch.allclose(a.mT @ a, torch.eye(4).expand(2, 3, 4, 4), atol=1e-5)
    assert (r - a @ b.mT).norm() < r.norm()
    # on an exactly rank-2 matrix, 3 loops recover it
    exact = torch.randn(1, 1, 100, 2) @ torch.randn(1, 1, 2, 64)
    a, b = low_rank(exact, 2, 3, seed=5)
    assert torch.allclose(a @ b.mT, exact, atol=1e-4)


def test_every_held_tensor_owns_exactly_its_bytes():
    layer = gear_layer(bits=2, group_size=8, residual=16)
    x = structured(2, 3, 70, 16)
    layer.update(x, x)
    for i in range(40):
        layer.update(x[:, :, i : i + 1], x[:, :, i : i + 1])
    held = layer.stored_k() + layer.stored_v()
    assert len(held) == 2 * (1 + 3 + 2 + 2 * 2)  # window, codes/scale/zero, outliers, two low-rank runs
    for t in held:
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_constant_input_stays_finite():
    layer = gear_layer(bits=2)
    out_k, out_v = layer.update(torch.full((1, 2, 300, 64), 3.0), torch.zeros(1, 2, 300, 64))
    assert torch.equal(out_k, torch.full_like(out_k, 3.0)) and torch.equal(out_v, torch.zeros_like(out_v))


def test_streaming_compresses_each_block_once(monkeypatch):
    calls = []

    def counting(x, bits, axis, group_size, mask=None, checked=False):
        calls.append((axis, x.shape[2]))
        return quantize(x, bits, axis, group_size, mask, checked)

    monkeypatch.setattr(gear_format, "quantize", counting)
    layer = gear_layer(bits=2, group_size=64, residual=128)
    x = structured(1, 2, 530, 64)
    layer.update(x[:, :, :300], x[:, :, :300])
    assert sorted(calls) == [(2, 256), (3, 256)]  # the prompt: one segment each for K and V
    for n in range(301, 531):
        store = layer.k_stream.store
        before = [t.clone() for t in store.tensors()]
        calls.clear()
        layer.update(x[:, :, n - 1 : n], x[:, :, n - 1 : n])
        flushed = (n - 1) % 128 == 0
        assert sorted(calls) == ([(2, 128), (3, 128)] if flushed else []), n
        # what was stored before is untouched: codes, scales, zeros and outliers are bit-identical prefixes
        for old, new in zip(before[:3], store.q.tensors(), strict=True):
            assert torch.equal(new.narrow(2, 0, old.shape[2]), old)
        for old, new in zip(before[3:5], (store.index, store.value), strict=True):
            assert torch.equal(new[..., : old.shape[-1]], old)
        assert torch.equal(store.runs[0].a, before[5])
    # one rank-4 prefill segment, then decode segments of 128 tokens with rank 2, stacked into one run
    assert [(r.start, r.seg_len, r.a.shape[2], r.a.shape[-1]) for r in store.runs] == [(0, 256, 1, 4), (256, 128, 2, 2)]
    assert store.length == 512 and layer.k_stream.window.shape[2] == 18


@pytest.mark.parametrize("name,ceiling", [("gear2", 5.0), ("gear4", 7.0)])
def test_bits_stored_at_4k_on_smollm2_shapes(name, ceiling):
    method = get_method(name)
    stats = fill(method, 4096).stats()
    analytic = method.analytic_bits(SMOLLM2, context=4096)
    print(f"{name}: measured {stats['bits_stored']:.4f} bits/element, analytic {analytic:.4f} at 4096 tokens")
    assert stats["bits_stored"] == pytest.approx(analytic, rel=0.05)
    assert stats["bits_stored"] <= ceiling and stats["bytes"] < stats["bytes_fp16"]
    assert stats["bits_read"] == pytest.approx(stats["bits_stored"], rel=1e-12)


@pytest.mark.slow
def test_gear2_beats_kivi2_on_real_kv(smollm2):
    errors = {name: real_error(*smollm2, name) for name in ("kivi2", "gear2")}
    print(" ".join(f"{k} {v:.4f}" for k, v in errors.items()))
    assert errors["gear2"] < errors["kivi2"]


@pytest.fixture(scope="module")
def plain_story(stories):
    model, tok = stories
    ids = tok("Once upon a time", return_tensors="pt").input_ids
    return ids, model.generate(
        ids, max_new_tokens=32, do_sample=False, output_logits=True, return_dict_in_generate=True
    )


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["gear2", "gear4", "gear_l2"])
def test_generate_through_the_cache(stories, plain_story, name):
    model, _ = stories
    ids, plain = plain_story
    cache = get_method(name, group_size=8, residual=16).new_cache(model)
    out = model.generate(ids, max_new_tokens=32, do_sample=False, past_key_values=cache)
    assert out.shape == plain.sequences.shape and cache.get_seq_length() == out.shape[1] - 1
    assert cache.stats()["bits_stored"] < 16
    if get_method(name).bits == 4:  # 4-bit GEAR follows fp16's greedy path on this prompt for 16 tokens
        assert_follows_fp16(model, ids, plain, out, name, group_size=8, residual=16)


@pytest.mark.parametrize("context", [1, 128, 129, 300, 1000])
def test_analytic_bits_match_measured_for_a_prompt(context):
    method = get_method("gear2", group_size=16, residual=32)
    cache = method.new_cache(fake_model())
    for i in range(2):
        cache.update(torch.randn(2, 3, context, 64), torch.randn(2, 3, context, 64), i)
    assert cache.stats()["bits_stored"] == pytest.approx(method.analytic_bits(SMOLLM2, context=context), rel=1e-12)
    assert get_method("gear2").analytic_bits() == pytest.approx(2 + 0.5 + 0.96)
    assert get_method("gear_l2").analytic_bits(SMOLLM2) == pytest.approx(2 + 0.5)
    with pytest.raises(InvalidParameterError, match="geometry"):
        method.analytic_bits(context=context)


def test_analytic_bits_use_the_adapted_group_size():
    assert get_method("gear2").analytic_bits(KVGeometry(2, 4, 4, 32)) == pytest.approx(2 + 1.0 + 0.96)
    assert get_method("gear2", group_size=16).analytic_bits(KVGeometry(2, 4, 4, 32)) == pytest.approx(2 + 2.0 + 0.96)


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["gear", "gear2", "gear4", "gear_l", "gear_l2", "gear_l4"])
def test_beam_search_with_default_parameters(stories, name):
    beam_search_runs(*stories, get_method(name))


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["gear2", "gear_l2"])
def test_batch_selection_equals_the_cache_of_the_selected_rows(stories, name):
    """Outlier positions count within their own (batch row, head) history: a reorder keeps them valid."""
    model, _ = stories
    method = get_method(name, group_size=8, residual=32)
    check_selection_equals_rebuild(model, method.on_backend("torch"))
    cache = method.new_cache(model)
    cache.update(torch.randn(3, 4, 100, 8), torch.randn(3, 4, 100, 8), 0)
    store = cache.layers[0].k_stream.store
    assert (store.index is not None) == (name == "gear2") and len(store.runs) == 1


def test_dropping_whole_segments_keeps_the_rest_exact():
    """A sliding layer's GEAR store forgets whole segments (codes, outliers, factors together); what
    stays reads back exactly as the same tokens did before, positions of the outliers shifted."""
    from kvquant.formats.gear import GearStore
    from kvquant.formats.window import CHANNEL_AXIS, TOKEN_AXIS

    for axis in (TOKEN_AXIS, CHANNEL_AXIS):
        store = GearStore(GearMethod(bits=2, group_size=8, residual=16), axis, 8)
        for i, t in enumerate((48, 16, 16, 16)):
            store.add(structured(1, 2, t, 16, seed=i), decode=t == 16)
        before = torch.empty(1, 2, 96, 16)
        store.read_into(before)
        assert store.drop(47) == 0 and store.drop(70) == 64  # whole segments only
        assert store.length == 32 and len(store.runs) == 1 and store.runs[0].start == 0
        after = torch.empty(1, 2, 32, 16)
        store.read_into(after)
        assert torch.equal(after, before[:, :, 64:])
        assert store.drop(32) == 32 and store.q is None and store.index is None and not store.runs
