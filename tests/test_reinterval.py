"""experiments.reinterval on the committed LongBench cells (smollm2_135m, all 87 bundled examples)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from experiments.reinterval import main, reinterval
from kvquant.results import RESULTS_FILE

ROOT = Path(__file__).resolve().parents[1]


def _cell(name: str, tmp_path: Path) -> Path:
    found = sorted(ROOT.glob(f"evaluations/runs/*/*/cells/{name}/{RESULTS_FILE}"))
    if not found:
        pytest.fail(f"committed cell {name} not found under evaluations/runs")
    return Path(shutil.copytree(found[0].parent, tmp_path / name))


def _drop(cell: Path, keys: list[str]) -> dict:
    results = json.loads((cell / RESULTS_FILE).read_text())
    kept = {k: v for k, v in results["ci95"].items() if k not in keys}
    (cell / RESULTS_FILE).write_text(json.dumps({**results, "ci95": kept}, indent=2))
    return results


def test_restores_the_longbench_average_interval_and_keeps_the_rest(tmp_path):
    fp16, trunc = _cell("fp16_longbench", tmp_path), _cell("truncation_longbench", tmp_path)
    keys = ["metrics/longbench_avg", "paired/longbench_avg"]
    before = _drop(trunc, keys)
    assert reinterval(trunc, fp16) == [f"ci95/{k}" for k in keys]
    after = json.loads((trunc / RESULTS_FILE).read_text())
    assert after["ci95"] == before["ci95"]  # every other interval reproduced, in the same order
    lo, hi = after["ci95"]["metrics/longbench_avg"]
    assert lo < after["metrics"]["longbench_avg"] < hi
    assert after["n"]["metrics/longbench_avg"] == 87
    assert reinterval(trunc, fp16) == []


def test_a_cell_whose_interval_does_not_reproduce_is_left_alone(tmp_path):
    fp16, trunc = _cell("fp16_longbench", tmp_path), _cell("truncation_longbench", tmp_path)
    results = json.loads((trunc / RESULTS_FILE).read_text())
    results["ci95"]["metrics/qasper"] = [0.0, 99.0]
    text = json.dumps(results, indent=2)
    (trunc / RESULTS_FILE).write_text(text)
    with pytest.raises(SystemExit, match="metrics/qasper recomputes as"):
        main([str(trunc), "--reference", str(fp16)])
    assert (trunc / RESULTS_FILE).read_text() == text
