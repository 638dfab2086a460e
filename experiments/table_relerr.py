"""The paper's Table 1 for every method: relative-error buckets of ``QKᵀ`` and ``SV`` at real decode steps.

For each of ``prompts`` WikiText-2 windows of ``context`` tokens, the decode step after the window is
captured once from the fp16 model and replayed through a fresh store of every method
(``kvquant.analysis.relerr``); shares are averaged over the windows. A method that cannot run on
the model (e.g. a group size that does not divide its head_dim) is listed with the reason.
Writes ``table_relerr.md`` and ``table_relerr.csv``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from kvquant.analysis.relerr import BUCKETS, relative_error_table
from kvquant.data import wikitext2_test
from kvquant.errors import KvquantError
from kvquant.methods import get_method
from kvquant.models import load_model, model_info, resolve_device

NAME = "table_relerr"


def build_methods(specs: dict, model) -> tuple[dict[str, Any], dict[str, str]]:
    """Registry methods by label, and the labels that cannot run on ``model`` with the reason."""
    methods, skipped = {}, {}
    for label, spec in specs.items():
        params = dict(spec or {})
        name = params.pop("name", label)
        try:
            method = get_method(name, **params)
            method.new_cache(model)  # surfaces model-dependent refusals (head_dim, layouts)
            methods[label] = method
        except KvquantError as exc:
            skipped[label] = str(exc)
    return methods, skipped


def markdown(rows: list[dict], skipped: dict[str, str]) -> str:
    head = "| method | " + " | ".join(f"QKᵀ {b}" for b in BUCKETS) + " | " + " | ".join(f"SV {b}" for b in BUCKETS)
    lines = [head + " |", "|---" * (1 + 2 * len(BUCKETS)) + "|"]
    for r in rows:
        cells = [f"{100 * r[f'qk {b}']:.1f}%" for b in BUCKETS] + [f"{100 * r[f'sv {b}']:.1f}%" for b in BUCKETS]
        lines.append(f"| {r['method']} | " + " | ".join(cells) + " |")
    lines += [f"| {label} | skipped: {reason} |" for label, reason in skipped.items()]
    return "\n".join(lines) + "\n"


def run(cfg: DictConfig) -> dict[str, Any]:
    import pandas as pd

    exp = cfg.experiment
    device = resolve_device(cfg.device)
    model, tok = load_model(cfg.model.path or cfg.model.name, dtype=cfg.model.dtype, device=device)
    context = min(int(exp.context), model.config.max_position_embeddings - 1)
    methods, skipped = build_methods(OmegaConf.to_container(exp.methods, resolve=True), model)
    ids = tok(wikitext2_test(), return_tensors="pt").input_ids[0]
    sums: dict[str, dict[str, float]] = {label: {} for label in methods}
    for i in tqdm(range(exp.prompts), desc=NAME, disable=not cfg.progress):
        table = relative_error_table(model, ids[i * context : (i + 1) * context + 1], methods)
        for label, kinds in table.items():
            for kind, shares in kinds.items():
                for bucket, share in shares.items():
                    key = f"{kind} {bucket}"
                    sums[label][key] = sums[label].get(key, 0.0) + share / exp.prompts
    rows = [{"method": label, **values} for label, values in sums.items()]
    out = Path(HydraConfig.get().runtime.output_dir)
    text = f"Relative error of decode-step results, {cfg.model.name}, {exp.prompts} × {context}-token prompts\n\n"
    text += markdown(rows, skipped)
    for folder in (out, Path(exp.figures_dir)):
        folder.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows).to_csv(folder / f"{NAME}.csv", index=False)
        (folder / f"{NAME}.md").write_text(text, encoding="utf-8")
    print(text)
    return {
        "model": model_info(model, cfg.model.name),
        "experiment": {"name": NAME, "context": context, "prompts": exp.prompts, "skipped": skipped},
        "table": rows,
        "device": device,
    }
