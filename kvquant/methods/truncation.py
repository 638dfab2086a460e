"""truncation: uniform bit removal — AlignedKV's control ("remove 3 bits from every element").

K/V are stored as fp16 (16 bits stored) and every read keeps only the top ``keep_bits`` of each
element, filling the rest with ``1000…`` (``kvquant.bits.truncate``). Unlike AlignedKV it reads
the same width everywhere, prefill included: that is what "uniform" means.
"""

from __future__ import annotations

import torch

from kvquant.bits import truncate
from kvquant.errors import InvalidParameterError
from kvquant.methods.base import KVMethod, register_method
from kvquant.methods.fp16 import Fp16Layer


class TruncationLayer(Fp16Layer):
    def __init__(self, layer_idx: int | None, keep_bits: int):
        super().__init__(layer_idx)
        self.keep_bits = keep_bits

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        self.count_read({self.keep_bits: self.keys.numel()}, {self.keep_bits: self.values.numel()})
        return truncate(self.keys, self.keep_bits).to(dtype), truncate(self.values, self.keep_bits).to(dtype)


class TruncationMethod(KVMethod):
    """fp16 storage, every element read at ``keep_bits`` (6..16; 13 = the paper's control)."""

    def __init__(self, keep_bits: int = 13):
        if not isinstance(keep_bits, int) or not 6 <= keep_bits <= 16:
            raise InvalidParameterError(
                f"method truncation: keep_bits={keep_bits!r} must be an integer in 6..16 (sign and exponent are kept)"
            )
        self.keep_bits = keep_bits

    def new_layer(self, layer_idx: int, model_config) -> TruncationLayer:
        return TruncationLayer(layer_idx, self.keep_bits)

    def analytic_bits(self) -> float:
        return 16.0


register_method("truncation", TruncationMethod)
