"""KV methods: one module (or package) per method; each registers itself by name when imported.

Every module in this package is imported on first use of the registry, so a method is one module
here, one ``conf/method/<name>.yaml`` and one test file: docs/adding_a_method.md. ``window`` is the
shared fp16-window plumbing of the windowed methods, not a method.
"""

from kvquant.methods.base import METHODS, KVMethod, get_method, method_names, register_method

__all__ = ["METHODS", "KVMethod", "get_method", "method_names", "register_method"]
