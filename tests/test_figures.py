"""experiments/figures.py: every figure from the committed results/, clear failures, plotted numbers = results.json."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import figures
from experiments.figures import FiguresError, artefact, artefact_names, check_agrees, collect, load

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
FIGURES = ["fig_bitwidth", "fig_latency", "frontier_alignedkv"]


def test_every_artefact_is_discovered_and_committed():
    names = artefact_names()
    assert {*FIGURES, "table_relerr"} <= set(names)
    assert {"evaluate", "calibrate", "figures"}.isdisjoint(names)
    for name in names:
        table, results = load(name)  # raises if the CSV and results.json disagree
        assert len(table) == len(results["table"]) > 0
    assert sum(p.stat().st_size for p in RESULTS.rglob("*")) < 1_000_000
    assert not list(RESULTS.rglob("*.png")) and not list(RESULTS.rglob("*.pdf"))


def test_make_figures_from_committed_results(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MPLBACKEND": "Agg"}
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.figures", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]  # no wall-clock bound: a loaded CI machine is not a benchmark
    printed = {Path(line) for line in proc.stdout.splitlines()}
    for name in artefact_names():
        stem = tmp_path / name
        assert stem.with_suffix(".csv").read_bytes() == (RESULTS / name / f"{name}.csv").read_bytes()
        drawn = stem.with_suffix(".png") in printed
        assert drawn or stem.with_suffix(".md") in printed, f"{name} wrote neither a figure nor a table"
        suffixes = (".png", ".pdf") if drawn else (".md",)
        for suffix in suffixes:
            assert stem.with_suffix(suffix).stat().st_size > 1_000
    for name in FIGURES:
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000


def test_missing_result_names_the_command(tmp_path, capsys):
    shutil.copytree(RESULTS, tmp_path / "results")
    shutil.rmtree(tmp_path / "results" / "fig_latency")
    (tmp_path / "results" / "table_relerr" / "results.json").unlink()
    only = [arg for name in ("fig_bitwidth", "fig_latency", "table_relerr") for arg in ("--only", name)]
    code = figures.main(["--results", str(tmp_path / "results"), "--out", str(tmp_path / "fig"), *only])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert len(err) == 2
    assert "fig_latency" in err[0] and "python run.py experiment=fig_latency" in err[0]
    assert "table_relerr" in err[1] and "python run.py experiment=table_relerr" in err[1]
    assert all("python -m experiments.figures collect" in line for line in err)
    assert not (tmp_path / "fig").exists()  # nothing rendered when something is missing

    code = figures.main(
        ["--results", str(tmp_path / "results"), "--out", str(tmp_path / "fig"), "--only", "fig_bitwidth"]
    )
    assert code == 0 and (tmp_path / "fig" / "fig_bitwidth.png").is_file()
    # --allow-missing: the missing two skipped with their lines, the rest drawn (every artefact is drawn
    # from these results in test_make_figures_from_committed_results; one stands for them here).
    only += ["--only", "frontier_alignedkv"]
    code = figures.main(
        ["--results", str(tmp_path / "results"), "--out", str(tmp_path / "all"), *only, "--allow-missing"]
    )
    skipped = capsys.readouterr().err.strip().splitlines()
    assert code == 0 and (tmp_path / "all" / "frontier_alignedkv.png").is_file()
    assert skipped == [line.replace("error: ", "skipped: ", 1) for line in err]  # the refusal's two lines
    assert not (tmp_path / "all" / "fig_latency.png").exists()
    assert figures.main(["--only", "nope"]) == 1
    assert "unknown artefact nope" in capsys.readouterr().err


def test_csv_and_results_json_disagreeing_is_caught(tmp_path):
    folder = tmp_path / "table_relerr"
    shutil.copytree(RESULTS / "table_relerr", folder)
    table = figures.read_table(folder / "table_relerr.csv")
    column = next(c for c in table.columns if c.startswith("qk "))
    table.loc[0, column] += 0.01
    table.to_csv(folder / "table_relerr.csv", index=False)
    with pytest.raises(FiguresError, match=f"row 0 '{column}': CSV"):
        load("table_relerr", tmp_path)
    with pytest.raises(FiguresError, match="CSV has 1 rows"):
        check_agrees(table.head(1), json.loads((folder / "results.json").read_text())["table"], "x")
    with pytest.raises(FiguresError, match="has no 'table'"):
        check_agrees(table, None, "x")


def test_collect_drops_where_the_run_wrote_its_figures(tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(RESULTS / "frontier_alignedkv", run_dir)
    results = json.loads((run_dir / "results.json").read_text())
    results["config"]["experiment"]["figures_dir"] = "/elsewhere/figs"
    results["experiment"]["figures"] = "/elsewhere/figs/frontier_alignedkv"
    (run_dir / "results.json").write_text(json.dumps(results))
    collected = json.loads((collect(run_dir, tmp_path / "results") / "results.json").read_text())
    assert collected["config"]["experiment"]["figures_dir"] == "figures"
    assert collected["experiment"]["figures"] == "figures/frontier_alignedkv"
    assert (
        collected["config_hash"]
        == json.loads((RESULTS / "frontier_alignedkv" / "results.json").read_text())["config_hash"]
    )


def test_collect_copies_a_finished_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(RESULTS / "fig_latency", run_dir)
    (run_dir / "examples.jsonl").write_text("{}\n")
    target = collect(run_dir, tmp_path / "results")
    assert target == tmp_path / "results" / "fig_latency"
    assert sorted(p.name for p in target.iterdir()) == ["fig_latency.csv", "results.json"]
    assert (target / "results.json").read_bytes() == (RESULTS / "fig_latency" / "results.json").read_bytes()

    results = json.loads((run_dir / "results.json").read_text())
    results["table"][0]["ms"] *= 2
    (run_dir / "results.json").write_text(json.dumps(results))
    assert figures.main(["collect", str(run_dir), "--results", str(tmp_path / "other")]) == 1
    assert "'ms': CSV" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()
    assert figures.main(["collect", str(tmp_path)]) == 1
    assert "no results.json" in capsys.readouterr().err


def test_collect_makes_output_folders_relative_and_rehashes(tmp_path):
    """A run written to absolute folders is committed with the default ones and the hash they give."""
    from kvquant.results import config_hash

    run_dir = tmp_path / "run"
    shutil.copytree(RESULTS / "bench_kv_methods", run_dir)
    results = json.loads((run_dir / "results.json").read_text())
    results["config"]["results_dir"] = str(tmp_path / "out")
    results["config"]["experiment"]["figures_dir"] = str(tmp_path / "fig")
    (run_dir / "results.json").write_text(json.dumps(results))
    target = collect(run_dir, tmp_path / "results")
    kept = json.loads((target / "results.json").read_text())
    assert kept["config"]["results_dir"] == "outputs" and kept["config"]["experiment"]["figures_dir"] == "figures"
    assert kept["config_hash"] == config_hash(kept["config"]) != config_hash(results["config"])
    assert kept["table"] == results["table"]


def _drawn(name: str, monkeypatch, tmp_path):
    """The matplotlib figure ``name``'s render draws from the committed CSV, and that artefact's results.json."""
    module = artefact(name)
    captured = []
    original = module.save_figure

    def keep(fig, stem, copies=()):
        captured.append([(ax, [line for line in ax.lines], list(ax.patches)) for ax in fig.axes])
        return original(fig, stem, copies)

    monkeypatch.setattr(module, "save_figure", keep)
    table, results = load(name)
    figures.call_render(module.render, table, tmp_path / name, results)
    assert len(captured) == 1
    return captured[0], results["table"]


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15)


def _values(rows: list[dict]) -> list[float]:
    return [float(v) for row in rows for v in row.values() if isinstance(v, int | float)]


def _assert_plotted_from(axes, rows: list[dict]) -> int:
    """Every y value drawn (line points, bar heights) is a number of results.json's table."""
    known = _values(rows)
    count = 0
    for _, lines, patches in axes:
        ys = [y for line in lines for y in line.get_ydata()] + [p.get_height() for p in patches]
        for y in ys:
            assert any(_close(float(y), v) for v in known), f"plotted {y} is not in results.json"
        count += len(ys)
    return count


def test_latency_plot_numbers_are_results_json(monkeypatch, tmp_path):
    axes, rows = _drawn("fig_latency", monkeypatch, tmp_path)
    assert _assert_plotted_from(axes, rows) > 0
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    assert len(axes) == 2 * len(shapes)
    for i, shape in enumerate(shapes):  # one row of panels per shape: ms (left), ratio to fp16 (right)
        mine_rows = [r | {"label": f"{r['method']} ({r['backend']})"} for r in rows if r["shape"] == shape]
        for (_, lines, _), column in zip(axes[2 * i : 2 * i + 2], ("ms", "ratio_to_fp16"), strict=True):
            drawn = {
                line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
                for line in lines
                if line.get_label()[0] != "_"
            }
            assert set(drawn) == {r["label"] for r in mine_rows}
            for label, (xs, ys) in drawn.items():
                mine = sorted((r["context"], r[column]) for r in mine_rows if r["label"] == label)
                assert xs == [c for c, _ in mine] and ys == [v for _, v in mine]


def test_bitwidth_plot_numbers_are_results_json(monkeypatch, tmp_path):
    axes, rows = _drawn("fig_bitwidth", monkeypatch, tmp_path)
    assert _assert_plotted_from(axes, rows) > 0
    overall = [r for r in rows if r["layer"] == "all"]
    largest = max(r["context"] for r in overall)
    methods = sorted({r["method"] for r in overall})
    heights = [p.get_height() for p in axes[1][2]]
    expected = []
    for method in methods:
        row = next(r for r in overall if r["method"] == method and r["context"] == largest)
        expected += [row[f"{side}{w}"] for side in "kv" for w in (8, 12, 16)]
    assert heights == expected
    per_layer = [line.get_ydata().tolist() for line in axes[2][1]]
    layers = sorted((r for r in rows if r["layer"] != "all" and r["context"] == largest), key=lambda r: int(r["layer"]))
    assert per_layer == [[r["bits_read"] for r in layers if r["method"] == m] for m in methods]


def test_frontier_plot_numbers_are_results_json(monkeypatch, tmp_path):
    axes, rows = _drawn("frontier_alignedkv", monkeypatch, tmp_path)
    assert _assert_plotted_from(axes, rows) > 0
    contexts = sorted({r["context"] for r in rows})
    for col, context in enumerate(contexts):
        for row_index, column in ((0, "greedy_match"), (1, "kl")):
            _, lines, _ = axes[row_index * len(contexts) + col]
            for line in lines:
                mine = sorted(
                    (r["bits_read"], r[column])
                    for r in rows
                    if r["context"] == context and r["rule"] == line.get_label()
                )
                assert list(zip(line.get_xdata(), line.get_ydata(), strict=True)) == mine


def test_relerr_table_numbers_are_results_json(tmp_path):
    from experiments.table_relerr import percentages

    written = figures.render_one("table_relerr", tmp_path)
    text = (tmp_path / "table_relerr.md").read_text()
    assert tmp_path / "table_relerr.md" in written
    rows = load("table_relerr")[1]["table"]
    shown = percentages(text)
    assert set(shown) == {r["method"] for r in rows}
    for r in rows:
        values = [r[k] for k in r if k.startswith("qk ")] + [r[k] for k in r if k.startswith("sv ")]
        assert shown[r["method"]] == [float(f"{100 * v:.1f}") for v in values]
