#!/usr/bin/env python
"""Compile every kernels_cupy module once, one process each, as the loader does at first use.

    python scripts/gpu_compile.py          # on a GPU machine; scripts/gpu_check.sh runs it before the tests

Each module goes through NVRTC (the loader's first choice) and then ``loader.module``, which falls back
to CuPy's nvcc backend where NVRTC refuses a source: the line says which compiled it, in how many seconds,
and NVRTC's complaint where it refused. Afterwards CuPy's disk cache holds every module, so test workers
load them instead of compiling the same source each. Exit 1 when a module does not compile at all.
"""

from __future__ import annotations

import multiprocessing
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def compile_one(name: str) -> tuple[bool, str]:
    """One module through NVRTC, then as the loader compiles it: whether it compiled, and a line saying how."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import cupy

    from kernels_cupy import loader

    start = time.perf_counter()
    try:
        cupy.RawModule(code=loader.source_text(name), options=loader.NVRTC_OPTIONS).compile()
        how = "nvrtc"
    except Exception as exc:  # CuPy raises its CompileException, or a CUDA error where NVRTC is missing
        how = "nvcc (NVRTC refused it: " + " ".join(str(exc).split())[:1500] + ")"
    try:
        loader.module(name)
    except Exception as exc:
        return False, f"{name}: FAILED after {time.perf_counter() - start:.1f} s: " + " ".join(str(exc).split())[:3000]
    return True, f"{name}: {how}, {time.perf_counter() - start:.1f} s"


def main() -> int:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from kernels_cupy import cupy_status
    from kernels_cupy.nvcc import ALL_SOURCES

    ok, why = cupy_status()
    if not ok:
        print(f"error: the kernels cannot run here: {why}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(len(ALL_SOURCES)) as pool:
        done = pool.map(compile_one, ALL_SOURCES)
    print("\n".join(line for _, line in done))
    print(f"all modules: {time.perf_counter() - start:.1f} s")
    return 0 if all(ok for ok, _ in done) else 1


if __name__ == "__main__":
    sys.exit(main())
