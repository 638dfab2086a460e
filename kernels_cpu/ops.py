"""The Python face of the kernels: one function per storage format, over the tensors a layer holds.

Each takes the query ``[B, Hq, q_len, D]`` (any float dtype; computed in fp32), the layer's stored
tensors untouched, an optional mask broadcastable to ``[B, Hq, q_len, L]`` (bool: True = attend,
or additive float), ``scaling`` (default ``D**-0.5``) and ``causal`` (query ``i`` sees keys
``t <= L - q_len + i``; for a mask-less multi-token step). GQA: query head ``j`` reads KV head
``j // (Hq / Hkv)``, as transformers' ``repeat_kv`` does. Returns ``[B, Hq, q_len, D]`` in the
query's dtype. A row that sees no key gives zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
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


def attend_fp16(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    scaling: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Attention over fp16 ``k``/``v`` ``[B, Hkv, L, D]`` (``Fp16Layer.keys``/``.values``), read in place."""
    q32 = _query(q)
    out = module().attend_fp16(q32, k, v, _mask(mask, q32, k.shape[-2]), causal, _scaling(scaling, q))
    return out if out.dtype == q.dtype else out.to(q.dtype)


def attend_kivi(
    q: torch.Tensor,
    k_codes: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    k_zero: torch.Tensor | None,
    k_window: torch.Tensor,
    v_codes: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    v_zero: torch.Tensor | None,
    v_window: torch.Tensor,
    *,
    bits: int,
    group_size: int,
    mask: torch.Tensor | None = None,
    scaling: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Attention over a KIVI store: quantized keys then the fp16 key window, likewise for values.

    Keys: ``k_codes`` uint8 ``[B, Hkv, Tk, D·bits/8]``, ``k_scale``/``k_zero`` fp16
    ``[B, Hkv, Tk/G, 1, D]`` (per channel, groups of ``G`` tokens). Values: ``v_codes``
    ``[B, Hkv, Tv, D·bits/8]``, ``v_scale``/``v_zero`` ``[B, Hkv, Tv, D/G, 1]`` (per token, groups of
    ``G`` channels). ``Tk`` and ``Tv`` may differ; ``Tk + window length`` must equal ``Tv + window``.
    A part not quantized yet is ``None``. ``kivi_tensors(layer)`` gives all of these from a layer.
    """
    q32 = _query(q)
    length = k_window.shape[-2] + (0 if k_codes is None else k_codes.shape[-2])
    out = module().attend_kivi(
        q32,
        k_codes,
        k_scale,
        k_zero,
        k_window,
        v_codes,
        v_scale,
        v_zero,
        v_window,
        int(bits),
        int(group_size),
        _mask(mask, q32, length),
        causal,
        _scaling(scaling, q),
    )
    return out if out.dtype == q.dtype else out.to(q.dtype)


def _streams(layer: Any) -> tuple[tuple[str, Any], tuple[str, Any]]:
    """The layer's (name, stream) pairs; the kernels take no attention sinks (KIVI and GEAR keep none)."""
    pairs = (("k", layer.k_stream), ("v", layer.v_stream))
    for _, stream in pairs:
        if getattr(getattr(stream, "fp16", None), "sinks", None) is not None:
            raise ValueError("kernels_cpu: a window with attention sinks is not supported")
    return pairs


def kivi_tensors(layer: Any) -> dict[str, Any]:
    """``attend_kivi``'s store arguments from a ``kvquant.methods.kivi.KiviLayer`` (duck-typed)."""
    args: dict[str, Any] = {"bits": layer.bits, "group_size": layer.group_size}
    for name, stream in _streams(layer):
        quant = stream.store.q
        args[f"{name}_codes"] = None if quant is None else quant.codes
        args[f"{name}_scale"] = None if quant is None else quant.scale
        args[f"{name}_zero"] = None if quant is None else quant.zero
        args[f"{name}_window"] = stream.window
    return args


Run = tuple[int, int, torch.Tensor, torch.Tensor]


def attend_gear(
    q: torch.Tensor,
    k_codes: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    k_zero: torch.Tensor | None,
    k_window: torch.Tensor,
    k_index: torch.Tensor | None,
    k_value: torch.Tensor | None,
    k_runs: Sequence[Run],
    v_codes: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    v_zero: torch.Tensor | None,
    v_window: torch.Tensor,
    v_index: torch.Tensor | None,
    v_value: torch.Tensor | None,
    v_runs: Sequence[Run],
    *,
    bits: int,
    group_size: int,
    mask: torch.Tensor | None = None,
    scaling: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Attention over a GEAR store: ``attend_kivi``'s codes and windows, plus per stream the exact
    outliers (``index`` int32 ``[B, Hkv, n]`` = token·D + channel, ``value`` fp16 ``[B, Hkv, n]``; they
    replace the reconstruction there) and the low-rank runs ``(start, seg_len, A, B)`` with ``A``
    ``[B, Hkv, n_seg, seg_len, r]`` and ``B`` ``[B, Hkv, n_seg, D, r]`` fp16, applied as ``q·(A Bᵀ)``
    and ``(p A) Bᵀ`` without expanding ``A Bᵀ``. ``gear_tensors(layer)`` gives all of these.
    """
    q32 = _query(q)
    length = k_window.shape[-2] + (0 if k_codes is None else k_codes.shape[-2])

    def runs(rs: Sequence[Run]) -> list:
        return [[int(r[0]) for r in rs], [int(r[1]) for r in rs], [r[2] for r in rs], [r[3] for r in rs]]

    out = module().attend_gear(
        q32,
        k_codes,
        k_scale,
        k_zero,
        k_window,
        k_index,
        k_value,
        *runs(k_runs),
        v_codes,
        v_scale,
        v_zero,
        v_window,
        v_index,
        v_value,
        *runs(v_runs),
        int(bits),
        int(group_size),
        _mask(mask, q32, length),
        causal,
        _scaling(scaling, q),
    )
    return out if out.dtype == q.dtype else out.to(q.dtype)


def gear_tensors(layer: Any) -> dict[str, Any]:
    """``attend_gear``'s store arguments from a ``kvquant.methods.gear.GearLayer`` (duck-typed)."""
    args: dict[str, Any] = {"bits": layer.bits, "group_size": layer.group_size}
    for name, stream in _streams(layer):
        store, quant = stream.store, stream.store.q
        args[f"{name}_codes"] = None if quant is None else quant.codes
        args[f"{name}_scale"] = None if quant is None else quant.scale
        args[f"{name}_zero"] = None if quant is None else quant.zero
        args[f"{name}_window"] = stream.window
        args[f"{name}_index"] = store.index
        args[f"{name}_value"] = store.value
        args[f"{name}_runs"] = [(run.start, run.seg_len, run.a, run.b) for run in store.runs]
    return args
