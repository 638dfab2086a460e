"""The AQUA-KV table (paper artefact 5): perplexity and LongBench vs bits stored, with and without predictors.

Cells (``experiments/cells.py``) of fp16, HIGGS and AQUA-KV at 2/3/4 bits, the predictor ablation
(``aquakv_k_only``, ``aquakv_v_only``) and KIVI-2/4 × WikiText-2 perplexity and LongBench. AQUA-KV
cells need calibrated predictors (``python run.py experiment=calibrate method=aquakv method.bits=B``);
without them a cell is listed as skipped with that command. Writes ``table_aquakv.csv``,
``table_aquakv.md`` and ``table_aquakv.{png,pdf}`` (score vs measured bits stored per value, one panel
per task); ``render`` rebuilds the Markdown and the figure from the CSV alone. Scores and KL carry
their 95% bootstrap intervals over examples (error bars in the figure), and the difference to fp16
its paired interval on the same examples, where the cell has them (n ≥ 2, results.json with ``ci95``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from experiments.cells import excludes_zero, fmt, fmt_ci, footnotes, missing, run_table
from experiments.figures import write_markdown
from experiments.table_tasks import col
from kvquant.eval.intervals import MIN_N_CLAIM
from kvquant.plots import method_color, pyplot, save_figure

NAME = "table_aquakv"
RESUME = "cells"  # run.py: the table always runs; each cell is reused by its identity (experiments/cells.py)
REFERENCE = "fp16"
ABLATIONS = {"aquakv_k_only": ("^", "key predictors only"), "aquakv_v_only": ("v", "value predictors only")}
WIDTH = 6  # Markdown columns per task
PUBLISHED_NOTE = (
    "Published (AQUA-KV paper, Llama-family models): near-lossless at 2–2.5 bits per value, "
    "under 1% relative change in perplexity and LongBench."
)


def relative_change(value: float, reference: float | None) -> float | None:
    """``value / reference − 1`` (None where either is missing or the reference is 0)."""
    if reference is None or reference != reference or not reference or value != value:
        return None
    return value / reference - 1


def reference_values(ours) -> dict[str, float]:
    ref = ours[(ours.method_name == REFERENCE) & ours.value.notna()]
    return dict(zip(ref.task, ref.value, strict=True))


def markdown(ours, stem: Path) -> Path:
    tasks = list(dict.fromkeys(ours.task))
    refs = reference_values(ours)
    notes, note_lines = footnotes(ours)
    head, rule = ["method"], ["---"]
    for task in tasks:
        metric = ours[ours.task == task].metric.iloc[0]
        head += [f"{task}: bits stored", f"{task}: bits (analytic)", f"{task}: {metric}", f"{task}: Δ vs {REFERENCE}"]
        head += [f"{task}: Δ paired", f"{task}: KL vs {REFERENCE}"]
        rule += ["---"] * WIDTH
    models = ", ".join(dict.fromkeys(ours.model.dropna())) or "?"
    lines = [f"# AQUA-KV vs HIGGS vs KIVI, {models}", "", "| " + " | ".join(head) + " |", "|" + "|".join(rule) + "|"]
    for method in dict.fromkeys(ours.method):
        rows = ours[ours.method == method].set_index("task")
        cells = []
        for task in tasks:
            if task not in rows.index:
                cells += ["–"] * WIDTH
                continue
            row = rows.loc[task]
            if isinstance(row.reason, str):
                cells += [f"{row.status if row.status in ('skipped', 'pending') else '–'} [{notes[row.reason]}]"] + [
                    "–"
                ] * (WIDTH - 1)
                continue
            change = relative_change(row.value, refs.get(task))
            shown = "–" if change is None or row.method_name == REFERENCE else f"{100 * change:+.2f}%"
            value = fmt_ci(row.value, col(row, "value_lo"), col(row, "value_hi"), 3, row.scale)
            cells += [fmt(row.bits_stored, 3), fmt(row.bits_analytic, 3), value, shown]
            lo, hi = col(row, "paired_lo"), col(row, "paired_hi")
            paired = "–" if row.method_name == REFERENCE else fmt_ci(col(row, "paired"), lo, hi, 3, row.scale, True)
            cells.append(paired + (" *" if excludes_zero(lo, hi, row.n) else ""))
            cells.append(fmt_ci(row.kl, col(row, "kl_lo"), col(row, "kl_hi"), 4))
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    n = {t: ours[(ours.task == t) & ours.n.notna()].n for t in tasks}
    lines += [
        "",
        "Bits stored: measured from the tensors each cache held in that cell (scales, fp16 sink and window "
        "included, so short contexts read high); analytic: the method's asymptotic bits per value. "
        f"KL: mean KL({REFERENCE} ‖ method) of next-token distributions in nats, meaningful at any model size. "
        f"Brackets: 95% percentile-bootstrap interval over examples (fixed seed; none where no stratum has 2 "
        f"examples, as where n < 2); Δ paired: "
        f"method − {REFERENCE} on the same examples in the metric's units, * where its interval excludes 0 "
        f"with n ≥ {MIN_N_CLAIM} (elsewhere this n cannot tell the method from fp16). "
        "n: " + ", ".join(f"{t} {int(v.max())}" for t, v in n.items() if len(v)) + ".",
        "",
        PUBLISHED_NOTE,
        *(["", *note_lines] if note_lines else []),
    ]
    return write_markdown(stem, lines)


def figure(ours, stem: Path) -> list[Path]:
    plt = pyplot()
    tasks = list(dict.fromkeys(ours.task))
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4.2), squeeze=False)
    done = ours[ours.value.notna() & ours.reason.isna()]
    for ax, task in zip(axes[0], tasks, strict=True):
        rows = done[done.task == task]
        first = ours[ours.task == task].iloc[0]
        for name, group in rows.groupby("method_name", sort=False):
            group = group.sort_values("bits_stored")
            y = group.value * group.scale
            color = method_color(name)
            yerr = error_bars(group)
            if name == REFERENCE:
                band = "; band: its 95% interval" if yerr is not None else ""
                ax.axhline(y.iloc[0], color=color, ls="--", lw=1, label=f"{name} (16 bits{band})")
                if yerr is not None:
                    lo, hi = y.iloc[0] - yerr[0][0], y.iloc[0] + yerr[1][0]
                    ax.axhspan(lo, hi, color=color, alpha=0.12, lw=0)
            elif name in ABLATIONS:
                marker, what = ABLATIONS[name]
                ax.scatter(group.bits_stored, y, marker=marker, s=60, facecolors="none", edgecolors=color, zorder=3)
                if yerr is not None:
                    ax.errorbar(group.bits_stored, y, yerr=yerr, fmt="none", ecolor=color, capsize=3, lw=1)
                ax.plot([], [], marker=marker, ls="none", mfc="none", color=color, label=f"{name} (ablation: {what})")
            else:
                ax.errorbar(group.bits_stored, y, yerr=yerr, marker="o", color=color, label=name, capsize=3)
                for x, v, label in zip(group.bits_stored, y, group.method, strict=True):
                    ax.annotate(label, (x, v), fontsize=7, xytext=(3, 3), textcoords="offset points")
        unit = f" ×{first.scale:g}" if first.scale != 1 else ""
        ax.set_xlabel("bits stored per value (measured)")
        ax.set_ylabel(f"{first.metric}{unit}")
        ax.set_title(f"{task}: {first.metric} vs bits (bars: 95% intervals over examples)", fontsize=10)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    handles = {}
    for ax in axes[0]:
        handles |= dict(zip(*reversed(ax.get_legend_handles_labels()), strict=True))
    fig.legend(handles.values(), handles.keys(), loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=8)
    missing = list(dict.fromkeys(ours[ours.reason.notna()].method))
    if missing:
        fig.text(0.01, -0.16, f"not shown (see {stem.name}.md): {', '.join(missing)}", fontsize=7, color="#555555")
    return save_figure(fig, stem)


def error_bars(group) -> list[list[float]] | None:
    """Matplotlib's ``yerr`` (below, above) from the rows' 95% intervals: 0 for a row without one, None
    when no row has one."""
    if "value_lo" not in group or group.value_lo.isna().all():
        return None
    below, above = [], []
    for row in group.itertuples():
        has = not (missing(row.value_lo) or missing(row.value_hi))
        below.append((row.value - row.value_lo) * row.scale if has else 0.0)
        above.append((row.value_hi - row.value) * row.scale if has else 0.0)
    return [below, above]


def render(table, stem: Path) -> list[Path]:
    """``<stem>.md`` and ``<stem>.{png,pdf}`` from the CSV rows."""
    ours = table[table.source == "ours"]
    return [markdown(ours, stem), *figure(ours, stem)]


def run(cfg: DictConfig) -> dict[str, Any]:
    return run_table(cfg, NAME, render)
