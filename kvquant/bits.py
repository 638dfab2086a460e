"""fp16 bit planes and truncation — the storage AlignedKV reads from. Pure torch.

An fp16 element is ``s eeeee mmmmmmmmmm``. Plane A is its high byte (sign, exponent, top two
mantissa bits), plane B mantissa bits 7..4 and plane C bits 3..0; B and C are nibbles stored two
per byte. Reading A gives an 8-bit value, A+B 12 bits, A+B+C all 16.

Bits that are not read are filled with ``1000…`` (the midpoint of the interval the read bits leave
open), with two exceptions the paper's fill gets wrong: a read whose kept bits are ±0 gives ±0 (the
plain fill would turn every zero into a subnormal), and ±inf stays ±inf (the fill would make a
NaN). Both decisions need only the bits that were read, so a GPU kernel that never loads the
dropped planes produces the same bits. ``truncate`` additionally returns NaN unchanged; storage
never holds NaN.
"""

from __future__ import annotations

import torch

from kvquant.errors import InvalidParameterError

PLANE_WIDTHS = (8, 12, 16)
ZERO_EXPONENT = -1024
"""Stand-in for log2(0): far below any fp16/fp32 exponent, and safe to add in int32."""


def fp16_bits(x: torch.Tensor) -> torch.Tensor:
    """The 16-bit patterns of ``x`` (cast to fp16) as int32 in [0, 65535]."""
    return x.to(torch.float16).contiguous().view(torch.int16).to(torch.int32) & 0xFFFF


def bits_to_fp16(bits: torch.Tensor) -> torch.Tensor:
    """Inverse of ``fp16_bits``."""
    return bits.to(torch.int32).to(torch.int16).view(torch.float16)


def pack_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """Pack values 0..15 two per byte along the last dim (even index → low nibble)."""
    if nibbles.shape[-1] % 2:
        raise InvalidParameterError(f"nibble packing needs an even last dimension, got {nibbles.shape[-1]}")
    n = nibbles.to(torch.uint8)
    return n[..., 0::2] | (n[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_nibbles``."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def split_planes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split fp16 ``x`` into plane A (uint8) and nibble-packed planes B and C along the last dim."""
    u = fp16_bits(x)
    a = (u >> 8).to(torch.uint8)
    b = pack_nibbles((u >> 4) & 0x0F)
    c = pack_nibbles(u & 0x0F)
    return a, b, c


def join_planes(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Rebuild fp16 values from all three planes (a full 16-bit read)."""
    return bits_to_fp16(plane_bits(a, b, c))


def plane_bits(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The int32 bit patterns held by three planes."""
    return (a.to(torch.int32) << 8) | (unpack_nibbles(b).to(torch.int32) << 4) | unpack_nibbles(c).to(torch.int32)


def _check_keep(keep_bits: int | torch.Tensor) -> None:
    lo, hi = (keep_bits, keep_bits) if isinstance(keep_bits, int) else (keep_bits.min(), keep_bits.max())
    if int(lo) < 6 or int(hi) > 16:
        raise InvalidParameterError(
            f"keep_bits must lie in 6..16 (sign and exponent are never dropped), got {int(lo)}..{int(hi)}"
        )


def truncate_bits(bits: torch.Tensor, keep_bits: int | torch.Tensor) -> torch.Tensor:
    """Keep the top ``keep_bits`` of each 16-bit pattern and fill the rest with ``1000…``.

    ``keep_bits`` is an int or an integer tensor broadcastable to ``bits``. ±0, ±inf and NaN are
    returned unchanged, and a value whose kept bits are ±0 becomes ±0 (see the module docstring).
    """
    _check_keep(keep_bits)
    drop = 16 - (keep_bits if isinstance(keep_bits, torch.Tensor) else torch.tensor(keep_bits)).to(torch.int32)
    drop = drop.to(bits.device)
    kept = bits & ((0xFFFF << drop) & 0xFFFF)
    fill = torch.where(drop > 0, 1 << (drop - 1).clamp_min(0), 0)
    exponent = (bits >> 10) & 0x1F
    keep_as_is = ((kept & 0x7FFF) == 0) | (exponent == 31)
    out = torch.where(keep_as_is, kept, kept | fill)
    is_nan = (exponent == 31) & ((bits & 0x3FF) != 0)
    return torch.where(is_nan, bits, out)


def truncate(x: torch.Tensor, keep_bits: int | torch.Tensor) -> torch.Tensor:
    """``x`` as fp16 with only its top ``keep_bits`` bits read (per element if a tensor)."""
    return bits_to_fp16(truncate_bits(fp16_bits(x), keep_bits))


def read_planes(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, widths: torch.Tensor | int) -> torch.Tensor:
    """What a reader of ``widths`` bits (8, 12 or 16 per element, broadcastable) gets from the planes."""
    return bits_to_fp16(truncate_bits(plane_bits(a, b, c), widths))


def high_byte_exponent(a: torch.Tensor) -> torch.Tensor:
    """floor(log2|x|) from plane A alone (int32): exact for normals, an upper bound (-15) for
    subnormals, ``ZERO_EXPONENT`` where the high byte reads as ±0."""
    a = a.to(torch.int32)
    field = (a >> 2) & 0x1F
    exponent = torch.where(field == 0, -15, field - 15)
    return torch.where((a & 0x7F) == 0, ZERO_EXPONENT, exponent)


def floor_log2(x: torch.Tensor) -> torch.Tensor:
    """floor(log2|x|) per element (int32); ``ZERO_EXPONENT`` for zeros. fp64 stays fp64 (rounding it to
    fp32 first could carry a value just below a power of two up to it)."""
    _, e = torch.frexp(x if x.dtype == torch.float64 else x.float())
    return torch.where(x == 0, ZERO_EXPONENT, e.to(torch.int32) - 1)
