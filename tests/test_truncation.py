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
