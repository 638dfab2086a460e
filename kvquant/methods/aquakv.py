"""AQUA-KV: predict each layer's K/V from the previous layer's reconstruction, store HIGGS codes of the rest.

Per layer ``l ≥ 1`` two linear predictors (with bias, closed-form ridge, fp32) are fitted once:
keys of ``l`` from the reconstructed **pre-RoPE** keys of ``l − 1``; values of ``l`` from
``[reconstructed keys of l, reconstructed values of l − 1]`` (all KV heads concatenated per token).
The cache stores ``HIGGS(x − pred)`` and reconstructs ``pred + deHIGGS(codes)``, layer by layer, at
every forward — prefill chunks and decode steps alike. Layer 0 has no predictor and uses the
``first_layer_bits`` (4) preset.

Storage per layer: the first ``sink`` (4) tokens and the newest ``window`` (128) stay fp16 exactly
as the model produced them (after RoPE); older tokens are quantized when they leave the window
and only their packed codes and fp16 scales are held, plus one int32 position per token (layer 0)
to redo RoPE. Every one of these tensors is named in ``stored_k``/``stored_v``, so ``bits_stored``
includes scales, sinks, window and positions. The predictors are per model, not per token: their
size is reported separately (``cache.stats()["predictor_bytes"]``).

RoPE. Predictors work on pre-RoPE keys, but a Llama attention hands the cache rotated ones. The
cache undoes the rotation with cos/sin it computes from the model's own rotary-embedding module at
the token positions — ``position_ids`` when transformers passes them (5.24: ``kwargs=``), the
``cache_position`` of 5.17's positional ``cache_kwargs``, else its own running count — and checks
once against the ``cos``/``sin`` that 5.17 hands over. No modeling file is forked.

Reads: each forward reads every quantized token's codes and scales and the fp16 sinks/window;
``count_read`` records exactly those bits (the quantized part split between the two whole-bit
widths around its mean, since widths are integers). Predictor weights and positions are not counted
as reads.

Predictor files: safetensors (no pickle) whose header (``__metadata__["kvquant"]``, JSON) records
the model (id + config hash), the quantizer (bits, grid, group, first-layer bits, which predictors),
the calibration data, seed, λ and each layer's fit error. A file made for another model or
quantizer is refused with both identities named; a missing file gets the calibrate command.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvquant.cache import KVCache, KVLayer, nbytes, to_fp16_checked, whole_bit_widths
from kvquant.errors import InvalidParameterError, KvquantError
from kvquant.methods.base import KVMethod, register_method
from kvquant.quant.grids import PRESETS
from kvquant.quant.higgs import Higgs, HiggsTensor, cat_rows
from kvquant.quant.ridge import DEFAULT_LAMBDA, RidgeStats

SINK = 4
WINDOW = 128
GROUP = 1024
PREDICT = ("none", "k", "v", "kv")
FORMAT = "kvquant-aquakv-predictors/1"
CALIB_POOL = 2000  # calibration draws from the last CALIB_POOL TinyStories validation stories
CONFIG_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rope_parameters",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
)


class PredictorFileError(KvquantError):
    """A predictor file that is missing or was made for another model or quantizer."""


# ----------------------------------------------------------------------------- model geometry, RoPE


def kv_geometry(config: Any) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a (text) model config."""
    n_heads = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    return config.num_hidden_layers, int(n_kv), int(head_dim)


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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_tables(rotary: torch.nn.Module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, sin)`` of shape ``[B, n, D]`` for integer ``positions`` ``[B, n]``."""
    probe = torch.zeros(1, dtype=torch.float32, device=positions.device)
    cos, sin = rotary(probe, positions.long())
    return cos.float(), sin.float()


def apply_rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``k`` (``[B, H, n, D]``) the way Llama does."""
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return k * c + rotate_half(k) * s


def undo_rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of ``apply_rope`` (exact for any attention scaling: divides by ``cos² + sin²``)."""
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return (k * c - rotate_half(k) * s) / (c * c + s * s)


def to_rows(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, n, D]`` → ``[B, n, H·D]`` (all heads of a token side by side)."""
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b, n, h * d)


def from_rows(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    b, n, c = x.shape
    return x.view(b, n, n_heads, c // n_heads).transpose(1, 2)


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


# ----------------------------------------------------------------------------- identities and files


def model_identity(config: Any) -> dict[str, str]:
    """``{"id", "config_hash"}``: the model's name or folder name, and a hash of its architecture fields."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    name = str(getattr(config, "_name_or_path", "") or "unknown")
    model_id = Path(name).name if Path(name).expanduser().is_dir() else name
    data = config.to_dict()
    arch = {k: data[k] for k in CONFIG_KEYS if k in data}
    digest = hashlib.sha256(json.dumps(arch, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return {"id": model_id, "config_hash": digest}


def grid_hash(q: Higgs) -> str:
    return hashlib.sha256(q.grid.contiguous().numpy().tobytes()).hexdigest()[:12]


def predictor_dir() -> Path:
    """Where predictor files live: ``$KVQUANT_PREDICTOR_DIR``, else ``predictors/`` beside the model cache."""
    env = os.environ.get("KVQUANT_PREDICTOR_DIR")
    if env:
        return Path(env).expanduser()
    from kvquant.models import model_cache_dir

    return model_cache_dir().parent / "predictors"


def config_name(model_id: str) -> str | None:
    """The ``conf/model`` name of a model id, if it is one of ours."""
    from kvquant.models import MODELS

    for name, spec in MODELS.items():
        if model_id in (name, spec.hub_id) or model_id.startswith(f"{name}-"):
            return name
    return None


@dataclass
class Predictors:
    """Fitted predictors: ``k[l]``/``v[l]`` = ``(W [in, out], b [out])`` fp32, plus the file header."""

    header: dict[str, Any]
    k: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    v: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for kind, table in (("k", self.k), ("v", self.v)):
            for layer, (w, b) in table.items():
                out[f"{kind}.{layer}.weight"] = w.contiguous()
                out[f"{kind}.{layer}.bias"] = b.contiguous()
        return out

    def nbytes(self) -> int:
        return nbytes(self.tensors().values())

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically (temporary file + rename)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            save_file(self.tensors(), str(tmp), metadata={"kvquant": json.dumps(self.header, sort_keys=True)})
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Predictors:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as fh:
            meta = fh.metadata() or {}
            if "kvquant" not in meta:
                raise PredictorFileError(f"{path} is not a kvquant predictor file (no 'kvquant' header)")
            header = json.loads(meta["kvquant"])
            if header.get("format") != FORMAT:
                raise PredictorFileError(f"{path}: format {header.get('format')!r}, expected {FORMAT!r}")
            pred = cls(header)
            for name in fh.keys():
                kind, layer, part = name.split(".")
                table = pred.k if kind == "k" else pred.v
                w, b = table.get(int(layer), (None, None))
                t = fh.get_tensor(name).float()
                table[int(layer)] = (t, b) if part == "weight" else (w, t)
        return pred


def apply_predictor(pred: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    w, b = pred
    return torch.addmm(b.to(x.device), x.reshape(-1, x.shape[-1]), w.to(x.device)).view(*x.shape[:-1], -1)


# ----------------------------------------------------------------------------- cache


class AquaKVLayer(KVLayer):
    """One layer: fp16 sinks and window (post-RoPE, as given) around HIGGS codes of the predictor residual."""

    is_croppable = False

    def __init__(
        self,
        layer_idx: int,
        quant: Higgs,
        pred_k: tuple[torch.Tensor, torch.Tensor] | None,
        pred_v: tuple[torch.Tensor, torch.Tensor] | None,
        sink: int,
        window: int,
    ):
        super().__init__(layer_idx)
        self.quant, self.pred_k, self.pred_v = quant, pred_k, pred_v
        self.sink, self.window = sink, window
        self.owner: AquaKVCache | None = None
        self._clear()

    def _clear(self) -> None:
        self.sink_k = self.sink_v = self.win_k = self.win_v = None
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
        self.dtype = key_states.dtype
        b, self.n_heads, _, self.head_dim = key_states.shape
        empty = key_states.new_empty((b, self.n_heads, 0, self.head_dim), dtype=torch.float16)
        self.sink_k = self.sink_v = self.win_k = self.win_v = empty
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.length

    def logical_elements(self) -> tuple[int, int]:
        if not self.is_initialized:
            return 0, 0
        n = self.sink_k.shape[0] * self.n_heads * self.length * self.head_dim
        return n, n

    def stored_k(self) -> list[torch.Tensor | None]:
        extra = [self.owner.positions] if self.owner is not None and self.layer_idx == 0 else []
        return [self.sink_k, self.win_k, *(self.qk.tensors() if self.qk else []), *extra]

    def stored_v(self) -> list[torch.Tensor | None]:
        return [self.sink_v, self.win_v, *(self.qv.tensors() if self.qv else [])]

    def parts_bytes(self) -> dict[str, int]:
        """Bytes held per kind: packed codes, fp16 scales, fp16 sinks, fp16 window."""
        q = [t for t in (self.qk, self.qv) if t is not None]
        return {
            "codes": nbytes(t.codes for t in q),
            "scales": nbytes(t.scales for t in q),
            "sinks": nbytes([self.sink_k, self.sink_v]),
            "window": nbytes([self.win_k, self.win_v]),
        }

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        self.owner.track_positions(self.layer_idx, self.length, n, rope_inputs(args, kwargs), key_states.device)
        k16 = to_fp16_checked(key_states, self.layer_idx, "key")
        v16 = to_fp16_checked(value_states, self.layer_idx, "value")
        take = min(n, self.sink - self.sink_k.shape[-2])
        if take > 0:
            self.sink_k = torch.cat([self.sink_k, k16[:, :, :take]], dim=-2)
            self.sink_v = torch.cat([self.sink_v, v16[:, :, :take]], dim=-2)
        self.win_k = torch.cat([self.win_k, k16[:, :, max(take, 0) :]], dim=-2)
        self.win_v = torch.cat([self.win_v, v16[:, :, max(take, 0) :]], dim=-2)
        self.length += n

        leaving = max(0, self.win_k.shape[-2] - self.window)
        prev = self.owner.previous(self.layer_idx, self.n_quant + leaving) if self.needs_previous() else None
        if leaving:
            self._evict(leaving, prev)
        rk, rv = self.reconstruct(prev)
        self.owner.hand_off(self.layer_idx, rk, rv)

        dtype = key_states.dtype
        parts_k, parts_v = [self.sink_k.to(dtype)], [self.sink_v.to(dtype)]
        if rk is not None:
            cos, sin = self.owner.quantized_rope(self.sink, self.n_quant)
            parts_k.append(apply_rope(from_rows(rk, self.n_heads), cos, sin).to(dtype))
            parts_v.append(from_rows(rv, self.n_heads).to(dtype))
        parts_k.append(self.win_k.to(dtype))
        parts_v.append(self.win_v.to(dtype))
        self._count_reads()
        return torch.cat(parts_k, dim=-2), torch.cat(parts_v, dim=-2)

    def needs_previous(self) -> bool:
        return self.pred_k is not None or self.pred_v is not None

    def _evict(self, m: int, prev: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Quantize the ``m`` oldest window tokens (after the sinks) and append their codes."""
        ek, ev = self.win_k[:, :, :m], self.win_v[:, :, :m]
        self.win_k, self.win_v = self.win_k[:, :, m:].clone(), self.win_v[:, :, m:].clone()
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
        b = self.sink_k.shape[0]
        per_token = b * self.n_heads * self.head_dim
        n_fp16 = per_token * (self.sink_k.shape[-2] + self.win_k.shape[-2])
        n_q = per_token * self.n_quant
        bits_k = 8 * nbytes(self.qk.tensors()) if self.qk else 0
        bits_v = 8 * nbytes(self.qv.tensors()) if self.qv else 0
        self.count_read(whole_bit_widths(n_q, bits_k, n_fp16), whole_bit_widths(n_q, bits_v, n_fp16))


Pred = tuple[torch.Tensor, torch.Tensor] | None


def encode_pair(
    quant: Higgs,
    pred_k: Pred,
    pred_v: Pred,
    k: torch.Tensor,
    v: torch.Tensor,
    prev_k: torch.Tensor | None,
    prev_v: torch.Tensor | None,
) -> tuple[HiggsTensor, torch.Tensor, HiggsTensor, torch.Tensor]:
    """Codes and reconstructions of ``k``/``v`` rows: ``Q(x − pred)`` and ``pred + deQ(Q(x − pred))``.

    One rule for the cache and for calibration; the value predictor reads the reconstructed keys.
    """
    pk = apply_predictor(pred_k, prev_k) if pred_k is not None else None
    qk = quant.quantize(k - pk if pk is not None else k)
    rk = quant.dequantize(qk) + (pk if pk is not None else 0)
    pv = apply_predictor(pred_v, torch.cat([rk, prev_v], dim=-1)) if pred_v is not None else None
    qv = quant.quantize(v - pv if pv is not None else v)
    rv = quant.dequantize(qv) + (pv if pv is not None else 0)
    return qk, rk, qv, rv


def dequantize_pair(
    quant: Higgs,
    pred_k: Pred,
    pred_v: Pred,
    qk: HiggsTensor,
    qv: HiggsTensor,
    prev_k: torch.Tensor | None,
    prev_v: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``pred + deQ(codes)`` for keys, then values (whose predictor reads the reconstructed keys)."""
    rk = quant.dequantize(qk)
    if pred_k is not None:
        rk = rk + apply_predictor(pred_k, prev_k)
    rv = quant.dequantize(qv)
    if pred_v is not None:
        rv = rv + apply_predictor(pred_v, torch.cat([rk, prev_v], dim=-1))
    return rk, rv


class AquaKVCache(KVCache):
    """The layers plus what they share: token positions, the model's RoPE, the previous layer's reconstruction."""

    def __init__(self, layers: list[AquaKVLayer], rotary: torch.nn.Module, predictors: Predictors | None):
        super().__init__(layers)
        self.rotary, self.predictors = rotary, predictors
        for layer in layers:
            layer.owner = self
        self.positions: torch.Tensor | None = None
        self.clear()

    def clear(self) -> None:
        self.positions = None
        self._handoff: dict[int, tuple[int, torch.Tensor | None, torch.Tensor | None]] = {}
        self._rope: tuple[int, int, torch.Tensor, torch.Tensor] | None = None
        self._rope_checked = False

    def track_positions(self, layer_idx: int, seen: int, n: int, given: dict[str, Any], device) -> None:
        """Record the new tokens' positions (first layer only): ``position_ids``, ``cache_position`` or a count."""
        if layer_idx != 0:
            return
        batch = self.layers[0].sink_k.shape[0]
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


# ----------------------------------------------------------------------------- methods


class AquaKVMethod(KVMethod):
    """AQUA-KV: cross-layer linear predictors + HIGGS codes of the residual (``predict``: kv, k or v)."""

    def __init__(
        self,
        bits: int = 2,
        predict: str = "kv",
        first_layer_bits: int | None = 4,
        group: int = GROUP,
        sink: int = SINK,
        window: int = WINDOW,
        predictors: str | None = None,
    ):
        name = type(self).__name__
        if bits not in PRESETS:
            raise InvalidParameterError(f"{name}: bits must be one of {', '.join(map(str, PRESETS))}, got {bits!r}")
        if first_layer_bits is not None and first_layer_bits not in PRESETS:
            raise InvalidParameterError(
                f"{name}: first_layer_bits must be null or one of {', '.join(map(str, PRESETS))}, "
                f"got {first_layer_bits!r}"
            )
        if predict not in PREDICT:
            raise InvalidParameterError(f"{name}: predict must be one of {', '.join(PREDICT)}, got {predict!r}")
        for key, val in (("group", group), ("sink", sink), ("window", window)):
            if not isinstance(val, int) or val < (2 if key == "group" else 0):
                raise InvalidParameterError(f"{name}: {key} must be an integer >= {2 if key == 'group' else 0}")
        self.bits, self.predict, self.first_layer_bits = bits, predict, first_layer_bits
        self.group, self.sink, self.window, self.predictors = group, sink, window, predictors
        self._loaded: tuple[str, Predictors] | None = None
        self._analytic: float | None = None
        self._noted: set[str] = set()

    def layer_bits(self, layer_idx: int) -> int:
        return self.first_layer_bits if layer_idx == 0 and self.first_layer_bits is not None else self.bits

    def quantizers(self, config: Any) -> dict[int, Higgs]:
        n_layers, n_kv, head_dim = kv_geometry(config.get_text_config(decoder=True))
        return {b: Higgs(n_kv * head_dim, b, self.group) for b in {self.layer_bits(i) for i in range(n_layers)}}

    def quantizer_identity(self, quants: dict[int, Higgs]) -> dict[str, Any]:
        q = quants[self.bits]
        return {
            **q.describe(),
            "first_layer_bits": self.layer_bits(0),
            "grid": grid_hash(q),
            "predict": self.predict,
        }

    def default_path(self, model_id: dict[str, str], quants: dict[int, Higgs]) -> Path:
        q = self.quantizer_identity(quants)
        safe = "".join(c if c.isalnum() or c in "-._" else "_" for c in model_id["id"])
        name = f"aquakv-{q['predict']}-b{q['bits']}-l0b{q['first_layer_bits']}-g{q['group']}.safetensors"
        return predictor_dir() / f"{safe}-{model_id['config_hash']}" / name

    def calibrate_command(self, model_id: dict[str, str], config: Any) -> str:
        name = config_name(model_id["id"])
        model_arg = f"model={name}" if name else f"model.path={getattr(config, '_name_or_path', '?')}"
        method = {"kv": "aquakv", "k": "aquakv_k_only", "v": "aquakv_v_only"}[self.predict]
        extra = "" if self.first_layer_bits == 4 else f" method.first_layer_bits={self.first_layer_bits}"
        extra += "" if self.group == GROUP else f" method.group={self.group}"
        return f"python run.py experiment=calibrate method={method} {model_arg} method.bits={self.bits}{extra}"

    def load_predictors(self, model: Any) -> Predictors | None:
        """The predictors for ``model``: from ``predictors`` (a path) or the default location; checked."""
        if self.predict == "none":
            return None
        config = model.config.get_text_config(decoder=True)
        quants = self.quantizers(model.config)
        mid, qid = model_identity(config), self.quantizer_identity(quants)
        path = Path(self.predictors).expanduser() if self.predictors else self.default_path(mid, quants)
        if self._loaded is not None and self._loaded[0] == str(path):
            return self._loaded[1]
        if not path.is_file():
            raise PredictorFileError(
                f"no AQUA-KV predictors at {path} for model {mid['id']} "
                f"({qid['bits']}-bit HIGGS, predict={self.predict}); "
                f"calibrate first: {self.calibrate_command(mid, config)}"
            )
        pred = Predictors.load(path)
        file_model, file_q = pred.header.get("model"), pred.header.get("quantizer")
        if file_model != mid or file_q != qid:
            raise PredictorFileError(
                f"predictor file {path} was made for model {json.dumps(file_model, sort_keys=True)} with quantizer "
                f"{json.dumps(file_q, sort_keys=True)}; this run has model {json.dumps(mid, sort_keys=True)} "
                f"with quantizer {json.dumps(qid, sort_keys=True)}; "
                f"recalibrate: {self.calibrate_command(mid, config)}"
            )
        self._loaded = (str(path), pred)
        return pred

    def new_cache(self, model: Any) -> AquaKVCache:
        config = model.config.get_text_config(decoder=True)
        quants = self.quantizers(model.config)
        note = quants[self.bits].padding_note()
        if note and note not in self._noted:
            warnings.warn(note, stacklevel=2)
            self._noted.add(note)
        pred = self.load_predictors(model)
        layers = []
        for i in range(config.num_hidden_layers):
            pk = pred.k.get(i) if pred is not None else None
            pv = pred.v.get(i) if pred is not None else None
            layers.append(AquaKVLayer(i, quants[self.layer_bits(i)], pk, pv, self.sink, self.window))
        self._analytic = sum(quants[self.layer_bits(i)].bits_per_value() for i in range(len(layers))) / len(layers)
        return AquaKVCache(layers, find_rotary(model), pred)

    def new_layer(self, layer_idx: int, model_config: Any) -> KVLayer:
        raise NotImplementedError("aquakv layers share state through their cache: use new_cache(model)")

    def analytic_bits(self) -> float | None:
        """Bits per quantized value (codes + scales, averaged over layers), known once a cache was made."""
        return self._analytic

    # ------------------------------------------------------------------------- calibration

    def calibrate(
        self,
        model: Any,
        tokenizer: Any,
        n_seqs: int = 16,
        seq_len: int = 1024,
        seed: int = 0,
        lam: float = DEFAULT_LAMBDA,
        progress: bool = True,
        log: Callable[[str], None] | None = print,
    ) -> Predictors:
        """Fit this method's predictors on held-out TinyStories text (see ``calibrate``)."""
        if self.predict == "none":
            raise InvalidParameterError(f"{self.name or 'higgs'}: no predictors to calibrate (predict=none)")
        quants = self.quantizers(model.config)
        config = model.config.get_text_config(decoder=True)
        ids, data = calibration_ids(tokenizer, n_seqs, min(seq_len, config.max_position_embeddings), seed)
        pred = fit_predictors(
            model,
            ids,
            quants={i: quants[self.layer_bits(i)] for i in range(config.num_hidden_layers)},
            predict=self.predict,
            lam=lam,
            sink=self.sink,
            progress=progress,
            log=log,
        )
        pred.header.update(
            {
                "format": FORMAT,
                "model": model_identity(config),
                "quantizer": self.quantizer_identity(quants),
                "data": data,
                "seed": seed,
                "lambda": lam,
            }
        )
        return pred


class HiggsMethod(AquaKVMethod):
    """HIGGS alone: the same cache without predictors (layer 0 at ``first_layer_bits`` if set, else ``bits``)."""

    def __init__(
        self,
        bits: int = 2,
        first_layer_bits: int | None = None,
        group: int = GROUP,
        sink: int = SINK,
        window: int = WINDOW,
    ):
        super().__init__(bits, "none", first_layer_bits, group, sink, window, None)


# ----------------------------------------------------------------------------- calibration


def calibration_ids(tokenizer: Any, n_seqs: int, seq_len: int, seed: int) -> tuple[list[torch.Tensor], dict]:
    """``n_seqs`` sequences of ``seq_len`` tokens of TinyStories validation stories never used for evaluation.

    Stories come from the last ``CALIB_POOL`` pieces (evaluation reads the first ones), in a seeded
    order, joined by blank lines; each sequence starts with BOS when the tokenizer has one.
    """
    from kvquant.data import tinystories_pieces

    if n_seqs < 1 or seq_len < 2 * SINK:
        raise InvalidParameterError(f"calibration: need n_seqs >= 1 and seq_len >= {2 * SINK}")
    pieces = tinystories_pieces()
    first = len(pieces) - CALIB_POOL
    pool = pieces[first:]
    order = torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed)).tolist()
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    sep = tokenizer("\n\n", add_special_tokens=False).input_ids
    seqs, cur, used = [], list(bos), 0
    for idx in order:
        cur += tokenizer(pool[idx], add_special_tokens=False).input_ids + sep
        used += 1
        while len(cur) >= seq_len and len(seqs) < n_seqs:
            seqs.append(torch.tensor(cur[:seq_len]))
            cur = list(bos) + cur[seq_len:]
        if len(seqs) == n_seqs:
            break
    if len(seqs) < n_seqs:
        raise InvalidParameterError(
            f"calibration: {CALIB_POOL} held-out stories give only {len(seqs)} sequences of {seq_len} tokens"
        )
    data = {
        "source": "tinystories_val",
        "pieces": f"{first}..{len(pieces) - 1} (seeded order)",
        "stories_used": used,
        "n_seqs": n_seqs,
        "seq_len": seq_len,
        "tokens": n_seqs * seq_len,
    }
    return seqs, data


@torch.no_grad()
def collect_kv(
    model: Any, ids: list[torch.Tensor], sink: int, progress: bool = False
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, pre-RoPE keys and values ``[N, C]`` (fp16, as the cache's window holds them), sinks dropped."""
    from tqdm.auto import tqdm

    from kvquant.analysis.capture import capture_kv

    rotary = find_rotary(model)
    keys: list[list[torch.Tensor]] = []
    values: list[list[torch.Tensor]] = []
    for seq in tqdm(ids, desc="aquakv calibration (collect K/V)", disable=not progress):
        kv = capture_kv(model, seq)
        pos = torch.arange(seq.numel(), device=kv[0][0].device).unsqueeze(0)
        cos, sin = rope_tables(rotary, pos)
        for layer, (k, v) in enumerate(kv):
            k16 = to_fp16_checked(k, layer, "key").float()
            v16 = to_fp16_checked(v, layer, "value")
            if layer >= len(keys):
                keys.append([])
                values.append([])
            keys[layer].append(to_rows(undo_rope(k16, cos, sin))[0, sink:].half().cpu())
            values[layer].append(to_rows(v16)[0, sink:].cpu())
    return [torch.cat(k) for k in keys], [torch.cat(v) for v in values]


def relative_mse(x: torch.Tensor, xhat: torch.Tensor) -> float:
    return float((x - xhat).pow(2).sum() / x.pow(2).sum().clamp_min(1e-30))


def equivalent_bits(rel_mse: float) -> float:
    """Bits per value a Gaussian source needs for this relative MSE (``−½·log2``): comparable across methods."""
    return -0.5 * math.log2(max(rel_mse, 1e-30))


def fit_predictors(
    model: Any,
    ids: list[torch.Tensor],
    quants: dict[int, Higgs],
    predict: str = "kv",
    lam: float = DEFAULT_LAMBDA,
    sink: int = SINK,
    progress: bool = True,
    log: Callable[[str], None] | None = print,
) -> Predictors:
    """Fit predictors layer by layer, each on the quantize→dequantize reconstruction of the layers before it."""
    from tqdm.auto import tqdm

    started = time.perf_counter()
    keys, values = collect_kv(model, ids, sink, progress)
    collected = time.perf_counter() - started
    pred = Predictors({})
    fit: list[dict[str, float]] = []
    prev_k = prev_v = None
    bar = tqdm(range(len(keys)), desc="aquakv calibration (layers)", disable=not progress)
    for layer in bar:
        k, v = keys[layer].float(), values[layer].float()
        quant = quants[layer]
        pk = ridge_fit(prev_k, k, lam) if layer > 0 and predict in ("k", "kv") else None
        out_k = apply_predictor(pk, prev_k) if pk is not None else torch.zeros_like(k)
        rk = quant.roundtrip(k - out_k) + out_k
        pv = ridge_fit(torch.cat([rk, prev_v], dim=-1), v, lam) if layer > 0 and predict in ("v", "kv") else None
        out_v = apply_predictor(pv, torch.cat([rk, prev_v], dim=-1)) if pv is not None else torch.zeros_like(v)
        rv = quant.roundtrip(v - out_v) + out_v
        if pk is not None:
            pred.k[layer] = pk
        if pv is not None:
            pred.v[layer] = pv
        row = {"layer": layer, "k_rel_mse": relative_mse(k, rk), "v_rel_mse": relative_mse(v, rv)}
        row["k_rel_mse_higgs"] = relative_mse(k, quant.roundtrip(k))
        row["v_rel_mse_higgs"] = relative_mse(v, quant.roundtrip(v))
        for kind in ("k", "v"):
            row[f"{kind}_equivalent_bits"] = equivalent_bits(row[f"{kind}_rel_mse"])
            row[f"{kind}_equivalent_bits_higgs"] = equivalent_bits(row[f"{kind}_rel_mse_higgs"])
        fit.append(row)
        if log is not None:
            (bar.write if log is print else log)(
                f"layer {layer:>2}: K rel MSE {row['k_rel_mse']:.4f} (≈{row['k_equivalent_bits']:.2f} bits; "
                f"HIGGS alone {row['k_rel_mse_higgs']:.4f} ≈{row['k_equivalent_bits_higgs']:.2f}) · "
                f"V rel MSE {row['v_rel_mse']:.4f} (≈{row['v_equivalent_bits']:.2f} bits; "
                f"HIGGS alone {row['v_rel_mse_higgs']:.4f} ≈{row['v_equivalent_bits_higgs']:.2f})"
            )
        prev_k, prev_v = rk, rv
    pred.header = {"fit": fit, "seconds": {"collect": collected, "total": time.perf_counter() - started}}
    return pred


def ridge_fit(x: torch.Tensor, y: torch.Tensor, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    stats = RidgeStats(x.shape[-1], y.shape[-1])
    stats.add(x, y)
    return stats.fit(lam)


register_method("higgs", HiggsMethod)
register_method("aquakv", AquaKVMethod, predict="kv")
register_method("aquakv_k_only", AquaKVMethod, predict="k")
register_method("aquakv_v_only", AquaKVMethod, predict="v")
