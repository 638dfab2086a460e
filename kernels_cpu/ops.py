"""The Python face of the kernels over fp16, integer codes (KIVI, GEAR) and bit planes (AlignedKV).

Each takes the query ``[B, Hq, q_len, D]`` (any float dtype; computed in fp32), the stored tensors
untouched, an optional mask broadcastable to ``[B, Hq, q_len, L]`` (bool: True = attend, or additive
float), ``scaling`` (default ``D**-0.5``) and ``causal`` (query ``i`` sees keys ``t <= L - q_len + i``;
for a mask-less multi-token step). GQA: query head ``j`` reads KV head ``j // (Hq / Hkv)``, as
transformers' ``repeat_kv`` does. Returns ``[B, Hq, q_len, D]`` in the query's dtype. A row that sees
no key gives zeros. HIGGS and AQUA-KV's are in ``kernels_cpu.coded``; ``kernels_cpu.backend`` reads
``kvquant.formats`` states with them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kernels_cpu.loader import module


def _query(q: torch.Tensor) -> torch.Tensor:
    if q.dim() != 4:
        raise ValueError(f"q must be [B, Hq, q_len, D], got shape {tuple(q.shape)}")
    q = q if q.dtype == torch.float32 else q.float()
    return q if q.stride(-1) == 1 else q.contiguous()


def _mask(mask: torch.Tensor | None, q: torch.Tensor, length: int) -> torch.Tensor | None:
    """A broadcast view ``[B, Hq, q_len, L]`` (no copy unless the dtype is neither bool nor fp32)."""
    if mask is None:
        return None
    if mask.dtype not in (torch.bool, torch.float32):
        mask = mask.float()
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    b, h, n, _ = q.shape
    try:
        return mask.expand(b, h, n, length)
    except RuntimeError as exc:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to {(b, h, n, length)}") from exc


def _scaling(scaling: float | None, q: torch.Tensor) -> float:
    return float(q.shape[-1]) ** -0.5 if scaling is None else float(scaling)


def call(name: str, q: torch.Tensor, stored: Sequence[Any], mask: torch.Tensor | None, length: int, *rest: Any):
    """``module().<name>(q32, *stored, mask as [B, Hq, q_len, length], *rest)``: every kernel's call."""
    q32 = _query(q)
    return getattr(module(), name)(q32, *stored, _mask(mask, q32, length), *rest)


def as_query(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return out if out.dtype == q.dtype else out.to(q.dtype)


def attend_fp16(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    scaling: float | None = None,
    causal: bool = False,
    keep_bits: int = 16,
) -> torch.Tensor:
    """Attention over fp16 ``k``/``v`` ``[B, Hkv, L, D]`` (``Fp16State``'s views), read in place.

    ``keep_bits`` < 16 reads every element as ``kvquant.bits.truncate`` does (the truncation method):
    the truncation happens in registers, so all 16 stored bits are still loaded.
    """
    out = call("attend_fp16", q, (k, v), mask, k.shape[-2], causal, _scaling(scaling, q), int(keep_bits))
    return as_query(out, q)


Widths = torch.Tensor | int


def _widths(w: Widths, batch: int, heads: int, n: int, d: int | None) -> torch.Tensor:
    """uint8 widths ``[B, H, n, D]`` (keys: ``d`` given; a ``[B, H, D]`` tensor is one width per
    column) or ``[B, H, n]`` (values); an int is one width for all, as a stride-0 view."""
    if isinstance(w, int):
        shape = (batch, heads, 1, d) if d is not None else (batch, heads, 1)
        return torch.full((1,) * len(shape), w, dtype=torch.uint8).expand(shape)
    if d is not None and w.dim() == 3:
        w = w.unsqueeze(2)
    return w if w.dtype == torch.uint8 else w.to(torch.uint8)


def _plane_stored(q: torch.Tensor, store: Any, k_widths: Widths) -> tuple[tuple, torch.Tensor | None, int]:
    """The key side of a plane store as the kernels take it: ``(k_a, k_b, k_c, wk, tail_k)``, the uint8
    key widths (None before the first block) and the number of keys."""
    k_a, tail_k = store.k_a, store.tail_k
    nb = 0 if k_a is None else k_a.shape[2]
    wk = None if k_a is None else _widths(k_widths, q.shape[0], tail_k.shape[1], nb, q.shape[-1])
    return (k_a, store.k_b, store.k_c, wk, tail_k), nb * 64, nb * 64 + tail_k.shape[-2]


def attend_planes(
    q: torch.Tensor,
    store: Any,
    *,
    k_widths: Widths,
    v_widths: Widths,
    mask: torch.Tensor | None = None,
    scaling: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Attention over AlignedKV's planes (a ``kvquant.formats.planes.PlaneStore``) read at given widths.

    Keys: ``k_a`` uint8 ``[B, Hkv, nb, D, 64]`` and nibble-packed ``k_b``/``k_c`` ``[B, Hkv, nb, D, 32]``
    (64-token blocks, channel-major), then the fp16 ``tail_k`` ``[B, Hkv, T, D]``; ``k_widths`` 8/12/16
    per (batch, head, channel) ``[B, Hkv, D]`` or per block ``[B, Hkv, nb, D]`` (AlignedKV+). Values:
    ``v_a`` ``[B, Hkv, nb·64, D]``, ``v_b``/``v_c`` ``[B, Hkv, nb·64, D/2]``, then ``tail_v``;
    ``v_widths`` per token ``[B, Hkv, nb·64]``. An int width reads everything at it. Tails are read
    at 16 bits, as the torch path does. Before the first block the planes are ``None``. ``tiny_k``/
    ``tiny_v`` False (no plane-A byte reads as ±0) lets the kernel skip the ±0 rule, which then cannot apply.
    """
    keys, n_full, length = _plane_stored(q, store, k_widths)
    wv = None if store.k_a is None else _widths(v_widths, q.shape[0], store.tail_k.shape[1], n_full, None)
    values = (store.v_a, store.v_b, store.v_c, wv, store.tail_v, bool(store.tiny_k), bool(store.tiny_v))
    return as_query(call("attend_planes", q, (*keys, *values), mask, length, causal, _scaling(scaling, q)), q)


def attend_aligned(
    q: torch.Tensor,
    store: Any,
    *,
    k_widths: Widths,
    v8: torch.Tensor,
    v_thresholds: tuple[float, float],
    topk: int,
    v_block: int = 1,
    block_rule: bool = False,
    mask: torch.Tensor | None = None,
    scaling: float | None = None,
    exact_scores: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """AlignedKV's step in one call: ``(out, v_widths)``, the value widths decided by
    ``kvquant.alignment.value_widths`` on fp64 scores of the keys read at ``k_widths`` (strided
    top-``topk``, ``O_est`` by the pairwise tree, exponent gaps, ``v_block``), then attention over
    the values read at them with those scores. ``v8``: fp32 ``[256]``, ``|v8|`` of each plane-A byte
    (``kvquant.alignment.high_byte_values``); ``v_thresholds`` ``(t12, t8)``. ``store`` as
    ``attend_planes``'; ``v_widths`` int32 ``[B, Hkv, nb·64]`` (the block tokens). ``block_rule``: the
    block-bound rule (``kvquant.alignment.block_value_widths``) from the store's ``v_exp`` per
    ``value_block`` tokens instead of the paper's per-token gaps. Runs of units (blocks, tokens) that the store's
    ``v_exp_max`` (a bound on every exponent field) already puts at 8 bits are settled without reading their
    bytes (``aligned_bound_units``; the same widths). Either rule decides from fp32 scores where
    their error bounds (from the store's ``k_absmax``) prove the fp64 widths, and rescores in fp64 elsewhere
    (``exact_scores``: always; ``aligned_rule_counts`` tells how often). A multi-token step needs its mask
    (the rule reads no causal limit)."""
    keys, _, length = _plane_stored(q, store, k_widths)
    values = (store.v_a, store.v_b, store.v_c, store.tail_v, bool(store.tiny_k), bool(store.tiny_v))
    rule = (v8.float().contiguous(), float(v_thresholds[0]), float(v_thresholds[1]), int(topk), int(v_block))
    rule += (store.v_exp, int(store.value_block)) if block_rule else (None, 0)
    rule += (store.v_exp_max,)
    rule += (store.k_absmax, bool(exact_scores))
    out, wv = call("attend_aligned", q, (*keys, *values), mask, length, _scaling(scaling, q), *rule)
    return as_query(out, q), wv.to(torch.int32)


def aligned_rule_counts() -> tuple[int, int]:
    """``(fp32, fp64)``: ``attend_aligned``'s (KV head, batch row) items this process decided from fp32 scores within
    their bounds, and those the bounds could not decide (rescored in fp64)."""
    fast, exact, _, _ = module().aligned_rule_counts()
    return int(fast), int(exact)


def aligned_rescored_items() -> int:
    """How many of ``aligned_rule_counts``' fp32 items (this process) were decided only after rescoring some of
    their keys in fp64 where the fp32 bounds left a width open (before, each would have gone to fp64 whole)."""
    return int(module().aligned_rule_counts()[2])


def aligned_bound_units() -> int:
    """How many value units (the block rule's blocks, the paper's rule's tokens) ``attend_aligned`` (this process)
    settled at 8 bits from the store's ``v_exp_max`` alone, without reading their own exponent bytes or plane-A
    fields (the widths are the same either way)."""
    return int(module().aligned_rule_counts()[3])


def key_widths(
    q: torch.Tensor, k_absmax: torch.Tensor, thresholds: tuple[float, float], k_exp: torch.Tensor | None = None
) -> torch.Tensor:
    """``kvquant.alignment.key_widths`` (``k_exp`` None: per column, ``[B, Hkv, D]``) or ``block_key_widths``
    (AlignedKV+'s block exponent fields ``k_exp`` uint8 ``[B, Hkv, nb, D]``: ``[B, Hkv, nb, D]``) in one call,
    the same widths as uint8 (what the plane kernels take). Why: the torch rule is a dozen small ops a layer
    and step, each with its dispatch overhead. ``q`` fp32, fp16 or bf16 (exact in fp32; the torch rule reads
    fp64 queries in fp64)."""
    if q.dtype == torch.float64:
        raise ValueError("key_widths: an fp64 query would be rounded to fp32 here; use kvquant.alignment.key_widths")
    return module().key_widths(_query(q), k_absmax, k_exp, float(thresholds[0]), float(thresholds[1]))


def width_counts(wk: torch.Tensor, wv: torch.Tensor, first: int, n_full: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``kvquant.methods.alignedkv.head_width_counts`` in one pass over the widths (uint8 or int32): per KV head
    the (key token, channel) and value-token counts of the window ``first..n_full`` at 8 / 12 / 16 bits, int64
    ``[H, 3]`` each, the same integers."""
    counts = module().width_counts(wk, wv, int(first), int(n_full))
    return counts[0], counts[1]


def read_plane_keys(
    k_a: torch.Tensor | None,
    k_b: torch.Tensor | None,
    k_c: torch.Tensor | None,
    tail_k: torch.Tensor,
    *,
    k_widths: Widths,
    tiny_k: bool = True,
) -> torch.Tensor:
    """Every key ``[B, Hkv, L, D]`` as fp32, the planes read at ``k_widths`` (as ``attend_planes`` takes
    them) and the tail at 16 bits: bit for bit ``PlaneStore.read_keys(k_widths, torch.float32)``, in
    one pass. What the value rule's scores are computed from on the cpu backend."""
    batch, heads, _, d = tail_k.shape
    nb = 0 if k_a is None else k_a.shape[2]
    wk = None if k_a is None else _widths(k_widths, batch, heads, nb, d)
    return module().read_plane_keys(k_a, k_b, k_c, wk, tail_k, bool(tiny_k))


def exponent_gaps(e_o: torch.Tensor, v_high: torch.Tensor) -> torch.Tensor:
    """``kvquant.alignment.exponent_gaps`` in one pass (int16 ``[B, Hkv, L]``, the same integers):
    ``min_c (e_o[c] − exponent_field(v_high[..., t, c]))`` for ``e_o`` int16 ``[B, Hkv, D]``."""
    return module().exponent_gaps(e_o, v_high)


Run = tuple[int, int, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class CodeStream:
    """One of K or V as the integer-code kernels read it: ``codes`` uint8 ``[B, Hkv, T, D·bits/8]`` with fp16
    ``scale``/``zero`` (keys ``[B, Hkv, T/G, 1, D]``: per channel, groups of ``G`` tokens; values
    ``[B, Hkv, T, D/G, 1]``: per token, groups of ``G`` channels; all None before the first flush), then the
    fp16 ``window`` ``[B, Hkv, w, D]``. GEAR's: the exact outliers (``index`` int32 ``[B, Hkv, n]`` = token·D
    + channel, ``value`` fp16) and the low-rank ``runs`` ``(start, seg_len, A, B)``, ``A``
    ``[B, Hkv, n_seg, seg_len, r]`` and ``B`` ``[B, Hkv, n_seg, D, r]`` fp16."""

    codes: torch.Tensor | None
    scale: torch.Tensor | None
    zero: torch.Tensor | None
    window: torch.Tensor
    index: torch.Tensor | None = None
    value: torch.Tensor | None = None
    runs: Sequence[Run] = ()

    @property
    def length(self) -> int:
        return self.window.shape[-2] + (0 if self.codes is None else self.codes.shape[-2])

    def quantized(self) -> tuple:
        return self.codes, self.scale, self.zero, self.window

    def sparse(self) -> tuple:
        runs = self.runs
        return (
            self.index,
            self.value,
            [int(r[0]) for r in runs],
            [int(r[1]) for r in runs],
            [r[2] for r in runs],
            [r[3] for r in runs],
        )


def attend_kivi(
    q: torch.Tensor,
    k: CodeStream,
    v: CodeStream,
    *,
    bits: int,
    group_size: int,
    mask: torch.Tensor | None = None,
    scaling: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Attention over a KIVI store: quantized keys then the fp16 key window, likewise for values. Keys
    leave the window in blocks, values one at a time, so their coded lengths may differ; ``k.length`` must
    equal ``v.length``. ``kernels_cpu.backend.kivi_tensors(state)`` gives all of these."""
    stored = (*k.quantized(), *v.quantized(), int(bits), int(group_size))
    return as_query(call("attend_kivi", q, stored, mask, k.length, causal, _scaling(scaling, q)), q)


def attend_gear(
    q: torch.Tensor,
    k: CodeStream,
    v: CodeStream,
    *,
    bits: int,
    group_size: int,
    mask: torch.Tensor | None = None,
    scaling: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Attention over a GEAR store: ``attend_kivi``'s codes and windows, plus per stream the exact outliers
    (they replace the reconstruction there) and the low-rank runs, applied as ``q·(A Bᵀ)`` and ``(p A) Bᵀ``
    without expanding ``A Bᵀ``. ``kernels_cpu.backend.gear_tensors(state)`` gives all of these."""
    stored = (*k.quantized(), *k.sparse(), *v.quantized(), *v.sparse(), int(bits), int(group_size))
    return as_query(call("attend_gear", q, stored, mask, k.length, causal, _scaling(scaling, q)), q)
