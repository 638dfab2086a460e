"""RoPE maths (``kvquant.quant.rope``): the model's own rotation, undone exactly."""

import torch

from kvquant.quant.rope import apply_rope, rope_layer_types, rope_tables, rotate_half, undo_rope


def test_rotate_half_pairs_channel_i_with_i_plus_half():
    x = torch.arange(8.0).view(1, 1, 1, 8)
    assert rotate_half(x).flatten().tolist() == [-4.0, -5.0, -6.0, -7.0, 0.0, 1.0, 2.0, 3.0]
    assert torch.equal(rotate_half(rotate_half(x)), -x)


def test_apply_rope_is_what_the_model_does_and_undo_inverts_it(stories):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model, _ = stories
    pos = torch.arange(3, 40).view(1, -1).expand(2, -1)
    cos, sin = rope_tables(model.model.rotary_emb, pos)
    assert cos.shape == sin.shape == (2, 37, 8) and cos.dtype == torch.float32
    k = torch.randn(2, 4, 37, 8, generator=torch.Generator().manual_seed(0))
    want, _ = apply_rotary_pos_emb(k, k, cos, sin)
    assert torch.allclose(apply_rope(k, cos, sin), want, atol=1e-6)
    assert torch.allclose(undo_rope(apply_rope(k, cos, sin), cos, sin), k, atol=1e-5)


def test_undo_rope_is_exact_for_scaled_tables():
    """Attention scaling multiplies cos and sin alike: undoing divides by cos² + sin²."""
    gen = torch.Generator().manual_seed(1)
    angle = torch.rand(1, 5, 4, generator=gen) * 6
    cos, sin = (torch.cat([f(angle)] * 2, -1) * 1.3 for f in (torch.cos, torch.sin))
    k = torch.randn(1, 2, 5, 8, generator=gen)
    assert torch.allclose(undo_rope(apply_rope(k, cos, sin), cos, sin), k, atol=1e-5)


def test_a_module_with_a_table_per_layer_type_is_asked_for_each_layers_own():
    """Gemma-3's rotary module takes the layer type (sliding layers: the local base, full ones: the
    global); Llama's has one table, asked without a type."""
    from transformers import Gemma3TextConfig, LlamaConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    types = ["sliding_attention", "full_attention"]
    config = Gemma3TextConfig(num_hidden_layers=2, head_dim=16, layer_types=types, sliding_window=32)
    rotary, pos = Gemma3RotaryEmbedding(config), torch.arange(40).view(1, -1)
    assert rope_layer_types(rotary, types) == types
    assert rope_layer_types(LlamaRotaryEmbedding(LlamaConfig(head_dim=16)), types) == [None, None]
    for layer_type in types:
        base = config.rope_parameters[layer_type]["rope_theta"]
        angle = pos[..., None].float() / base ** (torch.arange(0, 16, 2).float() / 16)
        cos, sin = rope_tables(rotary, pos, layer_type)
        torch.testing.assert_close(cos, torch.cat([angle.cos()] * 2, -1))
        torch.testing.assert_close(sin, torch.cat([angle.sin()] * 2, -1))
    local, global_ = (config.rope_parameters[t]["rope_theta"] for t in types)
    assert local != global_
