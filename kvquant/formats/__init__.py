"""Storage formats: the seam between what a method stores and who reads it.

One module per format, each a typed state (the tensors a layer holds, its geometry, ``append``,
``map_tensors``, bytes held) and, where a method decides per step what to read, a small frozen rule:

| format | state | rule |
|---|---|---|
| ``fp16`` (fp16, truncation) | ``fp16.Fp16State`` | ``fp16.TruncationRule`` (or None: 16 bits) |
| ``kivi`` (integer codes) | ``codes.CodesState`` | None |
| ``gear`` | ``gear.GearState`` | None |
| ``planes`` (AlignedKV) | ``planes.PlaneStore`` | ``planes.AlignedRule`` |
| ``higgs`` / ``aquakv`` | ``higgs.HiggsState`` / ``higgs.AquaKVState`` | the ``Higgs`` quantizer |

Every backend implements one protocol over them, ``attend(state, rule, query, mask, scaling) ->
(output, reads)`` (``kvquant.backends``); ``attend`` below is the torch reference's, which every kernel
is tested against. Formats import nothing of layers, methods, caches or backends.
"""

from __future__ import annotations

from typing import Any

import torch

from kvquant.formats import codes, fp16, higgs, planes
from kvquant.formats.base import FormatState, Reads

__all__ = ["FormatState", "Reads", "attend"]

REFERENCE = {
    "fp16": fp16.attend,
    "kivi": codes.attend,
    "gear": codes.attend,
    "planes": planes.attend,
    "higgs": higgs.attend,
    "aquakv": higgs.attend,
}


def attend(
    state: FormatState, rule: Any, query: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> tuple[torch.Tensor, Reads]:
    """The torch reference of the backend protocol, for every format: its read, then fp32 attention."""
    return REFERENCE[state.format](state, rule, query, mask, scaling)
