"""A ``PlaneStore`` whose appends run the pack kernel: the layer keeps calling ``store.append``."""

from __future__ import annotations

import torch

from kernels_cupy.ops import append
from kvquant.formats.planes import PlaneStore


class KernelPlaneStore(PlaneStore):
    """``PlaneStore`` with ``append`` done by ``pack_kv`` on the GPU (same tensors, same layout).

    Only layers append to it, after ``to_fp16_checked``: the values are checked there (on CUDA without a
    host sync, the verdict read at the next step), so the pack runs without ``check_storable``'s two syncs
    a layer, which would keep the host from running ahead of the device."""

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        append(self, k, v, checked=True)
