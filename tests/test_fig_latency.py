"""experiments/fig_latency.py through run.py, tiny."""

import csv
import json

import pytest
from conftest import run_experiment, run_py

from experiments.figures import check_agrees, read_table


def test_latency_rows_and_ratios(tmp_path):
    fig = run_experiment(
        tmp_path,
        "experiment=fig_latency",
        "experiment.shapes=[smollm2_135m]",
        "experiment.contexts.smollm2_135m=[128,320]",
        "experiment.repeats=1",
        "experiment.backend=torch",
        "experiment.methods=[alignedkv,truncation,kivi2]",
        "experiment.v_blocks=[64]",
    )
    rows = list(csv.DictReader(open(fig / "fig_latency.csv")))
    assert [(r["method"], r["context"]) for r in rows] == [
        (m, c)
        for c in ("128", "320")
        for m in ("fp16", "alignedkv", "truncation", "kivi2", "alignedkv v_block=64", "hf_dynamic")
    ]
    assert all(float(r["ms"]) > 0 and r["backend"] == "torch" for r in rows)
    assert all(float(r["ratio_to_fp16"]) == 1.0 for r in rows if r["method"] == "fp16")
    assert all(float(r["ratio_to_hf_dynamic"]) == 1.0 for r in rows if r["method"] == "hf_dynamic")
    by = {(r["method"], r["context"]): r for r in rows}
    for c in ("128", "320"):  # bits and bytes read per step: 16-bit fp16, 32-bit DynamicCache, 13-bit truncation
        elements = 2 * 3 * int(c) * 64
        assert float(by["fp16", c]["bits_read"]) == 16.0
        assert float(by["fp16", c]["mb_read"]) == pytest.approx(2 * elements / 1e6)
        assert float(by["hf_dynamic", c]["mb_read"]) == pytest.approx(4 * elements / 1e6)
        assert float(by["truncation", c]["bits_read"]) == 13.0
        assert 8.0 < float(by["alignedkv", c]["bits_read"]) <= float(by["alignedkv v_block=64", c]["bits_read"]) < 16.5
    for r in rows:  # the byte-proportional ideal: bits read / 16 (none for DynamicCache's fp32)
        assert (
            r["ideal_x_fp16"] == ""
            if r["method"] == "hf_dynamic"
            else float(r["ideal_x_fp16"]) == pytest.approx(float(r["bits_read"]) / 16)
        )
    assert float(by["kivi2", "320"]["bits_read"]) < 16  # 320 tokens: 192 of them quantized
    results = json.loads(next((tmp_path / "out").rglob("results.json")).read_text())
    check_agrees(read_table(fig / "fig_latency.csv"), results["table"], "fig_latency")
    experiment = results["experiment"]
    assert experiment["shape_labels"] == {"smollm2_135m": "smollm2_135m shape (9q/3kv×64)"}
    assert experiment["copy_gb_per_s"] > 0 and experiment["cpu"]
    assert (fig / "fig_latency.png").stat().st_size > 10_000 and (fig / "fig_latency.pdf").is_file()


def test_whole_steps_and_batches_beside_the_attention_rows(tmp_path):
    """Whole decode steps on a random-weight model of stories260k's layout and attention cells of 2
    sequences: each with its own fp16 and DynamicCache baseline, bits read over every layer."""
    fig = run_experiment(
        tmp_path,
        "experiment=fig_latency",
        "experiment.shapes=[smollm2_135m]",
        "experiment.contexts.smollm2_135m=[160]",
        "experiment.batches=[1,2]",
        "experiment.step_layouts=[stories260k]",
        "experiment.step_contexts=[200]",
        "experiment.step_layers=2",
        "experiment.repeats=1",
        "experiment.backend=torch",
        "experiment.methods=[truncation,kivi2]",
        "experiment.v_blocks=[]",
    )
    rows = list(csv.DictReader(open(fig / "fig_latency.csv")))
    methods = ("fp16", "truncation", "kivi2", "hf_dynamic")
    assert [(r["kind"], r["batch"], r["context"], r["method"]) for r in rows] == [
        (kind, b, c, m) for kind, c in (("attention", "160"), ("step", "200")) for b in ("1", "2") for m in methods
    ]
    by = {(r["kind"], r["batch"], r["method"]): r for r in rows}
    for kind, b in (("attention", "1"), ("attention", "2"), ("step", "1"), ("step", "2")):
        assert float(by[kind, b, "fp16"]["ratio_to_fp16"]) == 1.0
        assert float(by[kind, b, "fp16"]["bits_read"]) == 16.0 and float(by[kind, b, "truncation"]["bits_read"]) == 13.0
    # K and V of every layer (2 of them) and sequence: 4 KV heads x 8 channels x 200 tokens, 2 bytes each
    assert float(by["step", "2", "fp16"]["mb_read"]) == pytest.approx(2 * 2 * 2 * 4 * 8 * 200 * 2 / 1e6)
    assert float(by["attention", "2", "fp16"]["mb_read"]) == pytest.approx(2 * 2 * 3 * 64 * 160 * 2 / 1e6)
    assert float(by["step", "1", "hf_dynamic"]["bits_read"]) == 32.0  # the model's fp32 on a CPU
    results = json.loads(next((tmp_path / "out").rglob("results.json")).read_text())
    check_agrees(read_table(fig / "fig_latency.csv"), results["table"], "fig_latency")
    assert results["experiment"]["layout_labels"] == {
        "stories260k": "whole decode step, stories260k layout (2 layers, random weights)"
    }
    assert (fig / "fig_latency.png").stat().st_size > 10_000


def test_an_unknown_layout_is_named_with_the_valid_ones(tmp_path):
    proc = run_py(
        tmp_path, "experiment=fig_latency", "model=stories260k", "logger=none", "experiment.step_layouts=[llama9]"
    )
    assert proc.returncode != 0
    assert "unknown experiment.step_layouts ['llama9']; valid: stories260k, smollm2_135m" in proc.stderr
