"""AQUA-KV's predictors: the file format, where files live, and the rule that applies them.

Predictor files are safetensors (no pickle) whose header (``__metadata__["kvquant"]``, JSON) records
the model (id + config hash), the quantizer (bits, grid, group, first-layer bits, which predictors),
the calibration data, seed, λ and each layer's fit error; a ``<file>.manifest.json`` beside it holds
its size and sha256, checked on every load. A file made for another model or quantizer, damaged, or
missing is refused with a ``PredictorFileError`` whose fields say which calibration makes the right
one — the library never spells a command line (``experiments.calibrate.calibrate_command`` does).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvquant.cache import nbytes
from kvquant.errors import KvquantError
from kvquant.quant.device import on_device
from kvquant.quant.higgs import Higgs, HiggsTensor

FORMAT = "kvquant-aquakv-predictors/1"
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
TARGET_FIELDS = ("model_id", "config_hash", "model_path", "method", "bits", "predict", "first_layer_bits", "group")

Pred = tuple[torch.Tensor, torch.Tensor] | None


class PredictorFileError(KvquantError):
    """A predictor file that is missing, damaged, or was made for another model or quantizer.

    ``str()`` is one plain-English line naming the file. The fields say which calibration would
    make the right file: ``path``; the model (``model_id``: a known name, hub id or folder name,
    ``config_hash``, ``model_path``: its ``_name_or_path``); ``method`` (the registry name that
    calibrates it), ``bits``, ``predict``, ``first_layer_bits`` and ``group``. They are None where
    unknown (a file read on its own, ``Predictors.load``).
    """

    def __init__(self, message: str, path: str | os.PathLike | None = None, **target: Any):
        super().__init__(message)
        unknown = set(target) - set(TARGET_FIELDS)
        if unknown:
            raise TypeError(f"PredictorFileError: unknown fields {sorted(unknown)}")
        self.path = None if path is None else Path(path)
        self.model_id: str | None = None
        self.config_hash: str | None = None
        self.model_path: str | None = None
        self.method: str | None = None
        self.bits: int | None = None
        self.predict: str | None = None
        self.first_layer_bits: int | None = None
        self.group: int | None = None
        for key, value in target.items():
            setattr(self, key, value)

    def target(self) -> dict[str, Any]:
        """The calibration fields (model, method, quantizer) as a dict."""
        return {key: getattr(self, key) for key in TARGET_FIELDS}

    def with_target(self, **target: Any) -> PredictorFileError:
        """The same message with the calibration fields filled in (what a method knows, a file doesn't)."""
        return PredictorFileError(str(self), target.pop("path", self.path), **{**self.target(), **target})

    def __reduce__(self) -> tuple:
        return (_rebuild, (str(self), self.path, self.target()))


def _rebuild(message: str, path: Path | None, target: dict[str, Any]) -> PredictorFileError:
    return PredictorFileError(message, path, **target)


# ----------------------------------------------------------------------------- identities and paths


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


# ----------------------------------------------------------------------------- the file


@dataclass
class Predictors:
    """Fitted predictors: ``k[l]``/``v[l]`` = ``(W [in, out], b [out])`` fp32, plus the file header.
    ``source``: ``{"path", "sha256"}`` of the file they were read from (None if never saved), so a
    result can name the exact file: recalibrating keeps the file name but not its digest."""

    header: dict[str, Any]
    k: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    v: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    source: dict[str, str] | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for kind, table in (("k", self.k), ("v", self.v)):
            for layer, (w, b) in table.items():
                out[f"{kind}.{layer}.weight"] = w.contiguous()
                out[f"{kind}.{layer}.bias"] = b.contiguous()
        return out

    def nbytes(self) -> int:
        return nbytes(self.tensors().values())

    @staticmethod
    def manifest_path(path: str | os.PathLike) -> Path:
        """The size/sha256 manifest written beside a predictor file (``<file>.manifest.json``)."""
        path = Path(path)
        return path.with_name(f"{path.name}.manifest.json")

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically (temporary file + rename), then its manifest.

        The old manifest goes first, so a crash in between leaves a file without one (checked by
        parsing) rather than a new file beside an old manifest that would call it corrupt.
        """
        from safetensors.torch import save_file

        from kvquant.fsutil import write_manifest

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.manifest_path(path).unlink(missing_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            save_file(self.tensors(), str(tmp), metadata={"kvquant": json.dumps(self.header, sort_keys=True)})
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        write_manifest(self.manifest_path(path), [path])
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Predictors:
        """Read a predictor file, refusing a damaged one in one line that names it.

        The file is small and read whole anyway, so its sha256 is checked on every load. A file
        without a manifest (saved before manifests existed, or copied alone) is checked by parsing.
        """
        from safetensors import SafetensorError, safe_open

        from kvquant.fsutil import check_manifest, sha256_file

        manifest = cls.manifest_path(path)
        problem = check_manifest(manifest, full=True) if manifest.is_file() else None
        if problem is None:
            try:
                with safe_open(str(path), "pt") as fh:
                    meta = fh.metadata() or {}
                    if "kvquant" not in meta:
                        raise PredictorFileError(
                            f"{path} is not a kvquant predictor file (no 'kvquant' header); recalibrate", path
                        )
                    header = json.loads(meta["kvquant"])
                    if header.get("format") != FORMAT:
                        raise PredictorFileError(
                            f"{path}: format {header.get('format')!r}, expected {FORMAT!r}; recalibrate", path
                        )
                    pred = cls(header)
                    for name in fh.keys():
                        kind, layer, part = name.split(".")
                        table = pred.k if kind == "k" else pred.v
                        w, b = table.get(int(layer), (None, None))
                        t = fh.get_tensor(name).float()
                        table[int(layer)] = (t, b) if part == "weight" else (w, t)
                pred.source = {"path": str(Path(path).resolve()), "sha256": sha256_file(path)}
                return pred
            except (SafetensorError, OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                problem = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise PredictorFileError(f"predictor file {path} is corrupt or truncated ({problem}); recalibrate", path)


def load_cached(path: Path) -> Predictors:
    """``Predictors.load``, memoised per file version (path, inode, size, mtime, ctime): a sweep loads once."""
    st = Path(path).stat()
    return _load_version(str(Path(path).resolve()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@functools.lru_cache(maxsize=8)
def _load_version(path: str, ino: int, size: int, mtime_ns: int, ctime_ns: int) -> Predictors:
    return Predictors.load(path)


# ----------------------------------------------------------------------------- the rule


def to_rows(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, n, D]`` → ``[B, n, H·D]`` (all heads of a token side by side, as the predictors read them)."""
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b, n, h * d)


def from_rows(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    b, n, c = x.shape
    return x.view(b, n, n_heads, c // n_heads).transpose(1, 2)


def apply_predictor(pred: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``x @ w + b`` on ``x``'s device (the weights copied there once, not every step)."""
    w, b = (on_device(t, x.device) for t in pred)
    return torch.addmm(b, x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], -1)


def encode_pair(
    quant: Higgs,
    pred_k: Pred,
    pred_v: Pred,
    k: torch.Tensor,
    v: torch.Tensor,
    prev_k: torch.Tensor | None,
    prev_v: torch.Tensor | None,
    reconstruct: bool = True,
) -> tuple[HiggsTensor, torch.Tensor | None, HiggsTensor, torch.Tensor | None]:
    """Codes and reconstructions of ``k``/``v`` rows: ``Q(x − pred)`` and ``pred + deQ(Q(x − pred))``.

    One rule for the cache and for calibration; the value predictor reads the reconstructed keys. Without
    ``reconstruct`` (the cache, which keeps codes) the reconstructions come back None and the keys' is made only
    for a value predictor to read: each is a decoding, some twenty operators a layer and step on a GPU.
    """
    pk = apply_predictor(pred_k, prev_k) if pred_k is not None else None
    qk = quant.quantize(k - pk if pk is not None else k)
    rk = quant.dequantize(qk) + (pk if pk is not None else 0) if reconstruct or pred_v is not None else None
    pv = apply_predictor(pred_v, torch.cat([rk, prev_v], dim=-1)) if pred_v is not None else None
    qv = quant.quantize(v - pv if pv is not None else v)
    rv = quant.dequantize(qv) + (pv if pv is not None else 0) if reconstruct else None
    return qk, rk if reconstruct else None, qv, rv


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
