"""Integer codes (KIVI): min-max codes packed in uint8 with fp16 scales and zeros, behind fp16 windows.

Keys are coded per channel (a group is ``group_size`` tokens of one channel), values per token (a
group is ``group_size`` channels of one token); ``kvquant.quant.integer`` packs them. Each of K and V
is a ``Stream``: an fp16 window of the newest tokens in front of a ``QuantStore``. Nothing coded is
ever coded again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import ClassVar

import torch

from kvquant.formats.base import FormatState, Reads, RowBuffer, attention, hold
from kvquant.formats.window import TOKEN_AXIS, Stream
from kvquant.quant.integer import QuantizedTensor, dequantize, drop_leading, quantize


class QuantStore:
    """KIVI's compressed part of one stream: one growing ``QuantizedTensor`` (codes, scales, zeros) whose
    tensors are views of ``RowBuffer``s, so the value a decode step codes is written in place rather than
    the whole coded history copied to append it."""

    BLOCK = 64  # tokens of room a full buffer grows by (``RowBuffer``): the history is copied once per 64 coded
    # tokens (1/64 of what attention reads meanwhile) and the slack, under 128 tokens of codes, stays small beside
    # the fp16 windows, so measured memory stays close to the bytes stored

    def __init__(self, bits: int, axis: int, group_size: int):
        self.bits, self.axis, self.group_size = bits, axis, group_size
        self.unit = group_size if axis == TOKEN_AXIS else 1  # a key group spans tokens
        self.q: QuantizedTensor | None = None
        self.length = 0
        meta_block = -(-self.BLOCK // self.unit)  # scale/zero rows are groups of tokens for keys
        self.rows = (RowBuffer(self.BLOCK), RowBuffer(meta_block), RowBuffer(meta_block))

    def add(self, x: torch.Tensor, decode: bool) -> None:
        self.check_whole_groups()
        new = quantize(x, self.bits, self.axis, self.group_size, checked=True)  # the layer's check_storable
        for rows, t in zip(self.rows, new.tensors(), strict=True):
            rows.append(t)
        self.grown(x.shape)

    def check_whole_groups(self) -> None:
        if self.length % self.unit:
            raise ValueError(f"only whole groups ({self.unit}) can be coded before more tokens ({self.length} held)")

    def grown(self, shape: tuple[int, ...]) -> None:
        """The buffers took the codes of ``shape[2]`` more tokens (of ``shape``): ``q`` views them all."""
        self.length += shape[TOKEN_AXIS]
        codes, scale, zero = (rows.held for rows in self.rows)
        held = (*shape[:TOKEN_AXIS], self.length, *shape[TOKEN_AXIS + 1 :])
        self.q = QuantizedTensor(codes, scale, zero, self.bits, self.axis, self.group_size, tuple(held))

    def _hold(self, q: QuantizedTensor | None) -> None:
        """``q``'s tensors become the buffers (a drop or a batch map made new ones)."""
        codes, scale, zero = hold(self.rows, q.tensors() if q is not None else (None,) * 3)
        self.q = None if q is None else replace(q, codes=codes, scale=scale, zero=zero)

    def drop(self, n: int) -> int:
        m = min(n, self.length) // self.unit * self.unit
        if m:
            self._hold(drop_leading(self.q, TOKEN_AXIS, m) if m < self.length else None)
            self.length -= m
        return m

    def read_into(self, out: torch.Tensor) -> None:
        if self.q is not None:
            dequantize(self.q, out=out)

    def tensors(self) -> list[torch.Tensor]:
        return self.q.tensors() if self.q is not None else []

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.q is not None:
            self._hold(self.q.map(fn))


class CodesState(FormatState):
    """One layer's K and V streams at ``bits`` in groups of ``group_size`` (KIVI's format)."""

    format: ClassVar[str] = "kivi"
    reads_by_query: ClassVar[bool] = False

    def __init__(self, k: Stream, v: Stream, bits: int, group_size: int) -> None:
        self.k, self.v, self.bits, self.group_size = k, v, bits, group_size

    @property
    def length(self) -> int:
        return self.k.length

    def append(self, keys: torch.Tensor, values: torch.Tensor, decode: bool, keep_from: int | None = None) -> None:
        """Append new tokens to both streams; what leaves a window is coded (``Stream.extend``)."""
        self.k.extend(keys, decode, keep_from)
        self.v.extend(values, decode, keep_from)

    def newest_fp16(self) -> int:
        """How many of the newest tokens both windows still hold in fp16 (what a crop can take back)."""
        return min(s.window.shape[TOKEN_AXIS] if s.window is not None else 0 for s in (self.k, self.v))

    def forget_newest(self, n: int) -> None:
        """Drop the newest ``n`` tokens from both windows (``newest_fp16`` of them at most)."""
        self.k.fp16.drop_newest(n)
        self.v.fp16.drop_newest(n)

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole history, decoded, then the windows: what the torch reference attends over."""
        return self.k.read(dtype), self.v.read(dtype)

    def read_counts(self) -> tuple[dict[int, int], dict[int, int]]:
        """What one attention pass reads: every byte held, as whole-bit widths (``Window.read_widths``)."""
        return self.k.read_counts(), self.v.read_counts()

    def tensors_k(self) -> list[torch.Tensor | None]:
        return self.k.tensors()

    def tensors_v(self) -> list[torch.Tensor | None]:
        return self.v.tensors()

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.k.map(fn)
        self.v.map(fn)


def attend(
    state: CodesState, rule: None, query: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> tuple[torch.Tensor, Reads]:
    """The torch reference: attention over the decoded history and the windows (GEAR's too)."""
    keys, values = state.read(torch.float32)
    return attention(query, keys, values, mask, scaling), Reads()
