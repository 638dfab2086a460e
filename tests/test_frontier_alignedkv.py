"""experiments/frontier_alignedkv.py through run.py, at a size that fits a test."""

import csv
import os
import subprocess
import sys

from conftest import ROOT


def test_frontier_writes_csv_and_plot(tmp_path):
    args = [
        sys.executable,
        str(ROOT / "run.py"),
        "experiment=frontier_alignedkv",
        "model=stories260k",
        "logger=none",
        "progress=false",
        f"results_dir={tmp_path / 'out'}",
        f"experiment.figures_dir={tmp_path / 'fig'}",
        "experiment.contexts=[160]",
        "experiment.prompts=1",
        "experiment.new_tokens=6",
        "experiment.keep=[9,16]",
        "experiment.margins=[0,2]",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["label"]: r for r in csv.DictReader(open(tmp_path / "fig" / "frontier_alignedkv.csv"))}
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
    assert (tmp_path / "fig" / "frontier_alignedkv.png").stat().st_size > 10_000
