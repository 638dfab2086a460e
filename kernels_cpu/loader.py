"""Build the C++ kernels once into the user cache, and load them from there without rebuilding.

The build folder is ``<cache>/kernels_cpu/<key>``, ``<cache>`` being ``KVQUANT_CACHE_DIR`` or the
platformdirs user cache of ``kvquant``; ``<key>`` hashes the sources, torch's version, the compiler,
the flags and the CPU, so a shared home folder never hands one machine another's ``-march=native``
binary. Loading only imports the built ``.so``: it needs neither ninja nor a compiler, and never
raises; ``status()`` says in one line why the kernels are unavailable.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import shutil
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import torch

SOURCE_DIR = Path(__file__).resolve().parent
SOURCES = ("attention.cpp", "fp16.cpp", "kivi.cpp", "gear.cpp", "planes.cpp", "higgs.cpp", "aquakv.cpp")
HEADERS = ("simd.h", "bits.h", "kernels.h", "higgs.h")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno")
LDFLAGS = ("-fopenmp",)
BUILD_HINT = "python -m kernels_cpu build"
FAILED = "FAILED"  # one line: why the last build in this folder failed
LOG = "build.log"
META = "build.json"


class Status(NamedTuple):
    available: bool
    reason: str


_lock = threading.Lock()
_module: ModuleType | None = None
_status: Status | None = None


def cache_root() -> Path:
    env = os.environ.get("KVQUANT_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    try:
        import platformdirs
    except ImportError:  # a bare GPU machine: kvquant.models.user_cache_root's folder (platformdirs' on Linux)
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "kvquant"
    return Path(platformdirs.user_cache_dir("kvquant"))


def compiler() -> str:
    """What torch's builder will call: ``CXX`` if set, else ``c++``."""
    return os.environ.get("CXX", "c++")


def cpu_identity() -> str:
    """The CPU's model and feature flags (Linux), else what platform knows: ``-march=native`` depends on it."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(keep))


def build_key() -> str:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode() + b"\0" + (SOURCE_DIR / name).read_bytes() + b"\0")
    for part in (torch.__version__, sys.version, compiler(), " ".join(CFLAGS + LDFLAGS), cpu_identity()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def build_dir() -> Path:
    return cache_root() / "kernels_cpu" / build_key()


def module_name(key: str) -> str:
    return f"kvquant_cpu_kernels_{key}"


def _first_line(text: str) -> str:
    """The compiler's first error line if there is one, else the first line of the message."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return (errors or lines or ["unknown error"])[0][:300]


def _import(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"no loader for {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _load_built() -> Status:
    """Import the built module if there is one; never builds, never raises."""
    global _module
    try:
        key = build_key()
    except Exception as exc:
        return Status(False, f"cannot hash the kernel sources: {exc}")
    folder = cache_root() / "kernels_cpu" / key
    so = folder / f"{module_name(key)}.so"
    if so.is_file():
        try:
            _module = _import(so, module_name(key))
        except Exception as exc:
            return Status(False, f"cannot load {so}: {exc}")
        return Status(True, f"ok: {so}")
    failed = folder / FAILED
    if failed.is_file():
        why = failed.read_text().strip() or "unknown error"
        log = f"log: {folder / LOG}; " if (folder / LOG).is_file() else ""
        return Status(False, f"build failed: {why} ({log}rebuild with `{BUILD_HINT}`)")
    return Status(False, f"not built for this machine, torch and compiler: run `{BUILD_HINT}`")


def status() -> Status:
    """``(available, reason)``: whether the kernels are built and loaded here, and if not, why in one line.

    Looked up once per process (``build`` looks again), so callers may ask on every step.
    """
    global _status
    with _lock:
        if _status is None:
            _status = _load_built()
        return _status


def module() -> ModuleType:
    """The loaded extension, or ``RuntimeError`` with the status line."""
    ok, why = status()
    if not ok or _module is None:
        raise RuntimeError(f"kernels_cpu unavailable: {why}")
    return _module


def build(verbose: bool = False) -> Status:
    """Compile the kernels into the cache (a no-op if already built) and load them.

    A missing compiler, a missing ninja or a compile error is written to ``FAILED`` in the build
    folder (with the full log beside it) and returned as the status; nothing is raised.
    """
    global _status
    with _lock:
        _status = None
    ok, why = status()
    if ok:
        return Status(True, why)
    key = build_key()
    folder = cache_root() / "kernels_cpu" / key
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / FAILED).unlink(missing_ok=True)
    except OSError as exc:
        return Status(False, f"cannot write the build folder {folder}: {exc}")
    reason = _build_in(folder, key, verbose)
    if reason is not None:
        (folder / FAILED).write_text(reason + "\n")
    with _lock:
        _status = None
    return status()


def _build_in(folder: Path, key: str, verbose: bool) -> str | None:
    """Run torch's builder; the one-line reason on failure, else None."""
    from torch.utils import cpp_extension

    cxx = compiler()
    if shutil.which(cxx) is None:
        return f"C++ compiler not found (CXX={cxx})"
    if not cpp_extension.is_ninja_available():
        return "ninja not found (torch.utils.cpp_extension needs it: pip install ninja)"
    start = time.perf_counter()
    try:
        cpp_extension.load(
            name=module_name(key),
            sources=[str(SOURCE_DIR / s) for s in SOURCES],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            extra_include_paths=[str(SOURCE_DIR)],
            build_directory=str(folder),
            verbose=verbose,
        )
    except Exception as exc:
        text = str(exc)
        (folder / LOG).write_text(text)
        return _first_line(text)
    meta = {
        "seconds": round(time.perf_counter() - start, 1),
        "torch": torch.__version__,
        "compiler": cxx,
        "cflags": list(CFLAGS),
        "built": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    (folder / META).write_text(json.dumps(meta, indent=1) + "\n")
    return None


def build_seconds() -> float | None:
    """How long the build in the current folder took, if it recorded it."""
    try:
        return float(json.loads((build_dir() / META).read_text())["seconds"])
    except (OSError, ValueError, KeyError):
        return None
