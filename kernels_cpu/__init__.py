"""Fused C++ CPU attention over kvquant's stored K/V formats (fp16, KIVI, GEAR, AlignedKV planes, HIGGS,
AQUA-KV), built once into the user cache.

``python -m kernels_cpu build`` compiles them (``make setup`` does); afterwards importing this
package only loads the built library. Nothing here raises at import: ``status()`` returns
``(available, reason)`` and callers fall back to the torch path when it is False. The kernels are
plain functions over the tensors a layer holds (``kernels_cpu.ops``); this package imports only
torch (and platformdirs for the cache folder).
"""

from __future__ import annotations

from kernels_cpu.loader import Status, build, build_dir, status
from kernels_cpu.ops import (
    aquakv_encode,
    aquakv_reconstruct,
    aquakv_tensors,
    attend_aligned,
    attend_aquakv,
    attend_fp16,
    attend_gear,
    attend_higgs,
    attend_kivi,
    attend_planes,
    exponent_gaps,
    gear_tensors,
    higgs_tensors,
    kivi_tensors,
    plane_tensors,
    read_plane_keys,
)

__all__ = [
    "Status",
    "aquakv_encode",
    "aquakv_reconstruct",
    "aquakv_tensors",
    "attend_aquakv",
    "attend_fp16",
    "attend_gear",
    "attend_higgs",
    "attend_kivi",
    "attend_aligned",
    "attend_planes",
    "exponent_gaps",
    "build",
    "build_dir",
    "gear_tensors",
    "higgs_tensors",
    "kivi_tensors",
    "plane_tensors",
    "read_plane_keys",
    "status",
]
