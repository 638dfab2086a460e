"""AQUA-KV's layers and the cache that links them: fp16 sinks and window around HIGGS codes of the
residual a cross-layer predictor leaves.

Each layer holds two ``Window``s (K, V; the first ``sink`` tokens and the newest ``window`` stay fp16
exactly as the model produced them, after RoPE) and the HIGGS codes and scales of the tokens that
left the window. Layer ``l``'s codes are of ``x − pred(layer l − 1's reconstruction)``, so the cache
keeps what the layers share, per batch row: the token positions (to undo and redo RoPE; held — and
counted — by layer 0), the previous layer's reconstruction handed on within a forward, and the
forward's cos/sin of the quantized tokens. Layer 0's ``map_tensors`` maps that shared state too, so
beam search, batch selection and offloading move every batch-first tensor together.

RoPE. Predictors work on pre-RoPE keys, but a Llama attention hands the cache rotated ones. The
cache undoes the rotation with cos/sin it computes from the model's own rotary-embedding module at
the token positions — ``position_ids`` when transformers passes them (5.24: ``kwargs=``), the
``cache_position`` of 5.17's positional ``cache_kwargs``, else its own running count — and checks
once against the ``cos``/``sin`` that 5.17 hands over. No modeling file is forked.

Reads: each forward reads every quantized token's codes and scales and the fp16 sinks/window
(``Window.read_widths``). Predictor weights and positions are not counted as reads.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from kvquant.cache import KVCache, KVLayer, nbytes, to_fp16_checked
from kvquant.errors import InvalidParameterError, KvquantError
from kvquant.methods.aquakv.predictors import Predictors, dequantize_pair, encode_pair, from_rows, to_rows
from kvquant.methods.window import Window
from kvquant.quant.higgs import Higgs, HiggsTensor, cat_rows
from kvquant.quant.rope import apply_rope, rope_tables, undo_rope

Pred = tuple[torch.Tensor, torch.Tensor] | None


def find_rotary(model: Any) -> torch.nn.Module:
    """The model's rotary-embedding module (``model.model.rotary_emb`` for Llama-family models)."""
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None:
        rotary = next((m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")), None)
    if rotary is None:
        raise InvalidParameterError(
            f"aquakv: {type(model).__name__} has no rotary-embedding module; AQUA-KV needs one to undo RoPE"
        )
    return rotary


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


def map_higgs(q: HiggsTensor | None, fn: Callable[[torch.Tensor], torch.Tensor]) -> HiggsTensor | None:
    return None if q is None else HiggsTensor(fn(q.codes), fn(q.scales))


class AquaKVLayer(KVLayer):
    """One layer: fp16 sinks and window (post-RoPE, as given) around HIGGS codes of the predictor residual."""

    is_croppable = False

    def __init__(self, layer_idx: int, quant: Higgs, pred_k: Pred, pred_v: Pred, sink: int, recent: int):
        super().__init__(layer_idx)
        self.quant, self.pred_k, self.pred_v = quant, pred_k, pred_v
        self.sink, self.recent = sink, recent  # fp16 tokens: first ``sink`` and newest ``recent``
        self.owner: AquaKVCache | None = None
        self._clear()

    def _clear(self) -> None:
        self.k_win, self.v_win = Window(self.recent, sink=self.sink), Window(self.recent, sink=self.sink)
        self.qk: HiggsTensor | None = None
        self.qv: HiggsTensor | None = None
        self.n_quant = self.length = 0
        self.n_heads = self.head_dim = 0

    def reset(self) -> None:
        super().reset()
        self._clear()
        if self.owner is not None and self.layer_idx == 0:
            self.owner.clear()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        _, self.n_heads, _, self.head_dim = key_states.shape
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.length

    def logical_elements(self) -> tuple[int, int]:
        if not self.is_initialized:
            return 0, 0
        n = self.k_win.recent.shape[0] * self.n_heads * self.length * self.head_dim
        return n, n

    def stored_k(self) -> list[torch.Tensor | None]:
        extra = [self.owner.positions] if self.owner is not None and self.layer_idx == 0 else []
        return [*self.k_win.tensors(), *(self.qk.tensors() if self.qk else []), *extra]

    def stored_v(self) -> list[torch.Tensor | None]:
        return [*self.v_win.tensors(), *(self.qv.tensors() if self.qv else [])]

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Windows, sinks, codes and scales; on layer 0 also the state the cache shares per batch row."""
        self.k_win.map(fn)
        self.v_win.map(fn)
        self.qk, self.qv = map_higgs(self.qk, fn), map_higgs(self.qv, fn)
        if self.owner is not None and self.layer_idx == 0:
            self.owner.map_shared(fn)

    def parts_bytes(self) -> dict[str, int]:
        """Bytes held per kind: packed codes, fp16 scales, fp16 sinks, fp16 window."""
        q = [t for t in (self.qk, self.qv) if t is not None]
        return {
            "codes": nbytes(t.codes for t in q),
            "scales": nbytes(t.scales for t in q),
            "sinks": nbytes([self.k_win.sinks, self.v_win.sinks]),
            "window": nbytes([self.k_win.recent, self.v_win.recent]),
        }

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        self.owner.track_positions(self.layer_idx, self.length, key_states, rope_inputs(args, kwargs))
        leaving_k = self.k_win.push(to_fp16_checked(key_states, self.layer_idx, "key"))
        leaving_v = self.v_win.push(to_fp16_checked(value_states, self.layer_idx, "value"))
        self.length += n

        m = 0 if leaving_k is None else leaving_k.shape[-2]
        prev = self.owner.previous(self.layer_idx, self.n_quant + m) if self.needs_previous() else None
        if m:
            self._evict(leaving_k, leaving_v, prev)
        rk, rv = self.reconstruct(prev)
        self.owner.hand_off(self.layer_idx, rk, rv)

        dtype = key_states.dtype
        parts_k = [] if self.k_win.sinks is None else [self.k_win.sinks.to(dtype)]
        parts_v = [] if self.v_win.sinks is None else [self.v_win.sinks.to(dtype)]
        if rk is not None:
            cos, sin = self.owner.quantized_rope(self.sink, self.n_quant)
            parts_k.append(apply_rope(from_rows(rk, self.n_heads), cos, sin).to(dtype))
            parts_v.append(from_rows(rv, self.n_heads).to(dtype))
        parts_k.append(self.k_win.recent.to(dtype))
        parts_v.append(self.v_win.recent.to(dtype))
        self._count_reads()
        return torch.cat(parts_k, dim=-2), torch.cat(parts_v, dim=-2)

    def needs_previous(self) -> bool:
        return self.pred_k is not None or self.pred_v is not None

    def _evict(self, ek: torch.Tensor, ev: torch.Tensor, prev: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Quantize the tokens that left the window (the oldest after the sinks) and append their codes."""
        m = ek.shape[-2]
        start = self.sink + self.n_quant
        cos, sin = rope_tables(self.owner.rotary, self.owner.positions[:, start : start + m])
        k = to_rows(undo_rope(ek.float(), cos, sin))
        v = to_rows(ev.float())
        prev_k = prev_v = None
        if prev is not None:
            prev_k, prev_v = (p[:, self.n_quant : self.n_quant + m] for p in prev)
        qk, _, qv, _ = encode_pair(self.quant, self.pred_k, self.pred_v, k, v, prev_k, prev_v)
        self.qk = qk if self.qk is None else cat_rows([self.qk, qk])
        self.qv = qv if self.qv is None else cat_rows([self.qv, qv])
        self.n_quant += m

    def reconstruct(
        self, prev: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Pre-RoPE keys and values of the quantized tokens (``[B, n_quant, C]`` fp32), or ``(None, None)``."""
        if self.qk is None:
            return None, None
        prev_k, prev_v = prev if prev is not None else (None, None)
        return dequantize_pair(self.quant, self.pred_k, self.pred_v, self.qk, self.qv, prev_k, prev_v)

    def _count_reads(self) -> None:
        read_k = self.k_win.read_widths(self.n_quant, self.qk.tensors() if self.qk else [])
        read_v = self.v_win.read_widths(self.n_quant, self.qv.tensors() if self.qv else [])
        self.count_read(read_k, read_v)


class AquaKVCache(KVCache):
    """The layers plus what they share: token positions, the model's RoPE, the previous layer's reconstruction."""

    def __init__(self, layers: list[AquaKVLayer], rotary: torch.nn.Module, predictors: Predictors | None):
        super().__init__(layers)
        self.rotary, self.predictors = rotary, predictors
        self.adaptations: dict[str, Any] = {}
        for layer in layers:
            layer.owner = self
        self.clear()

    def clear(self) -> None:
        self.positions: torch.Tensor | None = None  # [B, L] int32
        self._handoff: dict[int, tuple[int, torch.Tensor | None, torch.Tensor | None]] = {}
        self._rope: tuple[int, int, torch.Tensor, torch.Tensor] | None = None
        self._rope_checked = False

    def map_shared(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-first map to the per-row state the layers share (positions, hand-off, cos/sin)."""
        if self.positions is not None:
            self.positions = fn(self.positions)
        self._handoff = {i: (n, fn(rk), fn(rv)) for i, (n, rk, rv) in self._handoff.items()}
        if self._rope is not None:
            start, n, cos, sin = self._rope
            self._rope = (start, n, fn(cos), fn(sin))

    def track_positions(self, layer_idx: int, seen: int, key_states: torch.Tensor, given: dict[str, Any]) -> None:
        """Record the new tokens' positions (first layer only): ``position_ids``, ``cache_position`` or a count."""
        if layer_idx != 0:
            return
        batch, _, n, _ = key_states.shape
        device = key_states.device
        if given.get("position_ids") is not None and given["position_ids"].shape[-1] == n:
            pos = given["position_ids"].reshape(-1, n)
        elif given.get("cache_position") is not None and given["cache_position"].shape[-1] == n:
            pos = given["cache_position"].reshape(1, n)
        else:
            pos = torch.arange(seen, seen + n, device=device).unsqueeze(0)
        pos = pos.to(device=device, dtype=torch.int32).expand(batch, n)
        self.positions = pos.clone() if self.positions is None else torch.cat([self.positions, pos], dim=1)
        if not self._rope_checked and given.get("cos") is not None and given["cos"].shape[-2] == n:
            self._check_rope(pos, given["cos"], given["sin"])

    def _check_rope(self, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Refuse a model whose cos/sin differ from its rotary module's at the tracked positions."""
        mine_cos, mine_sin = rope_tables(self.rotary, pos)
        tol = 1e-2 if cos.dtype in (torch.float16, torch.bfloat16) else 1e-4
        if not (torch.allclose(mine_cos, cos.float(), atol=tol) and torch.allclose(mine_sin, sin.float(), atol=tol)):
            raise KvquantError("aquakv: the cos/sin the model handed the cache differ from its rotary embedding's")
        self._rope_checked = True

    def quantized_rope(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of the quantized tokens, computed once per forward and shared by all layers."""
        if self._rope is None or self._rope[:2] != (start, n):
            cos, sin = rope_tables(self.rotary, self.positions[:, start : start + n])
            self._rope = (start, n, cos, sin)
        return self._rope[2], self._rope[3]

    def hand_off(self, layer_idx: int, rk: torch.Tensor | None, rv: torch.Tensor | None) -> None:
        """Keep layer ``l``'s reconstruction for layer ``l + 1`` of the same forward (dropped at the end)."""
        self._handoff.pop(layer_idx - 1, None)
        if layer_idx + 1 < len(self.layers) and rk is not None:
            self._handoff[layer_idx] = (rk.shape[1], rk, rv)
        else:
            self._rope = None

    def previous(self, layer_idx: int, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer ``l − 1``'s reconstruction of its ``n`` quantized tokens (from the hand-off, else rebuilt)."""
        if layer_idx == 0 or n == 0:
            return None
        got = self._handoff.get(layer_idx - 1)
        if got is not None and got[0] == n:
            return got[1], got[2]
        return self.reconstruct(layer_idx - 1)

    def reconstruct(self, upto: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Rebuild layers ``0 … upto`` from their codes alone (what any reader of this cache can do)."""
        prev = None
        for layer in self.layers[: upto + 1]:
            rk, rv = layer.reconstruct(prev if layer.needs_previous() else None)
            prev = None if rk is None else (rk, rv)
        return prev

    def stats(self) -> dict[str, Any]:
        """``KVCache.stats()`` plus bytes per kind of storage and, separately, the predictors' size."""
        out = super().stats()
        parts: Counter = Counter()
        for layer in self.layers:
            parts.update(layer.parts_bytes())
        parts["positions"] = nbytes([self.positions])
        out["bytes_by_part"] = dict(parts)
        out["predictor_bytes"] = self.predictors.nbytes() if self.predictors is not None else 0
        return out
