"""AQUA-KV on the GPU: the cache's per-forward reconstruction and decode attention over it (``higgs.cu``).

AQUA-KV's codes are of a cross-layer predictor's residual, and the next layer's predictor reads this
layer's reconstruction of every coded token at every step, so the cache rebuilds each layer once per
forward into a reused fp32 workspace (``AquaKVCache.fill_workspace``, as on the C++ kernels) through
``Backend.kernel("aquakv_reconstruct")``:

- ``reconstruct``: ``higgs_decode`` writes ``deHIGGS(codes) + bias`` (grid points, the inverse rotation,
  signs and scale) of keys and values straight into the workspace, one launch; then cuBLAS adds the
  predictions in place (``addmm_``: keys from the previous layer's keys, values from this layer's keys
  and the previous layer's values, the weight's two row blocks: no concat), under torch's own fp32
  matmul settings (TF32 only where ``torch.backends.cuda.matmul.allow_tf32`` allows it, as the torch path).
- ``attend_aquakv`` (format ``aquakv``): ``higgs_rows_r*`` over the fp16 sinks, the workspace rows (keys
  rotated by RoPE in registers from the int32 positions or the step's tables, as ``higgs_pre_r*``) and the
  fp16 window, split over CTAs with ``higgs_merge``'s log-sum-exp (``higgs.launches``: one KV head a group,
  ``higgs.rows_shape``). More than ``PROMPT_QUERIES`` queries take the torch reference over the same rows.
- ``encode``: the torch rule (``encode_pair``) on the device, with the predictor weights copied there once.

The predictor weights, grid, signs and outer factor are copied to the device once per tensor (not per
step). Importing this module needs torch and numpy only; cupy is imported at the first launch.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch

from kernels_cupy.codes import kernel_arg
from kernels_cupy.codes import limits as code_limits
from kernels_cupy.higgs import (
    CODE_BITS,
    COORDS_PER_LANE,
    HEAD_DIM_MAX,
    PADDED_MAX,
    SOURCE,
    THREADS,
    ZBUF,
    lane_groups,
    lanes_per_token,
    launched,
    rope_kind,
)
from kernels_cupy.loader import check_device, i32, launch, ptr
from kvquant.formats.base import Reads
from kvquant.quant.device import on_device as placed

Pred = tuple[torch.Tensor, torch.Tensor] | None
#: HIGGS bits a value of each code width (a grid of 2 coordinates and 2^code_bits points)
BITS_OF_CODE = {4: 2, 6: 3, 8: 4}


def limits(fmt: str, geometry: Any, rule: Any) -> list[str]:
    """What of a model these kernels lack, one phrase each: logit soft-capping, sliding-window layers and head
    dims not a multiple of 8 up to 256 (``codes.limits``: the attention's lanes of 8 channels), and groups
    padded to a size not a multiple of 8 or above 1024 (``higgs_decode``'s lanes). Groups may split heads:
    the attention reads decoded rows by head."""
    missing = code_limits("aquakv", geometry, rule)
    if rule is not None and (rule.padded_group % COORDS_PER_LANE or rule.padded_group > PADDED_MAX):
        missing.append(
            f"groups padded to {rule.padded_group} channels (the decode needs a multiple of 8 up to {PADDED_MAX})"
        )
    return missing


def check_state(state: Any, d: int, hkv: int) -> None:
    """What ``attend_aquakv`` assumes of a state, one ``ValueError`` line otherwise: an AQUA-KV state whose
    coded tokens were reconstructed this forward (``rows``: fp32 ``[B, n_codes, Hkv·D]``), head dim as
    ``limits`` says, and this step's RoPE inputs covering whole heads."""
    if state.format != "aquakv":
        raise ValueError(f"kernels_cupy: attend_aquakv reads AQUA-KV states, got format {state.format!r}")
    if d % COORDS_PER_LANE or not COORDS_PER_LANE <= d <= HEAD_DIM_MAX:
        raise ValueError(f"kernels_cupy: the AQUA-KV kernel takes head_dim a multiple of 8 up to 256, got {d}")
    if state.qk is None:
        return
    rows = state.rows
    want = (state.qk.codes.shape[0], state.n_codes, hkv * d)
    if rows is None or any(r.dtype != torch.float32 or tuple(r.shape) != want for r in rows):
        got = None if rows is None else [(tuple(r.shape), r.dtype) for r in rows]
        raise ValueError(f"kernels_cupy: AQUA-KV codes without this forward's fp32 rows {want} (got {got})")
    kind, rope = rope_kind(state), state.rope
    if kind == 0 or (kind == 1 and rope.get("positions") is None):
        raise ValueError("kernels_cupy: AQUA-KV rows without this step's RoPE inputs (state.rope)")
    if kind == 1 and tuple(rope["inv_freq"].shape) != (d // 2,):
        raise ValueError(f"kernels_cupy: RoPE inv_freq of shape {tuple(rope['inv_freq'].shape)} over heads of {d}")
    if kind == 2 and (rope["cos"].shape[-1] != d or rope["sin"].shape != rope["cos"].shape):
        raise ValueError(f"kernels_cupy: RoPE tables of {rope['cos'].shape[-1]} channels over heads of {d}")


def attend_aquakv(
    state: Any, rule: Any, query: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> tuple[torch.Tensor, Reads]:
    """The backend protocol for format ``aquakv`` (an ``AquaKVState`` whose ``rows`` the cache filled this
    forward): ``(out, Reads())``, ``kvquant.formats.higgs.attend`` up to fp32 summation order."""
    check_state(state, query.shape[-1], state.k_win.recent.shape[1])
    return launched(state, query, mask, scaling, "AQUA-KV")


# ---------------------------------------------------------------- the reconstruction (``higgs_decode`` + cuBLAS)


def on_device(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """``t`` as a contiguous fp32 tensor on ``device``, copied once per tensor (quantizer tables, predictor
    weights: held by the method, read every step; ``kvquant.quant.device.on_device``) and dropped with it."""
    return None if t is None else kernel_arg(placed(t, device, torch.float32))


def pred_on_device(pred: Pred, device: torch.device) -> Pred:
    return None if pred is None else (on_device(pred[0], device), on_device(pred[1], device))


def decode_grid(rows: int, p: int, groups: int) -> tuple[int, int, int]:
    """``higgs_decode``'s grid: ``(CTAs over the rows, groups, 2 sides)``, a row per lane group."""
    return -(-rows // lane_groups(p)), groups, 2


def decode_shared_bytes(p: int, n_grid: int, m: int) -> int:
    """``higgs_decode``'s dynamic shared memory: the grid's points, signs / √P, the outer factor and the two
    rounds of coordinates of ``higgs_unrotate``."""
    return 4 * (2 * n_grid + p + m * m + ZBUF)


def decode_launch(
    k_codes: torch.Tensor,
    k_scales: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    code_bits: int,
    group: int,
    bias_k: torch.Tensor | None,
    bias_v: torch.Tensor | None,
    out_k: torch.Tensor,
    out_v: torch.Tensor,
) -> tuple[tuple, tuple]:
    """``(grid, shared memory, args)`` of ``higgs_decode`` and the tensors it reads; ``tables`` the grid, signs
    and outer factor on the device."""
    grid, signs, outer = tables
    rows, c = k_codes.shape[0] * k_codes.shape[1], out_k.shape[-1]
    p, m = signs.shape[0], outer.shape[0]
    groups = -(-c // group)
    kc, ks, vc, vs = (kernel_arg(t) for t in (k_codes, k_scales, v_codes, v_scales))
    args = (ptr(kc), ptr(ks), ptr(vc), ptr(vs), ptr(bias_k), ptr(bias_v), np.int64(rows), i32(kc.shape[-1]))
    args += (i32(code_bits), ptr(grid), i32(grid.shape[0]), i32(groups), i32(group), i32(c), i32(p))
    args += (i32(lanes_per_token(p)), ptr(signs), ptr(outer), i32(m), i32(p // m), np.float32(p**-0.5))
    args += (ptr(out_k), ptr(out_v))
    launch_ = (decode_grid(rows, p, groups), decode_shared_bytes(p, grid.shape[0], m), args)
    return launch_, (kc, ks, vc, vs)


def add_product(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """``out [B, n, C] += x [B, n, Cin] @ w`` in place (cuBLAS ``addmm_``): one product over every row where
    ``x``'s rows are evenly strided (the previous layer's whole workspace), else one per batch row."""
    try:
        rows = x.view(-1, x.shape[-1])
    except RuntimeError:
        for i in range(x.shape[0]):
            out[i].addmm_(x[i], w)
        return
    out.view(-1, out.shape[-1]).addmm_(rows, w)


def add_predictions(
    out_k: torch.Tensor,
    out_v: torch.Tensor,
    pred_k: Pred,
    pred_v: Pred,
    prev_k: torch.Tensor | None,
    prev_v: torch.Tensor | None,
) -> None:
    """The predictions added to ``deHIGGS + bias`` in place: keys ``+= prev_k @ W_k``, then values ``+= keys @
    W_v[:C] + prev_v @ W_v[C:]`` (the value predictor reads the reconstructed keys)."""
    if pred_k is not None:
        add_product(out_k, prev_k, pred_k[0])
    if pred_v is not None:
        c = out_k.shape[-1]
        add_product(out_v, out_k, pred_v[0][:c])
        add_product(out_v, prev_v, pred_v[0][c:])


def reconstruct(
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
    """``kernels_cpu.aquakv_reconstruct`` on the GPU (the same arguments; the hook ``aquakv_reconstruct``):
    an AQUA-KV layer's pre-RoPE keys and values ``[B, n, C]`` fp32, ``pred + deHIGGS(codes)``, written into
    ``out_k``/``out_v`` (contiguous, e.g. views of the cache's workspace; allocated when None, ``channels``
    giving C): ``higgs_decode`` writes the residuals plus the biases, cuBLAS adds the predictions in place.
    ``kvquant.methods.aquakv.predictors.dequantize_pair`` up to fp32 summation order."""
    check_device(k_codes)
    device = k_codes.device
    if not k_codes.is_cuda:
        raise ValueError(f"kernels_cupy: the AQUA-KV decode needs CUDA tensors, got codes on {device}")
    if code_bits not in CODE_BITS:
        raise ValueError(f"kernels_cupy: HIGGS codes of {code_bits} bits")
    if out_k is None or out_v is None:
        c = channels if channels is not None else (pred_k or pred_v)[0].shape[1]
        shape = (k_codes.shape[0], k_codes.shape[1], c)
        out_k = torch.empty(shape, device=device) if out_k is None else out_k
        out_v = torch.empty(shape, device=device) if out_v is None else out_v
    for out in (out_k, out_v):
        if out.dtype != torch.float32 or not out.is_contiguous() or out.data_ptr() % 16:
            raise ValueError("kernels_cupy: the AQUA-KV workspace must be contiguous 16-byte aligned fp32")
    pred_k, pred_v = pred_on_device(pred_k, device), pred_on_device(pred_v, device)
    if out_k.numel():
        tables = tuple(on_device(t, device) for t in (grid, signs, outer))
        bias_k, bias_v = (None if pr is None else pr[1] for pr in (pred_k, pred_v))
        (grid_, shared, args), _held = decode_launch(
            k_codes, k_scales, v_codes, v_scales, tables, code_bits, group, bias_k, bias_v, out_k, out_v
        )
        launch(SOURCE, "higgs_decode", grid_, THREADS, args, shared_mem=shared)
        add_predictions(out_k, out_v, pred_k, pred_v, prev_k, prev_v)
    return out_k, out_v


_QUANTS: dict[tuple[int, int, int], Any] = {}
_CHECKED: dict[tuple[int, int], tuple[weakref.ref, weakref.ref]] = {}


def check_presets(quant: Any, grid: torch.Tensor, signs: torch.Tensor) -> None:
    """Refuse a grid or signs other than ``quant``'s (HIGGS's presets), compared once per pair of tensors: a layer
    hands the same ones at every step."""
    key = (id(grid), id(signs))
    held = _CHECKED.get(key)
    if held is not None and held[0]() is grid and held[1]() is signs:
        return
    if not torch.equal(quant.grid, grid) or not torch.equal(quant.signs, signs):
        raise ValueError("kernels_cupy: AQUA-KV codes of another grid or sign seed than HIGGS's presets")
    _CHECKED[key] = (weakref.ref(grid), weakref.ref(signs))


def encode(
    k: torch.Tensor,
    v: torch.Tensor,
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
) -> tuple[Any, Any]:
    """The hook ``aquakv_encode``: ``encode_pair``'s codes of new rows (the torch rule, on the rows' device),
    with the predictor weights copied to the device once rather than at every step."""
    from kvquant.methods.aquakv.predictors import encode_pair
    from kvquant.quant.higgs import Higgs

    channels = k.shape[-1]
    key = (channels, code_bits, group)
    if key not in _QUANTS:
        _QUANTS[key] = Higgs(channels, BITS_OF_CODE[code_bits], group)
    quant = _QUANTS[key]
    check_presets(quant, grid, signs)
    pk, pv = pred_on_device(pred_k, k.device), pred_on_device(pred_v, k.device)
    qk, _, qv, _ = encode_pair(quant, pk, pv, k, v, prev_k, prev_v, reconstruct=False)
    return qk, qv
