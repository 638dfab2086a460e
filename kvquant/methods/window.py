"""What KIVI and GEAR share: an fp16 window of the newest tokens in front of codes, K and V apart.

Not a method (nothing here registers): ``WindowedLayer`` holds a ``kvquant.formats.codes.CodesState``
(two ``Stream``s: ``kvquant.formats.window``) and ``WindowedMethod`` the parameters both methods take
(``bits``, ``group_size``, ``residual``, ``backend``), validated once, with the model-dependent
default group size.

Default group sizes. ``group_size = None`` means the paper's default (``default_group_size``: 32
for KIVI, 64 for GEAR) adapted to the model: the largest divisor of the head dim that is ≤ the
default and divides ``residual`` (so keys still leave the window in whole groups) — 32 on head
dim 8 becomes 8, GEAR's 64 on head dim 32 becomes 32. What was adapted is recorded in the cache
(``cache.adaptations``, e.g. ``{"group_size": [32, 8]}``), never on the method. An explicit
``group_size`` that does not divide the head dim is a one-line ``InvalidParameterError``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvquant.attention import stock_attention
from kvquant.backends import TORCH, Backend, check_backend
from kvquant.cache import FP16_MAX, CropError, FiniteCheck, KVCache, KVGeometry, KVLayer, value_range, within_fp16
from kvquant.errors import InvalidParameterError, KvquantError
from kvquant.formats.codes import CodesState
from kvquant.formats.window import TOKEN_AXIS, Stream
from kvquant.methods.base import KVMethod

PROMPT_QUERIES = 16  # queries in one forward from which a chunk is a prompt chunk (attend decodes once)


class NonFiniteKVError(KvquantError, ValueError):
    """NaN, inf or a value beyond fp16's range reached a quantized cache: its fp16 windows, scales and zeros
    cannot hold it, and min-max quantization of such a group is meaningless."""


def out_of_range_error(
    label: str, layer_idx: int | None, k_low: float, k_high: float, v_low: float, v_high: float
) -> str | None:
    """The one line for keys or values out of range, from their ``value_range`` (None when both were fine)."""
    bad_keys = not within_fp16(k_low, k_high)
    if not bad_keys and within_fp16(v_low, v_high):
        return None
    what = "keys" if bad_keys else "values"
    return f"{label}: layer {layer_idx} received non-finite {what} (NaN or inf) or {what} beyond fp16's ±{FP16_MAX:g}"


def check_storable(
    label: str, layer_idx: int | None, keys: torch.Tensor, values: torch.Tensor, check: FiniteCheck | None = None
) -> None:
    """Refuse NaN, ±inf and values beyond fp16's range: one reduction a tensor per update (``value_range``)
    and one sync, or on a GPU none (``check`` reads the verdict when the next step begins,
    ``kvquant.cache.FiniteCheck``). What passes quantizes to finite fp16 scales and zeros
    (``kvquant.quant.integer.quantize(checked=True)`` relies on it)."""
    if not keys.numel():
        return
    verdict = (*value_range(keys), *value_range(values))
    describe = functools.partial(out_of_range_error, label, layer_idx)
    if check is not None and check.defers(keys):
        check.defer(layer_idx, verdict, describe, NonFiniteKVError)
        return
    message = describe(*torch.stack([t.float() for t in verdict]).tolist())
    if message is not None:
        raise NonFiniteKVError(message)


def check_divides(label: str, group_size: int, head_dim: int) -> None:
    """One line when a group size cannot divide the head dim (values are grouped within a head)."""
    if head_dim % group_size:
        raise InvalidParameterError(
            f"method {label}: group_size {group_size} does not divide the model's head_dim {head_dim} "
            f"(values are grouped per token within a head); set method.group_size to a divisor of {head_dim} "
            "or null for the default adapted to the model"
        )


@dataclass(frozen=True)
class WindowedMethod(KVMethod):
    """Parameters KIVI and GEAR share: ``bits``-bit codes in groups of ``group_size``; the newest
    ``residual`` tokens in fp16 (a multiple of the group size). ``group_size`` None: the paper's
    default adapted to the model (module docstring). ``backend``: ``auto`` (the device's kernels,
    attending over the codes as stored, where built and able to run the model; else the torch
    reference, which decodes the history for the model's attention), ``torch`` or a backend by name."""

    bits: int = 2
    group_size: int | None = None
    residual: int = 128
    backend: str = "auto"

    allowed_bits: ClassVar[tuple[int, ...]] = (2, 4, 8)
    default_group_size: ClassVar[int] = 32
    family: ClassVar[str] = "windowed"
    format: ClassVar[str] = "kivi"

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

    def new_layer(self, layer_idx: int, geometry: KVGeometry, backend: Backend = TORCH) -> WindowedLayer:
        raise NotImplementedError

    def new_cache(self, model: Any) -> KVCache:
        """Layers on the backend ``backend`` resolves to for this model (``KVMethod.resolve``), and
        ``cache.adaptations`` (what was fitted to it)."""
        geometry = KVGeometry.of(model.config)
        adaptations = self.adaptations(geometry)  # an explicit group size that cannot divide fails here
        backend = self.resolve(model, geometry)
        cache = KVCache([self.new_layer(i, geometry, backend) for i in range(geometry.n_layers)])
        cache.adaptations, cache.backend = adaptations, backend.name
        return cache


class WindowedLayer(KVLayer):
    """One decoder layer of a windowed method: a ``CodesState`` (K and V ``Stream``s) built by ``new_state``.

    ``params`` is the method itself (its parameters, frozen); ``group_size`` the size resolved for
    the model, or None to resolve it from the head dim of the first update. ``window``: a sliding
    layer's window; such a layer hands attention exactly the tokens ``get_mask_sizes`` promised and
    then forgets what the next step will not need (whole key groups / GEAR segments; tokens that
    leave the fp16 window already outside the sliding window are coded apart, so they go whole).
    """

    def __init__(
        self,
        layer_idx: int | None,
        params: WindowedMethod,
        group_size: int | None = None,
        window: int | None = None,
        backend: Backend = TORCH,
    ):
        super().__init__(layer_idx, window, backend)
        self.params, self.group_size = params, group_size
        self.state: CodesState | None = None

    @property
    def bits(self) -> int:
        return self.params.bits

    @property
    def k_stream(self) -> Stream | None:
        return None if self.state is None else self.state.k

    @property
    def v_stream(self) -> Stream | None:
        return None if self.state is None else self.state.v

    def new_state(self) -> CodesState:
        """A fresh state for ``self.group_size``."""
        raise NotImplementedError

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new tokens and code what leaves the windows; return the whole history (decoded, then
        the windows) in the input dtype for the model's attention, or placeholders where the backend's
        kernel reads the codes (full-attention layers only: the kernels' ``limits`` refuse sliding ones)."""
        check_storable(self.params.label, self.layer_idx, key_states, value_states, self.finite)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[TOKEN_AXIS]
        first = self.get_mask_sizes(n)[1]  # the oldest token attention gets this step
        self.seen += n
        keep_from = None if self.window is None else self.seen - self.window + 1  # what the next step needs
        self.state.append(key_states, value_states, n == 1, keep_from)
        self.count_read(*self.state.read_counts(), position=self.seen)
        if self.reads_in_attention(self.state):
            b, h, _, d = key_states.shape
            return self.expect_attention((b, h, self.state.length, d), key_states.dtype, key_states.device)
        outs = [
            s.read(x.dtype)[:, :, first - s.dropped :]
            for s, x in ((self.k_stream, key_states), (self.v_stream, value_states))
        ]
        if keep_from is not None:
            for stream in (self.k_stream, self.v_stream):
                stream.forget(keep_from)
        return outs[0], outs[1]

    def attend(self, module, query: torch.Tensor, attention_mask, scaling: float | None = None, **kwargs):
        """The backend's kernel over the codes and windows; a prompt chunk of ``PROMPT_QUERIES`` or more
        queries decodes the history once for the model's own attention instead (a kernel decodes the
        history once per query: q_len times the work)."""
        if query.shape[2] >= PROMPT_QUERIES:
            keys, values = self.state.read(query.dtype)
            return stock_attention(module, query, keys, values, attention_mask, scaling=scaling, **kwargs)
        return super().attend(module, query, attention_mask, scaling, **kwargs)

    def forget_newest(self, n: int) -> None:
        """Tokens still in both fp16 windows (codes are never rewritten); a sliding layer's only until its
        window has filled (a crop would need tokens it already forgot)."""
        if self.window is not None and self.seen >= self.window:
            raise CropError(
                f"layer {self.layer_idx}: a sliding-window layer cannot be cropped once its window has filled"
            )
        self.refuse_crop(n, self.state.newest_fp16(), "in the fp16 window")
        self.state.forget_newest(n)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if self.group_size is None:
            self.group_size = self.params.group_size_for(key_states.shape[-1])
        else:
            check_divides(self.params.label, self.group_size, key_states.shape[-1])
        self.device = key_states.device
        self.state = self.new_state()
        self.is_initialized = True

    def logical_elements(self) -> tuple[int, int]:
        if not self.is_initialized:
            return 0, 0
        return self.k_stream.numel(), self.v_stream.numel()

    def stored_k(self) -> list[torch.Tensor | None]:
        return self.state.tensors_k() if self.is_initialized else []

    def stored_v(self) -> list[torch.Tensor | None]:
        return self.state.tensors_v() if self.is_initialized else []

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Windows, codes, scales, zeros and whatever else the stores hold — all batch-first."""
        if self.is_initialized:
            self.state.map_tensors(fn)

    def reset(self) -> None:
        super().reset()
        self.state = None
