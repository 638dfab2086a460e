"""A table as a grid of cells, each cell one ordinary ``experiment=evaluate`` run, reused when it exists.

A cell is (method label → conf/method choice + parameters) × (task label → conf/task choice +
parameters) on the table run's model. Its config is composed exactly as

    python run.py <the table's own overrides, minus experiment/method/task> experiment=evaluate \
        method=<m> task=<t> ++method.<k>=<v> ++task.<k>=<v>

would compose it, so its config hash is the one run.py writes for that command line. A cell whose
identity (that hash, plus the sha256 of the predictor file an AQUA-KV cell reads:
``experiments/identity.py``) already has a results.json anywhere under ``results_dir`` (a finished cell
of an interrupted table, or a run of a plain sweep) is read, not recomputed; so after a recalibration
the AQUA-KV cells are computed again, and a cell that records no predictor digest (unverifiable) is
never reused. A new cell writes its results.json, in run.py's format, to
``<table run dir>/cells/<method>_<task>/``. A cell that raises ``KvquantError`` (aquakv without
predictors, CoQA offline, a group size the model cannot take) is kept as ``skipped`` with the error's
line, never a crash. When the cells with results come from different code commits or read different
digests of one predictor file, one warning line says so (``kvquant.results.mix_warning``).

Table runners (``table_tasks``, ``table_aquakv``) are artefacts in ``experiments.figures``' sense:
``NAME`` and ``render(table, stem)``, which writes the Markdown table / figure from the CSV alone.

Each CSV row carries the cell's headline metric with its 95% interval (``value_lo``, ``value_hi``),
its difference to fp16 on the same examples with that interval (``paired``, ``paired_lo``,
``paired_hi``), n, and every fidelity number with its interval (``<name>_lo``, ``<name>_hi``), read
from the cell's results.json ``ci95``/``paired`` blocks; a cell written before those blocks existed
(or with one example) has them empty, and the Markdown shows the number alone.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvquant.errors import InvalidParameterError, KvquantError
from kvquant.results import (
    RESULTS_FILE,
    config_hash,
    env_info,
    identity,
    mix_warning,
    result_identity,
    unverifiable,
    write_results,
)

CELLS_DIR = "cells"
CELL_GROUPS = ("experiment", "method", "task")  # set per cell; the table's own overrides of these are dropped
FIDELITY = ("greedy_match", "first_divergence", "kl", "top1_agreement", "answer_agreement")
DISPLAY_KEYS = ("metric", "scale")  # task-spec keys for the table itself, not handed to the task
SIMPLE = re.compile(r"[A-Za-z_][\w\-./]*")
HYDRA_WORDS = {"null", "true", "false", "inf", "nan"}
# Each task's headline metric and the factor that shows it in the published tables' units (%).
PRIMARY: dict[str, tuple[str, float]] = {
    "coqa": ("em", 1.0),
    "truthfulqa_gen": ("bleu_max", 1.0),
    "truthfulqa_mc2": ("mc2", 100.0),
    "gsm8k": ("exact_match_strict", 100.0),
    "longbench": ("longbench_avg", 1.0),
    "passkey": ("passkey_acc", 100.0),
    "wikitext": ("ppl", 1.0),
    "tinystories": ("ppl", 1.0),
}


@dataclass(frozen=True)
class Cell:
    """One evaluate run of the grid: row ``method`` (label) × column ``task`` (label)."""

    method: str
    method_name: str
    task: str
    task_name: str
    method_params: dict[str, Any] = field(default_factory=dict, hash=False)
    task_params: dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def overrides(self) -> list[str]:
        """The command-line overrides that select this cell (on top of the model and run settings)."""
        out = ["experiment=evaluate", f"method={self.method_name}", f"task={self.task_name}"]
        out += [f"++method.{k}={override_value(v)}" for k, v in self.method_params.items()]
        out += [f"++task.{k}={override_value(v)}" for k, v in self.task_params.items()]
        return out

    @property
    def slug(self) -> str:
        return re.sub(r"[^\w.\-]+", "-", f"{self.method}_{self.task}")


DONE = ("computed", "reused")  # the statuses of a cell with results (``skipped`` and ``pending`` have a reason)
PENDING = "not computed yet: the table run with experiment.compute=true (its default) computes it"


@dataclass
class CellResult:
    """A cell's outcome: ``computed`` now, ``reused`` from an existing results.json, ``skipped`` (it
    cannot run here), or ``pending`` (not found, and the run was asked not to compute)."""

    cell: Cell
    status: str
    config_hash: str
    path: Path | None = None
    results: dict[str, Any] | None = None
    reason: str | None = None


def override_value(value: Any) -> str:
    """``value`` in Hydra's override grammar (strings quoted when they would parse as something else)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{override_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if SIMPLE.fullmatch(text) and text.lower() not in HYDRA_WORDS:
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def split_spec(label: str, spec: Mapping | None, group: str) -> tuple[str, dict[str, Any]]:
    """``{name: <choice>, **params}`` (name defaults to the label) → (choice, params), the choice checked."""
    params = dict(spec or {})
    name = str(params.pop("name", label))
    conf = Path(__file__).resolve().parents[1] / "conf" / group
    valid = sorted(p.stem for p in conf.glob("*.yaml"))
    if name not in valid:
        raise InvalidParameterError(f"{label}: unknown {group} '{name}'; valid {group}s: {', '.join(valid)}")
    return name, params


def grid(methods: Mapping, tasks: Mapping) -> tuple[list[Cell], dict[str, tuple[str, float]]]:
    """Cells of ``methods`` × ``tasks`` (row-major, config order) and each task label's (metric, scale)."""
    rows = [(label, *split_spec(label, spec, "method")) for label, spec in methods.items()]
    cols, shown = [], {}
    for label, spec in tasks.items():
        spec = dict(spec or {})
        display = {k: spec.pop(k) for k in DISPLAY_KEYS if k in spec}
        cols.append((label, *split_spec(label, spec, "task")))
        shown[label] = metric_of(cols[-1][1], display)
    cells = [Cell(m, mn, t, tn, dict(mp), dict(tp)) for m, mn, mp in rows for t, tn, tp in cols]
    return cells, shown


def base_overrides(overrides: Iterable[str] | None = None) -> list[str]:
    """The table run's overrides that every cell keeps (model, device, seed, results_dir, …)."""
    if overrides is None:
        from hydra.core.hydra_config import HydraConfig

        overrides = HydraConfig.get().overrides.task
    kept = []
    for item in overrides:
        key = item.lstrip("~+").split("=", 1)[0]
        if key.split(".", 1)[0] not in CELL_GROUPS:
            kept.append(item)
    return kept


def cell_config(cell: Cell, base: list[str]) -> DictConfig:
    """The config run.py composes for ``base + cell.overrides`` (needs an initialised Hydra, as inside run.py)."""
    from hydra import compose

    return compose(config_name="config", overrides=[*base, *cell.overrides])


def command(cell: Cell, base: list[str]) -> str:
    """The run.py command line that computes (or, once done, skips) this cell on its own."""
    return " ".join(["python run.py", *base, *cell.overrides])


def results_index(root: str | Path) -> tuple[dict[str, Path], dict[str, Path]]:
    """Identity → the first results.json under ``root`` that has it (``find_results``' rule, one scan),
    and config hash → the first unverifiable one (never reused; named when its cell is recomputed)."""
    index: dict[str, Path] = {}
    unverified: dict[str, Path] = {}
    root = Path(root)
    if not root.is_dir():
        return index, unverified
    for path in sorted(root.rglob(RESULTS_FILE)):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        ident = result_identity(data)
        if ident:
            index.setdefault(ident, path)
        elif data.get("config_hash") and unverifiable(data):
            unverified.setdefault(str(data["config_hash"]), path)
    return index, unverified


def one_line(exc: BaseException) -> str:
    from experiments.calibrate import error_line

    return error_line(exc) or type(exc).__name__


def run_cells(
    cfg: DictConfig, cells: list[Cell], run_dir: str | Path, base: list[str] | None = None, compute: bool = True
) -> list[CellResult]:
    """Each cell's results: reused from ``cfg.results_dir`` when its hash exists, else computed and written
    (or, with ``compute`` false, listed as pending: a long table's finished part, rendered between sessions)."""
    from experiments import evaluate
    from experiments.identity import parameter_files

    base = base_overrides() if base is None else base
    index, unverified = results_index(cfg.results_dir)
    models: dict[str, tuple] = {}
    out: list[CellResult] = []
    for cell in cells:
        cell_cfg = cell_config(cell, base)
        config = OmegaConf.to_container(cell_cfg, resolve=True)
        digest = config_hash(config)
        try:
            ident = identity(digest, parameter_files(cell_cfg))
        except KvquantError as exc:  # its predictor file is missing or made for another model
            out.append(CellResult(cell, "skipped", digest, reason=one_line(exc)))
            print(f"cell {cell.method} × {cell.task}: skipped: {out[-1].reason}")
            continue
        found = index.get(ident)
        if found is None and digest in unverified:
            print(f"cell {cell.method} × {cell.task}: {unverified[digest]} records no predictor digest: not reused")
        if found is not None:
            out.append(CellResult(cell, "reused", digest, found, json.loads(found.read_text(encoding="utf-8"))))
            print(f"cell {cell.method} × {cell.task}: reused {found}")
            continue
        if not compute:
            out.append(CellResult(cell, "pending", digest, reason=PENDING))
            print(f"cell {cell.method} × {cell.task}: pending")
            continue
        folder = Path(run_dir) / CELLS_DIR / cell.slug
        try:
            key = json.dumps([config["model"], config["device"]], sort_keys=True, default=str)
            if key not in models:
                models[key] = evaluate.load(cell_cfg)
            model = models[key][0]
            from kvquant.methods import get_method

            get_method(cell_cfg.method.name, **evaluate.params_of(cell_cfg.method)).new_cache(model)  # fail early
            started = time.perf_counter()
            measured = evaluate.run(cell_cfg, out_dir=folder, loaded=models[key])
        except KvquantError as exc:
            out.append(CellResult(cell, "skipped", digest, reason=one_line(exc)))
            print(f"cell {cell.method} × {cell.task}: skipped: {out[-1].reason}")
            continue
        device = measured.pop("device", None)
        results = {"config": config, "config_hash": digest, **measured}
        results["timing"] = {"wall_s": time.perf_counter() - started, **measured.get("timing", {})}
        results["env"] = env_info(device)
        path = write_results(folder, results)
        index[ident] = path
        out.append(CellResult(cell, "computed", digest, path, json.loads(path.read_text(encoding="utf-8"))))
        print(f"cell {cell.method} × {cell.task}: {results['timing']['wall_s']:.1f}s, {path}")
    warning = mix_warning([r.results for r in out if r.status in DONE and r.results], "cells of this table")
    if warning:
        print(warning, file=sys.stderr, flush=True)
    return out


def shown_path(path: Path) -> str:
    """``path`` relative to the working directory where it lies below it (committed CSVs name no home folders)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def bounds(data: Mapping[str, Any], key: str) -> tuple[float | None, float | None]:
    """``(lo, hi)`` of ``ci95[key]`` in a results.json, ``(None, None)`` where it has none (n = 1, or older)."""
    pair = (data.get("ci95") or {}).get(key)
    if isinstance(pair, (list, tuple)) and len(pair) == 2:
        return float(pair[0]), float(pair[1])
    return None, None


def cell_row(result: CellResult, metric: str, scale: float = 1.0) -> dict[str, Any]:
    """One CSV row: the cell's primary metric, n, fidelity, bits and time, each number with its interval,
    straight from its results.json."""
    cell, data = result.cell, result.results or {}
    metrics, fidelity, bits = data.get("metrics", {}), data.get("fidelity", {}), data.get("bits", {})
    value_lo, value_hi = bounds(data, f"metrics/{metric}")
    paired_lo, paired_hi = bounds(data, f"paired/{metric}")
    with_bounds: dict[str, Any] = {}
    for name in FIDELITY:
        lo, hi = bounds(data, f"fidelity/{name}")
        with_bounds |= {name: fidelity.get(name), f"{name}_lo": lo, f"{name}_hi": hi}
    reason = result.reason
    if result.status in DONE and metric not in metrics:
        reason = f"no metric '{metric}' in {result.path}; it has: {', '.join(sorted(metrics))}"
    return {
        "source": "ours",
        "model": (data.get("model") or {}).get("name"),
        "method": cell.method,
        "method_name": cell.method_name,
        "method_params": json.dumps(cell.method_params, sort_keys=True),
        "task": cell.task,
        "task_name": cell.task_name,
        "status": result.status,
        "metric": metric,
        "value": metrics.get(metric),
        "value_lo": value_lo,
        "value_hi": value_hi,
        "paired": (data.get("paired") or {}).get(metric),
        "paired_lo": paired_lo,
        "paired_hi": paired_hi,
        "scale": scale,
        "n": (data.get("task") or {}).get("n"),
        **with_bounds,
        "bits_stored": bits.get("stored"),
        "bits_read": bits.get("read"),
        "bits_analytic": bits.get("analytic_stored"),
        "wall_s": (data.get("timing") or {}).get("wall_s"),
        "config_hash": result.config_hash,
        "results": shown_path(result.path) if result.path else None,
        "reason": reason,
    }


def counts(results: list[CellResult]) -> dict[str, int]:
    return {s: sum(r.status == s for r in results) for s in (*DONE, "skipped", "pending")}


def footnotes(table) -> tuple[dict[str, int], list[str]]:
    """Each distinct skip reason numbered once (a Markdown table cell cannot hold a long line)."""
    numbers: dict[str, int] = {}
    for reason in table["reason"].dropna() if "reason" in table else []:
        numbers.setdefault(str(reason), len(numbers) + 1)
    return numbers, [f"[{i}] {reason}" for reason, i in numbers.items()]


def missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def fmt(value: Any, digits: int = 2, sign: bool = False) -> str:
    if missing(value):
        return "–"
    return f"{float(value):{'+' if sign else ''}.{digits}f}"


def fmt_ci(value: Any, lo: Any, hi: Any, digits: int = 2, scale: float = 1.0, sign: bool = False) -> str:
    """``value [lo, hi]`` (each times ``scale``), or the value alone where the interval is missing."""
    if missing(value):
        return "–"
    text = fmt(value * scale, digits, sign)
    if missing(lo) or missing(hi):
        return text
    return f"{text} [{fmt(lo * scale, digits, sign)}, {fmt(hi * scale, digits, sign)}]"


def excludes_zero(lo: Any, hi: Any, n: Any) -> bool:
    """Whether a paired interval lies on one side of 0 with enough examples (``MIN_N_CLAIM``) for the
    bootstrap to be trusted: a difference beyond resampling noise."""
    from kvquant.eval.intervals import MIN_N_CLAIM

    enough = not missing(n) and n >= MIN_N_CLAIM
    return enough and not (missing(lo) or missing(hi)) and (lo > 0 or hi < 0)


def metric_of(task_name: str, display: Mapping[str, Any]) -> tuple[str, float]:
    """The metric a table shows for a task (``metric``/``scale`` in the task spec override the default)."""
    metric, scale = PRIMARY.get(task_name, (None, 1.0))
    metric = display.get("metric", metric)
    if metric is None:
        raise InvalidParameterError(f"task '{task_name}' has no default table metric; give its spec a metric:")
    return str(metric), float(display.get("scale", scale))


def rows_for(results: list[CellResult], shown: Mapping[str, tuple[str, float]]) -> list[dict[str, Any]]:
    """CSV rows for every cell, in grid order, each with its task's (metric, scale) from ``grid``."""
    return [cell_row(r, *shown[r.cell.task]) for r in results]


def run_table(
    cfg: DictConfig,
    name: str,
    render: Callable,
    extra_rows: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """A table runner's whole ``run``: the grid of ``cfg.experiment``, its cells, the CSV (plus
    ``extra_rows(ours)``, e.g. published numbers) rendered and published, and the results.json blocks."""
    import pandas as pd
    from hydra.core.hydra_config import HydraConfig

    from experiments.figures import publish, records

    exp = cfg.experiment
    cells, shown = grid(
        OmegaConf.to_container(exp.methods, resolve=True), OmegaConf.to_container(exp.tasks, resolve=True)
    )
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    results = run_cells(cfg, cells, run_dir, compute=bool(exp.get("compute", True)))
    ours = rows_for(results, shown)
    rows = [*ours, *(extra_rows(ours) if extra_rows else [])]
    table, _ = publish(render, name, pd.DataFrame(rows), run_dir, exp.figures_dir)
    print((run_dir / f"{name}.md").read_text(encoding="utf-8"))
    return {
        "experiment": {"name": name, "cells": counts(results), "figures": str(Path(exp.figures_dir) / name)},
        "table": records(table),
    }
