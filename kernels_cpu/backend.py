"""The C++ kernels as a kvquant backend: ``attend(state, rule, query, mask, scaling)`` for every format.

Imported by ``kvquant.backends`` on demand, it registers itself. It reads ``kvquant.formats`` states
(never layers, methods or caches): each ``*_tensors(state)`` turns a state into the arguments of the
kernel of its format (``kernels_cpu.ops``, ``kernels_cpu.coded``).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from kernels_cpu import coded, ops
from kernels_cpu.coded import aquakv_encode, aquakv_reconstruct
from kernels_cpu.loader import status
from kvquant.alignment import high_byte_values
from kvquant.backends import Backend, register_backend
from kvquant.formats.base import Reads, causal_allowed
from kvquant.formats.planes import decide_widths

__all__ = ["FORMATS", "aquakv_encode", "aquakv_reconstruct", "attend", "limits"]

FORMATS = frozenset({"fp16", "kivi", "gear", "planes", "higgs", "aquakv"})
FUSED_SCORE_BYTES = 1 << 28
"""Most bytes of fp64 scores (query rows of every head × tokens × 8) ``attend_aligned`` may hold at once;
a step needing more takes the torch rule (its threads hold one KV head's rows each, so this bounds them)."""
#: queries in one forward from which a windowed format's kernel is slower than decoding the history once
PROMPT_QUERIES = 16


def limits(fmt: str, geometry: Any, rule: Any) -> list[str]:
    """What of a model these kernels lack: logit soft-capping everywhere; sliding windows except on fp16
    (which reads the step's window as a view); HIGGS groups of whole even heads <= 256, AQUA-KV even
    heads <= 256 (RoPE pairs)."""
    missing = []
    if geometry.softcap is not None:
        missing.append(f"attention-logit soft-capping ({geometry.softcap})")
    if fmt != "fp16" and geometry.sliding_window is not None:
        missing.append(f"sliding-window layers ({geometry.sliding_window})")
    d = geometry.head_dim
    if fmt == "higgs" and (rule.group % d or d % 2 or d > 256):
        missing.append(f"groups of {rule.group} channels over heads of {d} (it needs whole heads, even, <= 256)")
    elif fmt == "aquakv" and (d % 2 or d > 256):
        missing.append(f"heads of {d} channels (it needs an even head dim <= 256)")
    return missing


def _causal(mask: torch.Tensor | None, query: torch.Tensor) -> bool:
    return mask is None and query.shape[2] > 1


def attend_fp16(state: Any, rule: Any, query: torch.Tensor, mask, scaling: float) -> tuple[torch.Tensor, Reads]:
    keys, values = state.step
    keep = 16 if rule is None else rule.keep_bits
    return ops.attend_fp16(query, keys, values, mask, scaling, _causal(mask, query), keep_bits=keep), Reads()


def kivi_tensors(state: Any) -> dict[str, Any]:
    """``attend_kivi``'s store arguments from a ``kvquant.formats.codes.CodesState``."""
    return {"k": code_stream(state.k), "v": code_stream(state.v), "bits": state.bits, "group_size": state.group_size}


def gear_tensors(state: Any) -> dict[str, Any]:
    """``attend_gear``'s store arguments from a ``kvquant.formats.gear.GearState``."""
    return {**kivi_tensors(state), "k": code_stream(state.k, sparse=True), "v": code_stream(state.v, sparse=True)}


def code_stream(stream: Any, sparse: bool = False) -> ops.CodeStream:
    """One ``kvquant.formats.window.Stream`` as the code kernels read it (GEAR's outliers and runs too)."""
    if stream.fp16.sinks is not None:
        raise ValueError("kernels_cpu: a window with attention sinks is not supported")
    store, quant = stream.store, stream.store.q
    parts = (None, None, None) if quant is None else (quant.codes, quant.scale, quant.zero)
    if not sparse:
        return ops.CodeStream(*parts, stream.window)
    runs = [(run.start, run.seg_len, run.a, run.b) for run in store.runs]
    return ops.CodeStream(*parts, stream.window, store.index, store.value, runs)


def attend_kivi(state: Any, rule: Any, query: torch.Tensor, mask, scaling: float) -> tuple[torch.Tensor, Reads]:
    return ops.attend_kivi(
        query, **kivi_tensors(state), mask=mask, scaling=scaling, causal=_causal(mask, query)
    ), Reads()


def attend_gear(state: Any, rule: Any, query: torch.Tensor, mask, scaling: float) -> tuple[torch.Tensor, Reads]:
    return ops.attend_gear(
        query, **gear_tensors(state), mask=mask, scaling=scaling, causal=_causal(mask, query)
    ), Reads()


@cache
def v8_magnitudes() -> torch.Tensor:
    """``|v8|`` of every plane-A byte: the value rule's table for ``attend_aligned``."""
    return high_byte_values(torch.arange(256, dtype=torch.uint8))


def plane_keys(store: Any, wk: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The keys read at ``wk`` in one C++ pass: the same bits as ``PlaneStore.read_keys``."""
    return ops.read_plane_keys(store.k_a, store.k_b, store.k_c, store.tail_k, k_widths=wk, tiny_k=store.tiny_k).to(
        dtype
    )


def attend_planes(store: Any, rule: Any, query: torch.Tensor, mask, scaling: float) -> tuple[torch.Tensor, Reads]:
    """AlignedKV's step: the key rule, then the value rule on fp64 scores and the attention, one C++ call each
    (the bits-read histogram's per-head counts a third). Where the fused call cannot stand in for the torch
    rule exactly — a bf16 query (the rule reads keys in the query's dtype), a sliding view, or scores too
    large to hold — the torch rule decides (keys and exponent gaps read in C++, the same bits) and
    ``attend_planes`` reads. A multi-token step without a mask (a prompt run whole) is causal: the fused call
    gets it spelled out."""
    q_rows = query.shape[1] * query.shape[2]
    n, first = store.n_tokens, store.first_visible
    fused = query.dtype in (torch.float32, torch.float16) and first == 0 and 8 * q_rows * n <= FUSED_SCORE_BYTES
    if not fused:
        _, wk, wv = decide_widths(store, rule, query, mask, scaling, plane_keys, ops.exponent_gaps)
        out = ops.attend_planes(
            query,
            store,
            k_widths=wk,
            v_widths=wv,
            mask=mask,
            scaling=scaling,
            causal=_causal(mask, query),
        )
        return out, Reads(wk, wv, ops.width_counts(wk, wv, first, store.n_full))
    if _causal(mask, query):  # the kernel's rule reads no causal limit
        mask = causal_allowed(query.shape[2], n, query.device)
    blocks = store.k_exp if rule.blockwise else None
    wk = ops.key_widths(query, store.k_absmax, rule.k_tiers(query.shape[-1]), blocks)
    out, wv = ops.attend_aligned(
        query,
        store,
        k_widths=wk,
        v8=v8_magnitudes(),
        v_thresholds=rule.v_tiers(store.visible),
        topk=rule.topk,
        v_block=rule.v_block,
        block_rule=rule.value_rule == "block",
        mask=mask,
        scaling=scaling,
    )
    return out, Reads(wk, wv, ops.width_counts(wk, wv, first, store.n_full))


def higgs_tensors(state: Any) -> dict[str, Any]:
    """``attend_higgs``' store arguments from a ``kvquant.formats.higgs.HiggsState`` (its codes as
    stored, the step's RoPE inputs, sinks and window); AQUA-KV's codes are of a predictor's residual,
    which this kernel does not add back: refused."""
    if state.format != "higgs":
        raise ValueError("kernels_cpu: HIGGS codes of a predictor residual (AQUA-KV) are not supported")
    quant, qk, qv = state.quant, state.qk, state.qv
    return {
        "k_codes": None if qk is None else qk.codes,
        "k_scales": None if qk is None else qk.scales,
        "v_codes": None if qv is None else qv.codes,
        "v_scales": None if qv is None else qv.scales,
        "cos": None,
        "sin": None,
        **state.rope,
        **window_tensors(state),
        "grid": quant.grid,
        "signs": quant.signs,
        "outer": quant.outer,
        "code_bits": quant.code_bits,
        "group": quant.group,
    }


def window_tensors(state: Any) -> dict[str, Any]:
    return {
        "k_sinks": state.k_win.sinks,
        "v_sinks": state.v_win.sinks,
        "k_recent": state.k_win.recent,
        "v_recent": state.v_win.recent,
    }


def aquakv_tensors(state: Any) -> dict[str, Any]:
    """``attend_aquakv``'s store arguments from a ``kvquant.formats.higgs.AquaKVState``: the rows its
    cache reconstructed this forward, the step's RoPE inputs, sinks and window."""
    rows = state.rows
    return {
        "k_rows": None if rows is None else rows[0],
        "v_rows": None if rows is None else rows[1],
        "cos": None,
        "sin": None,
        **(state.rope if rows is not None else {}),
        **window_tensors(state),
    }


def attend_higgs(state: Any, rule: Any, query: torch.Tensor, mask, scaling: float) -> tuple[torch.Tensor, Reads]:
    causal = _causal(mask, query)
    return coded.attend_higgs(query, **higgs_tensors(state), mask=mask, scaling=scaling, causal=causal), Reads()


def attend_aquakv(state: Any, rule: Any, query: torch.Tensor, mask, scaling: float) -> tuple[torch.Tensor, Reads]:
    causal = _causal(mask, query)
    return coded.attend_aquakv(query, **aquakv_tensors(state), mask=mask, scaling=scaling, causal=causal), Reads()


ATTEND = {
    "fp16": attend_fp16,
    "kivi": attend_kivi,
    "gear": attend_gear,
    "planes": attend_planes,
    "higgs": attend_higgs,
    "aquakv": attend_aquakv,
}


def attend(state: Any, rule: Any, query: torch.Tensor, mask, scaling: float) -> tuple[torch.Tensor, Reads]:
    """The backend protocol (``kvquant.backends.Backend.attend``): the kernel of ``state``'s format."""
    return ATTEND[state.format](state, rule, query, mask, scaling)


register_backend(Backend("cpu", "cpu", FORMATS, status, "kernels_cpu.backend", limits))
