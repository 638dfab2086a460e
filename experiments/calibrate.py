"""AQUA-KV calibration: ``python run.py experiment=calibrate method=aquakv model=smollm2_135m``.

Fits the predictors of ``cfg.method`` (aquakv, aquakv_k_only or aquakv_v_only, at its ``bits``) on
held-out TinyStories text, saves them where the method loads them from (or ``experiment.out``) and
returns the per-layer fit as the run's results.

``calibrate_command`` and ``error_line`` turn a ``PredictorFileError`` (whose fields say which
calibration makes the missing file) into the command line that makes it: the library knows nothing
of Hydra, so run.py and the experiment runners format it here.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from experiments.evaluate import load, params_of
from kvquant.errors import KvquantError
from kvquant.methods import get_method
from kvquant.methods.aquakv import GROUP, AquaKVMethod, PredictorFileError, model_identity
from kvquant.models import model_info

#: ``conf/method/aquakv.yaml``'s first_layer_bits: the command names it only when it differs
DEFAULT_FIRST_LAYER_BITS = 4


def config_name(model_id: str) -> str | None:
    """The ``conf/model`` name of a model id (a known name, its hub id, or a converted folder), if any."""
    from kvquant.models import MODELS

    for name, spec in MODELS.items():
        if model_id in (name, spec.hub_id) or model_id.startswith(f"{name}-"):
            return name
    return None


def calibrate_command(err: PredictorFileError) -> str | None:
    """``python run.py experiment=calibrate ...`` that makes the file ``err`` is about; None if it cannot say."""
    if err.method is None or err.bits is None:
        return None
    name = config_name(err.model_id) if err.model_id else None
    model = f"model={name}" if name else f"model.path={err.model_path or '?'}"
    args = [f"python run.py experiment=calibrate method={err.method}", model, f"method.bits={err.bits}"]
    if err.first_layer_bits != DEFAULT_FIRST_LAYER_BITS:
        flb = "null" if err.first_layer_bits is None else err.first_layer_bits
        args.append(f"method.first_layer_bits={flb}")
    if err.group is not None and err.group != GROUP:
        args.append(f"method.group={err.group}")
    return " ".join(args)


def error_line(exc: BaseException) -> str:
    """The one line to print for a ``KvquantError``: its message, plus the calibrate command after a
    predictor file error (whose message ends "calibrate first" or "recalibrate")."""
    line = " ".join(str(exc).split())
    command = calibrate_command(exc) if isinstance(exc, PredictorFileError) else None
    return f"{line}: {command}" if command else line


def run(cfg: DictConfig) -> dict[str, Any]:
    """Calibrate, save the predictor file and return the results.json blocks."""
    method = get_method(cfg.method.name, **params_of(cfg.method))
    if not isinstance(method, AquaKVMethod) or method.predict == "none":
        raise KvquantError(
            f"experiment=calibrate fits AQUA-KV predictors; method '{cfg.method.name}' has none "
            "(use method=aquakv, aquakv_k_only or aquakv_v_only)"
        )
    model, tokenizer, device = load(cfg)
    exp = cfg.experiment
    started = time.perf_counter()
    pred = method.calibrate(
        model, tokenizer, n_seqs=exp.n_seqs, seq_len=exp.seq_len, seed=cfg.seed, lam=exp.lam, progress=cfg.progress
    )
    seconds = time.perf_counter() - started
    config = model.config.get_text_config(decoder=True)
    out = Path(exp.out) if exp.out else method.default_path(model_identity(config), method.quantizers(model.config))
    path = pred.save(out)
    fit = pred.header["fit"]
    fitted = [row for row in fit if row["layer"] > 0]

    def mean(key: str) -> float:
        return sum(row[key] for row in fitted) / max(1, len(fitted))

    print(f"predictors: {path} ({pred.nbytes() / 1e6:.2f} MB) in {seconds:.1f}s")
    return {
        "model": model_info(model, cfg.model.name),
        "method": method.describe(),
        "task": {"name": "calibrate", **pred.header["data"], "seed": cfg.seed, "lambda": exp.lam},
        "metrics": {
            "k_rel_mse": mean("k_rel_mse"),
            "v_rel_mse": mean("v_rel_mse"),
            "k_rel_mse_higgs": mean("k_rel_mse_higgs"),
            "v_rel_mse_higgs": mean("v_rel_mse_higgs"),
            "k_equivalent_bits": mean("k_equivalent_bits"),
            "v_equivalent_bits": mean("v_equivalent_bits"),
            "predictor_bytes": pred.nbytes(),
        },
        "calibration": {"file": str(path), "layers": fit},
        "timing": {"calibrate_s": seconds},
        "device": device,
    }
