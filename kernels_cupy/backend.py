"""Registers the CuPy kernels with kvquant's backend seam (imported by ``kvquant.backends`` on demand)."""

from __future__ import annotations

from kernels_cupy.loader import cupy_status
from kvquant.backends import Backend, register_backend

register_backend(Backend("cupy", "cuda", frozenset({"planes"}), cupy_status, "kernels_cupy"))
