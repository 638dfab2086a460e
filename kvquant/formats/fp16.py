"""fp16: K/V as IEEE half in buffers appended in place — the baseline's format and truncation's.

``Fp16State`` holds K and V in one buffer each, ``[B, H, capacity, D]``: an append writes its tokens
after the held ones and the held tokens are the view ``[..., start:end, :]``, so decoding never copies
the history (``torch.cat`` did, every step). A buffer too small is replaced by one of
``capacity(need)`` tokens with the held ones moved to its front. A fixed block rather than doubling:
a move copies the history once per ``block`` (256) appended tokens, ≤ 1/256 of what attention reads
meanwhile, while the slack stays under two blocks, so measured memory stays close to the bytes
stored. ``window`` (a sliding layer): the state keeps its newest ``window − 1`` tokens in token order;
the start advances and, when the end reaches the capacity, the window is compacted to the front of a
new buffer, once per ``block`` steps. ``keys``/``values`` are views of what is held, so the bytes
counted are the held tokens only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvquant.bits import truncate
from kvquant.formats.base import FormatState, Reads, attention, nbytes


@dataclass(frozen=True)
class TruncationRule:
    """Every element read at its top ``keep_bits`` (the rest filled with ``1000…``): uniform truncation."""

    keep_bits: int = 16


FULL = TruncationRule(16)


class Fp16State(FormatState):
    """K/V in fp16 buffers (module docstring); ``keys``/``values`` are views of the held tokens."""

    format: ClassVar[str] = "fp16"
    reads_by_query: ClassVar[bool] = False

    def __init__(self, window: int | None = None, block: int = 256) -> None:
        self.window = window
        self.block = block if window is None else max(1, min(block, window))  # a window's slack ≤ itself
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # [B, H, capacity, D] each
        self.start = self.end = 0  # the held tokens are [start, end) of the buffers
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.step: tuple[torch.Tensor, torch.Tensor] | None = None  # the last append's history: what attention reads

    def capacity(self, need: int) -> int:
        """Tokens a new buffer for ``need`` gets: ``need + block − 1`` rounded up to the block; a sliding
        state's never fewer than its window needs, so decoding never shrinks it."""
        if self.window is not None:
            need = max(need, self.window)
        return -(-(need + self.block - 1) // self.block) * self.block

    def reserved_bytes(self) -> int:
        """Memory held including growth slack (and a sliding state's tokens already out of its window)."""
        return nbytes(self.buffers or ())

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write fp16 ``k``/``v`` ``[B, H, t, D]`` after the held tokens; returns this step's history (the
        held tokens before the append plus the new ones), then drops what left a sliding window."""
        start, end, n = self.start, self.end, k.shape[-2]
        if self.buffers is None or end + n > self.buffers[0].shape[-2]:
            self._move(self.capacity(end - start + n), like=(k, v))
            start, end = self.start, self.end
        kbuf, vbuf = self.buffers
        kbuf[..., end : end + n, :].copy_(k)
        vbuf[..., end : end + n, :].copy_(v)
        self.step = step = kbuf[..., start : end + n, :], vbuf[..., start : end + n, :]
        self.end = end + n
        if self.window is not None:
            self.start = max(start, self.end - self.window + 1)
            if kbuf.shape[-2] > self.capacity(0) + self.block:  # a chunk > block grew it: back to size
                self._move(self.capacity(0))
        self._hold()
        return step

    def _move(self, capacity: int, like: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Replace the buffers by ones of ``capacity`` tokens (shaped as ``like`` when there are none) with
        the held tokens at the front. Views handed out stay valid: the old buffer is not written."""
        old = self.buffers or like
        held = self.end - self.start
        new = tuple(t.new_empty((*t.shape[:-2], capacity, t.shape[-1]), dtype=torch.float16) for t in old)
        if self.buffers is not None:
            for dst, src in zip(new, self.buffers, strict=True):
                dst[..., :held, :].copy_(src[..., self.start : self.end, :])
        self.buffers, self.start, self.end = new, 0, held

    def _hold(self) -> None:
        kbuf, vbuf = self.buffers
        self.keys, self.values = kbuf[..., self.start : self.end, :], vbuf[..., self.start : self.end, :]

    @property
    def n_tokens(self) -> int:
        return self.end - self.start

    def keep(self, n: int) -> None:
        """Forget all but the oldest ``n`` held tokens (a crop); later appends write over them in place."""
        self.end = self.start + max(0, min(n, self.n_tokens))
        self._hold()

    def tensors_k(self) -> list[torch.Tensor | None]:
        return [self.keys]

    def tensors_v(self) -> list[torch.Tensor | None]:
        return [self.values]

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """``fn`` of the whole buffers, slack included, so the capacity and the held range survive and
        the next append still writes in place."""
        if self.buffers is not None:
            self.buffers = (fn(self.buffers[0]), fn(self.buffers[1]))
            self._hold()


def read(keys: torch.Tensor, values: torch.Tensor, rule: TruncationRule | None, dtype: torch.dtype):
    """What the torch reference reads of fp16 ``keys``/``values``: all of them, truncated by ``rule``."""
    if rule is not None and rule.keep_bits < 16:
        return truncate(keys, rule.keep_bits).to(dtype), truncate(values, rule.keep_bits).to(dtype)
    return keys.to(dtype), values.to(dtype)


def attend(
    state: Fp16State, rule: TruncationRule | None, query: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> tuple[torch.Tensor, Reads]:
    """The torch reference: attention over the last append's history read by ``rule``."""
    keys, values = read(*state.step, rule, query.dtype)
    return attention(query, keys, values, mask, scaling), Reads()
