"""experiments/table_ruler.py through run.py on stories260k: one run per method, every RULER number of it a
row equal to its results.json (value, interval, paired difference, n), the Markdown from the CSV alone."""

import json
import math

import pandas as pd
import pytest
from conftest import run_experiment

from experiments.cells import fmt_ci
from experiments.table_ruler import metric_order, render

GRID = [
    "experiment=table_ruler",
    "~experiment.methods",
    "+experiment.methods={fp16:{},kivi2:{group_size:8,residual:32},aquakv:{}}",
    "experiment.task.subtasks=[niah_single_1,niah_multikey_2]",
    "experiment.task.lengths=[512]",
    "experiment.task.n=2",
]
METRICS = ["niah_single_1_512", "niah_multikey_2_512", "len_512", "ruler_avg"]


def test_metric_order_puts_cells_before_means():
    given = ["niah_single_1_1024", "vt_1024", "vt_2048", "niah_single_1", "vt", "len_1024", "len_2048", "ruler_avg"]
    assert metric_order(given) == ["niah_single_1_1024", "vt_1024", "vt_2048", "len_1024", "len_2048", "ruler_avg"]


def test_ruler_table_equals_its_runs_and_reuses_them(tmp_path, monkeypatch):
    monkeypatch.setenv("KVQUANT_PREDICTOR_DIR", str(tmp_path / "no-predictors"))
    fig = run_experiment(tmp_path, *GRID)
    table = pd.read_csv(fig / "table_ruler.csv")
    done = table[table.status == "computed"]
    assert list(done.method) == ["fp16"] * 4 + ["kivi2"] * 4 and list(done.task) == METRICS * 2
    assert len(set(done.results)) == 2  # one evaluate run per method, every number of it a row
    for row in done.itertuples():
        data = json.loads((tmp_path / row.results).read_text())
        assert data["task"]["name"] == "ruler" and data["method"]["name"] == row.method_name
        assert float(row.value) == data["metrics"][row.task] and row.n == data["n"][f"metrics/{row.task}"]
        assert row.n == (2 if row.task.startswith("niah") else 4) and row.examples == 4
        assert [row.value_lo, row.value_hi] == data["ci95"][f"metrics/{row.task}"]
        if row.method == "kivi2":
            fp16 = done[(done.method == "fp16") & (done.task == row.task)].value.item()
            assert row.paired == pytest.approx(row.value - fp16)
            assert [row.paired_lo, row.paired_hi] == data["ci95"][f"paired/{row.task}"]
            assert row.kl == data["fidelity"]["kl"] > 0
        else:
            assert math.isnan(row.paired) and math.isnan(row.kl)
    [skipped] = table[table.status == "skipped"].itertuples()
    assert skipped.method == "aquakv" and "calibrate first: python run.py experiment=calibrate" in skipped.reason

    text = (fig / "table_ruler.md").read_text()
    kivi = done[done.method == "kivi2"].set_index("task")
    scores, paired = text.split("## Difference to fp16")
    lines = {line.split(" | ")[0][2:]: line[2:-2].split(" | ")[1:] for line in scores.splitlines() if line[:2] == "| "}
    cell = kivi.loc["niah_single_1_512"]
    assert lines["niah_single_1_512"][:2] == [
        fmt_ci(done.value.iloc[0], done.value_lo.iloc[0], done.value_hi.iloc[0], 1),
        fmt_ci(cell.value, cell.value_lo, cell.value_hi, 1),
    ]
    assert lines["niah_single_1_512"][2].startswith("skipped [1]") and "calibrate first: python run.py" in text
    assert (
        "| **ruler_avg** | "
        + fmt_ci(kivi.loc["ruler_avg"].paired, *kivi.loc["ruler_avg"][["paired_lo", "paired_hi"]], 1, sign=True)
        in paired
    )
    assert f"| kivi2 | 4 | {fmt_ci(cell.greedy_match, cell.greedy_match_lo, cell.greedy_match_hi, 3)} |" in text
    assert f"| {cell.bits_stored:.3f} | {cell.bits_read:.3f} |" in text and cell.bits_stored < 16
    assert (fig / "table_ruler.md").read_text() == render(table, tmp_path / "again" / "t")[0].read_text()

    stamps = {p: (tmp_path / p).stat().st_mtime_ns for p in set(done.results)}
    again = pd.read_csv(run_experiment(tmp_path, *GRID, "rerun=true") / "table_ruler.csv")
    assert set(again[again.status == "reused"].results) == set(done.results)
    assert {p: (tmp_path / p).stat().st_mtime_ns for p in stamps} == stamps
