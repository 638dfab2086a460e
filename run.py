"""kvquant entry point: ``python run.py method=<m> task=<t> [model=<name>] [-m for sweeps]``.

Composes the Hydra config, skips runs whose results already exist (same config hash; ``rerun=true``
forces), dispatches to ``experiments/<runner>.py``, writes results.json atomically, then logs W&B.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import time
import warnings
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from kvquant.errors import KvquantError
from kvquant.results import config_hash, env_info, find_results, flatten, write_results

TABLE_BLOCKS = ("metrics", "fidelity", "bits", "memory", "timing")
CONF = Path(__file__).resolve().parent / "conf"
GROUPS = ("model", "method", "task", "logger", "experiment")


def check_choices(argv: list[str]) -> str | None:
    """One line naming an unknown group choice (e.g. ``method=nope``) and the valid ones, else None."""
    for arg in argv:
        match = re.fullmatch(r"(model|method|task|logger|experiment)=([^=]+)", arg)
        if not match:
            continue
        group, value = match.groups()
        valid = sorted(p.stem for p in (CONF / group).glob("*.yaml"))
        for choice in value.removeprefix("choice(").removesuffix(")").split(","):
            if choice.strip() not in valid:
                return f"unknown {group} '{choice.strip()}'; valid {group}s: {', '.join(valid)} (conf/{group}/*.yaml)"
    return None


def print_table(cfg: DictConfig, results: dict) -> None:
    rows = flatten({k: results[k] for k in TABLE_BLOCKS if results.get(k)})
    width = max(map(len, rows), default=0)
    runner = cfg.experiment.runner
    names = [cfg.model.name, cfg.method.name, cfg.task.name] if runner == "evaluate" else [cfg.model.name, runner]
    print(" · ".join(names))
    for key, value in rows.items():
        shown = f"{value:.6g}" if isinstance(value, float) else value
        print(f"  {key:<{width}}  {shown}")


def read_examples(path: Path) -> list[dict] | None:
    """Per-example outputs a task wrote beside results.json, if any."""
    if not path.is_file():
        return None
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def execute(cfg: DictConfig) -> dict | None:
    config = OmegaConf.to_container(cfg, resolve=True)
    digest = config_hash(config)
    if not cfg.rerun:
        existing = find_results(cfg.results_dir, digest)
        if existing is not None:
            print(f"skip: results for this config already exist at {existing} (rerun=true recomputes)")
            return None
    run_dir = HydraConfig.get().runtime.output_dir
    runner = importlib.import_module(f"experiments.{cfg.experiment.runner}")

    started = time.perf_counter()
    measured = runner.run(cfg)
    device = measured.pop("device", None)
    results = {"config": config, "config_hash": digest, **measured}
    results["timing"] = {"wall_s": time.perf_counter() - started, **measured.get("timing", {})}
    results["env"] = env_info(device)
    path = write_results(run_dir, results)
    print_table(cfg, results)
    print(f"results: {path}")

    if cfg.logger.name == "wandb":
        from kvquant.tracking import log_to_wandb

        log_to_wandb(
            results,
            run_dir,
            project=cfg.logger.project,
            entity=cfg.logger.entity,
            mode=cfg.logger.mode,
            tags=list(cfg.logger.tags),
            name=f"{cfg.model.name}-{cfg.method.name}-{cfg.task.name}",
            examples=read_examples(Path(run_dir) / "examples.jsonl"),
        )
    return results


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        execute(cfg)
    except KvquantError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    problem = check_choices(sys.argv[1:])
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    main()
