"""``kvquant.quant.device.on_device``: long-lived tensors copied to the device that reads them once, not every step
(a blocking copy to a GPU makes the host wait for every kernel queued before it). The ``meta`` device stands in
for a GPU: a copy to it is dispatched as one would be."""

import gc

import torch

from kvquant.analysis.timing import OpCounter
from kvquant.quant import device


def test_a_tensor_is_copied_to_a_device_once_and_dropped_with_it():
    table = torch.randn(8)
    assert device.on_device(table, "cpu") is table and device.on_device(table, "cpu", torch.float32) is table
    with OpCounter() as first:
        placed = device.on_device(table, "meta")
    with OpCounter() as again:
        assert device.on_device(table, torch.device("meta")) is placed
    assert placed.device.type == "meta" and placed.dtype == torch.float32
    assert first.counts["_to_copy"] == 1 and again.total == 0
    half = device.on_device(table, "meta", torch.float16)
    assert half.dtype == torch.float16 and half is not placed
    held = len(device._COPIES)
    del table, placed, half
    gc.collect()
    assert len(device._COPIES) == held - 2


def test_a_predictor_and_the_plane_tables_are_placed_once():
    """AQUA-KV's predictor weights (loaded on the CPU) and the plane reads' mask/fill tables: a step on another
    device copies nothing after the first (12 MB of weights a layer and step on Llama-3.1-8B before)."""
    from kvquant.formats.planes import _mask_fill32
    from kvquant.methods.aquakv.predictors import apply_predictor

    pred = (torch.randn(16, 8), torch.randn(8))
    x = torch.empty(2, 3, 16, device="meta")
    apply_predictor(pred, x)
    _mask_fill32(12, "meta")
    with OpCounter() as step:
        out = apply_predictor(pred, x)
        mask, fill = _mask_fill32(12, "meta")
    assert out.shape == (2, 3, 8) and out.device.type == "meta" and mask.device.type == fill.device.type == "meta"
    assert "_to_copy" not in step.counts and step.counts["addmm"] == 1


class CrossDevice(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the copies that cross devices (a tensor's ``.to(device)`` as dispatched)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.overloadpacket.__name__ == "_to_copy" and out.device != args[0].device:
            self.copies.append((args[0].device.type, out.device.type))
        return out


def test_a_higgs_coding_on_another_device_copies_no_table():
    """HIGGS's coding and decoding (AQUA-KV's and HIGGS's caches, every layer and step) read the grid and the
    signs where the codes are, copied there once (two blocking copies a call before)."""
    from kvquant.quant.higgs import Higgs

    quant = Higgs(channels=64, bits=2)
    x = torch.empty(1, 2, 3, 64, device="meta")
    quant.dequantize(quant.quantize(x))
    with CrossDevice() as step:
        out = quant.dequantize(quant.quantize(x))
    assert out.shape == x.shape and out.device.type == "meta" and step.copies == []
