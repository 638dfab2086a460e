"""Compile the ``.cu`` sources with CuPy ``RawModule`` and launch them on torch tensors in place.

Needs only torch, numpy and cupy (cupy is imported on first use, so this module imports without
it). Tensors are handed to kernels as raw device pointers of torch's own storage, the
``__cuda_array_interface__`` contract without building a wrapper per call, and kernels run on
torch's current stream so they order with the surrounding torch ops.
"""

from __future__ import annotations

import functools
import importlib.util
import shutil
from pathlib import Path

import numpy as np
import torch

SOURCE_DIR = Path(__file__).resolve().parent
SOURCES = ("pack.cu", "qk.cu", "softmax.cu", "sv.cu")
HEADER = "planes.cuh"
NVRTC_OPTIONS = ("-std=c++17",)
CUDA_ATTR_SHARED_OPTIN = 97  # cudaDevAttrMaxSharedMemoryPerBlockOptin


def cupy_status() -> tuple[bool, str]:
    """Whether the kernels can run here, and if not, why (one line)."""
    if importlib.util.find_spec("cupy") is None:
        return False, "cupy is not installed (pip install 'kvquant[gpu]', i.e. cupy-cuda13x)"
    try:
        import cupy
    except Exception as exc:  # a broken CUDA install surfaces as any exception type
        return False, f"cupy does not import: {exc}"
    try:
        available = cupy.cuda.is_available()
    except Exception as exc:
        return False, f"cupy cannot query CUDA: {exc}"
    if not available:
        return False, "cupy finds no CUDA device"
    if not torch.cuda.is_available():
        return False, "torch has no CUDA device (a CPU build of torch?)"
    return True, "ok"


def source_text(name: str) -> str:
    """A ``.cu`` file with ``planes.cuh`` inlined, so CuPy's compile cache keys on the header too."""
    header = (SOURCE_DIR / HEADER).read_text()
    return (SOURCE_DIR / name).read_text().replace(f'#include "{HEADER}"', header)


@functools.cache
def module(name: str):
    """The compiled ``RawModule`` of one source file (once per process; CuPy caches it on disk).

    NVRTC first; if it is missing or refuses the source and ``nvcc`` is on PATH, CuPy's nvcc backend.
    """
    import cupy

    try:
        compiled = cupy.RawModule(code=source_text(name), options=NVRTC_OPTIONS)
        compiled.compile()
        return compiled
    except Exception:
        if shutil.which("nvcc") is None:
            raise
    compiled = cupy.RawModule(code=source_text(name), options=NVRTC_OPTIONS, backend="nvcc")
    compiled.compile()
    return compiled


@functools.cache
def kernel(source: str, name: str):
    return module(source).get_function(name)


def ptr(t: torch.Tensor | None) -> np.uint64:
    """Device pointer of a contiguous CUDA tensor (null for ``None``), without copying."""
    if t is None:
        return np.uint64(0)
    if not t.is_cuda or not t.is_contiguous():
        raise ValueError(f"kernel arguments must be contiguous CUDA tensors, got one on {t.device}")
    return np.uint64(t.data_ptr())


def check_device(t: torch.Tensor) -> None:
    """The kernels launch on the current CUDA device's stream: a tensor on another device (a model spread over
    several GPUs) would be read in the wrong context, so it is refused in one line."""
    if t.is_cuda and t.device.index is not None and t.device.index != torch.cuda.current_device():
        raise ValueError(
            f"the CuPy kernels run on the current CUDA device (cuda:{torch.cuda.current_device()}) and this layer's "
            f"tensors are on {t.device}: use method.backend=torch for a model spread over several GPUs"
        )


def i32(x: int) -> np.int32:
    return np.int32(x)


_LAUNCHES = [0]  # kernels launched by this process (``launch_count``)


def launch_count() -> int:
    """Kernels ``launch`` has launched in this process: per step, beside the torch operators
    (``kvquant.analysis.timing.OpCounter``), what a decode step asks of the GPU."""
    return _LAUNCHES[0]


def launch(source: str, name: str, grid: tuple[int, ...], block: int, args: tuple, shared_mem: int = 0) -> None:
    """Launch ``name`` from ``source`` on torch's current stream of the current device."""
    import cupy

    _LAUNCHES[0] += 1
    fn = kernel(source, name)
    if shared_mem > 48 * 1024 and fn.max_dynamic_shared_size_bytes < shared_mem:
        fn.max_dynamic_shared_size_bytes = shared_mem
    stream = torch.cuda.current_stream()
    with cupy.cuda.Device(stream.device.index), _stream(stream.cuda_stream):
        fn(grid, (block,), args, shared_mem=shared_mem)


@functools.cache
def _stream(handle: int):
    import cupy

    return cupy.cuda.ExternalStream(handle)


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def shared_memory_budget(device_index: int) -> int:
    """Bytes of dynamic shared memory one block may opt into (227 KB on sm_90, 163 KB on sm_80)."""
    optin = getattr(torch.cuda.get_device_properties(device_index), "shared_memory_per_block_optin", 0)
    if optin:
        return int(optin)
    import cupy

    return int(cupy.cuda.runtime.deviceGetAttribute(CUDA_ATTR_SHARED_OPTIN, device_index))
