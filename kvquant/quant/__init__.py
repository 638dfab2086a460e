"""Quantizers shared by the KV methods (pure torch: importable without transformers, Hydra or W&B)."""

from kvquant.quant.integer import BITS, QuantizedTensor, cat, dequantize, levels, pack, quantize, unpack

__all__ = ["BITS", "QuantizedTensor", "cat", "dequantize", "levels", "pack", "quantize", "unpack"]
