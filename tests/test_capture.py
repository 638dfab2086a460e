import torch

from kvquant.analysis.capture import capture_kv


def test_capture_returns_every_layer_with_cache_shapes(stories):
    model, tok = stories
    ids = tok("Once upon a time there was a cat", return_tensors="pt").input_ids
    kv = capture_kv(model, ids[0])
    assert len(kv) == model.config.num_hidden_layers
    k, v = kv[0]
    assert k.shape == v.shape == (1, model.config.num_key_value_heads, ids.shape[1], 8)
    assert torch.isfinite(k).all() and not torch.equal(k, v)
