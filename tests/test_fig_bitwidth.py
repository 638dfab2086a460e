"""experiments/fig_bitwidth.py through run.py on stories260k."""

import csv
import os
import subprocess
import sys

from conftest import ROOT


def test_bitwidth_figure_and_table(tmp_path):
    args = [
        sys.executable,
        str(ROOT / "run.py"),
        "experiment=fig_bitwidth",
        "model=stories260k",
        "logger=none",
        "progress=false",
        f"results_dir={tmp_path / 'out'}",
        f"experiment.figures_dir={tmp_path / 'fig'}",
        "experiment.contexts=[128,320,600]",
        "experiment.decode_steps=3",
        "experiment.methods=[alignedkv]",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader(open(tmp_path / "fig" / "fig_bitwidth.csv")))
    overall = [r for r in rows if r["layer"] == "all"]
    assert [int(r["context"]) for r in overall] == [128, 320]  # 600 is past stories260k's 512 tokens
    assert len(rows) == 2 * (1 + 5)  # overall + 5 layers per context
    for r in overall:
        shares = sum(float(r[f"{side}{w}"]) for side in "kv" for w in (8, 12, 16))
        assert abs(shares - 2.0) < 1e-9
        assert 8.0 <= float(r["bits_read_v"]) < float(r["bits_read_k"]) <= 16.0
    assert (tmp_path / "fig" / "fig_bitwidth.png").stat().st_size > 10_000
