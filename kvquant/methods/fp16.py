"""fp16: the baseline every method is measured against — K/V stored and read as IEEE half.

The store (``kvquant.formats.fp16.Fp16State``) appends each step's tokens in place into a buffer grown
a block at a time, so no decode step copies the history. Reads never re-expand the history into a
fresh fp32 tensor every step: a kernel backend reads the fp16 tensors as they are; the torch reference
copies the history into one fp32 working buffer per cache (``ReadBuffer``), reused by every layer and step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvquant.backends import TORCH, Backend, check_backend
from kvquant.cache import CropError, KVCache, KVGeometry, KVLayer, to_fp16_checked
from kvquant.formats.fp16 import Fp16State, TruncationRule, read
from kvquant.methods.base import KVMethod, register_method


class ReadBuffer:
    """One working buffer a cache's layers read K/V into, grown when a longer history needs it.

    Layers run one after another and attention consumes what a layer returns before the next
    layer's update, so one buffer serves them all: a copy into kept memory instead of a new
    allocation (page-faulted afresh above the allocator's mmap threshold) per layer and step.
    """

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def read(self, keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        nk, nv = keys.numel(), values.numel()
        buf = self.buffer
        if buf is None or buf.numel() < nk + nv or buf.dtype != dtype or buf.device != keys.device:
            buf = self.buffer = torch.empty(int((nk + nv) * 1.25) + 1024, dtype=dtype, device=keys.device)
        out_k, out_v = buf[:nk].view(keys.shape), buf[nk : nk + nv].view(values.shape)
        return out_k.copy_(keys), out_v.copy_(values)


class Fp16Layer(KVLayer):
    """A dynamic layer that stores K/V in float16 whatever the compute dtype (``kvquant.formats.fp16``).

    On a CPU the model runs in fp32; storing fp16 keeps the baseline's 16 bits real there too.
    ``window`` (a sliding-window layer's ``sliding_window``): between steps the layer holds only the
    newest ``window − 1`` tokens, as transformers' ``DynamicSlidingWindowLayer`` does, and reports the
    same mask sizes, so masks stay right and the bytes measured are the window's. ``rule`` (a
    ``TruncationRule``, or None for 16 bits) says how every element is read.
    """

    def __init__(
        self,
        layer_idx: int | None = None,
        backend: Backend = TORCH,
        buffer: ReadBuffer | None = None,
        window: int | None = None,
        block: int = 256,
        rule: TruncationRule | None = None,
    ):
        super().__init__(layer_idx, window, backend, rule)
        self.buffer = buffer or ReadBuffer()
        self.state = Fp16State(window, block)

    @property
    def keep_bits(self) -> int:
        return 16 if self.rule is None else self.rule.keep_bits

    def reserved_bytes(self) -> int:
        """Memory the store holds including growth slack; ``bits_stored`` counts only the held tokens."""
        return self.state.reserved_bytes()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        k = to_fp16_checked(key_states, self.layer_idx, "key", self.finite)
        v = to_fp16_checked(value_states, self.layer_idx, "value", self.finite)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self.state.append(k, v)
        self.keys, self.values = self.state.keys, self.state.values
        self.seen += k.shape[-2]
        self.count_read({self.keep_bits: keys.numel()}, {self.keep_bits: values.numel()})
        if self.reads_in_attention(self.state):
            return self.expect_attention(tuple(keys.shape), key_states.dtype, keys.device)
        self.state.step = None  # read here: no view of a replaced buffer is kept
        if self.keep_bits == 16 and key_states.dtype != torch.float16:  # one reused fp32 buffer, no allocation
            return self.buffer.read(keys, values, key_states.dtype)
        return read(keys, values, self.rule, key_states.dtype)

    def map_tensors(self, fn) -> None:
        self.state.map_tensors(fn)
        self.keys, self.values = self.state.keys, self.state.values

    def forget_newest(self, n: int) -> None:
        """A sliding layer can forget only until its window has filled (older tokens are gone by then).
        Later steps write over the forgotten tokens in place, so a view of them taken earlier changes."""
        if self.window is not None and self.seen >= self.window:
            raise CropError(
                f"layer {self.layer_idx}: a sliding-window layer keeps only its window and cannot be cropped "
                "once the window has filled; use a fresh cache"
            )
        self.state.keep(self.state.n_tokens - n)  # nothing has left a sliding window yet: all are held
        self.keys, self.values = self.state.keys, self.state.values

    def reset(self) -> None:
        super().reset()
        self.seen, self.keys, self.values = 0, None, None
        self.state = Fp16State(self.state.window, self.state.block)


@dataclass(frozen=True)
class Fp16Method(KVMethod):
    """Plain half-precision cache: 16 bits stored, 16 read. ``backend``: ``auto`` (the device's kernels
    where built, else the torch reference), ``torch`` or a kernel backend by name (``kvquant.backends``)."""

    backend: str = "auto"
    format: ClassVar[str] = "fp16"

    def __post_init__(self) -> None:
        check_backend(self.backend)

    def new_layer(
        self, layer_idx: int, geometry: KVGeometry | None, backend: Backend = TORCH, buffer: ReadBuffer | None = None
    ) -> Fp16Layer:
        """The store for one layer (a full-attention one when no ``geometry`` says otherwise)."""
        return Fp16Layer(
            layer_idx, backend, buffer, geometry.window(layer_idx) if geometry else None, rule=self.rule(geometry)
        )

    def new_cache(self, model: Any) -> KVCache:
        """Layers on the backend ``backend`` resolves to for this model (``KVMethod.resolve``)."""
        geometry, buffer = KVGeometry.of(model.config), ReadBuffer()
        backend = self.resolve(model, geometry)
        cache = KVCache([self.new_layer(i, geometry, backend, buffer) for i in range(geometry.n_layers)])
        cache.backend = backend.name
        return cache

    def analytic_bits(self, geometry: KVGeometry | None = None) -> float:
        return 16.0


register_method("fp16", Fp16Method)
