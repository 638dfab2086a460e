"""AQUA-KV on the CuPy backend (kernels_cupy.aquakv: ``higgs_decode`` + cuBLAS into the cache's workspace, then
``higgs_rows_r*`` over it): on CPU, every launch, index and split helper, and the kernels emulated line for line
in torch (kernels_cupy.aquakv_emulate, higgs_emulate) checked at every layer and step of real AQUA-KV caches —
stories260K with its shipped predictors, and Llama-shaped layers with random predictors — against the torch
rule (``dequantize_pair``) and the torch reference (``kvquant.formats.higgs.attend``); on a GPU, the kernels
themselves the same way and ``backend=cupy`` on stories260K. The compile (sm_80/sm_90, no warnings, no spills)
is ``test_kernels_cupy_higgs``'s: the kernels live in ``higgs.cu``."""

from __future__ import annotations

import re
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
import transformers as T
from test_kernels_cupy_codes import gpu_test
from test_kernels_cupy_higgs import KINDS, _signature, assert_follows_torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from kernels_cupy import aquakv, aquakv_emulate, higgs, higgs_emulate
from kernels_cupy.loader import SOURCE_DIR
from kvquant import backends, get_method
from kvquant.cache import KVGeometry
from kvquant.formats import higgs as higgs_format
from kvquant.formats.base import Reads
from kvquant.formats.higgs import HiggsRule
from kvquant.methods.aquakv.cache import AquaKVCache
from kvquant.methods.aquakv.layer import PROMPT_QUERIES, AquaKVLayer
from kvquant.methods.aquakv.predictors import Predictors, dequantize_pair
from kvquant.quant.hadamard import outer_factor
from kvquant.quant.higgs import Higgs

pytestmark = pytest.mark.usefixtures("one_thread")

#: mean KL bound of a decode against backend=torch: each leaving token's residual is coded against predictions
#: from rows reconstructed in fp32, so where the two paths' summation orders put a residual on the other side of
#: a rounding boundary one code differs and later layers carry it (MKL_CBWR=COMPATIBLE, one thread: mean 2e-4,
#: greedy tokens still equal); HIGGS alone stays below 1e-6
AQUAKV_KL = 1e-3

# fp32 summation order (RoPE, up to 4000 keys, values of a few units): as test_aquakv_kernel
ATOL, RTOL = 1e-5, 1e-4


# ---------------------------------------------------------------- a backend that checks each call


class Checked:
    """A backend's ops module that runs ``attend_kernel``/``reconstruct`` (the kernels or their emulation) at
    every call a model's AQUA-KV cache makes and compares them there, on the very state, with the torch
    reference (``kvquant.formats.higgs.attend``) and the torch rule (``dequantize_pair``); the kernels' outputs
    go on into the model. ``seen`` counts the checked calls by kind and RoPE form."""

    def __init__(self, attend_kernel, reconstruct, atol: float = ATOL, rtol: float = RTOL) -> None:
        self.attend_kernel, self.reconstruct, self.atol, self.rtol = attend_kernel, reconstruct, atol, rtol
        self.seen: dict[str, int] = {}

    def count(self, what: str) -> None:
        self.seen[what] = self.seen.get(what, 0) + 1

    def attend(self, state, rule, query, mask, scaling):
        got = self.attend_kernel(state, rule, query, mask, scaling)[0]
        ref = higgs_format.attend(state, None, query.float(), mask, scaling)[0]
        torch.testing.assert_close(got.float(), ref, atol=self.atol, rtol=self.rtol)
        form = "none" if state.rows is None else "tables" if state.rope.get("cos") is not None else "positions"
        self.count(f"attend q{min(query.shape[2], PROMPT_QUERIES + 1)} {form} b{query.shape[0]}")
        return got, Reads()

    def aquakv_reconstruct(self, k_codes, k_scales, v_codes, v_scales, **kw):
        q = Higgs(kw["out_k"].shape[-1], aquakv.BITS_OF_CODE[kw["code_bits"]], kw["group"])
        rk, rv = dequantize_pair(
            q, kw["pred_k"], kw["pred_v"], higgs_tensor(k_codes, k_scales), higgs_tensor(v_codes, v_scales),
            kw["prev_k"], kw["prev_v"],
        )  # fmt: skip
        out_k, out_v = self.reconstruct(k_codes, k_scales, v_codes, v_scales, **kw)
        assert out_k.data_ptr() == kw["out_k"].data_ptr() and out_v.data_ptr() == kw["out_v"].data_ptr()
        # a 1024-point rotation and predictors over up to 2C inputs, in another order: as test_aquakv_kernel
        torch.testing.assert_close(out_k, rk.to(out_k.device), atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(out_v, rv.to(out_v.device), atol=2e-5, rtol=1e-4)
        self.count("reconstruct" + (" predicted" if kw["pred_k"] is not None else ""))
        return out_k, out_v

    def module(self) -> types.ModuleType:
        mod = types.ModuleType("aquakv_checked")
        mod.attend, mod.aquakv_reconstruct, mod.aquakv_encode = self.attend, self.aquakv_reconstruct, aquakv.encode
        return mod


def higgs_tensor(codes, scales):
    from kvquant.quant.higgs import HiggsTensor

    return HiggsTensor(codes, scales)


def register_checked(monkeypatch, checked: Checked, device_type: str = "cpu") -> str:
    """``checked`` as backend ``aquakv_checked`` (format ``aquakv``, ``aquakv.limits``) for one test."""
    monkeypatch.setitem(sys.modules, "aquakv_checked", checked.module())
    backend = backends.Backend(
        "aquakv_checked", device_type, frozenset({"aquakv"}), lambda: (True, "ok"), "aquakv_checked", aquakv.limits
    )
    monkeypatch.setitem(backends._BACKENDS, backend.name, backend)
    return backend.name


@pytest.fixture
def emulated_backend(monkeypatch) -> str:
    """``kernels_cupy.aquakv_emulate`` as a CPU backend (the kernels' ``limits``), registered for one test: a
    model's AQUA-KV cache then runs the kernels' arithmetic."""
    backend = backends.Backend(
        "aquakv_emulated", "cpu", frozenset({"aquakv"}), lambda: (True, "ok"), "kernels_cupy.aquakv_emulate",
        aquakv.limits,
    )  # fmt: skip
    monkeypatch.setitem(backends._BACKENDS, backend.name, backend)
    return backend.name


def emulated(sms: int = 132) -> Checked:
    return Checked(
        lambda state, rule, q, mask, scaling: (higgs_emulate.emulate(state, q, mask, scaling, sms=sms), Reads()),
        aquakv_emulate.aquakv_reconstruct,
    )


# ---------------------------------------------------------------- real caches


@pytest.fixture(scope="module")
def stories_predictors(stories, predictor_root):
    return predictor_root(*stories)


def padded_batch(tok, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [tok(p, return_tensors="pt").input_ids[0] for p in prompts]
    n = max(len(r) for r in rows)
    ids = torch.stack([torch.cat([torch.zeros(n - len(r), dtype=torch.long), r]) for r in rows])
    return ids, torch.stack([(torch.arange(n) >= n - len(r)).long() for r in rows])


def run_chunks(model, method, ids, attn, cuts: list[int], steps: int, device="cpu") -> AquaKVCache:
    """A left-padded batch fed in chunks ``cuts`` (positions as ``generate`` numbers them), then greedy steps."""
    ids, attn = ids.to(device), attn.to(device)
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    with method.attach(model), torch.no_grad():
        cache = method.new_cache(model)
        for s, e in zip(cuts[:-1], cuts[1:], strict=True):
            out = model(input_ids=ids[:, s:e], attention_mask=attn[:, :e], position_ids=positions[:, s:e],
                        past_key_values=cache)  # fmt: skip
        token = out.logits[:, -1:].argmax(-1)
        for step in range(steps):
            mask = torch.cat([attn, torch.ones(len(ids), step + 1, dtype=attn.dtype, device=device)], 1)
            out = model(input_ids=token, attention_mask=mask, position_ids=positions[:, -1:] + step + 1,
                        past_key_values=cache)  # fmt: skip
            token = out.logits[:, -1:].argmax(-1)
    return cache


LONG = (
    "Once upon a time, a little fox saw a big red ball in the park. He wanted to play with it, so he ran to the tree."
)


def test_stories260k_every_layer_and_step_through_the_emulated_kernels(stories, stories_predictors, monkeypatch):
    """stories260K (GQA 8/4, head dim 8: the partner channels read one by one; a 32-channel group, 2-bit
    codes; layer 0 without predictors at 4 bits), a left-padded batch of two fed as chunks of 17 queries (a
    prompt: the backend hands it to the torch reference), 16 (RoPE from the forward's tables, through the kernel)
    and 7 (RoPE from the positions, masked), then 8 greedy steps: at every layer and forward the emulated
    decode + predictions equal ``dequantize_pair`` and the emulated attention the reference, on the cache's own
    state and mask."""
    monkeypatch.setenv("KVQUANT_PREDICTOR_DIR", str(stories_predictors))
    model, tok = stories
    checked = emulated(sms=4)
    name = register_checked(monkeypatch, checked)
    ids, attn = padded_batch(tok, [LONG, "Tom and Lily"])
    n = ids.shape[1]
    assert 1 < n - 33 < PROMPT_QUERIES
    cache = run_chunks(model, get_method("aquakv", window=4, backend=name), ids, attn, [0, 17, 33, n], steps=8)
    assert cache.backend == name and cache.layers[-1].n_codes > 30
    assert checked.seen == {
        "reconstruct": 11, "reconstruct predicted": 44, "attend q17 tables b2": 5, "attend q16 tables b2": 5,
        f"attend q{n - 33} positions b2": 5, "attend q1 positions b2": 5 * 8,
    }  # fmt: skip


def random_cache(n_layers, hkv, d, bits, group, sink, window, backend, seed=0, device="cpu") -> AquaKVCache:
    """An AQUA-KV cache of a Llama-shaped model (transformers' rotary module for head dim ``d``) with random
    predictors of calibration's scale on every layer past the first."""
    config = T.LlamaConfig(
        hidden_size=2 * hkv * d, num_attention_heads=2 * hkv, num_key_value_heads=hkv, head_dim=d,
        num_hidden_layers=n_layers,
    )  # fmt: skip
    c, gen = hkv * d, torch.Generator().manual_seed(seed)
    quant, pred = Higgs(c, bits, group), Predictors({})
    for i in range(1, n_layers):
        pred.k[i] = (torch.randn(c, c, generator=gen) * c**-0.5, 0.1 * torch.randn(c, generator=gen))
        pred.v[i] = (torch.randn(2 * c, c, generator=gen) * (2 * c) ** -0.5, 0.1 * torch.randn(c, generator=gen))
    get = backends.get_backend(backend)
    layers = [AquaKVLayer(i, quant, pred.k.get(i), pred.v.get(i), sink, window, None, get) for i in range(n_layers)]
    return AquaKVCache(layers, LlamaRotaryEmbedding(config).to(device), pred)


def drive(cache, b, hq, hkv, d, prefill, steps, q_lens=(1, 3), pad=True, seed=0, device="cpu"):
    """Prefill and decode steps through every layer (K with a per-channel offset, as real keys), each step's
    attention run through the layer's ``attend`` (``kvquant.attention``'s route) with queries of ``q_lens``
    rows: a left-padding mask, and a causal multi-row step."""
    gen = torch.Generator().manual_seed(seed)
    shift = torch.linspace(-1, 1, d)
    n_layers = len(cache.layers)
    for n in [prefill] + [1] * steps:
        for i in range(n_layers):
            k = (torch.randn(b, hkv, n, d, generator=gen) + shift) * (1 + i)
            v = torch.randn(b, hkv, n, d, generator=gen) + i
            layer = cache.layers[i]
            cache.update(k.to(device), v.to(device), i)
            if n != 1:
                continue
            length = layer.held_tokens()
            for q_len in q_lens:
                q = torch.randn(b, hq, q_len, d, generator=gen).to(device)
                mask = None
                if pad and q_len == 1:
                    mask = torch.ones(b, 1, 1, length, dtype=torch.bool)
                    for r in range(b):
                        mask[r, ..., : min(5 * r, length - 1)] = False
                    mask = mask.to(device)
                layer._attend_len = length
                layer.state.rope = layer.kernel_rope()
                layer.attend(None, q, mask, d**-0.5)


# (batch, q heads, kv heads, head_dim, bits, group, sink, window, prefill, decode steps, SMs): Llama-3's heads
# (D 128: partner channels one 32-byte run; 4 rows a tile), SmolLM2's (192 channels: the Paley factor in the
# decode; 3 rows), head dim 24 (partners one by one, 4 lanes a token) with groups of 48 splitting heads and
# 6-bit codes, MQA with 8-bit codes and 104 channels padded to 128 (no sinks), MHA with no window; few SMs
# split the workspace rows; tails throughout.
CASES = [
    (2, 32, 8, 128, 2, 1024, 4, 8, 300, 1, 16),
    (1, 9, 3, 64, 2, 1024, 4, 16, 100, 2, 132),
    (2, 6, 3, 24, 3, 48, 2, 8, 70, 2, 4),
    (2, 4, 1, 104, 4, 1024, 0, 8, 40, 1, 132),
    (1, 4, 4, 16, 2, 16, 4, 0, 30, 2, 132),
]


def case_id(c) -> str:
    return f"b{c[0]}-{c[1]}x{c[2]}-d{c[3]}-{c[4]}bit-g{c[5]}-L{c[8] + c[9]}-sm{c[10]}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_emulated_kernels_follow_the_torch_rule_on_llama_shaped_caches(case, monkeypatch):
    """Three layers (the first without predictors) with random predictors: at every layer and step the emulated
    decode + predictions equal ``dequantize_pair`` and the emulated attention (one query, a left-padded batch;
    a causal 3-query step) the reference, on the cache's state."""
    b, hq, hkv, d, bits, group, sink, window, prefill, steps, sms = case
    checked = emulated(sms)
    cache = random_cache(3, hkv, d, bits, group, sink, window, register_checked(monkeypatch, checked), seed=d)
    drive(cache, b, hq, hkv, d, prefill, steps, seed=prefill)
    assert checked.seen["reconstruct predicted"] == 2 * (1 + steps) and checked.seen["reconstruct"] == 1 + steps
    assert checked.seen[f"attend q1 positions b{b}"] == 3 * steps == checked.seen[f"attend q3 positions b{b}"]


def test_the_cases_cover_lanes_partners_tiles_and_splits():
    seen = set()
    for b, hq, hkv, d, bits, group, sink, window, prefill, steps, sms in CASES:
        quant = Higgs(hkv * d, bits, group)
        shape = higgs.rows_shape(hkv, d, hq, 1)
        rt = higgs.row_tile(shape["RM"], workspace=True)
        nc = prefill + steps - sink - window
        splits = higgs.plan((sink, nc, window), b * hkv, sms, d, higgs.tokens_in_flight(rt, workspace=True))
        seen |= {("lanes", higgs.lanes_per_token(d)), ("tile", rt), ("code splits", min(splits[1][0], 2))}
        seen |= {("aligned partners", d // 2 % 8 == 0), ("paley", quant.outer.shape[0] > 1), ("bits", bits)}
        seen |= {("split heads", group % d != 0), ("padded", quant.padded), ("no sinks", sink == 0)}
    want = {("lanes", 2), ("lanes", 4), ("lanes", 16), ("tile", 1), ("tile", 2), ("tile", 4), ("code splits", 2)}
    want |= {("aligned partners", True), ("aligned partners", False), ("paley", True), ("bits", 3), ("bits", 4)}
    want |= {("split heads", True), ("padded", True), ("no sinks", True)}
    assert want <= seen


def test_stories260k_through_the_emulated_kernels_follows_the_torch_backend(
    stories, stories_predictors, emulated_backend, monkeypatch
):
    """stories260K with the kernels' arithmetic as its AQUA-KV backend (``aquakv_emulate``: the decode, the same
    predictions, the rows kernel) against ``backend=torch``: greedy tokens equal over 24 steps past an 8-token
    window, and a left-padded batch of two fed the same tokens (same argmax, mean KL < 1e-6), as
    ``test_kernels_cupy_higgs.assert_follows_torch`` checks HIGGS."""
    monkeypatch.setenv("KVQUANT_PREDICTOR_DIR", str(stories_predictors))
    assert_follows_torch(*stories, emulated_backend, "aquakv", kl_bound=AQUAKV_KL)


# ---------------------------------------------------------------- CPU: launch, index and split helpers


def test_rows_shape_tiles_and_shared_memory():
    """A group per KV head (P = D, any quantizer group); tiles 1/2/4 at 4 tokens in flight (no 8-row tile:
    more rows take several 4-row tiles); shared memory without opt-in for every head dim."""
    assert higgs.rows_shape(8, 128, 32, 1) == {"G": 8, "hpg": 1, "P": 128, "g": 4, "RM": 4, "rows": [4] * 8}
    assert higgs.rows_shape(3, 64, 9, 2)["RM"] == 6
    assert higgs.ROWS_ROW_TILES == (1, 2, 4)
    assert [higgs.row_tile(r, workspace=True) for r in (1, 2, 3, 4, 5, 9)] == [1, 2, 4, 4, 4, 4]
    assert [higgs.tokens_in_flight(rt, workspace=True) for rt in higgs.ROWS_ROW_TILES] == [4, 4, 4]
    assert [higgs.kernel_name(rt, workspace=True) for rt in (1, 4)] == ["higgs_rows_r1", "higgs_rows_r4"]
    for d in range(8, 257, 8):
        for rt in higgs.ROWS_ROW_TILES:
            assert higgs.shared_bytes(d, rt, 0, workspace=True) <= 48 * 1024
    assert higgs.shared_bytes(128, 4, 0, workspace=True) == 4 * (2 * 4 * 4 * 4 + 2 * 8 * 4 + 8 * 4 * 8 * 16)


@pytest.mark.parametrize("p", [8, 16, 32, 40, 192, 512, 1024])
def test_decode_grid_and_shared_memory_cover_every_row(p):
    """``higgs_decode``: a row per lane group, every row of every group and side in one launch; its shared
    memory (grid, signs / √P, outer factor, two rounds of coordinates) without opt-in."""
    lanes = higgs.lane_groups(p)
    assert lanes * p <= higgs.ZBUF // 2  # one round of the CTA's coordinates in half the buffer
    for rows in (1, lanes - 1, lanes, lanes + 1, 4097):
        ctas, groups, sides = aquakv.decode_grid(rows, p, 3)
        assert (groups, sides) == (3, 2) and (ctas - 1) * lanes < rows <= ctas * lanes
    m = outer_factor(p).shape[0]
    assert aquakv.decode_shared_bytes(p, 256, m) == 4 * (512 + p + m * m + 2048) <= 48 * 1024


def test_add_product_adds_in_place_from_any_row_stride():
    """One ``addmm_`` over all rows, or one per batch row where the input's rows are a slice of a larger buffer."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(16, 12, generator=gen)
    big = torch.randn(2, 9, 16, generator=gen)
    for x in (big, big[:, 2:7], big[:1, 2:7]):
        out = torch.randn(x.shape[0], x.shape[1], 12, generator=gen)
        want, ptr = out + x @ w, out.data_ptr()
        aquakv.add_product(out, x, w)
        assert out.data_ptr() == ptr
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_tensors_are_copied_to_the_device_once():
    w = torch.randn(4, 4, dtype=torch.float64)
    got = aquakv.on_device(w, torch.device("cpu"))
    assert got.dtype == torch.float32 and aquakv.on_device(w, torch.device("cpu")) is got
    plain = torch.randn(3)
    assert aquakv.on_device(plain, torch.device("cpu")) is plain and aquakv.on_device(None, plain.device) is None
    from kvquant.quant import device

    key = (id(w), torch.device("cpu"), torch.float32)
    assert key in device._COPIES  # the copy kvquant.quant.device keeps for every caller
    del w
    assert key not in device._COPIES  # dropped with the tensor it copies


@pytest.mark.parametrize("shape", [(32, 2, 32), (192, 2, 1024), (100, 4, 1024), (128, 3, 48), (40, 3, 40)])
def test_emulated_decode_is_higgs_dequantize(shape):
    """``higgs_decode`` (emulated) equals ``Higgs.dequantize`` plus the bias: one group, the Paley factor (192),
    padding (100 → 128), groups of 48 over 128 channels (a partial last group), P 40."""
    channels, bits, group = shape
    quant = Higgs(channels, bits, group)
    gen = torch.Generator().manual_seed(channels)
    coded = quant.quantize(torch.randn(2, 7, channels, generator=gen) + torch.linspace(-1, 1, channels))
    bias = torch.randn(channels, generator=gen)
    out = torch.full((2, 7, channels), float("nan"))
    tables = (quant.grid, quant.signs, quant.outer, quant.code_bits, quant.group)
    aquakv_emulate.decode(coded.codes, coded.scales, *tables, bias, out)
    torch.testing.assert_close(out, quant.dequantize(coded) + bias, atol=2e-6, rtol=2e-5)


def test_limits_refuse_only_what_the_kernels_lack():
    """AQUA-KV is in the backend's formats (opt-in: ``auto`` does not pick it); ``limits`` passes stories260K,
    Llama-3 and SmolLM2 (any group, heads split or not) and names soft-capping, sliding windows, odd head dims
    and wide groups."""
    cupy = backends.get_backend("cupy")
    assert "aquakv" in cupy.formats and not cupy.auto_for("aquakv")
    assert cupy.kernel("aquakv_reconstruct") is aquakv.reconstruct and cupy.kernel("aquakv_encode") is aquakv.encode
    for geo in (KVGeometry(5, 8, 4, 8), KVGeometry(32, 32, 8, 128), KVGeometry(30, 9, 3, 64)):
        assert cupy.limits("aquakv", geo, get_method("aquakv").rule(geo)) == []
    geo = KVGeometry(n_layers=2, n_heads=8, n_kv_heads=4, head_dim=64)
    assert cupy.limits("aquakv", geo, HiggsRule(Higgs(256, 2, 96))) == []  # groups splitting heads
    assert higgs.limits("aquakv", geo, Higgs(256, 2, 96)) == []
    odd = KVGeometry(n_layers=2, n_heads=8, n_kv_heads=4, head_dim=60, sliding_window=4096, softcap=50.0)
    assert cupy.limits("aquakv", odd, Higgs(240, 2, 1024)) == [
        "attention-logit soft-capping (50.0)",
        "sliding-window layers (4096)",
        "heads of 60 channels (they need a multiple of 8 up to 256)",
    ]
    wide = Higgs(4096, 2, 4096)
    assert cupy.limits("aquakv", KVGeometry(2, 32, 32, 128), wide) == [
        "groups padded to 4096 channels (the decode needs a multiple of 8 up to 1024)"
    ]


def test_aquakv_resolves_to_cupy_and_its_cache_is_made(stories, stories_predictors, monkeypatch):
    """``aquakv`` on ``backend=cupy`` (the status and device faked for a CPU): its rule passes ``limits``."""
    import dataclasses

    monkeypatch.setenv("KVQUANT_PREDICTOR_DIR", str(stories_predictors))
    cupy = backends.get_backend("cupy")
    monkeypatch.setitem(
        backends._BACKENDS, "cupy", dataclasses.replace(cupy, status=lambda: (True, "ok"), device_type="cpu")
    )
    cache = get_method("aquakv", backend="cupy").new_cache(stories[0])
    assert cache.backend == "cupy" and cache.predictors is not None


def _state(backend: str, case=CASES[2]):
    """The last layer's state after decode steps through the emulated kernels (head dim 24, groups of 48, 6-bit
    codes), its rows and RoPE as attention reads them."""
    b, hq, hkv, d, bits, group, sink, window, prefill, steps, sms = case
    cache = random_cache(2, hkv, d, bits, group, sink, window, backend, seed=1)
    drive(cache, b, hq, hkv, d, prefill, steps, q_lens=())
    layer = cache.layers[-1]
    layer.state.rope = layer.kernel_rope()
    return layer.state, case


def test_states_the_kernel_cannot_read_are_refused(emulated_backend):
    state, (b, hq, hkv, d, *_rest) = _state(emulated_backend)
    aquakv.check_state(state, d, hkv)
    rope, rows = state.rope, state.rows
    state.rope = {}
    with pytest.raises(ValueError, match="without this step's RoPE inputs"):
        aquakv.check_state(state, d, hkv)
    state.rope = {**rope, "inv_freq": rope["inv_freq"][:4]}
    with pytest.raises(ValueError, match=r"inv_freq of shape \(4,\) over heads of 24"):
        aquakv.check_state(state, d, hkv)
    cos, sin = higgs_format.rope_tables(rope)
    state.rope = {"cos": cos[..., :8], "sin": sin[..., :8]}
    with pytest.raises(ValueError, match="RoPE tables of 8 channels over heads of 24"):
        aquakv.check_state(state, d, hkv)
    state.rope = rope
    state.rows = (rows[0][:, 1:], rows[1][:, 1:])
    with pytest.raises(ValueError, match="without this forward's fp32 rows"):
        aquakv.check_state(state, d, hkv)
    state.rows = None
    with pytest.raises(ValueError, match="without this forward's fp32 rows"):
        aquakv.check_state(state, d, hkv)
    with pytest.raises(ValueError, match="multiple of 8"):
        aquakv.check_state(state, 12, hkv)
    state.format = "higgs"
    with pytest.raises(ValueError, match="reads AQUA-KV states"):
        aquakv.check_state(state, d, hkv)


def test_a_prompt_takes_the_torch_reference_and_a_cpu_step_is_refused(emulated_backend):
    state, (b, hq, hkv, d, *_rest) = _state(emulated_backend)
    query = torch.randn(b, hq, PROMPT_QUERIES + 1, d)
    got, reads = aquakv.attend_aquakv(state, None, query, None, 0.25)
    assert torch.equal(got, higgs_format.attend(state, None, query, None, 0.25)[0]) and reads.k_widths is None
    with pytest.raises(ValueError, match="CUDA"):
        aquakv.attend_aquakv(state, None, query[:, :, :1], None, 0.25)
    with pytest.raises(ValueError, match="CUDA"):
        aquakv.reconstruct(state.qk.codes, state.qk.scales, state.qv.codes, state.qv.scales, grid=None, signs=None,
                           outer=None, code_bits=6, group=48, channels=hkv * d)  # fmt: skip


def test_emulated_rows_follow_their_positions(emulated_backend):
    """The workspace keys are rotated at their own positions: shifting them, a wrong ``rope_scale`` or rolled
    tables change the output; the tables of the same positions do not."""
    state, (b, hq, hkv, d, *_rest) = _state(emulated_backend)
    query = torch.randn(b, hq, 1, d)
    ref = higgs_format.attend(state, None, query, None, d**-0.5)[0]
    torch.testing.assert_close(higgs_emulate.emulate(state, query, None, d**-0.5), ref, atol=ATOL, rtol=RTOL)
    rope = state.rope
    for changed in ({"positions": rope["positions"] + 1}, {"rope_scale": 0.5}):
        state.rope = {**rope, **changed}
        assert not torch.allclose(higgs_emulate.emulate(state, query, None, d**-0.5), ref, atol=1e-4)
    cos, sin = higgs_format.rope_tables(rope)
    state.rope = {"cos": cos, "sin": sin}
    torch.testing.assert_close(higgs_emulate.emulate(state, query, None, d**-0.5), ref, atol=ATOL, rtol=RTOL)
    state.rope = {"cos": cos.roll(1, 1), "sin": sin.roll(1, 1)}
    assert not torch.allclose(higgs_emulate.emulate(state, query, None, d**-0.5), ref, atol=1e-4)


@pytest.mark.parametrize("rope", ["positions", "tables"])
def test_launch_arguments_match_the_kernels_signatures(rope, monkeypatch, emulated_backend):
    """Each argument of the rows kernel, the merge and ``higgs_decode`` has its parameter's type in higgs.cu, and
    the named sizes are the state's and the plan's: rows pointers set, no codes, no grid, no rotation back."""
    monkeypatch.setattr(higgs, "ptr", lambda t: np.uint64(0 if t is None else t.data_ptr()))  # CPU tensors
    monkeypatch.setattr(aquakv, "ptr", lambda t: np.uint64(0 if t is None else t.data_ptr()))
    state, (b, hq, hkv, d, bits, group, sink, window, *_rest) = _state(emulated_backend)
    if rope == "tables":
        cos, sin = higgs_format.rope_tables(state.rope)
        state.rope = {"cos": cos, "sin": sin}
    sms = 4
    query = torch.randn(b, hq, 1, d)
    (name, grid, shared, args), merge = higgs.launches(state, query, None, d**-0.5, sms)[0]
    shape = higgs.rows_shape(hkv, d, hq, 1)
    rt = higgs.row_tile(shape["RM"], workspace=True)
    parts = (state.n_sinks, state.n_codes, state.n_recent)
    splits = higgs.plan(parts, b * hkv * -(-shape["RM"] // rt), sms, d, higgs.tokens_in_flight(rt, workspace=True))
    assert name == f"higgs_rows_r{rt}" and grid == (sum(n for n, _ in splits), b * hkv, -(-shape["RM"] // rt))
    assert shared == higgs.shared_bytes(d, rt, 0, workspace=True)
    for kernel, got in ((name, args), (merge[0], merge[3])):
        assert [KINDS[type(x)] for x in got] == [kind for kind, _ in _signature(kernel)]
    given = {param: x for (_, param), x in zip(_signature(name), args, strict=True)}
    want = dict(zip(("ns", "nc", "nr", "n0", "chunk0", "n1", "chunk1"), (*parts, *splits[0], *splits[1]), strict=True))
    want |= {"chunk2": splits[2][1], "D": d, "P": d, "RM": shape["RM"], "G": hkv, "HPG": 1, "n_grid": 0, "om": 1}
    want |= {"rope_kind": 1 if rope == "positions" else 2, "lpt": higgs.lanes_per_token(d), "p": d}
    assert {key: int(given[key]) for key in want} == want
    assert given["krows"] == state.rows[0].data_ptr() and given["vrows"] == state.rows[1].data_ptr()
    assert not any(given[k] for k in ("kcodes", "vcodes", "kscale", "vscale", "grid", "qt", "signs", "outer"))
    merged = {param: x for (_, param), x in zip(_signature("higgs_merge"), merge[3], strict=True)}
    assert merged["n1"] == 0 and merged["n0"] == splits[0][0] and merged["n_split"] == sum(n for n, _ in splits)

    quant = state.quant
    out_k, out_v = (torch.empty(*state.qk.codes.shape[:2], hkv * d) for _ in range(2))
    tables = (quant.grid, quant.signs, quant.outer)
    bias = torch.randn(hkv * d)
    (dgrid, dshared, dargs), _held = aquakv.decode_launch(
        state.qk.codes, state.qk.scales, state.qv.codes, state.qv.scales, tables, quant.code_bits, quant.group,
        bias, None, out_k, out_v,
    )  # fmt: skip
    assert [KINDS[type(x)] for x in dargs] == [kind for kind, _ in _signature("higgs_decode")]
    named = {param: x for (_, param), x in zip(_signature("higgs_decode"), dargs, strict=True)}
    rows = state.qk.codes.shape[0] * state.qk.codes.shape[1]
    assert {k: int(named[k]) for k in ("rows", "cb", "G", "qgroup", "C", "P", "om", "lpt", "n_grid")} == {
        "rows": rows, "cb": quant.code_bits, "G": quant.n_groups, "qgroup": quant.group, "C": hkv * d,
        "P": quant.padded_group, "om": quant.outer.shape[0], "lpt": higgs.lanes_per_token(quant.padded_group),
        "n_grid": quant.grid.shape[0],
    }  # fmt: skip
    assert named["kbias"] == bias.data_ptr() and named["vbias"] == 0 and named["kout"] == out_k.data_ptr()
    assert dgrid == aquakv.decode_grid(rows, quant.padded_group, quant.n_groups)
    assert dshared == aquakv.decode_shared_bytes(quant.padded_group, quant.grid.shape[0], quant.outer.shape[0])


def test_the_kernels_are_in_higgs_cu():
    text = (SOURCE_DIR / "higgs.cu").read_text()
    names = set(re.findall(r"HIGGS_KERNEL\((\w+),", text)) | set(re.findall(r"(\w+)\(\n", text))
    assert {f"higgs_rows_r{rt}" for rt in higgs.ROWS_ROW_TILES} | {"higgs_decode"} <= names


def test_the_modules_import_without_cupy():
    code = "import sys; import kernels_cupy.aquakv, kernels_cupy.aquakv_emulate; assert 'cupy' not in sys.modules"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert done.returncode == 0, done.stderr.decode()


# ---------------------------------------------------------------- GPU: the kernels against the torch rule


def on_gpu(**tolerance) -> Checked:
    return Checked(aquakv.attend_aquakv, aquakv.reconstruct, **tolerance)


@gpu_test
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_kernels_follow_the_torch_rule_on_llama_shaped_caches(case, monkeypatch):
    """As the emulated test, on CUDA: ``higgs_decode`` + cuBLAS against ``dequantize_pair`` and ``higgs_rows_r*``
    against the reference at every layer and step (a left-padded batch, a causal 3-query step)."""
    b, hq, hkv, d, bits, group, sink, window, prefill, steps, sms = case
    checked = on_gpu(atol=5e-6, rtol=5e-5)
    name = register_checked(monkeypatch, checked, device_type="cuda")
    cache = random_cache(3, hkv, d, bits, group, sink, window, name, seed=d, device="cuda")
    drive(cache, b, hq, hkv, d, prefill, steps, seed=prefill, device="cuda")
    assert checked.seen["reconstruct predicted"] == 2 * (1 + steps)
    assert checked.seen[f"attend q1 positions b{b}"] == 3 * steps == checked.seen[f"attend q3 positions b{b}"]


@gpu_test
def test_kernels_follow_the_torch_rule_at_llama3_length():
    """A 4129-token Llama-3-shaped layer pair, batch 2 (several code splits): the rows kernel on fp16 and fp32
    queries against the reference on the same CUDA state."""
    cache = random_cache(2, 8, 128, 2, 1024, 4, 128, "cupy", seed=3, device="cuda")
    drive(cache, 2, 32, 8, 128, 4000, 129, q_lens=(), device="cuda")
    layer = cache.layers[-1]
    layer.state.rope = layer.kernel_rope()
    for dtype, tol in ((torch.float32, 5e-6), (torch.float16, 2e-3)):
        q = torch.randn(2, 32, 1, 128, device="cuda").to(dtype)
        mask = torch.ones(2, 1, 1, layer.held_tokens(), dtype=torch.bool, device="cuda")
        mask[1, ..., :37] = False
        got, _ = aquakv.attend_aquakv(layer.state, None, q, mask, 128**-0.5)
        ref = higgs_format.attend(layer.state, None, q.float(), mask, 128**-0.5)[0]
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), ref, atol=tol, rtol=10 * tol)


@gpu_test
def test_stories260k_every_layer_and_step_through_the_kernels(stories_predictors, monkeypatch):
    """stories260K on CUDA in fp32 through the kernels, checked at every call as the emulated test (an fp16 model's
    attention outputs are fp16: 2^-11 relative, past these bounds)."""
    from kvquant import load_model

    monkeypatch.setenv("KVQUANT_PREDICTOR_DIR", str(stories_predictors))
    model, tok = load_model("stories260k", device="cuda", dtype="float32")
    checked = on_gpu(atol=5e-6, rtol=5e-5)
    name = register_checked(monkeypatch, checked, device_type="cuda")
    ids, attn = padded_batch(tok, [LONG, "Tom and Lily"])
    method = get_method("aquakv", window=4, backend=name)
    cache = run_chunks(model, method, ids, attn, [0, 16, 19, ids.shape[1]], steps=8, device="cuda")
    assert cache.layers[-1].n_codes > 20 and checked.seen["attend q16 tables b2"] == 5


@gpu_test
@pytest.mark.parametrize("method_name", ["aquakv", "aquakv_v_only"])
def test_backend_cupy_generates_as_the_torch_backend_on_stories260k(method_name, stories_predictors, monkeypatch):
    """``backend=cupy`` on stories260K in fp32: as ``assert_follows_torch`` (greedy tokens equal, a left-padded
    batch with the same argmax, mean KL below ``AQUAKV_KL``)."""
    from kvquant import load_model

    model, tok = load_model("stories260k", device="cuda", dtype="float32")
    monkeypatch.setenv("KVQUANT_PREDICTOR_DIR", str(stories_predictors))
    assert_follows_torch(model, tok, "cupy", method_name, kl_bound=AQUAKV_KL)
