"""AQUA-KV's cache: what its layers (``layer.py``: fp16 sinks and window around HIGGS codes of the
residual a cross-layer predictor leaves) share and how they link.

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

from kvquant.cache import KVCache
from kvquant.errors import InvalidParameterError, KvquantError
from kvquant.formats.base import nbytes
from kvquant.methods.aquakv.layer import AquaKVLayer
from kvquant.methods.aquakv.predictors import Predictors
from kvquant.methods.aquakv.sliding import Rows, rows_between
from kvquant.quant.rope import rope_layer_types, rope_tables

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
            layer.reset()  # its state's kind follows the cache's predictors
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
        layer.state.rows = None
        if layer.state.qk is None:
            self.workspace.pop(idx, None)
            return
        batch, n, channels = layer.state.qk.codes.shape[0], layer.n_codes, layer.quant.channels
        need = 2 * batch * n * channels
        slot = idx % 2
        buf = self._buffers[slot]
        if buf is None or buf.numel() < need:
            blocks = -(-n // WORKSPACE_BLOCK) * WORKSPACE_BLOCK
            buf = self._buffers[slot] = torch.empty(2 * batch * blocks * channels, device=layer.state.qk.codes.device)
        k = buf[: need // 2].view(batch, n, channels)
        v = buf[need // 2 : need].view(batch, n, channels)
        prev_k = prev_v = None
        if layer.needs_previous():
            span = (layer.state.code_lo, layer.state.code_lo + n, idx)
            prev_k, prev_v = rows_between(self.previous(idx, *span[:2]), *span)
        q = layer.quant
        layer.backend.kernel("aquakv_reconstruct")(
            layer.state.qk.codes,
            layer.state.qk.scales,
            layer.state.qv.codes,
            layer.state.qv.scales,
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
        self.workspace[idx] = (layer.state.code_lo, k, v)
        layer.state.rows = (k, v)

    def workspace_bytes(self) -> int:
        """Bytes of the kernel path's reconstruction buffers (a step's transient; 0 on the torch path)."""
        return nbytes(b for b in self._buffers if b is not None)

    def rebuild(self, upto: int) -> Rows | None:
        """Layers ``0 … upto`` rebuilt from their codes alone (what any reader of this cache can do)."""
        prev = None
        for layer in self.layers[: upto + 1]:
            rk, rv = layer.reconstruct(prev if layer.needs_previous() else None)
            prev = None if rk is None else (layer.state.code_lo, rk, rv)
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
