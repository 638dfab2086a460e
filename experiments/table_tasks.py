"""The task table (paper artefact 4): methods × CoQA, TruthfulQA, GSM8K, LongBench, passkey, perplexity.

Every cell is one ``experiment=evaluate`` run (``experiments/cells.py``: reused when its results.json
exists, skipped with its reason when it cannot run), so each number carries the fidelity to fp16
measured on the same prompts. KIVI's published Llama-2-7B numbers sit beside ours in rows labelled
as theirs. Writes ``table_tasks.csv`` (one row per cell, plus the published rows) and
``table_tasks.md``; ``render`` rebuilds the Markdown from the CSV alone. Every number of ours is
shown with its 95% bootstrap interval over examples where the cell has one (n ≥ 2), and a table of
paired differences to fp16 marks the ones whose interval excludes 0 (the only ones that say a
method scores differently from fp16 at that n).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from experiments.cells import DONE, FIDELITY, excludes_zero, fmt, fmt_ci, footnotes, run_table
from experiments.figures import write_markdown
from kvquant.eval.intervals import MIN_N_CLAIM

NAME = "table_tasks"
RESUME = "cells"  # run.py: the table always runs; each cell is reused by its identity (experiments/cells.py)
PUBLISHED_SOURCE = "published (Llama-2-7B, KIVI paper)"
PUBLISHED_MODEL = "llama2_7b"
# ../shared/SPEC.md "Published numbers": KIVI (G=32, R=128) on Llama-2-7B, in the paper's units (%).
PUBLISHED: dict[str, dict[str, float]] = {
    "fp16": {"coqa": 63.88, "truthfulqa_gen": 30.76, "gsm8k": 13.50, "longbench": 44.52},
    "kivi4": {"coqa": 63.78, "truthfulqa_gen": 30.80, "gsm8k": 13.80, "longbench": 44.59},
    "kivi2": {"coqa": 63.05, "truthfulqa_gen": 33.95, "gsm8k": 12.74, "longbench": 44.27},
}
FIDELITY_HEAD = {
    "n": "n",
    "greedy_match": "greedy match",
    "first_divergence": "first divergence",
    "kl": "KL (nats)",
    "top1_agreement": "top-1 agreement",
    "answer_agreement": "answer agreement",
    "bits_stored": "bits stored",
    "bits_read": "bits read",
    "wall_s": "wall (s)",
}


def published_rows(ours: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """KIVI's numbers, one row per (method, task column) the table has a published number for."""
    columns = {r["task"]: r["task_name"] for r in ours}
    rows = []
    for method, by_task in PUBLISHED.items():
        for label, task_name in columns.items():
            if task_name in by_task:
                rows.append(
                    {
                        "source": PUBLISHED_SOURCE,
                        "model": PUBLISHED_MODEL,
                        "method": method,
                        "method_name": method,
                        "task": label,
                        "task_name": task_name,
                        "status": "published",
                        "metric": "as published",
                        "value": by_task[task_name],
                        "scale": 1.0,
                    }
                )
    return rows


def col(row, name: str):
    """``row.<name>``, None in a CSV written before that column existed (intervals, paired differences)."""
    return getattr(row, name, None)


def _cell_text(row, notes: dict[str, int]) -> str:
    if isinstance(row.reason, str):
        return f"{row.status if row.status in ('skipped', 'pending') else '–'} [{notes[row.reason]}]"
    return fmt_ci(row.value, col(row, "value_lo"), col(row, "value_hi"), scale=row.scale)


def _paired_text(row) -> str:
    lo, hi = col(row, "paired_lo"), col(row, "paired_hi")
    text = fmt_ci(col(row, "paired"), lo, hi, scale=row.scale, sign=True)
    return text + (" *" if excludes_zero(lo, hi, row.n) else "")


def paired_lines(ours, tasks: list[str]) -> list[str]:
    """Method − fp16 on the same examples, per task, with the paired interval (fp16 and cells without
    results left out)."""
    done = ours[(ours.method_name != "fp16") & ours.status.isin(DONE)]
    if not len(done) or "paired" not in done or done.paired.isna().all():  # a CSV from before paired differences
        return []
    lines = [
        "",
        "## Difference to fp16 (paired: the same examples, 95% bootstrap interval)",
        "",
        "| method | " + " | ".join(tasks) + " |",
        "|---" * (1 + len(tasks)) + "|",
    ]
    for method in dict.fromkeys(done.method):
        rows = done[done.method == method].set_index("task")
        cells = [_paired_text(rows.loc[t]) if t in rows.index else "–" for t in tasks]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines + [
        "",
        f"\\* the interval excludes 0 and n ≥ {MIN_N_CLAIM}: the method's score differs from fp16's beyond "
        "resampling noise; elsewhere this n cannot tell it from fp16's (below that n the bootstrap interval is "
        "too narrow to trust; no interval: no stratum with 2 examples, or a results.json from before intervals).",
    ]


def render(table, stem: Path) -> list[Path]:
    """``<stem>.md`` from the CSV rows: scores (methods × tasks, published rows labelled), then fidelity."""
    ours = table[table.source == "ours"]
    published = table[table.source != "ours"]
    tasks = list(dict.fromkeys(table.task))
    notes, note_lines = footnotes(ours)
    heads = []
    for task in tasks:
        first = ours[ours.task == task].iloc[0]
        unit = f" ×{first.scale:g}" if first.scale != 1 else ""
        heads.append(f"{task}: {first.metric}{unit}")
    models = ", ".join(dict.fromkeys(ours.model.dropna())) or "?"
    lines = [
        f"# Task scores, {models} (ours) vs {PUBLISHED_SOURCE}",
        "",
        "| method | " + " | ".join(heads) + " |",
        "|---" * (1 + len(tasks)) + "|",
    ]
    for method in dict.fromkeys(ours.method):
        rows = ours[ours.method == method].set_index("task")
        cells = [_cell_text(rows.loc[t], notes) if t in rows.index else "–" for t in tasks]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    for method in dict.fromkeys(published.method):
        rows = published[published.method == method].set_index("task")
        cells = [fmt(rows.loc[t].value) if t in rows.index else "" for t in tasks]
        label = f"{method}, {rows.source.iloc[0]}"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    n_by_task = {t: ours[(ours.task == t) & ours.n.notna()].n for t in tasks}
    lines += [
        "",
        "n (examples per cell): " + ", ".join(f"{t} {int(n.max())}" for t, n in n_by_task.items() if len(n)) + ".",
        f"The {PUBLISHED_SOURCE} rows are their numbers on their model and full task sets, not ours; "
        "our metric per column is in its header (×100: a fraction shown as %). "
        "Small n: read the fidelity table below, which is meaningful at any model size. "
        "Brackets: 95% percentile-bootstrap interval over examples (fixed seed); none where no stratum has 2 examples "
        "(n < 2; LongBench resamples within its tasks and holds a one-example task fixed); zero width "
        "where every example scored the same (the bootstrap sees no spread: for 0 of n read 3/n as the bound).",
        *(["", *note_lines] if note_lines else []),
        *paired_lines(ours, tasks),
        "",
        *fidelity_head("same prompts", ["method", "task"]),
    ]
    for row in ours[ours.status.isin(DONE)].itertuples():
        lines.append(f"| {row.method} | {row.task} | " + " | ".join(fidelity_values(row, row.n)) + " |")
    return [write_markdown(stem, lines)]


def fidelity_head(prompts: str, keys: list[str]) -> list[str]:
    """The heading and header rows of a fidelity table: ``keys`` (method, task, …), then ``FIDELITY_HEAD``."""
    return [
        f"## Fidelity to fp16 ({prompts}; fp16 is the reference)",
        "",
        "| " + " | ".join([*keys, *FIDELITY_HEAD.values()]) + " |",
        "|---" * (len(keys) + len(FIDELITY_HEAD)) + "|",
    ]


def fidelity_values(row, n: Any, wall_digits: int = 1) -> list[str]:
    """A fidelity table row (``FIDELITY_HEAD``'s columns): n, each fidelity number with its interval, bits, time."""
    values = [str(int(n)) if n is not None and n == n else "–"]
    for key in list(FIDELITY_HEAD)[1:-1]:
        digits = 4 if key == "kl" else 3
        if key in FIDELITY:
            values.append(fmt_ci(getattr(row, key), col(row, f"{key}_lo"), col(row, f"{key}_hi"), digits))
        else:
            values.append(fmt(getattr(row, key), digits))
    return values + [fmt(row.wall_s, wall_digits)]


def run(cfg: DictConfig) -> dict[str, Any]:
    return run_table(cfg, NAME, render, published_rows)
