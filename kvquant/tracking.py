"""Weights & Biases logging: offline by default, and never able to lose the local results."""

from __future__ import annotations

import os
import sys
from typing import Any

from kvquant.results import flatten


def log_to_wandb(
    results: dict[str, Any],
    run_dir: str,
    project: str = "kvquant",
    entity: str | None = None,
    mode: str | None = None,
    tags: list[str] | None = None,
    name: str | None = None,
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
        run.finish()
        return True
    except Exception as exc:  # W&B must never cost the local results
        print(
            f"warning: W&B logging failed ({type(exc).__name__}: {exc}); local results are kept in {run_dir}",
            file=sys.stderr,
        )
        return False
