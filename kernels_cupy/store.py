"""A ``PlaneStore`` whose appends run the pack kernel: the layer keeps calling ``store.append``."""

from __future__ import annotations

import torch

from kernels_cupy.ops import append
from kvquant.formats.planes import PlaneStore


class KernelPlaneStore(PlaneStore):
    """``PlaneStore`` with ``append`` done by ``pack_kv`` on the GPU (same tensors, same layout)."""

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        append(self, k, v)
