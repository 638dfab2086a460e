"""``kernels_cupy.aquakv`` line for line in torch, on any device: what the CPU tests check its arithmetic with.

``reconstruct`` is ``aquakv.reconstruct`` with ``higgs_decode`` emulated: per quantizer group the lanes' codes
read as the kernel reads them (``higgs.group_codes``), looked up in the grid, the S_p butterflies stage by
stage, the outer mix and signs / √P (``higgs_emulate.unrotated``, as ``higgs_unrotate`` and ``higgs_mixed``),
times the scale, plus the bias, the group's real channels written into the workspace; then the very
``aquakv.add_predictions`` the GPU path runs. ``attend`` is ``higgs_emulate.attend``, which reads an AQUA-KV
state's rows as ``higgs_rows_r*`` does; ``aquakv_encode`` is ``aquakv.encode`` (torch already). With these
three as a backend's ops module a model's AQUA-KV cache runs the kernels' arithmetic on a CPU.
"""

from __future__ import annotations

import torch

from kernels_cupy.aquakv import Pred, add_predictions, decode_grid
from kernels_cupy.aquakv import encode as aquakv_encode
from kernels_cupy.higgs import group_codes
from kernels_cupy.higgs_emulate import attend, unrotated

__all__ = ["aquakv_encode", "aquakv_reconstruct", "attend", "decode"]


def decode(
    codes: torch.Tensor,
    scales: torch.Tensor,
    grid: torch.Tensor,
    signs: torch.Tensor,
    outer: torch.Tensor,
    code_bits: int,
    group: int,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """``higgs_decode`` for one side: ``out [B, n, C] = s · unrotated(grid[codes]) (+ bias)`` group by group, in
    the launch's groups (``decode_grid``; every row is decoded alike, so the row order is not emulated)."""
    b, n, c = out.shape
    p = signs.shape[0]
    groups = decode_grid(b * n, p, -(-c // group))[1]
    for gi in range(groups):
        y = grid.float()[group_codes(codes, code_bits, gi, p)].reshape(b, n, p)
        x = scales[..., gi].float().unsqueeze(-1) * unrotated(y, signs, outer)
        cn = min(group, c - gi * group)
        part = x[..., :cn]
        if bias is not None:
            part = part + bias.float()[gi * group : gi * group + cn]
        out[..., gi * group : gi * group + cn] = part


def aquakv_reconstruct(
    k_codes: torch.Tensor,
    k_scales: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor,
    *,
    grid: torch.Tensor,
    signs: torch.Tensor,
    outer: torch.Tensor,
    code_bits: int,
    group: int,
    pred_k: Pred = None,
    pred_v: Pred = None,
    prev_k: torch.Tensor | None = None,
    prev_v: torch.Tensor | None = None,
    out_k: torch.Tensor | None = None,
    out_v: torch.Tensor | None = None,
    channels: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``aquakv.reconstruct`` (the cache's ``aquakv_reconstruct`` hook) with ``higgs_decode`` emulated."""
    if out_k is None or out_v is None:
        c = channels if channels is not None else (pred_k or pred_v)[0].shape[1]
        out_k = torch.empty(*k_codes.shape[:2], c) if out_k is None else out_k
        out_v = torch.empty_like(out_k) if out_v is None else out_v
    for codes, scales, pred, out in ((k_codes, k_scales, pred_k, out_k), (v_codes, v_scales, pred_v, out_v)):
        decode(codes, scales, grid, signs, outer, code_bits, group, None if pred is None else pred[1], out)
    add_predictions(out_k, out_v, pred_k, pred_v, prev_k, prev_v)
    return out_k, out_v
