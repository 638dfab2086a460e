"""experiments/table_alignedkv.py (formerly scripts/check_alignedkv.py) through run.py on stories260k."""

import json

from conftest import run_py

from experiments.figures import call_render, check_agrees, read_table
from experiments.table_alignedkv import render

SMALL = [
    "model=stories260k",
    "logger=none",
    "progress=false",
    "experiment=table_alignedkv",
    "experiment.long_context=128",
    "experiment.long_new=4",
    "experiment.prompts=2",
    "experiment.prompt_tokens=96",
    "experiment.new_tokens=16",
    "~experiment.methods",
    "+experiment.methods={fp16:{},truncation:{keep_bits:7},alignedkv:{},nope:{}}",
]


def test_fidelity_is_exact_for_fp16_lossy_for_7_bits_and_a_rerun_skips(tmp_path):
    args = [f"results_dir={tmp_path / 'out'}", f"experiment.figures_dir={tmp_path / 'fig'}", *SMALL]
    proc = run_py(tmp_path, *args, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = read_table(tmp_path / "fig" / "table_alignedkv.csv")
    rows = {r["method"]: r for r in table.to_dict(orient="records")}
    assert list(rows) == ["fp16", "truncation", "alignedkv"]
    fp16, trunc, aligned = rows["fp16"], rows["truncation"], rows["alignedkv"]
    assert fp16["greedy_match"] == fp16["before_divergence"] == 1.0 and fp16["prompts_identical"] == 2
    assert fp16["long_bits_read"] == fp16["bits_read"] == 16.0 and fp16["long_k16"] == 1.0
    assert trunc["greedy_match"] < 1.0 and trunc["prompts_identical"] < 2
    assert trunc["long_bits_read_k"] == trunc["long_bits_read_v"] == 7.0 and trunc["long_v7"] == 1.0
    assert 8.0 < aligned["long_bits_read"] < 16.0
    assert abs(sum(aligned[f"long_k{w}"] for w in (8, 12, 16)) - 1.0) < 1e-9

    (path,) = (tmp_path / "out").rglob("results.json")
    results = json.loads(path.read_text())
    check_agrees(table, results["table"], "table_alignedkv")
    assert "unknown method 'nope'" in results["experiment"]["skipped"]["nope"]
    text = (tmp_path / "fig" / "table_alignedkv.md").read_text()
    assert text.startswith("## Bits read: stories260k 128-token WikiText-2 prompt + 4 greedy tokens")
    assert "| fp16 | 1.0000 | 1.0000 | 2/2 | 16.00 |" in text and "| nope | skipped: unknown method" in text
    # make figures redraws the same table from the CSV and results.json alone
    assert call_render(render, table, tmp_path / "again" / "table_alignedkv", results)[0].read_text() == text

    proc = run_py(tmp_path, *args, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and "skip: results for this config already exist" in proc.stdout
    assert len(list((tmp_path / "out").rglob("results.json"))) == 1
