"""The default runner: one model × one KV method × one task, with fidelity to fp16.

Beside ``metrics`` and ``fidelity``, results.json gets ``paired`` (each metric minus fp16's on the
same examples), ``ci95`` (95% bootstrap intervals over examples, keyed ``metrics/<name>``,
``fidelity/<name>``, ``paired/<name>``) and ``n`` (the examples behind each of those numbers; a key
with n = 1 has no interval). results.json files written before these blocks existed lack them, and
every reader (``experiments/cells.py``, ``kvquant.results``, ``kvquant.tracking``) treats them as absent.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from kvquant.cache import KVGeometry
from kvquant.eval.tasks import get_task
from kvquant.fsutil import atomic_write_text
from kvquant.methods import get_method
from kvquant.models import load_model, model_info, resolve_device

REFERENCE_METHOD = "fp16"
EXAMPLES_FILE = "examples.jsonl"


def params_of(node: DictConfig) -> dict[str, Any]:
    """A config group's parameters: everything but its ``name``."""
    data = OmegaConf.to_container(node, resolve=True)
    data.pop("name", None)
    return data


def load(cfg: DictConfig) -> tuple[Any, Any, str]:
    """``(model, tokenizer, device)`` for ``cfg.model`` on ``cfg.device`` (tables load once for many cells)."""
    device = resolve_device(cfg.device)
    model, tokenizer = load_model(
        cfg.model.path or cfg.model.name,
        dtype=cfg.model.dtype,
        device=device,
        device_map=cfg.model.device_map,
        hub_id=cfg.model.get("hub_id"),
    )
    return model, tokenizer, device


def run(cfg: DictConfig, out_dir: str | Path | None = None, loaded: tuple | None = None) -> dict[str, Any]:
    """Evaluate ``cfg.method`` on ``cfg.task`` and return the results.json blocks it measured.

    ``out_dir`` receives examples.jsonl (default: Hydra's run folder, where run.py writes results.json);
    ``loaded`` is ``load(cfg)``'s result when the caller already holds the model.
    """
    method = get_method(cfg.method.name, **params_of(cfg.method))
    task = get_task(cfg.task.name, **params_of(cfg.task))
    model, tokenizer, device = loaded or load(cfg)
    # fidelity is to fp16 as transformers computes it: the torch reference, whatever backend is the default
    reference = None if cfg.method.name == REFERENCE_METHOD else get_method(REFERENCE_METHOD, backend="torch")
    cuda = device.startswith("cuda")
    if cuda:  # the peak of prefill and decode over what the model already holds
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    result = task.run(
        model,
        tokenizer,
        method,
        reference_method=reference,
        progress=cfg.progress,
        reference_dir=Path(cfg.results_dir) / "references",
    )

    probe = method.new_cache(model)  # what a cache of this method resolves on this model
    geometry = KVGeometry.of(model.config)
    stats = result.counts.summary()
    n_seqs = result.n_caches or max(1, task.params().get("limit") or 1)
    examples = write_examples(result.examples, out_dir)
    return {
        "model": model_info(model, cfg.model.name),
        "method": {
            **method.describe(),
            **({"backend_used": probe.backend} if probe.backend else {}),
            **({"adapted": probe.adaptations} if probe.adaptations else {}),
            **({"files": probe.parameter_files} if probe.parameter_files else {}),
        },
        "task": {"name": task.name, "n": result.n, **task.params(), **result.info},
        "examples": examples,
        "metrics": result.metrics,
        "fidelity": result.fidelity,
        "paired": result.paired or None,
        "ci95": result.ci95 or None,
        "n": result.n_by_key or None,
        "bits": {
            "stored": stats["bits_stored"],
            "read": stats["bits_read"],
            "read_k": stats["bits_read_k"],
            "read_v": stats["bits_read_v"],
            "analytic_stored": method.analytic_bits(geometry),
            "widths_k": stats["widths_k"],
            "widths_v": stats["widths_v"],
        },
        "bits_by_position": result.counts.position_series() if result.counts.by_position else None,
        "memory": {
            "kv_bytes": stats["bytes"] / n_seqs,
            "kv_bytes_fp16": stats["bytes_fp16"] / n_seqs,
            **result.memory,
            **({"cuda_peak_over_model": torch.cuda.max_memory_allocated() - before} if cuda else {}),
        },
        "timing": result.timing,
        "device": device,
    }


def write_examples(examples: list[dict[str, Any]], out_dir: str | Path | None = None) -> dict[str, Any] | None:
    """Per-example outputs as JSONL beside results.json (for diffing methods); the block results.json gets."""
    if not examples:
        return None
    if out_dir is None:
        from hydra.core.hydra_config import HydraConfig

        out_dir = HydraConfig.get().runtime.output_dir
    text = "".join(json.dumps(ex, default=str, ensure_ascii=False) + "\n" for ex in examples)
    atomic_write_text(Path(out_dir) / EXAMPLES_FILE, text)
    return {"file": EXAMPLES_FILE, "n": len(examples)}
