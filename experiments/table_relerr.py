"""The paper's Table 1 for every method: relative-error buckets of ``QKᵀ`` and ``SV`` at real decode steps.

For each of ``prompts`` WikiText-2 windows of ``context`` tokens, the decode step after the window is
captured once from the fp16 model and replayed through a fresh store of every method
(``kvquant.analysis.relerr``); shares are averaged over the windows. A method that cannot run on
the model (e.g. a group size that does not divide its head_dim) is listed with the reason.
Writes ``table_relerr.md`` (rendered from ``table_relerr.csv`` alone; the reasons for skipped methods and
the heading come from results.json).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from experiments.figures import progress, publish_table, start

NAME = "table_relerr"


def build_methods(specs: dict, model) -> tuple[dict[str, Any], dict[str, str]]:
    """Registry methods by label, and the labels that cannot run on ``model`` with the reason."""
    from kvquant.errors import KvquantError
    from kvquant.methods import get_method

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


def markdown(table, skipped: dict[str, str]) -> str:
    """The Markdown table: one row per method, shares of each bucket in percent, skipped methods last."""
    buckets = [c.removeprefix("qk ") for c in table.columns if c.startswith("qk ")]
    head = "| method | " + " | ".join(f"QKᵀ {b}" for b in buckets) + " | " + " | ".join(f"SV {b}" for b in buckets)
    lines = [head + " |", "|---" * (1 + 2 * len(buckets)) + "|"]
    for r in table.to_dict(orient="records"):
        cells = [f"{100 * r[f'{kind} {b}']:.1f}%" for kind in ("qk", "sv") for b in buckets]
        lines.append(f"| {r['method']} | " + " | ".join(cells) + " |")
    lines += [f"| {label} | skipped: {reason} |" for label, reason in skipped.items()]
    return "\n".join(lines) + "\n"


def render(table, stem: Path, results: dict[str, Any] | None = None) -> list[Path]:
    """``stem.md`` from the CSV; results.json supplies the heading (model, prompts) and why methods were skipped."""
    results = results or {}
    experiment = results.get("experiment", {})
    model = results.get("model", {}).get("name")
    heading = "Relative error of decode-step results (share of elements per bucket)"
    if model and experiment.get("prompts") and experiment.get("context"):
        heading += f", {model}, {experiment['prompts']} × {experiment['context']}-token prompts"
    path = stem.with_suffix(".md")
    path.write_text(heading + "\n\n" + markdown(table, experiment.get("skipped", {})), encoding="utf-8")
    return [path]


def percentages(text: str) -> dict[str, list[float]]:
    """The numbers of a rendered table by method (percent), for checking them against results.json."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) > 1 and all(re.fullmatch(r"[0-9.]+%", c) for c in cells[1:]):
            rows[cells[0]] = [float(c[:-1]) for c in cells[1:]]
    return rows


def run(cfg: DictConfig) -> dict[str, Any]:
    from experiments.greedy import wikitext_ids
    from kvquant.analysis.relerr import relative_error_table

    exp, model, tok, device = start(cfg)
    context = min(int(exp.context), model.config.max_position_embeddings - 1)
    methods, skipped = build_methods(OmegaConf.to_container(exp.methods, resolve=True), model)
    ids = wikitext_ids(tok)
    sums: dict[str, dict[str, float]] = {label: {} for label in methods}
    for i in progress(range(exp.prompts), cfg, NAME):
        shares_by_method = relative_error_table(model, ids[i * context : (i + 1) * context + 1], methods)
        for label, kinds in shares_by_method.items():
            for kind, shares in kinds.items():
                for bucket, share in shares.items():
                    key = f"{kind} {bucket}"
                    sums[label][key] = sums[label].get(key, 0.0) + share / exp.prompts
    rows = [{"method": label, **values} for label, values in sums.items()]
    experiment = {"name": NAME, "context": context, "prompts": exp.prompts, "skipped": skipped}
    return publish_table(render, NAME, rows, cfg, model, experiment, device)
