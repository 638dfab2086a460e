"""Dense packing of b-bit codes (1 ≤ b ≤ 8) into ``uint8``, along the last dim, low bits first.

HIGGS codes index grids of 16, 64 or 256 points (4, 6 or 8 bits); 6 does not divide a byte, so a
byte-aligned packer would waste a quarter of the storage. Codes are packed in words of
``k = 8 / gcd(b, 8)`` codes (``b·k / 8`` bytes): 4 six-bit codes make 3 bytes. Every word fits an
int64, so packing is a handful of shifts, never a per-bit loop.

Pure torch: this module imports with torch alone.
"""

from __future__ import annotations

from math import gcd

import torch


def _word(bits: int) -> tuple[int, int]:
    """(codes per word, bytes per word)."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    per = 8 // gcd(bits, 8)
    return per, bits * per // 8


def packed_size(n: int, bits: int) -> int:
    """Bytes that ``n`` codes of ``bits`` bits take once packed (the last word is zero-filled)."""
    per, nbytes = _word(bits)
    return -(-n // per) * nbytes


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes (each in ``0 … 2^bits − 1``) along the last dim into ``uint8``."""
    per, nbytes = _word(bits)
    n = codes.shape[-1]
    if bits == 8:
        return codes.to(torch.uint8)
    if n % per:
        codes = torch.nn.functional.pad(codes, (0, per - n % per))
    c = codes.reshape(*codes.shape[:-1], -1, per).to(torch.int64)
    word = c[..., 0].clone()
    for i in range(1, per):
        word |= c[..., i] << (bits * i)
    out = torch.stack([(word >> (8 * j)) & 0xFF for j in range(nbytes)], dim=-1)
    return out.to(torch.uint8).flatten(-2)


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of ``pack``: the first ``n`` codes along the last dim, as ``int64``."""
    per, nbytes = _word(bits)
    if bits == 8:
        return packed[..., :n].to(torch.int64)
    b = packed.reshape(*packed.shape[:-1], -1, nbytes).to(torch.int64)
    word = b[..., 0].clone()
    for j in range(1, nbytes):
        word |= b[..., j] << (8 * j)
    mask = (1 << bits) - 1
    codes = torch.stack([(word >> (bits * i)) & mask for i in range(per)], dim=-1).flatten(-2)
    return codes[..., :n]
