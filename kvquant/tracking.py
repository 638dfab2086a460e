"""Weights & Biases logging: offline by default, and never able to lose the local results."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from kvquant.results import flatten


def _cell(value: Any) -> Any:
    return value if value is None or isinstance(value, (int, float, str, bool)) else json.dumps(value, default=str)


def log_to_wandb(
    results: dict[str, Any],
    run_dir: str,
    project: str = "kvquant",
    entity: str | None = None,
    mode: str | None = None,
    tags: list[str] | None = None,
    name: str | None = None,
    examples: list[dict[str, Any]] | None = None,
) -> bool:
    """Log config, metrics and a one-row results table; return False (with a warning) on any failure.

    ``mode`` defaults to ``WANDB_MODE`` if the user set it, else ``offline`` (sync later with
    ``wandb sync <run_dir>/wandb/offline-run-*``).
    """
    try:
        import wandb

        mode = mode or os.environ.get("WANDB_MODE") or "offline"
        run = wandb.init(
            project=project,
            entity=entity,
            mode=mode,
            dir=run_dir,
            name=name,
            tags=tags,
            config=results.get("config", {}),
            reinit="finish_previous",
        )
        flat = {
            k: v
            for k, v in flatten({k: v for k, v in results.items() if k != "config"}).items()
            if isinstance(v, (int, float, str, bool))
        }
        run.summary.update(flat)
        run.log({k: v for k, v in flat.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        run.log({"results": wandb.Table(columns=list(flat), data=[list(flat.values())])})
        series = results.get("bits_by_position")
        if series:  # mean bits read at each sequence length (AlignedKV-style methods)
            rows = [list(r) for r in zip(*series.values(), strict=True)]
            run.log({"bits_by_position": wandb.Table(columns=list(series), data=rows)})
        if examples:  # per-example outputs, for diffing methods in the W&B UI
            columns = sorted({key for example in examples for key in example})
            data = [[_cell(example.get(c)) for c in columns] for example in examples]
            run.log({"examples": wandb.Table(columns=columns, data=data)})
        run.finish()
        return True
    except Exception as exc:  # W&B must never cost the local results
        print(
            f"warning: W&B logging failed ({type(exc).__name__}: {exc}); local results are kept in {run_dir}",
            file=sys.stderr,
        )
        return False
