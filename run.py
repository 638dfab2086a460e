"""kvquant entry point: ``python run.py method=<m> task=<t> [model=<name>] [-m for sweeps]``.

Composes the Hydra config, skips runs whose results already exist (same identity: the config hash
and the sha256 of any predictor file the method reads, ``experiments/identity.py``; ``rerun=true``
forces), dispatches to ``experiments/<runner>.py``, writes results.json atomically, then logs W&B.
A runner module may say how it resumes (``RESUME``): ``"run"`` (the default: a whole run is reused),
``"cells"`` (a table that reuses its cells, so the table run itself always runs) or ``"never"``
(timings, which depend on code and machine as much as on the config: always measured again, with the
C++ kernels' build key in ``env``). It is read from the module's source (a string literal), so a job
whose results exist is skipped before the runner, torch or transformers are imported.

In a sweep (``-m``) a job that fails with a ``KvquantError`` prints its one-line error, writes
``job.json`` (status ``failed``) in its folder and lets the others run; ``SweepReport`` (a Hydra
callback, ``conf/config.yaml``) then writes ``sweep.json`` in the sweep folder, prints one summary
line, and the process exits 1 if any job failed. A single run keeps exit code 2.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import re
import sys
import time
import warnings
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from kvquant.errors import KvquantError
from kvquant.fsutil import atomic_write_text
from kvquant.results import code_commit, config_hash, env_info, find_results, flatten, identity, write_results

TABLE_BLOCKS = ("metrics", "paired", "fidelity", "bits", "memory", "timing")
CONF = Path(__file__).resolve().parent / "conf"
GROUPS = ("model", "method", "task", "logger", "experiment")
JOB_FILE = "job.json"
SWEEP_FILE = "sweep.json"
RESUMES = ("run", "cells", "never")


def choices_of(value: str) -> list[str]:
    """The options of a group override value: ``kivi2``, ``kivi2,gear2`` or ``choice(kivi2,gear2)``."""
    return [c.strip() for c in value.removeprefix("choice(").removesuffix(")").split(",")]


def selected(group: str, argv: list[str]) -> list[str]:
    """The configs of ``group`` this command line selects: its override, else ``conf/config.yaml``'s default."""
    for arg in argv:
        if arg.startswith(f"{group}="):
            return choices_of(arg.split("=", 1)[1])
    defaults = OmegaConf.load(CONF / "config.yaml").defaults
    return [str(d[group]) for d in defaults if isinstance(d, DictConfig) and group in d]


def group_keys(group: str, choice: str) -> list[str]:
    """The parameters ``conf/<group>/<choice>.yaml`` sets, with those of the configs it inherits
    (``defaults: [kivi, _self_]`` in ``kivi2.yaml``)."""
    node = OmegaConf.load(CONF / group / f"{choice}.yaml")
    keys: list[str] = []
    for parent in node.get("defaults") or []:
        if isinstance(parent, str) and parent != "_self_":
            keys += [k for k in group_keys(group, parent) if k not in keys]
    return keys + [k for k in node if k not in ("name", "defaults") and k not in keys]


def check_choices(argv: list[str]) -> str | None:
    """One line naming an unknown group choice (``method=nope``) or an unknown parameter of the chosen
    method or task (``method.grup_size=8``, which Hydra would report as a struct error), else None."""
    for arg in argv:
        match = re.fullmatch(r"(model|method|task|logger|experiment)=([^=]+)", arg)
        if not match:
            continue
        group, value = match.groups()
        valid = sorted(p.stem for p in (CONF / group).glob("*.yaml"))
        for choice in choices_of(value):
            if choice not in valid:
                return f"unknown {group} '{choice}'; valid {group}s: {', '.join(valid)} (conf/{group}/*.yaml)"
    for arg in argv:
        match = re.fullmatch(r"(method|task)\.([A-Za-z_]\w*)[.=].*", arg)
        if not match:
            continue
        group, key = match.groups()
        for choice in selected(group, argv):
            accepted = group_keys(group, choice)
            if key not in accepted:
                return (
                    f"{group} '{choice}' has no parameter '{key}'; its parameters are: {', '.join(accepted) or 'none'}"
                    f" (conf/{group}/{choice}.yaml)"
                )
    return None


def print_table(cfg: DictConfig, results: dict) -> None:
    rows = flatten({k: results[k] for k in TABLE_BLOCKS if results.get(k)})
    width = max(map(len, rows), default=0)
    runner = cfg.experiment.runner
    names = [cfg.model.name, cfg.method.name, cfg.task.name] if runner == "evaluate" else [cfg.model.name, runner]
    print(" · ".join(names))
    ci95, counts = results.get("ci95") or {}, results.get("n") or {}
    for key, value in rows.items():
        shown = f"{value:.6g}" if isinstance(value, float) else value
        if key in ci95:
            shown = f"{shown}  [{ci95[key][0]:.6g}, {ci95[key][1]:.6g}]"
        if key in counts:
            shown = f"{shown}  (n={counts[key]})"
        print(f"  {key:<{width}}  {shown}")


def read_examples(path: Path) -> list[dict] | None:
    """Per-example outputs a task wrote beside results.json, if any."""
    if not path.is_file():
        return None
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def declared_resume(source: str) -> str | None:
    """The value of a module's top-level ``RESUME = "<literal>"`` (``"run"`` where it binds no ``RESUME``), or
    None where ``RESUME`` is bound any other way (computed, imported): then only importing the module tells."""
    found = "run"
    for node in ast.parse(source).body:
        names = [a.asname or a.name for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
        stored = [n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
        if "RESUME" not in names + stored:
            continue
        simple = isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["RESUME"]
        if not simple or not isinstance(node.value, ast.Constant) or not isinstance(node.value.value, str):
            return None
        found = node.value.value
    return found


def resume_of(runner: str) -> str:
    """How the runner module ``experiments.<runner>`` resumes (its ``RESUME``, default ``"run"``), checked.

    Read from the module's source where it is a literal, not by importing the module: a sweep job whose
    results exist is then skipped without loading torch and transformers (~8 s of CPU in each fresh job
    process of a resumed sweep)."""
    spec = importlib.util.find_spec(f"experiments.{runner}")
    origin = spec.origin if spec is not None else None
    resume = declared_resume(Path(origin).read_text(encoding="utf-8")) if origin and origin.endswith(".py") else None
    if resume is None:
        resume = getattr(importlib.import_module(f"experiments.{runner}"), "RESUME", "run")  # raises if not found
    if resume not in RESUMES:
        raise ValueError(f"experiments.{runner}.RESUME = {resume!r}; expected one of {RESUMES}")
    return resume


def execute(cfg: DictConfig, threads: int | None = None) -> tuple[str, Path]:
    """Run one job; ``("done", results.json)``, or ``("skipped", the existing results.json)``. ``threads``:
    torch's thread count for the run (set once it is known that the job runs)."""
    config = OmegaConf.to_container(cfg, resolve=True)
    digest = config_hash(config)
    if str(CONF.parent) not in sys.path:  # experiments/ from a SLURM node or worker started elsewhere
        sys.path.insert(0, str(CONF.parent))
    resume = resume_of(cfg.experiment.runner)
    if resume == "never":
        print(f"{cfg.experiment.runner} measures time: never reused from an earlier run, measured now")
    elif resume == "run" and not cfg.rerun:
        from experiments.identity import parameter_files

        existing = find_results(cfg.results_dir, identity(digest, parameter_files(cfg)))
        if existing is not None:
            print(f"skip: results for this config already exist at {existing} (rerun=true recomputes)")
            return "skipped", existing
    run_dir = HydraConfig.get().runtime.output_dir
    if threads:
        import torch

        torch.set_num_threads(threads)
    runner = importlib.import_module(f"experiments.{cfg.experiment.runner}")

    started = time.perf_counter()
    measured = runner.run(cfg)
    device = measured.pop("device", None)
    results = {"config": config, "config_hash": digest, **measured}
    results["timing"] = {"wall_s": time.perf_counter() - started, **measured.get("timing", {})}
    results["env"] = env_info(device, kernels=resume == "never")
    path = write_results(run_dir, results)
    print_table(cfg, results)
    print(f"results: {path}")

    if cfg.logger.name == "wandb":
        from kvquant.tracking import log_to_wandb

        names = [cfg.method.name, cfg.task.name] if cfg.experiment.runner == "evaluate" else [cfg.experiment.runner]
        log_to_wandb(
            results,
            run_dir,
            project=cfg.logger.project,
            entity=cfg.logger.entity,
            mode=cfg.logger.mode,
            tags=list(cfg.logger.tags),
            name="-".join([cfg.model.name, *names]),
            examples=read_examples(Path(run_dir) / "examples.jsonl"),
            group=cfg.logger.get("group"),
        )
    return "done", path


def job_threads(launcher: DictConfig) -> int | None:
    """Torch threads per job under the joblib launcher, so parallel jobs don't oversubscribe the cores.

    ``OMP_NUM_THREADS`` if set (joblib sets it in its workers to cores // n_jobs unless the user did),
    else the cores divided among the jobs run at once; None for other launchers (torch's default).
    """
    if "joblib" not in str(launcher.get("_target_", "")):
        return None
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    n_jobs = int(launcher.get("n_jobs") or 1)
    parallel = n_jobs if n_jobs > 0 else max(1, cores + 1 + n_jobs)  # joblib: -1 = every core
    return max(1, cores // parallel)


def record_job(status: str, **fields: object) -> None:
    """``job.json`` in this sweep job's folder, which ``SweepReport`` reads when the sweep ends."""
    hydra_cfg = HydraConfig.get()
    record = {"job": hydra_cfg.job.num, "status": status, "overrides": list(hydra_cfg.overrides.task), **fields}
    atomic_write_text(Path(hydra_cfg.runtime.output_dir) / JOB_FILE, json.dumps(record, default=str) + "\n")


class SweepReport(Callback):
    """Hydra callback: after a sweep, ``sweep.json`` in the sweep folder and one summary line.

    Jobs record themselves (``job.json``, written in their own folder, so parallel or remote jobs
    never share a file); this runs once, in the launching process, after every job has ended.
    """

    failed = 0  # read by ``__main__`` to set the exit code

    def on_multirun_end(self, config: DictConfig, **kwargs: object) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        jobs = []
        for path in sweep_dir.glob(f"*/{JOB_FILE}"):
            try:
                jobs.append(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, json.JSONDecodeError):
                continue
        jobs.sort(key=lambda job: job.get("job", 0))
        counts = {s: sum(job["status"] == s for job in jobs) for s in ("done", "skipped", "failed")}
        summary = atomic_write_text(sweep_dir / SWEEP_FILE, json.dumps({**counts, "jobs": jobs}, indent=2) + "\n")
        common = set.intersection(*(set(job["overrides"]) for job in jobs)) if len(jobs) > 1 else set()
        failed = [
            " ".join(o for o in job["overrides"] if o not in common) or f"#{job['job']}"
            for job in jobs
            if job["status"] == "failed"
        ]
        line = f"sweep: {len(jobs)} jobs, {counts['done']} done, {counts['skipped']} skipped, {len(failed)} failed"
        if failed:
            line += " (" + "; ".join(failed) + ")"
        print(f"{line}; {summary}", file=sys.stderr if failed else sys.stdout, flush=True)
        type(self).failed = len(failed)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    code_commit()  # the commit this run's code was loaded at, before it starts
    hydra_cfg = HydraConfig.get()
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    threads = job_threads(hydra_cfg.launcher)
    try:
        status, path = execute(cfg, threads)
    except KvquantError as exc:
        from experiments.calibrate import error_line  # a predictor error gets the calibrate command

        line = error_line(exc)
        print(f"error: {line}", file=sys.stderr, flush=True)
        if not sweeping:
            sys.exit(2)
        record_job("failed", error=line, threads=threads)
        return
    if sweeping:
        record_job(status, results=str(path), threads=threads)


if __name__ == "__main__":
    problem = check_choices(sys.argv[1:])
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    main()
    if SweepReport.failed:
        sys.exit(1)
