"""kvquant: KV-cache quantization methods for Hugging Face causal LMs, measured honestly.

The public face is imported lazily so that ``import kvquant.bits`` needs only torch (GPU boxes
carry no Hydra, W&B or lm-eval).
"""

from __future__ import annotations

import warnings
from importlib import import_module
from typing import Any

__version__ = "0.1.0"

# transformers 5.24 asks for `cache=` instead of `past_key_values=`, which 5.17 (on the GPU boxes) lacks.
warnings.filterwarnings("ignore", message=r".*`past_key_values` is deprecated.*", category=FutureWarning)

_EXPORTS = {
    "load_model": "kvquant.models",
    "model_names": "kvquant.models",
    "get_method": "kvquant.methods.base",
    "method_names": "kvquant.methods.base",
    "get_task": "kvquant.eval.tasks",
    "task_names": "kvquant.eval.tasks",
    "KVCache": "kvquant.cache",
    "KVLayer": "kvquant.cache",
    "KVMethod": "kvquant.methods.base",
    "KvquantError": "kvquant.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvquant' has no attribute {name!r}")
