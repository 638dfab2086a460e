"""Rotary position embedding maths: rotate keys the way Llama-family models do, and undo it.

Methods that quantize or predict keys before RoPE (AQUA-KV) get rotated keys from the model and
must take the rotation off, then put it back on what they reconstruct. The tables come from the
model's own rotary-embedding module, so every RoPE variant it implements (scaling, partial rotary
dims with identity tails) is followed without copying any modeling code. A module whose ``forward``
takes a ``layer_type`` (Gemma-3: sliding layers rotate with a local base, full ones with a global
one) is called once per layer type, as the model itself calls it (``rope_layer_types``).

Pure torch: importable without transformers, Hydra or W&B.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] → [−x2, x1]`` over the last dimension (Llama's pairing of channel i with i + D/2)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_layer_types(rotary: torch.nn.Module, layer_types: Sequence[str]) -> list[str | None]:
    """Per layer, the ``layer_type`` to hand ``rotary``: the layer's own type where the module's
    ``forward`` takes one (its tables differ per type), else None (one table for every layer)."""
    takes = "layer_type" in inspect.signature(rotary.forward).parameters
    return [t if takes else None for t in layer_types]


def rope_tables(
    rotary: torch.nn.Module, positions: torch.Tensor, layer_type: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, sin)`` of shape ``[B, n, D]`` for integer ``positions`` ``[B, n]``, from the model's
    module; ``layer_type`` (``rope_layer_types``) for a module with a table per layer type."""
    probe = torch.zeros(1, dtype=torch.float32, device=positions.device)
    extra = () if layer_type is None else (layer_type,)
    cos, sin = rotary(probe, positions.long(), *extra)
    return cos.float(), sin.float()


def apply_rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``k`` (``[B, H, n, D]``) the way Llama does, with tables ``[B, n, D]``."""
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return k * c + rotate_half(k) * s


def undo_rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of ``apply_rope`` (exact for any attention scaling: divides by ``cos² + sin²``)."""
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return (k * c - rotate_half(k) * s) / (c * c + s * s)
