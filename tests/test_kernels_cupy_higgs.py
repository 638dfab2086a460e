"""The CuPy kernel over HIGGS codes with keys coded after RoPE (kernels_cupy/higgs.cu): on CPU, the compile for
sm_80/sm_90 (no warnings, no spills), every launch, index and split helper, and the kernel emulated line for
line in torch (kernels_cupy.higgs_emulate) against the torch reference on states the real method wrote; on
a GPU, the kernel itself against the reference and ``backend=cupy`` on stories260K."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers as T
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kernels_cupy_codes import gpu_test, left_padding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from kernels_cupy.higgs import (
    MIN_CHUNK,
    PROMPT_QUERIES,
    ROW_TILES,
    TOKENS_IN_FLIGHT,
    attend_higgs,
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
    rotated_queries,
    rotation_entries,
    row_tile,
    shared_bytes,
    split_range,
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


def _nvcc(arch: str, out: str, *extra: str) -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    # -ftz=true as CuPy compiles; -Werror all-warnings turns every warning into a failure.
    cmd = [nvcc, f"-arch={arch}", "-ftz=true", "-Werror", "all-warnings", *extra]
    done = subprocess.run([*cmd, str(SOURCE_DIR / "higgs.cu"), "-o", out], capture_output=True)
    log = (done.stdout + done.stderr).decode(errors="replace")
    assert done.returncode == 0, log
    return log


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Each compile once for the module: sm_80 PTX, and an sm_90 cubin with ``ptxas -v``'s log."""
    out = tmp_path_factory.mktemp("higgs_cu")
    ptx_log = _nvcc("sm_80", str(out / "out.ptx"), "-ptx")
    cubin_log = _nvcc("sm_90", str(out / "out.cubin"), "-cubin", "-Xptxas", "-v")
    return ptx_log, (out / "out.ptx").read_text(), cubin_log


def test_higgs_cu_compiles_for_sm80_and_sm90_without_warnings(compiled):
    ptx_log, ptx, cubin_log = compiled
    assert not ptx_log.strip(), ptx_log
    assert ".entry higgs_r1" in ptx and ".entry higgs_merge" in ptx
    info = re.compile(r"ptxas info|bytes stack frame")
    assert not [line for line in cubin_log.splitlines() if line.strip() and not info.search(line)], cubin_log


def test_ptxas_shows_no_spills_on_sm90(compiled):
    """``ptxas -v`` on every kernel: no stack frame, no spill (the numbers in the README)."""
    log = compiled[2]
    entries = re.findall(r"Compiling entry function '(\w+)'", log)
    names = {f"higgs_r{rt}" for rt in ROW_TILES}
    assert set(entries) == names | {"higgs_merge"}
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert len(frames) == len(entries) and all(f == ("0", "0", "0") for f in frames), log


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
    """Registered for ``higgs`` (opt-in as the rest of the backend), not ``aquakv``; ``limits`` passes
    ``higgs_post_rope``'s quantizer on stories260K's and Llama-3's geometry and names what it lacks."""
    from kvquant import get_method
    from kvquant.backends import get_backend

    cupy = get_backend("cupy")
    assert "higgs" in cupy.formats and "aquakv" not in cupy.formats and cupy.auto is False
    for geo in (KVGeometry(5, 8, 4, 8), KVGeometry(32, 32, 8, 128)):
        assert cupy.limits("higgs", geo, get_method("higgs_post_rope").rule(geo)) == []
    geo = KVGeometry(n_layers=2, n_heads=8, n_kv_heads=4, head_dim=64)
    assert cupy.limits("aquakv", geo, Higgs(256, 2, 1024)) == ["AQUA-KV codes (a cross-layer predictor's residual)"]
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

    assert limits("higgs", geo, HiggsRule(Higgs(256, 2, 1024), post_rope=False)) == [
        "keys coded before RoPE (method higgs; higgs_post_rope has a kernel)"
    ]
    assert limits("higgs", geo, HiggsRule(Higgs(256, 2, 1024), post_rope=True)) == []


def test_method_higgs_is_refused_when_its_cache_is_made(stories, monkeypatch):
    """The method hands ``limits`` whether its keys are coded after RoPE (``HiggsRule``), so ``higgs``
    (pre-RoPE keys) on ``backend=cupy`` is refused in one line before any step, not at the first read."""
    import kvquant.backends as backends
    from kvquant import get_method
    from kvquant.errors import KvquantError

    cupy = backends.get_backend("cupy")
    monkeypatch.setitem(
        backends._BACKENDS, "cupy", dataclasses.replace(cupy, status=lambda: (True, "ok"), device_type="cpu")
    )
    with pytest.raises(KvquantError, match="keys coded before RoPE"):
        get_method("higgs", backend="cupy").new_cache(stories[0])


def test_states_the_kernel_cannot_read_are_refused():
    pre = higgs_layer(2, 16, 2, 1024, 4, 8, 1, 30, 1, post_rope=False)
    assert pre.state.qk is not None and "positions" in pre.state.rope
    with pytest.raises(ValueError, match="coded before RoPE"):
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


def _layer(case):
    b, hq, hkv, d, bits, group, sink, window, prefill, steps, q_len, mask_kind, sms = case
    return higgs_layer(hkv, d, bits, group, sink, window, b, prefill, steps, seed=prefill + steps)


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


def test_the_cases_cover_splits_lanes_and_parts():
    seen = set()
    for case in CASES:
        b, hq, hkv, d, bits, group, sink, window, prefill, steps, q_len, mask_kind, sms = case
        state = _layer(case).state
        shape = group_shape(state.quant, hkv, d, hq, q_len)
        rt, parts = row_tile(shape["RM"]), (state.n_sinks, state.n_codes, state.n_recent)
        splits = plan(parts, b * shape["G"] * -(-shape["RM"] // rt), sms, shape["P"], TOKENS_IN_FLIGHT[rt])
        seen |= {("splits", min(splits[1][0], 5)), ("lanes", min(lanes_per_token(shape["P"]), 64))}
        seen |= {
            ("bits", state.quant.code_bits),
            ("tiles", shape["RM"] > rt),
            ("short", shape["rows"][-1] < shape["RM"]),
        }
        seen |= {("no sinks", not parts[0]), ("no window", not parts[2])}
    want = {("splits", 0), ("splits", 1), ("splits", 3), ("splits", 5), ("lanes", 1), ("lanes", 4), ("lanes", 64)}
    want |= {("bits", 6), ("bits", 8), ("tiles", True), ("short", True), ("no sinks", True), ("no window", True)}
    assert want <= seen


def _signature(kernel: str) -> list[tuple[str, str]]:
    """``(type, name)`` of each parameter of a kernel in higgs.cu (the attention kernels' macro, or ``higgs_merge``)."""
    text = (SOURCE_DIR / "higgs.cu").read_text().replace("\\\n", "\n")
    head = "NAME(" if kernel != "higgs_merge" else "higgs_merge("
    params = text[text.index(head) + len(head) : text.index(") {", text.index(head))].split(",")
    out = []
    for param in (" ".join(x.split()) for x in params):
        kind, name = param.rsplit(" ", 1)
        out.append(("ptr" if "*" in kind else kind.replace("const ", ""), name))
    return out


KINDS = {np.uint64: "ptr", np.int32: "int", np.int64: "long long", np.float32: "float"}


@pytest.mark.parametrize("case", [CASES[i] for i in (1, 3, 7, 9)], ids=case_id)
def test_launch_arguments_match_the_kernels_signatures(case, monkeypatch):
    """Each argument of both launches has its parameter's type, and the named sizes are the state's and the
    plan's (a misordered argument would only show on a GPU otherwise)."""
    import kernels_cupy.higgs as module

    monkeypatch.setattr(module, "ptr", lambda t: np.uint64(0 if t is None else t.data_ptr()))  # CPU tensors
    b, hq, hkv, d, q_len, sms = case[0], case[1], case[2], case[3], case[10], case[12]
    state = _layer(case).state
    query, mask = _query_and_mask(case, _length(state))
    (name, grid, shared, args), merge = launches(state, query, mask, d**-0.5, sms)[0]
    shape = group_shape(state.quant, hkv, d, hq, q_len)
    rt = row_tile(shape["RM"])
    parts = (state.n_sinks, state.n_codes, state.n_recent)
    splits = plan(parts, b * shape["G"] * -(-shape["RM"] // rt), sms, shape["P"], TOKENS_IN_FLIGHT[rt])
    for kernel, got in ((name, args), (merge[0], merge[3])):
        params = _signature(kernel)
        assert [KINDS[type(x)] for x in got] == [kind for kind, _ in params]
    named = {param: int(x) for (_, param), x in zip(_signature(name), args, strict=True)}
    want = dict(zip(("ns", "nc", "nr", "n0", "chunk0", "n1", "chunk1"), (*parts, *splits[0], *splits[1]), strict=True))
    want |= {"chunk2": splits[2][1], "cb": state.quant.code_bits, "D": d, "P": shape["P"], "RM": shape["RM"]}
    want |= {"G": shape["G"], "HPG": shape["hpg"], "g": hq // hkv, "Q": q_len, "lpt": lanes_per_token(shape["P"])}
    assert {key: named[key] for key in want} == want
    assert name == f"higgs_r{rt}" and grid == (sum(n for n, _ in splits), b * shape["G"], -(-shape["RM"] // rt))
    assert shared == shared_bytes(shape["P"], rt, state.quant.grid.shape[0])
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


def assert_follows_torch(model, tok, backend: str) -> None:
    """``higgs_post_rope`` on ``backend`` against ``backend=torch``: one prompt, greedy over 24 steps past an
    8-token window (tokens equal), and two prompts, the shorter left-padded (the model's own mask handed to
    attention), fed the torch path's tokens for 10 steps (the same argmax at every step); mean KL below
    1e-6 for both (fp32 summation order, and where an fp16 window value rounds the other way, one fp16 step)."""
    from kvquant import get_method
    from kvquant.eval.fidelity import greedy_decode, kl_divergence

    rows = [tok(p, return_tensors="pt").input_ids[0] for p in ("Once upon a time, a little fox saw a", "Tom")]
    n = max(len(r) for r in rows)
    first = torch.stack([torch.cat([torch.zeros(n - len(r), dtype=torch.long), r]) for r in rows]).to(model.device)
    attn0 = (torch.arange(n)[None] >= torch.tensor([n - len(r) for r in rows])[:, None]).long().to(model.device)
    runs, logits = {}, {}
    for name in ("torch", backend):
        method = get_method("higgs_post_rope", window=8, backend=name)
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
    assert kl_divergence(runs["torch"].logprobs, runs[backend].logprobs).mean() < 1e-6
    assert torch.equal(logits[backend].argmax(-1), logits["torch"].argmax(-1))
    mine, theirs = (torch.log_softmax(logits[k], -1).flatten(0, 1).cpu() for k in (backend, "torch"))
    assert kl_divergence(theirs, mine).mean() < 1e-6


def test_stories260k_through_the_emulated_kernel_follows_the_torch_backend(stories, emulated_backend):
    """stories260K (GQA 8/4, head_dim 8, one 32-channel group) with the kernel's arithmetic in its attention."""
    assert_follows_torch(*stories, emulated_backend)


# ---------------------------------------------------------------- GPU: the kernel against the reference

GPU_CASES = [
    *CASES,
    (2, 32, 8, 128, 2, 1024, 4, 128, 4000, 129, 1, "pad", 0),  # Llama-3 shape, 4129 tokens
]


@gpu_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", GPU_CASES, ids=case_id)
def test_kernel_equals_the_reference_on_the_same_state(case, dtype):
    d = case[3]
    state = _layer(case).state
    state.map_tensors(lambda t: t.cuda())
    state.rope = {"post_rope": True} if state.qk is not None else {}
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
def test_backend_cupy_generates_as_the_torch_backend_on_stories260k():
    """``backend=cupy`` on stories260K: as ``assert_follows_torch`` (the kernel reads the codes from step one)."""
    from kvquant import load_model

    assert_follows_torch(*load_model("stories260k", device="cuda"), "cupy")
