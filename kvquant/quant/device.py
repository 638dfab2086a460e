"""Long-lived tensors (quantizer tables, predictor weights) placed on the device that reads them, once.

``t.to(device)`` of a CPU tensor inside a step is a copy to the GPU, and torch synchronises the stream after
a blocking one: the host waits for every kernel queued before it, every layer and step. A method holds these
tensors where it made or loaded them (the CPU); a step asks for them here and gets the copy made the first time.
"""

from __future__ import annotations

import weakref

import torch

_COPIES: dict[tuple[int, torch.device, torch.dtype], tuple[weakref.ref, torch.Tensor]] = {}


def on_device(t: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` on ``device`` (as ``dtype``, default its own): ``t`` itself where it is already there, else a copy
    made once per tensor, device and dtype and dropped when ``t`` is. For tensors never written after they are
    made (a copy does not follow later changes)."""
    device, dtype = torch.device(device), dtype or t.dtype
    if t.device == device and t.dtype == dtype:
        return t
    key = (id(t), device, dtype)
    held = _COPIES.get(key)
    if held is None or held[0]() is not t:
        ref = weakref.ref(t, lambda _, key=key: _COPIES.pop(key, None))
        held = _COPIES[key] = (ref, t.to(device=device, dtype=dtype))
    return held[1]
