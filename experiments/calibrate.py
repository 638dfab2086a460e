"""AQUA-KV calibration: ``python run.py experiment=calibrate method=aquakv model=smollm2_135m``.

Fits the predictors of ``cfg.method`` (aquakv, aquakv_k_only or aquakv_v_only, at its ``bits``) on
held-out TinyStories text, saves them where the method loads them from (or ``experiment.out``) and
returns the per-layer fit as the run's results.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from experiments.evaluate import load, params_of
from kvquant.errors import KvquantError
from kvquant.methods import get_method
from kvquant.methods.aquakv import AquaKVMethod, model_identity
from kvquant.models import model_info


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
