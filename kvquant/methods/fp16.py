"""fp16: the baseline every method is measured against — K/V stored and read as IEEE half.

The store appends each step's tokens in place into a buffer grown a block at a time
(``Fp16Layer``), so no decode step copies the history. Reads never re-expand the history into a
fresh fp32 tensor every step: with ``backend=cpu`` the C++ kernel reads the fp16 tensors as they
are; with ``torch`` the history is copied into one fp32 working buffer per cache (``ReadBuffer``),
reused by every layer and step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvquant.attention import resolve_kernels, tagged_placeholder
from kvquant.backends import check_backend, get_backend
from kvquant.cache import CropError, KVCache, KVGeometry, KVLayer, nbytes, to_fp16_checked
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
    """A dynamic layer that stores K/V in float16 whatever the compute dtype.

    On a CPU the model runs in fp32; storing fp16 keeps the baseline's 16 bits real there too.
    ``window`` (a sliding-window layer's ``sliding_window``): between steps the layer holds only the
    newest ``window − 1`` tokens, as transformers' ``DynamicSlidingWindowLayer`` does, and reports
    the same mask sizes, so masks stay right and the bytes measured are the window's.

    K and V live in one buffer each, ``[B, H, capacity, D]``: a step writes its tokens after the held
    ones and hands attention the view ``[..., start:end, :]``, so decoding never copies the history
    (``torch.cat`` did, every step). A buffer too small for a step is replaced by one of
    ``capacity(need)`` tokens, the held ones moved to its front. A fixed block rather than doubling:
    a move copies the history once per ``block`` (256) appended tokens, ≤ 1/256 of what attention
    reads meanwhile, while the slack (``reserved_bytes``) stays under two blocks instead of up to the
    whole history, so measured memory stays close to the bytes stored. A sliding layer keeps its
    window in token order (the kernels and the torch path read one run of tokens): the start
    advances, and when the end reaches the capacity the window is compacted to the front of a new
    buffer, once per ``block`` decode steps (``block`` at most the window). The kernel takes the
    view as it is (any batch/head/token strides, ``D`` contiguous). ``keys``/``values`` are views of
    what is held, so ``stored_k``/``stored_v`` count the held tokens only: ``bits_stored`` stays 16.
    """

    def __init__(
        self,
        layer_idx: int | None = None,
        backend: str = "torch",
        buffer: ReadBuffer | None = None,
        window: int | None = None,
        block: int = 256,
    ):
        super().__init__(layer_idx, window)
        self.backend, self.buffer = backend, buffer or ReadBuffer()
        self.block = block if window is None else max(1, min(block, window))  # a window's slack ≤ itself
        self._attend_kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self._store: tuple[torch.Tensor, torch.Tensor] | None = None  # K and V buffers [B, H, capacity, D]
        self._start = self._end = 0  # the held tokens are [start, end) of the buffers

    def capacity(self, need: int) -> int:
        """Tokens a new buffer for ``need`` gets: ``need + block − 1`` rounded up to the block, so
        decoding moves once per ``block`` tokens and the slack stays under two blocks; a sliding
        layer's never fewer than its window needs (``window − 1`` held plus one), so decoding never
        shrinks it."""
        if self.window is not None:
            need = max(need, self.window)
        return -(-(need + self.block - 1) // self.block) * self.block

    def reserved_bytes(self) -> int:
        """Memory the store holds including growth slack (and a sliding layer's tokens already
        out of its window, not yet overwritten); ``bits_stored`` counts only the held tokens."""
        return nbytes(self._store or ())

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        k = to_fp16_checked(key_states, self.layer_idx, "key")
        v = to_fp16_checked(value_states, self.layer_idx, "value")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end, n = self._start, self._end, k.shape[-2]
        if self._store is None or end + n > self._store[0].shape[-2]:
            self._move(self.capacity(end - start + n), like=(k, v))
            start, end = self._start, self._end
        kbuf, vbuf = self._store
        kbuf[..., end : end + n, :].copy_(k)
        vbuf[..., end : end + n, :].copy_(v)
        keys, values = kbuf[..., start : end + n, :], vbuf[..., start : end + n, :]
        self.seen += n
        self._end = end + n
        if self.window is not None:
            self._start = max(start, self._end - self.window + 1)
            if kbuf.shape[-2] > self.capacity(0) + self.block:  # a chunk > block grew it: back to size
                self._move(self.capacity(0))
        self._hold()
        return self.read(key_states.dtype, keys, values)

    def _move(self, capacity: int, like: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Replace the buffers by ones of ``capacity`` tokens (shaped as ``like`` when there are none)
        with the held tokens at the front. Old views handed out stay valid: the old buffer is not written."""
        old = self._store or like
        held = self._end - self._start
        new = tuple(t.new_empty((*t.shape[:-2], capacity, t.shape[-1]), dtype=torch.float16) for t in old)
        if self._store is not None:
            for dst, src in zip(new, self._store, strict=True):
                dst[..., :held, :].copy_(src[..., self._start : self._end, :])
        self._store, self._start, self._end = new, 0, held

    def _hold(self) -> None:
        """``keys``/``values``: the views of the held tokens."""
        kbuf, vbuf = self._store
        self.keys, self.values = kbuf[..., self._start : self._end, :], vbuf[..., self._start : self._end, :]

    def map_tensors(self, fn) -> None:
        """``fn`` of the whole buffers (beam reorder, batch selection, offload), slack included, so
        the capacity and the held range survive and the next step still appends in place."""
        if self._store is not None:
            self._store = (fn(self._store[0]), fn(self._store[1]))
            self._hold()

    def read(
        self, dtype: torch.dtype, keys: torch.Tensor | None = None, values: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What attention gets: ``keys``/``values`` (this step's history, fp16; by default what is held)
        at 16 bits (for a kernel: a placeholder that sends attention to ``attend``)."""
        keys, values = (self.keys, self.values) if keys is None else (keys, values)
        self.count_read({16: keys.numel()}, {16: values.numel()})
        if self.backend != "torch":
            self._attend_kv = (keys, values)
            return (
                tagged_placeholder(self, tuple(keys.shape), dtype, keys.device),
                tagged_placeholder(self, tuple(values.shape), dtype, values.device),
            )
        if dtype == torch.float16:
            return keys, values
        return self.buffer.read(keys, values, dtype)

    def attend(self, module, query: torch.Tensor, attention_mask, scaling: float | None = None, **kwargs):
        """Attention over this step's fp16 history by the backend's kernel (called by ``kvquant.attention``)."""
        keys, values = self._attend_kv
        self._attend_kv = None
        n = keys.shape[-2]
        mask = attention_mask[..., :n] if attention_mask is not None else None
        causal = mask is None and query.shape[2] > 1
        out = get_backend(self.backend).ops.attend_fp16(query, keys, values, mask, scaling, causal)
        return out.transpose(1, 2).contiguous(), None

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the newest tokens (assisted decoding): ``-n`` removes ``n``; a positive value is the
        length to keep (the legacy ``crop(max_length)``). A sliding layer can do so until its window
        has filled (older tokens are gone by then). Later steps write over the forgotten tokens in
        place, so a view of them taken earlier changes."""
        if not self.is_initialized:
            return
        keep = tokens_to_remove if tokens_to_remove > 0 else self.seen + tokens_to_remove
        if keep >= self.seen:
            return
        if self.window is not None and self.seen >= self.window:
            raise CropError(
                f"layer {self.layer_idx}: a sliding-window layer keeps only its window and cannot be cropped "
                "once the window has filled; use a fresh cache"
            )
        keep = max(0, keep)
        self._end = self._start + keep  # nothing has left a sliding window yet: start is 0
        self._hold()
        self.seen = keep

    def reset(self) -> None:
        super().reset()
        self.seen, self._attend_kv, self._store, self._start, self._end = 0, None, None, 0, 0


def softcap_missing(geometry: KVGeometry) -> list[str]:
    """What the fp16 kernel lacks for this model (``resolve_kernels``'s ``missing``): logit soft-capping."""
    if geometry.softcap is None:
        return []
    return [f"attention-logit soft-capping ({geometry.model_type}: {geometry.softcap})"]


@dataclass(frozen=True)
class Fp16Method(KVMethod):
    """Plain half-precision cache: 16 bits stored, 16 read. ``backend``: ``torch`` (reference),
    ``cpu`` (the C++ kernel reading fp16 in place) or ``auto`` (the kernel where it is built)."""

    backend: str = "torch"

    def __post_init__(self) -> None:
        check_backend(self.backend)

    def new_layer(
        self, layer_idx: int, geometry: KVGeometry | None, backend: str = "torch", buffer: ReadBuffer | None = None
    ) -> Fp16Layer:
        """The store for one layer (a full-attention one when no ``geometry`` says otherwise)."""
        return Fp16Layer(layer_idx, backend, buffer, geometry.window(layer_idx) if geometry else None)

    def new_cache(self, model: Any) -> KVCache:
        """Layers on the backend ``backend`` resolves to; the kernel has no logit soft-capping, so a
        soft-capped model (Gemma-2) runs the torch reference (``auto``) or is refused (``cpu``)."""
        geometry, buffer = KVGeometry.of(model.config), ReadBuffer()
        backend = resolve_kernels(model, self.backend, "fp16", softcap_missing(geometry))
        cache = KVCache([self.new_layer(i, geometry, backend, buffer) for i in range(geometry.n_layers)])
        cache.backend = backend
        return cache

    def analytic_bits(self, geometry: KVGeometry | None = None) -> float:
        return 16.0


register_method("fp16", Fp16Method)
