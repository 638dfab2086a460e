"""Glue to transformers' Cache: layers that store K/V their own way and count what they hold and read.

A method supplies a ``KVLayer`` subclass; ``KVCache`` is a plain ``transformers.Cache`` of those
layers, so ``model.generate(..., past_key_values=cache)`` and chunked forwards work unchanged.
Bytes are measured from the tensors a layer actually holds, never from a formula.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvquant.backends import TORCH, Backend
from kvquant.errors import KvquantError
from kvquant.formats.base import nbytes


@dataclass
class CacheCounts:
    """Raw totals that add across layers and caches; ``summary()`` turns them into per-element bits.

    ``read_k``/``read_v`` map a bit width to how many elements were read at that width (one entry,
    16, for fp16); ``by_position`` maps a sequence length to ``[bits_k, elements_k, bits_v, elements_v]``
    read at the step that reached it, for bits-vs-position curves.
    """

    elements_k: int = 0
    elements_v: int = 0
    bytes_k: int = 0
    bytes_v: int = 0
    read_k: Counter = field(default_factory=Counter)
    read_v: Counter = field(default_factory=Counter)
    by_position: dict[int, list[float]] = field(default_factory=dict)
    meta_bits_k: float = 0.0
    meta_bits_v: float = 0.0

    def __add__(self, other: CacheCounts) -> CacheCounts:
        positions = {p: list(v) for p, v in self.by_position.items()}
        for p, v in other.by_position.items():
            positions[p] = [a + b for a, b in zip(positions.get(p, [0.0] * 4), v, strict=True)]
        return CacheCounts(
            self.elements_k + other.elements_k,
            self.elements_v + other.elements_v,
            self.bytes_k + other.bytes_k,
            self.bytes_v + other.bytes_v,
            self.read_k + other.read_k,
            self.read_v + other.read_v,
            positions,
            self.meta_bits_k + other.meta_bits_k,
            self.meta_bits_v + other.meta_bits_v,
        )

    def add_read(
        self,
        read_k: dict[int, int],
        read_v: dict[int, int],
        position: int | None = None,
        meta_k: float = 0.0,
        meta_v: float = 0.0,
    ) -> None:
        """Record one attention read: element counts per bit width, for K and for V, plus the bits of
        metadata the read needed (per-channel maxima, block exponents), which count towards bits read."""
        self.read_k.update(read_k)
        self.read_v.update(read_v)
        self.meta_bits_k += meta_k
        self.meta_bits_v += meta_v
        if position is not None:
            row = self.by_position.setdefault(position, [0.0] * 4)
            row[0] += sum(w * n for w, n in read_k.items()) + meta_k
            row[1] += sum(read_k.values())
            row[2] += sum(w * n for w, n in read_v.items()) + meta_v
            row[3] += sum(read_v.values())

    def summary(self) -> dict[str, Any]:
        def ratio(a: float, b: float) -> float:
            return float(a) / b if b else float("nan")

        def bits(hist: Counter) -> float:
            return float(sum(w * n for w, n in hist.items()))

        elements = self.elements_k + self.elements_v
        nk, nv = sum(self.read_k.values()), sum(self.read_v.values())
        read_k, read_v = bits(self.read_k) + self.meta_bits_k, bits(self.read_v) + self.meta_bits_v
        return {
            "bits_stored": ratio(8 * (self.bytes_k + self.bytes_v), elements),
            "bits_stored_k": ratio(8 * self.bytes_k, self.elements_k),
            "bits_stored_v": ratio(8 * self.bytes_v, self.elements_v),
            "bits_read": ratio(read_k + read_v, nk + nv),
            "bits_read_k": ratio(read_k, nk),
            "bits_read_v": ratio(read_v, nv),
            "widths_k": {int(w): n / nk for w, n in sorted(self.read_k.items())},
            "widths_v": {int(w): n / nv for w, n in sorted(self.read_v.items())},
            "bytes": self.bytes_k + self.bytes_v,
            "bytes_fp16": 2 * elements,
            "elements": elements,
        }

    def position_series(self) -> dict[str, list[float]]:
        """Mean bits read per element at each sequence length (K, V, both)."""
        rows = sorted(self.by_position.items())
        return {
            "position": [p for p, _ in rows],
            "bits_read_k": [r[0] / r[1] if r[1] else float("nan") for _, r in rows],
            "bits_read_v": [r[2] / r[3] if r[3] else float("nan") for _, r in rows],
            "bits_read": [(r[0] + r[2]) / (r[1] + r[3]) if r[1] + r[3] else float("nan") for _, r in rows],
        }


FP16_MAX = 65504.0


@dataclass(frozen=True)
class KVGeometry:
    """What a method needs to know of a model's attention: one lookup, so methods never read configs.

    ``layer_types`` says per layer ``full_attention`` or ``sliding_attention`` (Mistral, Phi-3 with
    a window, Gemma-2/3, Qwen with ``use_sliding_window``) as transformers' ``DynamicCache`` reads
    it; ``sliding_window`` is the window those layers attend to (a layer keeps ``sliding_window − 1``
    tokens between steps, as ``DynamicSlidingWindowLayer`` does). ``softcap`` is the attention-logit
    soft-capping (Gemma-2), which attention kernels must apply or refuse.
    """

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    model_type: str = ""
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    softcap: float | None = None

    @classmethod
    def of(cls, config: Any) -> KVGeometry:
        """From a transformers config (the text decoder's, for multimodal configs)."""
        text = config.get_text_config(decoder=True)
        n_heads = int(text.num_attention_heads)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // n_heads
        n_layers = int(text.num_hidden_layers)
        window = getattr(text, "sliding_window", None)
        types = tuple(getattr(text, "layer_types", None) or ())
        if not types:
            types = ("sliding_attention" if window else "full_attention",) * n_layers
        return cls(
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=int(getattr(text, "num_key_value_heads", None) or n_heads),
            head_dim=int(head_dim),
            model_type=str(getattr(text, "model_type", "")),
            sliding_window=int(window) if window and "sliding_attention" in types else None,
            layer_types=types,
            softcap=getattr(text, "attn_logit_softcapping", None),
        )

    def is_sliding(self, layer_idx: int) -> bool:
        return layer_idx < len(self.layer_types) and self.layer_types[layer_idx] == "sliding_attention"

    def window(self, layer_idx: int) -> int | None:
        """The sliding window of layer ``layer_idx``, or None for a full-attention layer."""
        return self.sliding_window if self.is_sliding(layer_idx) else None


def fp16_range_error(layer_idx: int | None, what: str, n_bad: int, n_nan: int) -> str | None:
    """The one line for ``n_bad`` K or V values fp16 cannot hold (None when there are none)."""
    if not n_bad:
        return None
    return (
        f"layer {layer_idx}: {n_bad} {what} values are NaN/inf or outside fp16's range "
        f"(±{FP16_MAX:g}; {n_nan} NaN) and cannot be stored as fp16"
    )


def value_range(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min, max)`` of ``x`` as 0-d tensors on its device: one reduction (one kernel on a GPU), and NaN
    anywhere makes both NaN, so ``within_fp16`` of them is the whole check (NaN, ±inf, beyond ±65504)."""
    return torch.aminmax(x.detach())


def within_fp16(low: float, high: float) -> bool:
    """Whether a tensor whose ``value_range`` is ``(low, high)`` fits fp16 (NaN fails both comparisons)."""
    return -FP16_MAX <= low and high <= FP16_MAX


def fp16_range_verdict(layer_idx: int | None, what: str, low: float, high: float) -> str | None:
    """The one line for a deferred check whose tensor is gone by the time it is read: its range, not counts."""
    if within_fp16(low, high):
        return None
    return (
        f"layer {layer_idx}: {what} values are NaN/inf or outside fp16's range (±{FP16_MAX:g}; "
        f"min {low:g}, max {high:g}) and cannot be stored as fp16"
    )


class FiniteCheck:
    """Where a cache's refusals of NaN/inf K/V are read. A CPU tensor is checked at once. A GPU tensor's
    verdict stays on the device and is read when the next step begins (the update of a lower layer than
    the last one checked), at ``counts()`` or ``settle()``: one host sync a step instead of one a layer
    (each sync drains the GPU's queue, so the launches of the next layer no longer overlap the work of
    this one). The error then comes one step late, naming the layer that received the values.
    A verdict is a few 0-d tensors (``value_range``'s, one kernel a tensor): a layer adds no other launch,
    and ``settle`` reads every held verdict with one ``torch.cat`` and one copy to the host.
    ``deferred`` forces either way (tests); None decides by the tensor's device."""

    MAX_PENDING = 4096  # verdicts held before they are read anyway (a one-layer model never wraps around)

    def __init__(self, deferred: bool | None = None) -> None:
        self.deferred = deferred
        self.pending: list[tuple[int, tuple[torch.Tensor, ...], Callable[..., str | None], type[Exception]]] = []

    def defers(self, x: torch.Tensor) -> bool:
        return self.deferred if self.deferred is not None else x.device.type != "cpu"

    def defer(
        self,
        layer_idx: int | None,
        verdict: tuple[torch.Tensor, ...],
        describe: Callable[..., str | None],
        error: type[Exception],
    ) -> None:
        """Keep ``verdict`` (0-d tensors on the device) until it is read; ``describe(*verdict)`` (as floats)
        gives the error's line, or None when the values were fine."""
        index = -1 if layer_idx is None else layer_idx
        if self.pending and (index < self.pending[-1][0] or len(self.pending) >= self.MAX_PENDING):
            self.settle()
        self.pending.append((index, verdict, describe, error))

    def settle(self) -> None:
        """Read every held verdict (one sync) and raise the first refusal."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        flat = [t.reshape(1) for _, verdict, _, _ in pending for t in verdict]
        values = torch.cat(flat).tolist()  # cat promotes fp16 / bf16 / fp32 verdicts to one dtype
        start = 0
        for _, verdict, describe, error in pending:
            message = describe(*values[start : start + len(verdict)])
            start += len(verdict)
            if message is not None:
                raise error(f"{message} (found after the step that received them)")


def to_fp16_checked(
    x: torch.Tensor, layer_idx: int | None, what: str, check: FiniteCheck | None = None
) -> torch.Tensor:
    """Cast K or V to fp16, refusing NaN and values outside fp16's range instead of storing inf (at once,
    or where ``check`` defers it, when the next step begins)."""
    if not x.numel():
        return x.to(torch.float16)
    low, high = value_range(x)
    if check is not None and check.defers(x):
        check.defer(layer_idx, (low, high), functools.partial(fp16_range_verdict, layer_idx, what), KvquantError)
    elif not within_fp16(*(torch.stack((low, high)).tolist() if x.is_cuda else (low.item(), high.item()))):
        bad = ~torch.isfinite(x) | (x.abs() > FP16_MAX)
        raise KvquantError(fp16_range_error(layer_idx, what, int(bad.sum()), int(torch.isnan(x).sum())))
    return x.to(torch.float16)


class CropError(KvquantError):
    """A cache asked to forget tokens it cannot take back (codes are never rewritten)."""


class KVLayer(DynamicLayer):
    """One layer's store: the small contract every method's layer keeps.

    ``crop`` (assisted decoding, prompt lookup) works as far as ``forget_newest`` can take tokens back.

    A subclass implements ``update`` and says what it holds twice over: ``stored_k``/``stored_v``
    (every tensor, for bytes) and ``map_tensors`` (every tensor with a leading batch axis, replaced
    by ``fn(tensor)``). From that one map come ``reorder_cache`` (beam search),
    ``batch_select_indices``, ``batch_repeat_interleave`` (``num_return_sequences``), ``offload``
    and ``prefetch``, for every method alike.

    Reading: a layer holds its K/V in a ``kvquant.formats`` state and reads it with the ``backend`` its
    cache resolved (``kvquant.backends``) by the ``rule`` its method gave. Where the backend reads inside
    attention, ``update`` returns ``expect_attention``'s placeholders and ``attend`` (called by
    ``kvquant.attention``) runs ``backend.attend(attended_state(), rule, …)``; ``record`` takes what
    that read chose.
    """

    def __init__(
        self, layer_idx: int | None = None, window: int | None = None, backend: Backend = TORCH, rule: Any = None
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.window, self.is_sliding = window, window is not None  # ``KVGeometry.window(layer_idx)``
        self.backend, self.rule = backend, rule
        self.seen = 0  # tokens received so far; a sliding layer holds fewer
        self.finite = FiniteCheck()  # where NaN/inf refusals are read (its cache shares one across layers)
        self._reads = CacheCounts()
        self._attend_len = 0  # keys this step's attention reads (the placeholders' length)

    def reads_in_attention(self, state: Any) -> bool:
        """Whether ``update`` hands attention placeholders (kernels, or a read that needs the query)
        rather than the K/V the torch reference reads."""
        return not self.backend.materializes or state.reads_by_query

    def expect_attention(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
        """``update``'s return when attention reads: placeholders that route attention to ``attend``."""
        from kvquant.attention import expect_attention

        self._attend_len = shape[-2]
        return expect_attention(self, shape, dtype, device)

    def attended_state(self) -> Any:
        """The state this step's attention reads (a subclass's ``state``)."""
        return self.state

    def attend(self, module, query: torch.Tensor, attention_mask, scaling: float | None = None, **kwargs):
        """Attention over ``attended_state()`` by the backend (called by ``kvquant.attention``); returns
        ``([B, q_len, Hq, D], None)`` as transformers' attention functions do."""
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        mask = attention_mask[..., : self._attend_len] if attention_mask is not None else None
        out, reads = self.backend.attend(self.attended_state(), self.rule, query, mask, scaling)
        self.record(reads)
        return out.transpose(1, 2).contiguous(), None

    def record(self, reads: Any) -> None:
        """Count what a rule chose to read (``kvquant.formats.Reads``); layers that read everything they
        hold count it in ``update`` instead."""

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the keys this layer hands attention for ``query_length`` new
        tokens: all of them, or for a sliding layer the newest ``window − 1`` plus the new ones (as
        transformers' ``DynamicSlidingWindowLayer``); ``update`` must hand over exactly those."""
        seen = self.get_seq_length()
        if self.window is None or seen < self.window:
            return seen + query_length, 0
        return self.window - 1 + query_length, seen - self.window + 1

    def get_max_length(self) -> int:
        return -1 if self.window is None else self.window

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace every batch-first tensor the layer holds by ``fn(tensor)``."""
        if self.keys is not None:
            self.keys, self.values = fn(self.keys), fn(self.values)

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

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self.map_tensors(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.map_tensors(lambda t: t[indices, ...])

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.map_tensors(lambda t: t.repeat_interleave(repeats, dim=0))

    def offload(self) -> None:
        if self.is_initialized:
            self.map_tensors(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.is_initialized:
            self.map_tensors(lambda t: t.to(self.device, non_blocking=True))

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the newest tokens (assisted decoding rejects a draft): ``-n`` removes ``n``; a positive
        value is the length to keep (transformers' legacy ``crop(max_length)``). What a layer can take
        back, ``forget_newest`` says; beyond it, one ``CropError`` line."""
        if not self.is_initialized:
            return
        keep = tokens_to_remove if tokens_to_remove > 0 else self.seen + tokens_to_remove
        n = self.seen - max(0, keep)
        if n > 0:
            self.forget_newest(n)
            self.seen -= n

    def forget_newest(self, n: int) -> None:
        """Drop the newest ``n`` tokens from what the layer holds, where they are still held as received
        (a subclass's rule); ``CropError`` otherwise. ``seen`` is ``crop``'s to lower."""
        raise CropError(f"{type(self).__name__}: this cache cannot be cropped; use a fresh cache")

    def refuse_crop(self, n: int, held: int, where: str) -> None:
        """One ``CropError`` line when ``n`` tokens to forget exceed the ``held`` newest ones kept ``where``."""
        if n > held:
            raise CropError(
                f"layer {self.layer_idx}: cannot forget the newest {n} tokens, only {held} are still held {where} "
                "(older ones are compressed and never rewritten); use a fresh cache"
            )

    def count_read(
        self,
        read_k: dict[int, int],
        read_v: dict[int, int],
        position: int | None = None,
        meta_k: float = 0.0,
        meta_v: float = 0.0,
    ) -> None:
        """Record one attention read as element counts per bit width (e.g. ``{16: n}`` for fp16)."""
        self._reads.add_read(read_k, read_v, position, meta_k, meta_v)

    def counts(self) -> CacheCounts:
        ek, ev = self.logical_elements()
        c = CacheCounts(elements_k=ek, elements_v=ev, bytes_k=nbytes(self.stored_k()), bytes_v=nbytes(self.stored_v()))
        return c + self._reads

    def reset(self) -> None:
        super().reset()
        self.seen = 0
        self._reads = CacheCounts()


class KVCache(Cache):
    """A transformers ``Cache`` of ``KVLayer`` objects that can report what it stores and reads."""

    backend: str | None = None  # the kernels its layers read with, where the method has a choice
    adaptations: dict[str, Any] = {}  # parameters changed to fit the model (``KVMethod.adaptations``)
    parameter_files: dict[str, Any] = {}  # files its parameters were read from: name -> {path, sha256, ...}

    def __init__(self, layers: list[KVLayer]):
        super().__init__(layers=layers)
        self.finite = FiniteCheck()
        for layer in layers:
            layer.finite = self.finite

    def counts(self) -> CacheCounts:
        self.finite.settle()
        total = CacheCounts()
        for layer in self.layers:
            total = total + layer.counts()
        return total

    def stats(self) -> dict[str, float]:
        """``bits_stored``/``bits_read`` per element (K, V and both) and ``bytes`` actually held."""
        return self.counts().summary()
