"""AlignedKV's CUDA kernels (kernels_cupy): PTX compile on CPU; on a GPU, bit-for-bit widths and
reads and fp32-rounding outputs against the torch reference (kvquant.alignment)."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from test_kernels_cupy_codes import assert_generates_as_torch, nvcc_compile

from kernels_cupy import SOURCES, cupy_status
from kernels_cupy.launch import (
    qk_shared_bytes,
    qk_split,
    row_chunks,
    softmax_split,
    split_softmax,
    step_launches,
    sv_lanes,
    sv_split,
    tiers,
)
from kernels_cupy.loader import HEADER, SOURCE_DIR, source_text

GPU_OK, GPU_WHY = cupy_status()


def gpu_test(fn):
    """Marked ``gpu``; skipped with the reason where cupy or a CUDA device is missing."""
    return pytest.mark.gpu(pytest.mark.skipif(not GPU_OK, reason=f"needs cupy and a CUDA GPU: {GPU_WHY}")(fn))


U32 = 2.0**-24  # unit roundoff of fp32

# (batch, q heads, kv heads, head_dim, tokens): MHA, GQA, MQA with 16 rows (row chunks), head_dim 8
# (stories260K), 96 (lanes not a power of two) and 256 (8 channels a lane); ragged lengths leave a
# partial block, 64 leaves none, 20 holds only a tail (and fewer tokens than topk).
SHAPES = [
    (1, 4, 4, 64, 64),
    (2, 8, 2, 128, 1000),
    (3, 9, 3, 64, 130),
    (2, 8, 4, 8, 300),
    (1, 16, 1, 64, 517),
    (1, 4, 2, 256, 200),
    (2, 2, 2, 96, 20),
    (1, 32, 8, 128, 4129),
]
THRESHOLDS = [(4.0, 8.0), (1.0, 2.0), (2.5, 6.5), (math.inf, math.inf)]


# ---------------------------------------------------------------- CPU: compile, dispatch, imports


@pytest.mark.parametrize("source", SOURCES)
def test_source_compiles_to_sm80_ptx_without_warnings(source):
    """sm_80 to PTX; sm_90 is compiled (warnings failing it too) by the spill test below."""
    compiled = nvcc_compile(source, "sm_80")
    assert not compiled.log.strip(), compiled.log
    assert ".entry" in compiled.ptx


def test_sources_are_self_contained_after_inlining_the_header():
    for source in SOURCES:
        text = source_text(source)
        assert "#include" not in text and HEADER not in text.split("\n", 1)[0]


def test_the_backend_gives_layers_its_plane_store():
    from kernels_cupy.store import KernelPlaneStore
    from kvquant.backends import TORCH, get_backend
    from kvquant.formats.planes import PlaneStore

    assert type(TORCH.new_state(PlaneStore, block_exponents=False)) is PlaneStore
    store = get_backend("cupy").new_state(PlaneStore, block_exponents=True)
    assert isinstance(store, KernelPlaneStore) and store.block_exponents


def test_thresholds_become_integer_tiers():
    assert tiers((4.0, 8.0)) == (4, 8)
    assert tiers((2.5, 6.01)) == (3, 7)
    assert tiers((math.inf, math.inf)) == (2**31 - 1, 2**31 - 1)


def _tree_sum(values):
    """The reference's O_est order written out: adjacent pairs, zero-padded to a power of two (fp32)."""
    xs = [np.float32(x) for x in values]
    xs += [np.float32(0)] * ((1 << (len(xs) - 1).bit_length()) - len(xs))
    while len(xs) > 1:
        xs = [np.float32(xs[i] + xs[i + 1]) for i in range(0, len(xs), 2)]
    return xs[0]


def _streamed_sum(values, levels=16):
    """sv.cu's ``PairwiseSum`` line for line: one pending partial per level, merged as a binary counter carries."""
    level, count = [np.float32(0)] * levels, 0
    for x in values:
        carry = np.float32(x)
        for j in range(levels):
            if not (count >> j) & 1:
                level[j] = carry
                break
            carry = np.float32(level[j] + carry)
        count += 1
    out = None
    for j in range(levels):
        if (count >> j) & 1:
            out = level[j] if out is None else np.float32(level[j] + out)
    return out


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 7, 8, 13, 16, 31, 32, 33, 64, 100])
def test_o_est_is_summed_in_the_written_order(k):
    """``pairwise_sum`` (the reference) and the kernel's streamed tree give the same fp32 bits as the
    order written out, on products as ``value_widths`` forms them (wide range, fp32 subnormals)."""
    from kernels_cupy.reference import pairwise_sum

    gen = torch.Generator().manual_seed(k)
    scores = torch.rand(64, k, generator=gen) ** 6
    scores[:, ::5] *= 1e-39  # products below fp32's normal range: no flushing anywhere
    x = scores * torch.randn(64, k, generator=gen).half().abs().float()
    rows = x.numpy()
    tree = np.array([_tree_sum(r) for r in rows], dtype=np.float32).view(np.uint32)
    streamed = np.array([_streamed_sum(r) for r in rows], dtype=np.float32).view(np.uint32)
    assert np.array_equal(streamed, tree)
    for got in (pairwise_sum(x, dim=-1), pairwise_sum(x.T, dim=0), pairwise_sum(x.T[None, :, :, None], dim=1)):
        assert np.array_equal(got.flatten().numpy().view(np.uint32), tree)
    if k >= 8:  # the data tells orders apart: a left-to-right sum differs somewhere
        sequential = np.array([np.add.accumulate(r, dtype=np.float32)[-1] for r in rows]).view(np.uint32)
        assert not np.array_equal(sequential, tree)


def test_prefill_chunks_are_split_to_fit_shared_memory():
    """The issue's case (4 query heads per KV head × 128 tokens at d=128) does not fit one QK launch on
    sm_90 (227 KB): two launches of 256 rows do. Any split covers every row once, fits, and is minimal."""
    from kvquant.errors import InvalidParameterError

    sm90, sm80 = 232448, 166912
    per_row, fixed = qk_shared_bytes(128)
    assert fixed + 512 * per_row > sm90
    assert row_chunks(512, per_row, fixed, sm90, "QK") == [(0, 256), (256, 256)]
    assert row_chunks(8, per_row, fixed, sm90, "QK") == [(0, 8)]
    for rows, per_row, fixed, budget in [
        (512, 512, 18432, sm80),
        (2048, 256, 0, sm90),
        (13, 100, 0, 450),
        (1, 8, 8, 16),
    ]:
        chunks = row_chunks(rows, per_row, fixed, budget, "x")
        fit = (budget - fixed) // per_row
        assert [r0 for r0, _ in chunks] == [sum(n for _, n in chunks[:i]) for i in range(len(chunks))]
        assert sum(n for _, n in chunks) == rows and len(chunks) == math.ceil(rows / fit)
        assert all(fixed + n * per_row <= budget for _, n in chunks)
        assert max(n for _, n in chunks) - min(n for _, n in chunks) <= 1
    with pytest.raises(InvalidParameterError, match="topk=40000 needs 320000 bytes"):
        row_chunks(4, 40000 * 8, 0, sm90, "topk=40000")


def test_append_refuses_what_the_model_path_refuses():
    """NaN, ±inf and values beyond fp16's range: the model path refuses them before storing (a plane
    read would turn inf into NaN); the kernels' append refuses them first too, leaving the store untouched."""
    from kernels_cupy.ops import append, check_storable
    from kvquant.errors import KvquantError
    from kvquant.formats.planes import PlaneStore

    k, v, _ = random_kv(1, 2, 2, 16, 10)
    for what, bad in [("key", math.inf), ("key", -math.inf), ("value", math.nan), ("value", 65520.0)]:
        kk, vv = k.float(), v.float()
        (kk if what == "key" else vv)[0, 1, 3, 5] = bad
        store = PlaneStore()
        with pytest.raises(KvquantError, match=f"^1 {what} values are NaN/inf or outside fp16's range"):
            append(store, kk, vv)
        assert store._empty and store.n_tokens == 0 and store.tail_k is None and store.k_absmax is None
    check_storable(torch.tensor([65504.0, -65504.0, 0.0, -0.0]), "key")  # fp16's own extremes are stored
    pytest.importorskip("transformers")
    from kvquant.cache import to_fp16_checked

    bad = torch.tensor([1.0, math.nan, math.inf, 7e4])
    with pytest.raises(KvquantError) as model_path:
        to_fp16_checked(bad, 3, "key")
    with pytest.raises(KvquantError) as kernels:
        check_storable(bad, "key")
    assert str(model_path.value) == f"layer 3: {kernels.value}"


def test_a_layer_store_skips_the_second_check_and_its_syncs(monkeypatch):
    """``append(checked=True)`` (what a layer's ``KernelPlaneStore`` passes: its values went through
    ``to_fp16_checked``) does not run ``check_storable``; a direct ``append`` still refuses (the pack kernel is
    stubbed here: no GPU)."""
    from kernels_cupy import ops, store
    from kvquant.errors import KvquantError
    from kvquant.formats.planes import PlaneStore

    monkeypatch.setattr(ops, "launch", lambda *args, **kw: None)
    monkeypatch.setattr(ops, "ptr", lambda t: np.uint64(0 if t is None else t.data_ptr()))
    k, v, _ = random_kv(1, 2, 2, 16, 70)
    v[0, 1, 3, 5] = math.inf
    with pytest.raises(KvquantError, match="NaN/inf"):
        ops.append(PlaneStore(), k, v)
    ops.append(PlaneStore(), k, v, checked=True)
    calls = []
    monkeypatch.setattr(store, "append", lambda *args, **kw: calls.append(kw))
    store.KernelPlaneStore().append(k, v)
    assert calls == [{"checked": True}]


def test_a_layer_on_another_gpu_is_refused_in_one_line(monkeypatch):
    """The kernels launch on the current device: a tensor of a model spread over GPUs is refused (naming the
    devices and backend=torch) before any launch; CPU tensors and the current device pass."""
    import types

    from kernels_cupy.loader import check_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    check_device(torch.zeros(1))
    check_device(types.SimpleNamespace(is_cuda=True, device=torch.device("cuda:0")))
    with pytest.raises(ValueError, match=r"current CUDA device \(cuda:0\).*on cuda:1: use method.backend=torch"):
        check_device(types.SimpleNamespace(is_cuda=True, device=torch.device("cuda:1")))


def test_kernel_arguments_are_aligned_copies_of_odd_views():
    """An fp16 view at an odd offset would fault on 8/16-byte vector loads: it is copied; aligned ones are not."""
    from kernels_cupy.ops import ALIGN, kernel_arg

    base = torch.arange(64, dtype=torch.float16)
    odd = base[1:17]
    assert odd.data_ptr() % ALIGN and odd.is_contiguous()
    copy = kernel_arg(odd)
    assert copy.data_ptr() % ALIGN == 0 and copy.data_ptr() != odd.data_ptr() and torch.equal(copy, odd)
    aligned = base[8:24]
    assert kernel_arg(aligned).data_ptr() == aligned.data_ptr() and kernel_arg(None) is None


def test_kernel_package_imports_without_heavy_dependencies():
    code = (
        "import sys, kernels_cupy, kernels_cupy.ops, kernels_cupy.reference, kernels_cupy.loader, kernels_cupy.store\n"
        "heavy = [m for m in ('transformers', 'hydra', 'wandb', 'lm_eval', 'cupy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=SOURCE_DIR.parent)
    assert done.returncode == 0, done.stderr


def test_reference_is_the_methods_chain():
    """The oracle equals AlignedLayer.aligned_read (widths and reads) on CPU."""
    pytest.importorskip("transformers")
    from kernels_cupy.reference import reference_attention
    from kvquant.cache import KVGeometry
    from kvquant.methods.alignedkv import AlignedKVMethod, AlignedKVPlusMethod

    for cls in (AlignedKVMethod, AlignedKVPlusMethod):
        method = cls()
        layer = method.new_layer(0, KVGeometry(n_layers=1, n_heads=4, n_kv_heads=2, head_dim=64))
        k, v, q = random_kv(2, 4, 2, 64, 300, seed=3)
        layer.update(k, v)
        keys, values, wk, wv = layer.aligned_read(q, None, 64**-0.5)
        ref = reference_attention(
            layer.store, q, None, 64**-0.5, method.k_thresholds, method.v_thresholds, 32, cls.blockwise
        )
        assert torch.equal(ref["wk"], wk) and torch.equal(ref["wv"], wv)
        assert torch.equal(ref["keys"], keys) and torch.equal(ref["values"], values)


def test_bench_counts_bytes_read():
    """The benchmark's byte count: all-16 widths read fp16's bytes; 8-bit reads half of a plane row."""
    from conftest import load_script

    bench = load_script("bench_kernels")
    b, h, d, n = 2, 3, 16, 64 * 3 + 5
    k, v, _ = random_kv(b, h, h, d, n)
    store = cpu_store(k, v, True, [(0, n)])
    meta = 2 * b * h * d
    assert bench.kv_bytes(store, None, None, False)[0] == 2 * 2 * b * h * n * d + meta
    wk, wv = torch.full((b, h, d), 8), torch.full((b, h, 3 * 64), 8)
    total, bits_k, bits_v = bench.kv_bytes(store, wk, wv, True)
    assert (bits_k, bits_v) == (8.0, 8.0)
    assert total == 2 * b * h * 3 * 64 * d + 2 * 2 * b * h * 5 * d + meta + store.k_exp.numel()
    block_store = cpu_store(k, v, False, [(0, n)], 32)  # the block rule also reads its exponent bytes
    assert block_store.v_exp.numel() == b * h * 6 * d
    with_exp = bench.kv_bytes(block_store, wk, wv, False, block_rule=True)[0]
    assert with_exp == bench.kv_bytes(block_store, wk, wv, False)[0] + block_store.v_exp.numel()


def test_bench_table_keeps_notes_in_their_column():
    """A method whose graph capture failed, or a configuration the time budget skipped, is said once in the
    note column; the ratios come from the times that were measured."""
    from conftest import load_script

    bench = load_script("bench_kernels")
    rows = [
        {"shape": "llama2_7b", "batch": 1, "context": 4096, "sdpa ms": 0.1, "block ms": 0.2, "note": " block_w: x"},
        {"shape": "llama2_7b", "batch": 8, "context": 32768, "note": "skipped: time budget"},
    ]
    lines = bench.table(rows).splitlines()
    header, *cells = ([c.strip() for c in line.strip("|").split("|")] for line in lines[:1] + lines[2:])
    assert header[-1] == "note" and len(lines) == 4
    assert cells[0][-1] == "block_w: x" and cells[0][header.index("sdpa/block")] == "0.50"
    assert cells[1][-1] == "skipped: time budget" and cells[1][header.index("sdpa ms")] == ""


def test_bench_reads_issue_32_targets_off_its_rows():
    """Issue 32's GPU targets below the benchmark's table: per kernel pair the worst row of each target, PASS at
    the bound itself and FAIL past it; not measured where no row was timed (a skipped configuration, another
    shape's rows)."""
    from conftest import load_script

    bench = load_script("bench_kernels")
    big = {"shape": "llama2_7b", "batch": 8}
    rows = [
        big | {"context": 32768, "sdpa ms": 1.0, "block ms": 0.87, "block %copy": 75.0, "block_w ms": 0.5},
        big | {"context": 65536, "sdpa ms": 2.0, "block ms": 1.6, "block %copy": 80.0, "block_w ms": 1.9},
        {"shape": "llama2_7b", "batch": 1, "context": 4096, "sdpa ms": 0.1, "block ms": 0.2, "block_w ms": 0.21},
        {"shape": "llama3_8b", "batch": 8, "context": 32768, "sdpa ms": 1.0, "block ms": 9.0, "block_w ms": 9.0},
        big | {"context": 131072, "note": "skipped: time budget"},
    ]
    rows[0]["block_w %copy"], rows[1]["block_w %copy"] = 90.0, 74.0
    lines = bench.targets(rows).splitlines()
    block, block_w = (next(line for line in lines if line.startswith(f"- `{name}`:")) for name in ("block", "block_w"))
    assert "SDPA's at >= 32K, batch 8: PASS (0.87x at 32K)" in block  # the worse of 0.87x and 0.80x
    assert "copy bandwidth there: PASS (75% at 32K)" in block
    assert "SDPA's at 4K, batch 1: PASS (2.00x at 4K)" in block
    assert "SDPA's at >= 32K, batch 8: FAIL (0.95x at 64K)" in block_w
    assert "copy bandwidth there: FAIL (74% at 64K)" in block_w
    assert "SDPA's at 4K, batch 1: FAIL (2.10x at 4K)" in block_w
    aligned_w = next(line for line in lines if line.startswith("- `aligned_w`:"))
    assert aligned_w.count(": not measured") == 3  # no row timed it
    assert bench.targets(rows[3:]).count(": not measured") == 9


def test_bench_lists_the_kernels_of_a_step():
    """The benchmark's per-step kernel list: calls and time per step, and a total row per method (on a CPU
    the profiler's CPU ops stand in for the device kernels)."""
    from conftest import load_script

    bench = load_script("bench_kernels")
    a = torch.randn(96, 96)
    rows = bench.kernel_times({"mm": lambda: a @ a, "two": lambda: (a @ a) + a}, steps=4)
    by = {(r["method"], r["kernel"]): r for r in rows}
    assert by[("mm", "aten::mm")]["calls"] == 1.0 and ("mm", "aten::add") not in by
    assert by[("two", "aten::mm")]["calls"] == 1.0 and by[("two", "aten::add")]["calls"] == 1.0
    for method in ("mm", "two"):
        parts = [r for r in rows if r["method"] == method and r["kernel"] != "(all)"]
        assert by[(method, "(all)")]["us"] == pytest.approx(sum(r["us"] for r in parts))
        assert by[(method, "(all)")]["calls"] == sum(r["calls"] for r in parts)
    assert "| two | aten::add | 1.0 |" in bench.kernel_table(rows)


def test_bench_times_the_host_work_of_an_eager_call():
    """``--host``: each method's host time per call (the device drained before each call, outside the timing), its
    share of the eager call's time, and the block rule's call profiled by function (which part of the host time
    is whose: on a GPU CuPy's launches and torch's allocations)."""
    from conftest import load_script

    bench = load_script("bench_kernels")
    drained = []

    def slow():
        time.sleep(0.002)

    def quick():
        return None

    times = bench.host_times({"block": slow, "sdpa": quick}, repeats=5, drain=lambda: drained.append(1))
    assert len(drained) == 2 * (5 + 1)  # before each timed call and once after each method
    assert times["block"] >= 0.002 > 10 * times["sdpa"]
    profile = bench.host_profile(slow, 7)
    assert profile.startswith("7 calls;") and "slow" in profile and "sleep" in profile
    row = {"shape": "llama2_7b", "batch": 1, "context": 4096, "host": times, "block ms": 4.0, "host_profile": {}}
    lines = bench.host_table(row).splitlines()
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in lines[2:]}
    assert cells["block"][1:] == ["4.000", f"{100 * times['block'] * 1e3 / 4.0:.0f}%"]
    assert cells["sdpa"][1:] == ["", ""] and float(cells["block"][0]) == pytest.approx(times["block"] * 1e6, abs=0.1)
    row["host_profile"] = {"block": profile}
    section = bench.host_section(row)
    assert "host work per eager call, llama2_7b batch 1 context 4096:" in section and "```\n7 calls;" in section


SM90, SM80 = 232448, 166912


@pytest.mark.parametrize("source", SOURCES)
def test_no_kernel_spills_registers_on_sm90(source):
    """sm_90 (what the H200 runs) without warnings, and ``ptxas -v``: no kernel spills to local memory."""
    compiled = nvcc_compile(source, "sm_90")
    assert not compiled.warnings(), compiled.log
    assert compiled.frames() and all(f[1:] == (0, 0) for f in compiled.frames()), compiled.log


@pytest.mark.parametrize("n", [1, 5, 64, 100, 4129, 32768])
@pytest.mark.parametrize("span", [64, 1024, 4096])
def test_split_softmax_equals_one_pass_softmax(n, span):
    """The split statistics merged by log-sum-exp (QK's per-CTA ``(m, l)``, ``softmax.cu``'s merge) give the
    one-pass softmax within fp32 rounding, with bool masks, additive masks and fully masked rows (0, as
    the reference's ``nan_to_num``)."""
    from kernels_cupy.launch import merge_softmax_partials
    from kernels_cupy.ops import softmax_scores

    gen = torch.Generator().manual_seed(n + span)
    logits = torch.randn(3, 2, 2, n, generator=gen) * 4
    keep = torch.rand(3, 1, 2, n, generator=gen) > 0.3
    keep[0, :, 1] = False  # a fully masked row
    keep[1, :, 0, : min(n, span)] = False  # a whole split masked
    additive = torch.where(torch.rand(3, 1, 2, n, generator=gen) > 0.5, 0.0, -1e4)
    for mask in (None, keep, additive):
        want = softmax_scores(logits, mask).double()
        if mask is None:
            masked = logits
        else:
            masked = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
        got = split_softmax(masked, span).double()
        tol = (n + 8) * U32 * want + 1e-45
        assert bool(((got - want).abs() <= tol).all()), float((got - want).abs().max())
        assert bool((got[want == 0] == 0).all())
    parts = torch.tensor([[float("-inf"), 0.0], [1.5, 2.0], [0.5, 3.0], [float("-inf"), 0.0]])
    m, total = merge_softmax_partials(parts)
    assert float(m) == 1.5 and math.isclose(float(total), 2.0 + 3.0 * math.exp(-1.0), rel_tol=1e-6)
    m, total = merge_softmax_partials(torch.full((3, 2), float("-inf")).index_fill(1, torch.tensor([1]), 0.0))
    assert float(m) == float("-inf") and float(total) == 0.0


@pytest.mark.parametrize("sms", [132, 108])
@pytest.mark.parametrize("bh", [1, 8, 32, 256])
@pytest.mark.parametrize("n", [20, 64, 300, 4096, 4129, 131072])
def test_split_arithmetic_covers_every_token_once(n, bh, sms):
    """QK, softmax and SV splits: every token in exactly one CTA, no empty CTA; softmax spans are whole
    strided rows of top-k; SV spans are whole 64-token blocks holding at least one 32-token group per warp."""
    n_units = math.ceil(n / 64)
    per_cta, n_qk = qk_split(n_units, bh, sms)
    assert (n_qk - 1) * per_cta < n_units <= n_qk * per_cta
    for topk in (0, 7, 32, 300):
        span, n_splits = softmax_split(n, topk, bh, sms)
        assert (n_splits - 1) * span < n <= n_splits * span
        assert span % (topk or 64) == 0 and span // (topk or 64) >= 16
    per_cta, n_chunks = sv_split(n, bh, sms)
    assert (n_chunks - 1) * per_cta < n <= n_chunks * per_cta
    assert per_cta % 64 == 0 and per_cta >= 256
    for value_block in (32, 64):  # warp groups start every 32 tokens from a chunk's start: one block each
        starts = [c * per_cta + g for c in range(n_chunks) for g in range(0, per_cta, 32)]
        assert all(start // value_block == (start + 31) // value_block for start in starts)


@pytest.mark.parametrize("width", [8, 12, 16])
def test_read8_reads_every_element_as_read_planes(width):
    """The warp kernel's ``read8`` (``launch.read8_words``, line for line) on all 65,536 (A byte, B nibble,
    C nibble) elements shuffled into rows of 8 (zeros, subnormals, exponent 31 and ordinary elements share
    words), plus rows of only ±0, of only ±inf and of zero high bytes over nonzero nibbles: each element as
    ``read_bits`` reads it, and, NaN aside (storage never holds one), as ``kvquant.bits.read_planes``."""
    from kernels_cupy.launch import read8_words
    from kvquant.bits import fp16_bits, pack_nibbles, read_planes

    gen = torch.Generator().manual_seed(width)
    bits = torch.arange(65536)[torch.randperm(65536, generator=gen)].view(-1, 8)
    special = torch.tensor([[0x0000, 0x8000] * 4, [0x7C00, 0xFC00] * 4, [0x000F, 0x80F0, 0x0001, 0x8010] * 2])
    bits = torch.cat([bits, special])
    a, nib_b, nib_c = bits >> 8, (bits >> 4) & 0xF, bits & 0xF
    packed_b, packed_c = pack_nibbles(nib_b), pack_nibbles(nib_c)
    shifts = torch.arange(4) * 8
    a_words = torch.stack([(a[:, 4 * h : 4 * h + 4] << shifts).sum(-1) for h in (0, 1)], dim=-1)
    b_word = (packed_b.long() << shifts).sum(-1) if width >= 12 else torch.zeros(len(bits), dtype=torch.long)
    c_word = (packed_c.long() << shifts).sum(-1) if width == 16 else torch.zeros(len(bits), dtype=torch.long)
    words = read8_words(a_words, b_word, c_word, width)
    got = torch.stack([words & 0xFFFF, words >> 16], dim=-1).flatten(-2)
    kept = bits & ((0xFFFF << (16 - width)) & 0xFFFF)
    as_is = ((kept & 0x7FFF) == 0) | (((bits >> 10) & 0x1F) == 31)
    fill = 0 if width == 16 else 1 << (15 - width)
    assert torch.equal(got, torch.where(as_is, kept, kept | fill))
    want = fp16_bits(read_planes(a.to(torch.uint8), packed_b.to(torch.uint8), packed_c.to(torch.uint8), width))
    nan = (((bits >> 10) & 0x1F) == 31) & ((bits & 0x3FF) != 0)
    assert torch.equal(got[~nan], want[~nan].long())


@pytest.mark.parametrize("sms", [132, 108])
@pytest.mark.parametrize("bh", [1, 8, 32, 256])
@pytest.mark.parametrize("n_units", [1, 7, 64, 65, 2048])
def test_warp_kernel_split_gives_each_warp_whole_units(n_units, bh, sms):
    """Every unit in exactly one CTA, in whole rounds of the CTA's 8 warps or fewer units than warps (then as
    many CTAs as the tile kernel's split); decode rows take the warp kernel up to 4 a KV head (accumulated as
    1, 2 or 4), longer chunks the tile kernel; shared memory as the kernel lays it out."""
    from kernels_cupy.launch import qk_warp_rows, qk_warp_shared_bytes, qk_warp_split

    per_cta, n_ctas = qk_warp_split(n_units, bh, sms)
    assert (per_cta % 8 == 0 or per_cta < 8) and (n_ctas - 1) * per_cta < n_units <= n_ctas * per_cta
    tile = qk_split(n_units, bh, sms)
    assert per_cta >= tile[0] and (per_cta >= 8 or (per_cta, n_ctas) == tile)
    assert [qk_warp_rows(r) for r in range(1, 7)] == [1, 2, 4, 4, None, None]
    assert qk_warp_shared_bytes(128, 4) == (4 * 128 + 2 * 128 + 128) * 4 and qk_warp_shared_bytes(8, 1) == 32 * 4


def parameters(text: str) -> list[tuple[str, str]]:
    """``(kind, name)`` of a C parameter list (``ptr`` for any pointer), comments and line continuations dropped."""
    import re

    text = re.sub(r"//[^\n]*", "", text.replace("\\\n", "\n"))
    out = []
    for param in (" ".join(x.replace("__restrict__", "").split()) for x in text.split(",")):
        kind, name = param.replace("*", "* ").rsplit(" ", 1)
        out.append(("ptr" if "*" in kind else kind.replace("const ", "").strip(), name))
    return out


def qk_signature() -> list[tuple[str, str]]:
    """``(type, name)`` of each parameter of both QK kernels (qk.cu's ``QK_PARAMS``)."""
    text = (SOURCE_DIR / "qk.cu").read_text().replace("\\\n", "\n")
    start = text.index("#define QK_PARAMS") + len("#define QK_PARAMS")
    return parameters(text[start : text.index("#define", start)])


def kernel_signature(source: str, opening: str) -> list[tuple[str, str]]:
    """``(type, name)`` of the parameters that follow ``opening`` (the text up to the list's ``(``) in ``source``."""
    text = (SOURCE_DIR / source).read_text()
    start = text.index(opening) + len(opening)
    depth, end = 1, start
    while depth:
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        end += 1
    return parameters(text[start : end - 1])


KERNEL_ARG_KINDS = {np.uint64: "ptr", np.int32: "int", np.int64: "long long", np.float32: "float"}


@pytest.mark.parametrize("qk_kernel", ["tile", "warp"])
@pytest.mark.parametrize(("mode", "blockwise"), [("aligned", False), ("blockwise", True), ("full", False)])
@pytest.mark.parametrize(("hq", "q_len"), [(4, 1), (8, 1), (16, 1), (4, 2), (8, 5)])
def test_qk_launch_arguments_match_the_kernels_signature(qk_kernel, mode, blockwise, hq, q_len, monkeypatch):
    """Each argument of a QK launch has its parameter's type, in order, and the named sizes are the store's and
    the split's; ``warp`` takes ``qk_warp_{aligned,blockwise,full}_r{1,2,4}`` at up to 4 rows a KV head (on the
    warp split, its own shared memory), the tile kernel past that (a misordered argument would only show on a
    GPU otherwise)."""
    from kernels_cupy import ops
    from kernels_cupy.launch import qk_warp_shared_bytes, qk_warp_split

    calls = []
    monkeypatch.setattr(ops, "ptr", lambda t: np.uint64(0 if t is None else t.data_ptr()))  # CPU tensors
    monkeypatch.setattr(ops, "sm_count", lambda index: 132)
    monkeypatch.setattr(ops, "shared_memory_budget", lambda index: SM90)
    monkeypatch.setattr(ops, "launch", lambda *args, **kw: calls.append((args, kw)))
    monkeypatch.setattr(ops, "_geometry", lambda store, q: (*q.shape, 4, q.shape[1] // 4 * q.shape[2], store.n_tokens))
    b, hkv, d, n = 2, 4, 64, 300
    k, v, q = random_kv(b, hq, hkv, d, n, seed=1, q_len=q_len)
    store = cpu_store(k, v, True, chunks_for(n))
    ops._qk(store, q, d**-0.5, (4, 8), blockwise, mode == "full", True, None, qk_kernel)
    ((source, name, grid, block, args), kw) = calls[0]
    assert len(calls) == 1 and source == "qk.cu" and block == 256
    params = qk_signature()
    assert [KERNEL_ARG_KINDS[type(x)] for x in args] == [kind for kind, _ in params]
    named = {param: x for (_, param), x in zip(params, args, strict=True)}
    rows = hq // hkv * q_len
    warp = qk_kernel == "warp" and rows <= 4
    rt = next(r for r in (1, 2, 4) if rows <= r) if warp else None
    assert name == (f"qk_warp_{mode}_r{rt}" if warp else ops.TILE_KERNELS[mode])
    per_cta, n_ctas = (qk_warp_split if warp else qk_split)(5, b * hkv, 132)
    assert grid == (n_ctas, b * hkv) and int(named["units_per_cta"]) == per_cta
    assert kw["shared_mem"] == (qk_warp_shared_bytes(d, rows) if warp else qk_shared_bytes(d)[1] + rows * d * 4)
    want = {"R": rows, "R_total": rows, "row0": 0, "D": d, "nblk": 4, "cap_blk": 4, "n_tail": n - 256}
    assert {key: int(named[key]) for key in want} == want
    assert bool(named["k_exp"]) == (mode == "blockwise") and bool(named["wk"]) == (mode != "full")
    assert bool(named["keys_out"]) and bool(named["partial_ml"]) and float(named["scaling"]) == np.float32(d**-0.5)


@pytest.mark.parametrize("qk_kernel", ["tile", "warp"])
@pytest.mark.parametrize("sv_read", ["bytes", "permute"])
@pytest.mark.parametrize(("rule", "full"), [("token", False), ("block", False), ("token", True)])
@pytest.mark.parametrize(("hq", "hkv", "d", "q_len"), [(8, 2, 128, 1), (4, 4, 64, 1), (8, 4, 8, 2)])
def test_a_decode_step_hands_each_kernel_what_the_one_before_wrote(
    qk_kernel, sv_read, rule, full, hq, hkv, d, q_len, monkeypatch
):
    """One ``aligned_attention`` step, launched dry on the CPU: each of its three launches passes arguments of
    its kernel's parameter types in order, and the kernels are chained through the same buffers — softmax_topk
    normalises the logits QK wrote and merges QK's per-CTA statistics (as many as QK's CTAs), SV reads those
    probabilities and softmax_topk's ``e(O_est)`` (null for the control), each kernel's ticket counters are its
    own, the buffers a kernel writes are distinct from everything else it reads or writes, and the sizes are the
    store's (a misordered or mismatched argument would only show on a GPU otherwise)."""
    from kernels_cupy import ops

    calls = []
    monkeypatch.setattr(ops, "ptr", lambda t: np.uint64(0 if t is None else t.data_ptr()))  # CPU tensors
    monkeypatch.setattr(ops, "sm_count", lambda index: 132)
    monkeypatch.setattr(ops, "shared_memory_budget", lambda index: SM90)
    monkeypatch.setattr(ops, "launch", lambda *args, **kw: calls.append(args))
    monkeypatch.setattr(ops, "_geometry", lambda store, q: (*q.shape, hkv, hq // hkv * q.shape[2], store.n_tokens))
    counters = torch.zeros(1024, dtype=torch.int32)
    monkeypatch.setattr(ops, "counters", lambda device, n: counters)
    b, n = 2, 300
    k, v, q = random_kv(b, hq, hkv, d, n, seed=2, q_len=q_len)
    store = cpu_store(k, v, False, chunks_for(n), 32)
    mask = torch.ones(q_len, n, dtype=torch.bool).tril(n - q_len) if q_len > 1 else None
    ops.aligned_attention(store, q, mask, d**-0.5, (4, 8), (4, 8), 32, False, full, rule, False, qk_kernel, sv_read)
    assert [c[0] for c in calls] == ["qk.cu", "softmax.cu", "sv.cu"]
    signatures = {
        "qk.cu": qk_signature(),
        "softmax.cu": kernel_signature("softmax.cu", "softmax_topk("),
        "sv.cu": kernel_signature("sv.cu", "SV_MIN_CTAS(RC, CPT, MODE, PERM)) NAME("),
    }
    named = {}
    for source, name, _, _, args in calls:
        params = signatures[source]
        assert [KERNEL_ARG_KINDS[type(x)] for x in args] == [kind for kind, _ in params], name
        named[source] = {param: int(x) for (_, param), x in zip(params, args, strict=True)}
    qk_args, sm_args, sv_args = named["qk.cu"], named["softmax.cu"], named["sv.cu"]
    rows, bh = hq // hkv * q_len, b * hkv
    assert calls[1][2][1:] == (rows, bh) and calls[2][2][1] == bh
    assert calls[2][1].startswith(f"sv_{'full' if full else rule}_") and calls[2][1].endswith("_p") == (
        sv_read == "permute"
    )
    assert sm_args["scores"] == qk_args["logits"] == sv_args["scores"] != 0  # normalised in place, read by SV
    assert sm_args["partial_ml"] == qk_args["partial_ml"] != 0 and sm_args["n_qk"] == calls[0][2][0]
    assert sm_args["normalize"] == 1 and sm_args["k"] == (0 if full else 32)
    assert sv_args["e_o"] == (0 if full else sm_args["e_o"]) and (sm_args["e_o"] != 0) != full
    assert (sm_args["best_val"] != 0) != full and (sm_args["best_idx"] != 0) != full
    assert sv_args["counter"] == sm_args["counter"] + 4 * bh and sm_args["counter"] == counters.data_ptr()
    for args in (sm_args, sv_args):
        want = {"R": rows, "D": d, "n_full": store.n_full, "n_tail": n - store.n_full}
        assert {key: args[key] for key in want} == want
    assert sm_args["L"] == n and sv_args["value_block"] == (32 if rule == "block" and not full else 0)
    assert bool(sv_args["v_exp"]) == (rule == "block" and not full)
    assert sv_args["v_a"] == sm_args["v_a"] == store.v_a.data_ptr() and sv_args["v_b"] == store.v_b.data_ptr()
    written = {  # what each kernel writes; a buffer freed after one kernel may be another's later (stream order)
        "qk.cu": ("logits", "wk", "partial_ml"),
        "softmax.cu": ("scores", "best_val", "best_idx", "e_o"),
        "sv.cu": ("partial", "out", "wv"),
    }
    for source, args in named.items():
        pointers = [x for kind_name, x in zip(signatures[source], args.values(), strict=True) if kind_name[0] == "ptr"]
        outs = [args[name] for name in written[source] if args[name]]
        assert len(set(outs)) == len(outs) and all(pointers.count(x) == 1 for x in outs), source


#: torch operators a decode step on the CuPy kernels may add to a layer beyond DynamicCache's (its two ``cat`` and
#: SDPA): the range checks, the query's and output's casts, the kernels' buffers, the width counts (AlignedKV: 5,
#: where ``bincount`` took 12 and four syncs), the coding of the value leaving KIVI's window
#: (``kvquant.quant.integer.quantize``), HIGGS's coding of each new token in torch (``Higgs.quantize``, 27 operators;
#: 28 more a layer with the decodings nothing read, 8 with the pads and copies of nothing); 2 spare, 8 for HIGGS's
#: longer chain
EXTRA_OPS_A_LAYER = {
    "alignedkv": 19, "alignedkv_block": 19, "alignedkv_plus_block": 25, "kivi2": 40, "gear2": 12, "higgs": 97,
    "higgs_post_rope": 88,
}  # fmt: skip


@pytest.mark.parametrize("name", list(EXTRA_OPS_A_LAYER))
def test_a_decode_step_on_the_cupy_kernels_never_waits_for_the_gpu(name, monkeypatch):
    """A whole decode step of a model whose caches read by these kernels, launched dry on the CPU (kernels not
    run, their outputs zero and widths filled): no torch operator of the step would wait for a GPU
    (``OpCounter.syncs``: ``item``, ``bincount``, boolean-mask indexing…), so the host can run ahead of the device
    through every layer (four syncs a layer and step counted AlignedKV's widths before), and the operators it adds
    to a layer beyond DynamicCache's stay within ``EXTRA_OPS_A_LAYER`` (each is a launch on a GPU, what a batch-1
    step is bound by). The range checks are deferred as on a GPU, and the width counts take the torch path a GPU
    takes."""
    import functools

    from transformers import DynamicCache

    from kernels_cupy import aquakv, codes, higgs, ops, store
    from kernels_cupy import backend as cupy_backend
    from kvquant.analysis.timing import OpCounter, layout_model, synthetic_kv
    from kvquant.backends import get_backend
    from kvquant.methods import alignedkv, base, get_method

    def dry(*args, **kwargs):
        return None

    for module in (ops, codes, store, higgs, aquakv):
        monkeypatch.setattr(module, "launch", dry)
    for module, names in (
        (ops, ("ptr", "check_device")),
        (codes, ("ptr", "raw", "check_cuda")),
        (store, ("check_device",)),
        (higgs, ("ptr", "check_cuda")),
    ):
        for attr in names:
            fake = (lambda t: np.uint64(0 if t is None else t.data_ptr())) if attr in ("ptr", "raw") else dry
            monkeypatch.setattr(module, attr, fake)
    monkeypatch.setattr(cupy_backend, "check_device", dry)
    monkeypatch.setattr(ops, "sm_count", lambda index: 132)
    for module in (codes, higgs):
        monkeypatch.setattr(module, "sm_count", lambda index: 132)
    monkeypatch.setattr(ops, "shared_memory_budget", lambda index: SM90)
    monkeypatch.setattr(
        ops,
        "_geometry",
        lambda st, q: (*q.shape, st.tail_k.shape[1], q.shape[1] // st.tail_k.shape[1] * q.shape[2], st.n_tokens),
    )
    counters = torch.zeros(4096, dtype=torch.int32)
    monkeypatch.setattr(ops, "counters", lambda device, n: counters)
    monkeypatch.setattr(alignedkv, "head_width_counts", functools.partial(alignedkv.head_width_counts, in_numpy=False))
    monkeypatch.setattr(base, "resolve_backend", lambda *args, **kwargs: get_backend("cupy"))
    attend = dict(cupy_backend.ATTEND)

    def filled(fmt):
        def run(*args, **kwargs):
            out, reads = attend[fmt](*args, **kwargs)
            with torch.utils._python_dispatch._disable_current_modes():  # what the kernels would have written
                out.zero_()
                for widths, value in ((reads.k_widths, 12), (reads.v_widths, 8)):
                    if widths is not None:
                        widths.fill_(value)
            return out, reads

        return run

    monkeypatch.setattr(cupy_backend, "ATTEND", {fmt: filled(fmt) for fmt in attend})
    model = layout_model("smollm2_135m", "cpu", 2)
    method = get_method(name, backend="cupy")
    with method.attach(model):
        cache = method.new_cache(model)
        assert cache.backend == "cupy"
        k, v = synthetic_kv("smollm2_135m", 300, 0, 1, "cpu")
        for layer in cache.layers:
            layer.finite.deferred = True
            layer.update(k.half(), v.half())
        for step in range(2):
            with torch.no_grad(), OpCounter(cpu_as_gpu=True) as counter:
                position = torch.tensor([[300 + step]])
                model(input_ids=torch.tensor([[5]]), past_key_values=cache, position_ids=position, use_cache=True)
        assert counter.total > 0 and not counter.syncs, counter.syncs
    dynamic = DynamicCache(config=model.config)
    for index in range(model.config.num_hidden_layers):
        dynamic.update(k, v, index)
    with torch.no_grad(), OpCounter() as baseline:
        model(input_ids=torch.tensor([[5]]), past_key_values=dynamic, position_ids=position, use_cache=True)
    extra = (counter.total - baseline.total) / model.config.num_hidden_layers
    assert 0 < extra <= EXTRA_OPS_A_LAYER[name], (extra, counter.counts)


@pytest.mark.parametrize("d", [8, 16, 24, 64, 96, 128, 256])
def test_sv_lanes_cover_the_row_with_aligned_loads(d):
    """Each active lane holds CPT whole channels (16 where d allows: a 16-byte plane-A load), lanes of a row
    are a power of two within a warp, and every load is aligned to its width."""
    cpt, seg = sv_lanes(d)
    assert d % cpt == 0 and seg & (seg - 1) == 0 and seg <= 32 and seg * cpt >= d > (seg // 2) * cpt
    assert cpt == (16 if d % 16 == 0 else 8)
    for lane in range(seg):
        c0 = lane * cpt
        if c0 < d:
            assert (d * 7 + c0) % cpt == 0 and (d // 2 * 7 + c0 // 2) % (cpt // 2) == 0  # A, B/C rows
            assert (2 * (d * 7 + c0)) % 16 == 0  # tail fp16: 16-byte loads


def test_a_decode_step_is_at_most_four_launches():
    """Decode (GQA groups up to 8 query heads a KV head) is three launches on sm_80 and sm_90; the issue's
    prefill chunk (512 rows at d=128) adds one QK row chunk."""
    for budget in (SM80, SM90):
        for rows in (1, 4, 8):
            for d in (64, 128, 256):
                assert step_launches(rows, d, budget) == 3
        assert step_launches(512, 128, SM90) == 4


def test_limits_take_the_block_rule_at_warp_sized_blocks():
    """The plane kernels' limits: the block rule at 32 or 64 tokens, no per-block paper rule, and head dims the
    layout takes (``auto`` then falls back to torch instead of failing at the first append)."""
    from kernels_cupy.backend import limits
    from kvquant.cache import KVGeometry
    from kvquant.formats.planes import AlignedRule

    class Geometry:
        softcap = None
        sliding_window = None

    assert limits("planes", Geometry, AlignedRule()) == []
    for v_block in (32, 64):
        assert limits("planes", Geometry, AlignedRule(v_block=v_block, value_rule="block")) == []
    assert limits("planes", Geometry, AlignedRule(v_block=16, value_rule="block")) == [
        "the block rule at v_block=16 (v_block a multiple of 32 here: 32 or 64)"
    ]
    assert limits("planes", Geometry, AlignedRule(v_block=2)) == ["value widths per block (v_block=2)"]
    for head_dim, ok in ((8, True), (256, True), (96, True), (12, False), (264, False)):
        geometry = KVGeometry(2, 4, 2, head_dim)
        assert limits("planes", geometry, AlignedRule()) == (
            [] if ok else [f"head_dim {head_dim} (the plane kernels take multiples of 8 up to 256)"]
        )


def kernel_block_widths(scores, v_exp, e_o, value_block, thresholds):
    """``sv.cu``'s ``block_width`` in integer torch: ``min_c(e_o − v_exp)`` less ``floor_log2_bits`` of the
    largest score bits of the block over all rows; no contribution reads 8 (``NO_CONTRIBUTION``)."""
    b, hkv, n_blocks, d = v_exp.shape
    n_full = n_blocks * value_block
    s = scores.float().reshape(b, hkv, -1, scores.shape[-1])[..., :n_full].contiguous()
    s_max = s.view(torch.int32).amax(dim=2).unflatten(-1, (n_blocks, value_block)).amax(-1).long()
    field = s_max >> 23
    subnormal = -118 - (31 - torch.floor(torch.log2(s_max.clamp_min(1).double())).long())
    e_s = torch.where(field == 0, subnormal, field - 127)
    gap_c = (e_o.view(b, hkv, 1, d).long() - v_exp.long()).amin(-1)
    gap = torch.where(s_max == 0, 1 << 20, gap_c - e_s)
    t12, t8 = tiers(thresholds)
    widths = torch.where(gap >= t8, 8, torch.where(gap >= t12, 12, 16)).to(torch.int32)
    return widths.repeat_interleave(value_block, dim=-1)


@pytest.mark.parametrize("value_block", [32, 64])
@pytest.mark.parametrize("thresholds", THRESHOLDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_block_width_arithmetic_is_the_block_rule(shape, thresholds, value_block):
    """The block rule as ``sv.cu`` computes it (integer exponents, score bits, integer tiers) equals
    ``kvquant.alignment.block_value_widths`` on the same fp32 scores, with subnormal and zero scores."""
    from kernels_cupy.reference import reference_block_widths
    from kvquant.alignment import grouped_scores, output_exponents

    b, hq, hkv, d, n = shape
    k, v, q = random_kv(b, hq, hkv, d, n, seed=21)
    store = cpu_store(k, v, False, chunks_for(n), value_block)
    scores = torch.softmax(torch.randn(b, hq, 1, n, generator=torch.Generator().manual_seed(n)) * 6, dim=-1)
    scores[..., ::7] *= 1e-40  # fp32 subnormals
    scores[..., : min(n, 64)] = 0.0  # a block no query attends to
    want = reference_block_widths(scores, store, thresholds)
    if store.v_exp is None:
        assert want.shape[-1] == 0
        return
    e_o = output_exponents(grouped_scores(scores, hkv), store.high_bytes_at, 32)
    got = kernel_block_widths(scores, store.v_exp, e_o, value_block, thresholds)
    assert torch.equal(got, want)


# ---------------------------------------------------------------- data and helpers


def random_kv(b, hq, hkv, d, n, seed=0, dtype=torch.float16, q_len=1):
    """K/V with realistic channel outliers, plus exact zeros and values whose high byte reads as ±0."""
    gen = torch.Generator().manual_seed(seed)
    channel = torch.exp(torch.randn(1, hkv, 1, d, generator=gen) * 1.2)
    channel[..., torch.randperm(d, generator=gen)[: max(1, d // 16)]] *= 25
    k = torch.randn(b, hkv, n, d, generator=gen) * channel
    token = torch.exp(torch.randn(b, hkv, n, 1, generator=gen))
    v = torch.randn(b, hkv, n, d, generator=gen) * token
    for x in (k, v):
        x.view(-1)[torch.randint(0, x.numel(), (max(1, x.numel() // 200),), generator=gen)] = 0.0
        x.view(-1)[torch.randint(0, x.numel(), (max(1, x.numel() // 200),), generator=gen)] = 3e-6
    q = torch.randn(b, hq, q_len, d, generator=gen) * 3 / k.pow(2).mean().sqrt()  # logits of a few units, as in models
    q[..., torch.randperm(d, generator=gen)[: max(1, d // 32)]] = 0.0
    return k.to(dtype), v.to(dtype), q.to(dtype)


def cpu_store(k, v, block_exponents, chunks, value_block=0):
    from kvquant.formats.planes import PlaneStore

    store = PlaneStore(block_exponents=block_exponents, value_block=value_block)
    for start, stop in chunks:
        store.append(k[:, :, start:stop], v[:, :, start:stop])
    return store


def chunks_for(n):
    """A prefill of most tokens, then single-token decode steps."""
    head = max(1, n - 5)
    return [(0, head)] + [(i, i + 1) for i in range(head, n)]


def to_device(store, device):
    moved = {f.name: getattr(store, f.name) for f in dataclasses.fields(store)}
    moved = {name: x.to(device) if isinstance(x, torch.Tensor) else x for name, x in moved.items()}
    return dataclasses.replace(store, **moved)


def assert_within(got, want, bound, what):
    err = (got.double().cpu() - want.double().cpu()).abs()
    bound = bound.double().cpu()
    worst = (err - bound).max()
    assert bool((err <= bound).all()), f"{what}: error exceeds the fp32 bound by {float(worst):.3g}"


def assert_few_tokens_differ(got, want, what):
    """Widths decided on scores that differ by fp32 rounding may flip near a binade: at most max(2, 1e-3·n) tokens."""
    differ, n = int((got.cpu() != want.cpu()).sum()), want.numel()
    assert differ <= max(2, 1e-3 * n), f"{what}: {differ} of {n} token widths differ"


def logit_bound(query, keys, scaling):
    """Worst-case fp32 error of two differently ordered length-d dot products."""
    d = query.shape[-1]
    from kernels_cupy.reference import reference_logits

    return 2 * (d + 2) * U32 * reference_logits(query.float().abs(), keys.float().abs(), scaling)


def output_bound(scores, values, logit_err, q_len):
    """Worst-case fp32 error of SV with scores that carry ``logit_err`` and a length-L sum."""
    b, hq, _, n = scores.shape
    hkv = values.shape[1]
    sv_abs = (scores.double().reshape(b, hkv, -1, n) @ values.double().abs()).view(b, hq, q_len, -1)
    rel = 2 * logit_err.amax(dim=-1, keepdim=True).double() + (n + 4) * U32
    return rel * sv_abs + 1e-30


# ---------------------------------------------------------------- GPU: each kernel vs the reference


@gpu_test
@pytest.mark.parametrize("value_block", [0, 32, 64])
@pytest.mark.parametrize("block_exponents", [False, True])
@pytest.mark.parametrize("shape", SHAPES[:7])
def test_append_writes_the_plane_store_layout(shape, block_exponents, value_block):
    from kernels_cupy.store import KernelPlaneStore
    from kvquant.formats.planes import PlaneStore

    b, hq, hkv, d, n = shape
    k, v, _ = random_kv(b, hq, hkv, d, n, seed=1)
    head = min(n, 100)
    chunks = [(0, head)] + [(i, min(n, i + 37)) for i in range(head, n, 37)]
    want = cpu_store(k, v, block_exponents, chunks, value_block)
    got = KernelPlaneStore(block_exponents=block_exponents, value_block=value_block)  # append: the pack kernel
    for start, stop in chunks:
        got.append(k[:, :, start:stop].cuda(), v[:, :, start:stop].cuda())
    for f in dataclasses.fields(PlaneStore):
        a, w = getattr(got, f.name), getattr(want, f.name)
        if isinstance(w, torch.Tensor):
            assert torch.equal(a.cpu(), w), f.name
        else:
            assert a == w, f.name


@gpu_test
@pytest.mark.parametrize("qk_kernel", ["tile", "warp"])
@pytest.mark.parametrize("blockwise", [False, True])
@pytest.mark.parametrize("thresholds", THRESHOLDS[:3])
@pytest.mark.parametrize("shape", SHAPES)
def test_qk_reads_and_widths_match_reference(shape, thresholds, blockwise, qk_kernel):
    from kernels_cupy.ops import qk
    from kernels_cupy.reference import reference_attention

    b, hq, hkv, d, n = shape
    k, v, q = random_kv(b, hq, hkv, d, n, seed=2)
    store = cpu_store(k, v, blockwise, chunks_for(n))
    scaling = d**-0.5
    ref = reference_attention(store, q, None, scaling, thresholds, (4, 8), 32, blockwise)
    logits, wk, keys = qk(
        to_device(store, "cuda"), q.cuda(), scaling, thresholds, blockwise, return_keys=True, qk_kernel=qk_kernel
    )
    assert torch.equal(wk.cpu(), ref["wk"])
    assert torch.equal(keys.cpu().view(torch.int16), ref["keys"].view(torch.int16))
    assert_within(logits, ref["logits"], logit_bound(q, ref["keys"], scaling), "logits")


@gpu_test
@pytest.mark.parametrize("sv_read", ["bytes", "permute"])
@pytest.mark.parametrize("thresholds", THRESHOLDS)
@pytest.mark.parametrize(("topk", "rule"), [(32, "token"), (7, "token"), (32, "block32"), (7, "block64")])
@pytest.mark.parametrize("shape", SHAPES)
def test_value_widths_and_sv_match_reference(shape, topk, rule, thresholds, sv_read):
    """Given the reference's (fp32) scores, V widths (the paper's rule, or the block rule:
    ``block_value_widths``) and reads are identical and SV is within fp32 rounding."""
    from kernels_cupy.ops import sv, value_exponents
    from kernels_cupy.reference import reference_attention

    b, hq, hkv, d, n = shape
    value_rule, value_block = ("token", 0) if rule == "token" else ("block", int(rule[5:]))
    k, v, q = random_kv(b, hq, hkv, d, n, seed=4)
    store = cpu_store(k, v, False, chunks_for(n), value_block)
    ref = reference_attention(store, q, None, d**-0.5, (4, 8), thresholds, topk, value_rule=value_rule)
    gpu_store = to_device(store, "cuda")
    scores = ref["scores"].cuda()
    e_o = value_exponents(gpu_store, scores, topk)
    out, wv, values = sv(gpu_store, scores, e_o, thresholds, return_values=True, value_rule=value_rule, sv_read=sv_read)
    assert torch.equal(wv.cpu(), ref["wv"])
    assert torch.equal(values.cpu().view(torch.int16), ref["values"].view(torch.int16))
    bound = output_bound(ref["scores"], ref["values"], torch.zeros(1), 1)
    assert_within(out, ref["out"], bound, "SV")


KERNEL_CHOICES = [("tile", "bytes"), ("warp", "permute")]  # the validated kernels, and the new ones


@gpu_test
@pytest.mark.parametrize(("qk_kernel", "sv_read"), KERNEL_CHOICES)
@pytest.mark.parametrize("value_rule", ["token", "block"])
@pytest.mark.parametrize("blockwise", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_aligned_attention_end_to_end(shape, blockwise, value_rule, qk_kernel, sv_read):
    """The whole step (three launches): K widths identical; the kernel's own fp32 scores within fp32
    rounding of the reference's; V widths identical to the rule (the paper's, or the block rule per 32
    tokens) applied to those scores; output within fp32 rounding."""
    from kernels_cupy.ops import aligned_attention
    from kernels_cupy.reference import reference_attention, reference_block_widths, reference_value_widths

    b, hq, hkv, d, n = shape
    k, v, q = random_kv(b, hq, hkv, d, n, seed=5)
    store = cpu_store(k, v, blockwise, chunks_for(n), 32 if value_rule == "block" else 0)
    gpu_store, scaling = to_device(store, "cuda"), d**-0.5
    ref = reference_attention(store, q, None, scaling, (4, 8), (4, 8), 32, blockwise, value_rule)
    out, wk, wv, own_scores = aligned_attention(
        gpu_store, q.cuda(), None, scaling, (4, 8), (4, 8), 32, blockwise, value_rule=value_rule, return_scores=True,
        qk_kernel=qk_kernel, sv_read=sv_read,
    )  # fmt: skip
    assert torch.equal(wk.cpu(), ref["wk"])
    own_scores = own_scores.cpu()
    err = logit_bound(q, ref["keys"], scaling)
    score_bound = (2 * err.amax(dim=-1, keepdim=True) + (n + 8) * U32) * ref["scores"] + 1e-30
    assert_within(own_scores, ref["scores"], score_bound, "softmax")
    if value_rule == "block":
        own_wv = reference_block_widths(own_scores, store, (4, 8), 32)
    else:
        own_wv = reference_value_widths(own_scores, store.value_high_bytes(), (4, 8), 32)[:, :, : store.n_full]
    assert torch.equal(wv.cpu(), own_wv)
    step = 32 if value_rule == "block" else 1  # one width per block: count blocks
    assert_few_tokens_differ(wv[..., ::step], ref["wv"][..., ::step], "V widths")
    own_values = store.read_values(own_wv, torch.float16)
    own_out = (own_scores.double().reshape(b, hkv, -1, n) @ own_values.double()).view(b, hq, 1, d)
    assert_within(out, own_out, output_bound(own_scores, own_values, torch.zeros(1), 1), "SV of the kernel's scores")
    assert_within(out, ref["out"], output_bound(ref["scores"], ref["values"], err, 1), "attention")


@gpu_test
@pytest.mark.parametrize(
    ("value_rule", "blockwise", "full"), [("token", False, False), ("block", True, False), ("token", False, True)]
)
@pytest.mark.parametrize("shape", SHAPES)
def test_new_kernels_give_the_validated_kernels_bits(shape, value_rule, blockwise, full):
    """The warp QK kernel sums each logit in the tile kernel's order (channel groups c mod 4, ascending, then
    (g0 + g1) + (g2 + g3)) and ``read8`` gives ``read_bits``' bits: the whole step on the new kernels equals the
    validated kernels' bit for bit — probabilities, widths, output — with a mask, at 1 and 2 query positions.
    QK (logits, widths, keys read) and SV (on the same scores: output, widths, values read) are compared apart
    first, so a failure names the kernel."""
    from kernels_cupy.ops import aligned_attention, qk, sv, value_exponents

    def same(validated, new, what):
        assert (validated is None and new is None) or torch.equal(validated, new), what

    b, hq, hkv, d, n = shape
    for q_len in (1, 2):
        k, v, q = random_kv(b, hq, hkv, d, n, seed=21, q_len=q_len)
        store = to_device(cpu_store(k, v, blockwise, chunks_for(n), 32 if value_rule == "block" else 0), "cuda")
        mask = (torch.rand(b, 1, q_len, n, generator=torch.Generator().manual_seed(n)) > 0.1).cuda()
        query, thresholds = q.cuda(), (4, 8)
        logits = [
            qk(store, query, d**-0.5, thresholds, blockwise, full, True, mask, qk_kernel=kernel)
            for kernel in ("tile", "warp")
        ]
        for validated, new, what in zip(*logits, ("logits", "key widths", "keys"), strict=True):
            same(validated, new, f"QK, warp kernel: {what} (q_len {q_len})")
        scores = torch.softmax(logits[0][0], dim=-1).nan_to_num(0.0)
        e_o = value_exponents(store, scores)
        read = [sv(store, scores, e_o, thresholds, full, True, value_rule, sv_read=r) for r in ("bytes", "permute")]
        for validated, new, what in zip(*read, ("output", "value widths", "values"), strict=True):
            same(validated, new, f"SV, byte-permute reads: {what} (q_len {q_len})")
        kw = {"blockwise": blockwise, "full": full, "value_rule": value_rule, "return_scores": True}
        runs = [
            aligned_attention(store, query, mask, d**-0.5, qk_kernel=kernel, sv_read=r, **kw)
            for kernel, r in KERNEL_CHOICES
        ]
        for validated, new, what in zip(*runs, ("output", "key widths", "value widths", "scores"), strict=True):
            same(validated, new, f"the step: {what} (q_len {q_len})")


@gpu_test
@pytest.mark.parametrize(("qk_kernel", "sv_read"), KERNEL_CHOICES)
@pytest.mark.parametrize("shape", SHAPES)
def test_16_bit_control_reads_every_plane(shape, qk_kernel, sv_read):
    from kernels_cupy.ops import aligned_attention
    from kernels_cupy.reference import reference_attention

    b, hq, hkv, d, n = shape
    k, v, q = random_kv(b, hq, hkv, d, n, seed=6)
    store = cpu_store(k, v, False, chunks_for(n))
    ref = reference_attention(store, q, None, d**-0.5, (math.inf, math.inf), (math.inf, math.inf))
    assert bool((ref["wk"] == 16).all() and (ref["wv"] == 16).all())
    out, wk, wv = aligned_attention(
        to_device(store, "cuda"), q.cuda(), None, d**-0.5, full=True, qk_kernel=qk_kernel, sv_read=sv_read
    )
    assert wk is None and wv is None
    err = logit_bound(q, ref["keys"], d**-0.5)
    assert_within(out, ref["out"], output_bound(ref["scores"], ref["values"], err, 1), "16-bit control")


@gpu_test
@pytest.mark.parametrize("value_rule", ["token", "block"])
def test_backend_attend_applies_the_rule(value_rule):
    """The backend protocol (what ``KVLayer.attend`` calls): ``aligned_attention`` at the rule's tiers (the
    margin added) and value rule, in the query's dtype, and the widths it read."""
    from kernels_cupy.backend import attend
    from kernels_cupy.ops import aligned_attention
    from kvquant.formats.planes import AlignedRule

    b, hq, hkv, d, n = 2, 8, 2, 64, 200
    v_block = 64 if value_rule == "block" else 1
    k, v, q = random_kv(b, hq, hkv, d, n, seed=9)
    store = to_device(cpu_store(k, v, True, chunks_for(n), 64 if value_rule == "block" else 0), "cuda")
    rule = AlignedRule(
        k_thresholds=(4, 8),
        v_thresholds=(1, 2),
        topk=16,
        blockwise=True,
        margin=1.0,
        v_block=v_block,
        value_rule=value_rule,
    )
    out, reads = attend(store, rule, q.cuda(), None, d**-0.5)
    want, want_wk, want_wv = aligned_attention(
        store, q.cuda(), None, d**-0.5, (5, 9), (2, 3), 16, True, value_rule=value_rule
    )
    assert out.dtype == q.dtype and out.shape == (b, hq, 1, d)
    assert torch.equal(out, want.to(q.dtype))
    assert torch.equal(reads.k_widths, want_wk) and torch.equal(reads.v_widths, want_wv)


@gpu_test
@pytest.mark.parametrize("method_name", ["alignedkv", "alignedkv_block"])
def test_backend_cupy_generates_as_the_torch_backend_on_stories260k(method_name):
    """A whole model through the plane kernels (``backend=auto``'s choice on CUDA), the paper's rule and the block
    rule: as the torch path. 1e-5: a width may differ where the kernel's fp32 scores and the reference's fall on
    the two sides of a threshold, a low-probability token then read 4 bits wider or narrower."""
    assert_generates_as_torch(method_name, kl_bound=1e-5)


@gpu_test
@pytest.mark.parametrize(("hq", "qk_kernel", "sv_read"), [(8, "tile", "bytes"), (4, "warp", "permute")])
@pytest.mark.parametrize("kind", ["bool", "additive", "additive_fp16"])
def test_chunk_of_queries_with_a_mask(kind, hq, qk_kernel, sv_read):
    """Two queries per step (prefill_aligned) with a boolean or additive mask (applied inside QK, broadcast
    over heads by strides): rows are the most demanding query's. 4 query heads: 4 rows a KV head, the warp
    kernel's most."""
    from kernels_cupy.ops import aligned_attention
    from kernels_cupy.reference import reference_attention

    b, hkv, d, n = 2, 2, 64, 333
    k, v, q = random_kv(b, hq, hkv, d, n, seed=7, q_len=2)
    mask = torch.ones(b, 1, 2, n, dtype=torch.bool)
    mask[:, :, 0, -1] = False
    mask[1, :, :, :10] = False
    if kind != "bool":
        mask = torch.where(mask, 0.0, float("-inf") if kind == "additive" else -3e4)
        mask[0, :, 1, 5] = -0.75  # a finite bias the kernel adds, not only -inf
        mask = mask.half() if kind == "additive_fp16" else mask
    store = cpu_store(k, v, False, chunks_for(n))
    ref = reference_attention(store, q, mask, d**-0.5)
    out, wk, wv = aligned_attention(
        to_device(store, "cuda"), q.cuda(), mask.cuda(), d**-0.5, qk_kernel=qk_kernel, sv_read=sv_read
    )
    assert torch.equal(wk.cpu(), ref["wk"])
    assert_few_tokens_differ(wv, ref["wv"], "V widths")
    err = logit_bound(q, ref["keys"], d**-0.5)
    assert_within(out, ref["out"], output_bound(ref["scores"], ref["values"], err, 2), "masked chunk")


@gpu_test
def test_real_captured_kv(request):
    """stories260K's K/V (head_dim 8, 8 q / 4 KV heads), appended by the kernel, attended both ways."""
    pytest.importorskip("transformers", reason="the stories fixture loads the model with transformers")
    from kernels_cupy.ops import aligned_attention, append
    from kernels_cupy.reference import reference_attention
    from kvquant.analysis.capture import capture_kv
    from kvquant.formats.planes import PlaneStore

    try:
        model, tok = request.getfixturevalue("stories")
    except Exception as exc:  # a GPU box without the model's converter dependencies
        pytest.skip(f"stories260K does not load here: {exc}")
    text = "Once upon a time there was a little girl named Lily. She liked to play in the park with her dog. " * 12
    ids = tok(text, return_tensors="pt").input_ids[0][:301]
    hq = model.config.num_attention_heads
    for layer, (k, v) in enumerate(capture_kv(model, ids)):
        k, v = k.half(), v.half()
        want = cpu_store(k, v, True, chunks_for(k.shape[2]), 32)
        got = PlaneStore(block_exponents=True, value_block=32)
        for start, stop in chunks_for(k.shape[2]):
            append(got, k[:, :, start:stop].cuda(), v[:, :, start:stop].cuda())
        for name in ("k_a", "k_b", "k_c", "v_a", "v_b", "v_c", "k_exp", "v_exp", "k_absmax", "tail_k", "tail_v"):
            assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), (layer, name)
        d = k.shape[-1]
        q = (k[:, :, -1:].repeat_interleave(hq // k.shape[1], dim=1) * 1.5).contiguous()
        for blockwise, rule in [(False, "token"), (True, "token"), (False, "block"), (True, "block")]:
            ref = reference_attention(want, q, None, d**-0.5, (4, 8), (4, 8), 32, blockwise, rule)
            out, wk, wv = aligned_attention(
                got, q.cuda(), None, d**-0.5, (4, 8), (4, 8), 32, blockwise, value_rule=rule
            )
            assert torch.equal(wk.cpu(), ref["wk"]), layer
            step = 32 if rule == "block" else 1
            assert_few_tokens_differ(wv[..., ::step], ref["wv"][..., ::step], f"layer {layer} {rule} V widths")
            err = logit_bound(q, ref["keys"], d**-0.5)
            assert_within(out, ref["out"], output_bound(ref["scores"], ref["values"], err, 1), f"layer {layer}")


@gpu_test
@pytest.mark.parametrize("n", [40, 150])
def test_append_copies_odd_offset_inputs_and_owns_its_tails(n):
    """K/V handed over as contiguous views at an odd offset (2 bytes in): the pack kernel's 32-bit loads
    and SV's 8/16-byte tail loads see aligned copies, and the tails never alias the caller's tensors."""
    from kernels_cupy.ops import ALIGN, aligned_attention, append
    from kernels_cupy.reference import reference_attention
    from kvquant.formats.planes import PlaneStore

    b, hq, hkv, d = 1, 4, 2, 64
    k, v, q = random_kv(b, hq, hkv, d, n, seed=11)
    flat_k, flat_v = torch.zeros(1 + k.numel(), dtype=torch.float16), torch.zeros(1 + v.numel(), dtype=torch.float16)
    flat_k[1:], flat_v[1:] = k.flatten(), v.flatten()
    flat_k, flat_v = flat_k.cuda(), flat_v.cuda()
    k_view, v_view = flat_k[1:].view(k.shape), flat_v[1:].view(v.shape)
    assert k_view.data_ptr() % ALIGN and k_view.is_contiguous()
    got = PlaneStore()
    append(got, k_view, v_view)
    flat_k.fill_(7.0)  # the caller reuses its buffers
    flat_v.fill_(7.0)
    want = cpu_store(k, v, False, [(0, n)])
    for name in ("tail_k", "tail_v", "k_a", "v_a", "k_absmax"):
        a, w = getattr(got, name), getattr(want, name)
        assert (a is None) == (w is None), name
        if w is not None:
            assert a.data_ptr() % ALIGN == 0 and torch.equal(a.cpu(), w), name
    out, wk, wv = aligned_attention(got, q.cuda(), None, d**-0.5)
    ref = reference_attention(want, q, None, d**-0.5)
    assert torch.equal(wk.cpu(), ref["wk"])
    err = logit_bound(q, ref["keys"], d**-0.5)
    assert_within(out, ref["out"], output_bound(ref["scores"], ref["values"], err, 1), "attention")


@gpu_test
@pytest.mark.parametrize("blockwise", [False, True])
@pytest.mark.parametrize("budget", [None, 40_000])
def test_prefill_chunk_beyond_shared_memory_is_split_into_row_chunks(budget, blockwise, monkeypatch):
    """A ``prefill_aligned`` chunk of 128 tokens with 4 query heads per KV head at d=128: 512 query rows
    need 274 KiB of QK shared memory, more than sm_90's 227 KiB, so QK runs in row chunks (also with a 40 KB
    budget); widths stay those of all rows and results match the reference."""
    import kernels_cupy.ops as ops
    from kernels_cupy.reference import reference_attention

    if budget is not None:
        monkeypatch.setattr(ops, "shared_memory_budget", lambda index: budget)
    b, hq, hkv, d, n, q_len = 1, 8, 2, 128, 300, 128
    rows = hq // hkv * q_len
    available = ops.shared_memory_budget(0)
    assert len(row_chunks(rows, *qk_shared_bytes(d), available, "QK")) > 1
    k, v, q = random_kv(b, hq, hkv, d, n, seed=12, q_len=q_len)
    store = cpu_store(k, v, blockwise, [(0, n - q_len), (n - q_len, n)])
    positions = n - q_len + torch.arange(q_len)
    mask = (torch.arange(n)[None, :] <= positions[:, None]).view(1, 1, q_len, n)  # causal
    scaling = d**-0.5
    ref = reference_attention(store, q, mask, scaling, (4, 8), (4, 8), 32, blockwise)
    gpu_store = to_device(store, "cuda")
    logits, wk, keys = ops.qk(gpu_store, q.cuda(), scaling, (4, 8), blockwise, return_keys=True)
    assert torch.equal(wk.cpu(), ref["wk"])
    assert torch.equal(keys.cpu().view(torch.int16), ref["keys"].view(torch.int16))
    assert_within(logits, ref["logits"], logit_bound(q, ref["keys"], scaling), "logits")
    scores = ref["scores"].cuda()
    out, wv, _ = ops.sv(gpu_store, scores, ops.value_exponents(gpu_store, scores, 32), (4, 8))
    assert torch.equal(wv.cpu(), ref["wv"])
    bound = output_bound(ref["scores"], ref["values"], torch.zeros(1), q_len)
    assert_within(out, ref["out"], bound, "SV")
    out, wk, wv = ops.aligned_attention(gpu_store, q.cuda(), mask.cuda(), scaling, blockwise=blockwise)
    assert torch.equal(wk.cpu(), ref["wk"])
    assert_few_tokens_differ(wv, ref["wv"], "V widths")
    err = logit_bound(q, ref["keys"], scaling)
    assert_within(out, ref["out"], output_bound(ref["scores"], ref["values"], err, q_len), "attention")


@gpu_test
@pytest.mark.parametrize(("qk_kernel", "sv_read"), KERNEL_CHOICES)
@pytest.mark.parametrize("value_rule", ["token", "block", "control"])
def test_decode_step_replays_in_a_cuda_graph(value_rule, qk_kernel, sv_read, monkeypatch):
    """``attend`` for a fixed-size store captured in ``torch.cuda.graph``: no host sync, no allocation of the
    ticket counters inside, and the replays equal eager steps bit for bit (every sum in a fixed order),
    also after a new query is copied into the captured buffer; with either kernel set as the module defaults."""
    from kernels_cupy import ops
    from kernels_cupy.backend import attend
    from kernels_cupy.ops import aligned_attention
    from kvquant.formats.planes import AlignedRule

    monkeypatch.setattr(ops, "QK_KERNEL", qk_kernel)
    monkeypatch.setattr(ops, "SV_READ", sv_read)

    b, hq, hkv, d, n = 2, 8, 2, 128, 1000
    k, v, q = random_kv(b, hq, hkv, d, n, seed=13)
    _, _, q2 = random_kv(b, hq, hkv, d, n, seed=14)
    store = to_device(cpu_store(k, v, False, chunks_for(n), 32), "cuda")
    scaling = d**-0.5
    if value_rule == "control":

        def step(query):
            out, _, _ = aligned_attention(store, query, None, scaling, full=True)
            return out, None

    else:
        rule = AlignedRule(topk=32, v_block=32 if value_rule == "block" else 1, value_rule=value_rule)

        def step(query):
            out, reads = attend(store, rule, query, None, scaling)
            return out, reads.v_widths

    static_q = q.cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up: compile, launch once, allocate the counters
        for _ in range(2):
            step(static_q)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got, got_wv = step(static_q)
    for query in (q.cuda(), q2.cuda()):
        static_q.copy_(query)
        graph.replay()
        want, want_wv = step(query.clone())
        torch.cuda.synchronize()
        assert torch.equal(got, want)
        if want_wv is not None:
            assert torch.equal(got_wv, want_wv)
    first, _ = step(q.cuda())
    assert not torch.equal(first, got)  # the replay followed the new query


def test_a_step_counts_the_backends_own_launches_where_it_keeps_a_count():
    """``model_step_time`` reads CuPy's launch count around its counted step (bench_step's ``kernels/layer``);
    the torch reference and the C++ kernels keep none (their column stays blank)."""
    from kernels_cupy import loader
    from kvquant.analysis.timing import launch_counter

    assert launch_counter("cupy") is loader.launch_count and isinstance(loader.launch_count(), int)
    assert launch_counter("torch") is None and launch_counter("cpu") is None


def test_an_append_without_a_whole_block_passes_no_flags(monkeypatch):
    """``pack_kv`` flags tiny high bytes only in whole blocks, so a decode append that completes none passes a
    null pointer and allocates (on a GPU: memsets) nothing for them; the one that completes a block does."""
    from kernels_cupy import ops
    from kernels_cupy.store import KernelPlaneStore

    calls = []
    monkeypatch.setattr(ops, "ptr", lambda t: np.uint64(0 if t is None else t.data_ptr()))  # CPU tensors
    monkeypatch.setattr(ops, "check_device", lambda t: None)
    monkeypatch.setattr(ops, "launch", lambda *args, **kw: calls.append(args[4]))
    store = KernelPlaneStore()
    k = torch.randn(1, 2, 64, 8).half()
    for n in (62, 1, 1):  # 62 + 1 stays a tail; the third append completes the first block
        ops.append(store, k[:, :, :n].contiguous(), k[:, :, :n].contiguous(), checked=True)
    assert [int(args[-1]) == 0 for args in calls] == [True, True, False]
