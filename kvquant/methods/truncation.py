"""truncation: uniform bit removal — AlignedKV's control ("remove 3 bits from every element").

K/V are stored as fp16 (16 bits stored) and every read keeps only the top ``keep_bits`` of each
element, filling the rest with ``1000…`` (``kvquant.bits.truncate``). Unlike AlignedKV it reads
the same width everywhere, prefill included: that is what "uniform" means.

With ``backend=cpu`` the fp16 kernel of ``kernels_cpu`` reads the fp16 store in place and truncates
each element in registers (``keep_bits`` may be any of 6..16, which bit planes of 8/12/16 cannot
give). It loads all 16 stored bits, so it runs at fp16's speed: the bits read that the cache reports
are the method's model of a reader that loads only ``keep_bits``, not the bytes this kernel moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvquant.attention import resolve_kernels, tagged_placeholder
from kvquant.backends import check_backend, get_backend
from kvquant.bits import truncate
from kvquant.cache import KVCache, KVGeometry
from kvquant.errors import InvalidParameterError
from kvquant.methods.base import KVMethod, register_method
from kvquant.methods.fp16 import Fp16Layer, softcap_missing


class TruncationLayer(Fp16Layer):
    """fp16 storage (a sliding layer's window only, as ``Fp16Layer``), every read at ``keep_bits``."""

    def __init__(self, layer_idx: int | None, keep_bits: int, window: int | None = None, backend: str = "torch"):
        super().__init__(layer_idx, backend=backend, window=window)
        self.keep_bits = keep_bits

    def read(
        self, dtype: torch.dtype, keys: torch.Tensor | None = None, values: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = (self.keys, self.values) if keys is None else (keys, values)
        self.count_read({self.keep_bits: keys.numel()}, {self.keep_bits: values.numel()})
        if self.backend != "torch":
            self._attend_kv = (keys, values)
            return (
                tagged_placeholder(self, tuple(keys.shape), dtype, keys.device),
                tagged_placeholder(self, tuple(values.shape), dtype, values.device),
            )
        return truncate(keys, self.keep_bits).to(dtype), truncate(values, self.keep_bits).to(dtype)

    def attend(self, module, query: torch.Tensor, attention_mask, scaling: float | None = None, **kwargs):
        """Attention over this step's fp16 history, truncated in the kernel (called by ``kvquant.attention``)."""
        keys, values = self._attend_kv
        self._attend_kv = None
        mask = attention_mask[..., : keys.shape[-2]] if attention_mask is not None else None
        causal = mask is None and query.shape[2] > 1
        ops = get_backend(self.backend).ops
        out = ops.attend_fp16(query, keys, values, mask, scaling, causal, keep_bits=self.keep_bits)
        return out.transpose(1, 2).contiguous(), None


@dataclass(frozen=True)
class TruncationMethod(KVMethod):
    """fp16 storage, every element read at ``keep_bits`` (6..16; 13 = the paper's control).
    ``backend``: ``torch`` (reference), ``cpu`` (the fp16 kernel truncating in registers) or ``auto``."""

    keep_bits: int = 13
    backend: str = "torch"

    def __post_init__(self) -> None:
        if not isinstance(self.keep_bits, int) or not 6 <= self.keep_bits <= 16:
            raise InvalidParameterError(
                f"method truncation: keep_bits={self.keep_bits!r} must be an integer in 6..16 "
                "(sign and exponent are kept)"
            )
        check_backend(self.backend)

    def new_layer(self, layer_idx: int, geometry: KVGeometry | None, backend: str = "torch") -> TruncationLayer:
        """The store for one layer (a full-attention one when no ``geometry`` says otherwise)."""
        window = geometry.window(layer_idx) if geometry else None
        return TruncationLayer(layer_idx, self.keep_bits, window, backend)

    def new_cache(self, model: Any) -> KVCache:
        """Layers on the backend ``backend`` resolves to (format ``fp16``: the store is fp16); the kernel
        has no logit soft-capping, so a soft-capped model runs torch (``auto``) or is refused (``cpu``)."""
        geometry = KVGeometry.of(model.config)
        backend = resolve_kernels(model, self.backend, "fp16", softcap_missing(geometry))
        cache = KVCache([self.new_layer(i, geometry, backend) for i in range(geometry.n_layers)])
        cache.backend = backend
        return cache

    def analytic_bits(self, geometry: KVGeometry | None = None) -> float:
        return 16.0


register_method("truncation", TruncationMethod)
