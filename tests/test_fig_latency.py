"""experiments/fig_latency.py through run.py, tiny."""

import csv
import os
import subprocess
import sys

from conftest import ROOT


def test_latency_rows_and_ratios(tmp_path):
    args = [
        sys.executable,
        str(ROOT / "run.py"),
        "experiment=fig_latency",
        "model=stories260k",
        "logger=none",
        "progress=false",
        f"results_dir={tmp_path / 'out'}",
        f"experiment.figures_dir={tmp_path / 'fig'}",
        "experiment.contexts=[128,320]",
        "experiment.repeats=1",
        "experiment.methods=[alignedkv,truncation]",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader(open(tmp_path / "fig" / "fig_latency.csv")))
    assert [(r["method"], r["context"]) for r in rows] == [
        (m, c) for c in ("128", "320") for m in ("fp16", "alignedkv", "truncation")
    ]
    assert all(float(r["ms"]) > 0 for r in rows)
    assert all(float(r["ratio_to_fp16"]) == 1.0 for r in rows if r["method"] == "fp16")
    assert all(float(r["bits_read"]) == 13.0 for r in rows if r["method"] == "truncation")
    assert all(8.0 < float(r["bits_read"]) < 16.5 for r in rows if r["method"] == "alignedkv")
