"""kernels_cupy.nvcc: a compile's cached log stands only for the exact source, header, flags and nvcc it
came from, a warning fails the compile, and ``ptxas -v``'s per-kernel lines are read as they are."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from kernels_cupy import nvcc
from kernels_cupy.loader import HEADER, SOURCE_DIR

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")

CLEAN = """#include "planes.cuh"
extern "C" __global__ void twice(float* x, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= 2.0f;
}
"""
WARNS = CLEAN.replace("x[i] *= 2.0f;", "{ int unused = 3; x[i] *= 2.0f; }")


@pytest.fixture
def sources(tmp_path, monkeypatch):
    """A source folder of this test's own (with the real header) and a cache of its own."""
    folder = tmp_path / "src"
    folder.mkdir()
    shutil.copyfile(SOURCE_DIR / HEADER, folder / HEADER)
    monkeypatch.setattr(nvcc, "SOURCE_DIR", folder)
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    return folder


def test_a_clean_source_compiles_once_and_is_then_read_from_the_cache(sources, monkeypatch):
    (sources / "twice.cu").write_text(CLEAN)
    ptx, cubin = nvcc.compile_source("twice.cu", "sm_80"), nvcc.compile_source("twice.cu", "sm_90")
    assert ptx.returncode == 0 and not ptx.log.strip() and ".entry twice" in ptx.ptx
    assert cubin.returncode == 0 and not cubin.warnings() and cubin.entries() == ["twice"]
    assert cubin.frames() == [(0, 0, 0)] and 0 < cubin.registers()["twice"] <= 32
    assert not list((sources.parent / "cache" / "nvcc").glob("tmp*"))  # no work folder left behind

    calls = []
    real_run = subprocess.run

    def run(cmd, *args, **kwargs):
        calls.append(cmd[1:])
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(nvcc.subprocess, "run", run)
    assert nvcc.compile_source("twice.cu", "sm_90") == cubin
    assert calls == [["--version"]]  # the key only; no compile


def test_a_changed_source_header_or_target_is_another_compile(sources):
    (sources / "twice.cu").write_text(CLEAN)
    path = shutil.which("nvcc")
    key = nvcc.compile_key("twice.cu", "sm_90", path)
    assert key == nvcc.compile_key("twice.cu", "sm_90", path)
    assert key != nvcc.compile_key("twice.cu", "sm_80", path)
    (sources / "twice.cu").write_text(CLEAN + "\n")
    assert key != nvcc.compile_key("twice.cu", "sm_90", path)
    (sources / "twice.cu").write_text(CLEAN)
    (sources / HEADER).write_text((SOURCE_DIR / HEADER).read_text() + "\n")
    assert key != nvcc.compile_key("twice.cu", "sm_90", path)


def test_a_warning_fails_the_compile_for_both_targets(sources):
    (sources / "twice.cu").write_text(WARNS)
    for arch in nvcc.TARGETS:
        compiled = nvcc.compile_source("twice.cu", arch)
        assert compiled.returncode != 0 and "unused" in compiled.log, compiled.log
        assert compiled.warnings()


def test_every_source_is_compiled_for_both_targets():
    jobs = {(s, a) for s in nvcc.ALL_SOURCES for a in nvcc.TARGETS}
    assert len(jobs) == 2 * len(set(nvcc.ALL_SOURCES)) == 12
    assert {p.name for p in SOURCE_DIR.glob("*.cu")} == set(nvcc.ALL_SOURCES)


def test_the_command_prints_one_row_per_compile_and_fails_closed_under_strict(sources, monkeypatch, capsys):
    from kernels_cupy.__main__ import main

    (sources / "twice.cu").write_text(CLEAN)
    (sources / "warns.cu").write_text(WARNS)
    monkeypatch.setattr(nvcc, "ALL_SOURCES", ("twice.cu", "warns.cu"))
    assert main(["nvcc"]) == 0 and main(["nvcc", "--strict"]) == 1
    out = capsys.readouterr().out.splitlines()
    rows = [line.split(" | ") for line in out if line.startswith("| ") and "---" not in line and "source" not in line]
    assert sorted((r[0][2:], r[1], r[2]) for r in rows[:4]) == [
        ("twice.cu", "sm_80", "ok"),
        ("twice.cu", "sm_90", "ok"),
        ("warns.cu", "sm_80", "FAILED"),
        ("warns.cu", "sm_90", "FAILED"),
    ]
    assert out[-1].startswith("kernels_cupy: 2 of 4 compiles clean")
    monkeypatch.setattr(nvcc, "nvcc_path", lambda: None)
    monkeypatch.setattr("kernels_cupy.__main__.nvcc_path", lambda: None)
    assert main(["nvcc"]) == 0 and main(["nvcc", "--strict"]) == 1
    assert capsys.readouterr().out.count("nvcc is not on PATH") == 2
