"""Fused C++ CPU attention over kvquant's stored K/V formats (fp16, KIVI, GEAR, AlignedKV planes, HIGGS,
AQUA-KV), built once into the user cache.

``python -m kernels_cpu build`` compiles them (``make setup`` does); afterwards importing this
package only loads the built library. Nothing here raises at import: ``status()`` returns
``(available, reason)`` and callers fall back to the torch path when it is False. The kernels are
plain functions over stored tensors (``kernels_cpu.ops``, ``kernels_cpu.coded``); ``kernels_cpu.backend``
reads ``kvquant.formats`` states with them. Importing the package needs only torch (and platformdirs
for the cache folder).
"""

from __future__ import annotations

from kernels_cpu.coded import aquakv_encode, aquakv_reconstruct, attend_aquakv, attend_higgs
from kernels_cpu.loader import Status, build, build_dir, status
from kernels_cpu.ops import (
    aligned_bound_units,
    aligned_rescored_items,
    aligned_rule_counts,
    attend_aligned,
    attend_fp16,
    attend_gear,
    attend_kivi,
    attend_planes,
    exponent_gaps,
    key_widths,
    read_plane_keys,
    width_counts,
)

__all__ = [
    "Status",
    "aligned_bound_units",
    "aligned_rescored_items",
    "aligned_rule_counts",
    "aquakv_encode",
    "aquakv_reconstruct",
    "attend_aligned",
    "attend_aquakv",
    "attend_fp16",
    "attend_gear",
    "attend_higgs",
    "attend_kivi",
    "attend_planes",
    "build",
    "build_dir",
    "exponent_gaps",
    "key_widths",
    "read_plane_keys",
    "status",
    "width_counts",
]
