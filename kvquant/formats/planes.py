"""Bit planes (AlignedKV): fp16 K/V split by bits so that a read loads only the planes it needs.

fp16 = sign(1) exponent(5) mantissa(10); plane A is the high byte (sign, exponent, top 2 mantissa
bits), plane B mantissa bits 7..4, plane C bits 3..0. A read at 8 bits loads A, at 12 A+B, at 16 all
three; unread bits are filled with ``1000…``. Keys are channel-major in blocks of 64 tokens (a skipped
plane is one contiguous run), values token-major; the newest ``L mod 64`` tokens stay fp16.

``AlignedRule`` is what a step needs to decide the widths (``kvquant.alignment`` holds the rules);
``attend`` here is the torch reference every plane kernel is compared with: the rules on fp64 scores,
then attention over K/V as read.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvquant.alignment import (
    BLOCK,
    accumulation_margin,
    block_exponent_field,
    block_key_widths,
    block_value_widths,
    block_widths,
    exponent_gaps,
    key_widths,
    value_widths,
)
from kvquant.bits import fp16_bits, split_planes
from kvquant.errors import InvalidParameterError
from kvquant.formats.base import FormatState, Reads, attention, masked_logits
from kvquant.quant.device import on_device

if sys.byteorder != "little":  # plane reads assemble fp16 from (low, high) byte pairs
    raise ImportError("kvquant.formats.planes assumes a little-endian machine")

WIDTHS = (8, 12, 16)


def _i32(x: int) -> int:
    """An unsigned 32-bit pattern as the signed int torch's int32 ops take."""
    return x - (1 << 32) if x >= 1 << 31 else x


MASK32 = {8: 0, 12: _i32(0xF0F0F0F0), 16: -1}
FILL32 = {8: _i32(0x80808080), 12: 0x08080808, 16: 0}
_MASK_LUT = torch.zeros(17, dtype=torch.int32)
_FILL_LUT = torch.zeros(17, dtype=torch.int32)
_VALID_LUT = torch.zeros(17, dtype=torch.bool)
for _w in (8, 12, 16):
    _MASK_LUT[_w], _FILL_LUT[_w], _VALID_LUT[_w] = MASK32[_w], FILL32[_w], True
_MASK_ONE = {w: torch.tensor(MASK32[w], dtype=torch.int32) for w in WIDTHS}  # one width for every element
_FILL_ONE = {w: torch.tensor(FILL32[w], dtype=torch.int32) for w in WIDTHS}


def _mask_fill32(widths: torch.Tensor | int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Low-byte keep mask and ``1000…`` fill for 8/12/16-bit reads, replicated over the 4 bytes of an int32.

    The tables live on each device once (``on_device``): a copy to a GPU per read would make the host wait,
    as would more than the one read-back that refuses widths other than 8, 12 or 16."""
    if isinstance(widths, int):
        if widths not in MASK32:
            raise InvalidParameterError(f"plane reads take widths 8, 12 or 16, got [{widths}]")
        return on_device(_MASK_ONE[widths], device), on_device(_FILL_ONE[widths], device)
    w = widths.long()
    if bool(((w < 0) | (w > 16) | ~on_device(_VALID_LUT, w.device)[w.clamp(0, 16)]).any()):
        shown = sorted(set(w.flatten().tolist()))[:8]
        raise InvalidParameterError(f"plane reads take widths 8, 12 or 16, got {shown}")
    return on_device(_MASK_LUT, w.device)[w].to(device), on_device(_FILL_LUT, w.device)[w].to(device)


def _low_bytes(b: torch.Tensor, c: torch.Tensor, mask: torch.Tensor, fill: torch.Tensor):
    """Read low bytes (B<<4 | C, masked and filled) of the even and odd elements of nibble-packed planes.

    Works four bytes at a time on int32 views; the ±0 rule is applied by the caller where needed.
    """
    b32, c32 = b.view(torch.int32), c.view(torch.int32)
    even = (((b32 & 0x0F0F0F0F) << 4) | (c32 & 0x0F0F0F0F)) & mask | fill
    odd = ((b32 & _i32(0xF0F0F0F0)) | ((c32 >> 4) & 0x0F0F0F0F)) & mask | fill
    return even.view(torch.uint8), odd.view(torch.uint8)


def _zero_rule(pairs: torch.Tensor, fill: torch.Tensor) -> None:
    """In place on assembled fp16 byte pairs ``[..., 2, 2]``: a read whose kept bits are ±0 reads as ±0.

    Works on two fp16 lanes per int32; ``fill`` is the int32-replicated fill of each lane pair's row.
    Planes never hold inf/NaN (storage refuses them), so this is the only exception to the fill.
    """
    x = pairs.view(*pairs.shape[:-2], 4).view(torch.int32)
    lane_fill = fill & 0x00FF00FF  # the fill byte at the bottom of each 16-bit lane
    if lane_fill.dim():  # same-shape contiguous operands vectorise; short broadcast rows do not
        lane_fill = lane_fill.expand(x.shape).contiguous()
    y = x & (0x7FFF7FFF & ~lane_fill)  # magnitude of the kept bits, per lane
    t = y + 0x7FFF7FFF  # in-place from here: this runs on every element of every read
    t |= y
    t &= _i32(0x80008000)  # bit 15 of each lane: kept magnitude != 0
    t ^= _i32(0x80008000)
    t >>= 15
    t &= 0x00010001
    t *= 0xFF  # 0xFF under each lane whose kept bits read as ±0
    t &= lane_fill
    x &= t.bitwise_not_()


@dataclass
class PlaneStore(FormatState):
    """One layer's K/V in the layout the kernels read.

    K: channel-major blocks of ``BLOCK`` tokens, planes ``k_a [b, h, blocks, d, 64]`` and
    nibble-packed ``k_b``/``k_c [b, h, blocks, d, 32]``. V: token-major, ``v_a [b, h, n, d]``,
    ``v_b``/``v_c [b, h, n, d/2]``. The newest ``L mod 64`` tokens stay fp16 in ``tail_k``/``tail_v``
    until a block fills. ``k_absmax`` is the running per-channel max of ``|K|`` (fp16); ``v_exp_max``
    ``[b, h, d]`` the running per-channel max of plane A's exponent fields (so of ``v_exp`` too), a bound that
    lets the CPU kernel settle runs of value blocks or tokens at 8 bits without reading their fields.
    """

    k_a: torch.Tensor | None = None
    k_b: torch.Tensor | None = None
    k_c: torch.Tensor | None = None
    v_a: torch.Tensor | None = None
    v_b: torch.Tensor | None = None
    v_c: torch.Tensor | None = None
    tail_k: torch.Tensor | None = None
    tail_v: torch.Tensor | None = None
    k_absmax: torch.Tensor | None = None
    n_tokens: int = 0
    tiny_k: bool = False
    tiny_v: bool = False
    block_exponents: bool = False
    k_exp: torch.Tensor | None = None
    value_block: int = 0  # > 0: keep v_exp, the block-bound value rule's exponent bytes per value_block tokens
    v_exp: torch.Tensor | None = None
    v_exp_max: torch.Tensor | None = None
    visible: int = 0  # the newest tokens this step's attention sees (a sliding layer's window)
    _empty: bool = field(default=True, repr=False)

    format: ClassVar[str] = "planes"
    reads_by_query: ClassVar[bool] = True
    TENSORS: ClassVar[tuple[str, ...]] = (
        "k_a",
        "k_b",
        "k_c",
        "v_a",
        "v_b",
        "v_c",
        "tail_k",
        "tail_v",
        "k_absmax",
        "k_exp",
        "v_exp",
        "v_exp_max",
    )

    def tensors_k(self) -> list[torch.Tensor | None]:
        return [self.k_a, self.k_b, self.k_c, self.tail_k, self.k_absmax, self.k_exp]

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace every tensor (all batch-first) by ``fn(tensor)``: beam reorder, batch select, offload."""
        for name in self.TENSORS:
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, fn(tensor))

    def tensors_v(self) -> list[torch.Tensor | None]:
        return [self.v_a, self.v_b, self.v_c, self.tail_v, self.v_exp, self.v_exp_max]

    @property
    def first_visible(self) -> int:
        """Index, among the tokens held, of the first one this step's attention sees."""
        return self.n_tokens - self.visible

    @property
    def n_full(self) -> int:
        return 0 if self.v_a is None else self.v_a.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append fp16 ``k``/``v`` ``[b, h, t, d]``; every completed 64-token block moves into planes."""
        if self.value_block and BLOCK % self.value_block:
            raise InvalidParameterError(f"value_block {self.value_block} must divide the {BLOCK}-token plane block")
        if k.shape[-1] % 8:
            raise InvalidParameterError(f"head_dim {k.shape[-1]} must be a multiple of 8 for the plane layout")
        absmax = k.abs().amax(dim=2)
        if self._empty:
            self.tail_k, self.tail_v, self.k_absmax, self._empty = k, v, absmax, False
        else:
            self.tail_k = torch.cat([self.tail_k, k], dim=2)
            self.tail_v = torch.cat([self.tail_v, v], dim=2)
            self.k_absmax = torch.maximum(self.k_absmax, absmax)
        self.n_tokens += k.shape[2]
        full = (self.tail_k.shape[2] // BLOCK) * BLOCK
        if full:
            self._store_blocks(self.tail_k[:, :, :full], self.tail_v[:, :, :full])
            self.tail_k, self.tail_v = self.tail_k[:, :, full:].clone(), self.tail_v[:, :, full:].clone()

    def kept(self, n: int) -> PlaneStore:
        """A store of the same kind holding only the oldest ``n`` tokens, rebuilt from them read at 16 bits
        (the fp16 appended, exactly): planes, running max and block exponents as if nothing came after."""
        fresh = type(self)(block_exponents=self.block_exponents, value_block=self.value_block)
        if n:
            fresh.append(self.read_keys(16)[:, :, :n].contiguous(), self.read_values(16)[:, :, :n].contiguous())
        return fresh

    def drop_blocks(self, n_blocks: int) -> None:
        """Forget the oldest ``n_blocks`` whole blocks (a sliding-window layer's tokens no query can
        see again); copies, so the dropped bytes are freed. ``k_absmax`` and ``v_exp_max`` stay the running
        maxima (bounds still)."""
        n_blocks = min(n_blocks, self.n_full // BLOCK)
        if n_blocks <= 0:
            return
        for name in ("k_a", "k_b", "k_c", "k_exp"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name)[:, :, n_blocks:].clone())
        for name in ("v_a", "v_b", "v_c"):
            setattr(self, name, getattr(self, name)[:, :, n_blocks * BLOCK :].clone())
        if self.v_exp is not None:
            self.v_exp = self.v_exp[:, :, n_blocks * BLOCK // self.value_block :].clone()
        self.n_tokens -= n_blocks * BLOCK

    def _store_blocks(self, k: torch.Tensor, v: torch.Tensor) -> None:
        b, h, n, d = k.shape
        k_blocks = k.view(b, h, n // BLOCK, BLOCK, d).transpose(-1, -2)  # channel-major per block
        new = (*split_planes(k_blocks), *split_planes(v))
        # Whether any element's high byte reads as ±0 (|x| < 2^-16): only then can the ±0 rule apply.
        self.tiny_k = self.tiny_k or bool(((new[0] & 0x7F) == 0).any())
        self.tiny_v = self.tiny_v or bool(((new[3] & 0x7F) == 0).any())
        if self.block_exponents:
            new = (*new, block_exponent_field(new[0]))
        names = ("k_a", "k_b", "k_c", "v_a", "v_b", "v_c", "k_exp")[: len(new)]
        if self.value_block:  # per block of value_block tokens and channel: the largest exponent field
            new, names = (*new, ((new[3] >> 2) & 0x1F).unflatten(2, (-1, self.value_block)).amax(3)), (*names, "v_exp")
        for name, tensor in zip(names, new, strict=True):
            old = getattr(self, name)
            setattr(self, name, tensor if old is None else torch.cat([old, tensor], dim=2))
        self.fold_v_exp_max(new[3])

    def fold_v_exp_max(self, v_a: torch.Tensor) -> None:
        """Fold the exponent fields of newly stored plane-A values ``[b, h, n, d]`` into ``v_exp_max`` (every
        append path calls it, so the bound never lags the fields the kernel would otherwise read)."""
        top = ((v_a >> 2) & 0x1F).amax(dim=2)
        self.v_exp_max = top if self.v_exp_max is None else torch.maximum(self.v_exp_max, top)

    def read_keys(self, widths: torch.Tensor | int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
        """All keys ``[b, h, L, d]`` in ``dtype``; block tokens read at ``widths`` per (b, h, channel)
        or per (b, h, block, channel)."""
        if self.k_a is None:
            return self.tail_k.to(dtype)
        b, h, nb, d, _ = self.k_a.shape
        mask, fill = _mask_fill32(widths, self.k_a.device)
        if mask.dim():  # per (b, h, channel) or per (b, h, block, channel), expanded to the int32 words
            if mask.dim() == 3:
                mask, fill = mask[:, :, None], fill[:, :, None]
            words = (b, h, nb, d, BLOCK // 8)
            mask = mask[..., None].expand(words).contiguous()
            fill = fill[..., None].expand(words).contiguous()
        even, odd = _low_bytes(self.k_b, self.k_c, mask, fill)
        pairs = torch.empty(b, h, nb, d, BLOCK // 2, 2, 2, dtype=torch.uint8, device=self.k_a.device)
        pairs[..., 0, 0] = even
        pairs[..., 1, 0] = odd
        pairs[..., 1] = self.k_a.view(b, h, nb, d, BLOCK // 2, 2)
        if self.tiny_k:
            _zero_rule(pairs, fill[..., :1, None] if fill.dim() else fill)
        blocks = pairs.view(torch.float16).view(b, h, nb, d, BLOCK)
        out = torch.empty(b, h, self.n_tokens, d, dtype=dtype, device=self.k_a.device)
        out[:, :, : nb * BLOCK].view(b, h, nb, BLOCK, d).copy_(blocks.transpose(-1, -2))
        out[:, :, nb * BLOCK :] = self.tail_k
        return out

    def read_values(self, widths: torch.Tensor | int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
        """All values ``[b, h, L, d]`` in ``dtype``, block tokens read at ``widths`` per (b, h, token)."""
        if self.v_a is None:
            return self.tail_v.to(dtype)
        b, h, n, d = self.v_a.shape
        mask, fill = _mask_fill32(widths, self.v_a.device)
        if mask.dim():  # per (b, h, token), expanded to the int32 words of the token's row
            mask = mask[..., None].expand(b, h, n, d // 8).contiguous()
            fill = fill[..., None].expand(b, h, n, d // 8).contiguous()
        even, odd = _low_bytes(self.v_b, self.v_c, mask, fill)
        pairs = torch.empty(b, h, n, d // 2, 2, 2, dtype=torch.uint8, device=self.v_a.device)
        pairs[..., 0, 0] = even
        pairs[..., 1, 0] = odd
        pairs[..., 1] = self.v_a.view(b, h, n, d // 2, 2)
        if self.tiny_v:
            _zero_rule(pairs, fill[..., :1, None] if fill.dim() else fill)
        out = torch.empty(b, h, self.n_tokens, d, dtype=dtype, device=self.v_a.device)
        out[:, :, :n] = pairs.view(torch.float16).view(b, h, n, d)
        out[:, :, n:] = self.tail_v
        return out

    def high_bytes_at(self, idx: torch.Tensor) -> torch.Tensor:
        """Plane A of the tokens ``idx`` ``[b, h, m]`` (indices among those held) ``[b, h, m, d]`` (uint8):
        the rows ``O_est`` reads, without assembling plane A of every token."""
        d = self.tail_v.shape[-1]

        def rows(plane: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
            return plane.gather(2, at.clamp(0, plane.shape[2] - 1).unsqueeze(-1).expand(-1, -1, -1, d))

        tail = (fp16_bits(self.tail_v) >> 8).to(torch.uint8)
        if self.v_a is None or not tail.shape[2]:
            return rows(tail, idx) if self.v_a is None else rows(self.v_a, idx)
        return torch.where((idx < self.n_full).unsqueeze(-1), rows(self.v_a, idx), rows(tail, idx - self.n_full))

    def value_high_bytes(self) -> torch.Tensor:
        """Plane A of every value, tail included ``[b, h, L, d]`` (uint8)."""
        tail = (fp16_bits(self.tail_v) >> 8).to(torch.uint8)
        return tail if self.v_a is None else torch.cat([self.v_a, tail], dim=2)


@dataclass(frozen=True)
class AlignedRule:
    """What decides a step's widths: the binade gaps ``(t12, t8)`` at which keys and values drop to 12 and
    8 bits, ``topk`` strided-max candidates behind ``O_est``, ``v_block`` (value widths per block of that
    many tokens, counted from the store's first token; 1 = the paper), ``blockwise`` (AlignedKV+: key
    widths per 64-token block from the block exponents), ``margin`` binades added to every threshold and
    ``accumulation`` (add ``accumulation_margin(n)`` for the ``n`` addends of each sum), and the model's
    logit ``softcap`` (the scores the value rule reads are soft-capped as attention's are). ``value_rule``:
    ``token`` (the paper: per token, from plane A) or ``block`` (``kvquant.alignment.block_value_widths``:
    per ``v_block`` tokens, from the exponent bytes kept at append time)."""

    k_thresholds: tuple[float, float] = (4, 8)
    v_thresholds: tuple[float, float] = (4, 8)
    topk: int = 32
    v_block: int = 1
    blockwise: bool = False
    margin: float = 0.0
    accumulation: bool = False
    softcap: float | None = None
    value_rule: str = "token"

    def thresholds(self, thresholds: tuple[float, float], n_addends: int) -> tuple[float, float]:
        """``thresholds`` raised by the margin (and the accumulation margin for ``n_addends``)."""
        extra = self.margin + (accumulation_margin(n_addends) if self.accumulation else 0.0)
        return (thresholds[0] + extra, thresholds[1] + extra)

    def k_tiers(self, head_dim: int) -> tuple[float, float]:
        return self.thresholds(self.k_thresholds, head_dim)

    def v_tiers(self, n_tokens: int) -> tuple[float, float]:
        return self.thresholds(self.v_thresholds, n_tokens)


def step_key_widths(store: PlaneStore, rule: AlignedRule, query: torch.Tensor) -> torch.Tensor:
    """The key rule (integer exponent arithmetic): per column, or per (block, column) for AlignedKV+."""
    tiers = rule.k_tiers(query.shape[-1])
    if rule.blockwise and store.k_exp is not None:
        return block_key_widths(query, store.k_absmax, store.k_exp, tiers)
    return key_widths(query, store.k_absmax, tiers)


def scores(
    query: torch.Tensor,
    keys: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Attention probabilities ``[b, q_heads, q_len, L]`` in ``dtype`` of ``query`` over ``keys``: logits
    scaled, soft-capped (``tanh(x/softcap)·softcap``), then the mask applied.

    The width rules take them in fp64: a product of an fp32 query element and an fp16 key is exact there
    and a sum of ``head_dim`` of them is off by ~1e-16, so a width moves only when a score lies that close
    to a power of two — any BLAS order, thread count or kernel decides the same widths, where fp32 sums in
    different orders would move one now and then."""
    b, hq, q_len, d = query.shape
    hkv, n = keys.shape[1], keys.shape[2]
    grouped = query.to(dtype).reshape(b, hkv, (hq // hkv) * q_len, d)  # GQA without copying K
    logits = (torch.matmul(grouped, keys.to(dtype).transpose(-1, -2)) * scaling).view(b, hq, q_len, n)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return torch.softmax(masked_logits(logits, mask), dim=-1).nan_to_num(0.0)


KeyReader = Callable[[PlaneStore, torch.Tensor, torch.dtype], torch.Tensor]


def read_keys(store: PlaneStore, wk: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return store.read_keys(wk, dtype)


def decide_widths(
    store: PlaneStore,
    rule: AlignedRule,
    query: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    keys_at: KeyReader = read_keys,
    gaps: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = exponent_gaps,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rules for this step: ``(keys, wk, wv)``, ``keys`` the visible keys as read at ``wk`` (the value
    rule's fp64 scores come from them) and ``wv`` the widths of the visible block tokens, raised to the
    widest of each ``v_block``. ``keys_at``/``gaps`` may be a kernel's, bit for bit the same as torch's."""
    first = store.first_visible
    wk = step_key_widths(store, rule, query)
    keys = keys_at(store, wk, query.dtype)[:, :, first:]
    probs = scores(query, keys, mask, scaling, rule.softcap, torch.float64)
    tiers = rule.v_tiers(store.visible)
    if rule.value_rule == "block":
        if store.v_exp is None:  # no block stored yet: nothing read from planes
            return keys, wk, torch.empty(*wk.shape[:2], 0, dtype=torch.int32, device=wk.device)

        def rows_at(idx: torch.Tensor) -> torch.Tensor:
            return store.high_bytes_at(idx + first)

        return keys, wk, block_value_widths(probs, store.v_exp, rows_at, tiers, rule.topk, rule.v_block, first)
    wv_all = value_widths(probs, store.value_high_bytes()[:, :, first:], tiers, rule.topk, gaps)
    wv = block_widths(wv_all[:, :, : max(0, store.n_full - first)], rule.v_block, first)
    return keys, wk, wv


def aligned_read(
    store: PlaneStore, rule: AlignedRule, query: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decide this step's widths and read K and V at them: ``(keys, values, wk, wv)``, what attention sees."""
    first = store.first_visible
    keys, wk, wv = decide_widths(store, rule, query, mask, scaling)
    unseen = wv.new_full((*wv.shape[:2], min(first, store.n_full)), 16)  # held, out of the window: not read
    values = store.read_values(torch.cat([unseen, wv], dim=2) if first else wv, query.dtype)[:, :, first:]
    return keys, values, wk, wv


def attend(
    store: PlaneStore, rule: AlignedRule, query: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> tuple[torch.Tensor, Reads]:
    """The torch reference: the rules, then attention over K/V as read."""
    keys, values, wk, wv = aligned_read(store, rule, query, mask, scaling)
    return attention(query, keys, values, mask, scaling, rule.softcap), Reads(wk, wv)
