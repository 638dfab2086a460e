"""The fused C++ CPU kernels (kernels_cpu) against fp64 attention over the same stored tensors.

Stores are written by kvquant's own layers (``fp16``, ``kivi``, ``gear`` via ``new_layer``), so the
layouts are the real ones; the reference reads them back through the layer (kvquant's dequantize) and computes
softmax(q·kᵀ·scale + mask)·v in fp64. The extension is built once per test run if it is not built
yet (about 1.5 min on 2 cores); if the build fails, every kernel test is skipped with its reason.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import require_kernels_cpu

import kernels_cpu
from kernels_cpu import loader
from kvquant.cache import KVGeometry
from kvquant.methods.base import get_method

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def built() -> None:
    require_kernels_cpu()


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


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
    k, v = layer.read(torch.float32)
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
# groups of 4..32 channels (several groups per 16-lane chunk, or one), a store still all window, and
# one long enough (3 heads x 3000 keys) that two threads split the keys into chunks.
KIVI_CASES = [
    (2, 32, 128, 1, 9, 3, 1000, 5, 64),
    (2, 32, 128, 1, 9, 3, 3000, 3, 64),
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
    args = kernels_cpu.kivi_tensors(layer)
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
        assert_close(kernels_cpu.attend_kivi(q, **kernels_cpu.kivi_tensors(layer)), reference(q, k, v))


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
    args = kernels_cpu.gear_tensors(layer)
    if ratio:
        assert args["k_index"] is not None and args["k_index"].shape[-1] > 0
    length = k.shape[2]
    for q_len in (1, 3):
        q = torch.randn(b, hq, q_len, d)
        mask = causal_padding_mask(b, q_len, length, [min(5 * i, length - q_len) for i in range(b)])
        assert_close(kernels_cpu.attend_gear(q, **args, mask=mask), reference(q, k, v, mask))
    q = torch.randn(b, hq, 2, d)
    ref = reference(q, k, v, causal_padding_mask(b, 2, length, [0] * b))
    assert_close(kernels_cpu.attend_gear(q, **args, causal=True), ref)


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
    assert cpu is not None and cpu.device_type == "cpu" and cpu.formats == {"fp16", "kivi", "gear"}
    assert cpu.status() == kernels_cpu.status()
    assert cpu.ops.attend_kivi is kernels_cpu.attend_kivi
