"""The RULER table: each method's score per (subtask, length), per length and overall, with 95% intervals.

One ``experiment=evaluate`` run of ``task=ruler`` per method (``experiments/cells.py``: reused when its
results.json exists, skipped with its reason when it cannot run); every RULER number of that run
becomes one CSV row (``task`` = the metric: ``<subtask>_<length>``, ``len_<length>``, ``ruler_avg``)
with its interval and its paired difference to fp16 on the same examples. The Markdown turns it
round (rows = RULER cells, columns = methods), since methods are few and cells many; fidelity to
fp16 is one row per method. ``render`` rebuilds the Markdown from the CSV alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from experiments.cells import cell_row, counts, excludes_zero, fmt_ci, footnotes, grid, run_cells
from experiments.figures import write_markdown
from experiments.table_tasks import col, fidelity_head, fidelity_values
from kvquant.eval.intervals import MIN_N_CLAIM
from kvquant.eval.ruler_tasks import SUBTASKS

NAME = "table_ruler"
RESUME = "cells"  # run.py: the table always runs; each cell is reused by its identity (experiments/cells.py)
TASK = "ruler"


def is_cell(metric: str) -> bool:
    """``<subtask>_<length>``: one (subtask, length) cell, not a mean over several."""
    subtask, _, length = metric.rpartition("_")
    return subtask in SUBTASKS and length.isdigit()


def metric_order(metrics: Iterable[str]) -> list[str]:
    """RULER's numbers in reading order: each (subtask, length) cell, then each length's mean, then overall
    (the per-subtask means over lengths are left out: they repeat the cells)."""
    metrics = list(metrics)
    lengths = [m for m in metrics if m.startswith("len_")]
    return [m for m in metrics if is_cell(m)] + lengths + [m for m in metrics if m == "ruler_avg"]


def _scores(ours, metrics: list[str], notes: dict[str, int], paired: bool) -> list[str]:
    methods = list(dict.fromkeys(ours.method))
    if paired:
        methods = [m for m in methods if (ours[ours.method == m].method_name != "fp16").all()]
    lines = ["| RULER cell | " + " | ".join(methods) + " |", "|---" * (1 + len(methods)) + "|"]
    by = ours.set_index(["method", "task"])
    for metric in metrics:
        cells = []
        for method in methods:
            mine = ours[ours.method == method]
            row = by.loc[(method, metric)] if (method, metric) in by.index else mine.iloc[0]
            if row.status != "skipped" and (method, metric) not in by.index:
                cells.append("–")
            elif isinstance(row.reason, str):
                cells.append(f"{'skipped' if row.status == 'skipped' else '–'} [{notes[row.reason]}]")
            elif paired:
                lo, hi = col(row, "paired_lo"), col(row, "paired_hi")
                text = fmt_ci(col(row, "paired"), lo, hi, 1, sign=True)
                cells.append(text + (" *" if excludes_zero(lo, hi, row.n) else ""))
            else:
                cells.append(fmt_ci(row.value, col(row, "value_lo"), col(row, "value_hi"), 1))
        label = metric if is_cell(metric) else f"**{metric}**"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def render(table, stem: Path) -> list[Path]:
    """``<stem>.md``: scores (RULER cells × methods), paired differences to fp16, fidelity per method."""
    ours = table[table.source == "ours"]
    metrics = list(dict.fromkeys(ours.task))
    notes, note_lines = footnotes(ours.drop_duplicates("method"))
    models = ", ".join(dict.fromkeys(ours.model.dropna())) or "?"
    n = ours[[is_cell(t) for t in ours.task]].n.dropna()
    lines = [
        f"# RULER (synthetic long-context tasks), {models}",
        "",
        "Score ×100 (RULER's string match of all needles), 95% percentile-bootstrap interval over examples "
        f"(fixed seed); n = {int(n.max()) if len(n) else '–'} examples per (subtask, length) cell; "
        "`len_<L>` is the mean over subtasks at length L (RULER's headline), `ruler_avg` over all cells.",
        "",
        *_scores(ours, metrics, notes, paired=False),
        *(["", *note_lines] if note_lines else []),
        "",
        "## Difference to fp16 (paired: the same prompts, 95% bootstrap interval)",
        "",
        *_scores(ours, metrics, notes, paired=True),
        "",
        f"\\* the interval excludes 0 and n ≥ {MIN_N_CLAIM}: the method scores differently from fp16 beyond "
        "resampling noise; elsewhere this n cannot tell it from fp16.",
        "",
        *fidelity_head("all RULER prompts of the run", ["method"]),
    ]
    for row in ours[ours.status != "skipped"].drop_duplicates("method").itertuples():
        lines.append(f"| {row.method} | " + " | ".join(fidelity_values(row, col(row, "examples"), 0)) + " |")
    return [write_markdown(stem, lines)]


def rows_of(result) -> list[dict[str, Any]]:
    """One CSV row per RULER number of a method's run, each with its own n (a skipped run: one row, its reason)."""
    data = result.results or {}
    examples = (data.get("task") or {}).get("examples")
    out = []
    for metric in metric_order(data.get("metrics", {})) or ["ruler_avg"]:
        row = cell_row(result, metric) | {"task": metric, "examples": examples}
        row["n"] = (data.get("n") or {}).get(f"metrics/{metric}", row["n"])
        out.append(row)
    return out


def run(cfg: DictConfig) -> dict[str, Any]:
    import pandas as pd
    from hydra.core.hydra_config import HydraConfig

    from experiments.figures import publish, records

    exp = cfg.experiment
    task = OmegaConf.to_container(exp.task, resolve=True)
    cells, _ = grid(OmegaConf.to_container(exp.methods, resolve=True), {TASK: {**task, "metric": "ruler_avg"}})
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    results = run_cells(cfg, cells, run_dir)
    rows = [row for result in results for row in rows_of(result)]
    table, _ = publish(render, NAME, pd.DataFrame(rows), run_dir, exp.figures_dir)
    print((run_dir / f"{NAME}.md").read_text(encoding="utf-8"))
    return {
        "experiment": {"name": NAME, "cells": counts(results), "figures": str(Path(exp.figures_dir) / NAME)},
        "table": records(table),
    }
