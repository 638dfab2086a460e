"""The attention function that lets a cache layer decide what it reads, without forking modeling files.

transformers looks attention up by name (``AttentionInterface``). We register ``kvquant``: when
the key it receives carries a reader (a cache layer that stores planes and needs the query to
decide widths), the reader computes attention; any other key goes to transformers' SDPA unchanged,
so fp16 and every other method run bit-identically under this implementation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvquant.errors import InvalidParameterError

NAME = "kvquant"
READER_ATTR = "_kvquant_reader"
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")


_CAPTURE: list[list[dict]] = []


def kvquant_attention(module, query, key, value, attention_mask, **kwargs):
    if _CAPTURE:
        _CAPTURE[-1].append({"query": query, "key": key, "value": value, "scaling": kwargs.get("scaling")})
    reader = getattr(key, READER_ATTR, None)
    if reader is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return reader.attend(module, query, attention_mask, **kwargs)


AttentionInterface.register(NAME, kvquant_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


def tagged_placeholder(reader: object, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A key stand-in that costs no memory and carries ``reader``; NaN so that misuse is loud."""
    t = torch.full((), float("nan"), dtype=dtype, device=device).expand(shape)
    setattr(t, READER_ATTR, reader)
    return t


@contextlib.contextmanager
def capture_attention_inputs(model) -> Iterator[list[dict]]:
    """Record ``query``/``key``/``value``/``scaling`` of every attention call inside the block."""
    use_kvquant_attention(model)
    calls: list[dict] = []
    _CAPTURE.append(calls)
    try:
        yield calls
    finally:
        _CAPTURE.remove(calls)


def use_kvquant_attention(model) -> None:
    """Route ``model``'s attention through ``kvquant_attention`` (a no-op for non-reader caches)."""
    config = model.config.get_text_config(decoder=True)
    if config.model_type not in LLAMA_FAMILY:
        raise InvalidParameterError(
            f"this method reads K/V inside attention and supports Llama-family layouts "
            f"({', '.join(LLAMA_FAMILY)}); model_type '{config.model_type}' is not supported"
        )
    if model.config._attn_implementation != NAME:
        model.set_attn_implementation(NAME)
