"""The backend seam: choices, one-line errors, auto's fallback, and imports that run one way."""

import subprocess
import sys

import pytest
import torch

from kvquant import backends, get_method
from kvquant.backends import check_backend, choices, get_backend, select_backend
from kvquant.errors import InvalidParameterError


def test_choices_and_unknown_names():
    assert choices()[:4] == ["auto", "torch", "cpu", "cupy"]
    assert check_backend("cupy") == "cupy"
    with pytest.raises(InvalidParameterError, match="unknown backend 'triton'; valid backends: auto, torch, cpu, cupy"):
        select_backend("triton", "cuda", "planes")


def test_torch_is_always_there_and_auto_falls_back_with_one_line(capsys, monkeypatch):
    monkeypatch.setattr("kvquant.backends._WARNED", set())  # each fallback line is said once per process
    assert select_backend("torch", "cuda", "planes") == "torch"
    assert select_backend("auto", "cpu", "no-such-format") == "torch"
    select_backend("auto", "cpu", "no-such-format")  # said once, not per cache
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: backend=auto uses torch for 'no-such-format' on cpu")


def test_explicit_backend_that_cannot_run_is_one_line():
    with pytest.raises(InvalidParameterError, match=r"backend=cupy cannot run here: .*use backend=auto or torch"):
        select_backend("cupy", "cpu", "planes")


def test_cupy_registers_itself_for_planes():
    cupy = get_backend("cupy")
    assert cupy is not None and cupy.device_type == "cuda" and "planes" in cupy.formats


def test_the_library_imports_no_kernels_package():
    code = (
        "import sys, kvquant, kvquant.methods, kvquant.cache, kvquant.backends, kvquant.attention;"
        "from kvquant import get_method; [get_method(n) for n in ('fp16', 'alignedkv', 'kivi2')];"
        "print(sorted(m for m in sys.modules if m.startswith('kernels_')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


FORMATS = {
    "fp16": {},
    "truncation": {},
    "kivi2": {"group_size": 8, "residual": 32},
    "gear2": {"group_size": 8, "residual": 32},
    "alignedkv": {},
    "alignedkv_block": {},
    "higgs": {"window": 16},
    "aquakv": {"window": 16},
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_cpu_kernel_attends_as_the_torch_reference_on_the_same_state(stories, predictor_root, monkeypatch, name):
    """The protocol itself: after a real prefill on the C++ backend, ``attend`` over a layer's state equals
    the torch reference's (``kvquant.formats.attend``) on that state — the same output within fp32
    summation order and, where a rule chooses, the same widths; a bf16 query takes the planes' unfused path."""
    from conftest import require_kernels_cpu

    from kvquant.backends import TORCH

    require_kernels_cpu()
    model, tok = stories
    monkeypatch.setenv("KVQUANT_PREDICTOR_DIR", str(predictor_root(model, tok)))
    method = get_method(name, backend="cpu", **FORMATS[name])
    ids = tok("Once upon a time, there was a little girl named Lily. " * 8, return_tensors="pt").input_ids[:, :90]
    with method.attach(model), torch.no_grad():
        cache = method.new_cache(model)
        model(ids, past_key_values=cache)
    layer = cache.layers[-1]  # the last layer: AQUA-KV's workspace rows are still this forward's
    if hasattr(layer, "kernel_rope"):  # HIGGS/AQUA-KV: the step's RoPE inputs, which attention consumed
        layer.state.rope = layer.kernel_rope()
    cpu = get_backend("cpu")
    # a bf16 query: the planes' unfused path (elsewhere the reference reads K/V in bf16, the kernels in fp32)
    for dtype in (torch.float32, torch.bfloat16) if method.format == "planes" else (torch.float32,):
        query = torch.randn(1, model.config.num_attention_heads, 1, 8, generator=torch.Generator().manual_seed(1))
        query = query.to(dtype)
        want, want_reads = TORCH.attend(layer.attended_state(), layer.rule, query, None, 8**-0.5)
        got, reads = cpu.attend(layer.attended_state(), layer.rule, query, None, 8**-0.5)
        tol = {"rtol": 2e-2, "atol": 4e-3} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-5}
        torch.testing.assert_close(got.float(), want.float(), **tol)
        for mine, theirs in ((reads.k_widths, want_reads.k_widths), (reads.v_widths, want_reads.v_widths)):
            assert (mine is None) == (theirs is None) and (mine is None or torch.equal(mine, theirs))


def test_auto_passes_over_an_opt_in_format_with_one_line(capsys, monkeypatch):
    """CuPy's kernels are ``auto``'s choice on CUDA for the formats validated on a GPU (planes, kivi) and
    opt-in for the rest: ``auto`` then reads with the torch reference, said once per format; naming ``cupy``
    still selects them where they can run; where CuPy cannot run, ``auto`` for planes says why."""
    monkeypatch.setattr("kvquant.backends._WARNED", set())
    cupy = get_backend("cupy")
    assert [f for f in ("planes", "kivi", "gear", "higgs", "aquakv") if cupy.auto_for(f)] == ["planes", "kivi"]
    old_style = [backends.Backend("x", "cpu", frozenset({"fp16"}), cupy.status, "m", auto=a) for a in (True, False)]
    assert [b.auto_for("fp16") for b in old_style] == [True, False]
    assert backends.auto_candidate("cuda", "planes") == "cupy" and backends.auto_candidate("cuda", "gear") is None
    assert backends.auto_candidate("cpu", "gear") == "cpu"
    for fmt in ("gear", "higgs", "gear"):
        assert select_backend("auto", "cuda", fmt) == "torch"
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"warning: backend=auto uses torch for '{fmt}' on cuda: its kernels are opt-in (method.backend=cupy)"
        for fmt in ("gear", "higgs")
    ]
    if not cupy.status()[0]:
        assert select_backend("auto", "cuda", "planes") == "torch"
        assert "backend=auto uses torch for 'planes' on cuda: cupy kernels unusable" in capsys.readouterr().err


def test_placeholders_route_by_identity_and_cost_no_operator():
    """``expect_attention``'s placeholders are views of one cached NaN per dtype and device: after the first,
    handing them out dispatches no torch operator (on a GPU: no launch a layer and step), and each key still
    routes to its own reader, once."""
    from kvquant.analysis.timing import OpCounter
    from kvquant.attention import expect_attention, take_reader

    expect_attention("warm", (1, 2, 3, 4), torch.float16, "cpu")
    with OpCounter() as counter:
        k1, v1 = expect_attention("first", (1, 2, 3, 4), torch.float16, "cpu")
        k2, _ = expect_attention("second", (2, 1, 5, 4), torch.float16, "cpu")
    assert counter.total == 0 and k1.shape == v1.shape == (1, 2, 3, 4) and bool(k1.isnan().all())
    assert take_reader(k2) == "second" and take_reader(k1) == "first" and take_reader(k1) is None
    assert take_reader(torch.full((1, 2, 3, 4), float("nan"))) is None
