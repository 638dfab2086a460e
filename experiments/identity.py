"""What a run's identity holds beyond its config: the digest of every parameter file its method reads.

An ``experiment=evaluate`` run (a plain run or a table's cell) whose method names a parameter file
(``kvquant.results.FILE_PARAMS``: AQUA-KV's ``predictors``, ``null`` meaning the default path for the
model and quantizer) is identified by its config hash *and* that file's sha256
(``kvquant.results.identity``), so a run or cell made with other predictors is not reused after a
recalibration. The file is found as the run would find it: ``method.new_cache`` on a copy of the model
built on the meta device (its config, no weights), on the torch backend (the file does not depend on
it). A file that is missing or made for another model raises the method's own ``KvquantError``, the
one the run itself would raise.
"""

from __future__ import annotations

import functools
from typing import Any

from omegaconf import DictConfig

from kvquant.results import FILE_PARAMS


def reads_files(cfg: DictConfig) -> bool:
    """Whether ``cfg`` is an evaluate run whose method names a parameter file."""
    method = cfg.get("method") or {}
    return cfg.experiment.runner == "evaluate" and any(name in method for name in FILE_PARAMS)


def parameter_files(cfg: DictConfig) -> dict[str, str]:
    """``{name: sha256}`` of the parameter files ``cfg``'s method reads on ``cfg``'s model; ``{}`` for a
    run that reads none (no model is built then)."""
    if not reads_files(cfg):
        return {}
    from experiments.evaluate import params_of
    from kvquant.methods import get_method

    method = get_method(cfg.method.name, **params_of(cfg.method)).on_backend("torch")
    cache = method.new_cache(meta_model(cfg.model.path or cfg.model.name, cfg.model.get("hub_id")))
    digests = {name: (cache.parameter_files.get(name) or {}).get("sha256") for name in FILE_PARAMS}
    return {name: str(sha) for name, sha in digests.items() if sha and name in cfg.method}


@functools.lru_cache(maxsize=4)
def meta_model(name_or_path: str, hub_id: str | None = None) -> Any:
    """The model ``load_model(name_or_path)`` would load, built on the meta device from its config alone
    (seconds for any size); where its config cannot be read, ``load_model``'s own one-line error."""
    from pathlib import Path

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvquant.models import MODELS, load_model, prepare_model

    spec = MODELS.get(name_or_path)
    if spec is not None and spec.source != "hub":
        source = str(prepare_model(name_or_path))
    elif spec is not None:
        source = hub_id or spec.hub_id
    else:
        source = str(Path(name_or_path).expanduser())
    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError):
        return load_model(name_or_path, device="cpu", hub_id=hub_id)[0]  # raises the loader's own line
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)
