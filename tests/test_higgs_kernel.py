"""``kernels_cpu.attend_higgs`` against the torch path of the ``higgs`` method, and ``backend=cpu`` on a model.

The reference is what the torch path hands the model's attention (every coded token reconstructed,
RoPE re-applied, sinks and window concatenated), attended in fp64. Stores are written by kvquant's
own ``AquaKVCache``, on real K/V of stories260k and on random K/V in SmolLM2's and Llama-3's shapes
(RoPE tables from transformers' own rotary module), so layouts, codes and RoPE tables are the real ones.
"""

from __future__ import annotations

import pytest
import torch
import transformers as T
from test_kernels_cpu import causal_padding_mask as padded_causal
from test_kernels_cpu import reference
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import kernels_cpu
from kernels_cpu.backend import higgs_tensors
from kvquant import get_method
from kvquant.attention import capture_attention_inputs
from kvquant.cache import KVGeometry
from kvquant.errors import InvalidParameterError
from kvquant.formats.higgs import AquaKVState
from kvquant.methods.aquakv.cache import AquaKVCache
from kvquant.methods.aquakv.layer import AquaKVLayer
from kvquant.quant.higgs import Higgs

# fp32 sums over up to ~1000 keys and a 1024-point rotation, against fp64 over the torch path's own
# fp32 reconstruction: measured differences are below 2e-6 on outputs of magnitude 1-3.
RTOL, ATOL = 1e-4, 2e-5


def higgs_args(layer: AquaKVLayer) -> dict:
    """``attend_higgs``' arguments for a layer's state, its RoPE inputs as a kernel step sets them."""
    layer.state.rope = layer.kernel_rope()
    return higgs_tensors(layer.state)


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, rtol=RTOL, atol=ATOL)


def higgs_cache(
    kv_heads: int, head_dim: int, bits: int, group: int, sink: int, window: int, post_rope: bool = False
) -> AquaKVCache:
    """One higgs layer in a cache whose RoPE is transformers' Llama rotary module for this head dim
    (``post_rope``: keys coded as handed, ``higgs_post_rope``'s cache)."""
    config = T.LlamaConfig(
        hidden_size=2 * kv_heads * head_dim,
        num_attention_heads=2 * kv_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        num_hidden_layers=1,
    )
    quant = Higgs(kv_heads * head_dim, bits, group)
    layers = [AquaKVLayer(0, quant, None, None, sink, window)]
    return AquaKVCache(layers, LlamaRotaryEmbedding(config), None, post_rope=post_rope)


# (batch, q heads, kv heads, head_dim, bits, group, sink, window, prefill, decode steps):
# SmolLM2 (3 x 64 = 192 = 12 x 16: the Paley factor), Llama-3 (8 x 128: one 1024 group), 4 groups of
# 1024 (32 x 128), groups of 2 heads, head dim 8 (stories260k's) with a group per head, 6-bit codes
# whose groups start off an 8-code boundary (40 = 20 x 2; 5 groups of 8), no sinks, no window,
# nothing coded yet, a group zero-padded to 128 (5 x 20 = 100 channels), tails (L mod 64 != 0), MQA;
# 9000 and 5000 tokens: long enough that two threads split the keys into chunks merged by log-sum-exp.
CASES = [
    (1, 9, 3, 64, 2, 1024, 4, 128, 9000, 3),
    (2, 9, 3, 64, 3, 1024, 4, 16, 100, 2),
    (2, 8, 2, 128, 4, 1024, 4, 32, 200, 1),
    (1, 32, 8, 128, 2, 1024, 4, 128, 300, 2),
    (2, 64, 32, 128, 2, 1024, 4, 8, 40, 1),
    (1, 12, 6, 64, 2, 128, 4, 16, 90, 2),
    (2, 6, 3, 8, 2, 8, 4, 8, 40, 2),
    (2, 10, 5, 8, 3, 40, 0, 8, 70, 3),
    (1, 10, 5, 8, 3, 8, 2, 0, 30, 2),
    (2, 4, 2, 48, 4, 48, 4, 16, 10, 1),
    (2, 10, 5, 20, 2, 1024, 4, 8, 77, 1),
    (2, 4, 1, 64, 2, 1024, 4, 16, 5000, 1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_kernel_matches_the_torch_path(built, threads, case):
    b, hq, hkv, d, bits, group, sink, window, prefill, steps = case
    torch.manual_seed(prefill + bits)
    cache = higgs_cache(hkv, d, bits, group, sink, window)
    shift = torch.linspace(-1, 1, d)  # keys with a per-channel offset, as real keys have
    k, v = cache.update(torch.randn(b, hkv, prefill, d) + shift, torch.randn(b, hkv, prefill, d), 0)
    for _ in range(steps):
        k, v = cache.update(torch.randn(b, hkv, 1, d) + shift, torch.randn(b, hkv, 1, d), 0)
    layer, length = cache.layers[0], k.shape[2]
    assert (layer.n_codes > 0) == (prefill + steps > sink + window)
    args = higgs_args(layer)
    routes = [args]
    if layer.n_codes:  # RoPE from the positions (transformers' Llama module is the formula), and from tables
        assert args["positions"] is not None and args["cos"] is None
        cos, sin = cache.quantized_rope(0, layer.state.code_lo, layer.n_codes)
        routes.append({**args, "positions": None, "inv_freq": None, "cos": cos, "sin": sin})
    for q_len in (1, 4):
        q = torch.randn(b, hq, q_len, d)
        mask = padded_causal(b, q_len, length, [min(5 * i, length - q_len) for i in range(b)])
        for route in routes:
            assert_close(kernels_cpu.attend_higgs(q, **route, mask=mask), reference(q, k, v, mask))
    q = torch.randn(b, hq, 3, d)
    causal = padded_causal(b, 3, length, [0] * b)
    out = kernels_cpu.attend_higgs(q, **args, causal=True, scaling=0.3)
    assert_close(out, reference(q, k, v, causal, scaling=0.3))


@pytest.mark.parametrize("case", [CASES[i] for i in (0, 3, 6, 7, 10)], ids=lambda c: "x".join(map(str, c)))
def test_keys_coded_after_rope_match_the_torch_path(built, threads, case):
    """``higgs_post_rope``'s store: no RoPE inputs; scored in the rotated domain or from keys rebuilt with
    signs and scale only (the kernel's pick, and each forced), it equals attention over what the torch
    path hands the model; RoPE inputs beside ``post_rope`` are refused."""
    b, hq, hkv, d, bits, group, sink, window, prefill, steps = case
    torch.manual_seed(prefill + bits + 1)
    cache = higgs_cache(hkv, d, bits, group, sink, window, post_rope=True)
    shift = torch.linspace(-1, 1, d)
    k, v = cache.update(torch.randn(b, hkv, prefill, d) + shift, torch.randn(b, hkv, prefill, d), 0)
    for _ in range(steps):
        k, v = cache.update(torch.randn(b, hkv, 1, d) + shift, torch.randn(b, hkv, 1, d), 0)
    layer, length = cache.layers[0], k.shape[2]
    assert layer.n_codes > 0 and cache.positions is None
    args = higgs_args(layer)
    assert args["post_rope"] and args["cos"] is None and "positions" not in args
    for rotated in (None, True, False):
        for q_len in (1, 4):
            q = torch.randn(b, hq, q_len, d)
            mask = padded_causal(b, q_len, length, [min(5 * i, length - q_len) for i in range(b)])
            out = kernels_cpu.attend_higgs(q, **args, mask=mask, rotated_scores=rotated)
            assert_close(out, reference(q, k, v, mask))
        q = torch.randn(b, hq, 3, d)
        out = kernels_cpu.attend_higgs(q, **args, causal=True, scaling=0.3, rotated_scores=rotated)
        assert_close(out, reference(q, k, v, padded_causal(b, 3, length, [0] * b), scaling=0.3))
    positions = torch.zeros(b, layer.n_codes, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="neither for keys coded after RoPE"):
        kernels_cpu.attend_higgs(q, **args, positions=positions, inv_freq=torch.ones(d // 2))
    with pytest.raises(RuntimeError, match="neither for keys coded after RoPE"):
        kernels_cpu.attend_higgs(q, **{**args, "post_rope": False})


@pytest.mark.parametrize("start", [0, 100_000, 3_000_000])
def test_rope_from_positions_holds_at_large_positions(built, start):
    """cos/sin computed in the kernel from far positions (angles up to 3e6 rad) match the module's tables."""
    torch.manual_seed(5)
    cache = higgs_cache(2, 64, 2, 1024, 4, 8)
    b, n = 2, 200
    positions = start + torch.arange(n).expand(b, n) + torch.tensor([[0], [7]])
    k, v = cache.update(torch.randn(b, 2, n, 64), torch.randn(b, 2, n, 64), 0, {"position_ids": positions})
    args = higgs_args(cache.layers[0])
    assert torch.equal(args["positions"], positions[:, 4:-8].int())
    q = torch.randn(b, 4, 1, 64)
    assert_close(kernels_cpu.attend_higgs(q, **args), reference(q, k, v))


def test_rope_tables_are_read_where_the_module_is_not_the_formula(built):
    """A rotary module that computes otherwise (here: scaled positions) is not taken for the formula:
    the kernel reads this step's tables, and still equals the torch path."""

    class Stretched(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, position_ids):
            return self.inner(x, position_ids * 2)

    torch.manual_seed(6)
    plain = higgs_cache(3, 64, 2, 1024, 4, 8)
    cache = AquaKVCache(plain.layers, Stretched(plain.rotary), None)
    k, v = cache.update(torch.randn(1, 3, 100, 64), torch.randn(1, 3, 100, 64), 0)
    args = higgs_args(cache.layers[0])
    assert cache.rope_formula(0) is None and args["cos"] is not None and "positions" not in args
    q = torch.randn(1, 9, 1, 64)
    assert_close(kernels_cpu.attend_higgs(q, **args), reference(q, k, v))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_kernel_matches_the_torch_path_on_stories260k(built, stories, bits):
    """Real K/V and queries (a left-padded batch of two prompts): at the prefill (q_len > 1) and at
    every decode step, each layer's kernel output equals attention over what the torch path handed
    the model."""
    model, tok = stories
    prompts = ["Once upon a time, there was a little girl named Lily who", "The cat sat"]
    rows = [tok(p, return_tensors="pt").input_ids[0] for p in prompts]
    n = max(len(r) for r in rows)
    pads = [n - len(r) for r in rows]
    ids = torch.stack([torch.cat([torch.zeros(p, dtype=torch.long), r]) for p, r in zip(pads, rows, strict=True)])
    attn = (torch.arange(n)[None] >= torch.tensor(pads)[:, None]).long()
    method = get_method("higgs", bits=bits, window=4, backend="torch")
    cache = method.new_cache(model)
    for step in range(4):
        with capture_attention_inputs(model) as calls, torch.no_grad():
            logits = model(input_ids=ids, attention_mask=attn, past_key_values=cache, use_cache=True).logits
        ids = logits[:, -1].argmax(-1, keepdim=True)
        attn = torch.cat([attn, torch.ones(2, 1, dtype=torch.long)], dim=1)
        for layer, call in zip(cache.layers, calls, strict=True):
            assert layer.n_codes > 0
            q, k, v = call["query"], call["key"], call["value"]
            mask = padded_causal(2, q.shape[2], k.shape[2], pads)
            out = kernels_cpu.attend_higgs(q, **higgs_args(layer), mask=mask, scaling=call["scaling"])
            assert_close(out, reference(q, k, v, mask, scaling=call["scaling"]))
        assert step > 0 or calls[0]["query"].shape[2] == n


@pytest.mark.slow
def test_kernel_matches_the_torch_path_on_smollm2(built, smollm2):
    """SmolLM2's real K/V (3 KV heads x 64 = one 192-channel group, 12 x 16: the Paley factor): at the
    prefill and two decode steps every layer's kernel output equals attention over the torch path's."""
    model, tok = smollm2
    ids = tok("The quick brown fox jumps over the lazy dog because", return_tensors="pt").input_ids
    cache = get_method("higgs", window=4, backend="torch").new_cache(model)
    for _ in range(3):
        with capture_attention_inputs(model) as calls, torch.no_grad():
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
        ids = logits[:, -1:].argmax(-1)
        for layer, call in zip(cache.layers, calls, strict=True):
            q, k, v = call["query"], call["key"], call["value"]
            causal = padded_causal(1, q.shape[2], k.shape[2], [0])
            args = higgs_args(layer)
            out = kernels_cpu.attend_higgs(q, **args, causal=q.shape[2] > 1, scaling=call["scaling"])
            assert_close(out, reference(q, k, v, causal, scaling=call["scaling"]))


@pytest.mark.numerics
@pytest.mark.parametrize(("name", "bits"), [("higgs", 2), ("higgs", 4), ("higgs_post_rope", 2)])
def test_backend_cpu_follows_the_torch_path(built, stories, name, bits):
    """``backend=cpu`` attends over the codes as stored: teacher-forced along the torch path's greedy
    tokens the mean KL between the two is below 1e-6 (fp32 summation order only: the codes are the
    same), its own greedy run first differs (if ever) at a near-tie, what is stored and read is
    counted the same, and beam search (a reorder every step) runs."""
    from conftest import assert_kernels_follow_torch
    from test_kivi import beam_search_runs

    model, tok = stories
    cache_c = assert_kernels_follow_torch(model, tok, name, bits=bits, window=16)
    assert cache_c.layers[0].n_codes > 0
    with get_method(name, window=8, backend="cpu").attach(model) as routed:
        beam_search_runs(routed, tok, get_method(name, window=8, backend="cpu"))


@pytest.mark.numerics
@pytest.mark.parametrize("layout", ["llama", "qwen2", "qwen3", "phi3", "mistral", "gemma2", "gemma3"])
def test_backend_cpu_on_every_layout(built, layout):
    """The tiny random models of ``test_architectures``: on full-attention layouts the kernel's greedy
    run equals the torch path's (logits within 1e-3, as on stories260k); sliding or soft-capped ones
    are refused."""
    from test_architectures import run, tiny

    if layout in ("mistral", "gemma2", "gemma3"):
        with pytest.raises(InvalidParameterError, match="backend=cpu cannot run this model"):
            get_method("higgs", backend="cpu").new_cache(tiny(layout))
        return
    tokens_t, logits_t, cache_t = run(layout, "higgs")
    tokens_c, logits_c, cache_c = run(layout, "higgs", backend="cpu")
    assert cache_c.backend == "cpu" and cache_c.layers[0].n_codes > 0
    assert torch.equal(tokens_c, tokens_t) and cache_c.stats() == cache_t.stats()
    torch.testing.assert_close(logits_c, logits_t, atol=1e-3, rtol=1e-3)


@pytest.mark.numerics
def test_left_padded_batch_generates_as_the_torch_path(built, stories):
    """A left-padded batch of two prompts (per-row positions from the attention mask, the mask handed to
    the kernel), then 12 greedy steps: each row's logits within 1e-3 of the torch path's wherever the
    two caches store the same for it (``conftest.assert_rows_follow_torch``: a parting must be a
    rounding flip, after which the row is set back to the torch path's stores)."""
    from conftest import assert_rows_follow_torch

    model, tok = stories
    prompts = ["Once upon a time, a little fox saw a", "Tom"]
    n = len(tok(prompts[0]).input_ids)
    methods = {b: get_method("higgs", window=4, backend=b) for b in ("torch", "cpu")}
    caches = assert_rows_follow_torch(model, tok, prompts, methods, [0, n - 1], steps=12)
    assert caches["cpu"].layers[0].n_codes > 0


def test_float_masks_query_dtype_and_rows_that_see_no_key(built):
    """An additive float mask (-inf where masked), a row that sees no key (zeros, as SDPA gives), and
    a bfloat16 query (computed in fp32, returned in bfloat16)."""
    torch.manual_seed(7)
    cache = higgs_cache(2, 64, 2, 1024, 4, 8)
    k, v = cache.update(torch.randn(1, 2, 90, 64), torch.randn(1, 2, 90, 64), 0)
    args = higgs_args(cache.layers[0])
    q = torch.randn(1, 4, 2, 64)
    allowed = torch.rand(1, 1, 2, 90) > 0.3
    allowed[..., 1, :] = False
    bias = torch.randn(1, 4, 2, 90).masked_fill(~allowed, float("-inf"))
    out = kernels_cpu.attend_higgs(q, **args, mask=bias)
    assert torch.all(out[:, :, 1] == 0)
    kk, vv = k.double().repeat_interleave(2, dim=1), v.double().repeat_interleave(2, dim=1)
    p = torch.nan_to_num((q.double() @ kk.mT * 64**-0.5 + bias.double()).softmax(-1), nan=0.0)
    assert_close(out, p @ vv)
    out16 = kernels_cpu.attend_higgs(q.bfloat16(), **args, mask=allowed)
    assert out16.dtype == torch.bfloat16
    ref16 = reference(q.bfloat16().float(), k, v, allowed)
    torch.testing.assert_close(out16.double(), ref16, rtol=1e-2, atol=1e-2)


def sliding_model():
    """A tiny random Mistral whose layers slide (what the kernel does not read)."""
    config = T.MistralConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=32,
    )
    return T.MistralForCausalLM(config).eval()


@pytest.mark.parametrize("backend", ["cpu", "auto"])
def test_models_the_kernel_cannot_run_are_refused_or_fall_back(built, backend, capsys, monkeypatch):
    """Sliding windows: ``cpu`` is one line of error, ``auto`` the torch path with one warning line."""
    monkeypatch.setattr("kvquant.backends._WARNED", set())  # each fallback line is said once per process
    model = sliding_model()
    method = get_method("higgs", backend=backend)
    if backend == "cpu":
        with pytest.raises(InvalidParameterError, match="backend=cpu cannot run this model: .*sliding-window"):
            method.new_cache(model)
        return
    assert method.new_cache(model).backend == "torch"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "backend=auto uses torch" in err[0] and "sliding-window" in err[0]


def test_groups_that_split_a_head_have_no_kernel_and_aquakv_has_one(built, stories, capsys, monkeypatch):
    """A HIGGS group that is not a whole number of heads: one line of error on ``cpu``. AQUA-KV's
    residual codes have their kernels (``tests/test_aquakv_kernel.py``): ``cpu`` and ``auto`` read with
    them, without a warning."""
    monkeypatch.setattr("kvquant.backends._WARNED", set())  # each fallback line is said once per process
    model, _ = stories
    with pytest.raises(InvalidParameterError, match="backend=cpu cannot run this model: .*groups of 4 channels"):
        get_method("higgs", group=4, backend="cpu").new_cache(model)
    assert get_method("higgs", group=4).new_cache(model).backend == "torch"
    assert "groups of 4 channels" in capsys.readouterr().err
    geometry = KVGeometry.of(model.config)
    for backend in ("cpu", "auto"):
        method = get_method("aquakv", backend=backend)
        assert method.resolve(model, geometry, method.rule(geometry)).name == "cpu"
    assert capsys.readouterr().err == ""


def test_bad_arguments_raise_one_line(built):
    cache = higgs_cache(2, 8, 2, 16, 4, 4)
    cache.update(torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8), 0)
    args = higgs_args(cache.layers[0])
    q = torch.randn(1, 4, 1, 8)
    with pytest.raises(RuntimeError, match="not a multiple of head_dim"):
        kernels_cpu.attend_higgs(q, **{**args, "group": 12})
    with pytest.raises(RuntimeError, match="k_codes must be uint8"):
        kernels_cpu.attend_higgs(q, **{**args, "k_codes": args["k_codes"][..., :-1]})
    with pytest.raises(RuntimeError, match="or none of them"):
        kernels_cpu.attend_higgs(q, **{**args, "positions": None, "inv_freq": None})
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        kernels_cpu.attend_higgs(torch.randn(1, 3, 1, 8), **args)
    residual = AquaKVState(cache.layers[0].quant, 4, 4)
    with pytest.raises(ValueError, match="predictor residual"):
        higgs_tensors(residual)


def test_geometry_of_the_shipped_models_is_read_whole(stories):
    """stories260k (4 x 8 channels) and SmolLM2 (3 x 64) each code one group of whole heads."""
    model, _ = stories
    geometry = KVGeometry.of(model.config)
    quant = get_method("higgs", backend="torch").quantizers(geometry)[2]
    assert quant.group % geometry.head_dim == 0 and quant.outer.shape == (1, 1)
    smol = Higgs(3 * 64, 2)
    assert smol.group == 192 and smol.outer.shape == (12, 12) and smol.padded_group == 192
