"""AlignedKV's CUDA kernels (kernels_cupy): PTX compile on CPU; on a GPU, bit-for-bit widths and
reads and fp32-rounding outputs against the torch reference (kvquant.alignment)."""

from __future__ import annotations

import dataclasses
import math
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from kernels_cupy import SOURCES, cupy_status
from kernels_cupy.loader import HEADER, SOURCE_DIR, source_text
from kernels_cupy.ops import qk_shared_bytes, row_chunks, tiers

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


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", SOURCES)
def test_source_compiles_to_ptx_without_warnings(source, arch, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    # -ftz=true as CuPy compiles; -Werror all-warnings turns every warning into a failure.
    cmd = [nvcc, "-ptx", f"-arch={arch}", "-ftz=true", "-Werror", "all-warnings", f"-I{SOURCE_DIR}"]
    done = subprocess.run([*cmd, str(SOURCE_DIR / source), "-o", str(tmp_path / "out.ptx")], capture_output=True)
    log = (done.stdout + done.stderr).decode(errors="replace")
    assert done.returncode == 0 and not log.strip(), log
    assert ".entry" in (tmp_path / "out.ptx").read_text()


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


def cpu_store(k, v, block_exponents, chunks):
    from kvquant.formats.planes import PlaneStore

    store = PlaneStore(block_exponents=block_exponents)
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
@pytest.mark.parametrize("block_exponents", [False, True])
@pytest.mark.parametrize("shape", SHAPES[:7])
def test_append_writes_the_plane_store_layout(shape, block_exponents):
    from kernels_cupy.store import KernelPlaneStore
    from kvquant.formats.planes import PlaneStore

    b, hq, hkv, d, n = shape
    k, v, _ = random_kv(b, hq, hkv, d, n, seed=1)
    head = min(n, 100)
    chunks = [(0, head)] + [(i, min(n, i + 37)) for i in range(head, n, 37)]
    want = cpu_store(k, v, block_exponents, chunks)
    got = KernelPlaneStore(block_exponents=block_exponents)  # its append is the pack kernel
    for start, stop in chunks:
        got.append(k[:, :, start:stop].cuda(), v[:, :, start:stop].cuda())
    for f in dataclasses.fields(PlaneStore):
        a, w = getattr(got, f.name), getattr(want, f.name)
        if isinstance(w, torch.Tensor):
            assert torch.equal(a.cpu(), w), f.name
        else:
            assert a == w, f.name


@gpu_test
@pytest.mark.parametrize("blockwise", [False, True])
@pytest.mark.parametrize("thresholds", THRESHOLDS[:3])
@pytest.mark.parametrize("shape", SHAPES)
def test_qk_reads_and_widths_match_reference(shape, thresholds, blockwise):
    from kernels_cupy.ops import qk
    from kernels_cupy.reference import reference_attention

    b, hq, hkv, d, n = shape
    k, v, q = random_kv(b, hq, hkv, d, n, seed=2)
    store = cpu_store(k, v, blockwise, chunks_for(n))
    scaling = d**-0.5
    ref = reference_attention(store, q, None, scaling, thresholds, (4, 8), 32, blockwise)
    logits, wk, keys = qk(to_device(store, "cuda"), q.cuda(), scaling, thresholds, blockwise, return_keys=True)
    assert torch.equal(wk.cpu(), ref["wk"])
    assert torch.equal(keys.cpu().view(torch.int16), ref["keys"].view(torch.int16))
    assert_within(logits, ref["logits"], logit_bound(q, ref["keys"], scaling), "logits")


@gpu_test
@pytest.mark.parametrize("thresholds", THRESHOLDS)
@pytest.mark.parametrize("topk", [32, 7])
@pytest.mark.parametrize("shape", SHAPES)
def test_value_widths_and_sv_match_reference(shape, topk, thresholds):
    """Given the reference's scores, V widths and reads are identical and SV is within fp32 rounding."""
    from kernels_cupy.ops import sv, value_exponents
    from kernels_cupy.reference import reference_attention

    b, hq, hkv, d, n = shape
    k, v, q = random_kv(b, hq, hkv, d, n, seed=4)
    store = cpu_store(k, v, False, chunks_for(n))
    ref = reference_attention(store, q, None, d**-0.5, (4, 8), thresholds, topk)
    gpu_store = to_device(store, "cuda")
    scores = ref["scores"].cuda()
    out, wv, values = sv(gpu_store, scores, value_exponents(gpu_store, scores, topk), thresholds, return_values=True)
    assert torch.equal(wv.cpu(), ref["wv"])
    assert torch.equal(values.cpu().view(torch.int16), ref["values"].view(torch.int16))
    bound = output_bound(ref["scores"], ref["values"], torch.zeros(1), 1)
    assert_within(out, ref["out"], bound, "SV")


@gpu_test
@pytest.mark.parametrize("blockwise", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_aligned_attention_end_to_end(shape, blockwise):
    """The whole step: K widths identical; V widths identical to the rule applied to the kernel's own
    scores (scores differ from the reference's by fp32 rounding); output within fp32 rounding."""
    from kernels_cupy.ops import aligned_attention, qk, softmax_scores
    from kernels_cupy.reference import reference_attention, reference_value_widths

    b, hq, hkv, d, n = shape
    k, v, q = random_kv(b, hq, hkv, d, n, seed=5)
    store = cpu_store(k, v, blockwise, chunks_for(n))
    gpu_store, scaling = to_device(store, "cuda"), d**-0.5
    ref = reference_attention(store, q, None, scaling, (4, 8), (4, 8), 32, blockwise)
    out, wk, wv = aligned_attention(gpu_store, q.cuda(), None, scaling, (4, 8), (4, 8), 32, blockwise)
    assert torch.equal(wk.cpu(), ref["wk"])
    own_scores = softmax_scores(qk(gpu_store, q.cuda(), scaling, (4, 8), blockwise)[0]).cpu()
    own_wv = reference_value_widths(own_scores, store.value_high_bytes(), (4, 8), 32)[:, :, : store.n_full]
    assert torch.equal(wv.cpu(), own_wv)
    assert_few_tokens_differ(wv, ref["wv"], "V widths")
    own_values = store.read_values(own_wv, torch.float16)
    own_out = (own_scores.double().reshape(b, hkv, -1, n) @ own_values.double()).view(b, hq, 1, d)
    assert_within(out, own_out, output_bound(own_scores, own_values, torch.zeros(1), 1), "SV of the kernel's scores")
    err = logit_bound(q, ref["keys"], scaling)
    assert_within(out, ref["out"], output_bound(ref["scores"], ref["values"], err, 1), "attention")


@gpu_test
@pytest.mark.parametrize("shape", SHAPES)
def test_16_bit_control_reads_every_plane(shape):
    from kernels_cupy.ops import aligned_attention
    from kernels_cupy.reference import reference_attention

    b, hq, hkv, d, n = shape
    k, v, q = random_kv(b, hq, hkv, d, n, seed=6)
    store = cpu_store(k, v, False, chunks_for(n))
    ref = reference_attention(store, q, None, d**-0.5, (math.inf, math.inf), (math.inf, math.inf))
    assert bool((ref["wk"] == 16).all() and (ref["wv"] == 16).all())
    out, wk, wv = aligned_attention(to_device(store, "cuda"), q.cuda(), None, d**-0.5, full=True)
    assert wk is None and wv is None
    err = logit_bound(q, ref["keys"], d**-0.5)
    assert_within(out, ref["out"], output_bound(ref["scores"], ref["values"], err, 1), "16-bit control")


@gpu_test
def test_backend_attend_applies_the_rule():
    """The backend protocol (what ``KVLayer.attend`` calls): ``aligned_attention`` at the rule's tiers (the
    margin added), in the query's dtype, and the widths it read."""
    from kernels_cupy.backend import attend
    from kernels_cupy.ops import aligned_attention
    from kvquant.formats.planes import AlignedRule

    b, hq, hkv, d, n = 2, 8, 2, 64, 200
    k, v, q = random_kv(b, hq, hkv, d, n, seed=9)
    store = to_device(cpu_store(k, v, True, chunks_for(n)), "cuda")
    rule = AlignedRule(k_thresholds=(4, 8), v_thresholds=(1, 2), topk=16, blockwise=True, margin=1.0)
    out, reads = attend(store, rule, q.cuda(), None, d**-0.5)
    want, want_wk, want_wv = aligned_attention(store, q.cuda(), None, d**-0.5, (5, 9), (2, 3), 16, True)
    assert out.dtype == q.dtype and out.shape == (b, hq, 1, d)
    assert torch.equal(out, want.to(q.dtype))
    assert torch.equal(reads.k_widths, want_wk) and torch.equal(reads.v_widths, want_wv)


@gpu_test
def test_chunk_of_queries_with_a_mask():
    """Two queries per step (prefill_aligned) with a boolean mask: rows are the most demanding query's."""
    from kernels_cupy.ops import aligned_attention
    from kernels_cupy.reference import reference_attention

    b, hq, hkv, d, n = 2, 8, 2, 64, 333
    k, v, q = random_kv(b, hq, hkv, d, n, seed=7, q_len=2)
    mask = torch.ones(b, 1, 2, n, dtype=torch.bool)
    mask[:, :, 0, -1] = False
    mask[1, :, :, :10] = False
    store = cpu_store(k, v, False, chunks_for(n))
    ref = reference_attention(store, q, mask, d**-0.5)
    out, wk, wv = aligned_attention(to_device(store, "cuda"), q.cuda(), mask.cuda(), d**-0.5)
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
        want = cpu_store(k, v, True, chunks_for(k.shape[2]))
        got = PlaneStore(block_exponents=True)
        for start, stop in chunks_for(k.shape[2]):
            append(got, k[:, :, start:stop].cuda(), v[:, :, start:stop].cuda())
        for name in ("k_a", "k_b", "k_c", "v_a", "v_b", "v_c", "k_exp", "k_absmax", "tail_k", "tail_v"):
            assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), (layer, name)
        d = k.shape[-1]
        q = (k[:, :, -1:].repeat_interleave(hq // k.shape[1], dim=1) * 1.5).contiguous()
        for blockwise in (False, True):
            ref = reference_attention(want, q, None, d**-0.5, (4, 8), (4, 8), 32, blockwise)
            out, wk, wv = aligned_attention(got, q.cuda(), None, d**-0.5, (4, 8), (4, 8), 32, blockwise)
            assert torch.equal(wk.cpu(), ref["wk"]), layer
            assert_few_tokens_differ(wv, ref["wv"], f"layer {layer} V widths")
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
    need 274 KiB of QK shared memory, more than sm_90's 227 KiB, so QK runs in row chunks (and, with a
    40 KB budget, the value rule too); widths stay those of all rows and results match the reference."""
    import kernels_cupy.ops as ops
    from kernels_cupy.reference import reference_attention

    if budget is not None:
        monkeypatch.setattr(ops, "shared_memory_budget", lambda index: budget)
    b, hq, hkv, d, n, q_len = 1, 8, 2, 128, 300, 128
    rows = hq // hkv * q_len
    available = ops.shared_memory_budget(0)
    assert len(row_chunks(rows, *qk_shared_bytes(d), available, "QK")) > 1
    if budget is not None:
        assert len(row_chunks(rows, 32 * 8, 0, available, "topk")) > 1
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
