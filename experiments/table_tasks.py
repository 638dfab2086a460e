"""The task table (paper artefact 4): methods × CoQA, TruthfulQA, GSM8K, LongBench, passkey, perplexity.

Every cell is one ``experiment=evaluate`` run (``experiments/cells.py``: reused when its results.json
exists, skipped with its reason when it cannot run), so each number carries the fidelity to fp16
measured on the same prompts. KIVI's published Llama-2-7B numbers sit beside ours in rows labelled
as theirs. Writes ``table_tasks.csv`` (one row per cell, plus the published rows) and
``table_tasks.md``; ``render`` rebuilds the Markdown from the CSV alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from experiments.cells import fmt, footnotes, run_table

NAME = "table_tasks"
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


def _cell_text(row, notes: dict[str, int]) -> str:
    if isinstance(row.reason, str):
        return f"{'skipped' if row.status == 'skipped' else '–'} [{notes[row.reason]}]"
    return fmt(row.value * row.scale)


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
        "Small n: read the fidelity table below, which is meaningful at any model size.",
        *(["", *note_lines] if note_lines else []),
        "",
        "## Fidelity to fp16 (same prompts; fp16 is the reference)",
        "",
        "| method | task | " + " | ".join(FIDELITY_HEAD.values()) + " |",
        "|---" * (2 + len(FIDELITY_HEAD)) + "|",
    ]
    for row in ours[ours.status != "skipped"].itertuples():
        values = [str(int(row.n)) if row.n == row.n else "–"]
        values += [fmt(getattr(row, k), 4 if k in ("kl",) else 3) for k in list(FIDELITY_HEAD)[1:-1]]
        values.append(fmt(row.wall_s, 1))
        lines.append(f"| {row.method} | {row.task} | " + " | ".join(values) + " |")
    path = stem.with_suffix(".md")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return [path]


def run(cfg: DictConfig) -> dict[str, Any]:
    return run_table(cfg, NAME, render, published_rows)
