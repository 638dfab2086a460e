"""The ``.cu`` sources through nvcc as the suite checks them (sm_80 PTX; an sm_90 cubin with ``ptxas -v``),
each compile's log kept in the user cache under a key of what it depends on.

A GPU machine compiles the sources with NVRTC at first use; this is the offline check that they compile
for both architectures without a warning and that ``ptxas`` gives every kernel its registers without a
spill. One compile of ``codes.cu`` for sm_90 takes minutes of CPU, so ``make setup`` runs them all once
(``python -m kernels_cupy nvcc``) and the tests read the logs; a changed source, header, flag or nvcc gives
another key and is compiled again. ``<cache>`` is ``KVQUANT_CACHE_DIR`` or the user cache of ``kvquant``.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kernels_cupy.loader import HEADER, SOURCE_DIR, SOURCES

ALL_SOURCES = (*SOURCES, "codes.cu", "higgs.cu")
# -ftz=true as CuPy compiles; -Werror all-warnings turns every warning into a failure.
FLAGS = ("-ftz=true", "-Werror", "all-warnings")
TARGETS = {"sm_80": ("-ptx",), "sm_90": ("-cubin", "-Xptxas", "-v")}
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


@dataclass(frozen=True)
class Compiled:
    """One source through nvcc for one architecture: exit code, the compiler's log, the PTX (sm_80)."""

    source: str
    arch: str
    returncode: int
    log: str
    ptx: str

    def warnings(self) -> list[str]:
        """Log lines other than ``ptxas -v``'s per-kernel information."""
        info = re.compile(r"ptxas info|bytes stack frame")
        return [line for line in self.log.splitlines() if line.strip() and not info.search(line)]

    def entries(self) -> list[str]:
        """The kernels ``ptxas -v`` compiled (sm_90), in its order."""
        return re.findall(r"Compiling entry function '(\w+)'", self.log)

    def frames(self) -> list[tuple[int, int, int]]:
        """Per kernel (sm_90): bytes of stack frame, spill stores and spill loads."""
        return [tuple(map(int, f)) for f in FRAME.findall(self.log)]

    def registers(self) -> dict[str, int]:
        """Per kernel (sm_90): the registers ``ptxas`` gave it."""
        regs = re.findall(r"Used (\d+) registers", self.log)
        return dict(zip(self.entries(), map(int, regs), strict=True))


def nvcc_path() -> str | None:
    return shutil.which("nvcc")


def compile_key(source: str, arch: str, nvcc: str) -> str:
    """What the compile's result depends on: the source and header, the command line and nvcc's version."""
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    h = hashlib.sha256()
    for part in (
        (SOURCE_DIR / source).read_text(),
        (SOURCE_DIR / HEADER).read_text(),
        " ".join((arch, *FLAGS, *TARGETS[arch])),
        version,
    ):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:20]


def cache_dir() -> Path:
    """``<cache>/nvcc``, ``<cache>`` as kernels_cpu's build folder has it."""
    from kvquant.models import user_cache_root

    env = os.environ.get("KVQUANT_CACHE_DIR")
    return (Path(env).expanduser() if env else user_cache_root()) / "nvcc"


def compile_source(source: str, arch: str) -> Compiled:
    """``source`` through nvcc for ``arch`` (``TARGETS``), from the cache when this exact compile ran before.
    Raises ``FileNotFoundError`` when nvcc is not on PATH."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise FileNotFoundError("nvcc is not on PATH")
    folder = cache_dir() / f"{Path(source).stem}-{arch}-{compile_key(source, arch, nvcc)}"
    if not (folder / "returncode").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(dir=folder.parent))
        try:
            out = work / ("out.ptx" if arch == "sm_80" else "out.cubin")
            cmd = [nvcc, f"-arch={arch}", *FLAGS, *TARGETS[arch], f"-I{SOURCE_DIR}", str(SOURCE_DIR / source)]
            done = subprocess.run([*cmd, "-o", str(out)], capture_output=True)
            (work / "log.txt").write_bytes(done.stdout + done.stderr)
            (work / "out.ptx").touch()  # sm_80's PTX; none for a cubin, which is not kept
            (work / "out.cubin").unlink(missing_ok=True)
            (work / "returncode").write_text(str(done.returncode))  # last: a folder with it is complete
            os.rename(work, folder)
        except OSError:  # another process finished the same compile first (its folder is this one's result)
            if not (folder / "returncode").is_file():
                raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return _read(folder, source, arch)


def _read(folder: Path, source: str, arch: str) -> Compiled:
    log = (folder / "log.txt").read_bytes().decode(errors="replace")
    ptx = (folder / "out.ptx").read_text(errors="replace")
    return Compiled(source, arch, int((folder / "returncode").read_text()), log, ptx)


def compile_all(workers: int | None = None) -> list[Compiled]:
    """Every source for every architecture, ``workers`` nvcc processes at a time (default: the usable CPUs)."""
    jobs = [(source, arch) for source in ALL_SOURCES for arch in TARGETS]
    workers = workers or len(os.sched_getaffinity(0))
    # codes.cu and higgs.cu for sm_90 take longest: started first, so the short ones fill in around them
    jobs.sort(key=lambda j: (j[0] not in ("codes.cu", "higgs.cu"), j[1] != "sm_90"))
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda job: compile_source(*job), jobs))
