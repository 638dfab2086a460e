import pytest
import torch

from kvquant import get_method
from kvquant.bits import truncate
from kvquant.errors import InvalidParameterError, KvquantError


def test_reads_are_truncated_and_storage_is_fp16():
    layer = get_method("truncation", keep_bits=9).new_layer(0, None)
    k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    out_k, out_v = layer.update(k, v)
    assert torch.equal(out_k, truncate(k, 9).float()) and torch.equal(out_v, truncate(v, 9).float())
    assert not torch.equal(out_k, k.half().float())
    counts = layer.counts()
    assert counts.read_k == {9: 80} and counts.bytes_k == 160
    s = counts.summary()
    assert s["bits_stored"] == 16.0 and s["bits_read"] == 9.0


def test_keep16_equals_fp16_generation(stories):
    model, tok = stories
    ids = tok("Once upon a time", return_tensors="pt").input_ids
    a = model.generate(ids, max_new_tokens=20, do_sample=False, past_key_values=get_method("fp16").new_cache(model))
    b = model.generate(
        ids, max_new_tokens=20, do_sample=False, past_key_values=get_method("truncation", keep_bits=16).new_cache(model)
    )
    assert torch.equal(a, b)


def test_default_is_the_papers_control_and_bad_widths_fail():
    assert get_method("truncation").keep_bits == 13
    for bad in (5, 17, 12.5):
        with pytest.raises(InvalidParameterError, match="keep_bits"):
            get_method("truncation", keep_bits=bad)


def test_out_of_range_values_name_the_layer():
    layer = get_method("truncation").new_layer(3, None)
    k = torch.ones(1, 1, 2, 4)
    k[0, 0, 1, 2] = 1e6
    with pytest.raises(KvquantError, match="layer 3: 1 key values are NaN/inf or outside fp16's range"):
        layer.update(k, torch.ones(1, 1, 2, 4))


@pytest.mark.numerics
@pytest.mark.parametrize("keep", [9, 13])
def test_the_cpu_kernel_follows_the_torch_path(stories, keep):
    """``backend=cpu``: the fp16 kernel reads the fp16 store and truncates in registers. Along the torch
    path's greedy tokens the mean KL between the two is below 1e-6 (fp32 summation order), the bits
    read are the same, its own greedy run first differs (if ever) at a near-tie."""
    from conftest import require_kernels_cpu

    from kvquant.eval.fidelity import first_flip_is_near_tie, greedy_decode, kl_divergence

    require_kernels_cpu()
    model, tok = stories
    ids = tok("Once upon a time, a little fox", return_tensors="pt").input_ids[0]
    runs, before = {}, model.config._attn_implementation
    for backend in ("torch", "cpu"):
        method = get_method("truncation", keep_bits=keep, backend=backend)
        with method.attach(model):
            cache = method.new_cache(model)
            free = greedy_decode(model, ids, cache, 40)
            forced = greedy_decode(
                model, ids, method.new_cache(model), 40, forced=runs["torch"][0].tokens if runs else None
            )
            runs[backend] = (free, forced, cache)
        assert cache.backend == backend and model.config._attn_implementation == before  # attach restores it
    (free_t, _, cache_t), (free_c, forced_c, cache_c) = runs["torch"], runs["cpu"]
    assert kl_divergence(free_t.logprobs, forced_c.logprobs).mean() < 1e-6
    assert first_flip_is_near_tie(free_t.tokens, free_t.logprobs, free_c.tokens)
    assert cache_c.stats() == cache_t.stats() and cache_c.stats()["bits_read"] == keep


def test_backend_is_validated():
    with pytest.raises(InvalidParameterError, match="unknown backend 'gpu'"):
        get_method("truncation", backend="gpu")
