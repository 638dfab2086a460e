"""KIVI (Liu et al., 2024): asymmetric 2/4-bit KV cache — keys per channel, values per token, fp16 window.

Storage, per layer (all of it named by ``stored_k``/``stored_v``, so bytes are measured):

- **Keys** are quantized per channel: a group is ``group_size`` (G) consecutive tokens of one channel.
  The fp16 key window holds at most ``residual`` (R) tokens; when an update makes it longer, its
  oldest *whole blocks of R tokens* leave it (``⌊(w − 1)/R⌋·R`` tokens, SPEC: "keys leave the window
  only in whole blocks of R"). After any update the window holds 1…R keys, so the newest key is
  always fp16. R is a multiple of G, so a block is R/G whole groups, and blocks stay aligned to
  multiples of R from the first token: the codes do not depend on how the sequence was chunked.
- **Values** are quantized per token: a group is G consecutive channels of one token (G must divide
  the head dim). The fp16 value window holds the newest ``min(L, R)`` values; each value that leaves
  it is quantized alone.
- Codes are packed into ``uint8``; scale and zero are fp16, one pair per group
  (``kvquant.quant.integer``). Incoming K/V are rounded to fp16 first (the window's format), so a
  token's codes are the same whether it was quantized at prefill or when it left the window.

Updates are incremental: an update quantizes only what leaves the window and appends the codes to
what is held; nothing already quantized is ever re-quantized. ``update`` returns the dequantized
history followed by the window, in the input dtype, so the model's stock attention runs unchanged.

Reads: each update the attention reads everything the layer holds — the window at 16 bits and, for
the quantized part, its codes plus every group's scale and zero (``b + 32/G`` bits per element for
KIVI). That measured total is recorded exactly; because ``count_read`` takes whole-bit widths, the
quantized elements are split between ``⌊w⌋`` and ``⌈w⌉`` bits so that the total (and the mean) is
exact — the per-width histogram of the quantized part is a two-point rendering of one mean width.

The window, the read counting and the parameters KIVI shares with GEAR live in
``kvquant.methods.window``; ``group_size`` None is the paper's 32 adapted to the model's head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvquant.backends import TORCH, Backend
from kvquant.cache import KVGeometry
from kvquant.errors import InvalidParameterError
from kvquant.formats.codes import CodesState, QuantStore
from kvquant.formats.window import CHANNEL_AXIS, TOKEN_AXIS, Stream
from kvquant.methods.base import register_method
from kvquant.methods.window import WindowedLayer, WindowedMethod


class KiviLayer(WindowedLayer):
    """One decoder layer's KIVI store (see the module docstring for the layout and flush rules)."""

    params: KiviMethod

    def new_state(self) -> CodesState:
        bits, residual, g = self.params.bits, self.params.residual, self.group_size
        keys = Stream(QuantStore(bits, TOKEN_AXIS, g), residual, block=residual)
        values = Stream(QuantStore(bits, CHANNEL_AXIS, g), residual, block=None)
        return self.backend.new_state(CodesState, keys, values, bits, g)  # the backend's own, where it keeps one


def kivi_fp16_tokens(context: int, residual: int) -> tuple[int, int]:
    """How many keys and values of a ``context``-token sequence sit in the fp16 windows."""
    keys = context if context <= residual else (context - 1) % residual + 1
    return keys, min(context, residual)


@dataclass(frozen=True)
class KiviMethod(WindowedMethod):
    """KIVI (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache"):
    ``bits``-bit keys per channel and values per token in groups of ``group_size`` (None: 32, adapted
    to the head dim); the newest ``residual`` tokens in fp16."""

    allowed_bits = (2, 4, 8)
    default_group_size = 32
    family = "kivi"

    def new_layer(self, layer_idx: int, geometry: KVGeometry, backend: Backend = TORCH) -> KiviLayer:
        return KiviLayer(layer_idx, self, self.group_size_for(geometry.head_dim), geometry.window(layer_idx), backend)

    def analytic_bits(self, geometry: KVGeometry | None = None, context: int | None = None) -> float:
        """Bits per stored element: asymptotically (``context=None``) ``bits + 32/group_size`` (codes plus
        an fp16 scale and zero per group, for K and V alike), with the group size used on ``geometry``
        (the paper's default without one); at a given ``context`` the fp16 windows
        (``kivi_fp16_tokens``) are counted too. Any head dim the group size divides gives the same
        figure, and it holds whatever the chunking, since the flush rule depends on the length alone."""
        group = self.group_size_for(geometry.head_dim) if geometry is not None else self.group_size
        quantized = self.bits + 32 / (group or self.default_group_size)
        if context is None:
            return quantized
        if context < 1:
            raise InvalidParameterError(f"context must be >= 1, got {context}")
        total = 0.0
        for fp16 in kivi_fp16_tokens(context, self.residual):
            total += fp16 * 16 + (context - fp16) * quantized
        return total / (2 * context)


register_method("kivi", KiviMethod)
register_method("kivi2", KiviMethod, bits=2)
register_method("kivi4", KiviMethod, bits=4)
