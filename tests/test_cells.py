"""experiments/cells.py: cell configs equal run.py's, cells are reused across tables and sweeps, failures are rows."""

import json

import pytest
from conftest import ROOT, run_py
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from experiments.cells import base_overrides, cell_config, command, grid, override_value, run_cells
from kvquant.errors import InvalidParameterError
from kvquant.results import config_hash

RUN = ["model=stories260k", "logger=none", "progress=false"]


def run_ok(tmp_path, *args):
    proc = run_py(tmp_path, *args, env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def hydra_app():
    return initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3")


def test_parameters_survive_the_override_grammar():
    params = {"tasks": ["trec", "qasper"], "limit": None, "max_length": 300, "chunk_size": 16}
    odd = {"keep_bits": 12, "margin": 0.5, "label": "two words, 'quoted'", "flag": True, "word": "null"}
    cells, display = grid(
        {"t": {"name": "truncation", **odd}}, {"lb": {"name": "longbench", "metric": "trec", **params}}
    )
    with hydra_app():
        cfg = cell_config(cells[0], RUN)
    assert display == {"lb": ("trec", 1.0)}
    assert OmegaConf.to_container(cfg.task) == {**OmegaConf.to_container(cfg.task), **params}
    assert OmegaConf.to_container(cfg.method) == {"name": "truncation", "backend": "auto", **odd}
    assert cfg.experiment.runner == "evaluate" and cfg.model.name == "stories260k"
    assert override_value([1.5e-05, "a b"]) == "[1.5e-05,'a b']"


def test_grid_checks_choices_and_base_drops_what_cells_set():
    with pytest.raises(InvalidParameterError, match="row: unknown method 'nope'"):
        grid({"row": {"name": "nope"}}, {"wikitext": {}})
    given = ["model=stories260k", "experiment=table_tasks", "+experiment.methods.kivi2.group_size=8", "method=kivi2"]
    given += ["task.limit=3", "~experiment.tasks", "device=cpu", "seed=1"]
    assert base_overrides(given) == ["model=stories260k", "device=cpu", "seed=1"]


def test_the_n50_tables_share_their_common_cells():
    """table_aquakv_n50 says its fp16, kivi and 2-bit AQUA-KV cells are table_tasks_n50's: the same
    hashes, so hours of CPU cells are computed once for both tables (and no other cell collides)."""
    labels = {}
    with hydra_app():
        for preset in ("table_tasks_n50", "table_aquakv_n50"):
            exp = compose(config_name="config", overrides=[f"experiment={preset}"]).experiment
            for cell in grid(exp.methods, exp.tasks)[0]:
                digest = config_hash(OmegaConf.to_container(cell_config(cell, []), resolve=True))
                labels.setdefault(digest, set()).add((preset, cell.method, cell.task))
    shared = {frozenset(found) for found in labels.values() if len(found) > 1}
    pairs = [("fp16", "fp16"), ("kivi2", "kivi2"), ("kivi4", "kivi4"), ("aquakv", "aquakv2")]
    expected = {
        frozenset({("table_tasks_n50", ours, task), ("table_aquakv_n50", theirs, task)})
        for ours, theirs in pairs
        for task in ("wikitext", "longbench")
    }
    assert shared == expected


def test_cells_reuse_a_sweep_compute_the_rest_and_run_py_agrees(tmp_path, monkeypatch):
    out = tmp_path / "out"
    base = [*RUN, f"results_dir={out}"]
    sweep = run_ok(tmp_path, "-m", *base, "method=fp16,truncation", "task=wikitext", "task.limit=1", "task.window=128")
    swept = {json.loads(p.read_text())["method"]["name"]: p for p in (out / "multirun").rglob("results.json")}
    assert set(swept) == {"fp16", "truncation"}, sweep.stdout

    methods = {"fp16": {}, "truncation": {"keep_bits": 13}, "kivi2": {"group_size": 8, "residual": 32}}
    methods |= {"gear2": {}, "aquakv": {}}
    cells, _ = grid(methods, {"wikitext": {"limit": 1, "window": 128}})
    monkeypatch.setenv("KVQUANT_PREDICTOR_DIR", str(tmp_path / "no-predictors"))
    with hydra_app():
        results = run_cells(OmegaConf.create({"results_dir": str(out)}), cells, out / "table", base=base)
        hashes = [config_hash(OmegaConf.to_container(cell_config(c, base), resolve=True)) for c in cells]
    by = {r.cell.method: r for r in results}
    assert [r.config_hash for r in results] == hashes
    for name in ("fp16", "truncation"):  # the sweep's runs, found by hash: the cell config is run.py's
        assert by[name].status == "reused" and by[name].path == swept[name]
        assert by[name].config_hash == json.loads(swept[name].read_text())["config_hash"]
    kivi = by["kivi2"]
    assert kivi.status == "computed" and kivi.path == out / "table" / "cells" / "kivi2_wikitext" / "results.json"
    data = json.loads(kivi.path.read_text())
    assert data["config_hash"] == kivi.config_hash and data["config"]["method"]["group_size"] == 8
    assert {"config", "metrics", "fidelity", "bits", "timing", "env"} <= set(data) and data["timing"]["wall_s"] > 0
    assert data["fidelity"]["kl"] > 0 and 2 < data["metrics"]["ppl"] < 10_000
    gear = json.loads(by["gear2"].path.read_text())  # GEAR's default group of 64 adapted to head_dim 8, and said
    assert by["gear2"].status == "computed" and gear["method"]["adapted"]["group_size"][1] == 8
    assert (
        by["aquakv"].status == "skipped"
        and "calibrate first: python run.py experiment=calibrate" in by["aquakv"].reason
    )
    assert "\n" not in by["aquakv"].reason

    # run.py, given the cell's own command line, finds the cell's results.json and skips.
    line = command(cells[2], base).split()[2:]
    assert run_ok(tmp_path, *line).stdout.startswith("skip: results for this config already exist at")


def test_cell_row_carries_intervals_and_reads_results_without_them():
    from pathlib import Path

    from experiments.cells import FIDELITY, Cell, CellResult, cell_row

    cell = Cell("kivi2", "kivi2", "wikitext", "wikitext")
    data = {
        "task": {"n": 4},
        "metrics": {"ppl": 10.0},
        "fidelity": {"kl": 0.1},
        "paired": {"ppl": 1.0},
        "ci95": {"metrics/ppl": [9.0, 11.0], "paired/ppl": [0.5, 1.5], "fidelity/kl": [0.05, 0.2]},
        "n": {"metrics/ppl": 4, "paired/ppl": 4, "fidelity/kl": 4},
    }
    row = cell_row(CellResult(cell, "reused", "h", Path("x/results.json"), data), "ppl")
    assert (row["value"], row["value_lo"], row["value_hi"], row["n"]) == (10.0, 9.0, 11.0, 4)
    assert (row["paired"], row["paired_lo"], row["paired_hi"]) == (1.0, 0.5, 1.5)
    assert (row["kl"], row["kl_lo"], row["kl_hi"]) == (0.1, 0.05, 0.2) and row["greedy_match_lo"] is None
    old = {k: v for k, v in data.items() if k not in ("paired", "ci95", "n")}  # committed before intervals
    row = cell_row(CellResult(cell, "reused", "h", Path("x/results.json"), old), "ppl")
    assert row["value"] == 10.0 and row["paired"] is None
    assert all(row[f"{name}_{end}"] is None for name in FIDELITY for end in ("lo", "hi"))


def test_a_difference_is_claimed_only_off_zero_and_from_enough_examples():
    from experiments.cells import excludes_zero, fmt_ci
    from kvquant.eval.intervals import MIN_N_CLAIM

    assert excludes_zero(0.1, 0.5, MIN_N_CLAIM) and excludes_zero(-0.5, -0.1, 50)
    assert not excludes_zero(-0.1, 0.5, 50) and not excludes_zero(0.1, 0.5, 2)  # n = 2: the bootstrap is too narrow
    assert not excludes_zero(float("nan"), float("nan"), 50)
    assert fmt_ci(0.5, 0.4, 0.6, scale=100) == "50.00 [40.00, 60.00]" and fmt_ci(0.5, None, None) == "0.50"
    assert fmt_ci(0.01, -0.02, 0.03, 3, sign=True) == "+0.010 [-0.020, +0.030]" and fmt_ci(None, 1, 2) == "–"


SHIPPED_PREDICTORS = ROOT / "tests" / "data" / "predictors"  # stories260k's, recorded with the golden outputs
CELL_TASK = {"wikitext": {"limit": 1, "window": 128}}


def own_predictors(tmp_path, monkeypatch):
    """A private copy of stories260k's predictors, named by KVQUANT_PREDICTOR_DIR (a test may overwrite it)."""
    import shutil

    folder = shutil.copytree(SHIPPED_PREDICTORS, tmp_path / "predictors")
    monkeypatch.setenv("KVQUANT_PREDICTOR_DIR", str(folder))
    return folder


def table_of(out, cells, base, name: str, compute: bool = True) -> dict:
    """``run_cells`` as a table run would (results_dir ``out``), by row label."""
    with hydra_app():
        results = run_cells(OmegaConf.create({"results_dir": str(out)}), cells, out / name, base=base, compute=compute)
    return {r.cell.method: r for r in results}


def test_a_recalibration_recomputes_the_aquakv_cells_and_reuses_the_rest(tmp_path, monkeypatch, stories):
    from kvquant.fsutil import sha256_file
    from kvquant.methods import get_method

    own_predictors(tmp_path, monkeypatch)
    out = tmp_path / "out"
    base = [*RUN, f"results_dir={out}"]
    cells, _ = grid({"fp16": {}, "aquakv": {}}, CELL_TASK)

    first = table_of(out, cells, base, "t1")
    assert {r.status for r in first.values()} == {"computed"}
    old = json.loads(first["aquakv"].path.read_text())["method"]["files"]["predictors"]
    assert old["sha256"] == sha256_file(old["path"])
    again = table_of(out, cells, base, "t2")
    assert {name: (r.status, r.path) for name, r in again.items()} == {
        name: ("reused", r.path) for name, r in first.items()
    }

    model, tok = stories  # recalibrate: the same file name, another fit
    get_method("aquakv").calibrate(model, tok, n_seqs=2, seq_len=64, seed=1, progress=False, log=None).save(old["path"])
    third = table_of(out, cells, base, "t3")
    assert (third["fp16"].status, third["fp16"].path) == ("reused", first["fp16"].path)
    assert third["aquakv"].status == "computed" and third["aquakv"].path != first["aquakv"].path
    new = json.loads(third["aquakv"].path.read_text())["method"]["files"]["predictors"]
    assert new["path"] == old["path"] and new["sha256"] == sha256_file(old["path"]) != old["sha256"]
    assert third["aquakv"].config_hash == first["aquakv"].config_hash  # the config did not change, the file did
    fourth = table_of(out, cells, base, "t4")
    assert fourth["aquakv"].status == "reused" and fourth["aquakv"].path == third["aquakv"].path


def write_cell(out, cell, base, folder: str, **blocks) -> dict:
    """A finished cell's results.json as run_cells writes it (config, hash, ``blocks``), without computing it."""
    with hydra_app():
        config = OmegaConf.to_container(cell_config(cell, base), resolve=True)
    data = {"config": config, "config_hash": config_hash(config), "metrics": {"ppl": 5.0}, **blocks}
    (out / folder).mkdir(parents=True)
    (out / folder / "results.json").write_text(json.dumps(data))
    return data


def test_a_table_of_cells_from_two_commits_warns_in_one_line(tmp_path, capsys):
    out = tmp_path / "out"
    base = [*RUN, f"results_dir={out}"]
    cells, _ = grid({"fp16": {}, "truncation": {}}, CELL_TASK)
    for cell, commit in zip(cells, ("a" * 40, "b" * 40 + "+dirty"), strict=True):
        write_cell(out, cell, base, cell.slug, env={"git_commit": commit})
    found = table_of(out, cells, base, "t", compute=False)
    assert {r.status for r in found.values()} == {"reused"}
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: 2 cells of this table mix 2 code commits (aaaaaaa, bbbbbbb+dirty): the numbers may not be comparable"
    ]

    (out / "truncation_wikitext" / "results.json").write_text(
        json.dumps(write_cell(out, cells[1], base, "again", env={"git_commit": "a" * 40}))
    )
    table_of(out, cells, base, "t2", compute=False)
    assert "warning:" not in capsys.readouterr().err


def test_an_aquakv_cell_resumes_only_with_the_digest_of_todays_file(tmp_path, monkeypatch, capsys):
    """A cell that records the digest of the file a run would read now is reused (whatever its config hash
    was written with); one that records none, or another digest, is not."""
    from kvquant.fsutil import sha256_file

    folder = own_predictors(tmp_path, monkeypatch)
    [path] = folder.rglob("aquakv-kv-*.safetensors")
    out = tmp_path / "out"
    base = [*RUN, f"results_dir={out}"]
    cells, _ = grid({"aquakv": {}}, CELL_TASK)
    legacy = write_cell(out, cells[0], base, "legacy", method={"name": "aquakv"})
    [found] = table_of(out, cells, base, "t1", compute=False).values()
    assert found.status == "pending" and "legacy/results.json records no predictor digest" in capsys.readouterr().out

    stale = {"predictors": {"path": str(path), "sha256": "0" * 64}}
    write_cell(out, cells[0], base, "stale", method={"name": "aquakv", "files": stale})
    assert table_of(out, cells, base, "t2", compute=False)["aquakv"].status == "pending"

    today = {"predictors": {"path": "/elsewhere/" + path.parent.name + "/" + path.name, "sha256": sha256_file(path)}}
    write_cell(out, cells[0], base, "today", method={"name": "aquakv", "files": today})
    [found] = table_of(out, cells, base, "t3", compute=False).values()
    assert found.status == "reused" and found.path == out / "today" / "results.json"
    assert found.config_hash == legacy["config_hash"]
