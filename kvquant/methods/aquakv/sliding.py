"""What an AQUA-KV/HIGGS sliding-window layer forgets after a step, and slicing by token position.

The rule (``cache.py``'s docstring says why): after a step that brought the layer to ``seen``
tokens, its attention window starts at ``lo = seen − window + 1`` and its codes are needed from
``seen − horizon + 1`` on (``horizon``: set by the cache from the layers that predict from this
one; None keeps every code). Sinks go below ``lo``. Window tokens go below ``lo`` on an ``early``
layer (no predictors), which first codes those it must keep codes for; elsewhere they stay until
coded unless no code of theirs is needed. Codes go below the code horizon. What stays is cloned, so
bytes measured from it are the bytes held.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvquant.errors import KvquantError
from kvquant.quant.higgs import HiggsTensor

if TYPE_CHECKING:
    from kvquant.methods.aquakv.layer import AquaKVLayer

Rows = tuple[int, torch.Tensor, torch.Tensor]  # (position of the first row, keys [B, n, C], values [B, n, C])


def rows_between(rows: Rows, lo: int, hi: int, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of positions ``[lo, hi)`` of a layer's reconstruction; a gap is an internal error, said so."""
    first, rk, rv = rows
    if lo < first or hi > first + rk.shape[1]:
        raise KvquantError(
            f"aquakv layer {layer_idx}: needs the previous layer's tokens {lo}..{hi - 1}, which holds "
            f"{first}..{first + rk.shape[1] - 1} (internal error)"
        )
    return rk[:, lo - first : hi - first], rv[:, lo - first : hi - first]


def tail(x: torch.Tensor | None, start: int, first: int) -> torch.Tensor | None:
    """``x`` (tokens ``start, start + 1, …`` on axis −2) from position ``first`` on; None if nothing is left."""
    if x is None or start + x.shape[-2] <= first:
        return None
    return x[..., max(0, first - start) :, :]


def drop_leading(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` without its first ``n`` tokens (axis −2), in storage of its own."""
    return x[..., n:, :].clone() if n else x


def drop_code_rows(q: HiggsTensor, n: int) -> HiggsTensor | None:
    return None if n >= len(q) else HiggsTensor(drop_leading(q.codes, n), drop_leading(q.scales, n))


def forget(layer: AquaKVLayer) -> None:
    """Drop from a sliding layer what the next steps will not read (module docstring)."""
    lo = layer.seen - layer.window + 1
    if lo <= 0:
        return
    code_floor = 0 if layer.horizon is None else layer.seen - layer.horizon + 1
    gone = min(max(0, lo - layer.sink_lo), layer.n_sinks)
    if gone:
        layer.sink_lo += gone
        for win in (layer.state.k_win, layer.state.v_win):
            win.sinks = drop_leading(win.sinks, gone)
            win.sink = layer.sink - layer.sink_lo  # so that ``push`` never refills what left
    cut = min(max(0, code_floor - layer.state.code_lo), layer.n_codes)
    if layer.state.qk is not None and cut:
        layer.state.code_lo += cut
        layer.state.set_codes(drop_code_rows(layer.state.qk, cut), drop_code_rows(layer.state.qv, cut))
    recent_lo = layer.seen - layer.n_recent
    if layer.early:
        start = max(recent_lo, code_floor)
        if start < lo:
            span = slice(start - recent_lo, lo - recent_lo)
            layer.code(layer.state.k_win.recent[:, :, span], layer.state.v_win.recent[:, :, span], start, None)
    keep_from = lo if layer.early else code_floor
    gone = min(max(0, keep_from - recent_lo), layer.n_recent)
    for win in (layer.state.k_win, layer.state.v_win):
        win.recent = drop_leading(win.recent, gone)
