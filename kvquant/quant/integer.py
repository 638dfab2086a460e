"""Asymmetric min-max integer quantization in groups, with codes packed densely into ``uint8``.

Grid. A ``b``-bit code takes the ``2^b`` values ``0 … 2^b − 1``: a group's range ``[min, max]`` is cut
into ``2^b − 1`` equal steps, ``step = (max − min) / (2^b − 1)``, and ``x ≈ zero + code · step``. This is
what "``2^b − 1`` levels" means throughout kvquant (the SPEC's wording for GEAR): ``2^b − 1`` steps
between ``2^b`` representable points, the grid KIVI uses too. (GEAR's published code divides by
``b² − 1``, which only coincides for 2 and 4 bits.)

Storage. ``scale`` (the step) and ``zero`` (the group's lower end) are fp16, one pair per group. They
are rounded *outward* — ``zero`` down, ``scale`` up — so the fp16 grid still covers the group; every
element then lies within half a stored step of its reconstruction, even for groups whose offset is
large compared with their range. A constant group (``max == min``) of an fp16 number — what the
caches feed, since they round K/V to fp16 first — gets ``scale = 0`` and ``zero = min``: it is
reconstructed exactly, never NaN. (A constant fp32 value that fp16 cannot hold gets a tiny step and
stays within half of it.)

Grouping. Groups are ``group_size`` consecutive elements along ``axis`` (keys per channel: ``axis`` =
tokens; values per token: ``axis`` = channels). A trailing partial group is padded by repeating its
last element, which changes neither its min nor its max. Codes keep the tensor's layout and are
packed along the last dimension (four 2-bit or two 4-bit codes per byte, low bits first).

Pure torch: this module imports with torch alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

BITS = (2, 4, 8)


def levels(bits: int) -> int:
    """Number of steps of the ``bits``-bit grid (``2^b − 1``); the largest code."""
    return (1 << bits) - 1


def _check_bits(bits: int) -> None:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``uint8`` codes (each ``< 2^bits``) along the last dim, ``8 // bits`` per byte, low bits first.

    The last dim is zero-padded to a whole number of bytes; ``unpack`` needs the original length.
    """
    _check_bits(bits)
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    if bits == 8:
        return codes.contiguous()
    return _pack_codes(codes.float(), bits)  # the packing ``quantize`` does (codes < 256 are exact in fp32)


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of ``pack``: the first ``n`` codes along the last dim, as ``uint8``."""
    _check_bits(bits)
    per = 8 // bits
    if per == 1:
        return packed[..., :n]
    mask = levels(bits)
    # One shift per position rather than a broadcast shift: the broadcast uint8 kernel is erratic on CPU.
    parts = [packed & mask] + [(packed >> (bits * i)) & mask for i in range(1, per - 1)] + [packed >> (8 - bits)]
    codes = torch.stack(parts, dim=-1).flatten(-2)
    return codes if codes.shape[-1] == n else codes[..., :n]


@dataclass(frozen=True)
class QuantizedTensor:
    """Packed codes plus fp16 ``scale``/``zero`` per group; ``shape`` is the logical (unpadded) shape.

    ``scale`` and ``zero`` have the padded shape with ``axis`` replaced by ``(n_groups, 1)``, so they
    broadcast over a ``(…, n_groups, group_size, …)`` view of the codes.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    axis: int
    group_size: int
    shape: tuple[int, ...]

    @property
    def padded_shape(self) -> tuple[int, ...]:
        n = self.shape[self.axis]
        g = self.group_size
        return (*self.shape[: self.axis], -(-n // g) * g, *self.shape[self.axis + 1 :])

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held (what a cache must count as stored bytes)."""
        return [self.codes, self.scale, self.zero]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedTensor:
        """Apply a batch-dim operation (e.g. ``index_select`` on dim 0) to codes, scale and zero alike."""
        codes = fn(self.codes)
        return replace(
            self, codes=codes, scale=fn(self.scale), zero=fn(self.zero), shape=(codes.shape[0], *self.shape[1:])
        )


def _outward_fp16(
    lo: torch.Tensor, hi: torch.Tensor, steps: int, checked: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp16 ``(scale, zero)`` whose grid ``zero + k·scale, k = 0…steps`` covers ``[lo, hi]``, and both in fp32.

    ``zero`` is ``lo`` rounded down to fp16 and ``scale`` is rounded up. A constant group whose value
    is an fp16 number gets ``zero = lo`` and ``scale = 0``: it is reconstructed exactly. Unless ``checked``,
    non-finite results are refused (a host sync on a GPU).
    """
    zero = lo.half()
    zero = torch.where(zero.float() > lo, zero.nextafter(_inf(zero, -1)), zero)
    zf = zero.float()
    scale = ((hi - zf) / steps).half()
    scale = torch.where(zf + steps * scale.float() < hi, scale.nextafter(_inf(scale, 1)), scale)
    sf = scale.float()
    if not checked and not bool(torch.isfinite(sf.sum() + zf.sum())):
        raise ValueError("values outside the fp16 range (or not finite) cannot be quantized with fp16 scales")
    return scale, zero, sf, zf


_CONSTANTS: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}


def _constant(name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small constant tensor made once per dtype and device: on a GPU each ``torch.full`` a call would be a
    launch, and one value's coding (a KIVI decode step) is a few dozen small ops."""
    key = (name, dtype, device)
    if key not in _CONSTANTS:
        if name in ("inf", "-inf"):
            value = torch.tensor(float(name), dtype=dtype)
        else:  # "weights<bits>": each code's place value in its byte, for packing by a multiply and a sum
            bits = int(name.removeprefix("weights"))
            value = torch.tensor([float(1 << (bits * i)) for i in range(8 // bits)], dtype=dtype)
        _CONSTANTS[key] = value.to(device)
    return _CONSTANTS[key]


def _inf(like: torch.Tensor, sign: int) -> torch.Tensor:
    return _constant("inf" if sign > 0 else "-inf", like.dtype, like.device)


def _pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """``pack`` of integer codes held in fp32 (each ``< 2^bits``): byte ``j`` is ``Σ_i q[per·j + i]·2^(bits·i)``,
    summed exactly in fp32 (at most 255), cast once — three ops where shifting uint8 codes took ``2·per``."""
    per = 8 // bits
    if per == 1:
        return q.to(torch.uint8)
    n = q.shape[-1]
    if n % per:
        q = torch.nn.functional.pad(q, (0, per - n % per))
    weights = _constant(f"weights{bits}", q.dtype, q.device)
    return (q.reshape(*q.shape[:-1], -1, per) * weights).sum(dim=-1).to(torch.uint8)


def quantize(
    x: torch.Tensor, bits: int, axis: int, group_size: int, mask: torch.Tensor | None = None, checked: bool = False
) -> QuantizedTensor:
    """Quantize ``x`` to ``bits`` bits in groups of ``group_size`` consecutive elements along ``axis``.

    ``mask`` (same shape as ``x``, True = ignore) leaves elements out of their group's min/max; their
    codes are clamped to the grid. GEAR uses it for outliers it stores exactly elsewhere. ``checked``: ``x``
    is known finite and within fp16's range (a KIVI/GEAR layer's ``check_storable``; on a GPU read a step later),
    so every scale and zero is finite and the check, a host sync a call on a GPU, is skipped.
    """
    _check_bits(bits)
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if x.ndim == 0:
        x = x.reshape(1)
    axis = axis % x.ndim
    shape = tuple(x.shape)
    n = shape[axis]
    if n == 0:
        raise ValueError("cannot quantize an empty axis")
    xf = x.float()
    pad = -n % group_size
    if pad:
        tail = xf.narrow(axis, n - 1, 1)
        xf = torch.cat([xf, tail.expand(*shape[:axis], pad, *shape[axis + 1 :])], dim=axis)
        if mask is not None:
            mtail = mask.narrow(axis, n - 1, 1)
            mask = torch.cat([mask, mtail.expand(*shape[:axis], pad, *shape[axis + 1 :])], dim=axis)
    padded = tuple(xf.shape)
    grouped_shape = (*padded[:axis], padded[axis] // group_size, group_size, *padded[axis + 1 :])
    g = xf.reshape(grouped_shape)
    if mask is None:
        lo, hi = torch.aminmax(g, dim=axis + 1, keepdim=True)
    else:
        m = mask.reshape(grouped_shape)
        lo = torch.where(m, float("inf"), g).amin(dim=axis + 1, keepdim=True)
        hi = torch.where(m, float("-inf"), g).amax(dim=axis + 1, keepdim=True)
        empty = torch.isinf(lo)
        lo = torch.where(empty, 0.0, lo)
        hi = torch.where(empty, 0.0, hi)
    steps = levels(bits)
    scale, zero, sf, zf = _outward_fp16(lo, hi, steps, checked)
    q = ((g - zf) / torch.where(sf == 0, 1.0, sf)).round_().clamp_(0, steps)
    codes = _pack_codes(q.reshape(padded), bits)
    return QuantizedTensor(codes, scale, zero, bits, axis, group_size, shape)


_TABLES: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def _code_table(bits: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[256, 8 // bits]``: the codes packed in each possible byte, as ``dtype``."""
    key = (bits, dtype, device)
    if key not in _TABLES:
        _TABLES[key] = unpack(torch.arange(256, dtype=torch.uint8).unsqueeze(-1), bits, 8 // bits).to(device, dtype)
    return _TABLES[key]


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """Reconstruct ``zero + code · scale`` in ``dtype``; with ``out`` (the logical shape) write into it.

    ``out`` may be a strided view (e.g. the quantized prefix of a cache's output buffer).
    """
    padded = q.padded_shape
    axis, gs = q.axis, q.group_size
    grouped_shape = (*padded[:axis], padded[axis] // gs, gs, *padded[axis + 1 :])
    dtype = out.dtype if out is not None else dtype
    if q.bits == 8:
        codes = q.codes.to(dtype)
    else:
        # A byte → codes lookup table unpacks and converts in one gather, faster than shifts + cast.
        codes = torch.nn.functional.embedding(q.codes.long(), _code_table(q.bits, dtype, q.codes.device))
        codes = codes.flatten(-2)
        if codes.shape[-1] != padded[-1]:
            codes = codes[..., : padded[-1]]
    codes = codes.reshape(grouped_shape)
    scale, zero = q.scale.to(dtype), q.zero.to(dtype)
    if padded == q.shape and out is not None:
        try:
            target = out.view(grouped_shape)
        except RuntimeError:
            target = None
        if target is not None:
            torch.addcmul(zero, codes, scale, out=target)
            return out
    x = torch.addcmul(zero, codes, scale).reshape(padded)
    if padded != q.shape:
        x = x.narrow(axis, 0, q.shape[axis])
    if out is not None:
        out.copy_(x)
        return out
    return x


def cat(parts: list[QuantizedTensor], dim: int) -> QuantizedTensor:
    """Concatenate quantized tensors along ``dim`` without re-quantizing anything.

    Along the grouped axis every part but the last must hold whole groups; along the packed last dim
    every part but the last must fill whole bytes.
    """
    first = parts[0]
    if len(parts) == 1:
        return first
    ndim = len(first.shape)
    dim = dim % ndim
    for p in parts:
        if (p.bits, p.axis, p.group_size) != (first.bits, first.axis, first.group_size):
            raise ValueError("cannot concatenate quantized tensors with different bits, axis or group size")
    for p in parts[:-1]:
        if dim == first.axis and p.shape[dim] % first.group_size:
            raise ValueError("only whole groups can be concatenated along the grouped axis")
        if dim == ndim - 1 and (p.padded_shape[-1] * first.bits) % 8:
            raise ValueError("only whole bytes can be concatenated along the packed dim")
    meta_dim = dim if dim <= first.axis else dim + 1
    shape = list(first.shape)
    shape[dim] = sum(p.shape[dim] for p in parts)
    return QuantizedTensor(
        torch.cat([p.codes for p in parts], dim=dim),
        torch.cat([p.scale for p in parts], dim=meta_dim),
        torch.cat([p.zero for p in parts], dim=meta_dim),
        first.bits,
        first.axis,
        first.group_size,
        tuple(shape),
    )


def drop_leading(q: QuantizedTensor, dim: int, n: int) -> QuantizedTensor:
    """``q`` without its first ``n`` entries along ``dim`` (not the packed last dim), nothing re-quantized.

    Along the grouped axis only whole groups can go. The result owns its storage (clones, not views
    of the longer tensors), so bytes measured from it are the bytes held.
    """
    ndim = len(q.shape)
    dim = dim % ndim
    if dim == ndim - 1:
        raise ValueError("cannot drop along the packed last dim")
    if dim == q.axis and n % q.group_size:
        raise ValueError(f"only whole groups ({q.group_size}) can be dropped along the grouped axis, got {n}")
    if not 0 <= n <= q.shape[dim]:
        raise ValueError(f"cannot drop {n} of {q.shape[dim]} entries")
    meta_dim = dim if dim <= q.axis else dim + 1
    meta_n = n // q.group_size if dim == q.axis else n
    shape = list(q.shape)
    shape[dim] -= n
    return replace(
        q,
        codes=q.codes.narrow(dim, n, q.codes.shape[dim] - n).clone(),
        scale=q.scale.narrow(meta_dim, meta_n, q.scale.shape[meta_dim] - meta_n).clone(),
        zero=q.zero.narrow(meta_dim, meta_n, q.zero.shape[meta_dim] - meta_n).clone(),
        shape=tuple(shape),
    )
