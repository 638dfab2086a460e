"""``experiments/bench_memory.py``: the budget column and the table, from rows alone; one real row."""

import pandas as pd
import pytest

from experiments.bench_memory import longest_context, measure, render
from tests.conftest import require_kernels_cpu


def test_longest_context_extrapolates_the_measured_bytes_per_token():
    rows = [
        {"status": "ok", "context": 2048, "total_mib": 60.0},
        {"status": "ok", "context": 8192, "total_mib": 180.0},
    ]
    assert longest_context(rows, 1024.0) == pytest.approx(8192 + (1024 - 180) / (120 / 6144))
    assert longest_context(rows[:1], 1024.0) is None


def test_render_writes_ratios_to_fp16_and_skipped_rows(tmp_path):
    table = pd.DataFrame(
        [
            {"cache": "fp16", "status": "ok", "context": 2048, "held_mib": 40.0, "step_peak_mib": 10.0}
            | {"total_mib": 50.0, "rss_over_model_mib": 70.0, "bits_stored": 16.0, "backend": "torch"},
            {"cache": "kivi2@cpu", "status": "ok", "context": 2048, "held_mib": 10.0, "step_peak_mib": 2.5}
            | {"total_mib": 12.5, "rss_over_model_mib": 20.0, "bits_stored": 3.6, "backend": "cpu"},
            {"cache": "aquakv", "status": "no predictors"},
        ]
    )
    [path] = render(table, tmp_path / "bench_memory", {"experiment": {"budget_mib": 1024, "threads": 1}})
    text = path.read_text()
    assert "| kivi2@cpu | cpu | 2048 | 3.60 | 10.0 | 2.5 | 12.5 | 0.25 | 20 |" in text
    assert "skipped: no predictors" in text


def test_measure_holds_less_for_fewer_bits():
    require_kernels_cpu()
    """stories260k: KIVI-2 on the C++ kernel holds and peaks below fp16 at the same context."""
    fp16 = measure("stories260k", "fp16", [256, 400], 64, 0)
    kivi = measure("stories260k", "kivi2@cpu", [256, 400], 64, 0)
    assert [r["context"] for r in fp16] == [256, 400] and fp16[0]["bits_stored"] == 16.0
    for k, f in zip(kivi, fp16, strict=True):
        assert k["total_mib"] < f["total_mib"] and k["held_mib"] < f["held_mib"], (k, f)
