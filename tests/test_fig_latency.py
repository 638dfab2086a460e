"""experiments/fig_latency.py through run.py, tiny."""

import csv
import json

from conftest import run_experiment

from experiments.figures import check_agrees, read_table


def test_latency_rows_and_ratios(tmp_path):
    fig = run_experiment(
        tmp_path,
        "experiment=fig_latency",
        "experiment.contexts=[128,320]",
        "experiment.repeats=1",
        "experiment.methods=[alignedkv,truncation]",
    )
    rows = list(csv.DictReader(open(fig / "fig_latency.csv")))
    assert [(r["method"], r["context"]) for r in rows] == [
        (m, c) for c in ("128", "320") for m in ("fp16", "alignedkv", "truncation")
    ]
    assert all(float(r["ms"]) > 0 for r in rows)
    assert all(float(r["ratio_to_fp16"]) == 1.0 for r in rows if r["method"] == "fp16")
    assert all(float(r["bits_read"]) == 13.0 for r in rows if r["method"] == "truncation")
    assert all(8.0 < float(r["bits_read"]) < 16.5 for r in rows if r["method"] == "alignedkv")
    results = json.loads(next((tmp_path / "out").rglob("results.json")).read_text())
    check_agrees(read_table(fig / "fig_latency.csv"), results["table"], "fig_latency")
    assert results["experiment"]["shape_label"] == "smollm2_135m shape (9q/3kv×64)"
    assert (fig / "fig_latency.png").stat().st_size > 10_000 and (fig / "fig_latency.pdf").is_file()
