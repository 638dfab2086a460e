"""An AQUA-KV/HIGGS layer: fp16 sinks and window around HIGGS codes of a predictor's residual
(``kvquant.formats.higgs``), coded as tokens leave the window; ``cache.py`` says how layers link.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kvquant.backends import TORCH, Backend
from kvquant.cache import CropError, KVLayer, to_fp16_checked
from kvquant.errors import KvquantError
from kvquant.formats.base import nbytes, whole_bit_widths
from kvquant.formats.higgs import AquaKVState, HiggsState
from kvquant.methods.aquakv.predictors import dequantize_pair, encode_pair, from_rows, to_rows
from kvquant.methods.aquakv.sliding import Rows, forget, rows_between, tail
from kvquant.quant.higgs import Higgs
from kvquant.quant.rope import apply_rope, undo_rope

if TYPE_CHECKING:
    from kvquant.methods.aquakv.cache import AquaKVCache

Pred = tuple[torch.Tensor, torch.Tensor] | None
PROMPT_QUERIES = 16  # queries in one forward from which a step is a prompt chunk (RoPE tables, not formula)


def rope_inputs(args: tuple, kwargs: dict) -> dict[str, Any]:
    """What transformers handed the layer besides K/V: 5.17's positional ``cache_kwargs`` or 5.24's ``kwargs=``."""
    found: dict[str, Any] = {}
    sources = [a for a in args if isinstance(a, dict)]
    sources += [kwargs.get("cache_kwargs") or {}, kwargs.get("kwargs") or {}, kwargs]
    for src in sources:
        for key in ("cos", "sin", "position_ids", "cache_position"):
            if src.get(key) is not None and key not in found:
                found[key] = src[key]
    return found


class AquaKVLayer(KVLayer):
    """One layer: fp16 sinks and window (post-RoPE, as given) around HIGGS codes of the predictor residual.

    Positions held: sinks ``[sink_lo, sink)``, codes ``[code_lo, code_lo + n_codes)``, fp16 window
    the newest ``n_recent`` of ``seen``. ``horizon`` (set by the cache): codes are kept for the newest
    ``horizon − 1`` tokens, None for all; ``early``: code tokens as they leave a sliding window.
    """

    def __init__(
        self,
        layer_idx: int,
        quant: Higgs,
        pred_k: Pred,
        pred_v: Pred,
        sink: int,
        recent: int,
        window: int | None = None,
        backend: Backend = TORCH,
    ):
        super().__init__(layer_idx, window, backend, quant)
        self.quant, self.pred_k, self.pred_v = quant, pred_k, pred_v
        self.sink, self.recent = sink, recent  # fp16 tokens: first ``sink`` and newest ``recent``
        self.horizon, self.early = window, False
        self.owner: AquaKVCache | None = None
        self._clear()

    def _clear(self) -> None:
        kind = AquaKVState if self.owner is not None and self.owner.predictors is not None else HiggsState
        self.state = kind(self.quant, self.sink, self.recent)
        self.n_quant = self.sink_lo = 0  # tokens coded so far; first sink position held
        self.n_heads = self.head_dim = 0

    def reset(self) -> None:
        super().reset()
        self._clear()
        if self.owner is not None and self.layer_idx == 0:
            self.owner.clear()

    def forget_newest(self, n: int) -> None:
        """Tokens still in the fp16 window (codes are never rewritten; layer 0 drops their positions too);
        a sliding layer's only until its window has filled."""
        if self.window is not None and self.seen >= self.window:
            raise CropError(
                f"layer {self.layer_idx}: a sliding-window layer cannot be cropped once its window has filled"
            )
        self.refuse_crop(n, self.n_recent, "in the fp16 window")
        self.state.k_win.drop_newest(n)
        self.state.v_win.drop_newest(n)
        owner = self.owner
        if self.layer_idx == 0 and owner.positions is not None:
            owner.positions = owner.positions[:, : owner.positions.shape[1] - n].clone()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        _, self.n_heads, _, self.head_dim = key_states.shape
        self.is_initialized = True

    @property
    def n_codes(self) -> int:
        return self.state.n_codes

    @property
    def n_sinks(self) -> int:
        return self.state.n_sinks

    @property
    def n_recent(self) -> int:
        return self.state.n_recent

    def held_tokens(self) -> int:
        return self.n_sinks + self.n_codes + self.n_recent

    def first_held(self) -> int:
        """The oldest position the layer holds in any form (``seen`` when it holds none)."""
        if not self.is_initialized:
            return 0
        codes = self.state.code_lo if self.state.qk is not None else self.seen
        return min(self.seen - self.n_recent, codes, self.sink_lo if self.n_sinks else self.seen)

    def logical_elements(self) -> tuple[int, int]:
        if not self.is_initialized:
            return 0, 0
        n = self.state.k_win.recent.shape[0] * self.n_heads * self.held_tokens() * self.head_dim
        return n, n

    def stored_k(self) -> list[torch.Tensor | None]:
        extra = [self.owner.positions] if self.owner is not None and self.layer_idx == 0 else []
        return [*self.state.tensors_k(), *extra]

    def stored_v(self) -> list[torch.Tensor | None]:
        return self.state.tensors_v()

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Windows, sinks, codes and scales; on layer 0 also the state the cache shares per batch row."""
        self.state.map_tensors(fn)
        if self.owner is not None and self.layer_idx == 0:
            self.owner.map_shared(fn)

    def parts_bytes(self) -> dict[str, int]:
        """Bytes held per kind: packed codes, fp16 scales, fp16 sinks, fp16 window."""
        q = [t for t in (self.state.qk, self.state.qv) if t is not None]
        return {
            "codes": nbytes(t.codes for t in q),
            "scales": nbytes(t.scales for t in q),
            "sinks": nbytes([self.state.k_win.sinks, self.state.v_win.sinks]),
            "window": nbytes([self.state.k_win.recent, self.state.v_win.recent]),
        }

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        before = self.seen
        self.owner.track_positions(self.layer_idx, before, key_states, rope_inputs(args, kwargs))
        leaving_k = self.state.k_win.push(to_fp16_checked(key_states, self.layer_idx, "key", self.finite))
        leaving_v = self.state.v_win.push(to_fp16_checked(value_states, self.layer_idx, "value", self.finite))
        self.seen += key_states.shape[-2]

        m = 0 if leaving_k is None else leaving_k.shape[-2]
        start = self.seen - self.n_recent - m  # position of the first token leaving the window
        if self.reads_in_attention(self.state):
            return self._update_for_kernel(leaving_k, leaving_v, start, key_states)
        lo = self.state.code_lo if self.state.qk is not None else start
        hi = start + m if m else lo + self.n_codes
        prev = self.owner.previous(self.layer_idx, lo, hi) if self.needs_previous() and hi > lo else None
        if m:
            self.code(leaving_k, leaving_v, start, prev)
        rk, rv = self.reconstruct(prev)
        self.owner.hand_off(self.layer_idx, self.state.code_lo, rk, rv)
        out = self._attended(key_states.dtype, rk, rv, before)
        if self.window is not None:
            forget(self)
        if self.layer_idx == len(self.owner.layers) - 1:
            self.owner.end_forward()
        return out

    def _update_for_kernel(
        self, leaving_k: torch.Tensor | None, leaving_v: torch.Tensor | None, start: int, key_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Code what leaves the window as the torch path does, count the same reads, and hand attention
        placeholders that send it to ``attend`` (full-attention layers: ``new_cache`` sees to it).
        HIGGS (no predictors in the cache): nothing is reconstructed, the kernel reads the codes. AQUA-KV:
        the cache's kernel reconstructs this layer's coded tokens into its per-forward workspace
        (``AquaKVCache.fill_workspace``), which the next layer's predictors and this layer's attention
        read; the tokens coded now are coded from the previous layer's workspace rows."""
        reconstructs = self.owner.predictors is not None
        if leaving_k is not None:
            prev = None
            if reconstructs and self.needs_previous():
                prev = self.owner.previous(self.layer_idx, start, start + leaving_k.shape[-2])
            self.code(leaving_k, leaving_v, start, prev)
        if reconstructs:
            self.owner.fill_workspace(self)
        prompt = reconstructs and key_states.shape[-2] >= PROMPT_QUERIES
        self.state.rope = self.kernel_rope(prompt)
        self._count_reads(self.n_sinks + self.n_recent)
        if self.layer_idx == len(self.owner.layers) - 1:
            self.owner.end_forward()
        b, h, _, d = key_states.shape
        return self.expect_attention((b, h, self.held_tokens(), d), key_states.dtype, key_states.device)

    def attend(self, module, query: torch.Tensor, attention_mask, scaling: float | None = None, **kwargs):
        """The backend's kernel over this step's state; the step's RoPE tables are not kept after it."""
        try:
            return super().attend(module, query, attention_mask, scaling, **kwargs)
        finally:
            self.state.rope = {}

    def kernel_rope(self, prompt: bool = False) -> dict[str, Any]:
        """How a kernel re-applies RoPE to the coded (pre-RoPE) keys (``HiggsState.rope``): their int32
        ``positions`` with the rotary module's ``inv_freq`` and ``rope_scale`` where its tables are that
        formula (``AquaKVCache.rope_formula``) and the step is not a ``prompt`` chunk, else fp32
        ``cos``/``sin`` tables, shared by the layers within a forward (AQUA-KV's prompt chunks take them:
        with many query rows its kernel would compute each key's sincos once per 16-row tile); {} before
        any code; ``post_rope``
        where the keys were coded after RoPE (nothing to re-apply)."""
        if self.state.qk is None:
            return {}
        if self.owner.post_rope:
            return {"post_rope": True}
        formula = self.owner.rope_formula(self.layer_idx)
        if formula is not None and not prompt:
            lo = self.state.code_lo - self.owner.pos_lo
            return {
                "positions": self.owner.positions[:, lo : lo + self.n_codes],
                "inv_freq": formula[0],
                "rope_scale": formula[1],
            }
        cos, sin = self.owner.quantized_rope(self.layer_idx, self.state.code_lo, self.n_codes)
        return {"cos": cos, "sin": sin}

    def _attended(
        self, dtype: torch.dtype, rk: torch.Tensor | None, rv: torch.Tensor | None, before: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sinks, reconstructed codes (re-rotated) and window from the first position attention reads:
        all, or on a sliding layer the newest ``window − 1`` before this update (``get_mask_sizes``)."""
        first = 0 if self.window is None else max(0, before - self.window + 1)
        parts_k = [tail(self.state.k_win.sinks, self.sink_lo, first)]
        parts_v = [tail(self.state.v_win.sinks, self.sink_lo, first)]
        if rk is not None:
            s = max(self.state.code_lo, first)
            n = self.state.code_lo + self.n_codes - s
            if n > 0:
                k = from_rows(rk[:, s - self.state.code_lo :], self.n_heads)
                if not self.owner.post_rope:
                    k = apply_rope(k, *self.owner.quantized_rope(self.layer_idx, s, n))
                parts_k.append(k)
                parts_v.append(from_rows(rv[:, s - self.state.code_lo :], self.n_heads))
        parts_k.append(tail(self.state.k_win.recent, self.seen - self.n_recent, first))
        parts_v.append(tail(self.state.v_win.recent, self.seen - self.n_recent, first))
        fp16 = sum(p.shape[-2] for p in (parts_k[0], parts_k[-1]) if p is not None)
        self._count_reads(fp16)
        keys = torch.cat([p.to(dtype) for p in parts_k if p is not None], dim=-2)
        return keys, torch.cat([p.to(dtype) for p in parts_v if p is not None], dim=-2)

    def needs_previous(self) -> bool:
        return self.pred_k is not None or self.pred_v is not None

    def code(self, ek: torch.Tensor, ev: torch.Tensor, start: int, prev: Rows | None) -> None:
        """Quantize fp16 tokens at positions ``[start, start + m)`` (post-RoPE keys, coded with RoPE taken
        off unless the cache codes them as they are) and append their codes."""
        m = ek.shape[-2]
        if self.state.qk is not None and self.state.code_lo + self.n_codes != start:
            raise KvquantError(f"aquakv layer {self.layer_idx}: codes would not be contiguous (internal error)")
        k = ek.float() if self.owner.post_rope else undo_rope(ek.float(), *self.owner.tables(self.layer_idx, start, m))
        k = to_rows(k)
        v = to_rows(ev.float())
        prev_k, prev_v = rows_between(prev, start, start + m, self.layer_idx) if prev is not None else (None, None)
        encode = self.backend.kernel("aquakv_encode")
        if encode is not None:  # the rule in one kernel call
            q = self.quant
            qk, qv = encode(
                k, v, grid=q.grid, signs=q.signs, outer=q.outer, code_bits=q.code_bits, group=q.group,
                pred_k=self.pred_k, pred_v=self.pred_v, prev_k=prev_k, prev_v=prev_v,
            )  # fmt: skip
        else:
            qk, _, qv, _ = encode_pair(self.quant, self.pred_k, self.pred_v, k, v, prev_k, prev_v, reconstruct=False)
        self.state.add_codes(qk, qv, start)
        self.n_quant += m

    def reconstruct(self, prev: Rows | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Pre-RoPE keys and values of the coded tokens held (``[B, n_codes, C]`` fp32), or ``(None, None)``;
        ``prev``: the previous layer's reconstruction from its first row's position on."""
        if self.state.qk is None:
            return None, None
        span = (self.state.code_lo, self.state.code_lo + self.n_codes, self.layer_idx)
        prev_k, prev_v = rows_between(prev, *span) if prev is not None else (None, None)
        return dequantize_pair(self.quant, self.pred_k, self.pred_v, self.state.qk, self.state.qv, prev_k, prev_v)

    def _count_reads(self, fp16_tokens: int) -> None:
        per_token = self.state.k_win.recent.shape[0] * self.n_heads * self.head_dim
        n_codes = per_token * self.n_codes
        bits_k = 8 * nbytes(self.state.qk.tensors()) if self.state.qk else 0
        bits_v = 8 * nbytes(self.state.qv.tensors()) if self.state.qv else 0
        fp16 = per_token * fp16_tokens
        self.count_read(whole_bit_widths(n_codes, bits_k, fp16), whole_bit_widths(n_codes, bits_v, fp16))
