"""Glue to transformers' Cache: layers that store K/V their own way and count what they hold and read.

A method supplies a ``KVLayer`` subclass; ``KVCache`` is a plain ``transformers.Cache`` of those
layers, so ``model.generate(..., past_key_values=cache)`` and chunked forwards work unchanged.
Bytes are measured from the tensors a layer actually holds, never from a formula.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields

import torch
from transformers.cache_utils import Cache, DynamicLayer


@dataclass
class CacheCounts:
    """Raw totals that add across layers and caches; ``summary()`` turns them into per-element bits."""

    elements_k: int = 0
    elements_v: int = 0
    bytes_k: int = 0
    bytes_v: int = 0
    read_elements_k: int = 0
    read_elements_v: int = 0
    read_bits_k: float = 0.0
    read_bits_v: float = 0.0

    def __add__(self, other: CacheCounts) -> CacheCounts:
        return CacheCounts(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def summary(self) -> dict[str, float]:
        def ratio(a: float, b: float) -> float:
            return float(a) / b if b else float("nan")

        elements = self.elements_k + self.elements_v
        read = self.read_elements_k + self.read_elements_v
        return {
            "bits_stored": ratio(8 * (self.bytes_k + self.bytes_v), elements),
            "bits_stored_k": ratio(8 * self.bytes_k, self.elements_k),
            "bits_stored_v": ratio(8 * self.bytes_v, self.elements_v),
            "bits_read": ratio(self.read_bits_k + self.read_bits_v, read),
            "bits_read_k": ratio(self.read_bits_k, self.read_elements_k),
            "bits_read_v": ratio(self.read_bits_v, self.read_elements_v),
            "bytes": self.bytes_k + self.bytes_v,
            "bytes_fp16": 2 * elements,
            "elements": elements,
        }


def nbytes(tensors: Iterable[torch.Tensor | None]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class KVLayer(DynamicLayer):
    """One layer's store. Subclasses implement ``update`` and name the tensors they hold."""

    def __init__(self) -> None:
        super().__init__()
        self._reads = CacheCounts()

    def stored_k(self) -> list[torch.Tensor | None]:
        """Every tensor that holds key information (codes, scales, windows, metadata)."""
        return [self.keys]

    def stored_v(self) -> list[torch.Tensor | None]:
        return [self.values]

    def logical_elements(self) -> tuple[int, int]:
        """How many K and V scalars the layer represents (batch · heads · tokens · head_dim)."""
        if not self.is_initialized or self.keys is None:
            return 0, 0
        return self.keys.numel(), self.values.numel()

    def count_read(self, elements_k: int, bits_k: float, elements_v: int, bits_v: float) -> None:
        """Record one attention read: ``bits_*`` is the total number of bits loaded."""
        self._reads.read_elements_k += elements_k
        self._reads.read_bits_k += bits_k
        self._reads.read_elements_v += elements_v
        self._reads.read_bits_v += bits_v

    def counts(self) -> CacheCounts:
        ek, ev = self.logical_elements()
        c = CacheCounts(elements_k=ek, elements_v=ev, bytes_k=nbytes(self.stored_k()), bytes_v=nbytes(self.stored_v()))
        return c + self._reads

    def reset(self) -> None:
        super().reset()
        self._reads = CacheCounts()


class KVCache(Cache):
    """A transformers ``Cache`` of ``KVLayer`` objects that can report what it stores and reads."""

    def __init__(self, layers: list[KVLayer]):
        super().__init__(layers=layers)

    def counts(self) -> CacheCounts:
        total = CacheCounts()
        for layer in self.layers:
            total = total + layer.counts()
        return total

    def stats(self) -> dict[str, float]:
        """``bits_stored``/``bits_read`` per element (K, V and both) and ``bytes`` actually held."""
        return self.counts().summary()
