"""The fp16 window of the newest tokens (and attention sinks) that KIVI, GEAR, HIGGS and AQUA-KV keep
in front of their compressed history, and how a read of it is counted.

Not a method (nothing here registers): the shared plumbing those methods build on.

- ``Window``: one of K or V in fp16 — the first ``sink`` tokens kept for good and a window of the
  newest; ``push`` appends tokens and hands back the oldest ones that leave it (one at a time, or in
  whole blocks), which the method then compresses.
- ``Window.read_widths``: what one attention pass reads — every compressed byte spread over the
  compressed elements as whole-bit widths with the exact total (``whole_bit_widths``), the fp16
  tokens at 16 bits.
- ``Stream`` / ``WindowedLayer``: a window in front of a per-stream compressed ``Store``, K and V
  apart (KIVI, GEAR; AQUA-KV compresses K and V jointly and uses ``Window`` directly).
- ``WindowedMethod``: the parameters KIVI and GEAR share (``bits``, ``group_size``, ``residual``),
  validated once, and the model-dependent default group size.

Default group sizes. ``group_size = None`` means the paper's default (``default_group_size``: 32
for KIVI, 64 for GEAR) adapted to the model: the largest divisor of the head dim that is ≤ the
default and divides ``residual`` (so keys still leave the window in whole groups) — 32 on head
dim 8 becomes 8, GEAR's 64 on head dim 32 becomes 32. What was adapted is recorded in the cache
(``cache.adaptations``, e.g. ``{"group_size": [32, 8]}``), never on the method. An explicit
``group_size`` that does not divide the head dim is a one-line ``InvalidParameterError``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from kvquant.attention import resolve_kernels, stock_attention, tagged_placeholder
from kvquant.backends import check_backend, get_backend
from kvquant.cache import KVCache, KVGeometry, KVLayer, nbytes, whole_bit_widths
from kvquant.errors import InvalidParameterError, KvquantError
from kvquant.methods.base import KVMethod

TOKEN_AXIS = 2
CHANNEL_AXIS = 3
PROMPT_QUERIES = 16  # queries in one forward from which a chunk is a prompt chunk (attend dequantizes once)

__all__ = [
    "CHANNEL_AXIS",
    "TOKEN_AXIS",
    "NonFiniteKVError",
    "Store",
    "Stream",
    "Window",
    "WindowedLayer",
    "WindowedMethod",
    "check_divides",
    "check_finite",
    "whole_bit_widths",
]


class NonFiniteKVError(KvquantError, ValueError):
    """NaN or inf reached a quantized cache: min-max quantization of such a group is meaningless."""


def check_finite(label: str, layer_idx: int | None, keys: torch.Tensor, values: torch.Tensor) -> None:
    """One reduction and one sync per update: a NaN or inf anywhere makes the fp32 sum non-finite."""
    if bool(torch.isfinite(keys.sum(dtype=torch.float32) + values.sum(dtype=torch.float32))):
        return
    name = "keys" if not bool(torch.isfinite(keys).all()) else "values"
    raise NonFiniteKVError(f"{label}: layer {layer_idx} received non-finite {name} (NaN or inf)")


def check_divides(label: str, group_size: int, head_dim: int) -> None:
    """One line when a group size cannot divide the head dim (values are grouped within a head)."""
    if head_dim % group_size:
        raise InvalidParameterError(
            f"method {label}: group_size {group_size} does not divide the model's head_dim {head_dim} "
            f"(values are grouped per token within a head); set method.group_size to a divisor of {head_dim} "
            "or null for the default adapted to the model"
        )


class Window:
    """One of K or V in fp16 (``[B, H, n, D]``): the first ``sink`` tokens for good, then the newest.

    ``block`` None: tokens leave one at a time (the window keeps the newest ``size``); otherwise they
    leave in whole blocks of ``block`` once it holds more than ``size`` (it keeps 1…``size``).
    Held tensors own their storage (never views of the caller's or of a bigger buffer), so bytes
    measured from them are the bytes held.
    """

    def __init__(self, size: int, block: int | None = None, sink: int = 0):
        self.size, self.block, self.sink = size, block, sink
        self.sinks: torch.Tensor | None = None
        self.recent: torch.Tensor | None = None

    def leaving(self, w: int) -> int:
        """How many of ``w`` recent tokens leave the window."""
        if w <= self.size:
            return 0
        if self.block is None:
            return w - self.size
        return (w - 1) // self.block * self.block

    def push(self, x: torch.Tensor) -> torch.Tensor | None:
        """Append ``x`` (as fp16); return the oldest recent tokens that leave (fp16, in order), or None."""
        x = x.to(torch.float16)
        if self.sink:
            have = 0 if self.sinks is None else self.sinks.shape[TOKEN_AXIS]
            take = max(0, min(x.shape[TOKEN_AXIS], self.sink - have))
            if self.sinks is None:
                self.sinks = x[:, :, :take].clone()
            elif take:
                self.sinks = torch.cat([self.sinks, x[:, :, :take]], dim=TOKEN_AXIS)
            x = x[:, :, take:]
        if self.recent is None:
            self.recent = x.clone()
        else:
            self.recent = torch.cat([self.recent, x], dim=TOKEN_AXIS)
        n = self.leaving(self.recent.shape[TOKEN_AXIS])
        if not n:
            return None
        out = self.recent[:, :, :n]
        self.recent = self.recent[:, :, n:].clone()
        return out

    @property
    def n_tokens(self) -> int:
        """Tokens held in fp16 (sinks and window)."""
        return sum(t.shape[TOKEN_AXIS] for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.sinks, self.recent) if t is not None]

    def drop(self, n: int) -> None:
        """Forget the oldest ``n`` recent tokens (a sliding layer's tokens that left its window)."""
        if n and self.recent is not None:
            self.recent = self.recent[:, :, n:].clone()

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace each held tensor by ``fn(tensor)`` (all batch-first)."""
        if self.sinks is not None:
            self.sinks = fn(self.sinks)
        if self.recent is not None:
            self.recent = fn(self.recent)

    def read_widths(self, n_compressed: int, compressed: list[torch.Tensor]) -> dict[int, int]:
        """What one attention pass over this stream reads, per whole-bit width: every byte of
        ``compressed`` (holding ``n_compressed`` tokens) and the fp16 tokens at 16 bits."""
        if self.recent is None:
            return {}
        b, h, _, d = self.recent.shape
        per_token = b * h * d
        return whole_bit_widths(per_token * n_compressed, 8 * nbytes(compressed), per_token * self.n_tokens)


class Store(Protocol):
    """The compressed history of one of K or V; tokens arrive in order and are never re-compressed.

    ``unit``: tokens are added and dropped in multiples of it (a key group spans ``group_size``
    tokens); ``drop(n)`` forgets the oldest whole units among the first ``n`` tokens and says how
    many tokens went.
    """

    length: int
    unit: int

    def add(self, x: torch.Tensor, decode: bool) -> None: ...

    def drop(self, n: int) -> int: ...

    def read_into(self, out: torch.Tensor) -> None: ...

    def tensors(self) -> list[torch.Tensor]: ...

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None: ...


class Stream:
    """One of K or V: an fp16 ``Window`` of the newest ``residual`` tokens in front of a ``Store``.

    On a sliding-window layer the oldest tokens are forgotten (``forget``): ``dropped`` counts them,
    so the store's first token is token ``dropped`` of the sequence.
    """

    def __init__(self, store: Store, residual: int, block: int | None):
        self.store = store
        self.fp16 = Window(residual, block)
        self.dropped = 0

    @property
    def window(self) -> torch.Tensor | None:
        """The fp16 window (``[B, H, w, D]``), None before the first token."""
        return self.fp16.recent

    def extend(self, x: torch.Tensor, decode: bool, keep_from: int | None = None) -> None:
        """Append ``x``; compress what leaves the window. Tokens before ``keep_from`` (which a sliding
        layer forgets after this step) are compressed apart from the rest, so they can go whole."""
        leaving = self.fp16.push(x)
        if leaving is None:
            return
        n = leaving.shape[TOKEN_AXIS]
        cut = 0 if keep_from is None else min(n, max(0, keep_from - self.dropped - self.store.length))
        cut -= cut % self.store.unit
        if 0 < cut < n:
            self.store.add(leaving[:, :, :cut], decode)
            leaving = leaving[:, :, cut:]
        self.store.add(leaving, decode)

    def forget(self, keep_from: int) -> None:
        """Drop tokens before position ``keep_from``: whole store units, then (once the store is
        empty) the oldest window tokens."""
        n = keep_from - self.dropped
        if n <= 0:
            return
        gone = self.store.drop(n)
        if gone < n and self.store.length == 0 and self.window is not None:
            extra = min(n - gone, self.window.shape[TOKEN_AXIS])
            self.fp16.drop(extra)
            gone += extra
        self.dropped += gone

    @property
    def length(self) -> int:
        return self.store.length + self.fp16.n_tokens

    def read(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole history, decompressed, then the window, as one ``[B, H, L, D]`` tensor."""
        b, h, w, d = self.window.shape
        n = self.store.length
        out = torch.empty(b, h, n + w, d, dtype=dtype, device=self.window.device)
        if n:
            self.store.read_into(out[:, :, :n])
        out[:, :, n:].copy_(self.window)
        return out

    def tensors(self) -> list[torch.Tensor]:
        return [*self.fp16.tensors(), *self.store.tensors()]

    def read_counts(self) -> dict[int, int]:
        return self.fp16.read_widths(self.store.length, self.store.tensors())

    def numel(self) -> int:
        if self.window is None:
            return 0
        b, h, _, d = self.window.shape
        return b * h * self.length * d

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.fp16.map(fn)
        self.store.map(fn)


@dataclass(frozen=True)
class WindowedMethod(KVMethod):
    """Parameters KIVI and GEAR share: ``bits``-bit codes in groups of ``group_size``; the newest
    ``residual`` tokens in fp16 (a multiple of the group size). ``group_size`` None: the paper's
    default adapted to the model (module docstring). ``backend``: ``torch`` (the reference: the
    history dequantized for the model's attention), ``cpu`` (``kernels_cpu`` attends over the codes
    as stored) or ``auto``."""

    bits: int = 2
    group_size: int | None = None
    residual: int = 128
    backend: str = "torch"

    allowed_bits: ClassVar[tuple[int, ...]] = (2, 4, 8)
    default_group_size: ClassVar[int] = 32
    family: ClassVar[str] = "windowed"
    kernel_format: ClassVar[str] = "kivi"  # the storage format backends name their kernels by

    @property
    def label(self) -> str:
        """The name errors use: the registry name, else the method family."""
        return self.name or self.family

    def __post_init__(self) -> None:
        check_backend(self.backend)
        label = f"method {self.label}"
        if self.bits not in self.allowed_bits:
            allowed = ", ".join(map(str, self.allowed_bits))
            raise InvalidParameterError(f"{label}: bits must be one of {allowed}, got {self.bits}")
        group = self.default_group_size if self.group_size is None else self.group_size
        if group < 1:
            raise InvalidParameterError(f"{label}: group_size must be >= 1, got {group}")
        if self.residual < group or self.residual % group:
            default = " (the default; set group_size for a smaller residual)" if self.group_size is None else ""
            raise InvalidParameterError(
                f"{label}: residual ({self.residual}) must be a positive multiple of group_size ({group}), "
                f"so keys leave the fp16 window in whole groups{default}"
            )

    def group_size_for(self, head_dim: int) -> int:
        """The group size used on a model with this head dim (explicit, or the adapted default)."""
        if self.group_size is None:
            limit = min(self.default_group_size, head_dim)
            return max(g for g in range(1, limit + 1) if head_dim % g == 0 and self.residual % g == 0)
        check_divides(self.label, self.group_size, head_dim)
        return self.group_size

    def adaptations(self, geometry: KVGeometry) -> dict[str, Any]:
        """Defaults changed to fit the model, ``{parameter: [default, used]}`` (empty when none was)."""
        used = self.group_size_for(geometry.head_dim)
        if self.group_size is None and used != self.default_group_size:
            return {"group_size": [self.default_group_size, used]}
        return {}

    def new_layer(self, layer_idx: int, geometry: KVGeometry, backend: str = "torch") -> WindowedLayer:
        raise NotImplementedError

    def new_cache(self, model: Any) -> KVCache:
        """Layers on the backend ``backend`` resolves to, and ``cache.adaptations`` (what was fitted
        to this model). The kernels read a layer's whole stream and apply no logit soft-capping: a
        model with either need runs the torch reference (``auto``) or is refused (``cpu``)."""
        geometry = KVGeometry.of(model.config)
        adaptations = self.adaptations(geometry)  # an explicit group size that cannot divide fails here
        missing = [f"soft-capped logits ({geometry.softcap})"] if geometry.softcap is not None else []
        if geometry.sliding_window is not None:
            missing.append(f"sliding-window layers ({geometry.sliding_window})")
        backend = resolve_kernels(model, self.backend, self.kernel_format, missing)
        cache = KVCache([self.new_layer(i, geometry, backend) for i in range(geometry.n_layers)])
        cache.adaptations, cache.backend = adaptations, backend
        return cache


class WindowedLayer(KVLayer):
    """One decoder layer of a windowed method: two ``Stream``s built by ``new_streams``.

    ``params`` is the method itself (its parameters, frozen); ``group_size`` the size resolved for
    the model, or None to resolve it from the head dim of the first update. ``window``: a sliding
    layer's window; such a layer hands attention exactly the tokens ``get_mask_sizes`` promised and
    then forgets what the next step will not need (whole key groups / GEAR segments; tokens that
    leave the fp16 window already outside the sliding window are compressed apart, so they go whole).
    """

    is_croppable = False

    def __init__(
        self,
        layer_idx: int | None,
        params: WindowedMethod,
        group_size: int | None = None,
        window: int | None = None,
        backend: str = "torch",
    ):
        super().__init__(layer_idx, window)
        self.params, self.group_size, self.backend = params, group_size, backend
        self.k_stream: Stream | None = None
        self.v_stream: Stream | None = None

    @property
    def bits(self) -> int:
        return self.params.bits

    def new_streams(self) -> tuple[Stream, Stream]:
        """A fresh (keys, values) pair of streams for ``self.group_size``."""
        raise NotImplementedError

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new tokens, compress what leaves the windows, and return the whole history
        (decompressed, then the windows) in the input dtype for the model's stock attention."""
        check_finite(self.params.label, self.layer_idx, key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[TOKEN_AXIS]
        if self.backend != "torch":
            return self._update_for_kernel(key_states, value_states)
        first = self.get_mask_sizes(n)[1]  # the oldest token attention gets this step
        self.seen += n
        keep_from = None if self.window is None else self.seen - self.window + 1  # what the next step needs
        streams = (self.k_stream, self.v_stream)
        outs = []
        for stream, x in zip(streams, (key_states, value_states), strict=True):
            stream.extend(x, n == 1, keep_from)
            outs.append(stream.read(x.dtype)[:, :, first - stream.dropped :])
        self.count_read(self.k_stream.read_counts(), self.v_stream.read_counts(), position=self.seen)
        if keep_from is not None:
            for stream in streams:
                stream.forget(keep_from)
        return outs[0], outs[1]

    def _update_for_kernel(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """Append and compress as the torch path does, then hand attention placeholders that send it
        to ``attend`` (full-attention layers only: ``new_cache`` refuses sliding ones)."""
        n = key_states.shape[TOKEN_AXIS]
        self.seen += n
        self.k_stream.extend(key_states, n == 1)
        self.v_stream.extend(value_states, n == 1)
        self.count_read(self.k_stream.read_counts(), self.v_stream.read_counts(), position=self.seen)
        b, h, _, d = key_states.shape
        shape = (b, h, self.k_stream.length, d)
        return (
            tagged_placeholder(self, shape, key_states.dtype, key_states.device),
            tagged_placeholder(self, shape, value_states.dtype, value_states.device),
        )

    def attend(self, module, query: torch.Tensor, attention_mask, scaling: float | None = None, **kwargs):
        """Attention over the stored codes and windows by the backend's kernel (``kvquant.attention``).
        A prompt chunk of ``PROMPT_QUERIES`` or more queries dequantizes the history once, as the torch
        path does, for the model's stock attention: the kernel dequantizes the history once per query,
        q_len times the work for a prompt chunk; decode steps (and short chunks) use the kernel."""
        if query.shape[2] >= PROMPT_QUERIES:
            keys, values = self.k_stream.read(query.dtype), self.v_stream.read(query.dtype)
            return stock_attention(module, query, keys, values, attention_mask, scaling=scaling, **kwargs)
        ops = get_backend(self.backend).ops
        fmt = self.params.kernel_format
        n = self.k_stream.length
        mask = attention_mask[..., :n] if attention_mask is not None else None
        causal = mask is None and query.shape[2] > 1
        stored = getattr(ops, f"{fmt}_tensors")(self)
        out = getattr(ops, f"attend_{fmt}")(query, **stored, mask=mask, scaling=scaling, causal=causal)
        return out.transpose(1, 2).contiguous(), None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if self.group_size is None:
            self.group_size = self.params.group_size_for(key_states.shape[-1])
        else:
            check_divides(self.params.label, self.group_size, key_states.shape[-1])
        self.device = key_states.device
        self.k_stream, self.v_stream = self.new_streams()
        self.is_initialized = True

    def logical_elements(self) -> tuple[int, int]:
        if not self.is_initialized:
            return 0, 0
        return self.k_stream.numel(), self.v_stream.numel()

    def stored_k(self) -> list[torch.Tensor | None]:
        return self.k_stream.tensors() if self.is_initialized else []

    def stored_v(self) -> list[torch.Tensor | None]:
        return self.v_stream.tensors() if self.is_initialized else []

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Windows, codes, scales, zeros and whatever else the stores hold — all batch-first."""
        if self.is_initialized:
            self.k_stream.map(fn)
            self.v_stream.map(fn)

    def reset(self) -> None:
        super().reset()
        self.k_stream = self.v_stream = None
