"""truncation: uniform bit removal — AlignedKV's control ("remove 3 bits from every element").

K/V are stored as fp16 (16 bits stored) and every read keeps only the top ``keep_bits`` of each
element, filling the rest with ``1000…`` (``kvquant.bits.truncate``). Unlike AlignedKV it reads
the same width everywhere, prefill included: that is what "uniform" means.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvquant.bits import truncate
from kvquant.cache import KVGeometry
from kvquant.errors import InvalidParameterError
from kvquant.methods.base import KVMethod, register_method
from kvquant.methods.fp16 import Fp16Layer


class TruncationLayer(Fp16Layer):
    """fp16 storage (a sliding layer's window only, as ``Fp16Layer``), every read at ``keep_bits``."""

    def __init__(self, layer_idx: int | None, keep_bits: int, window: int | None = None):
        super().__init__(layer_idx, window=window)
        self.keep_bits = keep_bits

    def read(
        self, dtype: torch.dtype, keys: torch.Tensor | None = None, values: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = (self.keys, self.values) if keys is None else (keys, values)
        self.count_read({self.keep_bits: keys.numel()}, {self.keep_bits: values.numel()})
        return truncate(keys, self.keep_bits).to(dtype), truncate(values, self.keep_bits).to(dtype)


@dataclass(frozen=True)
class TruncationMethod(KVMethod):
    """fp16 storage, every element read at ``keep_bits`` (6..16; 13 = the paper's control)."""

    keep_bits: int = 13

    def __post_init__(self) -> None:
        if not isinstance(self.keep_bits, int) or not 6 <= self.keep_bits <= 16:
            raise InvalidParameterError(
                f"method truncation: keep_bits={self.keep_bits!r} must be an integer in 6..16 "
                "(sign and exponent are kept)"
            )

    def new_layer(self, layer_idx: int, geometry: KVGeometry | None) -> TruncationLayer:
        """The store for one layer (a full-attention one when no ``geometry`` says otherwise)."""
        return TruncationLayer(layer_idx, self.keep_bits, geometry.window(layer_idx) if geometry else None)

    def analytic_bits(self, geometry: KVGeometry | None = None) -> float:
        return 16.0


register_method("truncation", TruncationMethod)
