"""The HIGGS and AQUA-KV methods: their parameters, where their predictors come from, and their caches.

AQUA-KV (Shutova et al., 2025, "Cache Me If You Must: Adaptive Key-Value Quantization for Large
Language Models"): per layer ``l ≥ 1`` two linear predictors (with bias, closed-form ridge, fp32)
are fitted once — keys of ``l`` from the reconstructed **pre-RoPE** keys of ``l − 1``; values of ``l``
from ``[reconstructed keys of l, reconstructed values of l − 1]`` (all KV heads concatenated per
token). The cache stores ``HIGGS(x − pred)`` and reconstructs ``pred + deHIGGS(codes)``, layer by
layer, at every forward. Layer 0 has no predictor and uses the ``first_layer_bits`` (4) preset.
HIGGS alone (Malinovskii et al., 2024) is the same cache without predictors.

Storage per layer: the first ``sink`` (4) tokens and the newest ``window`` (128) stay fp16; older
tokens are held as packed codes and fp16 scales, plus one int32 position per token (layer 0) to
redo RoPE — all counted in ``bits_stored``. The predictors are per model, not per token: their size
is reported separately (``cache.stats()["predictor_bytes"]``). A sliding-window layer (Mistral,
Gemma-2/3) keeps only what its window and the next layer's predictor need (``cache.py``).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from kvquant.backends import check_backend
from kvquant.cache import KVGeometry, KVLayer
from kvquant.errors import InvalidParameterError
from kvquant.formats.higgs import HiggsRule
from kvquant.methods.aquakv.cache import AquaKVCache, find_rotary
from kvquant.methods.aquakv.layer import AquaKVLayer
from kvquant.methods.aquakv.predictors import (
    PredictorFileError,
    Predictors,
    grid_hash,
    load_cached,
    model_identity,
    predictor_dir,
)
from kvquant.methods.base import KVMethod, register_method
from kvquant.quant.grids import PRESETS
from kvquant.quant.higgs import Higgs

SINK = 4
WINDOW = 128
GROUP = 1024
PREDICT = ("none", "k", "v", "kv")
#: the registry name that calibrates (and uses) each kind of predictors
METHOD_FOR_PREDICT = {"kv": "aquakv", "k": "aquakv_k_only", "v": "aquakv_v_only"}


@dataclass(frozen=True)
class HiggsMethod(KVMethod):
    """HIGGS alone: Hadamard rotation + Gaussian-optimal grid per token at ``bits`` (2, 3, 4) with one
    fp16 scale per ``group`` channels; the first ``sink`` and newest ``window`` tokens in fp16; layer 0
    at ``first_layer_bits`` if set, else ``bits``. ``backend``: ``auto`` (the device's kernels, attending
    over the codes as stored — AQUA-KV: see ``AquaKVMethod`` — where built and able to run the model;
    else the torch reference, every coded token reconstructed for the model's attention), ``torch`` or
    a backend by name. Keys are coded with RoPE taken off
    (the paper's choice: RoPE re-applied on every read, positions kept); ``higgs_post_rope`` codes them
    as the model hands them."""

    bits: int = 2
    first_layer_bits: int | None = None
    group: int = GROUP
    sink: int = SINK
    window: int = WINDOW
    backend: str = "auto"

    family: ClassVar[str] = "higgs"
    predict: ClassVar[str] = "none"
    predictors: ClassVar[str | None] = None
    #: keys coded after RoPE (``HiggsPostRopeMethod``) rather than with it taken off
    post_rope: ClassVar[bool] = False

    @property
    def label(self) -> str:
        return self.name or self.family

    def __post_init__(self) -> None:
        check_backend(self.backend)
        label = f"method {self.label}"
        presets = ", ".join(map(str, PRESETS))
        if self.bits not in PRESETS:
            raise InvalidParameterError(f"{label}: bits must be one of {presets}, got {self.bits!r}")
        if self.first_layer_bits is not None and self.first_layer_bits not in PRESETS:
            raise InvalidParameterError(
                f"{label}: first_layer_bits must be null or one of {presets}, got {self.first_layer_bits!r}"
            )
        if self.predict not in PREDICT:
            raise InvalidParameterError(f"{label}: predict must be one of {', '.join(PREDICT)}, got {self.predict!r}")
        for key, low in (("group", 2), ("sink", 0), ("window", 0)):
            value = getattr(self, key)
            if not isinstance(value, int) or value < low:
                raise InvalidParameterError(f"{label}: {key} must be an integer >= {low}, got {value!r}")

    def layer_bits(self, layer_idx: int) -> int:
        return self.first_layer_bits if layer_idx == 0 and self.first_layer_bits is not None else self.bits

    def quantizers(self, geometry: KVGeometry | Any) -> dict[int, Higgs]:
        """One HIGGS quantizer per bit width in use, for all KV heads of a token (a geometry or a config)."""
        if not isinstance(geometry, KVGeometry):
            geometry = KVGeometry.of(geometry)
        channels = geometry.n_kv_heads * geometry.head_dim
        return {b: Higgs(channels, b, self.group) for b in {self.layer_bits(i) for i in range(geometry.n_layers)}}

    def quantizer_identity(self, quants: dict[int, Higgs]) -> dict[str, Any]:
        q = quants[self.bits]
        return {**q.describe(), "first_layer_bits": self.layer_bits(0), "grid": grid_hash(q), "predict": self.predict}

    def adaptations(self, geometry: KVGeometry) -> dict[str, Any]:
        """What was fitted to the model, ``{parameter: [asked, used]}``: the group capped at the channels
        of a token, and a group zero-padded to a size that has a Hadamard transform."""
        q = self.quantizers(geometry)[self.bits]
        out: dict[str, Any] = {}
        if q.group != self.group:
            out["group"] = [self.group, q.group]
        if q.padded:
            out["padded_group"] = [q.group, q.padded_group]
        return out

    def analytic_bits(self, geometry: KVGeometry | None = None) -> float | None:
        """Bits per quantized value (codes + scales, averaged over layers) on ``geometry``; None without one."""
        if geometry is None:
            return None
        quants = self.quantizers(geometry)
        return sum(quants[self.layer_bits(i)].bits_per_value() for i in range(geometry.n_layers)) / geometry.n_layers

    def load_predictors(self, model: Any) -> Predictors | None:
        return None

    @property
    def format(self) -> str:
        """The storage format: ``higgs``, or ``aquakv`` (codes of a predictor's residual, which only the
        cache can reconstruct)."""
        return "higgs" if self.predict == "none" else "aquakv"

    def rule(self, geometry: KVGeometry | None = None) -> Higgs | None:
        """How codes are read: the quantizer of the last layer (``bits``) on ``geometry`` — its grid, rotation
        and group, which every layer's quantizer shares but for its bit width."""
        return None if geometry is None else self.quantizers(geometry)[self.layer_bits(geometry.n_layers - 1)]

    def new_layer(self, layer_idx: int, geometry: KVGeometry) -> KVLayer:
        raise NotImplementedError(f"{self.label} layers share state through their cache: use new_cache(model)")

    def new_cache(self, model: Any) -> AquaKVCache:
        geometry = KVGeometry.of(model.config)
        quants = self.quantizers(geometry)
        note = quants[self.bits].padding_note()
        if note:
            warnings.warn(note, stacklevel=2)
        backend = self.resolve(model, geometry, HiggsRule(quants[self.bits], self.post_rope))
        pred = self.load_predictors(model)
        layers = []
        for i in range(geometry.n_layers):
            pk = pred.k.get(i) if pred is not None else None
            pv = pred.v.get(i) if pred is not None else None
            quant, window = quants[self.layer_bits(i)], geometry.window(i)
            layers.append(AquaKVLayer(i, quant, pk, pv, self.sink, self.window, window, backend))
        cache = AquaKVCache(layers, find_rotary(model), pred, geometry.layer_types, self.post_rope)
        cache.adaptations, cache.backend = self.adaptations(geometry), backend.name
        if pred is not None and pred.source is not None:
            cache.parameter_files = {"predictors": {**pred.source, "calibration": pred.header.get("data")}}
        return cache


@dataclass(frozen=True)
class HiggsPostRopeMethod(HiggsMethod):
    """HIGGS with keys coded as the model hands them, after RoPE (not in either paper). Nothing is
    re-applied on a read and no positions are kept; the question is whether the rotated keys quantize
    as well (RoPE turns each channel pair at a different rate, so a token's key is a differently
    rotated vector at every position). No predictors: AQUA-KV's are fitted on pre-RoPE keys."""

    family: ClassVar[str] = "higgs_post_rope"
    post_rope: ClassVar[bool] = True


@dataclass(frozen=True)
class AquaKVMethod(HiggsMethod):
    """AQUA-KV: HIGGS codes of what cross-layer linear predictors miss (``predict``: kv, k or v);
    ``predictors``: a predictor file, or None for the default path for this model and quantizer.

    On the C++ kernels (``auto`` where they are built): the predictors must still run over the
    whole history every step (no reconstruction is kept: that would be fp16-sized memory), so a step
    is bounded below by those matmuls. Per layer and forward one kernel call
    (``kernels_cpu.aquakv_reconstruct``) decodes the residual codes, plus the predictor's bias, straight
    into a reused fp32 workspace and adds the predictions in place (``addmm_`` from the previous
    layer's workspace, which is this layer's predictor input); ``kernels_cpu.attend_aquakv`` then
    attends over the workspace (RoPE applied to keys as they are loaded), the fp16 sinks and window.
    The two workspaces (layers alternate) are overwritten every forward: a step's transient
    (``AquaKVCache.workspace_bytes()``), not held history, so ``stats()`` are the torch path's. Values
    equal the torch path's up to fp32 summation order (a code may differ where a residual sits on a
    rounding boundary)."""

    first_layer_bits: int | None = 4
    predict: str = "kv"
    predictors: str | None = None

    family = "aquakv"

    def default_path(self, model_id: dict[str, str], quants: dict[int, Higgs]) -> Path:
        """Where this method's predictors for a model (``model_identity``) and quantizers live by default."""
        q = self.quantizer_identity(quants)
        safe = "".join(c if c.isalnum() or c in "-._" else "_" for c in model_id["id"])
        name = f"aquakv-{q['predict']}-b{q['bits']}-l0b{q['first_layer_bits']}-g{q['group']}.safetensors"
        return predictor_dir() / f"{safe}-{model_id['config_hash']}" / name

    def load_predictors(self, model: Any) -> Predictors | None:
        """The predictors for ``model``: from ``predictors`` (a path) or the default location; checked
        against the model and quantizer, and read once per file version (``load_cached``)."""
        if self.predict == "none":
            return None
        config = model.config.get_text_config(decoder=True)
        quants = self.quantizers(KVGeometry.of(model.config))
        mid, qid = model_identity(config), self.quantizer_identity(quants)
        path = Path(self.predictors).expanduser() if self.predictors else self.default_path(mid, quants)
        target = {
            "path": path,
            "model_id": mid["id"],
            "config_hash": mid["config_hash"],
            "model_path": str(getattr(config, "_name_or_path", "") or "") or None,
            "method": METHOD_FOR_PREDICT.get(self.predict, self.label),
            "bits": self.bits,
            "predict": self.predict,
            "first_layer_bits": self.first_layer_bits,
            "group": self.group,
        }
        if not path.is_file():
            raise PredictorFileError(
                f"no AQUA-KV predictors at {path} for model {mid['id']} "
                f"({qid['bits']}-bit HIGGS, predict={self.predict}); calibrate first",
                **target,
            )
        try:
            pred = load_cached(path)
        except PredictorFileError as exc:
            raise exc.with_target(**target) from None
        file_model, file_q = pred.header.get("model"), pred.header.get("quantizer")
        if file_model != mid or file_q != qid:
            raise PredictorFileError(
                f"predictor file {path} was made for model {json.dumps(file_model, sort_keys=True)} with quantizer "
                f"{json.dumps(file_q, sort_keys=True)}; this run has model {json.dumps(mid, sort_keys=True)} "
                f"with quantizer {json.dumps(qid, sort_keys=True)}; recalibrate",
                **target,
            )
        return pred

    def calibrate(self, model: Any, tokenizer: Any, **options: Any) -> Predictors:
        """Fit this method's predictors on held-out TinyStories text; ``options`` (``n_seqs``,
        ``seq_len``, ``seed``, ``lam``, ``progress``, ``log``) are ``calibration.calibrate``'s."""
        from kvquant.methods.aquakv.calibration import calibrate

        return calibrate(self, model, tokenizer, **options)


register_method("higgs", HiggsMethod)
register_method("higgs_post_rope", HiggsPostRopeMethod)
for _predict, _name in METHOD_FOR_PREDICT.items():
    register_method(_name, AquaKVMethod, predict=_predict)
