"""experiments/niah.py: the grid composes and is checked; a tiny run on stories260k writes one CSV row per
(method, length, depth) equal to its own evaluate cell, resumes, and the heatmap redraws from the CSV alone."""

from __future__ import annotations

import json
import math
import re

import pandas as pd
import pytest
from conftest import ROOT, run_experiment, run_py
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from experiments import niah
from kvquant.errors import InvalidParameterError

METHODS = ["fp16", "kivi2", "aquakv"]  # fp16 is listed second below: it still runs and is drawn first
TINY = [
    "experiment=niah",
    "~experiment.methods",
    "+experiment.methods={kivi2:{},fp16:{},aquakv:{}}",  # aquakv: no predictors here, so skipped with its reason
    "experiment.lengths=[384,192]",
    "experiment.depths=[1,0]",
    "experiment.trials=2",
    "experiment.task.filler=tinystories",  # half WikiText-2's tokenizing time, paid once per cell
]
LENGTHS, DEPTHS = [192, 384], [0.0, 1.0]
PANELS = {"fp16", "alignedkv", "kivi2", "kivi4", "gear2", "gear4", "truncation", "aquakv", "higgs"}  # issue 17's list


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_config_composes_one_evaluate_cell_per_method_length_depth():
    cfg = composed("experiment=niah")
    grid = niah.grid_of(OmegaConf.to_container(cfg.experiment, resolve=True))
    assert cfg.experiment.runner == "niah" and list(grid.methods)[0] == "fp16"
    assert set(grid.methods) == PANELS
    assert grid.lengths == sorted(grid.lengths) and max(grid.lengths) <= 8192 and grid.trials >= 2
    assert grid.depths[0] == 0.0 and grid.depths[-1] == 1.0
    cells = grid.cells()
    assert len(cells) == len(grid.methods) * len(grid.lengths) * len(grid.depths)
    per_method = len(grid.lengths) * len(grid.depths)
    assert [c.method for c in cells[:per_method]] == ["fp16"] * per_method  # fp16's references first
    last = composed(*cells[-1].overrides)  # what `python run.py <overrides>` runs for that cell
    assert (last.experiment.runner, last.method.name, last.task.name) == ("evaluate", "higgs", "passkey")
    assert list(last.task.lengths) == [grid.lengths[-1]] and list(last.task.depths) == [1.0]
    assert last.task.trials == grid.trials and last.task.filler == "wikitext"
    aligned = composed(*next(c for c in cells if c.method == "alignedkv").overrides)
    assert aligned.method.prefill_aligned is False  # the paper's protocol: aligned reads in decode, the answer


GOOD = {"methods": {"fp16": {}}, "lengths": [256], "depths": [0.5], "trials": 1, "task": {}}


@pytest.mark.parametrize(
    "change,line",
    [
        ({"depths": [0.5, 1.5]}, "experiment niah: depths [0.5, 1.5] must lie in [0, 1]"),
        ({"depths": []}, "experiment niah: depths must be a non-empty list"),
        ({"lengths": []}, "experiment niah: lengths must be a non-empty list of positive token counts"),
        ({"lengths": [256, -1]}, "experiment niah: lengths [256, -1] must be positive token counts"),
        ({"methods": {"fp16": {}, "kivi3": {}}}, "kivi3: unknown method 'kivi3'; valid methods: alignedkv,"),
        ({"methods": {}}, "experiment niah: methods is empty"),
        ({"trials": 0}, "experiment niah: trials=0 must be a positive integer"),
        ({"task": {"depths": [0.5]}}, "experiment niah: experiment.task sets depths, which the grid sets per cell"),
    ],
)
def test_bad_input_is_one_line(change, line):
    with pytest.raises(InvalidParameterError, match=re.escape(line)) as err:
        niah.grid_of(GOOD | change)
    assert "\n" not in str(err.value)


def test_bad_input_through_run_py_is_one_line_and_exit_2(tmp_path):
    proc = run_py(tmp_path, "experiment=niah", "model=stories260k", "logger=none", "experiment.depths=[0,1.5]")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: experiment niah: depths [0, 1.5] must lie in [0, 1] (0 = needle at the start of the filler, "
        "1 = at its end)"
    ]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("niah")
    fig = run_experiment(tmp, *TINY, env={"KVQUANT_PREDICTOR_DIR": str(tmp / "no-predictors")})
    return tmp, fig


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_tiny_run_rows_are_their_cells(tiny):
    tmp, fig = tiny
    table = pd.read_csv(fig / "niah.csv")
    expected = [(m, n, d) for m in METHODS for n in LENGTHS for d in DEPTHS]
    assert list(zip(table.method, table.length, table.depth, strict=True)) == expected
    assert {"n", "accuracy", "accuracy_lo", "accuracy_hi", "paired", "greedy_match", "kl"} <= set(table.columns)
    done = table[table.status == "computed"].set_index(["method", "length", "depth"])
    assert len(done) == 8 and set(done.index.get_level_values(0)) == {"fp16", "kivi2"}
    keys = {}
    for (method, length, depth), row in done.iterrows():
        cell = tmp / row.results  # relative to where run.py ran
        data = json.loads(cell.read_text())
        assert data["config_hash"] == row.config_hash and data["method"]["name"] == method
        assert (data["task"]["lengths"], data["task"]["depths"], data["task"]["trials"]) == ([length], [depth], 2)
        assert row.n == data["task"]["n"] == 2 and row.accuracy == data["metrics"]["passkey_acc"]
        assert [row.accuracy_lo, row.accuracy_hi] == data["ci95"]["metrics/passkey_acc"]
        assert row.accuracy_lo <= row.accuracy <= row.accuracy_hi
        examples = lines(cell.with_name("examples.jsonl"))  # the two prompts behind the cell's accuracy
        assert [(e["length"], e["depth"], e["prompt_tokens"]) for e in examples] == [(length, depth, length)] * 2
        assert row.accuracy == sum(e["correct"] for e in examples) / 2
        keys.setdefault((length, depth), []).append([e["passkey"] for e in examples])
        if method == "fp16":
            assert row.bits_stored == 16 and math.isnan(row.greedy_match) and math.isnan(row.paired)
            continue
        fp16 = done.loc[("fp16", length, depth)]
        assert row.paired == pytest.approx(row.accuracy - fp16.accuracy)
        assert row.paired_lo <= row.paired <= row.paired_hi
        assert row.greedy_match == data["fidelity"]["greedy_match"] and 0 <= row.greedy_match <= 1
        assert [row.kl_lo, row.kl_hi] == data["ci95"]["fidelity/kl"] and row.kl > 0  # it read a quantized cache
        assert row.bits_stored < 16
    assert all(a == b for a, b in keys.values())  # fp16 and kivi2 answered the same keys in the same prompts
    assert len({tuple(k[0]) for k in keys.values()}) == 4  # a new key for each (length, depth)

    skipped = table[table.method == "aquakv"]
    assert (skipped.status == "skipped").all() and skipped.accuracy.isna().all()
    assert skipped.reason.str.contains("calibrate first: python run.py experiment=calibrate method=aquakv").all()

    [run] = (tmp / "out" / "runs").glob("*/*/results.json")
    data = json.loads(run.read_text())
    assert data["experiment"]["cells"] == {"computed": 8, "reused": 0, "skipped": 4, "pending": 0}
    assert (data["experiment"]["lengths"], data["experiment"]["depths"]) == (LENGTHS, DEPTHS)
    for rec, row in zip(data["table"], table.to_dict(orient="records"), strict=True):  # results.json "table" = CSV
        assert rec == {k: v for k, v in row.items() if not (isinstance(v, float) and math.isnan(v))}
    for suffix in (".png", ".pdf"):
        assert (fig / f"niah{suffix}").stat().st_size > 1_000


def test_an_interrupted_run_resumes_from_its_cells(tiny):
    tmp, fig = tiny
    table = pd.read_csv(fig / "niah.csv")
    done = table[table.status == "computed"]
    lost = tmp / done.results.iloc[-1]
    lost.unlink()  # as if the run had stopped before its last cell
    kept = {p: (tmp / p).stat().st_mtime_ns for p in done.results.iloc[:-1]}
    run_experiment(tmp, *TINY, "rerun=true", env={"KVQUANT_PREDICTOR_DIR": str(tmp / "no-predictors")})
    again = pd.read_csv(fig / "niah.csv")
    assert list(again.status) == ["reused"] * 7 + ["computed"] + ["skipped"] * 4
    assert {p: (tmp / p).stat().st_mtime_ns for p in done.results.iloc[:-1]} == kept
    assert (again.accuracy.fillna(-1) == table.accuracy.fillna(-1)).all()


def _drawn(table, stem, monkeypatch):
    """The figure ``render`` draws from ``table``: panel title → (image values, cell annotations)."""
    captured = []
    original = niah.save_figure
    monkeypatch.setattr(niah, "save_figure", lambda fig, s: captured.append(fig) or original(fig, s))
    written = niah.render(table, stem)
    assert [p.suffix for p in written] == [".png", ".pdf"] and all(p.stat().st_size > 1_000 for p in written)
    [fig] = captured
    out = {}
    for ax in fig.axes:
        if ax.images:  # a panel (the colour bar has none): cell (depth index, length index) → its text
            texts = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in ax.texts}
            out[ax.get_title()] = (ax.images[0].get_array(), texts)
    return out


def test_heatmap_redraws_from_the_csv_alone(monkeypatch, tmp_path):
    rows = []
    for method in ("gear2", "fp16", "higgs"):  # fp16 is drawn first whatever the CSV order
        for i, length in enumerate((512, 1024)):
            for j, depth in enumerate((0.0, 0.5, 1.0)):
                row = {"model": "m", "method": method, "length": length, "depth": depth, "status": "computed", "n": 12}
                row |= {"accuracy": (i + j) / 4, "paired": 0.0, "paired_lo": -0.1, "paired_hi": 0.1, "reason": None}
                rows.append(row)
    rows[3] |= {"paired": -0.5, "paired_lo": -0.75, "paired_hi": -0.25}  # gear2 at (1024, 0): differs from fp16
    for row in rows[12:]:
        row |= {"status": "skipped", "accuracy": None, "n": None, "reason": "no predictors"}
    csv = tmp_path / "niah.csv"
    pd.DataFrame(rows).to_csv(csv, index=False)
    drawn = _drawn(pd.read_csv(csv), tmp_path / "fig" / "niah", monkeypatch)
    assert list(drawn) == ["fp16", "gear2", "higgs"]
    values, texts = drawn["gear2"]
    assert values.tolist() == [[0.0, 0.25], [0.25, 0.5], [0.5, 0.75]]  # rows: depth 0, 0.5, 1; columns: 512, 1024
    assert texts[(0, 0)] == "0.00\nn=12" and texts[(0, 1)] == "0.25 *\nn=12" and texts[(2, 1)] == "0.75\nn=12"
    values, texts = drawn["higgs"]
    assert values.mask.all() and set(texts.values()) == {"skipped\n[1]"}


def test_tiny_run_heatmap_is_its_csv(tiny, monkeypatch, tmp_path):
    _, fig = tiny
    table = pd.read_csv(fig / "niah.csv")
    drawn = _drawn(table, tmp_path / "niah", monkeypatch)
    assert list(drawn) == METHODS
    for method in ("fp16", "kivi2"):
        rows = table[table.method == method]
        values, texts = drawn[method]
        for row in rows.itertuples():
            i, j = DEPTHS.index(row.depth), LENGTHS.index(row.length)
            assert values[i, j] == row.accuracy and texts[(i, j)] == f"{row.accuracy:.2f}\nn=2"
