"""experiments/frontier_alignedkv.py through run.py, at a size that fits a test."""

import csv
import json

from conftest import run_experiment

from experiments.figures import check_agrees, read_table


def test_frontier_writes_csv_and_plot(tmp_path):
    fig = run_experiment(
        tmp_path,
        "experiment=frontier_alignedkv",
        "experiment.contexts=[160]",
        "experiment.prompts=1",
        "experiment.new_tokens=6",
        "experiment.keep=[9,16]",
        "experiment.margins=[0,2]",
    )
    rows = {r["label"]: r for r in csv.DictReader(open(fig / "frontier_alignedkv.csv"))}
    assert set(rows) == {
        "truncation keep=9",
        "truncation keep=16",
        "alignedkv margin=0",
        "alignedkv margin=2",
        "alignedkv_plus margin=0",
        "alignedkv_plus margin=2",
    }
    full = rows["truncation keep=16"]
    assert float(full["kl"]) == 0.0 and float(full["greedy_match"]) == 1.0 and float(full["qk =0"]) == 1.0
    assert float(rows["truncation keep=9"]["bits_read"]) == 9.0
    for label in ("alignedkv margin=0", "alignedkv_plus margin=0"):
        assert float(rows[label]["bits_read"]) < float(rows[label.replace("=0", "=2")]["bits_read"]) < 16.5
    assert (fig / "frontier_alignedkv.png").stat().st_size > 10_000 and (fig / "frontier_alignedkv.pdf").is_file()
    results = json.loads(next((tmp_path / "out").rglob("results.json")).read_text())
    check_agrees(read_table(fig / "frontier_alignedkv.csv"), results["table"], "frontier_alignedkv")
