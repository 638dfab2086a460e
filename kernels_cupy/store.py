"""Stores whose appends run a kernel, handed to layers by ``Backend.new_state`` (``backend.STATES``): a
``PlaneStore`` packed by ``pack_kv``, and KIVI's ``CodesState`` whose value store codes the token leaving the
window with ``quantize_values`` (opt-in: ``codes.QUANTIZE_KERNEL``). The layers keep calling the same methods."""

from __future__ import annotations

import numpy as np
import torch

from kernels_cupy import codes
from kernels_cupy.loader import check_device, i32, launch
from kernels_cupy.ops import append
from kvquant.formats.codes import CodesState, QuantStore
from kvquant.formats.planes import PlaneStore
from kvquant.formats.window import CHANNEL_AXIS


class KernelPlaneStore(PlaneStore):
    """``PlaneStore`` with ``append`` done by ``pack_kv`` on the GPU (same tensors, same layout).

    Only layers append to it, after ``to_fp16_checked``: the values are checked there (on CUDA without a
    host sync, the verdict read at the next step), so the pack runs without ``check_storable``'s two syncs
    a layer, which would keep the host from running ahead of the device."""

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        append(self, k, v, checked=True)


class KernelQuantStore(QuantStore):
    """KIVI's value store whose coding of fp16 CUDA tokens is one ``quantize_values`` launch writing into the
    buffers in place (``kvquant.quant.integer.quantize``'s 28 torch operators otherwise), the same codes,
    scales and zeros, where ``codes.QUANTIZE_KERNEL`` is on; else, and for anything else, ``QuantStore.add``."""

    def kernel_takes(self, x: torch.Tensor) -> bool:
        """Whether ``quantize_values`` codes ``x``: switched on, fp16 on CUDA with contiguous channels, values."""
        d = x.shape[-1]
        return (
            codes.QUANTIZE_KERNEL
            and x.is_cuda
            and x.dtype == torch.float16
            and x.stride(-1) == 1
            and self.axis == CHANNEL_AXIS
            and d % self.group_size == 0
            and d <= codes.HEAD_DIM_MAX
        )

    def add(self, x: torch.Tensor, decode: bool) -> None:
        if not self.kernel_takes(x):
            return super().add(x, decode)
        check_device(x)
        self.check_whole_groups()
        b, h, t, d = x.shape
        groups, nbytes = d // self.group_size, (d * self.bits + 7) // 8
        held = [rows.rows for rows in self.rows]
        try:
            row0 = self.rows[0].reserve((b, h, t, nbytes), torch.uint8, x.device)
            for rows in self.rows[1:]:
                if rows.reserve((b, h, t, groups, 1), torch.float16, x.device) != row0:
                    raise RuntimeError("kernels_cupy: a KIVI value store's codes and scales are out of step")
            capacity = self.rows[0].buffer.shape[2]
            if any(rows.buffer.shape[2] != capacity for rows in self.rows[1:]):
                raise RuntimeError("kernels_cupy: a KIVI value store's codes and scales differ in capacity")
            args = (codes.raw(x), *(np.int64(s) for s in x.stride()[:3]), i32(h))
            args += tuple(codes.raw(rows.buffer) for rows in self.rows)
            args += (i32(capacity), i32(row0), i32(d), i32(self.group_size))
            launch(codes.SOURCE, f"quantize_values_b{self.bits}", (t, b * h), 32, args)
        except Exception:
            for rows, n in zip(self.rows, held, strict=True):  # nothing was coded: the rows go back
                rows.rows = n
            raise
        self.grown(x.shape)


class KernelCodesState(CodesState):
    """KIVI's ``CodesState`` with its value store a ``KernelQuantStore`` (the same layout and tensors)."""

    def __init__(self, k, v, bits: int, group_size: int) -> None:
        if type(v.store) is QuantStore and v.store.length == 0:
            v.store = KernelQuantStore(v.store.bits, v.store.axis, v.store.group_size)
        super().__init__(k, v, bits, group_size)
