"""CUDA kernels for AlignedKV's plane layout, KIVI/GEAR codes and HIGGS codes, compiled at first use
with CuPy ``RawModule``.

Importing this package needs only torch and numpy; cupy is imported when a kernel is first
launched. ``kernels_cupy.backend`` registers the package with ``kvquant.backends`` (which resolves
``method.backend``) and implements its ``attend`` protocol; the kernels are in ``kernels_cupy.ops``
(``append``, ``qk``, ``value_exponents``, ``sv``, ``aligned_attention``), ``KernelPlaneStore`` is the
plane store whose appends run the pack kernel, and their oracle is ``kernels_cupy.reference``;
``kernels_cupy.codes`` and ``kernels_cupy.higgs`` attend over the other formats' codes,
``kernels_cupy.aquakv`` over AQUA-KV's decoded workspace.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from kernels_cupy.loader import SOURCES, cupy_status

__all__ = [
    "SOURCES",
    "KernelPlaneStore",
    "aligned_attention",
    "append",
    "cupy_status",
    "qk",
    "sv",
]

_LAZY = {
    "aligned_attention": "kernels_cupy.ops",
    "append": "kernels_cupy.ops",
    "qk": "kernels_cupy.ops",
    "softmax_scores": "kernels_cupy.ops",
    "sv": "kernels_cupy.ops",
    "value_exponents": "kernels_cupy.ops",
    "KernelPlaneStore": "kernels_cupy.store",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kernels_cupy' has no attribute {name!r}")
