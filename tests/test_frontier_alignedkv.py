"""experiments/frontier_alignedkv.py through run.py, at a size that fits a test."""

import csv
import json

import pytest
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
        "experiment.v_blocks={alignedkv:[1,64],alignedkv_plus:[1,64],alignedkv_block:[16,64],alignedkv_plus_block:[16]}",
    )
    rows = {r["label"]: r for r in csv.DictReader(open(fig / "frontier_alignedkv.csv"))}
    assert set(rows) == {
        "truncation keep=9",
        "truncation keep=16",
        "alignedkv margin=0",
        "alignedkv margin=2",
        "alignedkv_plus margin=0",
        "alignedkv_plus margin=2",
        "alignedkv v_block=1",
        "alignedkv v_block=64",
        "alignedkv_plus v_block=1",
        "alignedkv_plus v_block=64",
        "alignedkv_block margin=0",
        "alignedkv_block margin=2",
        "alignedkv_block v_block=16",
        "alignedkv_block v_block=64",
        "alignedkv_plus_block margin=0",
        "alignedkv_plus_block margin=2",
        "alignedkv_plus_block v_block=16",
    }
    for rule in ("alignedkv", "alignedkv_plus"):  # v_block=1 is margin=0, computed once
        paper, block = rows[f"{rule} v_block=1"], rows[f"{rule} v_block=64"]
        assert {k: v for k, v in paper.items() if k not in ("rule", "param", "label")} == {
            k: v for k, v in rows[f"{rule} margin=0"].items() if k not in ("rule", "param", "label")
        }
        assert paper["rule"] == block["rule"] == f"{rule} v_block" and float(block["v_block"]) == 64
        assert float(paper["bits_read_v"]) < float(block["bits_read_v"]) < 16.5
        assert float(paper["bits_read_k"]) == float(block["bits_read_k"]) or rule == "alignedkv_plus"
    paper, bound = rows["alignedkv margin=0"], rows["alignedkv_block margin=0"]  # the block rule's default v_block 32
    assert float(bound["v_block"]) == 32 and float(bound["bits_read_k"]) == float(paper["bits_read_k"])
    for label in ("alignedkv_block margin=0", "alignedkv_block v_block=16", "alignedkv_block v_block=64"):
        # every token of a block reads at least the paper rule's bits (measured here: more, on every row)
        assert float(paper["bits_read_v"]) < float(rows[label]["bits_read_v"]) <= 16.5, label
    assert rows["alignedkv_block v_block=16"]["rule"] == "alignedkv_block v_block"
    assert float(rows["alignedkv_plus_block v_block=16"]["bits_read_v"]) > float(paper["bits_read_v"])
    assert rows["truncation keep=9"]["v_block"] == "" and float(rows["alignedkv margin=2"]["v_block"]) == 1
    full = rows["truncation keep=16"]
    assert float(full["kl"]) == 0.0 and float(full["greedy_match"]) == 1.0 and float(full["qk =0"]) == 1.0
    assert float(rows["truncation keep=9"]["bits_read"]) == 9.0
    for label in ("alignedkv margin=0", "alignedkv_plus margin=0"):
        assert float(rows[label]["bits_read"]) < float(rows[label.replace("=0", "=2")]["bits_read"]) < 16.5
    for row in rows.values():  # one timed decode step per point on stories260k's shape, beside fp16's
        assert float(row["attention_ms"]) > 0 and row["backend"] in ("cpu", "torch")
        assert float(row["ideal_x_fp16"]) == pytest.approx(float(row["attention_bits_read"]) / 16)
    assert float(rows["truncation keep=16"]["attention_bits_read"]) == 16.0
    assert (fig / "frontier_alignedkv.png").stat().st_size > 10_000 and (fig / "frontier_alignedkv.pdf").is_file()
    results = json.loads(next((tmp_path / "out").rglob("results.json")).read_text())
    check_agrees(read_table(fig / "frontier_alignedkv.csv"), results["table"], "frontier_alignedkv")
