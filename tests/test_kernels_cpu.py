"""The fused C++ CPU kernels (kernels_cpu) against fp64 attention over the same stored tensors.

Stores are written by kvquant's own layers (``fp16``, ``kivi``, ``gear`` via ``new_layer``), so the
layouts are the real ones; the reference reads them back through the layer (kvquant's dequantize) and computes
softmax(q·kᵀ·scale + mask)·v in fp64. The extension is built once per test run if it is not built
yet (about 1.5 min on 2 cores); if the build fails, every kernel test is skipped with its reason.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels_cpu
from kernels_cpu import loader
from kernels_cpu.backend import gear_tensors, kivi_tensors
from kvquant.cache import KVGeometry
from kvquant.methods.base import get_method

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def reference(q, k, v, mask=None, scaling=None) -> torch.Tensor:
    """fp64 attention; GQA by repeating KV heads as transformers' repeat_kv does; rows that see no key give 0."""
    g = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(g, dim=1)
    v = v.double().repeat_interleave(g, dim=1)
    s = (q.double() @ k.mT) * (q.shape[-1] ** -0.5 if scaling is None else scaling)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    p = torch.nan_to_num(s.softmax(dim=-1), nan=0.0)
    return p @ v


def causal_padding_mask(batch: int, q_len: int, length: int, pads: list[int]) -> torch.Tensor:
    """Bool ``[B, 1, q_len, L]``: query i sees keys ``t <= L - q_len + i`` that are not left padding."""
    t = torch.arange(length)
    causal = t[None, :] <= (length - q_len + torch.arange(q_len))[:, None]
    pad = t[None, :] >= torch.tensor(pads)[:, None]
    return (causal[None] & pad[:, None, :])[:, None]


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=2e-5)


# (batch, q heads, kv heads, q_len, tokens, head_dim): GQA 3 and 4, MHA, MQA; tails (L mod 64 != 0,
# L < 64, L = 1); head dims 8, 64, 128 and 48 (a partial 16-lane chunk).
FP16_SHAPES = [
    (1, 9, 3, 1, 4133, 64),
    (2, 8, 2, 1, 130, 128),
    (1, 4, 4, 1, 1, 8),
    (2, 6, 3, 5, 70, 8),
    (1, 32, 8, 3, 63, 128),
    (3, 4, 1, 1, 200, 64),
    (2, 2, 1, 20, 97, 48),
]


def new_layer(name: str, heads: int, kv_heads: int, head_dim: int, **params):
    """Layer 0 of a registered method, as ``new_cache`` builds it for a model of this geometry."""
    geometry = KVGeometry(n_layers=1, n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim)
    return get_method(name, **params).new_layer(0, geometry)


def fp16_store(batch: int, kv_heads: int, length: int, head_dim: int):
    layer = new_layer("fp16", kv_heads, kv_heads, head_dim)
    layer.update(torch.randn(batch, kv_heads, length, head_dim), torch.randn(batch, kv_heads, length, head_dim))
    return layer


@pytest.mark.parametrize("shape", FP16_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp16_matches_reference(built, threads, shape):
    b, hq, hkv, q_len, length, d = shape
    torch.manual_seed(length)
    layer = fp16_store(b, hkv, length, d)
    q = torch.randn(b, hq, q_len, d)
    pads = [min(i * 7, length - q_len) for i in range(b)]  # left padding, batch row 0 unpadded
    mask = causal_padding_mask(b, q_len, length, pads)
    out = kernels_cpu.attend_fp16(q, layer.keys, layer.values, mask=mask)
    assert_close(out, reference(q, layer.keys, layer.values, mask))


def test_fp16_causal_flag_additive_mask_and_scaling(built, threads):
    torch.manual_seed(1)
    layer = fp16_store(2, 2, 300, 64)
    q = torch.randn(2, 4, 6, 64)
    causal = causal_padding_mask(2, 6, 300, [0, 0])
    out = kernels_cpu.attend_fp16(q, layer.keys, layer.values, causal=True, scaling=0.3)
    assert_close(out, reference(q, layer.keys, layer.values, causal, scaling=0.3))
    bias = torch.randn(2, 1, 6, 300).masked_fill(~causal, float("-inf"))  # additive, -inf where masked
    out = kernels_cpu.attend_fp16(q, layer.keys, layer.values, mask=bias)
    assert_close(out, reference(q, layer.keys, layer.values, bias))


def test_fp16_agrees_with_sdpa_on_the_fp16_path(built):
    """What the fp16 method feeds transformers' SDPA today: the history as fp32, GQA in SDPA."""
    torch.manual_seed(2)
    layer = fp16_store(1, 3, 1000, 64)
    q = torch.randn(1, 9, 1, 64)
    k, v = layer.keys.float(), layer.values.float()
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(kernels_cpu.attend_fp16(q, layer.keys, layer.values), sdpa, rtol=1e-4, atol=1e-5)


def test_rows_that_see_no_key_give_zeros_and_query_dtype_is_kept(built):
    torch.manual_seed(3)
    layer = fp16_store(1, 1, 40, 8)
    q = torch.randn(1, 2, 2, 8, dtype=torch.bfloat16)
    mask = torch.ones(1, 1, 2, 40, dtype=torch.bool)
    mask[0, 0, 1] = False
    out = kernels_cpu.attend_fp16(q, layer.keys, layer.values, mask=mask)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 2, 2, 8)
    assert torch.all(out[:, :, 1] == 0)
    ref = reference(q.float(), layer.keys, layer.values, mask)
    torch.testing.assert_close(out[:, :, 0].double(), ref[:, :, 0], rtol=1e-2, atol=1e-2)


def test_bad_arguments_raise_one_line(built):
    layer = fp16_store(1, 2, 10, 8)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        kernels_cpu.attend_fp16(torch.randn(1, 3, 1, 8), layer.keys, layer.values)
    with pytest.raises(RuntimeError, match="float16"):
        kernels_cpu.attend_fp16(torch.randn(1, 2, 1, 8), layer.keys.float(), layer.values)
    with pytest.raises(ValueError, match="broadcast"):
        kernels_cpu.attend_fp16(torch.randn(1, 2, 1, 8), layer.keys, layer.values, mask=torch.ones(1, 1, 1, 9) > 0)


# ---------------------------------------------------------------- KIVI / GEAR through their layers


def run_layer(layer, batch: int, kv_heads: int, prefill: int, steps: int, head_dim: int):
    """Prefill, then ``steps`` single-token decode updates; returns the layer's (dequantized) K, V."""
    shape = (batch, kv_heads, prefill, head_dim)
    k, v = layer.update(torch.randn(shape), torch.randn(shape))
    for _ in range(steps):
        k, v = layer.update(torch.randn(batch, kv_heads, 1, head_dim), torch.randn(batch, kv_heads, 1, head_dim))
    return k, v


# (bits, group, residual, batch, q heads, kv heads, prefill, decode steps, head_dim): quantized key and
# value parts of different lengths (keys leave in blocks of R, values one at a time), head dims 8/64/128,
# groups of 4..32 channels (several groups per 16-lane chunk, or one), one row per KV head (MHA: the
# folded reads' single-row path), a store still all window, and
# one long enough (3 heads x 3000 keys) that two threads split the keys into chunks.
KIVI_CASES = [
    (2, 32, 128, 1, 9, 3, 1000, 5, 64),
    (2, 32, 128, 1, 9, 3, 3000, 3, 64),
    (2, 32, 128, 1, 4, 4, 600, 3, 128),
    (4, 32, 64, 2, 8, 2, 300, 3, 128),
    (2, 4, 8, 2, 6, 3, 70, 3, 8),
    (8, 8, 16, 1, 4, 2, 20, 40, 8),
    (4, 16, 32, 1, 2, 1, 100, 2, 48),
    (2, 32, 128, 2, 4, 4, 30, 0, 64),
    (2, 8, 16, 1, 4, 1, 1, 0, 64),
]


@pytest.mark.parametrize("case", KIVI_CASES, ids=lambda c: "x".join(map(str, c)))
def test_kivi_matches_reference(built, threads, case):
    bits, group, residual, b, hq, hkv, prefill, steps, d = case
    torch.manual_seed(prefill + bits)
    layer = new_layer("kivi", hq, hkv, d, bits=bits, group_size=group, residual=residual)
    k, v = run_layer(layer, b, hkv, prefill, steps, d)
    args = kivi_tensors(layer.state)
    length = k.shape[2]
    for q_len in (1, 4) if length >= 4 else (1,):
        q = torch.randn(b, hq, q_len, d)
        mask = causal_padding_mask(b, q_len, length, [min(5 * i, length - q_len) for i in range(b)])
        assert_close(kernels_cpu.attend_kivi(q, **args, mask=mask), reference(q, k, v, mask))


def test_kivi_reads_what_the_torch_path_returns_at_every_decode_step(built):
    """Across flushes (key blocks of R, values one at a time), the kernel follows the layer step by step."""
    torch.manual_seed(4)
    layer = new_layer("kivi", 6, 2, 16, bits=2, group_size=8, residual=16)
    k, v = layer.update(torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16))
    for _ in range(40):
        k, v = layer.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16))
        q = torch.randn(1, 6, 1, 16)
        assert_close(kernels_cpu.attend_kivi(q, **kivi_tensors(layer.state)), reference(q, k, v))


# (bits, group, residual, outlier ratio, rank, rank_decode, batch, q heads, kv heads, prefill, steps, head_dim)
GEAR_CASES = [
    (2, 32, 128, 0.02, 4, 2, 1, 9, 3, 1000, 130, 64),
    (4, 64, 128, 0.02, 4, 2, 1, 9, 3, 3000, 130, 64),
    (4, 64, 128, 0.02, 4, 2, 2, 8, 2, 300, 0, 128),
    (4, 32, 64, 0.05, 4, 0, 2, 8, 2, 300, 70, 128),
    (2, 4, 8, 0.1, 2, 1, 2, 6, 3, 70, 9, 8),
    (2, 8, 16, 0.0, 3, 2, 1, 4, 2, 20, 40, 8),
    (4, 16, 32, 0.02, 0, 0, 1, 2, 1, 100, 2, 48),
]


@pytest.mark.parametrize("case", GEAR_CASES, ids=lambda c: "x".join(map(str, c)))
def test_gear_matches_reference(built, threads, case):
    bits, group, residual, ratio, rank, rank_decode, b, hq, hkv, prefill, steps, d = case
    torch.manual_seed(prefill + bits)
    params = {"bits": bits, "group_size": group, "residual": residual, "rank": rank, "rank_decode": rank_decode}
    layer = new_layer("gear", hq, hkv, d, outlier_ratio=ratio, **params)
    k, v = run_layer(layer, b, hkv, prefill, steps, d)
    args = gear_tensors(layer.state)
    if ratio:
        assert args["k"].index is not None and args["k"].index.shape[-1] > 0
    length = k.shape[2]
    for q_len in (1, 3):
        q = torch.randn(b, hq, q_len, d)
        mask = causal_padding_mask(b, q_len, length, [min(5 * i, length - q_len) for i in range(b)])
        assert_close(kernels_cpu.attend_gear(q, **args, mask=mask), reference(q, k, v, mask))
    q = torch.randn(b, hq, 2, d)
    ref = reference(q, k, v, causal_padding_mask(b, 2, length, [0] * b))
    assert_close(kernels_cpu.attend_gear(q, **args, causal=True), ref)


# ---------------------------------------------------------------- AlignedKV planes, truncation


def plane_store(
    batch: int, kv_heads: int, length: int, head_dim: int, tiny: bool, blockwise: bool, seed: int, value_block: int = 0
):
    """A ``PlaneStore`` filled as ``AlignedLayer`` fills it (a prefill, then single tokens); ``tiny``
    puts zeros and values below 2^-16 in, so plane A reads as ±0 somewhere (the ±0 rule applies)."""
    from kvquant.formats.planes import PlaneStore

    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, kv_heads, length, head_dim, generator=g) * torch.rand(1, 1, 1, head_dim, generator=g) * 4
    v = torch.randn(batch, kv_heads, length, head_dim, generator=g)
    if tiny:
        k[..., 0, :3], v[..., 1, :], v[..., 2, 1::2] = 0.0, -1e-7, 3e-6
    else:  # away from zero: no plane-A byte reads as ±0
        k, v = (torch.where(x >= 0, x + 0.01, x - 0.01) for x in (k, v))  # randn may draw an exact 0
    store = PlaneStore(block_exponents=blockwise, value_block=value_block)
    first = max(1, length - 3)
    store.append(k[:, :, :first].half(), v[:, :, :first].half())
    for t in range(first, length):
        store.append(k[:, :, t : t + 1].half(), v[:, :, t : t + 1].half())
    assert store.tiny_k == store.tiny_v == (tiny and store.n_full > 0)
    return store


def random_widths(*shape: int, seed: int) -> torch.Tensor:
    choice = torch.randint(0, 3, shape, generator=torch.Generator().manual_seed(seed))
    return (8 + 4 * choice).to(torch.int32)


# (batch, q heads, kv heads, q_len, tokens, head_dim, per-block key widths): GQA 3 and 4, MHA, MQA; head
# dims 8, 64, 128, 48 and 96; tails (L mod 64 != 0), a store still all tail (L < 64) and one of whole blocks.
# On AVX-512 and AVX2 the fused step reads whole key blocks for up to 4 query rows a KV head, and value rows by
# block where the head dim is a multiple of 64 (planes.cpp, block_scores / value_rows64): the 1-, 2-, 3- and
# 4-row shapes at head dims 64, 96 and 128 take those paths, the others the 16-token ones.
PLANE_SHAPES = [
    (1, 9, 3, 1, 4133, 64, False),
    (2, 8, 2, 3, 130, 128, True),
    (1, 4, 4, 1, 63, 8, False),
    (2, 6, 3, 5, 200, 8, True),
    (3, 4, 1, 1, 256, 64, False),
    (2, 2, 1, 20, 97, 48, False),
    (1, 32, 8, 2, 1100, 128, True),
    (2, 8, 8, 1, 700, 128, True),
    (1, 4, 2, 1, 390, 96, False),
]


@pytest.mark.parametrize("tiny", [True, False], ids=["tiny", "normal"])
@pytest.mark.parametrize("shape", PLANE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_planes_match_the_torch_reader(built, threads, shape, tiny):
    """Per-channel (or per-block) key widths and per-token value widths, as the rules hand them over,
    or one width for all: the kernel equals fp64 attention over what ``PlaneStore`` reads at them."""
    b, hq, hkv, q_len, length, d, blockwise = shape
    store = plane_store(b, hkv, length, d, tiny, blockwise, seed=length + d)
    nb = store.n_full // 64
    wk = random_widths(b, hkv, nb, d, seed=1) if blockwise else random_widths(b, hkv, d, seed=1)
    wv = random_widths(b, hkv, store.n_full, seed=2)
    q = torch.randn(b, hq, q_len, d, generator=torch.Generator().manual_seed(3))
    mask = causal_padding_mask(b, q_len, length, [min(i * 7, length - q_len) for i in range(b)])
    for k_widths, v_widths in ((wk, wv), (8, 8), (12, 16), (16, 12)):
        keys, values = store.read_keys(k_widths, torch.float32), store.read_values(v_widths, torch.float32)
        out = kernels_cpu.attend_planes(q, store, k_widths=k_widths, v_widths=v_widths, mask=mask)
        assert_close(out, reference(q, keys, values, mask))
    causal = causal_padding_mask(b, q_len, length, [0] * b)
    out = kernels_cpu.attend_planes(q, store, k_widths=wk, v_widths=wv, causal=q_len > 1, scaling=0.2)
    ref = reference(q, store.read_keys(wk, torch.float32), store.read_values(wv, torch.float32), causal, 0.2)
    assert_close(out, ref)


@pytest.mark.parametrize("tiny", [True, False], ids=["tiny", "normal"])
@pytest.mark.parametrize("shape", PLANE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_aligned_rule_decides_the_torch_rules_widths(built, threads, shape, tiny):
    """``attend_aligned`` (the value rule in C++ on fp64 scores, then attention at its widths) against
    the torch rule on the same keys: the same value widths, token for token, for topk below and above
    the context, fractional thresholds, ``v_block`` 1 and 16, bool and additive masks; the output equals
    fp64 attention over the values read at those widths."""
    from kvquant.alignment import block_widths, high_byte_values, value_widths
    from kvquant.formats.planes import scores as _scores

    b, hq, hkv, q_len, length, d, blockwise = shape
    store = plane_store(b, hkv, length, d, tiny, blockwise, seed=length + d)
    nb = store.n_full // 64
    wk = random_widths(b, hkv, nb, d, seed=1) if blockwise else random_widths(b, hkv, d, seed=1)
    q = torch.randn(b, hq, q_len, d, generator=torch.Generator().manual_seed(3)) * 2
    bool_mask = causal_padding_mask(b, q_len, length, [min(i * 7, length - q_len) for i in range(b)])
    float_mask = torch.zeros(bool_mask.shape).masked_fill(~bool_mask, torch.finfo(torch.float32).min)
    v8 = high_byte_values(torch.arange(256, dtype=torch.uint8))
    keys = store.read_keys(wk, torch.float32)
    seen = set()
    for mask, topk, thresholds, v_block in (
        (bool_mask, 32, (4.0, 8.0), 1),
        (float_mask, 5, (4.7, 9.3), 16),
        (bool_mask, length + 3, (2.0, 2.0), 1),
    ):
        scores = _scores(q, keys, mask, d**-0.5, None, torch.float64)
        paper = value_widths(scores, store.value_high_bytes(), thresholds, topk)[:, :, : store.n_full]
        expected = block_widths(paper, v_block)
        out, wv = kernels_cpu.attend_aligned(
            q,
            store,
            k_widths=wk,
            v8=v8,
            v_thresholds=thresholds,
            topk=topk,
            v_block=v_block,
            mask=mask,
        )
        assert wv.dtype == torch.int32 and torch.equal(wv, expected)
        assert_close(out, reference(q, keys, store.read_values(expected, torch.float32), mask))
        seen |= set(wv.unique().tolist())
    assert nb == 0 or len(seen) >= 2
    if q_len > 1:
        with pytest.raises(RuntimeError, match="a multi-token step needs its mask"):
            kernels_cpu.attend_aligned(q, store, k_widths=wk, v8=v8, v_thresholds=(4, 8), topk=32)


@pytest.mark.parametrize("shape", PLANE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_aligned_block_rule_decides_the_torch_rules_widths(built, threads, shape):
    """The block-bound rule in C++ (``block_rule``: the exponent bytes kept at append, no pass over plane
    A) against ``kvquant.alignment.block_value_widths`` on the same fp64 scores: the same widths, block for
    block, never fewer bits than the paper's rule, and the output of fp64 attention at those widths."""
    from kvquant.alignment import block_value_widths, high_byte_values, value_widths
    from kvquant.formats.planes import scores as _scores

    b, hq, hkv, q_len, length, d, blockwise = shape
    q = torch.randn(b, hq, q_len, d, generator=torch.Generator().manual_seed(3)) * 2
    mask = causal_padding_mask(b, q_len, length, [min(i * 7, length - q_len) for i in range(b)])
    v8 = high_byte_values(torch.arange(256, dtype=torch.uint8))
    for v_block, topk, thresholds in ((16, 32, (4.0, 8.0)), (64, 5, (2.5, 6.5))):
        store = plane_store(b, hkv, length, d, True, blockwise, seed=length + d, value_block=v_block)
        nb = store.n_full // 64
        wk = random_widths(b, hkv, nb, d, seed=1) if blockwise else random_widths(b, hkv, d, seed=1)
        keys = store.read_keys(wk, torch.float32)
        scores = _scores(q, keys, mask, d**-0.5, None, torch.float64)
        if nb:
            expected = block_value_widths(scores, store.v_exp, store.high_bytes_at, thresholds, topk, v_block)
        else:
            expected = torch.empty(b, hkv, 0, dtype=torch.int32)
        out, wv = kernels_cpu.attend_aligned(
            q,
            store,
            k_widths=wk,
            v8=v8,
            v_thresholds=thresholds,
            topk=topk,
            v_block=v_block,
            block_rule=True,
            mask=mask,
        )
        assert torch.equal(wv, expected)
        paper = value_widths(scores, store.value_high_bytes(), thresholds, topk)[:, :, : store.n_full]
        assert bool((wv >= paper).all())
        assert_close(out, reference(q, keys, store.read_values(expected, torch.float32), mask))


@pytest.mark.parametrize("rule", ["paper", "block8", "block32", "block64"])
@pytest.mark.parametrize("shape", PLANE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rule_from_fp32_scores_decides_the_fp64_widths(built, threads, shape, rule):
    """The value rule decides from fp32 scores where their error bounds prove the widths: the same widths as
    ``exact_scores`` (fp64 throughout) and the torch rule, bool and additive masks, most items decided from
    fp32; with ``k_absmax`` inflated 2^14 times (bounds too wide to decide anything) every item goes to fp64
    and still gives those widths. The paper's rule at ``v_block`` 16, the block rule at 8, 32 and 64 (on
    AVX-512 it decides 16 blocks at a time where no key of them was scored in fp64: a mask's keys are)."""
    from kvquant.alignment import block_value_widths, block_widths, high_byte_values, value_widths
    from kvquant.formats.planes import scores as _scores

    b, hq, hkv, q_len, length, d, blockwise = shape
    q = torch.randn(b, hq, q_len, d, generator=torch.Generator().manual_seed(5)) * 2
    bool_mask = causal_padding_mask(b, q_len, length, [min(i * 7, length - q_len) for i in range(b)])
    float_mask = torch.zeros(bool_mask.shape).masked_fill(~bool_mask, torch.finfo(torch.float32).min)
    v8 = high_byte_values(torch.arange(256, dtype=torch.uint8))
    block = rule.startswith("block")
    v_block = int(rule.removeprefix("block")) if block else 16
    store = plane_store(b, hkv, length, d, True, blockwise, seed=length + d + 1, value_block=v_block if block else 0)
    nb = store.n_full // 64
    wk = random_widths(b, hkv, nb, d, seed=1) if blockwise else random_widths(b, hkv, d, seed=1)
    keys = store.read_keys(wk, torch.float32)
    kw = dict(k_widths=wk, v8=v8, v_thresholds=(4.0, 8.0), topk=32, v_block=v_block, block_rule=block)
    fast = 0
    for mask in (bool_mask, float_mask):
        scores = _scores(q, keys, mask, d**-0.5, None, torch.float64)
        if block:
            expected = (
                block_value_widths(scores, store.v_exp, store.high_bytes_at, (4.0, 8.0), 32, v_block) if nb else None
            )
        else:
            paper = value_widths(scores, store.value_high_bytes(), (4.0, 8.0), 32)[:, :, : store.n_full]
            expected = block_widths(paper, v_block)
        before = kernels_cpu.aligned_rule_counts()
        out, wv = kernels_cpu.attend_aligned(q, store, mask=mask, **kw)
        fast += kernels_cpu.aligned_rule_counts()[0] - before[0]
        exact_out, exact_wv = kernels_cpu.attend_aligned(q, store, mask=mask, exact_scores=True, **kw)
        assert torch.equal(wv, exact_wv) and (expected is None or torch.equal(wv, expected))
        assert_close(out, exact_out.double())
    assert nb == 0 or fast >= b * hkv  # of 2 * b * hkv items
    store.k_absmax = store.k_absmax * 2.0**14
    before = kernels_cpu.aligned_rule_counts()
    _, wv = kernels_cpu.attend_aligned(q, store, mask=bool_mask, **kw)
    after = kernels_cpu.aligned_rule_counts()
    assert nb == 0 or (after[0] == before[0] and after[1] - before[1] == b * hkv)
    assert torch.equal(wv, exact_wv)


@pytest.mark.parametrize("rule", ["paper", "block32"])
@pytest.mark.parametrize("length", [300, 1000])
def test_a_probability_near_underflow_sends_the_item_to_fp64(built, length, rule):
    """One key scores ~720 above the rest (their exp(s - max) below 2^-1000, s - max above -760: probabilities the
    fp32 bounds do not cover, near and in the subnormal range): the fp32 path gives the item up and it is scored
    in fp64 whole, with exact_scores' widths. ~880 above, every other probability is 0 at both ends and the fp32
    path decides. This is the exp pass's underflow test (its vector code on AVX2 and AVX-512)."""
    from kvquant.alignment import high_byte_values
    from kvquant.formats.planes import PlaneStore

    g = torch.Generator().manual_seed(length)
    d = 64
    k = torch.randn(1, 1, length, d, generator=g)
    k[0, 0, 5] = 0.0
    k[0, 0, 5, 0] = 64.0
    v = torch.randn(1, 1, length, d, generator=g)
    block = rule == "block32"
    store = PlaneStore(value_block=32 if block else 0)
    store.append(k.half(), v.half())
    v8 = high_byte_values(torch.arange(256, dtype=torch.uint8))
    kw = dict(k_widths=torch.full((1, 1, d), 12, dtype=torch.uint8), v8=v8, v_thresholds=(4.0, 8.0), topk=32)
    kw |= dict(v_block=32 if block else 1, block_rule=block)
    for a, fp64 in ((90.0, 1), (110.0, 0)):  # the sink's lead: a * 64 / 8 = 720, 880
        q = torch.zeros(1, 1, 1, d)
        q[..., 0] = a
        q[..., 1:] = 0.01 * torch.randn(d - 1, generator=g)
        before = kernels_cpu.aligned_rule_counts()
        out, wv = kernels_cpu.attend_aligned(q, store, **kw)
        after = kernels_cpu.aligned_rule_counts()
        assert (after[0] - before[0], after[1] - before[1]) == (1 - fp64, fp64), a
        exact_out, exact_wv = kernels_cpu.attend_aligned(q, store, exact_scores=True, **kw)
        assert torch.equal(wv, exact_wv)
        assert_close(out, exact_out.double())


@pytest.mark.parametrize("rule", ["paper", "block8", "block32"])
@pytest.mark.parametrize("hq,hkv,d,length", [(4, 4, 128, 1100), (6, 2, 64, 1500)])
def test_rule_from_fp32_rescores_the_units_its_bounds_leave_open(built, threads, hq, hkv, d, length, rule):
    """Where the fp32 scores' bounds leave a unit's width open (a 16-token group of the paper's rule, a value block
    of the block rule), the fp32 path rescores the item's heavy keys and that unit's tokens in fp64 and tests it
    again before sending the item to fp64: with ``k_absmax`` inflated 1-256x (wider bounds, so more units open)
    the widths stay ``exact_scores``' and the outputs close to them, and some items are decided that way
    (``aligned_rescored_items``). Keys as fig_latency's (log-normal channel scales, two outlier channels)."""
    from kvquant.alignment import high_byte_values
    from kvquant.formats.planes import PlaneStore

    g = torch.Generator().manual_seed(d + length)
    scale = torch.exp(0.6 * torch.randn(1, hkv, 1, d, generator=g))
    scale[..., :2] *= 8
    k = torch.randn(2, hkv, length, d, generator=g) * scale + 0.5 * scale
    v = torch.randn(2, hkv, length, d, generator=g)
    q = torch.randn(2, hq, 1, d, generator=g)
    block = rule.startswith("block")
    v_block = int(rule.removeprefix("block")) if block else 16
    store = PlaneStore(value_block=v_block if block else 0)
    store.append(k.half(), v.half())
    v8 = high_byte_values(torch.arange(256, dtype=torch.uint8))
    kw = dict(k_widths=torch.full((2, hkv, d), 12, dtype=torch.uint8), v8=v8, v_thresholds=(4.0, 8.0), topk=32)
    kw |= dict(v_block=v_block, block_rule=block)
    k_absmax, rescored = store.k_absmax.clone(), 0
    for inflation in (1, 4, 16, 64, 256):
        store.k_absmax = k_absmax * inflation
        before = kernels_cpu.aligned_rescored_items()
        out, wv = kernels_cpu.attend_aligned(q, store, **kw)
        rescored += kernels_cpu.aligned_rescored_items() - before
        exact_out, exact_wv = kernels_cpu.attend_aligned(q, store, exact_scores=True, **kw)
        assert torch.equal(wv, exact_wv), inflation
        assert_close(out, exact_out.double())
    assert rescored >= 1


@pytest.mark.parametrize("v_block", [0, 8, 16, 32])
@pytest.mark.parametrize("hq,hkv,d,length", [(4, 4, 128, 4096), (6, 2, 64, 2100), (3, 1, 96, 1500)])
def test_value_rules_settle_runs_of_units_from_v_exp_max(built, threads, hq, hkv, d, length, v_block):
    """Runs of value units (16 blocks of the block rule at ``v_block``; 64, else 16 tokens of the paper's rule,
    ``v_block`` 0 here) whose largest probability, against the gap of ``v_exp_max`` (each channel's largest field),
    still gives 8 bits are settled at 8 without reading their fields: the widths and outputs are those without
    ``v_exp_max`` (and ``exact_scores``'), and on spread attention with sinks (as the ``--planes`` bench's K/V)
    some units are settled that way (``aligned_bound_units``). A bound that is not one (every field 0) settles
    units the rule reads wider, so the kernel does read it. Outlier tokens in the last head of the second batch row
    only, away from the sinks, make blocks there wider: a bound read for the wrong row or head settles them."""
    from kvquant.alignment import high_byte_values
    from kvquant.formats.planes import PlaneStore

    g = torch.Generator().manual_seed(d + v_block)
    scale = 2.0 ** (torch.rand(d, generator=g) * 4 - 2)
    k = torch.randn(2, hkv, length, d, generator=g) * scale
    v = torch.randn(2, hkv, length, d, generator=g)
    q = torch.randn(2, hq, 1, d, generator=g) * 2.5 * d**0.25 / scale.square().mean().sqrt()
    direction = q.view(2, hkv, hq // hkv, d).mean(2)
    unit = direction / direction.norm(dim=-1, keepdim=True)
    k[:, :, :4] = (unit * 3 * d**0.5).unsqueeze(2)  # attention sinks
    k[1, -1, 100::509] = unit[1, -1] * 3 * d**0.5  # in one (row, head) only, heavy tokens with large values away
    v[1, -1, 100::509] *= 2.0**8  # from the sinks: their units read wider
    store = PlaneStore(value_block=v_block)
    store.append(k.half(), v.half())
    v8 = high_byte_values(torch.arange(256, dtype=torch.uint8))
    kw = dict(k_widths=torch.full((2, hkv, d), 12, dtype=torch.uint8), v8=v8, v_thresholds=(4.0, 8.0), topk=32)
    kw |= dict(v_block=v_block or 1, block_rule=v_block > 0)
    assert torch.equal(store.v_exp_max, ((store.v_a >> 2) & 0x1F).amax(2))
    before = kernels_cpu.aligned_bound_units()
    out, wv = kernels_cpu.attend_aligned(q, store, **kw)
    settled = kernels_cpu.aligned_bound_units() - before
    bound, store.v_exp_max = store.v_exp_max, None
    plain_out, plain_wv = kernels_cpu.attend_aligned(q, store, **kw)
    exact_out, exact_wv = kernels_cpu.attend_aligned(q, store, exact_scores=True, **kw)
    assert kernels_cpu.aligned_bound_units() - before == settled  # nothing settled without the bound
    assert torch.equal(wv, plain_wv) and torch.equal(wv, exact_wv)
    assert torch.equal(out, plain_out)
    unit_scale = torch.ones(2, hq, 1, 1)
    unit_scale[1, hq - hq // hkv :] = 2.0**-8  # the heavy head's outputs at the others' scale (exactly)
    assert_close(out * unit_scale, exact_out.double() * unit_scale)
    assert 0 < settled < wv.numel() // (v_block or 1)
    assert (wv[1, -1, 64:] > 8).any() and not (wv[0, -1, 64:] > 8).any()
    store.v_exp_max = torch.zeros_like(bound)
    _, wrong = kernels_cpu.attend_aligned(q, store, **kw)
    assert not torch.equal(wrong, wv) and bool((wrong <= wv).all())


@pytest.mark.parametrize("rule", ["paper", "block"])
@pytest.mark.parametrize("hq,hkv,d", [(2, 2, 128), (8, 2, 64), (6, 1, 96)])
def test_rule_from_fp32_scores_resolves_tied_and_near_tied_class_leaders(built, threads, hq, hkv, d, rule):
    """Classes of the strided top-k whose leaders tie exactly (copies of one key) or nearly (one channel nudged
    by half an fp16 ulp, so equal or one ulp apart once stored: closer than the fp32 scores' bound): the fp32
    path rescores those classes' contenders in fp64 and takes the first on ties, so its widths are
    ``exact_scores``' and the torch rule's; the other classes keep their lone contender unrescored. At least
    one item is still decided from fp32 (not sent whole to fp64)."""
    from kvquant.alignment import block_value_widths, block_widths, high_byte_values, value_widths
    from kvquant.formats.planes import PlaneStore
    from kvquant.formats.planes import scores as _scores

    length, topk = 1100, 32
    g = torch.Generator().manual_seed(hq * d)
    q = torch.randn(1, hq, 1, d, generator=g)
    k = torch.randn(1, hkv, length, d, generator=g)
    v = torch.randn(1, hkv, length, d, generator=g)
    lead = q.view(1, hkv, hq // hkv, d).mean(2).sign() * 1.5  # a key every row of the KV head scores high
    for j in range(8):  # classes 0-7: three exact copies of one leader; 8-15: two leaders, one channel nudged
        k[:, :, [j, j + 2 * topk, j + 9 * topk]] = lead[:, :, None]
        k[:, :, [8 + j, 8 + j + 5 * topk]] = lead[:, :, None] * (0.9 + 0.01 * j)
        k[:, :, 8 + j + 5 * topk, j] *= 1 + 2.0**-11
    block = rule == "block"
    store = PlaneStore(value_block=32 if block else 0)
    store.append(k.half(), v.half())
    wk = random_widths(1, hkv, d, seed=3)
    keys = store.read_keys(wk, torch.float32)
    v8 = high_byte_values(torch.arange(256, dtype=torch.uint8))
    kw = dict(k_widths=wk, v8=v8, v_thresholds=(4.0, 8.0), topk=topk, v_block=32 if block else 16, block_rule=block)
    scores = _scores(q, keys, None, d**-0.5, None, torch.float64)
    if block:
        expected = block_value_widths(scores, store.v_exp, store.high_bytes_at, (4.0, 8.0), topk, 32)
    else:
        paper = value_widths(scores, store.value_high_bytes(), (4.0, 8.0), topk)[:, :, : store.n_full]
        expected = block_widths(paper, 16)
    before = kernels_cpu.aligned_rule_counts()
    out, wv = kernels_cpu.attend_aligned(q, store, **kw)
    after = kernels_cpu.aligned_rule_counts()
    exact_out, exact_wv = kernels_cpu.attend_aligned(q, store, exact_scores=True, **kw)
    assert torch.equal(wv, exact_wv) and torch.equal(wv, expected)
    assert_close(out, exact_out.double())
    assert after[0] - before[0] >= 1  # of hkv items


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("inflate", [0, 6, 14])
@pytest.mark.parametrize("zero_channel", [False, True], ids=["", "zero-channel"])
def test_paper_rule_widths_16_tokens_at_a_time_are_the_exact_paths(built, d, inflate, zero_channel):
    """The paper's rule decided from fp32 scores 16 tokens at a time (AVX-512, head dims that are multiples of 64):
    the widths of ``exact_scores`` and of the torch rule, whether the bounds decide every token, leave O_est's
    exponents apart at the two ends, or cannot decide (``k_absmax`` inflated 2^6 and 2^14 times), and where a
    channel of zeros puts O_est's exponent out of the byte range (the token-by-token loop then decides)."""
    from kvquant.alignment import block_widths, high_byte_values, value_widths
    from kvquant.formats.planes import PlaneStore
    from kvquant.formats.planes import scores as _scores

    hq, hkv, length = {64: (9, 3), 128: (4, 4), 256: (2, 1)}[d] + (64 * 7 + 13,)
    v8 = high_byte_values(torch.arange(256, dtype=torch.uint8))
    before = kernels_cpu.aligned_rule_counts()
    for seed, scale, v_block in ((0, 1.0, 1), (1, 2.0**-12, 16)):
        g = torch.Generator().manual_seed(seed * 100 + d)
        q = torch.randn(1, hq, 1, d, generator=g) * 2
        k = torch.randn(1, hkv, length, d, generator=g)
        v = torch.randn(1, hkv, length, d, generator=g) * scale
        if zero_channel:
            v[..., 3] = 0
        store = PlaneStore()
        store.append(k.half(), v.half())
        store.k_absmax = store.k_absmax * 2.0**inflate
        wk = random_widths(1, hkv, d, seed=seed)
        kw = dict(k_widths=wk, v8=v8, v_thresholds=(4.0, 8.0), topk=32, v_block=v_block)
        out, wv = kernels_cpu.attend_aligned(q, store, **kw)
        exact_out, exact_wv = kernels_cpu.attend_aligned(q, store, exact_scores=True, **kw)
        scores = _scores(q, store.read_keys(wk, torch.float32), None, d**-0.5, None, torch.float64)
        paper = value_widths(scores, store.value_high_bytes(), (4.0, 8.0), 32)[:, :, : store.n_full]
        assert torch.equal(wv, exact_wv) and torch.equal(wv, block_widths(paper, v_block))
        assert_close(out, exact_out.double())
    fast, exact = (after - was for after, was in zip(kernels_cpu.aligned_rule_counts(), before, strict=True))
    # bounds 2^14 times too wide decide nothing, unless a zero channel makes every width 16 at both ends
    assert fast + exact == 2 * hkv and (exact == 2 * hkv if inflate == 14 and not zero_channel else True)
    assert fast > 0 or inflate > 0 or d == 256  # D = 256 sums leave bounds too wide here


def test_planes_read_every_fp16_pattern_as_the_torch_reader(built):
    """All 63,488 finite fp16 patterns as values (31 whole blocks of 32 channels) at 8, 12 and 16 bits,
    each query row seeing one value: the output is that value as the kernel read it, bit for bit; and
    as keys, read as ``read_plane_keys`` reads them, the bits ``PlaneStore.read_keys`` gives."""
    from kvquant.bits import bits_to_fp16
    from kvquant.formats.planes import PlaneStore

    patterns = torch.arange(1 << 16, dtype=torch.int32)
    values = bits_to_fp16(patterns[((patterns >> 10) & 0x1F) != 31]).view(1, 1, -1, 32)
    store = PlaneStore()
    store.append(values, values)
    n = values.shape[2]
    assert store.n_full == n and store.tiny_v
    mask = torch.eye(n, dtype=torch.bool)[None, None]  # query row i sees value i only
    for width in (8, 12, 16):
        out = kernels_cpu.attend_planes(torch.zeros(1, 1, n, 32), store, k_widths=width, v_widths=width, mask=mask)
        assert torch.equal(out, store.read_values(width, torch.float32))
        # the same patterns as keys, read 64 tokens of a channel at a time as block_scores reads them (planes64
        # on AVX-512; on AVX2 tokens 0-31 by planes32, 32-63 by planes16)
        keys = kernels_cpu.read_plane_keys(store.k_a, store.k_b, store.k_c, store.tail_k, k_widths=width)
        assert torch.equal(keys.view(torch.int32), store.read_keys(width, torch.float32).view(torch.int32))


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_block_value_reads_give_every_fp16_pattern_as_the_torch_reader(built, rows):
    """The block readers' values (value_rows64: whole key blocks, head dim a multiple of 64, at most 4 query
    rows a KV head; 64, 32 or 16 channels a pass by row count on AVX2): all 63,488 finite fp16 patterns (and
    2,048 again) as 16 sequences of one 64-token block x 64 channels, each query row seeing one token, calls
    until every token was seen; at 8, 12 and 16 bits the output is the value as the torch reader reads it."""
    from kvquant.bits import bits_to_fp16
    from kvquant.formats.planes import PlaneStore

    patterns = torch.arange(1 << 16, dtype=torch.int32)
    finite = patterns[((patterns >> 10) & 0x1F) != 31]
    values = bits_to_fp16(torch.cat([finite, finite[:2048]])).view(16, 1, 64, 64)
    store = PlaneStore()
    store.append(values, values)
    assert store.n_full == 64 and store.tiny_v
    q = torch.zeros(16, 1, rows, 64)
    for width in (8, 12, 16):
        expected = store.read_values(width, torch.float32)
        for first in (min(t, 64 - rows) for t in range(0, 64, rows)):
            mask = torch.zeros(16, 1, rows, 64, dtype=torch.bool)
            mask[:, :, torch.arange(rows), first + torch.arange(rows)] = True
            out = kernels_cpu.attend_planes(q, store, k_widths=width, v_widths=width, mask=mask)
            assert torch.equal(out, expected[:, :, first : first + rows])


@pytest.mark.parametrize("shape", PLANE_SHAPES[:4] + PLANE_SHAPES[5:], ids=lambda s: "x".join(map(str, s)))
def test_rule_helpers_equal_the_torch_code_bit_for_bit(built, threads, shape):
    """What the cpu backend hands the torch rules: keys read at their widths (``read_plane_keys`` =
    ``PlaneStore.read_keys``) and the value rule's per-token exponent gaps, the same bits."""
    from kvquant.alignment import exponent_gaps

    b, _, hkv, _, length, d, blockwise = shape
    for tiny in (True, False):
        store = plane_store(b, hkv, length, d, tiny, blockwise, seed=length)
        nb = store.n_full // 64
        wk = random_widths(b, hkv, nb, d, seed=4) if blockwise else random_widths(b, hkv, d, seed=4)
        for widths in (wk, 8, 12, 16):
            got = kernels_cpu.read_plane_keys(
                store.k_a, store.k_b, store.k_c, store.tail_k, k_widths=widths, tiny_k=store.tiny_k
            )
            assert torch.equal(got.view(torch.int32), store.read_keys(widths, torch.float32).view(torch.int32))
        v_high = store.value_high_bytes()
        e_o = torch.randint(-40, 40, (b, hkv, d), dtype=torch.int16, generator=torch.Generator().manual_seed(5))
        assert torch.equal(kernels_cpu.exponent_gaps(e_o, v_high), exponent_gaps(e_o, v_high))


# Query magnitudes for the key rule: zeros, fp32 subnormals, powers of two and their neighbours (an exponent's
# edges), ordinary values, inf and NaN (torch's frexp gives both exponent 0).
KEY_RULE_Q = st.one_of(
    st.sampled_from([0.0, -0.0, 1e-42, 2.0**-126, 1.0, 2.0, 0.99999994, 65504.0, float("inf"), float("nan")]),
    st.floats(min_value=-1e6, max_value=1e6, width=32),
)


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    shape=st.sampled_from([(1, 1, 1, 1, 8), (2, 3, 3, 1, 16), (1, 2, 4, 3, 8), (2, 1, 2, 2, 24)]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    tiers=st.sampled_from([(4.0, 8.0), (4.5, 8.2), (3.0, 3.0), (4.0, float("inf")), (5.0000001, 8.0)]),
    nb=st.integers(0, 3),
)
def test_key_widths_equal_the_torch_key_rule(built, data, shape, dtype, tiers, nb):
    """``key_widths`` is ``kvquant.alignment.key_widths`` (per column) and ``block_key_widths`` (AlignedKV+'s
    block exponent fields) to the integer: over exponent edges, zeros, subnormals, inf/NaN queries, zero and
    subnormal ``max |K|``, GQA and multi-query steps, fp32/fp16/bf16 queries and fractional thresholds."""
    from kvquant.alignment import block_key_widths, key_widths

    b, hkv, g, q_len, d = shape

    def drawn(elements, *dims: int) -> torch.Tensor:
        n = math.prod(dims)
        return torch.tensor(data.draw(st.lists(elements, min_size=n, max_size=n)), dtype=torch.float64).view(dims)

    q = drawn(KEY_RULE_Q, b, hkv * g, q_len, d).float().to(dtype)
    absmax = st.sampled_from([0.0, 6e-8, 6.1e-5, 0.5, 1.0, 3.0, 65504.0]) | st.floats(0, 65504, width=16)
    k_absmax = drawn(absmax, b, hkv, d).half()
    k_exp = drawn(st.integers(0, 31), b, hkv, nb, d).to(torch.uint8)
    got = kernels_cpu.key_widths(q, k_absmax, tiers)
    assert got.dtype == torch.uint8 and torch.equal(got.int(), key_widths(q, k_absmax, tiers))
    got = kernels_cpu.key_widths(q, k_absmax, tiers, k_exp)
    assert got.shape == (b, hkv, nb, d) and torch.equal(got.int(), block_key_widths(q, k_absmax, k_exp, tiers))


@pytest.mark.parametrize("blockwise", [False, True], ids=["per-column", "per-block"])
@pytest.mark.parametrize("first", [0, 10, 64, 200])
def test_width_counts_equal_head_width_counts(built, blockwise, first):
    """The bits-read histogram's per-step counts in one C++ pass: ``head_width_counts``' integers (which its
    own test counts one by one) for int32 and uint8 widths, strided views included; another width is refused."""
    from kvquant.methods.alignedkv import head_width_counts

    g = torch.Generator().manual_seed(first + blockwise)
    widths = torch.tensor([8, 12, 16], dtype=torch.int32)
    b, h, nb, d = 2, 3, 4, 16
    wk = widths[torch.randint(0, 3, (b, h, nb, d) if blockwise else (b, h, d), generator=g)]
    wv = widths[torch.randint(0, 3, (b, h, nb * 64 + 7), generator=g)][:, :, 7:]  # a view with an offset
    want = head_width_counts(wk, wv, first, nb * 64)
    strided = torch.stack([wk, wk], dim=-1)[..., 0]  # stride 2 along the channels
    for k, v in ((wk, wv), (wk.to(torch.uint8), wv.to(torch.uint8)), (strided, wv.to(torch.uint8))):
        got = kernels_cpu.width_counts(k, v, first, nb * 64)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    bad_k, bad_v = wk.clone(), wv.clone()
    bad_k.view(-1)[0], bad_v[0, 0, 3] = 9, 20
    for k, v in ((bad_k, wv), (wk, bad_v)):
        with pytest.raises(RuntimeError, match="widths must be 8, 12 or 16"):
            kernels_cpu.width_counts(k, v, first, nb * 64)


@pytest.mark.parametrize("keep", [6, 9, 13, 15, 16])
def test_fp16_kernel_truncates_as_kvquant_bits(built, threads, keep):
    from kvquant.bits import truncate

    b, hq, hkv, q_len, length, d = 2, 6, 3, 3, 201, 64
    torch.manual_seed(keep)
    layer = fp16_store(b, hkv, length, d)
    layer.keys[0, 0, :2] = 0.0  # zeros and a tiny value keep their ±0 read
    layer.values[1, 2, 5] = -1e-7
    q = torch.randn(b, hq, q_len, d)
    mask = causal_padding_mask(b, q_len, length, [0, 9])
    out = kernels_cpu.attend_fp16(q, layer.keys, layer.values, mask=mask, keep_bits=keep)
    ref = reference(q, truncate(layer.keys, keep).float(), truncate(layer.values, keep).float(), mask)
    assert_close(out, ref)


def test_planes_bad_arguments_raise_one_line(built):
    store = plane_store(1, 2, 130, 16, False, False, seed=0)
    q = torch.randn(1, 4, 1, 16)
    with pytest.raises(RuntimeError, match="widths 8, 12 or 16"):
        kernels_cpu.attend_planes(q, store, k_widths=10, v_widths=8)
    with pytest.raises(RuntimeError, match="widths 8, 12 or 16"):
        kernels_cpu.attend_planes(q, store, k_widths=8, v_widths=torch.full((1, 2, 128), 9))
    per_block = torch.full((1, 2, 2, 16), 12, dtype=torch.uint8)  # AlignedKV+'s: a row per block, checked by rows
    per_block[0, 1, 1, 15] = 4
    for widths in (per_block, per_block.transpose(2, 3).contiguous().transpose(2, 3)):  # contiguous, strided
        with pytest.raises(RuntimeError, match="widths 8, 12 or 16"):
            kernels_cpu.attend_planes(q, store, k_widths=widths, v_widths=8)
    late = torch.full((1, 2, 128), 8, dtype=torch.uint8)
    late[0, 1, 127] = 0
    with pytest.raises(RuntimeError, match="widths 8, 12 or 16"):
        kernels_cpu.attend_planes(q, store, k_widths=8, v_widths=late)
    with pytest.raises(RuntimeError, match="must hold 128 tokens"):
        kernels_cpu.attend_planes(q, dataclasses.replace(store, v_a=store.v_a[:, :, :64]), k_widths=8, v_widths=8)
    with pytest.raises(RuntimeError, match="keep_bits must be in 6..16"):
        kernels_cpu.attend_fp16(q, store.tail_k, store.tail_v, keep_bits=5)


# ---------------------------------------------------------------- build and status


NO_COMPILER = """
import torch, kernels_cpu
from kernels_cpu.__main__ import main
print(tuple(kernels_cpu.status()))
print("rc", main(["build"]))
ok, why = kernels_cpu.status()
print(ok)
print(why)
kv = torch.zeros(1, 1, 1, 8).half()
try:
    kernels_cpu.attend_fp16(torch.zeros(1, 1, 1, 8), kv, kv)
except RuntimeError as exc:
    print("raised", exc)
print("strict rc", main(["build", "--strict"]))
"""


def test_no_compiler_leaves_the_kernels_unavailable_with_one_line(tmp_path):
    """One subprocess (CXX pointing nowhere, an empty cache): status, build, status, a call, a strict build."""
    env = {**os.environ, "CXX": "/nonexistent/c++", "KVQUANT_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", NO_COMPILER], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("(False, 'not built")
    assert re.fullmatch(r"kernels_cpu: unavailable \([0-9.]+ s\): build failed: C\+\+ compiler not found .*", lines[1])
    assert "(CXX=/nonexistent/c++) (rebuild with `python -m kernels_cpu build`)" in lines[1]
    assert lines[2] == "rc 0" and lines[3] == "False"
    assert lines[4].startswith("build failed: C++ compiler not found (CXX=/nonexistent/c++)")
    assert lines[5].startswith("raised kernels_cpu unavailable: build failed")
    assert lines[-1] == "strict rc 1" and len(lines) == 8


def test_build_folder_is_keyed_by_compiler_and_lives_in_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path))
    first = loader.build_dir()
    assert first.parent == tmp_path / "kernels_cpu"
    monkeypatch.setenv("CXX", "/some/other/c++")
    assert loader.build_dir() != first


def test_registers_with_the_backend_seam():
    backends = pytest.importorskip("kvquant.backends")
    cpu = backends.get_backend("cpu")
    assert (
        cpu is not None
        and cpu.device_type == "cpu"
        and cpu.formats == {"fp16", "kivi", "gear", "planes", "higgs", "aquakv"}
    )
    assert cpu.status() == kernels_cpu.status()
    assert set(cpu.ops.ATTEND) == cpu.formats  # the protocol's attend for every format it declares
