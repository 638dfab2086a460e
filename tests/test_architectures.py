"""Every method on seven decoder layouts: Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma-2, Gemma-3.

Tiny random models built from configs (no weights): 2 layers, hidden 64, 4 query / 2 KV heads,
head dim 16. Mistral and Gemma-2/3 have sliding windows shorter than the prompt, Gemma-2 soft-caps
its logits (eager attention), Gemma-2/3 scale queries by ``query_pre_attn_scalar``. Greedy runs
are memoised per (layout, method), so each is generated once for all the checks that read it.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import transformers as T
from conftest import require_kernels_cpu
from transformers import DynamicCache

from kvquant import get_method, method_names
from kvquant.cache import KVGeometry
from kvquant.errors import InvalidParameterError
from kvquant.methods.aquakv import SINK

PROMPT, NEW = 150, 4  # the prompt is longer than the windows and than KIVI's fp16 residual
WINDOW = 32  # Gemma-2/3: within AlignedKV's fp16 tail (64-token blocks), so nothing there is read narrower
MISTRAL_WINDOW = 140  # every layer slides, past lossy methods' 128 fp16 tokens; AlignedKV reads less
COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)
GEMMA = dict(sliding_window=WINDOW, query_pre_attn_scalar=24)
LAYOUTS = {
    "llama": lambda: T.LlamaConfig(**COMMON),
    "mistral": lambda: T.MistralConfig(**COMMON, sliding_window=MISTRAL_WINDOW),
    "qwen2": lambda: T.Qwen2Config(**COMMON),
    "qwen3": lambda: T.Qwen3Config(**COMMON),
    "phi3": lambda: T.Phi3Config(**COMMON),
    "gemma2": lambda: T.Gemma2Config(**COMMON, **GEMMA, attn_logit_softcapping=50.0),
    "gemma3": lambda: T.Gemma3TextConfig(**COMMON, **GEMMA, layer_types=["sliding_attention", "full_attention"]),
}
INF = (float("inf"), float("inf"))
NEEDS_PREDICTORS = ("aquakv", "aquakv_k_only", "aquakv_v_only")
LOSSY = ("kivi", "gear", "higgs", "aquakv")  # compress what they store
READ_LESS = ("alignedkv", "truncation")  # store fp16, read fewer bits
# The block rule's bound is per 32 tokens: on these tiny random layouts (a few dozen tokens, near-uniform
# attention) it reads every element at 16 bits plus its exponent bytes; stories260k's test reads fewer.
SAVES_NOTHING_HERE = ("alignedkv_block", "alignedkv_plus_block")


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def tiny(layout: str):
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(LAYOUTS[layout]()).eval()


@functools.cache
def prompt() -> torch.Tensor:
    return torch.randint(3, 128, (1, PROMPT), generator=torch.Generator().manual_seed(1))


def greedy(model, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens and the raw logits of every step."""
    out = model.generate(
        prompt(),
        past_key_values=cache,
        max_new_tokens=NEW,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences, torch.stack(out.logits)


@functools.cache
def reference(layout: str, rounded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``DynamicCache``'s greedy run; ``rounded``: with K/V rounded to fp16 on their way in."""
    model = tiny(layout)
    cache = DynamicCache(config=model.config)
    if rounded:
        for layer in cache.layers:
            stock = layer.update
            layer.update = lambda k, v, *a, _up=stock, **kw: _up(k.half().float(), v.half().float(), *a, **kw)
    return greedy(model, cache)


class CharTokenizer:
    """Enough of a tokenizer for AQUA-KV's calibration text (the tiny models have none)."""

    bos_token_id = 2

    def __call__(self, text: str, add_special_tokens: bool = False, **_):
        return type("Encoding", (), {"input_ids": [3 + ord(c) % 125 for c in text]})()


_PREDICTORS = Path(tempfile.mkdtemp(prefix="kvquant-arch-predictors-"))


@pytest.fixture(autouse=True, scope="module")
def remove_predictors():
    yield
    shutil.rmtree(_PREDICTORS, ignore_errors=True)


def method_for(layout: str, name: str, **params):
    """``name`` with ``params``; AQUA-KV with tiny predictors calibrated here (as ``tests/golden.py``
    does, on 1 sequence of 64 tokens: the layouts are under test, not the fit)."""
    if name in NEEDS_PREDICTORS and "predictors" not in params:
        path = _PREDICTORS / layout / f"{name}.safetensors"
        if not path.is_file():
            method = get_method(name)
            method.calibrate(tiny(layout), CharTokenizer(), n_seqs=1, seq_len=64, progress=False, log=None).save(path)
        params["predictors"] = str(path)
    return get_method(name, **params)


@functools.cache
def run(layout: str, name: str, **params):
    """``(tokens, logits, cache)`` of one greedy run; the model's attention is restored after it."""
    model = tiny(layout)
    method = method_for(layout, name, **params)
    with method.attach(model):
        cache = method.new_cache(model)
        tokens, logits = greedy(model, cache)
    return tokens, logits, cache


def family(name: str, families: tuple[str, ...]) -> bool:
    return any(name.startswith(f) for f in families)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp16_equals_dynamic_cache(layout):
    """Same greedy tokens as ``DynamicCache``, logits within fp16 storage's rounding; bit for bit
    the ``DynamicCache`` run whose K/V were rounded to fp16 (same windows, same masks)."""
    ref_tokens, ref_logits = reference(layout)
    tokens, logits, cache = run(layout, "fp16", backend="torch")
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=2e-3, rtol=1e-3)
    assert torch.equal(logits, reference(layout, rounded=True)[1])
    geometry = KVGeometry.of(tiny(layout).config)
    per_token = 2 * 2 * geometry.n_kv_heads * geometry.head_dim  # bytes of one token's K and V
    for i, layer in enumerate(cache.layers):  # a sliding layer holds its window - 1 tokens, measured
        held = geometry.sliding_window - 1 if geometry.is_sliding(i) else PROMPT + NEW - 1
        assert layer.counts().bytes_k + layer.counts().bytes_v == per_token * held


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp16_cpu_kernel_equals_dynamic_cache(layout):
    require_kernels_cpu()
    if layout == "gemma2":  # soft-capped logits: the kernel cannot apply them and says so at build
        with pytest.raises(InvalidParameterError, match="backend=cpu cannot run this model: .*soft-capping"):
            get_method("fp16", backend="cpu").new_cache(tiny(layout))
        return
    ref_tokens, ref_logits = reference(layout)
    tokens, logits, cache = run(layout, "fp16", backend="cpu")
    assert cache.backend == "cpu" and torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("name", ["alignedkv", "alignedkv_plus"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_alignedkv_at_infinite_thresholds_is_fp16(layout, name):
    _, fp16_logits, fp16 = run(layout, "fp16", backend="torch")
    _, logits, cache = run(layout, name, k_thresholds=INF, v_thresholds=INF, backend="torch")
    assert torch.equal(logits, fp16_logits)
    # the same elements read (a sliding layer's window only), every one at 16 bits
    read, read_fp16 = cache.counts(), fp16.counts()
    assert read.read_k == read_fp16.read_k and read.read_v == read_fp16.read_v


@pytest.mark.parametrize(("layout", "name"), [(lay, n) for lay in LAYOUTS for n in method_names()])
def test_every_method_runs(layout, name):
    """``generate`` runs; lossy methods store fewer than 16 bits, AlignedKV/truncation read fewer,
    and any other method saves on one of the two."""
    tokens, logits, cache = run(layout, name)
    assert tokens.shape == (1, PROMPT + NEW) and bool(torch.isfinite(logits).all())
    stats = cache.stats()
    if name in SAVES_NOTHING_HERE:
        assert stats["bits_read"] < 16.5 and stats["bits_stored"] > 16  # every element, plus its metadata
        return
    if name != "fp16":
        assert min(stats["bits_stored"], stats["bits_read"]) < 16
    if family(name, LOSSY):
        assert stats["bits_stored"] < 16
    if family(name, READ_LESS):
        assert stats["bits_read"] < 16


@pytest.mark.parametrize("name", method_names())
def test_sliding_layers_hold_only_their_window(name):
    """On Gemma-2 (layer 0 sliding, layer 1 full): a sliding layer reports itself so, hands attention
    its window (``get_mask_sizes``), and holds at most the window plus one 64-token block; fp16 and
    truncation hold exactly the ``window − 1`` tokens transformers' sliding layers keep. HIGGS/AQUA-KV
    (``aquakv/cache.py``): no sinks, the window's ``window − 1`` tokens in fp16, and codes of none
    (HIGGS) or, for AQUA-KV, of every older non-sink token, which layer 1's predictor reads; layer 0
    also holds the positions of every token, which the full layer 1 still needs (but for keys coded
    after RoPE, which need none)."""
    _, _, cache = run("gemma2", name)
    geometry = KVGeometry.of(tiny("gemma2").config)
    assert cache.is_sliding == [True, False]
    seen = PROMPT + NEW - 1  # the last token's K/V are never written
    assert cache.get_seq_length() == seen and cache.layers[1].get_mask_sizes(1) == (seen + 1, 0)
    assert cache.layers[0].get_mask_sizes(1) == (WINDOW, seen - WINDOW + 1)
    sliding = cache.layers[0].counts()
    per_token = 2 * geometry.n_kv_heads * geometry.head_dim  # K and V of one token, in elements
    assert sliding.bytes_k + sliding.bytes_v <= 2.2 * per_token * (WINDOW + 64)
    if name in ("fp16", "truncation"):
        assert sliding.bytes_k + sliding.bytes_v == 2 * per_token * (WINDOW - 1)
    if family(name, ("higgs", "aquakv")):
        layer = cache.layers[0]
        coded = seen - (WINDOW - 1) - SINK if name in NEEDS_PREDICTORS else 0
        assert (layer.n_sinks, layer.n_recent, layer.n_codes) == (0, WINDOW - 1, coded)
        code_bytes = coded * per_token * layer.quant.bits_per_value() / 8  # codes and scales, K and V
        positions = 0 if cache.post_rope else 4 * seen  # higgs_post_rope keeps none
        assert sliding.bytes_k + sliding.bytes_v == 2 * per_token * (WINDOW - 1) + code_bytes + positions


def test_gemma3_keys_are_unrotated_with_each_layers_rope():
    """Gemma-3 rotates sliding layers with the local base and full ones with the global: the cache's
    tables and calibration's collected keys undo, per layer, exactly the rotation its attention
    applied (the pre-RoPE keys are ``k_norm``'s output)."""
    from kvquant.methods.aquakv.calibration import collect_kv
    from kvquant.methods.aquakv.predictors import to_rows
    from kvquant.quant.rope import undo_rope

    model = tiny("gemma3")
    pre: dict[int, torch.Tensor] = {}
    post: dict[int, torch.Tensor] = {}
    hooks = [
        layer.self_attn.k_norm.register_forward_hook(lambda _m, _i, out, i=i: pre.__setitem__(i, out.detach()))
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        cache = method_for("gemma3", "higgs").new_cache(model)
        for layer in cache.layers:
            stock = layer.update

            def keep(k, v, *args, _i=layer.layer_idx, _up=stock, **kwargs):
                post[_i] = k
                return _up(k, v, *args, **kwargs)

            layer.update = keep
        with torch.no_grad():
            model(prompt(), past_key_values=cache, use_cache=True)
        tables = [cache.tables(i, 0, PROMPT) for i in range(2)]
        assert not torch.allclose(tables[0][0], tables[1][0])  # local and global bases differ
        for i, (cos, sin) in enumerate(tables):
            torch.testing.assert_close(undo_rope(post[i], cos, sin), pre[i], atol=1e-5, rtol=1e-5)
        keys, _ = collect_kv(model, [prompt()[0]], SINK)  # a plain forward: layer 1 sees other inputs
    finally:
        for hook in hooks:
            hook.remove()
    for i in range(2):
        torch.testing.assert_close(keys[i].float(), to_rows(pre[i])[0, SINK:].half().float(), atol=2e-3, rtol=1e-3)


def test_eager_fallback_soft_caps_and_takes_any_mask():
    """The generic eager path (modules without their own) is Gemma-2's; bool, additive and absent
    (plain causal) masks give the same output, cut to the key length."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    from kvquant.attention import _generic_eager, eager_attention, stock_attention

    gen = torch.Generator().manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.head_dim, module.training = 2, 8, False
    q, k, v = (torch.randn(1, h, 5, 8, generator=gen) * 20 for h in (4, 2, 2))
    causal = torch.ones(5, 7, dtype=torch.bool).tril()[None, None]  # two columns past the keys
    additive = torch.where(causal[..., :5], 0.0, torch.finfo(torch.float32).min)
    kw = {"scaling": 0.3, "softcap": 30.0}
    want, _ = eager_attention_forward(module, q, k, v, additive, **kw)
    torch.testing.assert_close(_generic_eager(module, q, k, v, additive, **kw)[0], want)
    for mask in (causal, causal[..., :5], additive, None):
        torch.testing.assert_close(stock_attention(module, q, k, v, mask, **kw)[0], want)
    torch.testing.assert_close(eager_attention(module, q, k, v, None, **kw)[0], want)
