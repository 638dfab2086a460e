"""The attention function that lets a cache layer decide what it reads, without forking modeling files.

transformers looks attention up by name (``AttentionInterface``). We register ``kvquant`` (masks as
SDPA takes them) and ``kvquant_eager`` (additive masks, as eager takes them). The route from a layer
to attention is explicit: a layer that reads inside attention (a kernel backend, or AlignedKV whose
widths need the query) returns from ``update`` the placeholder K/V of ``expect_attention`` — NaN,
zero-stride, costing no memory — and is registered as the reader of that key object. transformers
hands the key straight to the attention function, which takes the reader registered for it
(``take_reader``) and calls its ``attend``. Nothing rides on the tensor; an unregistered key (a
method that hands real K/V, or a model not routed) goes to the attention the model ran before it
was routed (``stock_attention``), so fp16 and every other method run bit-identically under it.

Which variant a model gets: ``kvquant_eager`` when it ran eager attention (Gemma-2's default) or
soft-caps its attention logits (SDPA cannot), else ``kvquant``. Readers hand what they read to
``stock_attention`` too, so ``scaling`` (Gemma's ``query_pre_attn_scalar``), ``softcap`` and the
sliding-window mask apply exactly as the model's own attention applies them.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from kvquant.cache import KVGeometry
from kvquant.errors import InvalidParameterError
from kvquant.formats.base import causal_allowed

NAME = "kvquant"
EAGER_NAME = "kvquant_eager"
_ROUTE = threading.local()  # per thread: id(placeholder key) -> (weak ref to it, reader)


def _readers() -> dict[int, tuple[weakref.ref, Any]]:
    if not hasattr(_ROUTE, "readers"):
        _ROUTE.readers = {}
    return _ROUTE.readers


_NAN: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _nan(dtype: torch.dtype, device) -> torch.Tensor:
    """One 0-d NaN per dtype and device, made once: placeholders are views of it, so a layer's update hands
    attention its placeholders without a launch (two ``torch.full`` a layer and step on a GPU before)."""
    key = (dtype, torch.device(device))
    if key not in _NAN:
        _NAN[key] = torch.full((), float("nan"), dtype=dtype, device=device)
    return _NAN[key]


def expect_attention(reader: Any, shape: tuple[int, ...], dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
    """Placeholder ``(keys, values)`` of ``shape`` for ``update`` to return, with ``reader`` registered as
    what attention over that key reads (``reader.attend(module, query, mask, **kwargs)``). The entry
    goes when attention takes it or when the placeholder is freed unused. Both are expanded views of one
    NaN (``_nan``): nothing reads them but the routing, by the key object's identity."""
    key = _nan(dtype, device).expand(shape)
    value = _nan(dtype, device).expand(shape)
    readers, ident = _readers(), id(key)

    def gone(ref: weakref.ref) -> None:
        entry = readers.get(ident)
        if entry is not None and entry[0] is ref:
            del readers[ident]

    readers[ident] = (weakref.ref(key, gone), reader)
    return key, value


def take_reader(key: torch.Tensor) -> Any:
    """The reader ``expect_attention`` registered for this very key object (once), or None."""
    entry = _readers().get(id(key))
    if entry is None or entry[0]() is not key:
        return None
    del _readers()[id(key)]
    return entry[1]


_CAPTURE: list[list[dict]] = []


def kvquant_attention(module, query, key, value, attention_mask, **kwargs):
    if _CAPTURE:
        # clones: a cache may hand attention views of a buffer the next layer reuses
        _CAPTURE[-1].append(
            {"query": query.clone(), "key": key.clone(), "value": value.clone(), "scaling": kwargs.get("scaling")}
        )
    reader = take_reader(key)
    if reader is None:
        return stock_attention(module, query, key, value, attention_mask, **kwargs)
    return reader.attend(module, query, attention_mask, **kwargs)


AttentionInterface.register(NAME, kvquant_attention)
AttentionInterface.register(EAGER_NAME, kvquant_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)
AttentionMaskInterface.register(EAGER_NAME, eager_mask)


def stock_attention(module, query, key, value, attention_mask, **kwargs) -> tuple[torch.Tensor, Any]:
    """Attention as the routed model computes it: eager when routed as ``kvquant_eager`` or when
    ``softcap`` is set (SDPA refuses it), else transformers' SDPA. Masks are cut to the key length."""
    if attention_mask is not None and attention_mask.shape[-1] > key.shape[-2]:
        attention_mask = attention_mask[..., : key.shape[-2]]
    eager = kwargs.get("softcap") is not None
    config = getattr(module, "config", None)
    if eager or getattr(config, "_attn_implementation", None) == EAGER_NAME:
        return eager_attention(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def eager_attention(module, query, key, value, attention_mask, **kwargs) -> tuple[torch.Tensor, Any]:
    """The model's own ``eager_attention_forward`` (bit-identical to running it eager), or a generic
    one — ``scaling``, ``tanh`` soft-capping, additive mask, fp32 softmax — where it has none."""
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = additive_mask(attention_mask, query.dtype)
    elif attention_mask is None and query.shape[2] > 1:  # SDPA's mask may be skipped for plain causal
        attention_mask = additive_mask(causal_allowed(query.shape[2], key.shape[-2], query.device), query.dtype)
    own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if own is not None:
        return own(module, query, key, value, attention_mask, **kwargs)
    return _generic_eager(module, query, key, value, attention_mask, **kwargs)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = attend) as eager attention adds it: 0 or the dtype's minimum."""
    return torch.where(allowed, torch.tensor(0.0, dtype=dtype), torch.finfo(dtype).min).to(allowed.device)


def _generic_eager(module, query, key, value, attention_mask, scaling=None, softcap=None, dropout=0.0, **kwargs):
    """Gemma-2's eager order of operations, for a module whose modeling file has no eager function
    (inference: no dropout)."""
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        weights = torch.tanh(weights / softcap) * softcap
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


@contextlib.contextmanager
def capture_attention_inputs(model) -> Iterator[list[dict]]:
    """Record ``query``/``key``/``value``/``scaling`` of every attention call inside the block; the
    model's attention is restored after it."""
    previous = model.config._attn_implementation
    route_attention(model, NAME)
    calls: list[dict] = []
    _CAPTURE.append(calls)
    try:
        yield calls
    finally:
        _CAPTURE.remove(calls)
        restore_attention(model, previous)


def routable(model: Any) -> bool:
    """Whether ``model``'s attention can be routed (it goes through transformers' ``AttentionInterface``)."""
    config = getattr(model, "config", None)
    return bool(getattr(model, "_supports_attention_backend", False)) and hasattr(config, "_attn_implementation")


def route_attention(model, name: str = NAME) -> None:
    """Route ``model``'s attention through ``kvquant_attention`` (a no-op for non-reader caches).

    ``name`` ``kvquant`` picks the variant the model needs (module docstring). It stays routed until
    ``restore_attention`` (``KVMethod.attach`` scopes both). A model whose attention does not go
    through transformers' ``AttentionInterface`` cannot be routed: one line says so.
    """
    current = model.config._attn_implementation
    if name == NAME and (current in ("eager", EAGER_NAME) or KVGeometry.of(model.config).softcap is not None):
        name = EAGER_NAME
    if current == name:
        return
    if not getattr(model, "_supports_attention_backend", False):
        raise InvalidParameterError(
            f"this method reads K/V inside attention, and {type(model).__name__} does not route its attention "
            "through transformers' AttentionInterface"
        )
    model.set_attn_implementation(name)


def restore_attention(model, previous: str | None) -> None:
    """Put back the attention implementation ``model`` had before ``route_attention``."""
    if previous is not None and model.config._attn_implementation != previous:
        model.set_attn_implementation(previous)
