"""AQUA-KV's layers and the cache that links them: fp16 sinks and window around HIGGS codes of the
residual a cross-layer predictor leaves.

Each layer holds two ``Window``s (K, V; the first ``sink`` tokens and the newest ``recent`` stay fp16
exactly as the model produced them, after RoPE) and the HIGGS codes and scales of the tokens that
left the window. Layer ``l``'s codes are of ``x − pred(layer l − 1's reconstruction)``, so the cache
keeps what the layers share, per batch row: the token positions (to undo and redo RoPE; held — and
counted — by layer 0, for every token some layer still holds), the previous layer's reconstruction
handed on within a forward (with the position of its first row), and the forward's cos/sin of the
quantized tokens. Layer 0's ``map_tensors`` maps that shared state too, so beam search, batch
selection and offloading move every batch-first tensor together.

RoPE. Predictors work on pre-RoPE keys, but a Llama attention hands the cache rotated ones. The
cache undoes the rotation with cos/sin it computes from the model's own rotary-embedding module at
the token positions — ``position_ids`` when transformers passes them (5.24: ``kwargs=``), the
``cache_position`` of 5.17's positional ``cache_kwargs``, else its own running count — and checks
once against the ``cos``/``sin`` that 5.17 hands over. A module with a table per layer type
(Gemma-3's local and global bases) is asked for each layer's own type (``rope_layer_types``). No
modeling file is forked. ``post_rope`` (``higgs_post_rope``, no predictors) codes keys as handed:
no RoPE undone or redone, no positions kept.

Sliding-window layers (``window``: ``KVGeometry.window``) hand attention exactly what
``get_mask_sizes`` promised (the newest ``window − 1`` tokens before the update and the new ones),
then forget what no later step needs (``sliding.forget``). Every layer codes a token when it leaves
the newest ``recent``, so the layers' codes line up. Layer ``l + 1``'s predictor reads layer ``l``'s
reconstruction of every token ``l + 1`` holds codes for, at every step, so when ``l + 1`` predicts
from a sliding layer ``l``, ``l`` keeps codes for its window *and* for those tokens: its code horizon
is ``max(window_l, horizon_{l+1})``, unbounded when ``l + 1`` is a full layer (else its window).
Sinks leave with the window (no predictor reads them). Tokens a layer must keep codes for but has
not coded yet stay fp16 until coded on schedule, since coding them needs layer ``l − 1``'s codes of
them — except on a layer without predictors (HIGGS, AQUA-KV's layer 0), whose codes of a token
depend on that token alone: it codes tokens as they leave its window, so its fp16 part is just the
window. A HIGGS sliding layer thus holds only its window; on Gemma-2/3, AQUA-KV's sliding layer 0
holds its window in fp16 and codes of every older non-sink token, which the full layer 1 reads.

Reads: each forward reads every code row a layer holds (its attention's and the next predictor's
input) and the fp16 tokens handed to attention. Predictor weights and positions are not reads.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvquant.attention import tagged_placeholder
from kvquant.backends import get_backend
from kvquant.cache import KVCache, KVLayer, nbytes, to_fp16_checked, whole_bit_widths
from kvquant.errors import InvalidParameterError, KvquantError
from kvquant.methods.aquakv.predictors import Predictors, dequantize_pair, encode_pair, from_rows, to_rows
from kvquant.methods.aquakv.sliding import Rows, forget, rows_between, tail
from kvquant.methods.window import PROMPT_QUERIES, Window
from kvquant.quant.higgs import Higgs, HiggsTensor, cat_rows
from kvquant.quant.rope import apply_rope, rope_layer_types, rope_tables, undo_rope

Pred = tuple[torch.Tensor, torch.Tensor] | None
#: tokens by which a kernel backend's AQUA-KV workspace grows (``AquaKVCache.fill_workspace``)
WORKSPACE_BLOCK = 256


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
    """One layer: fp16 sinks and window (post-RoPE, as given) around HIGGS codes of the predictor residual.

    Positions held: sinks ``[sink_lo, sink)``, codes ``[code_lo, code_lo + n_codes)``, fp16 window
    the newest ``n_recent`` of ``seen``. ``horizon`` (set by the cache): codes are kept for the newest
    ``horizon − 1`` tokens, None for all; ``early``: code tokens as they leave a sliding window.
    """

    is_croppable = False

    def __init__(
        self,
        layer_idx: int,
        quant: Higgs,
        pred_k: Pred,
        pred_v: Pred,
        sink: int,
        recent: int,
        window: int | None = None,
        backend: str = "torch",
    ):
        super().__init__(layer_idx, window)
        self.quant, self.pred_k, self.pred_v, self.backend = quant, pred_k, pred_v, backend
        self.sink, self.recent = sink, recent  # fp16 tokens: first ``sink`` and newest ``recent``
        self.horizon, self.early = window, False
        self.owner: AquaKVCache | None = None
        self._clear()

    def _clear(self) -> None:
        self.k_win, self.v_win = Window(self.recent, sink=self.sink), Window(self.recent, sink=self.sink)
        self.qk: HiggsTensor | None = None
        self.qv: HiggsTensor | None = None
        self.n_quant = self.code_lo = self.sink_lo = 0  # tokens coded so far; first code / sink position held
        self.n_heads = self.head_dim = 0
        self._step_rope: tuple[torch.Tensor | None, torch.Tensor | None] | None = None

    def reset(self) -> None:
        super().reset()
        self._clear()
        if self.owner is not None and self.layer_idx == 0:
            self.owner.clear()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        _, self.n_heads, _, self.head_dim = key_states.shape
        self.is_initialized = True

    @property
    def n_codes(self) -> int:
        return 0 if self.qk is None else len(self.qk)

    @property
    def n_sinks(self) -> int:
        return 0 if self.k_win.sinks is None else self.k_win.sinks.shape[-2]

    @property
    def n_recent(self) -> int:
        return 0 if self.k_win.recent is None else self.k_win.recent.shape[-2]

    def held_tokens(self) -> int:
        return self.n_sinks + self.n_codes + self.n_recent

    def first_held(self) -> int:
        """The oldest position the layer holds in any form (``seen`` when it holds none)."""
        if not self.is_initialized:
            return 0
        codes = self.code_lo if self.qk is not None else self.seen
        return min(self.seen - self.n_recent, codes, self.sink_lo if self.n_sinks else self.seen)

    def logical_elements(self) -> tuple[int, int]:
        if not self.is_initialized:
            return 0, 0
        n = self.k_win.recent.shape[0] * self.n_heads * self.held_tokens() * self.head_dim
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
        self._step_rope = None
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
        before = self.seen
        self.owner.track_positions(self.layer_idx, before, key_states, rope_inputs(args, kwargs))
        leaving_k = self.k_win.push(to_fp16_checked(key_states, self.layer_idx, "key"))
        leaving_v = self.v_win.push(to_fp16_checked(value_states, self.layer_idx, "value"))
        self.seen += key_states.shape[-2]

        m = 0 if leaving_k is None else leaving_k.shape[-2]
        start = self.seen - self.n_recent - m  # position of the first token leaving the window
        if self.backend != "torch":
            return self._update_for_kernel(leaving_k, leaving_v, start, key_states)
        lo = self.code_lo if self.qk is not None else start
        hi = start + m if m else lo + self.n_codes
        prev = self.owner.previous(self.layer_idx, lo, hi) if self.needs_previous() and hi > lo else None
        if m:
            self.code(leaving_k, leaving_v, start, prev)
        rk, rv = self.reconstruct(prev)
        self.owner.hand_off(self.layer_idx, self.code_lo, rk, rv)
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
        rope = self.qk is not None and not self.owner.post_rope
        needs_tables = rope and self.owner.rope_formula(self.layer_idx) is None
        self._step_rope = (
            self.owner.quantized_rope(self.layer_idx, self.code_lo, self.n_codes) if needs_tables else None
        )
        self._count_reads(self.n_sinks + self.n_recent)
        if self.layer_idx == len(self.owner.layers) - 1:
            self.owner.end_forward()
        b, h, _, d = key_states.shape
        shape = (b, h, self.held_tokens(), d)
        return (
            tagged_placeholder(self, shape, key_states.dtype, key_states.device),
            tagged_placeholder(self, shape, key_states.dtype, key_states.device),
        )

    def workspace_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This forward's reconstruction of the coded tokens (pre-RoPE keys, values ``[B, n_codes, C]``
        fp32, views of the cache's workspace: valid until the layer after next overwrites it), or None."""
        rows = self.owner.workspace.get(self.layer_idx) if self.owner is not None else None
        return None if rows is None else (rows[1], rows[2])

    def kernel_rope(self) -> dict[str, Any]:
        """How a kernel re-applies RoPE to the coded (pre-RoPE) keys: their int32 ``positions`` with the
        rotary module's ``inv_freq`` and ``rope_scale`` where its tables are that formula
        (``AquaKVCache.rope_formula``), else this step's fp32 ``cos``/``sin`` tables; {} before any code;
        ``post_rope`` where the keys were coded after RoPE (nothing to re-apply)."""
        if self.qk is None:
            return {}
        if self.owner.post_rope:
            return {"post_rope": True}
        formula = self.owner.rope_formula(self.layer_idx)
        if formula is not None:
            lo = self.code_lo - self.owner.pos_lo
            return {
                "positions": self.owner.positions[:, lo : lo + self.n_codes],
                "inv_freq": formula[0],
                "rope_scale": formula[1],
            }
        cos, sin = self._step_rope or self.owner.quantized_rope(self.layer_idx, self.code_lo, self.n_codes)
        return {"cos": cos, "sin": sin}

    def attend(self, module, query: torch.Tensor, attention_mask, scaling: float | None = None, **kwargs):
        """Attention over the stored codes (HIGGS) or this forward's reconstruction of them (AQUA-KV), sinks
        and window, by the backend's kernel (``kvquant.attention``)."""
        ops = get_backend(self.backend).ops
        n = self.held_tokens()
        mask = attention_mask[..., :n] if attention_mask is not None else None
        causal = mask is None and query.shape[2] > 1
        if self.owner.predictors is not None:
            args = ops.aquakv_tensors(self)
            if args.get("positions") is not None and query.shape[2] >= PROMPT_QUERIES:
                args = {**args, **self._prompt_rope(), "positions": None, "inv_freq": None}
            out = ops.attend_aquakv(query, **args, mask=mask, scaling=scaling, causal=causal)
        else:
            out = ops.attend_higgs(query, **ops.higgs_tensors(self), mask=mask, scaling=scaling, causal=causal)
        self._step_rope = None
        return out.transpose(1, 2).contiguous(), None

    def _prompt_rope(self) -> dict[str, torch.Tensor]:
        """cos/sin tables of the coded tokens for a prompt chunk: with many query rows the kernel would
        compute each key's sincos once per 16-row tile, so the layers share one table per forward instead
        (the last layer, after ``end_forward``, computes its own without keeping it)."""
        last = self.layer_idx == len(self.owner.layers) - 1
        rope = self.owner.tables if last else self.owner.quantized_rope
        cos, sin = rope(self.layer_idx, self.code_lo, self.n_codes)
        return {"cos": cos, "sin": sin}

    def _attended(
        self, dtype: torch.dtype, rk: torch.Tensor | None, rv: torch.Tensor | None, before: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sinks, reconstructed codes (re-rotated) and window from the first position attention reads:
        all, or on a sliding layer the newest ``window − 1`` before this update (``get_mask_sizes``)."""
        first = 0 if self.window is None else max(0, before - self.window + 1)
        parts_k = [tail(self.k_win.sinks, self.sink_lo, first)]
        parts_v = [tail(self.v_win.sinks, self.sink_lo, first)]
        if rk is not None:
            s = max(self.code_lo, first)
            n = self.code_lo + self.n_codes - s
            if n > 0:
                k = from_rows(rk[:, s - self.code_lo :], self.n_heads)
                if not self.owner.post_rope:
                    k = apply_rope(k, *self.owner.quantized_rope(self.layer_idx, s, n))
                parts_k.append(k)
                parts_v.append(from_rows(rv[:, s - self.code_lo :], self.n_heads))
        parts_k.append(tail(self.k_win.recent, self.seen - self.n_recent, first))
        parts_v.append(tail(self.v_win.recent, self.seen - self.n_recent, first))
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
        if self.qk is not None and self.code_lo + self.n_codes != start:
            raise KvquantError(f"aquakv layer {self.layer_idx}: codes would not be contiguous (internal error)")
        k = ek.float() if self.owner.post_rope else undo_rope(ek.float(), *self.owner.tables(self.layer_idx, start, m))
        k = to_rows(k)
        v = to_rows(ev.float())
        prev_k, prev_v = rows_between(prev, start, start + m, self.layer_idx) if prev is not None else (None, None)
        if self.backend != "torch":  # the rule in one kernel call (HIGGS alone: no predictors)
            q = self.quant
            qk, qv = get_backend(self.backend).ops.aquakv_encode(
                k, v, grid=q.grid, signs=q.signs, outer=q.outer, code_bits=q.code_bits, group=q.group,
                pred_k=self.pred_k, pred_v=self.pred_v, prev_k=prev_k, prev_v=prev_v,
            )  # fmt: skip
        else:
            qk, _, qv, _ = encode_pair(self.quant, self.pred_k, self.pred_v, k, v, prev_k, prev_v)
        if self.qk is None:
            self.code_lo, self.qk, self.qv = start, qk, qv
        else:
            self.qk, self.qv = cat_rows([self.qk, qk]), cat_rows([self.qv, qv])
        self.n_quant += m

    def reconstruct(self, prev: Rows | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Pre-RoPE keys and values of the coded tokens held (``[B, n_codes, C]`` fp32), or ``(None, None)``;
        ``prev``: the previous layer's reconstruction from its first row's position on."""
        if self.qk is None:
            return None, None
        span = (self.code_lo, self.code_lo + self.n_codes, self.layer_idx)
        prev_k, prev_v = rows_between(prev, *span) if prev is not None else (None, None)
        return dequantize_pair(self.quant, self.pred_k, self.pred_v, self.qk, self.qv, prev_k, prev_v)

    def _count_reads(self, fp16_tokens: int) -> None:
        per_token = self.k_win.recent.shape[0] * self.n_heads * self.head_dim
        n_codes = per_token * self.n_codes
        bits_k = 8 * nbytes(self.qk.tensors()) if self.qk else 0
        bits_v = 8 * nbytes(self.qv.tensors()) if self.qv else 0
        fp16 = per_token * fp16_tokens
        self.count_read(whole_bit_widths(n_codes, bits_k, fp16), whole_bit_widths(n_codes, bits_v, fp16))


class AquaKVCache(KVCache):
    """The layers plus what they share: token positions, the model's RoPE, the previous layer's reconstruction.

    ``layer_types`` (``KVGeometry.layer_types``) choose each layer's RoPE table where the rotary
    module has one per type; the constructor sets each layer's code horizon (module docstring).
    """

    #: the kernel path's reconstruction buffers: a step's transient (``kvquant.analysis.memory``), not held
    transient_attributes = ("_buffers", "workspace")

    def __init__(
        self,
        layers: list[AquaKVLayer],
        rotary: torch.nn.Module,
        predictors: Predictors | None,
        layer_types: Sequence[str] | None = None,
        post_rope: bool = False,
    ):
        if post_rope and predictors is not None:
            raise InvalidParameterError("aquakv: predictors read pre-RoPE keys; post-RoPE keys are HIGGS alone")
        super().__init__(layers)
        self.rotary, self.predictors, self.post_rope = rotary, predictors, post_rope
        self.rope_types = rope_layer_types(rotary, layer_types) if layer_types else [None] * len(layers)
        self.adaptations: dict[str, Any] = {}
        after: AquaKVLayer | None = None
        for layer in reversed(layers):
            layer.owner = self
            horizon = layer.window
            if horizon is not None and after is not None and after.needs_previous():
                horizon = None if after.horizon is None else max(horizon, after.horizon)
            layer.horizon = horizon
            layer.early = layer.window is not None and not layer.needs_previous() and horizon != layer.window
            after = layer
        self.clear()

    def clear(self) -> None:
        self.positions: torch.Tensor | None = None  # [B, L] int32, of tokens pos_lo, pos_lo + 1, …
        self.pos_lo = 0
        self._handoff: dict[int, Rows] = {}
        self._rope: dict[tuple[str | None, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._rope_checked = False
        self._formula: tuple[torch.Tensor, float] | None | bool = False  # False: not looked at yet
        # kernel backends, AQUA-KV: two fp32 buffers reused forward after forward (layer l writes buffer
        # l % 2 and reads l - 1's), and which layer's rows each holds in this forward
        self._buffers: list[torch.Tensor | None] = [None, None]
        self.workspace: dict[int, Rows] = {}

    def map_shared(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-first map to the per-row state the layers share (positions, hand-off, cos/sin)."""
        if self.positions is not None:
            self.positions = fn(self.positions)
        self._handoff = {i: (lo, fn(rk), fn(rv)) for i, (lo, rk, rv) in self._handoff.items()}
        self._rope = {key: (fn(cos), fn(sin)) for key, (cos, sin) in self._rope.items()}

    def track_positions(self, layer_idx: int, seen: int, key_states: torch.Tensor, given: dict[str, Any]) -> None:
        """Record the new tokens' positions (first layer only): ``position_ids``, ``cache_position`` or a count.
        Keys coded after RoPE need no positions: none are kept."""
        if layer_idx != 0 or self.post_rope:
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
        mine_cos, mine_sin = rope_tables(self.rotary, pos, self.rope_types[0])
        tol = 1e-2 if cos.dtype in (torch.float16, torch.bfloat16) else 1e-4
        if not (torch.allclose(mine_cos, cos.float(), atol=tol) and torch.allclose(mine_sin, sin.float(), atol=tol)):
            raise KvquantError("aquakv: the cos/sin the model handed the cache differ from its rotary embedding's")
        self._rope_checked = True

    def rope_formula(self, layer_idx: int) -> tuple[torch.Tensor, float] | None:
        """``(inv_freq, scaling)`` when layer ``layer_idx``'s tables are ``cos/sin(position · inv_freq) ·
        scaling`` as transformers' static rotary modules compute them (checked once against the module
        at spread-out positions), else None (dynamic or per-layer-type RoPE, another module): then a
        kernel reads the tables instead of computing them from the positions."""
        if self._formula is False:
            self._formula = self._find_formula()
        return self._formula if self.rope_types[layer_idx] is None else None

    def _find_formula(self) -> tuple[torch.Tensor, float] | None:
        inv, scale = getattr(self.rotary, "inv_freq", None), getattr(self.rotary, "attention_scaling", None)
        kind = str(getattr(self.rotary, "rope_type", "default"))
        if not isinstance(inv, torch.Tensor) or not isinstance(scale, (int, float)) or "dynamic" in kind:
            return None
        if kind == "longrope" or inv.dim() != 1:
            return None
        inv = inv.detach().float().contiguous()
        pos = torch.tensor([[0, 1, 2, 3, 17, 255, 1000, 4097, 32767]], dtype=torch.int32, device=inv.device)
        cos, sin = rope_tables(self.rotary, pos)
        angle = pos[..., None].float() * inv
        angle = torch.cat([angle, angle], dim=-1)
        if cos.shape != angle.shape:
            return None
        close = torch.allclose(cos, angle.cos() * scale, rtol=0, atol=1e-6)
        return (inv, float(scale)) if close and torch.allclose(sin, angle.sin() * scale, rtol=0, atol=1e-6) else None

    def tables(self, layer_idx: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of tokens ``[start, start + n)`` for layer ``layer_idx``'s RoPE."""
        pos = self.positions[:, start - self.pos_lo : start - self.pos_lo + n]
        return rope_tables(self.rotary, pos, self.rope_types[layer_idx])

    def quantized_rope(self, layer_idx: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``tables`` of the coded tokens a layer hands attention, once per forward for the layers that share them."""
        key = (self.rope_types[layer_idx], start, n)
        if key not in self._rope:
            self._rope[key] = self.tables(layer_idx, start, n)
        return self._rope[key]

    def hand_off(self, layer_idx: int, lo: int, rk: torch.Tensor | None, rv: torch.Tensor | None) -> None:
        """Keep layer ``l``'s reconstruction (first row: position ``lo``) for layer ``l + 1`` of the same forward."""
        self._handoff.pop(layer_idx - 1, None)
        if layer_idx + 1 < len(self.layers) and rk is not None:
            self._handoff[layer_idx] = (lo, rk, rv)

    def end_forward(self) -> None:
        """After the last layer: drop the forward's cos/sin and the positions of tokens no layer holds."""
        self._rope.clear()
        cut = min(layer.first_held() for layer in self.layers) - self.pos_lo
        if cut > 0 and self.positions is not None:
            self.positions = self.positions[:, cut:].clone()
            self.pos_lo += cut

    def previous(self, layer_idx: int, lo: int, hi: int) -> Rows | None:
        """Layer ``l − 1``'s reconstruction covering positions ``[lo, hi)``: this forward's (the kernel
        path's workspace rows, or the torch path's hand-off), else rebuilt from the codes."""
        if layer_idx == 0:
            return None
        got = self.workspace.get(layer_idx - 1) or self._handoff.get(layer_idx - 1)
        if got is not None and got[0] <= lo and got[0] + got[1].shape[1] >= hi:
            return got
        return self.rebuild(layer_idx - 1)

    def fill_workspace(self, layer: AquaKVLayer) -> None:
        """Kernel backends: ``layer``'s coded tokens reconstructed (``pred + deHIGGS(codes)``, the torch
        path's ``reconstruct``) into buffer ``l % 2`` by one kernel call (residuals decoded in place,
        predictions added by in-place matmuls from layer ``l − 1``'s rows in the other buffer).

        The buffers are the step's transient, not held history: every forward overwrites them, and they
        grow by blocks of ``WORKSPACE_BLOCK`` tokens so a decode step allocates nothing.
        ``workspace_bytes()`` says how large they are."""
        idx = layer.layer_idx
        if idx == 0:
            self.workspace.clear()
        self.workspace.pop(idx - 2, None)  # the buffer it was in is about to be overwritten
        if layer.qk is None:
            self.workspace.pop(idx, None)
            return
        batch, n, channels = layer.qk.codes.shape[0], layer.n_codes, layer.quant.channels
        need = 2 * batch * n * channels
        slot = idx % 2
        buf = self._buffers[slot]
        if buf is None or buf.numel() < need:
            blocks = -(-n // WORKSPACE_BLOCK) * WORKSPACE_BLOCK
            buf = self._buffers[slot] = torch.empty(2 * batch * blocks * channels, device=layer.qk.codes.device)
        k = buf[: need // 2].view(batch, n, channels)
        v = buf[need // 2 : need].view(batch, n, channels)
        prev_k = prev_v = None
        if layer.needs_previous():
            span = (layer.code_lo, layer.code_lo + n, idx)
            prev_k, prev_v = rows_between(self.previous(idx, *span[:2]), *span)
        ops = get_backend(layer.backend).ops
        q = layer.quant
        ops.aquakv_reconstruct(
            layer.qk.codes,
            layer.qk.scales,
            layer.qv.codes,
            layer.qv.scales,
            grid=q.grid,
            signs=q.signs,
            outer=q.outer,
            code_bits=q.code_bits,
            group=q.group,
            pred_k=layer.pred_k,
            pred_v=layer.pred_v,
            prev_k=prev_k,
            prev_v=prev_v,
            out_k=k,
            out_v=v,
        )
        self.workspace[idx] = (layer.code_lo, k, v)

    def workspace_bytes(self) -> int:
        """Bytes of the kernel path's reconstruction buffers (a step's transient; 0 on the torch path)."""
        return nbytes(b for b in self._buffers if b is not None)

    def rebuild(self, upto: int) -> Rows | None:
        """Layers ``0 … upto`` rebuilt from their codes alone (what any reader of this cache can do)."""
        prev = None
        for layer in self.layers[: upto + 1]:
            rk, rv = layer.reconstruct(prev if layer.needs_previous() else None)
            prev = None if rk is None else (layer.code_lo, rk, rv)
        return prev

    def reconstruct(self, upto: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Pre-RoPE keys and values of the coded tokens layer ``upto`` holds, rebuilt from codes alone."""
        rows = self.rebuild(upto)
        return None if rows is None else (rows[1], rows[2])

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
