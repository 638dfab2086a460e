"""experiments/table_relerr.py through run.py on stories260k."""

import csv
import json

from conftest import run_experiment

from experiments.figures import check_agrees, read_table


def test_relerr_table_lists_every_method(tmp_path):
    fig = run_experiment(
        tmp_path,
        "experiment=table_relerr",
        "experiment.prompts=1",
        "experiment.context=300",
        "+experiment.methods.kivi2.group_size=8",
        "+experiment.methods.kivi2.residual=32",
    )
    rows = {r["method"]: r for r in csv.DictReader(open(fig / "table_relerr.csv"))}
    assert {"alignedkv", "truncation", "kivi2"} <= set(rows)
    for r in rows.values():
        assert abs(sum(float(v) for k, v in r.items() if k.startswith("qk ")) - 1.0) < 1e-9
    assert float(rows["alignedkv"]["qk =0"]) > float(rows["truncation"]["qk =0"])
    assert float(rows["kivi2"]["sv >1e-2"]) > float(rows["alignedkv"]["sv >1e-2"])  # 2-bit values are coarse
    text = (fig / "table_relerr.md").read_text()
    assert "| gear2 | " in text and "skipped" not in text  # GEAR's default group of 64 adapts to head_dim 8
    assert text.startswith("Relative error of decode-step results (share of elements per bucket), stories260k, 1 × 300")
    results = json.loads(next((tmp_path / "out").rglob("results.json")).read_text())
    check_agrees(read_table(fig / "table_relerr.csv"), results["table"], "table_relerr")
