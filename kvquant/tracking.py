"""Weights & Biases logging: offline by default, and never able to lose the local results.

One W&B run per results.json, named so a dashboard compares methods without editing:

- ``group`` = the experiment (the runner, or ``logger.group``), ``job_type`` = the task (the runner
  for paper artefacts), tags ``model:<m>``, ``method:<m>``, ``task:<t>``, ``experiment:<e>``;
- config = the resolved Hydra config flattened with dots (``method.name``, ``task.limit``), plus
  ``config_hash`` and ``env.*``, so the runs table groups and filters by any of them;
- metrics ``<task>/<metric>`` (``gsm8k/exact_match,strict-match``), ``fidelity/…``, ``bits/…``,
  ``memory/…``, ``timing/…``; each one with a 95% interval also as ``<name>/ci95_lo``,
  ``<name>/ci95_hi`` and ``<name>/n``, and the paired difference to fp16 as ``<task>/<metric>/vs_fp16``
  (with its own ``/ci95_lo``, ``/ci95_hi``, ``/n``); the other results.json blocks land in the
  summary as ``<block>/…``;
- media: every PNG in the run folder as ``figures/<stem>``, every CSV and Markdown table as
  ``tables/<stem>``, plus ``tables/results``, ``tables/examples`` and ``tables/bits_by_position``.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time
from pathlib import Path
from typing import Any

from kvquant.results import flatten

METRIC_BLOCKS = ("fidelity", "bits", "memory", "timing")
INTERVAL_BLOCKS = ("paired", "ci95", "n")  # results.json's interval blocks, logged beside the numbers they qualify
MAX_TABLE_ROWS = 10_000  # W&B refuses larger tables
SKIPPED_DIRS = {"wandb", ".hydra", ".submitit"}


def _cell(value: Any) -> Any:
    return value if value is None or isinstance(value, (int, float, str, bool)) else json.dumps(value, default=str)


def _scalar(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool))


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def experiment_name(results: dict[str, Any], group: str | None = None) -> str:
    """The W&B group: ``logger.group`` if set, else the runner (``evaluate``, ``fig_bitwidth``, …)."""
    return group or results.get("config", {}).get("experiment", {}).get("runner") or "evaluate"


def run_tags(results: dict[str, Any], experiment: str) -> list[str]:
    """``model:``/``method:``/``task:``/``experiment:`` tags, from the blocks the run measured.

    Method and task come from results.json, not the config, so a paper artefact (which ignores
    ``method=`` and ``task=``) is not tagged with the defaults it never used.
    """
    config = results.get("config", {})
    tags = []
    model = (results.get("model") or {}).get("name") or config.get("model", {}).get("name")
    for key, value in (
        ("model", model),
        ("method", (results.get("method") or {}).get("name")),
        ("task", (results.get("task") or {}).get("name")),
        ("experiment", experiment),
    ):
        if value:
            tags.append(f"{key}:{value}")
    return tags


def metric_names(results: dict[str, Any]) -> dict[str, Any]:
    """results.json's measured numbers under the W&B names: ``<task>/<metric>``, ``fidelity/…``, …."""
    task = (results.get("task") or {}).get("name") or experiment_name(results)
    out = {f"{task}/{k}": v for k, v in flatten(results.get("metrics") or {}).items()}
    for block in METRIC_BLOCKS:
        out.update(flatten(results.get(block) or {}, block))
    out.update(interval_names(results, task))
    return {k: v for k, v in out.items() if _scalar(v)}


def interval_names(results: dict[str, Any], task: str) -> dict[str, Any]:
    """The ``paired``, ``ci95`` and ``n`` blocks under the W&B name of the number each qualifies
    (absent in results.json files written before intervals existed: then nothing)."""

    def name(key: str) -> str:
        block, _, metric = key.partition("/")
        return {"metrics": f"{task}/{metric}", "paired": f"{task}/{metric}/vs_fp16"}.get(block, key)

    out: dict[str, Any] = {name(f"paired/{k}"): v for k, v in (results.get("paired") or {}).items()}
    for key, pair in (results.get("ci95") or {}).items():
        if isinstance(pair, (list, tuple)) and len(pair) == 2:
            out[f"{name(key)}/ci95_lo"], out[f"{name(key)}/ci95_hi"] = pair
    out.update({f"{name(key)}/n": n for key, n in (results.get("n") or {}).items()})
    return out


def summary_extras(results: dict[str, Any]) -> dict[str, Any]:
    """The other blocks' scalars (``model/params``, ``task/n``, ``env/host``, …)."""
    skipped = {"config", "config_hash", "metrics", "bits_by_position", *METRIC_BLOCKS, *INTERVAL_BLOCKS}
    rest = {k: v for k, v in results.items() if k not in skipped and isinstance(v, dict)}
    return {k: v for k, v in flatten(rest).items() if _scalar(v)}


def wandb_config(results: dict[str, Any]) -> dict[str, Any]:
    """The resolved config flattened with dots, plus ``config_hash`` and ``env.*``."""
    config = flatten(results.get("config") or {}, sep=".")
    config.update(flatten({"env": results.get("env") or {}}, sep="."))
    if results.get("config_hash"):
        config["config_hash"] = results["config_hash"]
    return {k: _cell(v) for k, v in config.items()}


def markdown_table(text: str) -> tuple[list[str], list[list[str]]] | None:
    """The first pipe table in ``text`` as (columns, rows), or None if there is none."""
    lines = [line.strip() for line in text.splitlines()]
    for i in range(len(lines) - 1):
        head, rule = lines[i], lines[i + 1]
        if head.startswith("|") and rule.startswith("|") and set(rule) <= set("|-: "):
            columns = [c.strip() for c in head.strip("|").split("|")]
            rows = []
            for line in lines[i + 2 :]:
                if not line.startswith("|"):
                    break
                cells = [c.strip() for c in line.strip("|").split("|")]
                rows.append((cells + [""] * len(columns))[: len(columns)])
            return columns, rows
    return None


def run_files(run_dir: str | os.PathLike, suffix: str) -> list[Path]:
    """Files with ``suffix`` the run wrote (W&B's and Hydra's own folders excluded)."""
    root = Path(run_dir)
    return sorted(
        p for p in root.rglob(f"*{suffix}") if p.is_file() and not SKIPPED_DIRS & set(p.relative_to(root).parts[:-1])
    )


def media(run_dir: str | os.PathLike) -> dict[str, Any]:
    """``figures/<stem>`` images and ``tables/<stem>`` tables from the run folder's PNG, CSV and Markdown files."""
    import pandas as pd
    import wandb

    out: dict[str, Any] = {}
    for path in run_files(run_dir, ".png"):
        out[f"figures/{path.stem}"] = wandb.Image(str(path))
    for path in run_files(run_dir, ".csv"):
        frame = pd.read_csv(path).head(MAX_TABLE_ROWS)
        out.setdefault(f"tables/{path.stem}", wandb.Table(dataframe=frame))
    for path in run_files(run_dir, ".md"):
        parsed = markdown_table(path.read_text(encoding="utf-8"))
        if parsed:
            out.setdefault(f"tables/{path.stem}", wandb.Table(columns=parsed[0], data=parsed[1][:MAX_TABLE_ROWS]))
    return out


def log_to_wandb(
    results: dict[str, Any],
    run_dir: str,
    project: str = "kvquant",
    entity: str | None = None,
    mode: str | None = None,
    tags: list[str] | None = None,
    name: str | None = None,
    examples: list[dict[str, Any]] | None = None,
    group: str | None = None,
    job_type: str | None = None,
) -> bool:
    """Log one run (names in the module docstring); return False (with a warning) on any failure.

    ``mode`` defaults to ``WANDB_MODE`` if the user set it, else ``offline`` (sync later with
    ``wandb sync <run_dir>/wandb/offline-run-*``). ``group`` overrides the experiment name.
    """
    try:
        import wandb

        experiment = experiment_name(results, group)
        task = (results.get("task") or {}).get("name")
        mode = mode or os.environ.get("WANDB_MODE") or "offline"
        run = wandb.init(
            project=project,
            entity=entity,
            mode=mode,
            dir=run_dir,
            name=name,
            group=experiment,
            job_type=job_type or task or experiment,
            tags=[*run_tags(results, experiment), *(tags or [])],
            config=wandb_config(results),
            reinit="finish_previous",
            settings=wandb.Settings(quiet=True),
        )
        metrics = metric_names(results)
        run.summary.update({**summary_extras(results), **metrics})
        logged: dict[str, Any] = {k: v for k, v in metrics.items() if _number(v)}
        row = {**metrics, **summary_extras(results)}
        logged["tables/results"] = wandb.Table(columns=list(row), data=[list(row.values())])
        series = results.get("bits_by_position")
        if series:  # mean bits read at each sequence length (AlignedKV-style methods)
            rows = [list(r) for r in zip(*series.values(), strict=True)]
            logged["tables/bits_by_position"] = wandb.Table(columns=list(series), data=rows[:MAX_TABLE_ROWS])
        if examples:  # per-example outputs, for diffing methods in the W&B UI
            columns = sorted({key for example in examples for key in example})
            data = [[_cell(example.get(c)) for c in columns] for example in examples[:MAX_TABLE_ROWS]]
            logged["tables/examples"] = wandb.Table(columns=columns, data=data)
        for key, value in media(run_dir).items():
            logged.setdefault(key, value)
        run.log(logged)
        run.finish()
        if mode == "offline":
            print(f"wandb: offline run in {run.dir.removesuffix('/files')} (wandb sync it; docs/sweeps.md)")
        return True
    except Exception as exc:  # W&B must never cost the local results
        print(
            f"warning: W&B logging failed ({type(exc).__name__}: {exc}); local results are kept in {run_dir}",
            file=sys.stderr,
        )
        return False


def _records(path: Path):
    """The protobuf records of a ``.wandb`` file (a LevelDB-style log: 32 KiB blocks, 7-byte headers)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B transaction log")
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _put(target: dict[str, Any], item: Any) -> None:
    keys = list(item.nested_key) or [item.key]
    for key in keys[:-1]:
        target = target.setdefault(key, {})
    target[keys[-1]] = json.loads(item.value_json)


def read_offline_run(run_path: str | os.PathLike, wait_s: float = 10.0) -> dict[str, Any]:
    """What an offline run holds (before ``wandb sync``): name, group, job_type, tags, config, summary, history.

    W&B's service finishes the file shortly after ``run.finish()`` returns: wait up to ``wait_s``
    for its exit record.
    """
    run_path = Path(run_path)
    [log] = run_path.glob("*.wandb")
    deadline = time.monotonic() + wait_s
    records = list(_records(log))
    while not any(r.WhichOneof("record_type") == "exit" for r in records) and time.monotonic() < deadline:
        time.sleep(0.05)
        records = list(_records(log))
    out: dict[str, Any] = {"config": {}, "summary": {}, "history": []}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            out.update(name=run.display_name, group=run.run_group, job_type=run.job_type, tags=list(run.tags))
            for item in run.config.update:
                _put(out["config"], item)
        elif kind == "config":
            for item in record.config.update:
                _put(out["config"], item)
        elif kind == "summary":
            for item in record.summary.update:
                _put(out["summary"], item)
        elif kind == "history":
            step: dict[str, Any] = {}
            for item in record.history.item:
                _put(step, item)
            out["history"].append(step)
    files = run_path / "files"
    out["files"] = sorted(str(p.relative_to(files)) for p in files.rglob("*") if p.is_file())
    return out
