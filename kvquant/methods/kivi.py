"""KIVI (Liu et al., 2024): asymmetric 2/4-bit KV cache — keys per channel, values per token, fp16 window.

Storage, per layer (all of it named by ``stored_k``/``stored_v``, so bytes are measured):

- **Keys** are quantized per channel: a group is ``group_size`` (G) consecutive tokens of one channel.
  The fp16 key window holds at most ``residual`` (R) tokens; when an update makes it longer, its
  oldest *whole blocks of R tokens* leave it (``⌊(w − 1)/R⌋·R`` tokens, SPEC: "keys leave the window
  only in whole blocks of R"). After any update the window holds 1…R keys, so the newest key is
  always fp16. R is a multiple of G, so a block is R/G whole groups, and blocks stay aligned to
  multiples of R from the first token: the codes do not depend on how the sequence was chunked.
- **Values** are quantized per token: a group is G consecutive channels of one token (G must divide
  the head dim). The fp16 value window holds the newest ``min(L, R)`` values; each value that leaves
  it is quantized alone.
- Codes are packed into ``uint8``; scale and zero are fp16, one pair per group
  (``kvquant.quant.integer``). Incoming K/V are rounded to fp16 first (the window's format), so a
  token's codes are the same whether it was quantized at prefill or when it left the window.

Updates are incremental: an update quantizes only what leaves the window and appends the codes to
what is held; nothing already quantized is ever re-quantized. ``update`` returns the dequantized
history followed by the window, in the input dtype, so the model's stock attention runs unchanged.

Reads: each update the attention reads everything the layer holds — the window at 16 bits and, for
the quantized part, its codes plus every group's scale and zero (``b + 32/G`` bits per element for
KIVI). That measured total is recorded exactly; because ``count_read`` takes whole-bit widths, the
quantized elements are split between ``⌊w⌋`` and ``⌈w⌉`` bits so that the total (and the mean) is
exact — the per-width histogram of the quantized part is a two-point rendering of one mean width.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from kvquant.cache import KVLayer, whole_bit_widths
from kvquant.errors import InvalidParameterError, KvquantError
from kvquant.methods.base import KVMethod, register_method
from kvquant.quant.integer import QuantizedTensor, cat, dequantize, quantize

TOKEN_AXIS = 2
CHANNEL_AXIS = 3


class NonFiniteKVError(KvquantError, ValueError):
    """NaN or inf reached a quantized cache: min-max quantization of such a group is meaningless."""


def head_dim_of(model_config: Any) -> int:
    """The attention head dimension of a (text) model config."""
    head_dim = getattr(model_config, "head_dim", None)
    return int(head_dim) if head_dim else model_config.hidden_size // model_config.num_attention_heads


def check_window_params(method: str, bits: int, allowed: tuple[int, ...], group_size: int, residual: int) -> None:
    """One-line errors for the parameters KIVI and GEAR share."""
    if bits not in allowed:
        raise InvalidParameterError(f"{method}: bits must be one of {', '.join(map(str, allowed))}, got {bits}")
    if group_size < 1:
        raise InvalidParameterError(f"{method}: group_size must be >= 1, got {group_size}")
    if residual < group_size or residual % group_size:
        raise InvalidParameterError(
            f"{method}: residual ({residual}) must be a positive multiple of group_size ({group_size}), "
            "so keys leave the fp16 window in whole groups"
        )


def check_head_dim(method: str, group_size: int, head_dim: int) -> None:
    if head_dim % group_size:
        raise InvalidParameterError(
            f"{method}: group_size {group_size} does not divide the model's head_dim {head_dim} "
            f"(values are grouped per token within a head); set method.group_size to a divisor of {head_dim}"
        )


def check_finite(method: str, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """One reduction and one sync per update: a NaN or inf anywhere makes the fp32 sum non-finite."""
    if bool(torch.isfinite(keys.sum(dtype=torch.float32) + values.sum(dtype=torch.float32))):
        return
    name = "keys" if not bool(torch.isfinite(keys).all()) else "values"
    raise NonFiniteKVError(f"{method}: layer {layer_idx} received non-finite {name} (NaN or inf)")


class Store(Protocol):
    """The compressed history of one of K or V; tokens arrive in order and are never re-compressed."""

    length: int

    def add(self, x: torch.Tensor, decode: bool) -> None: ...

    def read_into(self, out: torch.Tensor) -> None: ...

    def tensors(self) -> list[torch.Tensor]: ...

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None: ...


class QuantStore:
    """KIVI's compressed part: one growing ``QuantizedTensor`` (codes, scales, zeros)."""

    def __init__(self, bits: int, axis: int, group_size: int):
        self.bits, self.axis, self.group_size = bits, axis, group_size
        self.q: QuantizedTensor | None = None
        self.length = 0

    def add(self, x: torch.Tensor, decode: bool) -> None:
        new = quantize(x, self.bits, self.axis, self.group_size)
        self.q = new if self.q is None else cat([self.q, new], dim=TOKEN_AXIS)
        self.length += x.shape[TOKEN_AXIS]

    def read_into(self, out: torch.Tensor) -> None:
        if self.q is not None:
            dequantize(self.q, out=out)

    def tensors(self) -> list[torch.Tensor]:
        return self.q.tensors() if self.q is not None else []

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.q is not None:
            self.q = self.q.map(fn)


class Stream:
    """One of K or V: an fp16 window of the newest tokens in front of a compressed ``Store``.

    ``block`` = None: tokens leave the window one at a time (the window keeps the newest
    ``residual``); otherwise they leave in whole blocks of ``block`` once the window exceeds
    ``residual`` (the window keeps 1…``residual`` tokens).
    """

    def __init__(self, store: Store, residual: int, block: int | None):
        self.store, self.residual, self.block = store, residual, block
        self.window: torch.Tensor | None = None

    def leaving(self, w: int) -> int:
        if w <= self.residual:
            return 0
        if self.block is None:
            return w - self.residual
        return (w - 1) // self.block * self.block

    def extend(self, x: torch.Tensor, decode: bool) -> None:
        if self.window is None:  # a copy: the window must own its storage, never alias the caller's tensor
            self.window = x.to(torch.float16, copy=True)
        else:
            self.window = torch.cat([self.window, x.to(torch.float16)], dim=TOKEN_AXIS)
        n = self.leaving(self.window.shape[TOKEN_AXIS])
        if n:
            self.store.add(self.window[:, :, :n], decode)
            self.window = self.window[:, :, n:].clone()

    @property
    def length(self) -> int:
        w = 0 if self.window is None else self.window.shape[TOKEN_AXIS]
        return self.store.length + w

    def read(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole history, dequantized, then the window, as one ``[B, H, L, D]`` tensor."""
        b, h, w, d = self.window.shape
        n = self.store.length
        out = torch.empty(b, h, n + w, d, dtype=dtype, device=self.window.device)
        if n:
            self.store.read_into(out[:, :, :n])
        out[:, :, n:].copy_(self.window)
        return out

    def tensors(self) -> list[torch.Tensor]:
        return [self.window, *self.store.tensors()] if self.window is not None else []

    def read_counts(self) -> dict[int, int]:
        """What one attention pass over this stream reads: all compressed bytes, the window at 16 bits."""
        if self.window is None:
            return {}
        b, h, w, d = self.window.shape
        compressed = self.store.tensors()
        bits = 8 * sum(t.numel() * t.element_size() for t in compressed)
        return whole_bit_widths(b * h * self.store.length * d, bits, b * h * w * d)

    def numel(self) -> int:
        if self.window is None:
            return 0
        b, h, _, d = self.window.shape
        return b * h * self.length * d

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.window is not None:
            self.window = fn(self.window)
            self.store.map(fn)


class WindowedLayer(KVLayer):
    """Shared plumbing of KIVI and GEAR layers: two ``Stream``s, checks, measured bytes and reads."""

    is_croppable = False
    method = "kivi"

    def __init__(self, layer_idx: int, group_size: int):
        super().__init__()
        self.layer_idx, self.group_size = layer_idx, group_size
        self.k_stream, self.v_stream = self.new_streams()

    def new_streams(self) -> tuple[Stream, Stream]:
        """A fresh (keys, values) pair of streams."""
        raise NotImplementedError

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new tokens, compress what leaves the windows, and return the whole history
        (decompressed, then the windows) in the input dtype for the model's stock attention."""
        check_finite(self.method, self.layer_idx, key_states, value_states)
        if not self.is_initialized:
            check_head_dim(self.method, self.group_size, key_states.shape[-1])
            self.lazy_initialization(key_states, value_states)
        decode = key_states.shape[TOKEN_AXIS] == 1
        self.k_stream.extend(key_states, decode)
        self.v_stream.extend(value_states, decode)
        self.keys, self.values = self.k_stream.window, self.v_stream.window
        out_k, out_v = self.k_stream.read(key_states.dtype), self.v_stream.read(value_states.dtype)
        self.count_read(self.k_stream.read_counts(), self.v_stream.read_counts(), position=self.get_seq_length())
        return out_k, out_v

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.k_stream.length if self.is_initialized else 0

    def logical_elements(self) -> tuple[int, int]:
        return self.k_stream.numel(), self.v_stream.numel()

    def stored_k(self) -> list[torch.Tensor | None]:
        return self.k_stream.tensors()

    def stored_v(self) -> list[torch.Tensor | None]:
        return self.v_stream.tensors()

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.k_stream.map(fn)
        self.v_stream.map(fn)
        self.keys, self.values = self.k_stream.window, self.v_stream.window

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.get_seq_length():
            self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length():
            self._map(lambda t: t[indices, ...])

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length():
            self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def offload(self) -> None:
        if self.is_initialized:
            self._map(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.is_initialized:
            self._map(lambda t: t.to(self.device, non_blocking=True))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError(f"{self.method}: a quantized cache cannot be cropped (codes are never rewritten)")

    def reset(self) -> None:
        super().reset()
        self.k_stream, self.v_stream = self.new_streams()


class KiviLayer(WindowedLayer):
    """One decoder layer's KIVI store (see the module docstring for the layout and flush rules)."""

    method = "kivi"

    def __init__(self, layer_idx: int, bits: int = 2, group_size: int = 32, residual: int = 128):
        check_window_params(self.method, bits, KiviMethod.allowed_bits, group_size, residual)
        self.bits, self.residual = bits, residual
        super().__init__(layer_idx, group_size)

    def new_streams(self) -> tuple[Stream, Stream]:
        keys = Stream(QuantStore(self.bits, TOKEN_AXIS, self.group_size), self.residual, block=self.residual)
        values = Stream(QuantStore(self.bits, CHANNEL_AXIS, self.group_size), self.residual, block=None)
        return keys, values


def kivi_fp16_tokens(context: int, residual: int) -> tuple[int, int]:
    """How many keys and values of a ``context``-token sequence sit in the fp16 windows."""
    keys = context if context <= residual else (context - 1) % residual + 1
    return keys, min(context, residual)


class KiviMethod(KVMethod):
    """KIVI: ``bits``-bit keys per channel and values per token in groups of ``group_size``; the newest
    ``residual`` tokens in fp16."""

    allowed_bits = (2, 4, 8)

    def __init__(self, bits: int = 2, group_size: int = 32, residual: int = 128):
        check_window_params(self.name or "kivi", bits, self.allowed_bits, group_size, residual)
        self.bits, self.group_size, self.residual = bits, group_size, residual

    def new_layer(self, layer_idx: int, model_config: Any) -> KiviLayer:
        check_head_dim(self.name or "kivi", self.group_size, head_dim_of(model_config))
        layer = KiviLayer(layer_idx, self.bits, self.group_size, self.residual)
        layer.method = self.name or "kivi"
        return layer

    def analytic_bits(self, context: int | None = None) -> float:
        """Bits per stored element: asymptotically (``context=None``) ``bits + 32/group_size`` (codes plus
        an fp16 scale and zero per group, for K and V alike); at a given ``context`` the fp16 windows
        (``kivi_fp16_tokens``) are counted too. Any head dim that ``group_size`` divides gives the same
        figure, and it holds whatever the chunking, since the flush rule depends on the length alone."""
        quantized = self.bits + 32 / self.group_size
        if context is None:
            return quantized
        if context < 1:
            raise InvalidParameterError(f"context must be >= 1, got {context}")
        total = 0.0
        for fp16 in kivi_fp16_tokens(context, self.residual):
            total += fp16 * 16 + (context - fp16) * quantized
        return total / (2 * context)


register_method("kivi", KiviMethod)
register_method("kivi2", KiviMethod, bits=2)
register_method("kivi4", KiviMethod, bits=4)
