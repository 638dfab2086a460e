"""truncation: uniform bit removal — AlignedKV's control ("remove 3 bits from every element").

K/V are stored as fp16 (16 bits stored) and every read keeps only the top ``keep_bits`` of each
element, filling the rest with ``1000…`` (``kvquant.bits.truncate``). Unlike AlignedKV it reads
the same width everywhere, prefill included: that is what "uniform" means.

On the C++ kernels the fp16 kernel reads the fp16 store in place and truncates each element in
registers (``keep_bits`` may be any of 6..16, which bit planes of 8/12/16 cannot
give). It loads all 16 stored bits, so it runs at fp16's speed: the bits read that the cache reports
are the method's model of a reader that loads only ``keep_bits``, not the bytes this kernel moves.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvquant.backends import check_backend
from kvquant.cache import KVGeometry
from kvquant.errors import InvalidParameterError
from kvquant.formats.fp16 import TruncationRule
from kvquant.methods.base import register_method
from kvquant.methods.fp16 import Fp16Method


@dataclass(frozen=True)
class TruncationMethod(Fp16Method):
    """fp16 storage (``Fp16Method``'s layers), every element read at ``keep_bits`` (6..16; 13 = the
    paper's control): a ``TruncationRule`` the torch reference applies to what it reads and the fp16
    kernels apply in registers."""

    keep_bits: int = 13

    def __post_init__(self) -> None:
        if not isinstance(self.keep_bits, int) or not 6 <= self.keep_bits <= 16:
            raise InvalidParameterError(
                f"method truncation: keep_bits={self.keep_bits!r} must be an integer in 6..16 "
                "(sign and exponent are kept)"
            )
        check_backend(self.backend)

    def rule(self, geometry: KVGeometry | None = None) -> TruncationRule:
        return TruncationRule(self.keep_bits)


register_method("truncation", TruncationMethod)
