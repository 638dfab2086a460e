"""GEAR (Kang et al., 2024): KIVI-style quantization + exact sparse outliers + low-rank residual correction.

Each compressed *segment* — a ``[T, D]`` matrix per (batch row, KV head), for K and for V separately
— is stored as

1. **outliers**: the ``⌊s/2 · T·D⌋`` largest and the as many smallest entries of the matrix
   (``s = outlier_ratio``, a fraction of the matrix whatever its shape), kept exact: an int32 position
   (token · D + channel, within the layer's compressed history) and an fp16 value each, 48 bits;
2. **base codes**: KIVI-style ``bits``-bit quantization (keys per channel in groups of ``group_size``
   tokens, values per token in groups of ``group_size`` channels; ``2^b − 1`` steps, see
   ``kvquant.quant.integer``) with the outliers left out of their groups' min/max;
3. **low-rank**: the quantization residual (zero at the outliers) ≈ ``A Bᵀ`` with ``A`` ``[T, r]`` and
   ``B`` ``[D, r]`` in fp16, from ``loops`` rounds of seeded power (subspace) iteration with QR.
   ``r = rank`` for a segment written by a multi-token update (prefill, or a chunk of it),
   ``rank_decode`` for one written during single-token decoding (both capped at ``min(T, D)``).

Streaming (no whole-cache recompression): K and V each keep an fp16 window of the newest tokens.
When an update makes a window longer than ``residual``, its oldest whole blocks of ``residual``
tokens leave it together, as **one new segment**, compressed once and appended; the window keeps
1…``residual`` tokens. So a prompt becomes one big segment (one rank-``rank`` correction over the
whole prompt), and decoding adds one segment of ``residual`` tokens every ``residual`` steps with a
rank-``rank_decode`` correction. Segments already stored are never touched again. ``gear_l`` is the
same without the sparse part.

Reading reconstructs dequantized codes + ``A Bᵀ`` + outliers, then the window, in the input dtype;
reads are accounted as for KIVI (every byte held, spread over the compressed elements; window at 16).

Cost per compressed element, on top of KIVI's ``bits + 32/group_size``: ``48·s`` for the outliers
(0.96 bits at s = 2%) and ``16·r·(1/T + 1/D)`` for the factors — about 1 bit at r = 4 and D = 64,
since GEAR's correction is per head. ``analytic_bits`` gives the exact figure for a prompt.

Batch rows are independent: every tensor held is batch-first and an outlier position counts within
its own (batch row, head) matrix, so a beam reorder moves positions with their values and stays
valid. The window, read counting and shared parameters are ``kvquant.methods.window``'s;
``group_size`` None is the paper's 64 adapted to the model's head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvquant.backends import TORCH, Backend
from kvquant.cache import KVGeometry
from kvquant.errors import InvalidParameterError
from kvquant.formats.gear import SPARSE_BITS, GearCoding, GearState, GearStore, outlier_count
from kvquant.formats.window import CHANNEL_AXIS, TOKEN_AXIS, Stream
from kvquant.methods.base import register_method
from kvquant.methods.window import WindowedLayer, WindowedMethod


class GearLayer(WindowedLayer):
    """One decoder layer's GEAR store (layout and streaming in the module docstring)."""

    params: GearBase

    def new_state(self) -> GearState:
        p, residual, g = self.params, self.params.residual, self.group_size
        coding = GearCoding(p.bits, p.outlier_ratio, p.rank, p.rank_decode, p.loops, p.seed)
        keys = Stream(GearStore(coding, TOKEN_AXIS, g), residual, block=residual)
        values = Stream(GearStore(coding, CHANNEL_AXIS, g), residual, block=residual)
        return GearState(keys, values, p.bits, g)


@dataclass(frozen=True)
class GearBase(WindowedMethod):
    """What GEAR and GEAR-L share: a ``bits``-bit KIVI-style base in groups of ``group_size`` (None:
    64, adapted to the head dim) and a rank-``rank`` (prefill) / rank-``rank_decode`` (decode)
    residual correction from ``loops`` seeded power iterations; the newest tokens in an fp16 window."""

    bits: int = 4
    rank: int = 4
    rank_decode: int = 2
    loops: int = 3
    seed: int = 0

    allowed_bits = (2, 4)
    default_group_size = 64
    family = "gear"
    format = "gear"
    outlier_ratio: ClassVar[float] = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        label = f"method {self.label}"
        if not 0.0 <= self.outlier_ratio < 1.0:
            raise InvalidParameterError(f"{label}: outlier_ratio must be in [0, 1), got {self.outlier_ratio}")
        if self.rank < 0 or self.rank_decode < 0:
            raise InvalidParameterError(
                f"{label}: rank and rank_decode must be >= 0, got {self.rank} and {self.rank_decode}"
            )
        if self.loops < 1:
            raise InvalidParameterError(f"{label}: loops (power iterations) must be >= 1, got {self.loops}")

    def new_layer(self, layer_idx: int, geometry: KVGeometry, backend: Backend = TORCH) -> GearLayer:
        return GearLayer(layer_idx, self, self.group_size_for(geometry.head_dim), geometry.window(layer_idx), backend)

    def analytic_bits(self, geometry: KVGeometry | None = None, context: int | None = None) -> float:
        """Bits per stored element for a ``context``-token prompt written in one update (one prefill
        segment of ``⌊(L−1)/R⌋·R`` tokens with a rank-``rank`` correction, the rest in the fp16 window)
        on ``geometry`` (needed for a ``context``: the factors' cost depends on the head dim);
        ``context=None``: the limit L → ∞, ``bits + 32/group_size + 48·outlier_ratio`` (low-rank
        factors and window vanish per element)."""
        g = self.group_size_for(geometry.head_dim) if geometry is not None else self.group_size
        g = g or self.default_group_size
        if context is None:
            return self.bits + 32 / g + SPARSE_BITS * self.outlier_ratio
        if context < 1:
            raise InvalidParameterError(f"context must be >= 1, got {context}")
        if geometry is None:
            raise InvalidParameterError(f"method {self.label}: analytic bits at a context need the model's geometry")
        r = self.residual
        t = (context - 1) // r * r if context > r else 0
        d = geometry.head_dim
        total = 0.0
        for meta in (t // g * d, t * (d // g)):  # keys: per channel per token group; values: per token
            codes = self.bits * t * d + 32 * meta
            sparse = 2 * outlier_count(self.outlier_ratio, t * d) * SPARSE_BITS if t else 0
            factors = 16 * min(self.rank, t, d) * (t + d) if t else 0
            total += codes + sparse + factors + 16 * (context - t) * d
        return total / (2 * context * d)


@dataclass(frozen=True)
class GearMethod(GearBase):
    """GEAR (Kang et al., 2024, "GEAR: An Efficient KV Cache Compression Recipe for Near-Lossless
    Generative Inference of LLM"): the shared base plus the ``outlier_ratio`` largest and smallest
    entries of each segment kept exact."""

    outlier_ratio: float = 0.02


@dataclass(frozen=True)
class GearLMethod(GearBase):
    """GEAR-L: GEAR without the sparse outliers (quantization + low-rank residual only)."""

    family = "gear_l"


register_method("gear", GearMethod)
register_method("gear2", GearMethod, bits=2)
register_method("gear4", GearMethod, bits=4)
register_method("gear_l", GearLMethod)
register_method("gear_l2", GearLMethod, bits=2)
register_method("gear_l4", GearLMethod, bits=4)
