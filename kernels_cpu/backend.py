"""Registers the C++ CPU kernels with kvquant's backend seam (imported by ``kvquant.backends`` on demand)."""

from __future__ import annotations

from kernels_cpu.loader import status
from kvquant.backends import Backend, register_backend

FORMATS = frozenset({"fp16", "kivi", "gear", "planes", "higgs", "aquakv"})

register_backend(Backend("cpu", "cpu", FORMATS, status, "kernels_cpu.ops"))
