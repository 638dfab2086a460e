"""KV methods: one module per method; each registers itself by name when imported.

Every module in this package is imported on first use of the registry, so adding a method means
adding a file (and a ``conf/method/*.yaml``), nothing else.
"""

from kvquant.methods.base import METHODS, KVMethod, get_method, method_names, register_method

__all__ = ["METHODS", "KVMethod", "get_method", "method_names", "register_method"]
