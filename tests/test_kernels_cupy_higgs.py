"""The CuPy kernel over HIGGS codes, keys coded after RoPE (``higgs_post_rope``) or before it (``higgs``: rebuilt
and re-rotated per token) (kernels_cupy/higgs.cu): on CPU, the compile for sm_80/sm_90 (no warnings, no
spills), every launch, index and split helper, and the kernel emulated line for line in torch
(kernels_cupy.higgs_emulate) against the torch reference on states the real methods wrote; on a GPU, the
kernel itself against the reference and ``backend=cupy`` on stories260K."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers as T
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kernels_cupy_codes import gpu_test, left_padding, nvcc_compile
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from kernels_cupy.higgs import (
    MIN_CHUNK,
    PRE_ROW_TILES,
    PRE_TOKENS_IN_FLIGHT,
    PROMPT_QUERIES,
    ROW_TILES,
    ROWS_ROW_TILES,
    TOKENS_IN_FLIGHT,
    attend_higgs,
    butterfly_stages,
    check_state,
    group_codes,
    group_shape,
    lane_groups,
    lanes_per_token,
    launches,
    limits,
    placed,
    plan,
    quant_tensors,
    query_rows,
    rope_kind,
    rope_partner,
    rope_sincos,
    rope_tensors,
    rotated_queries,
    rotation_entries,
    row_tile,
    shared_bytes,
    split_range,
    tokens_in_flight,
)
from kernels_cupy.higgs_emulate import emulate
from kernels_cupy.loader import SOURCE_DIR
from kvquant.cache import KVGeometry
from kvquant.formats import higgs as higgs_format
from kvquant.methods.aquakv.cache import AquaKVCache
from kvquant.methods.aquakv.layer import AquaKVLayer
from kvquant.quant import bitpack
from kvquant.quant.hadamard import hadamard_matrix, outer_factor
from kvquant.quant.higgs import Higgs


def higgs_layer(hkv, d, bits, group, sink, window, b, prefill, steps, post_rope=True, seed=0):
    """One layer of a ``higgs_post_rope`` cache (``post_rope`` False: ``higgs``'s) fed a prefill and decode
    steps of keys with a per-channel offset, as real keys have; its RoPE inputs set as a kernel step sets them."""
    config = T.LlamaConfig(
        hidden_size=2 * hkv * d, num_attention_heads=2 * hkv, num_key_value_heads=hkv, head_dim=d, num_hidden_layers=1
    )
    layer = AquaKVLayer(0, Higgs(hkv * d, bits, group), None, None, sink, window)
    cache = AquaKVCache([layer], LlamaRotaryEmbedding(config), None, post_rope=post_rope)
    gen = torch.Generator().manual_seed(seed)
    shift = torch.linspace(-1, 1, d)
    for n in [prefill] + [1] * steps:
        cache.update(torch.randn(b, hkv, n, d, generator=gen) + shift, torch.randn(b, hkv, n, d, generator=gen), 0)
    layer.state.rope = layer.kernel_rope()
    return layer


# ---------------------------------------------------------------- CPU: compile


@pytest.fixture(scope="module")
def compiled():
    """sm_80 PTX, and an sm_90 cubin with ``ptxas -v``'s log."""
    return nvcc_compile("higgs.cu", "sm_80"), nvcc_compile("higgs.cu", "sm_90")


def test_higgs_cu_compiles_for_sm80_and_sm90_without_warnings(compiled):
    ptx, cubin = compiled
    assert not ptx.log.strip(), ptx.log
    assert ".entry higgs_r1" in ptx.ptx and ".entry higgs_merge" in ptx.ptx
    assert ".entry higgs_rows_r4" in ptx.ptx and ".entry higgs_decode" in ptx.ptx
    assert not cubin.warnings(), cubin.log


def test_ptxas_shows_no_spills_on_sm90(compiled):
    """``ptxas -v`` on every kernel: no stack frame, no spill (the numbers in the README)."""
    cubin = compiled[1]
    names = {f"higgs_r{rt}" for rt in ROW_TILES} | {f"higgs_pre_r{rt}" for rt in PRE_ROW_TILES}
    names |= {f"higgs_rows_r{rt}" for rt in ROWS_ROW_TILES} | {"higgs_decode"}  # AQUA-KV (test_kernels_cupy_aquakv)
    assert set(cubin.entries()) == names | {"higgs_merge"}
    frames = cubin.frames()
    assert len(frames) == len(cubin.entries()) and all(f == (0, 0, 0) for f in frames), cubin.log


# ---------------------------------------------------------------- CPU: launch, index and split helpers


def test_lane_geometry_and_row_tiles():
    assert [row_tile(r) for r in (1, 2, 3, 4, 5, 8, 9, 32)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert set(TOKENS_IN_FLIGHT) == set(ROW_TILES)
    assert [lanes_per_token(p) for p in (8, 16, 24, 32, 128, 192, 256, 512, 1024)] == [1, 2, 4, 4, 16, 32, 32, 64, 128]
    for p in range(8, 1025, 8):
        lpt = lanes_per_token(p)
        assert lpt * 8 >= p > lpt * 4 and (lpt <= 32 and 32 % lpt == 0 or lpt in (64, 128))
        assert lane_groups(p) * lpt == 128
        for rt in ROW_TILES:
            assert shared_bytes(p, rt, 256) <= 48 * 1024  # no opt-in needed
        m = outer_factor(p).shape[0] if p <= 1024 and _has_hadamard(p) else 1
        for rt in PRE_ROW_TILES:
            assert shared_bytes(p, rt, 256, pre=True, m=m) <= 48 * 1024
            assert shared_bytes(p, rt, 256, pre=True, m=m) >= 4 * (2 * 256 + p + m * m + 2 * 1024)  # + 2 rounds
            assert lane_groups(p) * p <= 1024  # one round of rebuild_key's coordinates in half its ZBUF


def _has_hadamard(p: int) -> bool:
    try:
        outer_factor(p)
    except ValueError:
        return False
    return True


def test_pre_rope_row_tiles_and_tokens_in_flight():
    """The pre-RoPE kernels: tiles 1, 4, 8 (a row count takes the smallest that holds it), fewer tokens in flight."""
    assert PRE_ROW_TILES == (1, 4, 8) and set(PRE_TOKENS_IN_FLIGHT) == set(PRE_ROW_TILES)
    assert [row_tile(r, pre=True) for r in (1, 2, 3, 4, 5, 8, 9, 32)] == [1, 4, 4, 4, 8, 8, 8, 8]
    assert [tokens_in_flight(rt) for rt in ROW_TILES] == [4, 4, 4, 2]
    assert [tokens_in_flight(rt, pre=True) for rt in PRE_ROW_TILES] == [2, 2, 1]
    with pytest.raises(KeyError):
        tokens_in_flight(2, pre=True)


@pytest.mark.parametrize("p", [1, 2, 4, 8, 16, 32, 64, 256, 512, 1024])
def test_butterfly_stages_and_their_sum_are_the_sylvester_transform(p):
    """Strides 1, 2, 4 in the lane, up to 128 by shuffle, 256 and 512 through shared memory; the stages as
    ``rebuild_key`` runs them (partner ``j ^ h``, ``partner − x`` where bit ``h`` is set) give ``S_p``."""
    stages = butterfly_stages(p)
    assert [h for h, _ in stages] == [1 << i for i in range(p.bit_length() - 1)]
    assert all(where == ("lane" if h < 8 else "warp" if h < 256 else "shared") for h, where in stages)
    j = torch.arange(p)
    x = torch.eye(p)
    for h, _ in stages:
        other = x[..., j ^ h]
        x = torch.where((j & h) != 0, other - x, x + other)
    assert torch.equal(x, hadamard_matrix(p) if p > 1 else torch.ones(1, 1))


@pytest.mark.parametrize("d", [8, 16, 64, 128, 256])
def test_rope_partner_is_rotate_half_per_head(d):
    """Over heads of ``d`` side by side, ``sign · k[partner]`` is ``rotate_half`` of each head."""
    from kvquant.quant.rope import rotate_half

    c = torch.arange(3 * d)
    partner, sign = rope_partner(c, d)
    k = torch.randn(5, 3 * d)
    want = rotate_half(k.view(5, 3, d)).reshape(5, 3 * d)
    assert torch.equal(sign * k[:, partner], want)
    assert torch.equal(partner // d, c // d)


def test_rope_sincos_matches_sin_and_cos_at_any_position():
    """``higgs_sincos`` (in torch) within 2 fp32 ulps of float64 sin/cos of the same fp32 angle, positions up
    to 2^20 times Llama's inverse frequencies (``rint`` halves to even, as CUDA's)."""
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    far = torch.randint(0, 1 << 20, (2048,), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(0, 4096), far])
    angle = pos.float().unsqueeze(-1) * inv_freq
    angle = torch.cat([angle.flatten(), torch.tensor([0.0, -0.7853982, 0.7853982, 2.3561945, -3.1415927, 1e5])])
    sin, cos = rope_sincos(angle)
    assert sin.dtype == cos.dtype == torch.float32
    ulp = torch.finfo(torch.float32).eps
    torch.testing.assert_close(sin.double(), angle.double().sin(), atol=2 * ulp, rtol=0)
    torch.testing.assert_close(cos.double(), angle.double().cos(), atol=2 * ulp, rtol=0)


def test_rope_kind_and_tensors_of_each_rope_form():
    """``rope_kind``: 0 after RoPE or before any code, 1 positions, 2 tables; ``rope_tensors`` gives the
    kernel's int32 positions ``[B, nc]`` / fp32 ``inv_freq`` or fp32 tables ``[B, nc, D]``, contiguous."""
    post = higgs_layer(2, 16, 2, 1024, 4, 8, 2, 30, 1)
    assert rope_kind(post.state) == 0
    assert rope_tensors(post.state, 2, 16, torch.device("cpu"))["positions"] is None
    empty = higgs_layer(2, 16, 2, 1024, 4, 8, 2, 6, 0, post_rope=False)
    assert empty.state.qk is None and rope_kind(empty.state) == 0
    pre = higgs_layer(2, 16, 2, 1024, 4, 8, 2, 30, 1, post_rope=False)
    nc = pre.state.n_codes
    assert rope_kind(pre.state) == 1
    got = rope_tensors(pre.state, 2, 16, torch.device("cpu"))
    assert got["positions"].dtype == torch.int32 and got["positions"].shape == (2, nc)
    assert got["positions"].is_contiguous() and got["inv_freq"].shape == (8,) and got["cos"] is None
    assert torch.equal(got["positions"], pre.state.rope["positions"].int())
    assert got["rope_scale"] == pre.state.rope["rope_scale"]
    cos, sin = higgs_format.rope_tables(pre.state.rope)
    pre.state.rope = {"cos": cos[:1], "sin": sin[:1]}  # a table broadcast over the batch
    assert rope_kind(pre.state) == 2
    got = rope_tensors(pre.state, 2, 16, torch.device("cpu"))
    assert got["cos"].shape == got["sin"].shape == (2, nc, 16) and got["cos"].is_contiguous()
    assert got["positions"] is None and torch.equal(got["sin"][1], sin[0])


@settings(max_examples=200, deadline=None)
@given(
    st.tuples(st.integers(0, 8), st.integers(0, 40000), st.integers(0, 300)),
    st.integers(1, 4096),
    st.sampled_from([1, 16, 132]),
    st.sampled_from([8, 32, 192, 512, 1024]),
    st.sampled_from(sorted(set(TOKENS_IN_FLIGHT.values()))),
)
def test_plan_and_splits_cover_each_part_in_whole_steps(parts, ctas, sms, p, u):
    """Every key in exactly one split, in order; no split straddles two parts; chunks are whole steps."""
    splits = plan(parts, ctas, sms, p, u)
    covered = []
    for (n_split, chunk), n in zip(splits, parts, strict=True):
        assert chunk % (lane_groups(p) * u) == 0
        assert n_split == 0 if n == 0 else (n_split - 1) * chunk < n <= n_split * chunk
    assert splits[1][0] <= max(1, -(-parts[1] // MIN_CHUNK))
    starts = [0, parts[0], parts[0] + parts[1]]
    for split in range(sum(s for s, _ in splits)):
        part, first, end = split_range(split, parts, splits)
        assert starts[part] <= first < end <= starts[part] + parts[part]
        covered.extend(range(first, end))
    assert covered == list(range(sum(parts)))
    with pytest.raises(ValueError, match="beyond"):
        split_range(sum(s for s, _ in splits), parts, splits)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([4, 6, 8]), st.integers(1, 4), st.sampled_from([8, 16, 24, 40, 64, 192]), st.data())
def test_lanes_read_codes_as_bitpack_packs_them(code_bits, groups, p, data):
    """Each lane's word (2, 3 or 4 bytes from its first code's byte) gives the codes ``bitpack`` packed."""
    n = groups * p // 2
    codes = torch.tensor(data.draw(st.lists(st.integers(0, (1 << code_bits) - 1), min_size=2 * n, max_size=2 * n)))
    packed = bitpack.pack(codes.view(2, n), code_bits)
    for gi in range(groups):
        assert torch.equal(group_codes(packed, code_bits, gi, p), codes.view(2, n)[:, gi * p // 2 : (gi + 1) * p // 2])


def test_group_shape_and_query_rows_with_a_short_last_group():
    quant = Higgs(3 * 32, 2, 64)  # 3 heads of 32 in groups of 2: the last group holds one head
    shape = group_shape(quant, 3, 32, 6, 2)
    assert shape == {"G": 2, "hpg": 2, "P": 64, "g": 2, "RM": 8, "rows": [8, 4]}
    q = torch.randn(2, 6, 2, 32)
    rows = query_rows(q, shape)
    assert rows.shape == (2, 2, 8, 32) and not rows[:, 1, 4:].any()
    assert torch.equal(rows.view(2, 16, 32)[:, :12], q.view(2, 12, 32))
    put = placed(rows, shape, 2)
    for r in range(8):
        head = r // 4
        assert torch.equal(put[:, :, r, head * 32 : head * 32 + 32], rows[:, :, r])
        assert not put[:, :, r, (1 - head) * 32 : (2 - head) * 32].any()


@pytest.mark.parametrize(
    ("hkv", "d", "bits", "group"), [(4, 8, 2, 1024), (3, 64, 3, 1024), (2, 128, 4, 1024), (5, 8, 2, 40)]
)
def test_rotated_queries_score_the_dequantized_keys(hkv, d, bits, group):
    """``s_t · (qt · y_t)`` equals ``q · k_t`` over the dequantized key of the row's head (P of 192 and
    40: the Paley factor)."""
    quant = Higgs(hkv * d, bits, group)
    x = torch.randn(7, hkv * d)
    coded = quant.quantize(x)
    keys = quant.dequantize(coded).view(7, hkv, d)
    hq = 2 * hkv
    shape = group_shape(quant, hkv, d, hq, 1)
    q = torch.randn(1, hq, 1, d)
    qt = rotated_queries(query_rows(q, shape), quant.signs, shape, 1)[0]  # [G, RM, P]
    p = shape["P"]
    for gi in range(shape["G"]):
        y = quant.grid[group_codes(coded.codes, quant.code_bits, gi, p)].view(7, p)
        got = coded.scales[:, gi].float().unsqueeze(-1) * (y @ qt[gi].T)  # [tokens, RM]
        for r in range(shape["rows"][gi]):
            head = gi * shape["hpg"] + r // 2
            torch.testing.assert_close(got[:, r], keys[:, head] @ q[0, gi * shape["RM"] + r, 0], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("p", [8, 32, 40, 192, 512, 640, 768, 1024])
def test_the_merge_forms_the_rotation_entries_of_the_quantizer(p):
    outer = outer_factor(p)
    got = rotation_entries(outer, p // outer.shape[0], torch.arange(p))
    assert torch.equal(got, hadamard_matrix(p))


def test_quantizer_tensors_are_copied_once_per_device():
    quant = Higgs(32, 2, 32)
    got = quant_tensors(quant, torch.device("cpu"))
    assert quant_tensors(quant, torch.device("cpu")) is got
    assert torch.equal(got.grid, quant.grid) and torch.equal(got.signs, quant.signs) and got.outer.shape == (1, 1)


def test_backend_cupy_reads_higgs_and_its_limits():
    """Registered for ``higgs`` (opt-in: ``auto`` does not pick it) and ``aquakv`` (its own limits:
    test_kernels_cupy_aquakv); ``limits`` passes ``higgs_post_rope``'s quantizer on stories260K's and Llama-3's
    geometry and names what it lacks."""
    from kvquant import get_method
    from kvquant.backends import get_backend

    cupy = get_backend("cupy")
    assert "higgs" in cupy.formats and "aquakv" in cupy.formats and not cupy.auto_for("higgs")
    for geo in (KVGeometry(5, 8, 4, 8), KVGeometry(32, 32, 8, 128)):
        assert cupy.limits("higgs", geo, get_method("higgs_post_rope").rule(geo)) == []
    geo = KVGeometry(n_layers=2, n_heads=8, n_kv_heads=4, head_dim=64)
    assert cupy.limits("aquakv", geo, Higgs(256, 2, 96)) == []  # decoded rows: groups may split heads
    odd = KVGeometry(n_layers=2, n_heads=8, n_kv_heads=4, head_dim=60, sliding_window=4096, softcap=50.0)
    assert limits("higgs", odd, Higgs(240, 2, 1024)) == [
        "attention-logit soft-capping (50.0)",
        "sliding-window layers (4096)",
        "heads of 60 channels (they need a multiple of 8 up to 256)",
    ]
    assert limits("higgs", geo, Higgs(256, 2, 96)) == [
        "groups of 96 channels padded to 96 over heads of 64 "
        "(they need whole heads, padded to a multiple of 8 up to 1024)"
    ]

    from kvquant.formats.higgs import HiggsRule

    for post_rope in (False, True):
        assert limits("higgs", geo, HiggsRule(Higgs(256, 2, 1024), post_rope=post_rope)) == []
        assert cupy.limits("higgs", geo, HiggsRule(Higgs(256, 2, 1024), post_rope=post_rope)) == []
    assert limits("higgs", geo, HiggsRule(Higgs(256, 2, 96), post_rope=False)) == [
        "groups of 96 channels padded to 96 over heads of 64 "
        "(they need whole heads, padded to a multiple of 8 up to 1024)"
    ]


def test_method_higgs_is_accepted_when_its_cache_is_made(stories, monkeypatch):
    """``higgs`` (pre-RoPE keys) on ``backend=cupy``: its ``HiggsRule`` passes ``limits``, the cache is made."""
    import kvquant.backends as backends
    from kvquant import get_method

    cupy = backends.get_backend("cupy")
    monkeypatch.setitem(
        backends._BACKENDS, "cupy", dataclasses.replace(cupy, status=lambda: (True, "ok"), device_type="cpu")
    )
    cache = get_method("higgs", backend="cupy").new_cache(stories[0])
    assert cache.backend == "cupy" and not cache.post_rope


def test_states_the_kernel_cannot_read_are_refused():
    pre = higgs_layer(2, 16, 2, 1024, 4, 8, 1, 30, 1, post_rope=False)
    assert pre.state.qk is not None and "positions" in pre.state.rope
    check_state(pre.state, 16, 2)
    rope = pre.state.rope
    pre.state.rope = {}  # codes, but no RoPE inputs for this step
    with pytest.raises(ValueError, match="without this step's RoPE inputs"):
        check_state(pre.state, 16, 2)
    pre.state.rope = {**rope, "inv_freq": rope["inv_freq"][:4]}  # partial rotary
    with pytest.raises(ValueError, match=r"inv_freq of shape \(4,\) over heads of 16"):
        check_state(pre.state, 16, 2)
    cos, sin = higgs_format.rope_tables(rope)
    pre.state.rope = {"cos": cos, "sin": sin}
    check_state(pre.state, 16, 2)
    pre.state.rope = {"cos": cos[..., :8], "sin": sin[..., :8]}
    with pytest.raises(ValueError, match="RoPE tables of 8 channels over heads of 16"):
        check_state(pre.state, 16, 2)
    post = higgs_layer(2, 16, 2, 1024, 4, 8, 1, 30, 1)
    check_state(post.state, 16, 2)
    post.state.format = "aquakv"
    with pytest.raises(ValueError, match="AQUA-KV"):
        check_state(post.state, 16, 2)
    with pytest.raises(ValueError, match="multiple of 8"):
        check_state(higgs_layer(2, 12, 2, 1024, 4, 8, 1, 30, 1).state, 12, 2)


def test_a_prompt_takes_the_torch_reference_and_a_cpu_step_is_refused():
    layer = higgs_layer(2, 16, 2, 1024, 4, 8, 1, 40, 0)
    query = torch.randn(1, 4, PROMPT_QUERIES + 1, 16)
    got, reads = attend_higgs(layer.state, None, query, None, 0.25)
    assert torch.equal(got, higgs_format.attend(layer.state, None, query, None, 0.25)[0]) and reads.k_widths is None
    with pytest.raises(ValueError, match="CUDA"):
        attend_higgs(layer.state, None, query[:, :, :1], None, 0.25)


def test_the_module_imports_without_cupy():
    code = "import sys; import kernels_cupy.higgs, kernels_cupy.higgs_emulate; assert 'cupy' not in sys.modules"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert done.returncode == 0, done.stderr.decode()


# ---------------------------------------------------------------- CPU: the kernel emulated against the reference

# (batch, q heads, kv heads, head_dim, bits, group, sink, window, prefill, decode steps, q_len, mask, SMs)
CASES = [
    (1, 8, 4, 8, 2, 1024, 4, 8, 40, 2, 1, None, 132),  # stories260K's shape: P 32, 4 lanes a token
    (2, 8, 2, 64, 3, 1024, 4, 16, 700, 2, 1, "pad", 132),  # GQA, batch 2, left padding, 3 code splits, 6-bit codes
    (2, 6, 3, 32, 4, 64, 2, 16, 100, 1, 1, "additive", 8),  # 8-bit codes, 2 groups, the last one head short
    (1, 32, 8, 128, 2, 1024, 4, 16, 300, 1, 1, None, 132),  # Llama-3's shape: P 1024 over 4 warps, 4 row tiles
    (2, 8, 4, 128, 3, 1024, 0, 8, 300, 2, 1, "pad", 132),  # P 512 over 2 warps, no sinks
    (1, 9, 3, 64, 2, 1024, 4, 16, 100, 2, 1, None, 132),  # SmolLM2's: P 192 (Paley 12 x 16), 9 rows in 2 tiles
    (2, 10, 5, 8, 3, 8, 2, 0, 30, 2, 1, None, 132),  # a group a head (P 8, 1 lane a token), no window
    (2, 10, 5, 8, 3, 40, 2, 8, 70, 2, 2, "pad", 16),  # P 40 (Paley 20 x 2), a masked two-token step
    (1, 8, 2, 32, 2, 1024, 4, 8, 90, 1, 3, None, 132),  # a causal three-token step
    (2, 4, 2, 16, 2, 1024, 4, 16, 10, 1, 1, "pad", 132),  # nothing coded yet: sinks and window only
    (3, 8, 4, 8, 2, 1024, 4, 8, 1200, 1, 1, "pad", 4),  # batch 3 left-padded, few SMs: 5 code splits
    (2, 4, 4, 16, 2, 16, 2, 8, 60, 1, 1, "pad", 132),  # MHA, a group a head: one row a group (P 16)
]


def case_id(c) -> str:
    return f"b{c[0]}-{c[1]}x{c[2]}-d{c[3]}-{c[4]}bit-g{c[5]}-L{c[8] + c[9]}-q{c[10]}-{c[11]}-sm{c[12]}"


def _query_and_mask(case, length, device="cpu"):
    b, hq, hkv, d, bits, group, sink, window, prefill, steps, q_len, mask_kind, sms = case
    gen = torch.Generator().manual_seed(prefill + d)
    query = torch.randn(b, hq, q_len, d, generator=gen)
    mask = None
    if mask_kind == "pad":
        mask = left_padding(b, length, [0, 5, 9][:b])
        if q_len > 1:
            mask = mask & torch.ones(q_len, length, dtype=torch.bool).tril(length - q_len)
    elif mask_kind == "additive":
        mask = torch.randn(b, 1, q_len, length, generator=gen)
        mask[..., :3] = float("-inf")
    return query.to(device), None if mask is None else mask.to(device)


def _layer(case, rope="post_rope"):
    """The case's layer: ``higgs_post_rope``'s (``rope="post_rope"``), or ``higgs``'s with its RoPE given as
    ``"positions"`` (as the layer sets it) or as ``"tables"`` (``{"cos", "sin"}`` from the same positions)."""
    b, hq, hkv, d, bits, group, sink, window, prefill, steps, q_len, mask_kind, sms = case
    post_rope = rope == "post_rope"
    layer = higgs_layer(hkv, d, bits, group, sink, window, b, prefill, steps, post_rope, seed=prefill + steps)
    if rope == "tables" and layer.state.qk is not None:
        cos, sin = higgs_format.rope_tables(layer.state.rope)
        layer.state.rope = {"cos": cos, "sin": sin}
    return layer


def _length(state) -> int:
    return state.n_sinks + state.n_codes + state.n_recent


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_emulated_kernel_equals_the_reference(case):
    d, sms = case[3], case[12]
    state = _layer(case).state
    query, mask = _query_and_mask(case, _length(state))
    ref = higgs_format.attend(state, None, query, mask, d**-0.5)[0]
    got = emulate(state, query, mask, d**-0.5, sms=sms)
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("rope", ["positions", "tables"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_emulated_kernel_equals_the_reference_with_keys_coded_before_rope(case, rope):
    """Method ``higgs``'s states (keys coded before RoPE, rebuilt per token with RoPE at their positions),
    RoPE given as the layer gives it (positions, ``inv_freq``, ``rope_scale``) or as ``cos``/``sin`` tables."""
    d, sms = case[3], case[12]
    state = _layer(case, rope).state
    assert rope_kind(state) == (0 if state.qk is None else {"positions": 1, "tables": 2}[rope])
    query, mask = _query_and_mask(case, _length(state))
    ref = higgs_format.attend(state, None, query, mask, d**-0.5)[0]
    got = emulate(state, query, mask, d**-0.5, sms=sms)
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("rope", ["positions", "tables"])
def test_emulated_pre_rope_keys_follow_their_positions(rope):
    """The rebuilt keys are rotated at their own positions: shifting them (or the tables) by one position
    changes the output; a wrong ``rope_scale`` too."""
    case = CASES[1]
    state = _layer(case, rope).state
    query, mask = _query_and_mask(case, _length(state))
    ref = higgs_format.attend(state, None, query, mask, 64**-0.5)[0]
    torch.testing.assert_close(emulate(state, query, mask, 64**-0.5), ref, atol=2e-6, rtol=2e-5)
    if rope == "positions":
        state.rope = {**state.rope, "positions": state.rope["positions"] + 1}
        assert not torch.allclose(emulate(state, query, mask, 64**-0.5), ref, atol=1e-4)
        state.rope = {**state.rope, "positions": state.rope["positions"] - 1, "rope_scale": 0.5}
    else:
        state.rope = {"cos": state.rope["cos"].roll(1, 1), "sin": state.rope["sin"].roll(1, 1)}
    assert not torch.allclose(emulate(state, query, mask, 64**-0.5), ref, atol=1e-4)


def test_the_cases_cover_splits_lanes_and_parts():
    seen = set()
    for case in CASES:
        b, hq, hkv, d, bits, group, sink, window, prefill, steps, q_len, mask_kind, sms = case
        state = _layer(case).state
        shape = group_shape(state.quant, hkv, d, hq, q_len)
        rt, parts = row_tile(shape["RM"]), (state.n_sinks, state.n_codes, state.n_recent)
        splits = plan(parts, b * shape["G"] * -(-shape["RM"] // rt), sms, shape["P"], TOKENS_IN_FLIGHT[rt])
        seen |= {("splits", min(splits[1][0], 5)), ("lanes", min(lanes_per_token(shape["P"]), 64))}
        m = state.quant.outer.shape[0]
        seen |= {("stages", where) for _, where in butterfly_stages(shape["P"] // m)} | {("paley", m > 1)}
        seen |= {("pre tiles", row_tile(shape["RM"], pre=True))}
        seen |= {
            ("bits", state.quant.code_bits),
            ("tiles", shape["RM"] > rt),
            ("short", shape["rows"][-1] < shape["RM"]),
        }
        seen |= {("no sinks", not parts[0]), ("no window", not parts[2])}
    want = {("splits", 0), ("splits", 1), ("splits", 3), ("splits", 5), ("lanes", 1), ("lanes", 4), ("lanes", 64)}
    want |= {("bits", 6), ("bits", 8), ("tiles", True), ("short", True), ("no sinks", True), ("no window", True)}
    want |= {("stages", "lane"), ("stages", "warp"), ("stages", "shared"), ("paley", True)}
    want |= {("pre tiles", rt) for rt in PRE_ROW_TILES}
    assert want <= seen


def _signature(kernel: str) -> list[tuple[str, str]]:
    """``(type, name)`` of each parameter of a kernel in higgs.cu (the attention kernels' macro, ``higgs_merge`` or
    ``higgs_decode``)."""
    text = (SOURCE_DIR / "higgs.cu").read_text().replace("\\\n", "\n")
    head = f"{kernel}(" if kernel in ("higgs_merge", "higgs_decode") else "NAME("
    params = text[text.index(head) + len(head) : text.index(") {", text.index(head))].split(",")
    out = []
    for param in (" ".join(x.split()) for x in params):
        kind, name = param.rsplit(" ", 1)
        out.append(("ptr" if "*" in kind else kind.replace("const ", ""), name))
    return out


KINDS = {np.uint64: "ptr", np.int32: "int", np.int64: "long long", np.float32: "float"}


@pytest.mark.parametrize("rope", ["post_rope", "positions", "tables"])
@pytest.mark.parametrize("case", [CASES[i] for i in (1, 3, 7, 9)], ids=case_id)
def test_launch_arguments_match_the_kernels_signatures(case, rope, monkeypatch):
    """Each argument of both launches has its parameter's type, and the named sizes are the state's and the
    plan's (a misordered argument would only show on a GPU otherwise); keys coded before RoPE take the
    ``higgs_pre_r*`` kernels with their RoPE inputs."""
    import kernels_cupy.higgs as module

    monkeypatch.setattr(module, "ptr", lambda t: np.uint64(0 if t is None else t.data_ptr()))  # CPU tensors
    b, hq, hkv, d, q_len, sms = case[0], case[1], case[2], case[3], case[10], case[12]
    state = _layer(case, rope).state
    query, mask = _query_and_mask(case, _length(state))
    (name, grid, shared, args), merge = launches(state, query, mask, d**-0.5, sms)[0]
    shape = group_shape(state.quant, hkv, d, hq, q_len)
    kind = rope_kind(state)
    pre = kind != 0
    rt = row_tile(shape["RM"], pre)
    parts = (state.n_sinks, state.n_codes, state.n_recent)
    splits = plan(parts, b * shape["G"] * -(-shape["RM"] // rt), sms, shape["P"], tokens_in_flight(rt, pre))
    for kernel, got in ((name, args), (merge[0], merge[3])):
        params = _signature(kernel)
        assert [KINDS[type(x)] for x in got] == [kind for kind, _ in params]
    named = {param: int(x) for (_, param), x in zip(_signature(name), args, strict=True)}
    want = dict(zip(("ns", "nc", "nr", "n0", "chunk0", "n1", "chunk1"), (*parts, *splits[0], *splits[1]), strict=True))
    want |= {"chunk2": splits[2][1], "cb": state.quant.code_bits, "D": d, "P": shape["P"], "RM": shape["RM"]}
    want |= {"G": shape["G"], "HPG": shape["hpg"], "g": hq // hkv, "Q": q_len, "lpt": lanes_per_token(shape["P"])}
    m = state.quant.outer.shape[0]
    want |= {"rope_kind": kind, "om": m, "p": shape["P"] // m}
    assert {key: named[key] for key in want} == want
    given = {param: x for (_, param), x in zip(_signature(name), args, strict=True)}
    assert bool(given["positions"]) == (kind == 1) and bool(given["inv_freq"]) == (kind == 1)
    assert bool(given["rope_cos"]) == bool(given["rope_sin"]) == (kind == 2)
    assert bool(given["qt"]) == (not pre and state.n_codes > 0)
    assert given["inv_sqrt_p"] == np.float32(shape["P"] ** -0.5)
    assert name == ("higgs_pre_r" if pre else "higgs_r") + str(rt)
    assert grid == (sum(n for n, _ in splits), b * shape["G"], -(-shape["RM"] // rt))
    assert shared == shared_bytes(shape["P"], rt, state.quant.grid.shape[0], pre, m)
    assert merge[1] == (b * hq * q_len,) and merge[2] == 4 * shape["P"]


def test_emulation_fails_a_wrong_scale():
    """The emulated path reads the coded keys: one changed scale changes the output."""
    case = CASES[0]
    state = _layer(case).state
    query, mask = _query_and_mask(case, _length(state))
    ref = higgs_format.attend(state, None, query, mask, 8**-0.5)[0]
    state.qk.scales[0, 3, 0] *= 4
    assert not torch.allclose(emulate(state, query, mask, 8**-0.5), ref, atol=1e-4)


@pytest.fixture
def emulated_backend(monkeypatch):
    """The emulated kernel as a CPU backend (``higgs_emulate.attend``, the kernel's ``limits``), registered
    for one test: a model's attention then runs the kernel's arithmetic, state and mask as the model leaves them."""
    from kvquant import backends

    emulated = backends.Backend(
        "higgs_emulated", "cpu", frozenset({"higgs"}), lambda: (True, "ok"), "kernels_cupy.higgs_emulate", limits
    )
    monkeypatch.setitem(backends._BACKENDS, "higgs_emulated", emulated)
    return emulated.name


def assert_follows_torch(
    model, tok, backend: str, method_name: str = "higgs_post_rope", kl_bound: float = 1e-6
) -> None:
    """``method_name`` (``higgs_post_rope``, or ``higgs``: keys coded before RoPE) on ``backend`` against
    ``backend=torch``: one prompt, greedy over 24 steps past an 8-token window (tokens equal), and two
    prompts, the shorter left-padded (the model's own mask handed to attention), fed the torch path's tokens
    for 10 steps (the same argmax at every step); mean KL below ``kl_bound`` for both (1e-6: fp32 summation
    order, and where an fp16 window value rounds the other way, one fp16 step)."""
    from kvquant import get_method
    from kvquant.eval.fidelity import greedy_decode, kl_divergence

    rows = [tok(p, return_tensors="pt").input_ids[0] for p in ("Once upon a time, a little fox saw a", "Tom")]
    n = max(len(r) for r in rows)
    first = torch.stack([torch.cat([torch.zeros(n - len(r), dtype=torch.long), r]) for r in rows]).to(model.device)
    attn0 = (torch.arange(n)[None] >= torch.tensor([n - len(r) for r in rows])[:, None]).long().to(model.device)
    runs, logits = {}, {}
    for name in ("torch", backend):
        method = get_method(method_name, window=8, backend=name)
        with method.attach(model), torch.no_grad():
            cache = method.new_cache(model)
            runs[name] = greedy_decode(model, rows[0], cache, 24)
            assert cache.backend == name and cache.layers[0].n_codes > 0
            ids, attn, steps, cache = first, attn0, [], method.with_params(window=4).new_cache(model)
            for i in range(11):
                steps.append(model(input_ids=ids, attention_mask=attn, past_key_values=cache).logits[:, -1].float())
                ids = (logits["torch"][i] if "torch" in logits else steps[-1]).argmax(-1, keepdim=True)
                attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
            assert cache.layers[0].n_codes > 0
        logits[name] = torch.stack(steps)
    assert torch.equal(runs[backend].tokens, runs["torch"].tokens)
    assert kl_divergence(runs["torch"].logprobs, runs[backend].logprobs).mean() < kl_bound
    assert torch.equal(logits[backend].argmax(-1), logits["torch"].argmax(-1))
    mine, theirs = (torch.log_softmax(logits[k], -1).flatten(0, 1).cpu() for k in (backend, "torch"))
    assert kl_divergence(theirs, mine).mean() < kl_bound


@pytest.mark.parametrize("method_name", ["higgs_post_rope", "higgs"])
def test_stories260k_through_the_emulated_kernel_follows_the_torch_backend(stories, emulated_backend, method_name):
    """stories260K (GQA 8/4, head_dim 8, one 32-channel group) with the kernel's arithmetic in its attention;
    ``higgs``: keys rebuilt and re-rotated at their positions (the layer's positions and ``inv_freq``)."""
    assert_follows_torch(*stories, emulated_backend, method_name)


# ---------------------------------------------------------------- GPU: the kernel against the reference

GPU_CASES = [
    *CASES,
    (2, 32, 8, 128, 2, 1024, 4, 128, 4000, 129, 1, "pad", 0),  # Llama-3 shape, 4129 tokens
]


@gpu_test
@pytest.mark.parametrize("rope", ["post_rope", "positions", "tables"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", GPU_CASES, ids=case_id)
def test_kernel_equals_the_reference_on_the_same_state(case, dtype, rope):
    """The kernel against the reference on the same CUDA state: keys coded after RoPE, or before it with
    RoPE from the positions or from the tables (``higgs_pre_r*``)."""
    d = case[3]
    state = _layer(case, rope).state
    given = state.rope
    state.map_tensors(lambda t: t.cuda())  # clears state.rope
    state.rope = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in given.items()}
    query, mask = _query_and_mask(case, _length(state), "cuda")
    query = query.to(dtype)
    ref, _ = higgs_format.attend(state, None, query.float(), mask, d**-0.5)
    got, reads = attend_higgs(state, None, query, mask, d**-0.5)
    assert got.dtype == dtype and got.shape == query.shape and reads.k_widths is None
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=5e-6, rtol=5e-5)
    else:
        torch.testing.assert_close(got, ref.to(dtype), atol=2e-3, rtol=2e-3)


@gpu_test
@pytest.mark.parametrize("method_name", ["higgs_post_rope", "higgs"])
def test_backend_cupy_generates_as_the_torch_backend_on_stories260k(method_name):
    """``backend=cupy`` on stories260K in fp32: as ``assert_follows_torch`` (the kernel reads the codes from step
    one); ``higgs``: the pre-RoPE kernels. fp32 because the bound is fp32 summation order's: ``load_model``'s fp16
    on CUDA rounds each attention output to fp16 and misses it on either path (the emulated kernel on the CPU too)."""
    from kvquant import load_model

    assert_follows_torch(*load_model("stories260k", device="cuda", dtype="float32"), "cupy", method_name)
