"""Memory a cache really takes: what it holds between steps and the peak a decode step allocates.

``held_bytes`` walks the cache object and sums the storages of every tensor it can reach (codes,
scales, windows, growth slack, working buffers kept between steps), each storage once — so a store
that keeps an fp16 copy beside its codes, or a read buffer, shows. ``StepPeak`` records, inside a
block, every tensor the ops allocate and when the last tensor on each storage dies: its ``peak`` is
the most bytes those allocations held at once (on any device) — the transient of a read path that
re-expands the history to fp32, measured by instrumenting the ops, not by formula. On CUDA,
``torch.cuda.max_memory_allocated`` says the same of the whole process.

One exception to "kept between steps is held": a per-forward workspace that a cache reuses so that a
step allocates nothing, and that holds nothing from one step to the next (every forward overwrites it
before reading it: AQUA-KV's reconstruction buffers on a kernel backend). An object names such
attributes in ``transient_attributes``; ``held_bytes`` skips them and ``transient_bytes`` counts them,
to be added to a step's peak (they are alive the whole step, and ``StepPeak`` cannot see writes made
by a kernel into storage that existed before the step).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """``(key, bytes)`` of the storage under ``t`` (None for tensors without one: meta, sparse)."""
    try:
        storage = t.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return None
    return storage.data_ptr(), storage.nbytes()


def _reachable_bytes(obj: Any, transient: bool) -> int:
    """Bytes of every distinct tensor storage reachable from ``obj`` (attributes, lists, dicts, tuples):
    those outside any ``transient_attributes`` (``transient`` False) or those inside them (True)."""
    seen_objects: set[int] = set()
    storages: dict[tuple[str, int], int] = {}
    stack: list[tuple[Any, bool]] = [(obj, False)]
    while stack:
        x, inside = stack.pop()
        if id(x) in seen_objects or x is None or isinstance(x, (str, bytes, int, float, bool, torch.nn.Module)):
            continue
        seen_objects.add(id(x))
        if isinstance(x, torch.Tensor):
            found = _storage(x)
            if found is not None and found[1] and inside == transient:
                storages[(str(x.device), found[0])] = found[1]
            continue
        if isinstance(x, dict):
            stack.extend((v, inside) for v in x.values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            stack.extend((v, inside) for v in x)
        elif hasattr(x, "__dict__"):
            names = getattr(x, "transient_attributes", ())
            stack.extend((v, inside or k in names) for k, v in vars(x).items())
        if hasattr(x, "__slots__"):
            stack.extend((getattr(x, s, None), inside) for s in x.__slots__)
    return sum(storages.values())


def held_bytes(obj: Any) -> int:
    """Bytes of every distinct tensor storage reachable from ``obj``, per-forward workspaces excepted."""
    return _reachable_bytes(obj, transient=False)


def transient_bytes(obj: Any) -> int:
    """Bytes of the per-forward workspaces reachable from ``obj`` (attributes an object names in
    ``transient_attributes``; module docstring): a decode step's transient, not held memory."""
    return _reachable_bytes(obj, transient=True)


class StepPeak(TorchDispatchMode):
    """``with StepPeak() as p: ...`` — ``p.peak``: most bytes allocated inside the block alive at once.

    Each op's outputs are registered by storage; a storage counts from the first tensor seen on it
    until the last one registered on it is freed. Storages that existed before the block (the cache's
    held tensors, the weights) are not counted; what the block leaves allocated is ``p.live``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._refs: dict[tuple[str, int], list[int]] = {}  # storage → [bytes, tensors alive]

    def _release(self, key: tuple[str, int]) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self._refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {(str(t.device), _storage(t)[0]) for t in tree_leaves((args, kwargs)) if _is_plain(t)}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not _is_plain(t):
                continue
            ptr, size = _storage(t)
            key = (str(t.device), ptr)
            if key not in self._refs and (key in inputs or not size):
                continue  # an in-place op or a view of memory allocated before the block
            entry = self._refs.setdefault(key, [size, 0])
            if entry[1] == 0:
                self.live += size
                self.peak = max(self.peak, self.live)
            entry[1] += 1
            weakref.finalize(t, self._release, key)
        return out


def _is_plain(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta"
