"""Two builds of the C++ kernels (kernels_cpu) in one process: do they give the same outputs, and which is faster?

    python scripts/ab_kernels_cpu.py --base 250e5c0          # a commit's kernels (A) against the working tree's (B)
    python scripts/ab_kernels_cpu.py --base HEAD~3 --shapes "9q/3kv x 64" --contexts 16384 --repeats 15
    python scripts/ab_kernels_cpu.py --base HEAD~1 --cases fp16,kivi2,gear2 --shapes "32q/32kv x 128"

A is ``kernels_cpu/`` as it is at ``--base`` (``git archive``), or as it is in ``--base-dir`` (a folder holding a
``kernels_cpu`` package); B is the working tree's. Each is built into the kernels' cache, whose key hashes the
sources, so a build made before is reused. Both extensions are loaded into this process and the working tree's
Python wrappers call one or the other (``kernels_cpu.loader._module``): the two must share the C++ interface.

For each shape and context, on the inputs of ``bench_kernels_cpu.py --planes``: fused fp16 (``fp16``), AlignedKV's
planes read whole at 8 and 16 bits (``u8``, ``u16``), the paper's step (``st1``), the block rule's (``bk32``) and
AlignedKV+'s with it (``pb8``); with ``--cases``, also the planes read whole at 12 bits (``u12``), the keys at the
paper rule's per-channel widths with the values at 8 bits (``kr8``: mostly the key pass at mixed widths) and KIVI's and
GEAR's stores of ``bench_kernels_cpu.py`` (``kivi2``, ``kivi4``, ``gear2``, ``gear4``: random codes of the same
shape). Columns: ``A ms`` and ``B ms`` (medians, caches flushed before each call as in ``bench_kernels_cpu.py``),
``B/A``, and ``outputs``: ``same`` where every tensor a call returns (attention outputs, widths) is bit for bit
A's, else the largest difference.

Why one process: on a shared machine two runs of one build differ by up to ~10%, more than most changes a kernel
edit makes; A's and B's calls are interleaved, so the machine's drift weighs on both alike and their ratio holds.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (ROOT, HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import bench_kernels_cpu as bench  # noqa: E402

import kernels_cpu  # noqa: E402
from kernels_cpu import loader  # noqa: E402

PLANES = ("fp16", "u8", "u16", "st1", "bk32", "pb8")
CASES = PLANES + ("u12", "kr8", "kivi2", "kivi4", "gear2", "gear4")
# Run in a child whose kernels_cpu is A's: builds it (or finds it built) and prints its .so's path.
BUILD = """
import kernels_cpu.loader as L
ok, why = L.build()
print(L.SOURCE_DIR)
print(L.build_dir() / f"{L.module_name(L.build_key())}.so" if ok else "FAILED " + why)
"""


class AbError(Exception):
    """What went wrong, in one line."""


def base_sources(rev: str, into: Path) -> Path:
    """``kernels_cpu/`` at git revision ``rev``, extracted under ``into``; the folder holding it."""
    done = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", rev, "kernels_cpu"], capture_output=True, check=False
    )
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines() or ["git archive failed"]
        raise AbError(f"cannot read kernels_cpu/ at {rev!r}: {why[0]}")
    safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python >= 3.11.4
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as tar:
        tar.extractall(into, **safe)
    return into


def build_at(folder: Path) -> Path:
    """Build the kernels_cpu package in ``folder`` (in a child process, where it is the one imported)."""
    if not (folder / "kernels_cpu" / "loader.py").is_file():
        raise AbError(f"{folder} holds no kernels_cpu package (kernels_cpu/loader.py)")
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(folder), str(ROOT)])}
    done = subprocess.run(  # from the folder: `-c` puts the working directory first on sys.path
        [sys.executable, "-c", BUILD], cwd=folder, env=env, capture_output=True, text=True, check=False
    )
    lines = done.stdout.strip().splitlines() or [done.stderr.strip() or "no output"]
    if done.returncode != 0 or lines[-1].startswith("FAILED") or not lines[-1].endswith(".so"):
        raise AbError(f"building the kernels in {folder} failed: {lines[-1]}")
    if Path(lines[0]) != folder / "kernels_cpu":
        raise AbError(f"the child imported kernels_cpu from {lines[0]}, not from {folder}")
    return Path(lines[-1])


def load(so: Path) -> ModuleType:
    """A built extension, imported under its own name (each build's name carries its key)."""
    if so == loader.build_dir() / f"{loader.module_name(loader.build_key())}.so":
        return loader.module()  # B's own build: the working tree's kernels are A's too
    return loader._import(so, so.stem)


def cases(hq: int, hkv: int, d: int, length: int, names: tuple[str, ...] = PLANES) -> dict:
    """The calls compared (of CASES), each a function of no arguments returning a tensor or a tuple of them."""
    q, k, v, store = bench.planes_inputs(hq, hkv, d, length)
    fns = {
        "fp16": lambda: kernels_cpu.attend_fp16(q, k, v),
        "u8": lambda: kernels_cpu.attend_planes(q, store, k_widths=8, v_widths=8),
        "u12": lambda: kernels_cpu.attend_planes(q, store, k_widths=12, v_widths=12),
        "u16": lambda: kernels_cpu.attend_planes(q, store, k_widths=16, v_widths=16),
    }
    if {"kr8", "st1"} & set(names):
        wk1, _ = bench.rule_widths(q, store, 1)
        fns["kr8"] = lambda: kernels_cpu.attend_planes(q, store, k_widths=wk1, v_widths=8)
        fns["st1"] = lambda: kernels_cpu.attend_aligned(
            q, store, k_widths=wk1, v8=bench.v8_magnitudes(), v_thresholds=(4, 8), topk=32, v_block=1
        )
    if "bk32" in names:
        _, _, _, kept = bench.planes_inputs(hq, hkv, d, length, value_block=32)
        fns["bk32"] = bench.block_rule_step(q, kept, bench.rule_widths(q, kept, 32, "block")[0], 32)
    if "pb8" in names:
        _, _, _, plus = bench.planes_inputs(hq, hkv, d, length, value_block=8, block_exponents=True)
        fns["pb8"] = bench.block_rule_step(q, plus, bench.rule_widths(q, plus, 8, "block", blockwise=True)[0], 8)
    for name, make, kernel in (("kivi", bench.kivi_store, "attend_kivi"), ("gear", bench.gear_store, "attend_gear")):
        for bits in (2, 4):
            if f"{name}{bits}" in names:
                codes = make(hkv, length, d, bits)
                fns[f"{name}{bits}"] = lambda codes=codes, kernel=kernel: getattr(kernels_cpu, kernel)(q, **codes)
    return {name: fns[name] for name in names}


def on(module: ModuleType, fn):
    """``fn`` with the wrappers calling ``module``."""

    def call():
        loader._module = module
        return fn()

    return call


def tensors(out) -> list[torch.Tensor]:
    return [out] if isinstance(out, torch.Tensor) else [x for x in out if isinstance(x, torch.Tensor)]


def difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> str:
    """``same`` where every tensor's bytes are the other's (a NaN where the same NaN), else the largest absolute
    difference (``nan`` where one side has a NaN the other lacks)."""
    pairs = list(zip(a, b, strict=True)) if len(a) == len(b) else None
    if pairs is None or any(x.shape != y.shape or x.dtype != y.dtype for x, y in pairs):
        return "shapes or dtypes differ"
    if all(torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)) for x, y in pairs):
        return "same"
    return f"max |B-A| {max(float((x.double() - y.double()).abs().max()) for x, y in pairs):.2e}"


def compare(
    a: ModuleType, b: ModuleType, hq: int, hkv: int, d: int, length: int, repeats: int, flush, names: tuple[str, ...]
) -> list:
    """``(case, A ms, B ms, outputs)`` for each case named."""
    fns = cases(hq, hkv, d, length, names)
    outputs = {name: difference(tensors(on(a, fn)()), tensors(on(b, fn)())) for name, fn in fns.items()}
    timed = {f"{name} {tag}": on(m, fn) for name, fn in fns.items() for tag, m in (("A", a), ("B", b))}
    try:
        t = bench.interleaved_ms(timed, repeats, flush)
    finally:
        loader._module = b
    return [(name, t[f"{name} A"], t[f"{name} B"], outputs[name]) for name in fns]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    base = parser.add_mutually_exclusive_group(required=True)
    base.add_argument("--base", help="git revision whose kernels_cpu/ is A")
    base.add_argument("--base-dir", type=Path, help="a folder holding a kernels_cpu package, as A")
    parser.add_argument("--contexts", default="16384")
    parser.add_argument("--shapes", default="9q/3kv x 64", help=f"comma-separated, of: {', '.join(bench.SHAPES)}")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warm", dest="cold", action="store_false", help="do not flush the caches between calls")
    parser.add_argument("--cases", default=",".join(PLANES), help=f"comma-separated, of: {', '.join(CASES)}")
    args = parser.parse_args(argv)
    names = tuple(name.strip() for name in args.cases.split(","))
    if unknown := [name for name in names if name not in CASES]:
        print(f"error: unknown case {unknown[0]!r}; known: {', '.join(CASES)}", file=sys.stderr)
        return 2
    try:
        shapes = [(name.strip(), bench.SHAPES[name.strip()]) for name in args.shapes.split(",")]
    except KeyError as exc:
        print(f"error: unknown shape {exc}; known: {', '.join(bench.SHAPES)}", file=sys.stderr)
        return 2
    ok, why = kernels_cpu.build()
    if not ok:
        print(f"error: the working tree's kernels: {why}", file=sys.stderr)
        return 1
    try:
        with tempfile.TemporaryDirectory() as tmp:
            folder = args.base_dir if args.base_dir is not None else base_sources(args.base, Path(tmp))
            a_so = build_at(folder.resolve())
        a, b = load(a_so), loader.module()
    except AbError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    flush = torch.zeros(bench.FLUSH_BYTES // 4) if args.cold else None
    print(f"# A: {args.base or args.base_dir} ({a_so.parent.name}); B: working tree ({loader.build_key()})")
    print(f"# {args.threads} thread(s); {'cold' if args.cold else 'warm'} caches; medians of {args.repeats} rounds")
    print(f"{'shape':<15} {'ctx':>6} {'case':<5} {'A ms':>8} {'B ms':>8} {'B/A':>6}  outputs")
    for name, (hq, hkv, d) in shapes:
        for length in (int(c) for c in args.contexts.split(",")):
            for case, ta, tb, same in compare(a, b, hq, hkv, d, length, args.repeats, flush, names):
                print(f"{name:<15} {length:>6} {case:<5} {ta:>8.3f} {tb:>8.3f} {tb / ta:>6.3f}  {same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
