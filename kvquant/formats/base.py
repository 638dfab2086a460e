"""What every storage format shares: the state base class, what a read reports, and attention math.

A format is the layout a method's layer keeps K/V in (fp16, integer codes, bit planes, …). Its state
holds the tensors and knows how to append, map and count them; a backend's ``attend`` reads it.
Formats know nothing of layers, methods, caches or backends, so kernel packages can import them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch


def nbytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the tensors given (None skipped): what a state holds, measured, never a formula."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class RowBuffer:
    """One tensor appended along dimension ``dim`` (its rows: tokens) in place: a buffer of some capacity whose held
    rows are the view ``narrow(dim, 0, rows)`` (``held``), so an append copies what it appends, not the history
    (``torch.cat`` copied every held row, every decode step: as many bytes as attention reads). A full buffer
    is replaced by one with room for ``max(block, 2·n)`` more rows than it needs (``n`` the rows appended), so the
    history is copied at most once per ``block`` rows appended, or per two appends of more, and the slack stays
    under two blocks (two appends). The kernels read ``held`` with its
    strides (C++) or the buffer with its capacity as the row stride (CuPy, ``kernels_cupy.codes.rows_of``)."""

    def __init__(self, block: int = 256, dim: int = 2) -> None:
        self.block, self.dim = max(1, block), dim
        self.buffer: torch.Tensor | None = None
        self.rows = 0

    @property
    def held(self) -> torch.Tensor | None:
        return None if self.buffer is None else self.buffer.narrow(self.dim, 0, self.rows)

    def holds(self, t: torch.Tensor | None) -> bool:
        """Whether ``t`` is this buffer's held view (not a tensor put in its place since)."""
        held = self.held
        if t is None or held is None:
            return t is None and held is None
        return (t.data_ptr(), t.shape, t.stride()) == (held.data_ptr(), held.shape, held.stride())

    def append(self, x: torch.Tensor) -> torch.Tensor:
        """Write ``x`` after the held rows; returns the held rows (a view)."""
        row0 = self.reserve(tuple(x.shape), x.dtype, x.device)
        self.buffer.narrow(self.dim, row0, x.shape[self.dim]).copy_(x)
        return self.held

    def reserve(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> int:
        """Hold ``shape[dim]`` more rows of ``shape``, regrowing the buffer where they do not fit; returns the first
        of them, for a kernel to write in place (``append`` copies a tensor there)."""
        d, n, buf = self.dim, shape[self.dim], self.buffer
        other = shape[:d] + shape[d + 1 :]
        if buf is not None and buf.shape[:d] + buf.shape[d + 1 :] != other:
            raise ValueError(f"cannot append rows of shape {shape} to rows of {tuple(buf.shape)}")
        if buf is None or self.rows + n > buf.shape[d] or (buf.dtype, buf.device) != (dtype, torch.device(device)):
            room = max(self.block, 2 * n)  # appends of whole blocks (KIVI's key flushes) fit twice before the next
            capacity = -(-(self.rows + n + room) // self.block) * self.block
            new = torch.empty(*shape[:d], capacity, *shape[d + 1 :], dtype=dtype, device=device)
            if self.rows:
                new.narrow(d, 0, self.rows).copy_(buf.narrow(d, 0, self.rows))
            self.buffer = new
        row0, self.rows = self.rows, self.rows + n
        return row0

    def reset(self, t: torch.Tensor | None) -> None:
        """Hold exactly ``t`` (after a drop or a batch map made new tensors): the next append regrows."""
        self.buffer = None if t is None else t.contiguous()
        self.rows = 0 if t is None else t.shape[self.dim]


def hold(rows: Sequence[RowBuffer], tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Each buffer holds its tensor (made new by a drop or a batch map; one it already holds, as a map that
    changed nothing returns, stays where it is); returns the held views, in order."""
    for buffer, t in zip(rows, tensors, strict=True):
        if not buffer.holds(t):
            buffer.reset(t)
    return [buffer.held for buffer in rows]


def whole_bit_widths(n_compressed: int, compressed_bits: int, n_fp16: int) -> dict[int, int]:
    """Element counts per whole-bit width whose total is exactly ``compressed_bits + 16·n_fp16``.

    For methods whose compressed part costs a fractional width (codes plus scales): the elements are
    split between ⌊w⌋ and ⌈w⌉ so that totals and means stay exact.
    """
    widths: Counter = Counter()
    if n_compressed:
        low, extra = divmod(compressed_bits, n_compressed)
        widths[low] += n_compressed - extra
        if extra:
            widths[low + 1] += extra
    if n_fp16:
        widths[16] += n_fp16
    return dict(widths)


class FormatState(ABC):
    """The tensors one layer holds in one storage format.

    ``format`` names it (backends list the formats they have kernels for). ``tensors_k``/``tensors_v``
    list every tensor (codes, scales, windows, metadata), so bytes are measured; ``map_tensors``
    replaces every batch-first tensor by ``fn(tensor)`` (beam reorder, batch selection, offload).
    """

    format: ClassVar[str] = ""

    @abstractmethod
    def tensors_k(self) -> list[torch.Tensor | None]: ...

    @abstractmethod
    def tensors_v(self) -> list[torch.Tensor | None]: ...

    @abstractmethod
    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None: ...

    def nbytes(self) -> int:
        return nbytes([*self.tensors_k(), *self.tensors_v()])


@dataclass(frozen=True)
class Reads:
    """What one ``attend`` read where a rule chose it per step: AlignedKV's key widths (per channel
    ``[B, Hkv, D]`` or per block and channel ``[B, Hkv, blocks, D]``) and value widths per block token
    ``[B, Hkv, n]``. ``None`` where the format reads all it holds: its layer counts that from bytes.
    ``counts``: per KV head how many (key token, channel) and value tokens of the step's window each width
    read (int64 ``[Hkv, 3]`` each, ``kvquant.methods.alignedkv.head_width_counts``' integers), where the
    backend counted them itself (a C++ pass costs a fraction of the torch or numpy ops a layer and step)."""

    k_widths: torch.Tensor | None = None
    v_widths: torch.Tensor | None = None
    counts: tuple[torch.Tensor, torch.Tensor] | None = None


NOTHING_CHOSEN = Reads()


def causal_allowed(q_len: int, n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[q_len, n]`` booleans (True = attend) of a causal step whose queries are the last ``q_len`` of
    ``n`` keys: what a forward without a mask means (transformers skips SDPA's mask for plain causal)."""
    return torch.ones(q_len, n, dtype=torch.bool, device=device).tril(n - q_len)


def masked_logits(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``logits`` ``[B, Hq, q_len, n]`` with ``mask`` applied (bool: True = attend, or additive); no mask
    on a multi-token step is plain causal."""
    n, q_len = logits.shape[-1], logits.shape[-2]
    if mask is not None:
        mask = mask[..., :n]
        return logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    if q_len > 1:
        return logits.masked_fill(~causal_allowed(q_len, n, logits.device), float("-inf"))
    return logits


def attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention ``[B, Hq, q_len, D]`` in the query's dtype over ``keys``/``values`` ``[B, Hkv, n, D]``
    (GQA without copying K/V), computed in fp32: the torch reference every backend is compared with.
    A row that sees no key gives zeros."""
    b, hq, q_len, d = query.shape
    hkv, n = keys.shape[1], keys.shape[2]
    grouped = query.float().reshape(b, hkv, (hq // hkv) * q_len, d)
    logits = (grouped @ keys.float().transpose(-1, -2) * scaling).view(b, hq, q_len, n)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    probs = torch.softmax(masked_logits(logits, mask), dim=-1).nan_to_num(0.0)
    out = probs.view(b, hkv, -1, n) @ values.float()
    return out.view(b, hq, q_len, values.shape[-1]).to(query.dtype)
