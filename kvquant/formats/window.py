"""The fp16 window of the newest tokens (and attention sinks) in front of a compressed history.

KIVI, GEAR, HIGGS and AQUA-KV keep one: ``Window`` holds one of K or V in fp16 — the first ``sink``
tokens for good and the newest; ``push`` appends and hands back the oldest tokens that leave it (one
at a time, or in whole blocks), which the format then compresses. ``Stream`` is a window in front of
a per-stream compressed ``Store`` (KIVI's codes, GEAR's codes + outliers + low-rank runs);
``Window.read_widths`` is what one attention pass over a stream reads, as whole-bit widths with the
exact total.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from kvquant.formats.base import nbytes, whole_bit_widths

TOKEN_AXIS = 2
CHANNEL_AXIS = 3


class Window:
    """One of K or V in fp16 (``[B, H, n, D]``): the first ``sink`` tokens for good, then the newest.

    ``block`` None: tokens leave one at a time (the window keeps the newest ``size``); otherwise they
    leave in whole blocks of ``block`` once it holds more than ``size`` (it keeps 1…``size``).
    Held tensors own their storage (never views of the caller's or of a bigger buffer), so bytes
    measured from them are the bytes held.
    """

    def __init__(self, size: int, block: int | None = None, sink: int = 0):
        self.size, self.block, self.sink = size, block, sink
        self.sinks: torch.Tensor | None = None
        self.recent: torch.Tensor | None = None

    def leaving(self, w: int) -> int:
        """How many of ``w`` recent tokens leave the window."""
        if w <= self.size:
            return 0
        if self.block is None:
            return w - self.size
        return (w - 1) // self.block * self.block

    def push(self, x: torch.Tensor) -> torch.Tensor | None:
        """Append ``x`` (as fp16); return the oldest recent tokens that leave (fp16, in order), or None."""
        x = x.to(torch.float16)
        if self.sink:
            have = 0 if self.sinks is None else self.sinks.shape[TOKEN_AXIS]
            take = max(0, min(x.shape[TOKEN_AXIS], self.sink - have))
            if self.sinks is None:
                self.sinks = x[:, :, :take].clone()
            elif take:
                self.sinks = torch.cat([self.sinks, x[:, :, :take]], dim=TOKEN_AXIS)
            x = x[:, :, take:]
        if self.recent is None:
            self.recent = x.clone()
        else:
            self.recent = torch.cat([self.recent, x], dim=TOKEN_AXIS)
        n = self.leaving(self.recent.shape[TOKEN_AXIS])
        if not n:
            return None
        out = self.recent[:, :, :n]
        self.recent = self.recent[:, :, n:].clone()
        return out

    @property
    def n_tokens(self) -> int:
        """Tokens held in fp16 (sinks and window)."""
        return sum(t.shape[TOKEN_AXIS] for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.sinks, self.recent) if t is not None]

    def drop_newest(self, n: int) -> None:
        """Forget the newest ``n`` recent tokens (a rejected draft; the caller checks they are held)."""
        if n and self.recent is not None:
            self.recent = self.recent[:, :, : self.recent.shape[TOKEN_AXIS] - n].clone()

    def drop(self, n: int) -> None:
        """Forget the oldest ``n`` recent tokens (a sliding layer's tokens that left its window)."""
        if n and self.recent is not None:
            self.recent = self.recent[:, :, n:].clone()

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace each held tensor by ``fn(tensor)`` (all batch-first)."""
        if self.sinks is not None:
            self.sinks = fn(self.sinks)
        if self.recent is not None:
            self.recent = fn(self.recent)

    def read_widths(self, n_compressed: int, compressed: list[torch.Tensor]) -> dict[int, int]:
        """What one attention pass over this stream reads, per whole-bit width: every byte of
        ``compressed`` (holding ``n_compressed`` tokens) and the fp16 tokens at 16 bits."""
        if self.recent is None:
            return {}
        b, h, _, d = self.recent.shape
        per_token = b * h * d
        return whole_bit_widths(per_token * n_compressed, 8 * nbytes(compressed), per_token * self.n_tokens)


class Store(Protocol):
    """The compressed history of one of K or V; tokens arrive in order and are never re-compressed.

    ``unit``: tokens are added and dropped in multiples of it (a key group spans ``group_size``
    tokens); ``drop(n)`` forgets the oldest whole units among the first ``n`` tokens and says how
    many tokens went.
    """

    length: int
    unit: int

    def add(self, x: torch.Tensor, decode: bool) -> None: ...

    def drop(self, n: int) -> int: ...

    def read_into(self, out: torch.Tensor) -> None: ...

    def tensors(self) -> list[torch.Tensor]: ...

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None: ...


class Stream:
    """One of K or V: an fp16 ``Window`` of the newest ``residual`` tokens in front of a ``Store``.

    On a sliding-window layer the oldest tokens are forgotten (``forget``): ``dropped`` counts them,
    so the store's first token is token ``dropped`` of the sequence.
    """

    def __init__(self, store: Store, residual: int, block: int | None):
        self.store = store
        self.fp16 = Window(residual, block)
        self.dropped = 0

    @property
    def window(self) -> torch.Tensor | None:
        """The fp16 window (``[B, H, w, D]``), None before the first token."""
        return self.fp16.recent

    def extend(self, x: torch.Tensor, decode: bool, keep_from: int | None = None) -> None:
        """Append ``x``; compress what leaves the window. Tokens before ``keep_from`` (which a sliding
        layer forgets after this step) are compressed apart from the rest, so they can go whole."""
        leaving = self.fp16.push(x)
        if leaving is None:
            return
        n = leaving.shape[TOKEN_AXIS]
        cut = 0 if keep_from is None else min(n, max(0, keep_from - self.dropped - self.store.length))
        cut -= cut % self.store.unit
        if 0 < cut < n:
            self.store.add(leaving[:, :, :cut], decode)
            leaving = leaving[:, :, cut:]
        self.store.add(leaving, decode)

    def forget(self, keep_from: int) -> None:
        """Drop tokens before position ``keep_from``: whole store units, then (once the store is
        empty) the oldest window tokens."""
        n = keep_from - self.dropped
        if n <= 0:
            return
        gone = self.store.drop(n)
        if gone < n and self.store.length == 0 and self.window is not None:
            extra = min(n - gone, self.window.shape[TOKEN_AXIS])
            self.fp16.drop(extra)
            gone += extra
        self.dropped += gone

    @property
    def length(self) -> int:
        return self.store.length + self.fp16.n_tokens

    def read(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole history, decompressed, then the window, as one ``[B, H, L, D]`` tensor."""
        b, h, w, d = self.window.shape
        n = self.store.length
        out = torch.empty(b, h, n + w, d, dtype=dtype, device=self.window.device)
        if n:
            self.store.read_into(out[:, :, :n])
        out[:, :, n:].copy_(self.window)
        return out

    def tensors(self) -> list[torch.Tensor]:
        return [*self.fp16.tensors(), *self.store.tensors()]

    def read_counts(self) -> dict[int, int]:
        return self.fp16.read_widths(self.store.length, self.store.tensors())

    def numel(self) -> int:
        if self.window is None:
            return 0
        b, h, _, d = self.window.shape
        return b * h * self.length * d

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.fp16.map(fn)
        self.store.map(fn)
