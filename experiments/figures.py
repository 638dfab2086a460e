"""``make figures``: every paper artefact re-rendered from committed results, with no model and no compute.

An artefact is a module ``experiments/<NAME>.py`` with ``NAME`` and ``render(table, stem) -> list[Path]``,
which draws ``stem.png``/``stem.pdf`` (via ``kvquant.plots.save_figure``) and/or writes ``stem.md`` from
the CSV alone. ``render`` may also take ``results=``: the run's results.json, for titles and notes that
are not in the CSV (never for numbers). A run publishes through :func:`publish`, so the rows in its
results.json ``"table"`` are exactly the rows of its ``<NAME>.csv``.

The data behind the README figures live in ``results/<NAME>/`` (``<NAME>.csv`` + ``results.json``)::

    python -m experiments.figures [--results results] [--out figures] [--only NAME] [--allow-missing]
    python -m experiments.figures --thumbnails docs/img        # also refresh the README's thumbnails
    python -m experiments.figures collect <run_dir> [--results results]   # after a run: update results/
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import math
import shutil
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = Path(__file__).resolve().parent
RESULTS_FILE = "results.json"


class FiguresError(Exception):
    """Committed results missing or inconsistent; the message is the one line a user needs."""


def artefact_names() -> list[str]:
    """Modules of ``experiments/`` with a top-level ``render``, found by parsing so that nothing is imported."""
    names = []
    for path in sorted(EXPERIMENTS.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(node, ast.FunctionDef) and node.name == "render" for node in tree.body):
            names.append(path.stem)
    return names


def artefact(name: str) -> ModuleType:
    """The imported module ``experiments.<name>``, checked to follow the artefact contract."""
    module = importlib.import_module(f"experiments.{name}")
    if getattr(module, "NAME", None) != name or not callable(getattr(module, "render", None)):
        raise FiguresError(f"experiments/{name}.py must define NAME = '{name}' and render(table, stem)")
    return module


def make_command(name: str) -> str:
    """The command that produces ``results/<name>/`` (settings used for the committed data: results/README.md)."""
    return (
        f"python run.py experiment={name} (settings used: results/README.md), "
        f"then python -m experiments.figures collect <its run folder>"
    )


def read_table(path: Path):
    """A ``<NAME>.csv`` as pandas reads it back (what ``render`` draws and results.json records)."""
    import pandas as pd

    return pd.read_csv(path)


def _shown(path: Path) -> str:
    """``path`` relative to the working directory where it lies below it (shorter error lines)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def records(table) -> list[dict[str, Any]]:
    """The CSV rows as JSON-safe records; NaN cells are omitted, as results.json omits missing values."""
    return [{k: v for k, v in row.items() if not _missing(v)} for row in table.to_dict(orient="records")]


def _same(csv_value: Any, json_value: Any) -> bool:
    if _missing(csv_value) or _missing(json_value):
        return _missing(csv_value) and _missing(json_value)
    if isinstance(csv_value, str) or isinstance(json_value, str):
        return str(csv_value) == str(json_value)
    return math.isclose(float(csv_value), float(json_value), rel_tol=1e-12, abs_tol=0.0)


def check_agrees(table, rows: list[dict[str, Any]] | None, where: str) -> None:
    """Raise unless results.json's ``"table"`` holds exactly the CSV's rows, column by column."""
    if rows is None:
        raise FiguresError(f"{where}: results.json has no 'table' (rerun the experiment with this version)")
    if len(rows) != len(table):
        raise FiguresError(f"{where}: CSV has {len(table)} rows, results.json 'table' has {len(rows)}")
    columns = list(table.columns)
    for i, (csv_row, json_row) in enumerate(zip(table.to_dict(orient="records"), rows, strict=True)):
        extra = sorted(set(json_row) - set(columns))
        if extra:
            raise FiguresError(f"{where}: row {i} of results.json has columns the CSV lacks: {', '.join(extra)}")
        for column in columns:
            csv_value, json_value = csv_row[column], json_row.get(column)
            if not _same(csv_value, json_value):
                raise FiguresError(f"{where}: row {i} '{column}': CSV {csv_value!r} != results.json {json_value!r}")


def call_render(
    render: Callable[..., list[Path]], table, stem: Path, results: dict[str, Any] | None = None
) -> list[Path]:
    """``render(table, stem)``, handing it ``results`` where it asks for them."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    if "results" in inspect.signature(render).parameters:
        return list(render(table, stem, results=results))
    return list(render(table, stem))


def _copy(paths: Iterable[Path], folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    copied = []
    for path in paths:
        target = folder / path.name
        if path.resolve() != target.resolve():
            shutil.copyfile(path, target)
        copied.append(target)
    return copied


def publish(
    render: Callable[..., list[Path]],
    name: str,
    table,
    run_dir: str | Path,
    figures_dir: str | Path,
    results: dict[str, Any] | None = None,
):
    """What every artefact's ``run`` does: save ``<name>.csv`` in the run folder, render from the CSV as read
    back, copy CSV + outputs into ``figures_dir``. Returns the table as read back (its :func:`records` go into
    results.json) and the paths in ``figures_dir``."""
    stem = Path(run_dir) / name
    stem.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(stem.with_suffix(".csv"), index=False)
    table = read_table(stem.with_suffix(".csv"))
    written = call_render(render, table, stem, results)
    return table, _copy([stem.with_suffix(".csv"), *written], Path(figures_dir))


def write_markdown(stem: Path, lines: list[str]) -> Path:
    """``stem.md`` holding ``lines``: where every Markdown artefact's ``render`` ends."""
    path = stem.with_suffix(".md")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def skipped_line(row: dict[str, Any], label: str, blanks: int = 0) -> str | None:
    """The Markdown row of an entry that could not run (a string ``reason``: ``| label | skipped: reason |``
    and ``blanks`` empty cells), None for an entry with numbers."""
    reason = row.get("reason")
    return f"| {row[label]} | skipped: {reason} |" + " |" * blanks if isinstance(reason, str) else None


def start(cfg: Any) -> tuple[Any, Any, Any, str]:
    """``(cfg.experiment, model, tokenizer, device)``: how a runner that measures one model begins."""
    from experiments.evaluate import load

    return (cfg.experiment, *load(cfg))


def progress(items: Iterable, cfg: Any, name: str) -> Iterable:
    """``items`` with a progress bar named ``name`` (none with ``progress=false``)."""
    from tqdm.auto import tqdm

    return tqdm(items, desc=name, disable=not cfg.progress)


def publish_table(
    render: Callable[..., list[Path]],
    name: str,
    rows: list[dict[str, Any]],
    cfg: Any,
    model: Any,
    experiment: dict[str, Any],
    device: str,
    env: bool = False,
) -> dict[str, Any]:
    """How a table runner ends: ``publish`` its rows into this Hydra run's folder (the model and
    ``experiment`` as metadata; ``env``: the device too), print the Markdown it wrote, and return
    the results.json blocks."""
    import pandas as pd
    from hydra.core.hydra_config import HydraConfig

    from kvquant.models import model_info

    info = model_info(model, cfg.model.name)
    meta = {"model": info, "experiment": experiment} | ({"env": {"device": device}} if env else {})
    out = Path(HydraConfig.get().runtime.output_dir)
    table, written = publish(render, name, pd.DataFrame(rows), out, cfg.experiment.figures_dir, meta)
    print(written[-1].read_text(encoding="utf-8"))
    return {"model": info, "experiment": experiment, "table": records(table), "device": device}


def load(name: str, results_dir: str | Path = ROOT / "results"):
    """``(table, results)`` of the committed artefact ``name``, checked to agree with each other."""
    folder = Path(results_dir) / name
    csv, json_path = folder / f"{name}.csv", folder / RESULTS_FILE
    if not (csv.is_file() and json_path.is_file()):
        raise FiguresError(f"missing {_shown(csv)} or {_shown(json_path)}; make it with: {make_command(name)}")
    table = read_table(csv)
    results = json.loads(json_path.read_text(encoding="utf-8"))
    check_agrees(table, results.get("table"), str(folder))
    return table, results


def render_one(name: str, out_dir: str | Path, results_dir: str | Path = ROOT / "results") -> list[Path]:
    """Render ``name`` from its committed results into ``out_dir``; its CSV is copied beside the outputs."""
    table, results = load(name, results_dir)
    out_dir = Path(out_dir)
    written = call_render(artefact(name).render, table, out_dir / name, results)
    return [*_copy([Path(results_dir) / name / f"{name}.csv"], out_dir), *written]


def make_figures(
    results_dir: str | Path = ROOT / "results",
    out_dir: str | Path = ROOT / "figures",
    only: list[str] | None = None,
    allow_missing: bool = False,
) -> list[Path]:
    """Render every artefact (or ``only`` these); missing results raise one line per artefact, naming its command."""
    names = artefact_names()
    unknown = sorted(set(only or ()) - set(names))
    if unknown:
        raise FiguresError(f"unknown artefact {', '.join(unknown)}; artefacts: {', '.join(names)}")
    names = [n for n in names if not only or n in only]
    folder = Path(results_dir)
    missing = [n for n in names if not all((folder / n / f).is_file() for f in (f"{n}.csv", RESULTS_FILE))]
    where = {n: _shown(folder / n) for n in missing}
    lines = [f"missing {where[n]}/{{{n}.csv,{RESULTS_FILE}}}: make it with: {make_command(n)}" for n in missing]
    if missing and not allow_missing:
        raise FiguresError("\n".join(lines))
    for line in lines:
        print(f"skipped: {line}", file=sys.stderr)
    written = []
    for name in names:
        if name not in missing:
            written += render_one(name, out_dir, folder)
    return written


def thumbnail(png: Path, folder: Path, width: int = 900) -> Path:
    """A small copy of ``png`` for the README (at most ``width`` pixels wide, palette PNG)."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    image = Image.open(png).convert("RGB")
    if image.width > width:
        image = image.resize((width, round(image.height * width / image.width)), Image.LANCZOS)
    target = folder / png.name
    image.quantize(colors=128).save(target, optimize=True)
    return target


def collect(run_dir: str | Path, results_dir: str | Path = ROOT / "results") -> Path:
    """Copy a finished run's results.json and CSV into ``results_dir/<NAME>/`` (after checking they agree)."""
    run_dir = Path(run_dir)
    json_path = run_dir / RESULTS_FILE
    if not json_path.is_file():
        raise FiguresError(f"{run_dir}: no {RESULTS_FILE} (did the run finish?)")
    results = json.loads(json_path.read_text(encoding="utf-8"))
    name = results.get("experiment", {}).get("name") or results.get("config", {}).get("experiment", {}).get("runner")
    names = artefact_names()
    if name not in names:
        raise FiguresError(f"{run_dir}: experiment '{name}' is not an artefact; artefacts: {', '.join(names)}")
    csv = run_dir / f"{name}.csv"
    if not csv.is_file():
        raise FiguresError(f"{run_dir}: no {name}.csv beside {RESULTS_FILE}")
    check_agrees(read_table(csv), results.get("table"), str(run_dir))
    target = Path(results_dir) / name
    _copy([csv], target)
    if _relative_locations(results):  # where this machine wrote the run is not part of the result
        from kvquant.results import config_hash, write_results

        results["config_hash"] = config_hash(results["config"])
        write_results(target, results)
    else:
        _copy([json_path], target)
    return target


def _relative_locations(results: dict[str, Any]) -> bool:
    """Replace absolute output folders in the run's config by the defaults (``outputs``, ``figures``), and
    the figures' location a runner records beside them; True if anything was replaced (the results are
    then rewritten, the config hash recomputed)."""
    config = results.get("config") or {}
    changed = False
    for block, key, default in (
        (config, "results_dir", "outputs"),
        (config.get("experiment") or {}, "figures_dir", "figures"),
    ):
        if isinstance(block.get(key), str) and Path(block[key]).is_absolute():
            block[key], changed = default, True
    experiment = results.get("experiment") or {}
    if isinstance(experiment.get("figures"), str) and Path(experiment["figures"]).is_absolute():
        experiment["figures"], changed = str(Path("figures") / Path(experiment["figures"]).name), True
    return changed


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["collect"]:
        parser = argparse.ArgumentParser(prog="python -m experiments.figures collect", description=collect.__doc__)
        parser.add_argument("run_dir", nargs="+", help="run folders holding results.json and <NAME>.csv")
        parser.add_argument("--results", default=str(ROOT / "results"), help="committed results (default: results/)")
        args = parser.parse_args(argv[1:])
        try:
            for run_dir in args.run_dir:
                print(f"collected {run_dir} -> {collect(run_dir, args.results)}")
        except FiguresError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0
    parser = argparse.ArgumentParser(prog="python -m experiments.figures", description=make_figures.__doc__)
    parser.add_argument("--results", default=str(ROOT / "results"), help="committed results (default: results/)")
    parser.add_argument("--out", default=str(ROOT / "figures"), help="where figures go (default: figures/)")
    parser.add_argument("--only", action="append", help="render only this artefact (repeatable)")
    parser.add_argument("--allow-missing", action="store_true", help="skip artefacts without results (a warning each)")
    parser.add_argument("--thumbnails", help="also write a small copy of each PNG here (the README's: docs/img)")
    args = parser.parse_args(argv)
    try:
        written = make_figures(args.results, args.out, args.only, args.allow_missing)
        if args.thumbnails:
            written += [thumbnail(p, Path(args.thumbnails)) for p in written if p.suffix == ".png"]
    except FiguresError as exc:
        for line in str(exc).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
