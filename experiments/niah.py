"""Needle in a haystack: passkey retrieval accuracy over context length × needle depth, one heatmap per method.

Why the ``passkey`` task and not RULER's ``niah_single``: passkey puts its needle at exactly the
depth asked (a task parameter: the fraction of the filler before the needle, tested in
``tests/test_passkey.py``), while RULER draws each example's depth at random from its 40 even steps,
so a (length, depth) grid would need many examples per cell before every cell had one. Passkey's
filler is real text (WikiText-2) and its prompt goes through the cache in chunks, so the answer is
read from the method's (quantized) cache, not from fresh fp16 K/V.

Each heatmap cell (method, length, depth) is one ``experiment=evaluate`` run of ``task=passkey`` with
``lengths=[length] depths=[depth] trials=<trials>`` (``experiments/cells.py``): reused when a
results.json with its config hash exists (an interrupted run resumes), skipped with its reason when it
cannot run (aquakv without predictors, a length beyond the model's context). One run per heatmap cell,
not per method, so that every number drawn — accuracy with its 95% interval, the paired difference to
fp16 and the fidelity to fp16 (greedy match, KL) on the same prompts — is a cell's own results.json
number, not a slice of a larger run. Methods run in config order with fp16 first: its outputs are the
reference the others are compared with (computed once per (length, depth), under
``<results_dir>/references``).

Reading it: at depth 1 the needle sits among the newest 128 tokens, which KIVI, GEAR, HIGGS and
AQUA-KV keep in fp16 (their ``residual``/``window``), so those cells test the window, not the codes.

Writes ``niah.csv`` (one row per cell) and ``niah.png``/``niah.pdf``; ``render`` redraws the
figure from the CSV alone (``make figures``).

Cost, the committed run (``results/niah/``: smollm2_135m, lengths 256/512/1024/2048 × depths 0/0.5/1
× 3 trials × 9 methods = 108 cells; one thread on a shared 2-core CPU, batch_size 8): 45 min. A cell
of 3 prompts takes 4/6/10/22 s for fp16 at 256/512/1K/2K tokens, up to 112 s for a 2-bit method at
2K whose output diverges (fidelity then re-reads the prompt teacher-forced); ~2 s of each cell is
tokenizing the WikiText-2 filler. The issue's 5 depths × 4 trials would take ~1.7 h here.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from experiments.cells import (
    FIDELITY,
    Cell,
    CellResult,
    cell_row,
    counts,
    excludes_zero,
    footnotes,
    grid,
    missing,
    run_cells,
)
from kvquant.errors import InvalidParameterError
from kvquant.plots import pyplot, save_figure

NAME = "niah"
RESUME = "cells"  # run.py: the table always runs; each cell is reused by its identity (experiments/cells.py)
TASK = "passkey"
METRIC = "passkey_acc"
PER_CELL = ("lengths", "depths", "trials", "limit")  # passkey parameters the grid sets, never experiment.task
REFERENCE = "fp16"


@dataclass(frozen=True)
class Grid:
    """The validated experiment: methods (label → conf/method spec, fp16 first), lengths and depths
    (ascending), trials per cell, and the other passkey parameters every cell shares."""

    methods: dict[str, dict[str, Any]]
    lengths: list[int]
    depths: list[float]
    trials: int
    task: dict[str, Any]

    def cells(self) -> list[Cell]:
        """One ``evaluate`` cell per (method, length, depth), method-major (fp16's references come first)."""
        tasks = {
            task_label(n, d): {"name": TASK, **self.task, "lengths": [n], "depths": [d], "trials": self.trials}
            for n in self.lengths
            for d in self.depths
        }
        return grid(self.methods, tasks)[0]


def task_label(length: int, depth: float) -> str:
    return f"L{length}_d{depth:g}"


def _ints(values: Any, what: str) -> list[int]:
    if not isinstance(values, (list, tuple)) or not values:
        raise InvalidParameterError(f"experiment niah: {what} must be a non-empty list of positive token counts")
    out = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
            raise InvalidParameterError(f"experiment niah: {what} {list(values)} must be positive token counts")
        out.append(int(value))
    return sorted(set(out))


def _depths(values: Any) -> list[float]:
    if not isinstance(values, (list, tuple)) or not values:
        raise InvalidParameterError("experiment niah: depths must be a non-empty list of fractions in [0, 1]")
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0]
    if bad:
        raise InvalidParameterError(
            f"experiment niah: depths {list(values)} must lie in [0, 1] (0 = needle at the start of the filler, "
            "1 = at its end)"
        )
    return sorted({float(v) for v in values})


def grid_of(exp: Mapping[str, Any]) -> Grid:
    """``cfg.experiment`` (as a container) checked: one ``InvalidParameterError`` line for anything wrong."""
    methods = dict(exp.get("methods") or {})
    if not methods:
        raise InvalidParameterError("experiment niah: methods is empty; give at least fp16, e.g. methods={fp16:{}}")
    methods = {k: dict(v or {}) for k, v in sorted(methods.items(), key=lambda kv: kv[0] != REFERENCE)}
    trials = exp.get("trials")
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise InvalidParameterError(f"experiment niah: trials={trials} must be a positive integer")
    task = dict(exp.get("task") or {})
    clash = sorted(set(task) & {*PER_CELL, "name"})
    if clash:
        raise InvalidParameterError(
            f"experiment niah: experiment.task sets {', '.join(clash)}, which the grid sets per cell; "
            "use experiment.lengths, experiment.depths, experiment.trials"
        )
    found = Grid(methods, _ints(exp.get("lengths"), "lengths"), _depths(exp.get("depths")), trials, task)
    found.cells()  # an unknown method names itself and the valid ones here, before any model is loaded
    return found


def row_of(result: CellResult) -> dict[str, Any]:
    """One CSV row: the cell's accuracy, n, interval, paired difference and fidelity, from its results.json."""
    base = cell_row(result, METRIC)
    params = result.cell.task_params
    row = {key: base[key] for key in ("model", "method", "method_name", "method_params")}
    row |= {"length": params["lengths"][0], "depth": params["depths"][0], "status": base["status"], "n": base["n"]}
    row |= {"accuracy": base["value"], "accuracy_lo": base["value_lo"], "accuracy_hi": base["value_hi"]}
    row |= {key: base[key] for key in ("paired", "paired_lo", "paired_hi")}
    for name in FIDELITY:
        row |= {key: base[key] for key in (name, f"{name}_lo", f"{name}_hi")}
    keys = ("bits_stored", "bits_read", "wall_s", "config_hash", "results", "reason")
    return row | {key: base[key] for key in keys}


def _text_color(rgba: tuple[float, ...]) -> str:
    """Black on light colours, white on dark ones (relative luminance)."""
    return "black" if 0.2126 * rgba[0] + 0.7152 * rgba[1] + 0.0722 * rgba[2] > 0.5 else "white"


def render(table, stem: Path) -> list[Path]:
    """One heatmap per method (fp16 first, then CSV order): needle depth (rows) × context length (columns),
    one 0–1 colour scale for all, each cell annotated with its accuracy and n (``*``: the paired interval
    to fp16 excludes 0 at n ≥ MIN_N_CLAIM); skipped cells grey, their reasons as numbered notes."""
    import numpy as np

    from kvquant.eval.intervals import MIN_N_CLAIM

    plt = pyplot()
    methods = sorted(dict.fromkeys(table.method), key=lambda m: m != REFERENCE)
    lengths = sorted(int(x) for x in table.length.unique())
    depths = sorted(float(x) for x in table.depth.unique())
    notes, note_lines = footnotes(table)
    ncols = min(3, len(methods))
    nrows = math.ceil(len(methods) / ncols)
    size = (1.5 + 1.1 * len(lengths) * ncols, 1.0 + (0.8 + 0.5 * len(depths)) * nrows)
    fig, axes = plt.subplots(nrows, ncols, figsize=size, squeeze=False, layout="constrained")
    cmap = plt.get_cmap("RdYlGn").with_extremes(bad="#d9d9d9")
    image = None
    for k, (ax, method) in enumerate(zip(axes.flat, methods, strict=False)):
        rows = table[table.method == method]
        values = np.full((len(depths), len(lengths)), np.nan)
        for row in rows.itertuples():
            i, j = depths.index(float(row.depth)), lengths.index(int(row.length))
            values[i, j] = np.nan if missing(row.accuracy) else float(row.accuracy)
            if isinstance(row.reason, str):
                text = f"skipped\n[{notes[row.reason]}]" if row.status == "skipped" else f"–\n[{notes[row.reason]}]"
                ax.text(j, i, text, ha="center", va="center", fontsize=7, color="#444444")
                continue
            star = " *" if excludes_zero(row.paired_lo, row.paired_hi, row.n) else ""
            color = _text_color(cmap(float(row.accuracy)))
            label = f"{float(row.accuracy):.2f}{star}\nn={int(row.n)}"
            ax.text(j, i, label, ha="center", va="center", fontsize=7, color=color)
        image = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=8)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=8)
        ax.set_title(method, fontsize=10)
        if k % ncols == 0:
            ax.set_ylabel("needle depth", fontsize=8)
        if k + ncols >= len(methods):
            ax.set_xlabel("context length (tokens)", fontsize=8)
    for ax in list(axes.flat)[len(methods) :]:
        ax.set_visible(False)
    models = ", ".join(str(m) for m in dict.fromkeys(table.model.dropna())) or "?"
    fig.suptitle(f"Needle in a haystack (passkey retrieval), {models}: accuracy per (length, depth)", fontsize=11)
    fig.colorbar(image, ax=list(axes.flat), shrink=0.8, label="retrieval accuracy (share of trials)")
    lines = [
        "Depth: share of the filler before the needle (0 = start, 1 = end). n: trials (keys) per cell; "
        f"* the paired 95% interval to fp16 excludes 0 with n ≥ {MIN_N_CLAIM}.",
        *note_lines,
    ]
    width = max(60, round(13 * size[0]))  # characters of 7-point text across the figure
    fig.text(0.0, 0.0, "\n".join(textwrap.fill(line, width) for line in lines), ha="left", va="top", fontsize=7)
    return save_figure(fig, stem)


def summary(table) -> str:
    """Accuracy per (method, depth) × length as text, for the log."""
    done = table[table.status != "skipped"]
    if not len(done):
        return "no cell ran"
    pivot = done.pivot_table(index=["method", "depth"], columns="length", values="accuracy", sort=False)
    return pivot.to_string(float_format=lambda v: f"{v:.2f}")


def run(cfg: DictConfig) -> dict[str, Any]:
    import pandas as pd
    from hydra.core.hydra_config import HydraConfig

    from experiments.figures import publish, records

    exp = grid_of(OmegaConf.to_container(cfg.experiment, resolve=True))
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    results = run_cells(cfg, exp.cells(), run_dir)
    rows = [row_of(result) for result in results]
    table, _ = publish(render, NAME, pd.DataFrame(rows), run_dir, cfg.experiment.figures_dir)
    print(summary(table))
    return {
        "experiment": {
            "name": NAME,
            "lengths": exp.lengths,
            "depths": exp.depths,
            "trials": exp.trials,
            "cells": counts(results),
            "figures": str(Path(cfg.experiment.figures_dir) / NAME),
        },
        "table": records(table),
    }
