"""experiments/table_tasks.py through run.py on stories260k: numbers (and their intervals) equal their cells,
cells are reused."""

import json
import math

import pandas as pd
import pytest
from conftest import run_experiment

from experiments.cells import fmt_ci
from experiments.table_tasks import PUBLISHED, PUBLISHED_SOURCE, render

GRID = [
    "experiment=table_tasks",
    "~experiment.methods",
    "+experiment.methods={fp16:{backend:torch},kivi2:{group_size:8,residual:32},truncation:{keep_bits:11},aquakv:{}}",
    "~experiment.tasks",
    "+experiment.tasks={coqa:{limit:1},gsm8k:{limit:1,max_gen_toks:12},truthfulqa_mc2:{limit:2},"
    "wikitext:{limit:2,window:160}}",
]
FIDELITY = ["greedy_match", "first_divergence", "kl", "top1_agreement", "answer_agreement"]


def same(csv_value, json_value):
    if json_value is None:
        return csv_value is None or (isinstance(csv_value, float) and math.isnan(csv_value))
    return float(csv_value) == float(json_value)


def markdown_rows(text: str) -> dict[str, list[str]]:
    """The first Markdown table: row label → cells."""
    table = text.split("\n\n")[1].splitlines()[2:]
    return {line.split(" | ")[0][2:]: line[2:-2].split(" | ")[1:] for line in table}


def test_task_table_equals_its_cells_and_reuses_them(tmp_path, monkeypatch):
    monkeypatch.setenv("KVQUANT_PREDICTOR_DIR", str(tmp_path / "no-predictors"))
    fig = run_experiment(tmp_path, *GRID)
    table = pd.read_csv(fig / "table_tasks.csv")
    ours, theirs = table[table.source == "ours"], table[table.source != "ours"]
    assert len(ours) == 4 * 4 and list(dict.fromkeys(ours.task)) == ["coqa", "gsm8k", "truthfulqa_mc2", "wikitext"]

    done = ours[ours.status == "computed"]
    assert len(done) == 3 * 3  # coqa is offline, aquakv has no predictors
    by = done.set_index(["method", "task"])
    for row in done.itertuples():
        data = json.loads((tmp_path / row.results).read_text())  # relative to where run.py ran
        assert data["config_hash"] == row.config_hash and data["method"]["name"] == row.method_name
        assert same(row.value, data["metrics"][row.metric]) and row.n == data["task"]["n"]
        assert same(row.bits_stored, data["bits"]["stored"]) and same(row.bits_read, data["bits"]["read"])
        assert same(row.wall_s, data["timing"]["wall_s"])
        for key in FIDELITY:
            assert same(getattr(row, key), data.get("fidelity", {}).get(key)), (row.method, row.task, key)
        if row.task == "gsm8k":  # evaluate wrote the per-example outputs into the cell's folder
            assert data["examples"] == {"file": "examples.jsonl", "n": 1}
            assert (tmp_path / row.results).with_name("examples.jsonl").is_file()
        # every number carries n; from two examples on, its interval, which holds it
        assert data["n"][f"metrics/{row.metric}"] == row.n == (2 if row.task in ("truthfulqa_mc2", "wikitext") else 1)
        assert all(data["n"][f"fidelity/{k}"] == row.n for k in data.get("fidelity", {}))
        if row.n < 2:
            assert "ci95" not in data and math.isnan(row.value_lo) and math.isnan(row.paired_lo)
            continue
        assert [row.value_lo, row.value_hi] == data["ci95"][f"metrics/{row.metric}"]
        assert row.value_lo <= row.value <= row.value_hi
        for key, value in data.get("fidelity", {}).items():
            lo, hi = data["ci95"][f"fidelity/{key}"]
            assert same(getattr(row, f"{key}_lo"), lo) and lo <= value <= hi
        if row.method != "fp16":  # the paired difference to fp16 on the same examples
            fp16 = json.loads((tmp_path / by.loc[("fp16", row.task)].results).read_text())
            assert row.paired == pytest.approx(row.value - fp16["metrics"][row.metric])
            assert row.paired_lo <= row.paired <= row.paired_hi and data["n"][f"paired/{row.metric}"] == 2
    assert by.loc[("fp16", "wikitext")].bits_stored == 16 and math.isnan(by.loc[("fp16", "wikitext")].kl)
    assert by.loc[("kivi2", "wikitext")].kl > by.loc[("truncation", "wikitext")].kl > 0
    assert by.loc[("truncation", "gsm8k")].bits_read == 11 and by.loc[("kivi2", "gsm8k")].bits_stored < 16
    assert by.loc[("kivi2", "wikitext")].value > by.loc[("fp16", "wikitext")].value  # 2-bit keys cost perplexity

    skipped = ours[ours.status == "skipped"].set_index(["method", "task"])
    assert len(skipped) == 4 + 3 and skipped.value.isna().all()
    assert skipped.loc[("fp16", "coqa")].reason.startswith("task coqa needs the hub dataset")
    assert (
        "calibrate first: python run.py experiment=calibrate method=aquakv" in skipped.loc[("aquakv", "gsm8k")].reason
    )

    # KIVI's Llama-2-7B numbers, labelled as theirs, only in the columns they published (not mc2, not ppl).
    assert set(theirs.source) == {PUBLISHED_SOURCE} and set(theirs.status) == {"published"}
    assert set(zip(theirs.method, theirs.task, theirs.value, strict=True)) == {
        (m, t, PUBLISHED[m][t]) for m in PUBLISHED for t in ("coqa", "gsm8k")
    }

    text = (fig / "table_tasks.md").read_text()
    rows = markdown_rows(text)
    notes = {line.split("] ", 1)[1]: line.split("]")[0] + "]" for line in text.splitlines() if line.startswith("[")}
    for row in ours.itertuples():
        col = ["coqa", "gsm8k", "truthfulqa_mc2", "wikitext"].index(row.task)
        shown = f"skipped {notes[row.reason]}" if row.status == "skipped" else f"{row.value * row.scale:.2f}"
        if row.n == 2:
            shown += f" [{row.value_lo * row.scale:.2f}, {row.value_hi * row.scale:.2f}]"
        assert rows[row.method][col] == shown
    assert rows[f"kivi2, {PUBLISHED_SOURCE}"] == ["63.05", "12.74", "", ""]
    assert (
        "gsm8k: exact_match_strict ×100" in text
        and f"| kivi2 | wikitext | 2 | – | – | {by.loc[('kivi2', 'wikitext')].kl:.4f} [" in text
    )
    kivi = by.loc[("kivi2", "wikitext")]
    paired = markdown_rows(text.split("## Difference to fp16")[1])  # method − fp16 with its interval
    expected = fmt_ci(kivi.paired, kivi.paired_lo, kivi.paired_hi, sign=True)
    assert paired["kivi2"][0] == "–" and paired["kivi2"][3].removesuffix(" *") == expected
    assert "fp16" not in paired and "aquakv" not in paired
    assert (tmp_path / "fig" / "table_tasks.md").read_text() == render(table, tmp_path / "again" / "t")[0].read_text()

    [run] = [p for p in (tmp_path / "out" / "runs").glob("*/*/results.json")]
    records = json.loads(run.read_text())["table"]
    assert [r["value"] for r in records if r["status"] == "computed"] == list(done.value)
    for rec, row in zip(records, table.to_dict(orient="records"), strict=True):  # results.json "table" = the CSV
        assert rec == {k: v for k, v in row.items() if not (isinstance(v, float) and math.isnan(v))}
    cells = {"computed": 9, "reused": 0, "skipped": 7, "pending": 0}
    assert json.loads(run.read_text())["experiment"]["cells"] == cells

    # Again (rerun=true recomputes the table, not its cells): every finished cell is read back, untouched.
    stamps = {p: (tmp_path / p).stat().st_mtime_ns for p in done.results}
    again = pd.read_csv(run_experiment(tmp_path, *GRID, "rerun=true") / "table_tasks.csv")
    redone = again[again.source == "ours"].set_index(["method", "task"])
    assert set(redone[redone.status == "reused"].results) == set(done.results)
    assert (redone.loc[by.index].value == by.value).all()
    assert {p: (tmp_path / p).stat().st_mtime_ns for p in done.results} == stamps

    # experiment.compute=false: the finished part of a longer table, the rest pending (nothing computed)
    more = [g.replace("aquakv:{}}", "aquakv:{},gear2:{}}") for g in GRID]
    partial = pd.read_csv(run_experiment(tmp_path, *more, "experiment.compute=false") / "table_tasks.csv")
    shown = partial[partial.source == "ours"].set_index(["method", "task"])
    assert (shown.loc[by.index].status == "reused").all() and (shown.loc[by.index].value == by.value).all()
    gear = shown.loc["gear2"]
    assert len(gear) == 4 and set(gear.status) == {"pending"} and gear.value.isna().all() and gear.n.isna().all()
    assert gear.reason.str.startswith("not computed yet").all() and not list((tmp_path / "out").rglob("gear2_*"))
    assert all(
        c.startswith("pending [") for c in markdown_rows((tmp_path / "fig" / "table_tasks.md").read_text())["gear2"]
    )
