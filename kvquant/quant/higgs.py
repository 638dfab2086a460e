"""HIGGS: Hadamard rotation + Gaussian-optimal vector grid, for one token's channels at a time.

Per token, the channels (all KV heads concatenated) are split into groups of ``min(group, channels)``
(1024 by default). Each group is divided by its RMS (its L2 norm / √size, stored in fp16 — the only
side information), multiplied by fixed random signs and rotated by an orthonormal Hadamard matrix
(a randomized Hadamard transform: without the signs a constant offset, common in keys, would land
on one coordinate far outside the grid) so its coordinates are close to i.i.d. N(0, 1), cut into
``d``-dim chunks and each chunk replaced by the index of the nearest point of an ``n``-point grid
that is MSE-optimal for a Gaussian (``kvquant.quant.grids``). Codes take ``log2 n`` bits and are
packed densely per token (``kvquant.quant.bitpack``); bits per value are ``log2(n)/d + 16/group``.

A group whose size has no Hadamard transform here (see ``hadamard.supported_size``) is zero-padded
to the next size that has one; the padding's codes are stored and counted, and ``padded`` says so.

Pure torch: importable without transformers, Hydra or W&B.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvquant.errors import InvalidParameterError
from kvquant.quant import bitpack
from kvquant.quant.device import on_device
from kvquant.quant.grids import GRID_FILE, PRESETS, load_grid, nearest
from kvquant.quant.hadamard import hadamard_transform, outer_factor, supported_size

MAX_GROUP = 1024
SIGN_SEED = 0x5EED
FP16_MAX = 65504.0


@dataclass(frozen=True)
class HiggsTensor:
    """Quantized rows: ``codes`` (``uint8`` ``[..., bytes]``) and fp16 ``scales`` (``[..., groups]``)."""

    codes: torch.Tensor
    scales: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scales]

    def __len__(self) -> int:
        return self.codes.shape[-2]


def cat_rows(parts: list[HiggsTensor], dim: int = -2) -> HiggsTensor:
    """Concatenate quantized tensors along a row (token) dimension."""
    return HiggsTensor(torch.cat([p.codes for p in parts], dim), torch.cat([p.scales for p in parts], dim))


class Higgs:
    """A HIGGS quantizer for vectors of ``channels`` values at ``bits`` (2, 3 or 4) bits per value."""

    def __init__(self, channels: int, bits: int = 2, group: int = MAX_GROUP, grid_file: Path = GRID_FILE):
        if bits not in PRESETS:
            raise InvalidParameterError(f"HIGGS: bits must be one of {', '.join(map(str, PRESETS))}, got {bits!r}")
        if channels < 1 or group < 1:
            raise InvalidParameterError(f"HIGGS: channels ({channels}) and group ({group}) must be >= 1")
        self.channels, self.bits = channels, bits
        self.d, self.n = PRESETS[bits]
        self.group = min(group, channels)
        self.n_groups = math.ceil(channels / self.group)
        self.padded_group = supported_size(self.group)
        while self.padded_group % self.d:
            self.padded_group = supported_size(self.padded_group + 1)
        self.padded = self.padded_group * self.n_groups != channels
        self.n_codes = self.n_groups * self.padded_group // self.d
        self.code_bits = int(math.log2(self.n))
        self.grid = load_grid(self.d, self.n, grid_file)
        gen = torch.Generator().manual_seed(SIGN_SEED)
        self.signs = torch.randint(0, 2, (self.padded_group,), generator=gen).float() * 2 - 1
        self.outer = outer_factor(self.padded_group)  # kron(outer, sylvester): the rotation, for kernels

    def describe(self) -> dict:
        """Identity of the quantizer (what predictor files are keyed by)."""
        return {
            "name": "higgs",
            "bits": self.bits,
            "d": self.d,
            "n": self.n,
            "group": self.group,
            "padded_group": self.padded_group,
            "channels": self.channels,
            "sign_seed": SIGN_SEED,
        }

    def padding_note(self) -> str | None:
        """One line saying how the groups were padded, or None if they were not."""
        if not self.padded:
            return None
        return (
            f"HIGGS: {self.channels} channels in {self.n_groups} group(s) of {self.group} have no Hadamard "
            f"transform here; each group is zero-padded to {self.padded_group} (stored bits per value rise to "
            f"{self.bits_per_value():.3f})"
        )

    def bits_per_value(self) -> float:
        """Stored bits per value: packed codes plus the fp16 scales, over the real channels."""
        return (8 * bitpack.packed_size(self.n_codes, self.code_bits) + 16 * self.n_groups) / self.channels

    def _groups(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., channels]`` → ``[..., n_groups, padded_group]``, zero-padded (no copy where nothing pads: each
        pad is a launch on a GPU at every coding)."""
        if self.n_groups * self.group != self.channels:
            x = F.pad(x, (0, self.n_groups * self.group - self.channels))
        x = x.reshape(*x.shape[:-1], self.n_groups, self.group)
        return F.pad(x, (0, self.padded_group - self.group)) if self.padded_group != self.group else x

    def quantize(self, x: torch.Tensor) -> HiggsTensor:
        """Quantize ``x`` (``[..., channels]``, any float dtype) row by row."""
        if x.shape[-1] != self.channels:
            raise ValueError(f"HIGGS: expected {self.channels} channels, got {x.shape[-1]}")
        g = self._groups(x.float())
        rms = g.pow(2).mean(-1).sqrt().clamp(max=FP16_MAX).to(torch.float16)
        s = rms.float().unsqueeze(-1)
        u = torch.where(s > 0, g / s.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(g))
        y = hadamard_transform(u * on_device(self.signs, u.device))
        grid = on_device(self.grid, y.device)
        codes = nearest(y.reshape(-1, self.d), grid).view(*x.shape[:-1], self.n_codes)
        return HiggsTensor(bitpack.pack(codes, self.code_bits), rms)

    def dequantize(self, q: HiggsTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Reconstruct ``[..., channels]`` from codes and scales."""
        codes = bitpack.unpack(q.codes, self.code_bits, self.n_codes)
        grid = on_device(self.grid, codes.device, dtype)
        y = F.embedding(codes.long(), grid).reshape(*codes.shape[:-1], self.n_groups, self.padded_group)  # a gather
        signs = on_device(self.signs, y.device, dtype)
        g = hadamard_transform(y, inverse=True) * signs * q.scales.to(dtype).unsqueeze(-1)
        return g[..., : self.group].reshape(*codes.shape[:-1], -1)[..., : self.channels]

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """``dequantize(quantize(x))`` in fp32."""
        return self.dequantize(self.quantize(x))
