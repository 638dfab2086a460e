"""KV methods: one module per method, each registering itself by name."""

from kvquant.methods import fp16  # noqa: F401  (registration)
from kvquant.methods.base import METHODS, KVMethod, get_method, method_names, register_method

__all__ = ["METHODS", "KVMethod", "get_method", "method_names", "register_method"]
