"""The CuPy kernels as a kvquant backend (imported by ``kvquant.backends`` on demand).

``attend(state, rule, query, mask, scaling)`` runs AlignedKV's step on the GPU (``kernels_cupy.ops``) over
a ``kvquant.formats.planes.PlaneStore`` by an ``AlignedRule``, KIVI's and GEAR's decode attention over
their codes (``kernels_cupy.codes``), HIGGS's, keys coded before or after RoPE (``kernels_cupy.higgs``,
methods ``higgs`` and ``higgs_post_rope``), and AQUA-KV's over its cache's decoded workspace
(``kernels_cupy.aquakv``, whose ``aquakv_reconstruct`` and ``aquakv_encode`` the cache calls through
``Backend.kernel``); ``STATES`` gives layers the plane store whose appends run the pack kernel;
``launch_count`` the kernels launched so far (``kvquant.analysis.timing`` reads it per step).

``auto`` picks these kernels for the formats in ``AUTO``: those whose gpu tests all passed in
``scripts/gpu_check.sh`` (H100, 2026-12-06) and whose decode step is measured faster than the torch
reference's (planes: 0.73x DynamicCache at 32K there, the torch path 6.9x on an H200 in issue 32; kivi2:
0.90x / 0.83x the torch path's step at 4K / 32K). GEAR (no torch step measured beside it), HIGGS and
AQUA-KV (their end-to-end tests ran an fp16 model against fp32 bounds and failed; the fp32 versions have not
run on a GPU yet) stay opt-in: ``method.backend=cupy``.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels_cupy import aquakv, codes, higgs
from kernels_cupy.aquakv import encode as aquakv_encode
from kernels_cupy.aquakv import reconstruct as aquakv_reconstruct
from kernels_cupy.loader import check_device, cupy_status, launch_count
from kernels_cupy.store import KernelCodesState, KernelPlaneStore
from kvquant.backends import Backend, register_backend
from kvquant.formats.base import Reads, causal_allowed

__all__ = ["ATTEND", "STATES", "aquakv_encode", "aquakv_reconstruct", "attend", "launch_count", "limits"]

STATES = {"planes": KernelPlaneStore, "kivi": KernelCodesState}


#: the formats ``backend=auto`` may run here (module docstring)
AUTO = frozenset({"planes", "kivi"})

BLOCK_RULE_V_BLOCKS = (32, 64)  # the block rule's v_block here: whole warps of 32 tokens at one width


def limits(fmt: str, geometry: Any, rule: Any) -> list[str]:
    """What of a model or rule these kernels lack: head dims off the plane layout, logit soft-capping, sliding
    windows, the paper's value rule per block (``v_block`` > 1 with ``value_rule`` token), and the block rule's
    ``v_block`` other than 32 or 64; the code kernels' own (``kernels_cupy.codes.limits``), the HIGGS kernel's
    (``kernels_cupy.higgs.limits``: group and head shapes) and AQUA-KV's (``kernels_cupy.aquakv.limits``)."""
    if fmt in ("kivi", "gear"):
        return codes.limits(fmt, geometry, rule)
    if fmt == "higgs":
        return higgs.limits(fmt, geometry, rule)
    if fmt == "aquakv":
        return aquakv.limits(fmt, geometry, rule)
    missing = []
    head_dim = getattr(geometry, "head_dim", None)
    if head_dim is not None and (head_dim % 8 or not 8 <= head_dim <= 256):
        missing.append(f"head_dim {head_dim} (the plane kernels take multiples of 8 up to 256)")
    if geometry.softcap is not None:
        missing.append(f"attention-logit soft-capping ({geometry.softcap})")
    if geometry.sliding_window is not None:
        missing.append(f"sliding-window layers ({geometry.sliding_window})")
    if rule is not None:
        block_rule = getattr(rule, "value_rule", "token") == "block"
        if block_rule and rule.v_block not in BLOCK_RULE_V_BLOCKS:
            missing.append(f"the block rule at v_block={rule.v_block} (v_block a multiple of 32 here: 32 or 64)")
        elif not block_rule and rule.v_block > 1:
            missing.append(f"value widths per block (v_block={rule.v_block})")
    return missing


def attend_planes(store: Any, rule: Any, query: torch.Tensor, mask, scaling: float) -> tuple[torch.Tensor, Reads]:
    """K widths, QKᵀ, softmax, V widths and SV on the GPU in three launches; a multi-token step without a
    mask is causal, spelled out for the kernels."""
    from kernels_cupy.ops import aligned_attention

    value_rule = getattr(rule, "value_rule", "token")
    if value_rule == "block" and store.value_block != rule.v_block:
        raise ValueError(f"the store keeps value exponents per {store.value_block} tokens, the rule {rule.v_block}")
    if mask is None and query.shape[2] > 1:
        mask = causal_allowed(query.shape[2], store.n_tokens, query.device)
    k_tiers, v_tiers = rule.k_tiers(query.shape[-1]), rule.v_tiers(store.n_tokens)
    out, wk, wv = aligned_attention(
        store, query, mask, scaling, k_tiers, v_tiers, rule.topk, rule.blockwise, value_rule=value_rule
    )
    return out.to(query.dtype), Reads(wk, wv)


ATTEND = {
    "planes": attend_planes,
    "kivi": codes.attend_codes,
    "gear": codes.attend_gear,
    "higgs": higgs.attend_higgs,
    "aquakv": aquakv.attend_aquakv,
}


def attend(state: Any, rule: Any, query: torch.Tensor, mask, scaling: float) -> tuple[torch.Tensor, Reads]:
    """The backend protocol (``kvquant.backends.Backend.attend``): the kernels of ``state``'s format."""
    check_device(query)
    return ATTEND[state.format](state, rule, query, mask, scaling)


register_backend(Backend("cupy", "cuda", frozenset(ATTEND), cupy_status, "kernels_cupy.backend", limits, auto=AUTO))
