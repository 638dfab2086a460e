"""experiments/fig_bitwidth.py through run.py on stories260k."""

import csv
import json

from conftest import run_experiment

from experiments.figures import check_agrees, read_table


def test_bitwidth_figure_and_table(tmp_path):
    fig = run_experiment(
        tmp_path,
        "experiment=fig_bitwidth",
        "experiment.contexts=[128,320,600]",
        "experiment.decode_steps=3",
        "experiment.methods=[alignedkv]",
    )
    rows = list(csv.DictReader(open(fig / "fig_bitwidth.csv")))
    overall = [r for r in rows if r["layer"] == "all"]
    assert [int(r["context"]) for r in overall] == [128, 320]  # 600 is past stories260k's 512 tokens
    assert len(rows) == 2 * (1 + 5)  # overall + 5 layers per context
    for r in overall:
        shares = sum(float(r[f"{side}{w}"]) for side in "kv" for w in (8, 12, 16))
        assert abs(shares - 2.0) < 1e-9
        assert 8.0 <= float(r["bits_read_v"]) < float(r["bits_read_k"]) <= 16.0
    assert (fig / "fig_bitwidth.png").stat().st_size > 10_000 and (fig / "fig_bitwidth.pdf").is_file()
    results = json.loads(next((tmp_path / "out").rglob("results.json")).read_text())
    assert len(results["table"]) == len(rows)  # every row, per layer too, not only the overall ones
    check_agrees(read_table(fig / "fig_bitwidth.csv"), results["table"], "fig_bitwidth")
    assert "bits_read_with_metadata" not in results["table"][1]  # a per-layer row: NaN cells are left out
