"""HIGGS codes (``higgs``, ``higgs_post_rope``) and AQUA-KV layers: per token, all KV heads' channels
rotated and snapped to a Gaussian-optimal grid (``kvquant.quant.higgs``), between fp16 sinks and an fp16
window of the newest tokens.

Keys are coded with RoPE taken off (re-applied at every read: ``rope``) unless coded after RoPE
(``{"post_rope": True}``). An AQUA-KV layer's codes are of a cross-layer predictor's residual: its
cache reconstructs them each forward (``rows``) and attention reads that reconstruction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvquant.formats.base import FormatState, Reads, RowBuffer, attention, hold
from kvquant.formats.window import Window
from kvquant.quant.higgs import Higgs, HiggsTensor
from kvquant.quant.rope import apply_rope

CODE_BLOCK = 64  # tokens of room the code buffers grow by (``RowBuffer``; KIVI's ``QuantStore.BLOCK`` likewise)


@dataclass(frozen=True)
class HiggsRule:
    """A HIGGS method's read as backends' ``limits`` judge it when a cache is made: its quantizer (grid,
    rotation, ``group``, ``padded_group``) and whether keys are coded after RoPE (no RoPE at a read)."""

    quant: Higgs
    post_rope: bool = False

    @property
    def group(self) -> int:
        return self.quant.group

    @property
    def padded_group(self) -> int:
        return self.quant.padded_group


class HiggsState(FormatState):
    """One layer's HIGGS storage: ``k_win``/``v_win`` (fp16 sinks and window, post-RoPE, as given), the
    codes ``qk``/``qv`` of tokens ``[code_lo, code_lo + n_codes)`` (``[B, n, bytes]`` + fp16 scales) and the
    ``quant`` that reads them. ``rope`` is what re-rotates this step's coded keys, set by the layer before
    attention: ``{"post_rope": True}``, ``{"positions", "inv_freq", "rope_scale"}`` (a static rotary
    module's formula) or ``{"cos", "sin"}`` tables ``[B, n, D]``; empty before any code."""

    format: ClassVar[str] = "higgs"
    reads_by_query: ClassVar[bool] = False

    def __init__(self, quant: Higgs, sink: int, recent: int) -> None:
        self.quant = quant
        self.k_win, self.v_win = Window(recent, sink=sink), Window(recent, sink=sink)
        self.qk: HiggsTensor | None = None
        self.qv: HiggsTensor | None = None
        #: where ``qk``/``qv`` grow: key codes, key scales, value codes, value scales, ``[B, rows, *]`` each
        self.code_rows = tuple(RowBuffer(CODE_BLOCK, dim=1) for _ in range(4))
        self.code_lo = 0
        self.rope: dict[str, Any] = {}

    @property
    def n_codes(self) -> int:
        return 0 if self.qk is None else len(self.qk)

    @property
    def n_sinks(self) -> int:
        return 0 if self.k_win.sinks is None else self.k_win.sinks.shape[-2]

    @property
    def n_recent(self) -> int:
        return 0 if self.k_win.recent is None else self.k_win.recent.shape[-2]

    def add_codes(self, qk: HiggsTensor, qv: HiggsTensor, start: int) -> None:
        """Append the codes of tokens from position ``start`` on (contiguous with those held), written into
        ``RowBuffer``s: a step copies the token it codes, and the coded history once per regrowth (the CuPy
        HIGGS kernel reads a contiguous copy where the held view is not contiguous: batch > 1)."""
        if self.qk is None:
            self.code_lo = start
        elif not self.code_rows[0].holds(self.qk.codes):  # assigned around ``set_codes``: adopt them first
            self.set_codes(self.qk, self.qv)
        k_codes, k_scales, v_codes, v_scales = (
            rows.append(t) for rows, t in zip(self.code_rows, (*qk.tensors(), *qv.tensors()), strict=True)
        )
        self.qk, self.qv = HiggsTensor(k_codes, k_scales), HiggsTensor(v_codes, v_scales)

    def set_codes(self, qk: HiggsTensor | None, qv: HiggsTensor | None) -> None:
        """Hold ``qk``/``qv`` in place of the codes (a drop of the oldest rows, a batch map): they become the
        buffers, so nothing held before lingers and the next ``add_codes`` grows them."""
        held = hold(self.code_rows, (*qk.tensors(), *qv.tensors()) if qk is not None else (None,) * 4)
        k_codes, k_scales, v_codes, v_scales = held
        self.qk = None if qk is None else HiggsTensor(k_codes, k_scales)
        self.qv = None if qk is None else HiggsTensor(v_codes, v_scales)

    def tensors_k(self) -> list[torch.Tensor | None]:
        return [*self.k_win.tensors(), *(self.qk.tensors() if self.qk else [])]

    def tensors_v(self) -> list[torch.Tensor | None]:
        return [*self.v_win.tensors(), *(self.qv.tensors() if self.qv else [])]

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.k_win.map(fn)
        self.v_win.map(fn)
        if self.qk is not None:
            self.set_codes(
                HiggsTensor(fn(self.qk.codes), fn(self.qk.scales)), HiggsTensor(fn(self.qv.codes), fn(self.qv.scales))
            )
        self.rope = {}

    def coded_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys (pre-RoPE unless post-RoPE) and values of the coded tokens, ``[B, n, C]`` fp32, or None."""
        if self.qk is None:
            return None
        return self.quant.dequantize(self.qk), self.quant.dequantize(self.qv)


class AquaKVState(HiggsState):
    """An AQUA-KV layer's storage: ``HiggsState`` whose codes are a predictor's residual, so only its
    cache can rebuild them; ``rows`` is that rebuild for this forward (``[B, n_codes, C]`` fp32 keys and
    values, pre-RoPE), set by the cache before attention."""

    format: ClassVar[str] = "aquakv"
    #: views of the cache's per-forward workspace: a step's transient, not held (``kvquant.analysis.memory``)
    transient_attributes: ClassVar[tuple[str, ...]] = ("rows",)

    def __init__(self, quant: Higgs, sink: int, recent: int) -> None:
        super().__init__(quant, sink, recent)
        self.rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def coded_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.rows

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().map_tensors(fn)
        self.rows = None


def rope_tables(rope: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(cos, sin)`` ``[B, n, D]`` of a state's ``rope``, or None for keys coded after RoPE."""
    if rope.get("post_rope"):
        return None
    if rope.get("cos") is not None:
        return rope["cos"], rope["sin"]
    angle = rope["positions"][..., None].float() * rope["inv_freq"].float()
    angle = torch.cat([angle, angle], dim=-1)
    return angle.cos() * rope["rope_scale"], angle.sin() * rope["rope_scale"]


def read(state: HiggsState, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Sinks, the coded tokens (decoded, RoPE re-applied) and the window, as ``[B, Hkv, n, D]`` each."""
    parts_k, parts_v = [state.k_win.sinks], [state.v_win.sinks]
    rows = state.coded_rows()
    if rows is not None:
        b, h, _, d = state.k_win.recent.shape
        k, v = (r.view(b, -1, h, d).transpose(1, 2) for r in rows)
        tables = rope_tables(state.rope)
        parts_k.append(k if tables is None else apply_rope(k, *tables))
        parts_v.append(v)
    parts_k.append(state.k_win.recent)
    parts_v.append(state.v_win.recent)
    keys = torch.cat([p.to(dtype) for p in parts_k if p is not None], dim=-2)
    return keys, torch.cat([p.to(dtype) for p in parts_v if p is not None], dim=-2)


def attend(
    state: HiggsState, rule: Any, query: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> tuple[torch.Tensor, Reads]:
    """The torch reference: attention over ``read``."""
    keys, values = read(state, torch.float32)
    return attention(query, keys, values, mask, scaling), Reads()
