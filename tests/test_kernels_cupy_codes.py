"""The CuPy kernels over integer codes (KIVI) and GEAR (kernels_cupy/codes.cu): on CPU, the compile for
sm_80/sm_90 (no warnings, no spills), every launch and argument helper, and the kernel emulated line for
line in torch (kernels_cupy.codes_emulate) against the torch reference; on a GPU, the kernels themselves
against the reference on the same states."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels_cupy import codes as codes_module
from kernels_cupy import cupy_status
from kernels_cupy.codes import (
    CHANNELS_PER_LANE,
    MIN_CHUNK,
    RANK_MAX,
    ROW_TILES,
    TOKENS_IN_FLIGHT,
    check_state,
    gear_args,
    lane_groups,
    lanes_per_token,
    limits,
    mask_view,
    outlier_rows,
    plan,
    query_times_b,
    row_tile,
    run_rows,
    segment_bases,
    shared_bytes,
)
from kernels_cupy.codes_emulate import emulate, lane_codes
from kernels_cupy.nvcc import Compiled, compile_source
from kvquant.cache import KVGeometry
from kvquant.formats import codes as codes_format
from kvquant.formats.codes import CodesState, QuantStore
from kvquant.formats.gear import GearCoding, GearState, GearStore
from kvquant.formats.window import CHANNEL_AXIS, TOKEN_AXIS, Stream
from kvquant.quant.integer import pack, unpack

GPU_OK, GPU_WHY = cupy_status()


def gpu_test(fn):
    """Marked ``gpu``; skipped with the reason where cupy or a CUDA device is missing."""
    return pytest.mark.gpu(pytest.mark.skipif(not GPU_OK, reason=f"needs cupy and a CUDA GPU: {GPU_WHY}")(fn))


def assert_generates_as_torch(
    method_name: str, kl_bound: float, steps: int = 40, backend: str = "cupy", device: str = "cuda"
) -> None:
    """A whole model through ``backend`` against ``backend=torch``: stories260K in fp32 (fp16, ``load_model``'s
    default on CUDA, rounds each attention output to fp16: past fp32 bounds), a 150-token story prompt (two full
    64-token blocks and a tail), then ``steps`` greedy tokens: the same tokens, mean KL below ``kl_bound``."""
    from kvquant import get_method, load_model
    from kvquant.data import tinystories_pieces
    from kvquant.eval.fidelity import greedy_decode, kl_divergence

    model, tok = load_model("stories260k", device=device, dtype="float32")
    ids = tok(" ".join(tinystories_pieces()[5:8]), return_tensors="pt").input_ids[0, :150]
    assert ids.numel() == 150
    runs = {}
    for name in ("torch", backend):
        method = get_method(method_name, backend=name)
        with method.attach(model), torch.no_grad():
            cache = method.new_cache(model)
            runs[name] = greedy_decode(model, ids, cache, steps)
        assert cache.backend == name
    assert torch.equal(runs[backend].tokens, runs["torch"].tokens)
    assert kl_divergence(runs["torch"].logprobs, runs[backend].logprobs).mean() < kl_bound


def kivi_state(bits, group, residual, b, h, d, chunks, seed=0):
    """A KIVI layer's state as ``KiviLayer.new_state`` builds it, fed ``chunks`` tokens at a time."""
    gen = torch.Generator().manual_seed(seed)
    keys = Stream(QuantStore(bits, TOKEN_AXIS, group), residual, block=residual)
    values = Stream(QuantStore(bits, CHANNEL_AXIS, group), residual, block=None)
    state = CodesState(keys, values, bits, group)
    for n in chunks:
        k, v = torch.randn(b, h, n, d, generator=gen), torch.randn(b, h, n, d, generator=gen)
        state.append(k.half().float(), v.half().float(), decode=n == 1)
    return state


def gear_state(bits, group, residual, b, h, d, chunks, seed=0, ratio=0.02, rank=4, rank_decode=2):
    """A GEAR layer's state as ``GearLayer.new_state`` builds it (outliers, a prefill run, a decode run)."""
    gen = torch.Generator().manual_seed(seed)
    coding = GearCoding(bits, ratio, rank, rank_decode, 3, seed)
    keys = Stream(GearStore(coding, TOKEN_AXIS, group), residual, block=residual)
    values = Stream(GearStore(coding, CHANNEL_AXIS, group), residual, block=residual)
    state = GearState(keys, values, bits, group)
    for n in chunks:
        k, v = torch.randn(b, h, n, d, generator=gen), torch.randn(b, h, n, d, generator=gen)
        k[..., 0] *= 8  # an outlier channel, as real keys have
        state.append(k.half().float(), v.half().float(), decode=n == 1)
    return state


def state_for(fmt, *args, **kwargs):
    """``fmt``: kivi, gear, or gear_l (GEAR without outliers, the gear format too)."""
    if fmt == "gear_l":
        return gear_state(*args, ratio=0.0, **kwargs)
    return (kivi_state if fmt == "kivi" else gear_state)(*args, **kwargs)


def format_of(case) -> str:
    return "gear" if case[0] == "gear_l" else case[0]


def left_padding(b, n, pad):
    """A bool mask ``[b, 1, 1, n]``: row i cannot see its first ``pad[i]`` keys (left padding)."""
    mask = torch.ones(b, 1, 1, n, dtype=torch.bool)
    for i, p in enumerate(pad):
        mask[i, ..., :p] = False
    return mask


# ---------------------------------------------------------------- CPU: compile


def nvcc_compile(source: str, arch: str) -> Compiled:
    """``kernels_cupy/<source>`` through nvcc for ``arch`` as ``kernels_cupy.nvcc`` compiles it (every warning
    an error; the log kept under a key of the source, header, flags and nvcc, so ``make setup``'s
    ``python -m kernels_cupy nvcc`` has usually compiled it already); skipped without nvcc."""
    try:
        compiled = compile_source(source, arch)
    except FileNotFoundError as missing:
        pytest.skip(str(missing))
    assert compiled.returncode == 0, compiled.log
    return compiled


def test_codes_cu_compiles_to_sm80_ptx_without_warnings():
    compiled = nvcc_compile("codes.cu", "sm_80")
    assert not compiled.log.strip(), compiled.log
    assert ".entry codes_kivi_b2_r1" in compiled.ptx


def test_codes_cu_compiles_for_sm90_without_warnings_or_spills():
    """``ptxas -v`` on every kernel: no warning, no stack frame, no spill (the numbers in the README)."""
    compiled = nvcc_compile("codes.cu", "sm_90")
    assert not compiled.warnings(), compiled.log
    names = {f"codes_{fmt}_b{bits}_r{rt}" for fmt, tiles in ROW_TILES.items() for rt in tiles for bits in (2, 4, 8)}
    quantize = {f"quantize_values_b{bits}" for bits in (2, 4, 8)}
    assert set(compiled.entries()) == names | quantize | {"codes_merge"}
    frames = compiled.frames()
    assert len(frames) == len(compiled.entries()) and all(f == (0, 0, 0) for f in frames), compiled.log


# ---------------------------------------------------------------- CPU: launch and argument helpers


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("d", [8, 16, 64, 96, 128, 256])
def test_lanes_unpack_codes_as_kvquant_packs_them(bits, d):
    gen = torch.Generator().manual_seed(bits * d)
    codes = torch.randint(0, 1 << bits, (3, 5, d), generator=gen, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert torch.equal(lane_codes(packed, bits, d), unpack(packed, bits, d).float())
    assert torch.equal(lane_codes(packed, bits, d), codes.float())


def test_lane_geometry():
    assert [lanes_per_token(d) for d in (8, 16, 24, 64, 80, 96, 128, 256)] == [1, 2, 4, 8, 16, 16, 16, 32]
    for d in range(8, 257, 8):
        lpt = lanes_per_token(d)
        assert lpt * CHANNELS_PER_LANE >= d > lpt * CHANNELS_PER_LANE // 2 and 32 % lpt == 0
        assert lane_groups(d) * lpt == 128
        for tiles in ROW_TILES.values():
            for rt in tiles:
                assert shared_bytes(d, rt) <= 48 * 1024  # no opt-in needed


def test_row_tiles():
    assert [row_tile("kivi", r) for r in (1, 2, 3, 4, 5, 8, 9, 64)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert [row_tile("gear", r) for r in (1, 3, 4, 7, 16)] == [1, 4, 4, 4, 4]
    assert set(TOKENS_IN_FLIGHT) == {(fmt, rt) for fmt, tiles in ROW_TILES.items() for rt in tiles}


@pytest.mark.parametrize("length", [1, 17, 255, 256, 257, 1000, 4129, 32768, 131072])
@pytest.mark.parametrize("ctas", [1, 8, 32, 256, 4096])
@pytest.mark.parametrize("d", [8, 128])
def test_plan_covers_the_sequence_in_whole_steps(length, ctas, d):
    for u in (2, 4):
        n_split, chunk = plan(length, ctas, 132, d, u)
        assert chunk % (lane_groups(d) * u) == 0
        assert (n_split - 1) * chunk < length <= n_split * chunk
        assert n_split <= max(1, -(-length // MIN_CHUNK))
        assert n_split == 1 or ctas * n_split <= 4 * 132 + ctas


@pytest.mark.parametrize("kind", ["bool", "float", "half"])
def test_mask_view_reads_what_the_reference_applies(kind):
    gen = torch.Generator().manual_seed(1)
    b, hq, q_len, n = 2, 4, 3, 11
    for shape in [(b, 1, 1, n + 5), (b, hq, q_len, n), (1, 1, q_len, n), (q_len, n)]:
        if kind == "bool":
            mask = torch.rand(shape, generator=gen) > 0.3
        else:
            mask = torch.randn(shape, generator=gen).to(torch.float32 if kind == "float" else torch.float16)
        view, code, strides = mask_view(mask, b, hq, q_len, n)
        assert code == (1 if kind == "bool" else 2)
        want = mask[..., :n].expand(b, hq, q_len, n)
        got = torch.as_strided(view, (b, hq, q_len, n), strides, view.storage_offset())
        assert torch.equal(got.bool() if kind == "bool" else got, want if kind != "half" else want.float())
        if kind == "bool" and shape[1] == 1:
            assert strides[1] == 0 and view.untyped_storage().nbytes() == mask.numel()  # no copy


def test_outlier_rows_list_each_tokens_outliers():
    state = gear_state(4, 8, 16, 2, 3, 32, [70, *[1] * 40])
    store = state.k.store
    d, n = 32, store.length
    row_ptr, pos, val = outlier_rows(store.index, store.value, n, d)
    assert row_ptr.dtype == pos.dtype == torch.int32 and row_ptr.shape == (2, 3, n + 1)
    for b in range(2):
        for h in range(3):
            want = {int(p): float(v) for p, v in zip(store.index[b, h], store.value[b, h], strict=True)}
            got = {}
            for t in range(n):
                for o in range(int(row_ptr[b, h, t]), int(row_ptr[b, h, t + 1])):
                    assert t * d <= int(pos[b, h, o]) < (t + 1) * d
                    got[int(pos[b, h, o])] = float(val[b, h, o])
            assert got == want and int(row_ptr[b, h, n]) == store.index.shape[-1]


def test_runs_table_and_q_b():
    state = gear_state(2, 8, 16, 2, 2, 32, [70, *[1] * 40])
    runs = state.k.store.runs
    assert len(runs) == 2 and runs[0].a.shape[-1] == 4 and runs[1].a.shape[-1] == 2
    assert segment_bases(runs) == [0, runs[0].a.shape[2]]
    for row, run, base in zip(run_rows(runs), runs, segment_bases(runs), strict=True):
        assert row[:5] == [run.start, run.seg_len, run.a.shape[2], run.a.shape[-1], base]
        assert row[5:11] == [run.a.data_ptr(), *run.a.stride()] and row[11:17] == [run.b.data_ptr(), *run.b.stride()]
    q = torch.randn(2, 2, 3, 32)
    qb = query_times_b(q, runs)
    assert qb.shape == (2, 2, sum(r.a.shape[2] for r in runs), 3, RANK_MAX)
    for run, base in zip(runs, segment_bases(runs), strict=True):
        for s in range(run.a.shape[2]):
            r = run.a.shape[-1]
            torch.testing.assert_close(qb[:, :, base + s, :, :r], q @ run.b[:, :, s].float())
            assert not qb[:, :, base + s, :, r:].any()


def test_ranks_beyond_the_kernel_are_refused():
    state = gear_state(2, 8, 16, 1, 1, 32, [40], rank=RANK_MAX + 1)
    with pytest.raises(ValueError, match="ranks up to"):
        run_rows(state.k.store.runs)


def test_gear_arguments_are_rebuilt_when_the_store_changes():
    state = gear_state(2, 8, 16, 1, 2, 32, [40])
    store = state.k.store
    first = gear_args(store, 32, torch.device("cpu"))
    assert gear_args(store, 32, torch.device("cpu")) is first
    state.append(torch.randn(1, 2, 16, 32), torch.randn(1, 2, 16, 32), decode=False)
    second = gear_args(store, 32, torch.device("cpu"))
    assert second is not first and second.rows[0].shape[-1] == store.length + 1
    state.map_tensors(lambda t: t.index_select(0, torch.tensor([0])))  # a beam reorder: new tensors
    assert gear_args(store, 32, torch.device("cpu")) is not second


def test_limits_and_refusals():
    geo = KVGeometry(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64)
    assert limits("kivi", geo, None) == [] and limits("gear", geo, None) == []
    odd = KVGeometry(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=60, sliding_window=4096, softcap=50.0)
    assert limits("kivi", odd, None) == [
        "attention-logit soft-capping (50.0)",
        "sliding-window layers (4096)",
        "heads of 60 channels (they need a multiple of 8 up to 256)",
    ]
    state = kivi_state(2, 8, 16, 1, 1, 32, [20])
    state.k.fp16.sinks = state.k.window[:, :, :1].clone()
    with pytest.raises(ValueError, match="attention sinks"):
        check_state(state, 32)


def test_the_module_imports_without_cupy():
    code = "import sys; import kernels_cupy.codes, kernels_cupy.codes_emulate; assert 'cupy' not in sys.modules"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert done.returncode == 0, done.stderr.decode()


# ---------------------------------------------------------------- CPU: the kernel emulated against the reference

# (fmt, bits, group, residual, batch, q heads, kv heads, head_dim, chunks, q_len, mask, SMs)
CASES = [
    ("kivi", 2, 8, 16, 1, 4, 4, 32, [40, *[1] * 9], 1, None, 132),  # MHA, keys 48 coded / values 33
    ("kivi", 4, 32, 64, 2, 8, 2, 128, [700, *[1] * 5], 1, "pad", 132),  # GQA, batch 2, left padding, 3 splits
    ("kivi", 8, 8, 32, 2, 6, 2, 8, [300, 1, 1], 1, "additive", 16),  # head_dim 8: 128 lane groups
    ("kivi", 2, 16, 32, 1, 8, 1, 96, [600], 3, None, 132),  # MQA, 24 rows in 3 tiles, causal chunk
    ("kivi", 4, 64, 64, 3, 2, 1, 256, [20], 1, None, 132),  # nothing coded yet: the windows only
    ("kivi", 2, 8, 16, 2, 4, 2, 16, [13, *[1] * 30], 2, "pad", 8),  # a masked two-token step
    ("gear", 2, 8, 16, 1, 4, 4, 32, [50, *[1] * 20], 1, None, 132),  # prefill run + decode run
    ("gear", 4, 32, 64, 2, 8, 2, 128, [600, *[1] * 70], 1, "pad", 132),  # GQA, 2 splits, left padding
    ("gear", 2, 8, 32, 2, 6, 2, 8, [300, *[1] * 40], 1, "additive", 16),  # head_dim 8, additive mask
    ("gear", 4, 16, 32, 1, 8, 1, 64, [400, 40, *[1] * 30], 2, None, 132),  # 16 rows in 4 tiles, causal, 3 runs
    ("gear_l", 4, 8, 16, 1, 6, 2, 32, [90, *[1] * 20], 1, None, 132),  # GEAR-L: no outliers, 3 rows of 4
]


def _query_and_mask(case, length, device="cpu"):
    fmt, bits, group, residual, b, hq, hkv, d, chunks, q_len, mask_kind, sms = case
    gen = torch.Generator().manual_seed(len(chunks) * 7 + d)
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


def _state(case):
    fmt, bits, group, residual, b, hq, hkv, d, chunks, q_len, mask_kind, sms = case
    return state_for(fmt, bits, group, residual, b, hkv, d, chunks)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}{c[1]}-d{c[7]}-{c[5]}x{c[6]}-q{c[9]}-{c[10]}")
def test_emulated_kernel_equals_the_reference(case):
    fmt, d, sms = format_of(case), case[7], case[11]
    state = _state(case)
    query, mask = _query_and_mask(case, state.length)
    ref = codes_format.attend(state, None, query, mask, d**-0.5)[0]
    got = emulate(fmt, state, query, mask, d**-0.5, sms=sms)
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=2e-5)


def test_the_cases_cover_splits_tiles_and_gear_parts():
    for case in CASES:
        fmt, bits, group, residual, b, hq, hkv, d, chunks, q_len, mask_kind, sms = case
        state = _state(case)
        rows = hq // hkv * q_len
        rt = row_tile(format_of(case), rows)
        u = TOKENS_IN_FLIGHT[(format_of(case), rt)]
        n_split, _ = plan(state.length, b * hkv * -(-rows // rt), sms, d, u)
        case_id = (fmt, d, hq, hkv, q_len)
        if case_id in {("kivi", 128, 8, 2, 1), ("gear", 128, 8, 2, 1), ("kivi", 96, 8, 1, 3)}:
            assert n_split > 1, case_id
        if fmt == "gear":
            assert state.k.store.index is not None and len(state.k.store.runs) >= 2
        if fmt == "gear_l":
            assert state.k.store.index is None and state.v.store.runs


def test_emulation_fails_a_wrong_outlier():
    """The emulated GEAR path reads the outliers: one changed outlier value changes the output."""
    case = CASES[6]
    state = _state(case)
    query, mask = _query_and_mask(case, state.length)
    state.k.store.value[0, 0, 0] += 4.0
    ref = codes_format.attend(state, None, query, mask, 32**-0.5)[0]
    got = emulate("gear", state, query, mask, 32**-0.5)
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=2e-5)
    state.k.store.value[0, 0, 0] -= 4.0
    assert not torch.allclose(emulate("gear", state, query, mask, 32**-0.5), ref, atol=1e-4)


# ---------------------------------------------------------------- GPU: the kernels against the reference

GPU_CASES = [
    *CASES,
    ("kivi", 2, 32, 128, 2, 32, 8, 128, [4000, *[1] * 129], 1, "pad", 0),  # Llama-3 shape, 4129 tokens
    ("gear", 2, 64, 128, 2, 32, 8, 128, [3000, *[1] * 129], 1, "pad", 0),
    ("kivi", 8, 32, 64, 1, 16, 2, 64, [900, 1], 1, None, 0),  # 8 rows a KV head: the r8 tile
]


@gpu_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"{c[0]}{c[1]}-d{c[7]}-{c[5]}x{c[6]}-q{c[9]}-{c[10]}")
def test_kernel_equals_the_reference_on_the_same_state(case, dtype):
    from kernels_cupy.codes import attend_codes, attend_gear

    fmt, d = format_of(case), case[7]
    state = _state(case)
    state.map_tensors(lambda t: t.cuda())
    query, mask = _query_and_mask(case, state.length, "cuda")
    query = query.to(dtype)
    ref, _ = codes_format.attend(state, None, query.float(), mask, d**-0.5)
    got, reads = (attend_codes if fmt == "kivi" else attend_gear)(state, None, query, mask, d**-0.5)
    assert got.dtype == dtype and got.shape == query.shape and reads.k_widths is None
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=5e-6, rtol=5e-5)
    else:
        torch.testing.assert_close(got, ref.to(dtype), atol=2e-3, rtol=2e-3)


def kernel_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` ``[B, H, n, ...]`` read as codes.cu addresses it: row ``i`` of ``(b, h)`` at element
    ``((b·H + h)·rows + i)·inner`` from ``t``'s first element, over its storage."""
    b, h, n = t.shape[:3]
    inner = math.prod(t.shape[3:])
    flat = t.as_strided((t.untyped_storage().nbytes() // t.element_size() - t.storage_offset(),), (1,))
    index = ((torch.arange(b * h)[:, None] * rows + torch.arange(n)) * inner)[..., None] + torch.arange(inner)
    return flat[index].reshape(t.shape)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 4),
    st.integers(1, 40),
    st.integers(0, 30),
    st.sampled_from([(16,), (4, 1), (1, 8), (3,)]),
)
def test_rows_of_reads_a_buffers_view_in_place_at_its_capacity(b, h, n, slack, inner):
    """A ``RowBuffer``'s held view is passed as it is, its capacity the row stride, and the kernel's addressing
    reads exactly the view; anything else (here a transposed copy) is made contiguous, rows = its length."""
    from kernels_cupy.codes import rows_of

    buffer = torch.randint(0, 255, (b, h, n + slack, *inner), dtype=torch.uint8)
    view = buffer[:, :, :n]
    got, rows = rows_of(view)
    assert got.data_ptr() == buffer.data_ptr() and rows >= n
    assert rows == (n + slack if b * h > 1 else n)
    assert torch.equal(kernel_rows(got, rows), view)
    other = buffer.transpose(0, 1)[:, :, :n] if b > 1 and h > 1 else buffer[:, :, :n, ..., :1]
    got, rows = rows_of(other)
    assert torch.equal(kernel_rows(got, rows), other)


def test_a_decoded_kivi_store_is_read_in_place_from_its_buffers():
    """After decode steps KIVI's codes, scales and zeros are views of buffers with room to spare: the kernel's
    arguments are those buffers (no copy of the coded history a step), keys with their own row and group strides,
    values with scales sharing the codes' row stride, and the addressing reads exactly what the store holds."""
    from kernels_cupy.codes import quant_rows

    state = kivi_state(2, 8, 16, 2, 3, 32, [70, *[1] * 25])
    for stream, per_token in ((state.k, False), (state.v, True)):
        store = stream.store
        (codes, scale, zero), rows, groups = quant_rows(store.q, per_token)
        assert [t.data_ptr() for t in (codes, scale, zero)] == [r.buffer.data_ptr() for r in store.rows]
        assert rows == store.rows[0].buffer.shape[2] > store.q.codes.shape[2]
        assert groups == store.rows[1].buffer.shape[2] and (groups == rows) == per_token
        assert torch.equal(kernel_rows(codes, rows), store.q.codes)
        assert torch.equal(kernel_rows(scale, groups), store.q.scale)
        assert torch.equal(kernel_rows(zero, groups), store.q.zero)


def codes_signature() -> list[tuple[str, str]]:
    """``(type, name)`` of each parameter of the codes kernels (codes.cu's ``CODES_KERNEL``)."""
    text = (Path(codes_module.__file__).parent / "codes.cu").read_text().replace("\\\n", "\n")
    start = text.index("NAME(", text.index("#define CODES_KERNEL")) + len("NAME(")
    out = []
    for param in (" ".join(x.split()) for x in text[start : text.index(")", start)].split(",")):
        kind, name = param.replace("*", "* ").rsplit(" ", 1)
        out.append(("ptr" if "*" in kind else kind.replace("const ", "").strip(), name))
    return out


KERNEL_ARG_KINDS = {np.uint64: "ptr", np.int32: "int", np.int64: "long long", np.float32: "float"}


@pytest.mark.parametrize("fmt", ["kivi", "gear"])
def test_codes_launch_arguments_match_the_kernels_signature(fmt, monkeypatch):
    """Each argument of a codes launch has its parameter's type, in order, and the strides are the store's
    buffers' capacities (a misordered argument would only show on a GPU otherwise)."""
    calls = []
    monkeypatch.setattr(codes_module, "check_cuda", lambda query: None)
    monkeypatch.setattr(codes_module, "ptr", lambda t: np.uint64(0 if t is None else t.data_ptr()))  # CPU tensors
    monkeypatch.setattr(codes_module, "raw", lambda t: np.uint64(0 if t is None else t.data_ptr()))
    monkeypatch.setattr(codes_module, "sm_count", lambda index: 132)
    monkeypatch.setattr(codes_module, "launch", lambda *args, **kw: calls.append(args))
    state = state_for(fmt, 2, 8, 16, 2, 3, 32, [70, *[1] * 25])
    codes_module._attend(fmt, state, torch.randn(2, 6, 1, 32), None, 32**-0.5)
    (source, name, grid, block, args), merge = calls
    params = codes_signature()
    assert source == "codes.cu" and name.startswith(f"codes_{fmt}_b2_r") and merge[1] == "codes_merge"
    assert [KERNEL_ARG_KINDS[type(x)] for x in args] == [kind for kind, _ in params]
    named = {param: int(x) for (_, param), x in zip(params, args, strict=True)}
    k, v = state.k.store, state.v.store
    windows = (state.k.window.shape[2], state.v.window.shape[2])
    assert (named["kn"], named["vn"], named["kw"], named["vw"]) == (k.length, v.length, *windows)
    assert named["kcodes"] == k.q.codes.data_ptr() and named["vcodes"] == v.q.codes.data_ptr()
    if fmt == "kivi":  # RowBuffers: read in place at their capacity
        assert named["krows"] == k.rows[0].buffer.shape[2] and named["kgroups"] == k.rows[1].buffer.shape[2]
        assert named["vrows"] == v.rows[0].buffer.shape[2] > v.length
    else:
        assert (named["krows"], named["kgroups"], named["vrows"]) == (k.length, k.length // 8, v.length)
    assert (named["D"], named["G"], named["L"], named["Hkv"]) == (32, 8, state.length, 3)


@gpu_test
def test_kernel_follows_a_growing_kivi_store():
    """Decode steps on the device: values coded into buffers with room (their capacity the row stride), a key
    block flushed, the buffers regrown; the kernel reads them in place and matches the reference every step."""
    from kernels_cupy.codes import attend_codes

    state = kivi_state(2, 8, 16, 2, 2, 64, [100])
    state.map_tensors(lambda t: t.cuda())
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(300):
        k, v = (torch.randn(2, 2, 1, 64, device="cuda", generator=gen).half().float() for _ in range(2))
        state.append(k, v, decode=True)
        query = torch.randn(2, 4, 1, 64, device="cuda", generator=gen)
        ref, _ = codes_format.attend(state, None, query, None, 0.125)
        torch.testing.assert_close(attend_codes(state, None, query, None, 0.125)[0], ref, atol=5e-6, rtol=5e-5)
    assert state.v.store.rows[0].buffer.shape[2] > state.v.store.length  # read with slack, not a contiguous copy


@gpu_test
def test_kernel_follows_a_growing_gear_store():
    """Decode steps that add segments and outliers: the cached outliers and runs follow the store."""
    from kernels_cupy.codes import attend_gear

    state = gear_state(4, 16, 32, 2, 2, 64, [100])
    state.map_tensors(lambda t: t.cuda())
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(70):
        k, v = (torch.randn(2, 2, 1, 64, device="cuda", generator=gen) for _ in range(2))
        state.append(k, v, decode=True)
        query = torch.randn(2, 4, 1, 64, device="cuda", generator=gen)
        ref, _ = codes_format.attend(state, None, query, None, 0.125)
        torch.testing.assert_close(attend_gear(state, None, query, None, 0.125)[0], ref, atol=5e-6, rtol=5e-5)


@gpu_test
def test_backend_cupy_generates_as_the_torch_backend_on_stories260k():
    """kivi2 through the code kernels in a whole model (``backend=auto``'s choice on CUDA): as the torch path,
    within fp32 summation order (128 of the 189 keys and 61 values coded)."""
    assert_generates_as_torch("kivi2", kl_bound=1e-6)


def test_a_prompt_takes_the_torch_reference():
    """More than ``PROMPT_QUERIES`` query positions: the reference's own path (any device)."""
    from kernels_cupy.codes import PROMPT_QUERIES, attend_codes

    state = kivi_state(2, 8, 16, 1, 2, 32, [60])
    query = torch.randn(1, 4, PROMPT_QUERIES + 1, 32)
    got, reads = attend_codes(state, None, query, None, 32**-0.5)
    assert torch.equal(got, codes_format.attend(state, None, query, None, 32**-0.5)[0]) and reads.v_widths is None
    with pytest.raises(ValueError, match="CUDA"):
        attend_codes(state, None, query[:, :, :1], None, 32**-0.5)


def quantize_signature() -> list[tuple[str, str]]:
    """``(type, name)`` of each parameter of ``quantize_values_b*`` (codes.cu's ``QUANTIZE_VALUES``)."""
    text = (Path(codes_module.__file__).parent / "codes.cu").read_text().replace("\\\n", "\n")
    start = text.index("quantize_values_b##BITS(", text.index("#define QUANTIZE_VALUES")) + len(
        "quantize_values_b##BITS("
    )
    out = []
    for param in (" ".join(x.split()) for x in text[start : text.index(")", start)].split(",")):
        kind, name = param.replace("*", "* ").rsplit(" ", 1)
        out.append(("ptr" if "*" in kind else kind.replace("const ", "").strip(), name))
    return out


def value_tokens(b, h, n, d, seed, window=True):
    """fp16 value tokens with the rows a coder meets: constant groups, zeros, fp16's extremes, subnormals;
    ``window``: as a view of a longer window (strided tokens, as ``Stream`` hands them)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, n + 3 if window else n, d, generator=gen) * torch.logspace(-6, 4, d)[torch.randperm(d)]
    x[:, :, 0, : d // 2] = 1.5  # a constant group (scale 0)
    x[:, :, -1, :4] = torch.tensor([65504.0, -65504.0, 6e-8, 0.0])
    x = x.clamp(-65504, 65504).half()
    return x[:, :, :n] if window else x


@pytest.mark.parametrize(("bits", "group"), [(2, 32), (4, 8), (8, 16), (2, 1), (4, 3)])
def test_quantize_launch_codes_what_quantize_codes_into_the_buffers(bits, group, monkeypatch):
    """``KernelQuantStore``'s launch, its arguments checked against ``QUANTIZE_VALUES``' signature and carried
    out on the CPU by the kernel's own addressing (the row from ``row0`` at the capacity stride, the token from
    the strides given): the store then holds what ``QuantStore`` holds, token by token, through regrowths."""
    from kernels_cupy import store as store_module
    from kvquant.quant.integer import quantize

    monkeypatch.setattr(codes_module, "QUANTIZE_KERNEL", True)
    monkeypatch.setattr(codes_module, "raw", lambda t: np.uint64(0 if t is None else t.data_ptr()))
    monkeypatch.setattr(store_module.KernelQuantStore, "kernel_takes", lambda self, x: True)
    b, h, d = 2, 3, 96
    kernel, plain = store_module.KernelQuantStore(bits, CHANNEL_AXIS, group), QuantStore(bits, CHANNEL_AXIS, group)
    params = quantize_signature()
    calls = []

    def launch(source, name, grid, block, args, shared_mem=0):
        assert (source, name, block) == ("codes.cu", f"quantize_values_b{bits}", 32)
        assert [KERNEL_ARG_KINDS[type(x)] for x in args] == [kind for kind, _ in params]
        a = {param: int(x) for (_, param), x in zip(params, args, strict=True)}
        (t, bh), groups, nbytes = grid, d // group, (d * bits + 7) // 8
        assert bh == b * h and a["H"] == h and (a["D"], a["G"]) == (d, group) and a["x"] == x.data_ptr()
        buffers = [rows.buffer for rows in kernel.rows]
        assert [a["codes"], a["scale"], a["zero"]] == [buf.data_ptr() for buf in buffers]
        assert a["rows"] == buffers[0].shape[2] and a["row0"] == kernel.rows[0].rows - t
        flat_x = x.as_strided((x.untyped_storage().nbytes() // 2 - x.storage_offset(),), (1,))
        for i in range(bh):
            for j in range(t):
                at = (i // h) * a["xb"] + (i % h) * a["xh"] + j * a["xt"]
                q = quantize(flat_x[at : at + d].reshape(1, 1, 1, d), bits, CHANNEL_AXIS, group, checked=True)
                row = i * a["rows"] + a["row0"] + j
                for buf, part, inner in zip(buffers, q.tensors(), (nbytes, groups, groups), strict=True):
                    buf.as_strided((buf.numel(),), (1,))[row * inner : (row + 1) * inner] = part.reshape(-1)
        calls.append(grid)

    monkeypatch.setattr(store_module, "launch", launch)
    for step, n in enumerate([5, *[1] * 70, 3]):
        x = value_tokens(b, h, n, d, seed=step)
        kernel.add(x, decode=n == 1)
        plain.add(x, decode=n == 1)
        for got, want in zip(kernel.q.tensors(), plain.q.tensors(), strict=True):
            assert torch.equal(got, want)
    assert len(calls) == 72 and kernel.rows[0].buffer.data_ptr() != 0 and kernel.length == plain.length == 78


def test_the_kernel_state_codes_values_by_the_kernel_store_and_keys_as_before():
    """``Backend.new_state`` on CuPy gives KIVI a ``KernelCodesState`` (``backend.STATES``): its value store is a
    ``KernelQuantStore``, which on tensors the kernel does not take (here the CPU's) codes as ``QuantStore``."""
    from kernels_cupy.backend import STATES
    from kernels_cupy.store import KernelCodesState, KernelQuantStore

    assert STATES["kivi"] is KernelCodesState
    keys = Stream(QuantStore(2, TOKEN_AXIS, 8), 16, block=16)
    values = Stream(QuantStore(2, CHANNEL_AXIS, 8), 16, block=None)
    state = KernelCodesState(keys, values, 2, 8)
    assert type(state.v.store) is KernelQuantStore and type(state.k.store) is QuantStore
    ref = kivi_state(2, 8, 16, 2, 3, 32, [40, *[1] * 10])
    gen = torch.Generator().manual_seed(0)
    for n in [40, *[1] * 10]:
        k, v = torch.randn(2, 3, n, 32, generator=gen), torch.randn(2, 3, n, 32, generator=gen)
        state.append(k.half().float(), v.half().float(), decode=n == 1)
    for got, want in zip(state.v.store.q.tensors(), ref.v.store.q.tensors(), strict=True):
        assert torch.equal(got, want)


@gpu_test
@pytest.mark.parametrize(("bits", "group", "d"), [(2, 32, 128), (4, 32, 128), (8, 16, 64), (2, 8, 64), (4, 1, 8)])
def test_the_quantize_kernel_codes_bit_for_bit_as_torch(bits, group, d, monkeypatch):
    """``quantize_values`` on the device against ``kvquant.quant.integer.quantize`` on the same CUDA tokens:
    the same codes, scales and zeros (constant groups, fp16's extremes, subnormals, strided window views), over
    decode steps that regrow the buffers."""
    from kernels_cupy.store import KernelQuantStore

    monkeypatch.setattr(codes_module, "QUANTIZE_KERNEL", True)
    kernel, plain = KernelQuantStore(bits, CHANNEL_AXIS, group), QuantStore(bits, CHANNEL_AXIS, group)
    for step, n in enumerate([7, *[1] * 80, 2]):
        x = value_tokens(2, 4, n, d, seed=step).cuda()
        kernel.add(x, decode=n == 1)
        plain.add(x, decode=n == 1)
    for got, want in zip(kernel.q.tensors(), plain.q.tensors(), strict=True):
        assert torch.equal(got, want)


@gpu_test
def test_backend_cupy_with_the_quantize_kernel_generates_as_the_torch_backend(monkeypatch):
    monkeypatch.setattr(codes_module, "QUANTIZE_KERNEL", True)
    assert_generates_as_torch("kivi2", 1e-6)
