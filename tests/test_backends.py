"""The backend seam: choices, one-line errors, auto's fallback, and imports that run one way."""

import subprocess
import sys

import pytest

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
