import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from kvquant import get_method, method_names
from kvquant.cache import FP16_MAX, CacheCounts, CropError, KVCache, nbytes
from kvquant.methods.fp16 import Fp16Layer


def test_counts_add_fieldwise_and_summarise_per_element():
    a = CacheCounts(elements_k=10, elements_v=10, bytes_k=5, bytes_v=20)
    a.add_read({8: 6, 16: 4}, {}, position=3)
    b = CacheCounts(elements_k=30, elements_v=30, bytes_k=15, bytes_v=60)
    b.add_read({}, {16: 40}, position=3)
    b.add_read({12: 10}, {12: 10}, position=4)
    s = (a + b).summary()
    assert s["bits_stored_k"] == 8 * 20 / 40 == 4.0
    assert s["bits_stored_v"] == 8 * 80 / 40 == 16.0
    assert s["bits_stored"] == 10.0
    assert s["bits_read_k"] == (48 + 64 + 120) / 20
    assert s["bits_read_v"] == (640 + 120) / 50
    assert s["bits_read"] == (48 + 64 + 120 + 640 + 120) / 70
    assert s["widths_k"] == {8: 0.3, 12: 0.5, 16: 0.2} and s["widths_v"] == {12: 0.2, 16: 0.8}
    assert s["bytes"] == 100 and s["bytes_fp16"] == 160
    series = (a + b).position_series()
    assert series["position"] == [3, 4]
    assert series["bits_read_k"] == [112 / 10, 12.0] and series["bits_read_v"] == [16.0, 12.0]
    assert a.summary()["bits_read_k"] == 11.2  # adding did not mutate the operands


def test_empty_counts_give_nan_not_zero():
    s = CacheCounts().summary()
    assert math.isnan(s["bits_stored"]) and math.isnan(s["bits_read"]) and s["bytes"] == 0


def test_nbytes_counts_real_element_sizes():
    assert nbytes([torch.zeros(3, dtype=torch.uint8), torch.zeros(2, dtype=torch.float16), None]) == 3 + 4


def test_kvcache_sums_layers_and_reports_length():
    cache = KVCache([Fp16Layer(), Fp16Layer()])
    for i in range(2):
        cache.update(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4), layer_idx=i)
    assert cache.get_seq_length() == 5
    stats = cache.stats()
    assert stats["elements"] == 2 * 2 * (2 * 5 * 4) and stats["bytes"] == 2 * stats["elements"]
    cache.layers[0].reset()
    assert cache.layers[0].counts() == CacheCounts()


def test_metadata_bits_count_towards_bits_read():
    c = CacheCounts()
    c.add_read({8: 64}, {16: 64}, position=64, meta_k=64.0)
    s = c.summary()
    assert s["bits_read_k"] == 9.0 and s["bits_read_v"] == 16.0 and s["bits_read"] == 12.5
    assert c.position_series()["bits_read_k"] == [9.0]
    assert (c + c).meta_bits_k == 128.0


# --- the layer contract, for every registered method -----------------------------------------------


@pytest.fixture(scope="module")
def story_prompt(stories):
    return stories[1]("Once upon a time, there was a little girl", return_tensors="pt").input_ids


@pytest.mark.parametrize("name", method_names())
def test_beam_search_and_several_sequences_work_for_every_method(
    stories, story_prompt, predictor_root, monkeypatch, name
):
    model, tok = stories
    monkeypatch.setenv("KVQUANT_PREDICTOR_DIR", str(predictor_root(model, tok)))
    kw = {"max_new_tokens": 70, "num_beams": 3, "num_return_sequences": 2, "do_sample": False}  # past a 64-block
    cache = get_method(name).new_cache(model)
    out = model.generate(story_prompt, past_key_values=cache, **kw)
    assert out.shape == (2, story_prompt.shape[1] + 70)
    assert cache.get_seq_length() == out.shape[1] - 1 and cache.stats()["bits_stored"] > 0


@pytest.mark.numerics
def test_fp16_beams_equal_dynamic_cache(stories, story_prompt):
    model, _ = stories
    kw = {"max_new_tokens": 20, "num_beams": 3, "num_return_sequences": 2, "do_sample": False}
    ours = model.generate(story_prompt, past_key_values=get_method("fp16").new_cache(model), **kw)
    theirs = model.generate(story_prompt, past_key_values=DynamicCache(), **kw)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("name", ["fp16", "truncation", "alignedkv", "alignedkv_plus", "kivi2", "gear2"])
def test_select_and_reorder_equal_a_cache_built_from_those_rows(stories, name):
    """K/V fed to the layers directly: a model's CPU forward may round a row differently in another
    batch shape, and this is about the cache, not the model."""
    model, _ = stories
    gen = torch.Generator().manual_seed(0)
    chunks = [torch.randn(2, 3, 4, t, 8, generator=gen) for t in (70, 1, 1, 60)]  # prefill, decode, a block more
    full, single, beams = (get_method(name).new_cache(model) for _ in range(3))
    for kv in chunks:
        for i in range(len(full.layers)):
            full.update(kv[0], kv[1], i)
            single.update(kv[0][2:3], kv[1][2:3], i)
            beams.update(kv[0][[2, 0, 1]], kv[1][[2, 0, 1]], i)
    full.batch_select_indices(torch.tensor([2]))
    beams.reorder_cache(torch.tensor([0, 0, 1]))
    for cache in (full, beams):
        for a, b in zip(cache.layers, single.layers, strict=True):
            mine = [t[:1] for t in a.stored_k() + a.stored_v() if t is not None]
            theirs = [t for t in b.stored_k() + b.stored_v() if t is not None]
            assert len(mine) == len(theirs) and all(torch.equal(x, y) for x, y in zip(mine, theirs, strict=True))


def test_crop_works_for_fp16_and_within_the_fp16_window_elsewhere(stories, story_prompt):
    model, _ = stories
    cache = get_method("fp16").new_cache(model)
    with torch.no_grad():
        model(story_prompt, past_key_values=cache)
    cache.crop(story_prompt.shape[1] - 3)
    assert cache.get_seq_length() == story_prompt.shape[1] - 3
    cache = get_method("kivi2", group_size=8, residual=16).new_cache(model)
    longer = story_prompt.repeat(1, 3)  # beyond the 16-token windows
    with torch.no_grad():
        model(longer, past_key_values=cache)
    held = cache.layers[0].state.newest_fp16()
    assert 0 < held < longer.shape[1]
    cache.crop(-held)  # what both fp16 windows hold can be taken back
    assert cache.get_seq_length() == longer.shape[1] - held
    with pytest.raises(CropError, match="only 0 are still held in the fp16 window") as err:
        cache.crop(-1)
    assert "\n" not in str(err.value)


def test_offload_and_prefetch_keep_every_tensor(stories, story_prompt):
    model, _ = stories
    cache = get_method("alignedkv").new_cache(model)
    with torch.no_grad():
        model(story_prompt, past_key_values=cache)
    before = [t.clone() for t in cache.layers[0].stored_k() if t is not None]
    cache.layers[0].offload()
    cache.layers[0].prefetch()
    after = [t for t in cache.layers[0].stored_k() if t is not None]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


EQUAL_WITH_LOOKUP = ("fp16", "truncation", "alignedkv")


@pytest.mark.parametrize("name", method_names())
def test_prompt_lookup_decoding_runs_with_every_method(stories, predictor_root, monkeypatch, name):
    """``prompt_lookup_num_tokens``: drafts from the prompt are verified in one forward and the rejected
    ones cropped away. Every method takes it with its defaults (what a rejected draft removes is still
    held at full precision); fp16, truncation and AlignedKV then give plain greedy decoding's tokens."""
    model, tok = stories
    monkeypatch.setenv("KVQUANT_PREDICTOR_DIR", str(predictor_root(model, tok)))
    text = "Once upon a time, there was a little dog. The little dog liked to play. " * 3 + "Once upon a time,"
    ids = tok(text, return_tensors="pt").input_ids
    method = get_method(name)
    crops = []
    with method.attach(model), torch.no_grad():
        plain = model.generate(ids, max_new_tokens=48, do_sample=False, past_key_values=method.new_cache(model))
        cache = method.new_cache(model)
        crop = cache.crop
        monkeypatch.setattr(cache, "crop", lambda n: (crops.append(n), crop(n)))
        lookup = model.generate(
            ids, max_new_tokens=48, do_sample=False, prompt_lookup_num_tokens=3, past_key_values=cache
        )
    assert crops and cache.get_seq_length() == lookup.shape[1] - 1  # drafts were rejected and taken back
    assert lookup.shape[1] == plain.shape[1] == ids.shape[1] + 48
    if name in EQUAL_WITH_LOOKUP:
        assert torch.equal(lookup, plain)


@pytest.mark.parametrize("name", ["fp16", "kivi2", "alignedkv", "aquakv"])
def test_a_gpu_cache_reads_its_finite_checks_once_a_step_and_names_the_layer(
    stories, predictor_root, monkeypatch, name
):
    """Deferred as on a GPU (``FiniteCheck``): a non-finite value passes its own update unremarked and is
    refused, naming the layer, when the next step begins (its first layer's update) or counts are read."""
    from kvquant.errors import KvquantError

    model, tok = stories
    monkeypatch.setenv("KVQUANT_PREDICTOR_DIR", str(predictor_root(model, tok)))
    kwargs = {"group_size": 8} if name == "kivi2" else {}

    def fresh():
        cache = get_method(name, backend="torch", **kwargs).new_cache(model)
        assert all(layer.finite is cache.finite for layer in cache.layers)  # one check per cache
        cache.finite.deferred = True
        return cache

    def step(cache, n: int, bad_layer: int | None = None) -> None:
        for i in range(len(cache.layers)):
            k, v = torch.randn(1, 4, n, 8), torch.randn(1, 4, n, 8)
            if i == bad_layer:
                v[0, 2, -1, 5] = float("nan")
            cache.update(k, v, i)

    found = "values.* \\(found after the step that received them\\)"
    cache = fresh()
    step(cache, 200)
    step(cache, 1, bad_layer=3)  # received, not yet read: no sync in this step
    assert len(cache.finite.pending) == len(cache.layers) * (1 if name in ("kivi2",) else 2)
    with pytest.raises(KvquantError, match=f"layer 3.*{found}"):
        cache.update(torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8), 0)  # the next step's first layer
    cache = fresh()
    step(cache, 200, bad_layer=2)
    with pytest.raises(KvquantError, match=f"layer 2.*{found}"):
        cache.counts()
    cache = fresh()
    step(cache, 200)
    step(cache, 1)
    assert cache.stats()["bits_read"] > 0 and cache.finite.pending == []


def test_a_cpu_cache_refuses_at_once_and_a_one_layer_cache_reads_its_checks_in_batches():
    from kvquant.cache import FiniteCheck, to_fp16_checked
    from kvquant.errors import KvquantError

    check = FiniteCheck()
    assert not check.defers(torch.ones(1)) and FiniteCheck(deferred=True).defers(torch.ones(1))
    with pytest.raises(KvquantError, match="^layer 0: 1 key values are NaN/inf or outside fp16's range"):
        to_fp16_checked(torch.tensor([1.0, 7e4]), 0, "key", check)
    check = FiniteCheck(deferred=True)
    for _ in range(FiniteCheck.MAX_PENDING):  # layer 0 over and over: no lower layer marks a new step
        to_fp16_checked(torch.ones(2), 0, "key", check)
    to_fp16_checked(torch.tensor([float("inf")]), 0, "key", check)
    assert len(check.pending) == 1  # the full list was read before this one was kept
    with pytest.raises(KvquantError, match="^layer 0: key values are NaN/inf .*min inf, max inf.*\\(found after"):
        check.settle()
    assert check.pending == []


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(-1e5, 1e5, width=32), min_size=1, max_size=70),
    st.sampled_from([None, float("nan"), float("inf"), -float("inf")]),
    st.integers(0, 69),
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
)
def test_one_value_range_decides_what_fp16_can_hold(values, special, where, dtype):
    """``within_fp16(*value_range(x))`` (one reduction) is exactly "every element finite and within ±65504"."""
    from kvquant.cache import value_range, within_fp16

    x = torch.tensor(values, dtype=torch.float32)
    if special is not None:
        x[where % x.numel()] = special
    x = x.to(dtype)
    low, high = value_range(x)
    assert within_fp16(low.item(), high.item()) == bool((x.float().abs() <= FP16_MAX).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["fp16", "kivi2", "alignedkv"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -7e4])
def test_on_a_gpu_the_finite_checks_wait_for_the_next_step(stories, name, bad):
    """CUDA tensors are checked without a host sync per layer: the refusal comes at the next step's first layer
    (NaN too: CUDA's ``aminmax`` must propagate it, as the CPU's does)."""
    from kvquant.errors import KvquantError

    model, _ = stories
    cache = get_method(name, backend="torch", **({"group_size": 8} if name == "kivi2" else {})).new_cache(model)
    assert cache.finite.defers(torch.ones(1, device="cuda"))
    for n in (200, 1):
        for i in range(len(cache.layers)):
            v = torch.randn(1, 4, n, 8, device="cuda")
            if n == 1 and i == 3:
                v[0, 1, 0, 2] = bad
            cache.update(torch.randn(1, 4, n, 8, device="cuda"), v, i)
    with pytest.raises(KvquantError, match="layer 3.*\\(found after the step that received them\\)"):
        cache.update(torch.randn(1, 4, 1, 8, device="cuda"), torch.randn(1, 4, 1, 8, device="cuda"), 0)


@pytest.mark.parametrize(("name", "most"), [("fp16", 4), ("kivi2", 46)])
def test_a_deferred_decode_update_dispatches_few_torch_ops(stories, name, most):
    """On a GPU every torch op of a layer's update is a launch, and a batch-1 step is bound by them: with the
    check deferred (as on a GPU), fp16's update is a ``value_range`` and an in-place copy per K and V (~20 ops
    when the check was spelled out); KIVI's adds one value's coding (``kvquant.quant.integer.quantize``) and, on
    the torch backend, the read of its history (55 ops in all before the check and the coding were trimmed)."""
    from kvquant.analysis.timing import OpCounter

    layer = get_method(name, backend="torch").new_cache(stories[0]).layers[0]
    layer.finite.deferred = True
    layer.update(torch.randn(1, 4, 300, 8).half(), torch.randn(1, 4, 300, 8).half())
    k, v = torch.randn(1, 4, 1, 8).half(), torch.randn(1, 4, 1, 8).half()
    layer.update(k, v)
    with OpCounter() as counter:
        layer.update(k, v)
    assert counter.total <= most, counter.counts
    if name == "fp16":
        assert counter.counts == {"aminmax": 2, "copy_": 2}
