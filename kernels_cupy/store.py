"""A ``PlaneStore`` whose appends run the pack kernel: the layer keeps calling ``store.append``."""

from __future__ import annotations

import torch

from kernels_cupy.ops import append
from kvquant.alignment import PlaneStore


class KernelPlaneStore(PlaneStore):
    """``PlaneStore`` with ``append`` done by ``pack_kv`` on the GPU (same tensors, same layout)."""

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        append(self, k, v)


def plane_store(backend: str | None, block_exponents: bool) -> PlaneStore:
    """The store for a layer: ``KernelPlaneStore`` when the resolved backend is ``cupy``, else ``PlaneStore``."""
    cls = KernelPlaneStore if backend == "cupy" else PlaneStore
    return cls(block_exponents=block_exponents)
