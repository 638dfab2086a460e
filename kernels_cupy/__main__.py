"""``python -m kernels_cupy nvcc``: every ``.cu`` through nvcc for sm_80 (PTX) and sm_90 (``ptxas -v``), once
(``make setup``; later runs read the cached logs), with a table of warnings, registers and spills.

No GPU is needed. Without nvcc it prints one line and exits 0 (the suite's compile tests then skip), as
it does when a compile fails, unless ``--strict`` is given.
"""

from __future__ import annotations

import argparse
import sys
import time

from kernels_cupy.nvcc import cache_dir, compile_all, nvcc_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels_cupy", description=__doc__)
    parser.add_argument("command", choices=["nvcc"])
    parser.add_argument("--strict", action="store_true", help="exit 1 when a compile fails or warns")
    args = parser.parse_args(argv)
    if nvcc_path() is None:
        print("kernels_cupy: nvcc is not on PATH; nothing compiled (the CUDA compile tests will skip)")
        return 1 if args.strict else 0
    start = time.perf_counter()
    results = compile_all()
    print("| source | arch | result | kernels | most registers | spilling kernels |")
    print("|---|---|---|---|---|---|")
    bad = 0
    for r in results:
        ok = r.returncode == 0 and not r.warnings()
        bad += not ok
        regs = r.registers() if r.arch == "sm_90" and r.returncode == 0 else {}
        spilling = sum(any(f) for f in r.frames())
        most = f"{max(regs.values())} ({max(regs, key=regs.get)})" if regs else "-"
        kernels = len(regs) if regs else r.ptx.count(".entry")
        print(f"| {r.source} | {r.arch} | {'ok' if ok else 'FAILED'} | {kernels} | {most} | {spilling} |")
        if not ok:
            print(r.log.strip(), file=sys.stderr)
    took = time.perf_counter() - start
    print(f"kernels_cupy: {len(results) - bad} of {len(results)} compiles clean ({took:.1f} s; logs in {cache_dir()})")
    return 1 if args.strict and bad else 0


if __name__ == "__main__":
    sys.exit(main())
