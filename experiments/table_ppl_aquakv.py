"""AQUA-KV's perplexity check: WikiText-2 perplexity of AQUA-KV vs HIGGS vs fp16 (and KIVI) at long context.

The protocol of the former ``scripts/ppl_aquakv.py`` as cells (``experiments/cells.py``): each row ×
the ``wikitext`` task is one ``experiment=evaluate`` run, reused when its results.json exists, so the
same token windows and chunks go through every method and each cell carries its KL to fp16. Rows
include HIGGS with layer 0 at 4 bits (AQUA-KV's layout without predictors), which separates what the
predictors buy from what the 4-bit first layer buys. AQUA-KV rows need predictors calibrated for each
bit width (``python run.py experiment=calibrate method=aquakv method.bits=B``); without them a row is
listed as skipped with that command. Calibration text is TinyStories, so WikiText-2 judges the
predictors out of domain. ``render`` writes ``table_ppl_aquakv.md`` from the CSV alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from experiments.cells import fmt, footnotes, run_table
from experiments.figures import write_markdown

NAME = "table_ppl_aquakv"
RESUME = "cells"  # run.py: the table always runs; each cell is reused by its identity (experiments/cells.py)
REFERENCE = "fp16"
NOTE = (
    "Bits stored are measured from the tensors each cache held (scales, fp16 sink and window included, so "
    "short contexts read high); analytic is the method's asymptotic bits per value. `higgs2_l0b4` is HIGGS "
    "with AQUA-KV's 4-bit layer 0 and no predictors: the gap between it and `aquakv2` is what the predictors "
    "buy. AQUA-KV's predictors are calibrated on TinyStories, so WikiText-2 judges them out of domain."
)


def render(table, stem: Path) -> list[Path]:
    """``stem.md``: per task column, perplexity, its change vs fp16, KL, bits stored (measured and analytic)."""
    notes, note_lines = footnotes(table)
    lines = []
    for task, rows in table.groupby("task", sort=False):
        ref = rows[(rows.method_name == REFERENCE) & rows.value.notna()].value
        base = float(ref.iloc[0]) if len(ref) else None
        first = rows.iloc[0]
        models = ", ".join(dict.fromkeys(rows.model.dropna())) or "?"
        lines += [
            f"## {task}: {first.metric} through each cache, {models} (n = {fmt(rows.n.max(), 0)} windows)",
            "",
            f"| method | {first.metric} | Δ vs {REFERENCE} | KL vs {REFERENCE} (nats) | bits stored (measured) "
            "| bits stored (analytic) |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows.to_dict(orient="records"):
            if isinstance(r["reason"], str):
                lines.append(f"| {r['method']} | {r['status']} [{notes[r['reason']]}] | – | – | – | – |")
                continue
            change = "–" if base is None or r["method_name"] == REFERENCE else f"{100 * (r['value'] / base - 1):+.2f}%"
            lines.append(
                f"| {r['method']} | {fmt(r['value'] * r['scale'], 3)} | {change} | {fmt(r['kl'], 4)} "
                f"| {fmt(r['bits_stored'], 3)} | {fmt(r['bits_analytic'], 3)} |"
            )
        lines.append("")
    return [write_markdown(stem, [*lines, NOTE, *(["", *note_lines] if note_lines else [])])]


def run(cfg: DictConfig) -> dict[str, Any]:
    return run_table(cfg, NAME, render)
