"""experiments/table_hf_quantized.py (formerly scripts/compare_hf_quantized.py) through run.py on stories260k."""

import importlib.util
import json

import pytest
from conftest import run_experiment

from experiments.figures import check_agrees, read_table
from experiments.table_hf_quantized import hf_bits

HAS_QUANTO = importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.quanto") is not None


def test_hf_bits_formula():
    assert hf_bits("fp8", 8, 512, 63) == 8.0
    # 512 prompt tokens quantized at once, 63 steps stay in the fp16 window: 2 + 32/64 bits vs 16
    assert hf_bits("quanto", 2, 512, 63) == pytest.approx((512 * 2.5 + 63 * 16) / 575)
    assert hf_bits("quanto", 4, 0, 128) == pytest.approx(4.5)  # the window just flushed


def test_kvquant_and_transformers_caches_side_by_side(tmp_path):
    fig = run_experiment(
        tmp_path,
        "experiment=table_hf_quantized",
        "experiment.prompts=2",
        "experiment.prompt_tokens=96",
        "experiment.new_tokens=16",
        "~experiment.methods",
        "+experiment.methods={fp16:{},truncation:{keep_bits:7}}",
        env={"OMP_NUM_THREADS": "1"},
    )
    table = read_table(fig / "table_hf_quantized.csv")
    rows = {r["cache"]: r for r in table.to_dict(orient="records")}
    assert list(rows) == ["hf_quanto2", "hf_quanto4", "hf_fp8", "fp16", "truncation"]
    assert rows["fp16"]["greedy_match"] == 1.0 and rows["fp16"]["bits_stored"] == rows["fp16"]["bits_read"] == 16.0
    assert rows["truncation"]["greedy_match"] < 1.0 and rows["truncation"]["bits_read"] == 7.0
    assert rows["hf_fp8"]["bits_source"] == "formula" and rows["hf_fp8"]["bits_stored"] == 8.0
    assert 0.0 <= rows["hf_fp8"]["greedy_match"] <= 1.0 and rows["hf_fp8"]["decode_ratio_fp16"] > 0
    if not HAS_QUANTO:
        assert "pip install -e '.[compare]'" in rows["hf_quanto2"]["reason"]
    results = json.loads(next((tmp_path / "out").rglob("results.json")).read_text())
    check_agrees(table, results["table"], "table_hf_quantized")
    text = (fig / "table_hf_quantized.md").read_text()
    assert "| fp16 | 1.000 | 1.000 | 2/2 | 16.00 | 16.00 |" in text and "| hf_fp8 |" in text
    assert "8.00 (formula)" in text
