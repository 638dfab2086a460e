"""results.json: the contract between runs, tables, plots and W&B.

A run's identity is the hash of its resolved config minus where it writes (``results_dir``,
``hydra``), whether it forces (``rerun``) and how it is logged (``logger``): a sweep that finds a
results.json with the same hash skips that run. ``python -m kvquant.results DIR`` collects every
results.json under DIR into one table, each 95% interval as two columns (``ci95/<block>/<name>/lo``
and ``/hi``; absent for runs written before intervals existed or with one example).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from kvquant.fsutil import atomic_write_text

IGNORED_KEYS = ("results_dir", "rerun", "logger", "hydra", "progress")
RESULTS_FILE = "results.json"


def config_hash(config: dict[str, Any]) -> str:
    """Stable hash of a resolved config, ignoring output location, ``rerun`` and the logger."""
    kept = {k: v for k, v in config.items() if k not in IGNORED_KEYS}
    blob = json.dumps(kept, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def find_results(root: str | os.PathLike, digest: str) -> Path | None:
    """The first results.json under ``root`` whose ``config_hash`` is ``digest``."""
    root = Path(root)
    if not root.is_dir():
        return None
    for path in sorted(root.rglob(RESULTS_FILE)):
        try:
            if json.loads(path.read_text(encoding="utf-8")).get("config_hash") == digest:
                return path
        except (OSError, json.JSONDecodeError):
            continue
    return None


def drop_missing(obj: Any) -> Any:
    """Remove None/NaN leaves: absent keys are omitted, never filled with placeholders."""
    if isinstance(obj, dict):
        out = {k: drop_missing(v) for k, v in obj.items()}
        return {k: v for k, v in out.items() if v is not None and v != {}}
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    return obj


def write_results(run_dir: str | os.PathLike, results: dict[str, Any]) -> Path:
    """Write ``results.json`` atomically (a crash never leaves a half file that a resume would trust)."""
    cleaned = {k: (v if k == "config" else drop_missing(v)) for k, v in results.items()}
    cleaned = {k: v for k, v in cleaned.items() if v is not None and v != {}}
    text = json.dumps(cleaned, indent=2, sort_keys=False, default=str, allow_nan=False)
    return atomic_write_text(Path(run_dir) / RESULTS_FILE, text + "\n")


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def git_commit(path: str | os.PathLike | None = None) -> str | None:
    """Commit of the checkout holding this package (``+dirty`` when it has uncommitted changes)."""
    where = Path(path) if path else Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=where,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return sha.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


@functools.cache
def code_commit() -> str | None:
    """``git_commit()`` read once per process, at the first call (``run.py`` makes it before a run starts):
    a run that outlives a commit records the code it ran, not the HEAD it finished at."""
    return git_commit()


def env_info(device: str | None = None) -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "lm_eval": _version("lm_eval"),
        "hydra": _version("hydra-core"),
        "git_commit": code_commit(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "device": device,
    }


def flatten(obj: dict[str, Any], prefix: str = "", sep: str = "/") -> dict[str, Any]:
    """``{"bits": {"read": 12}}`` → ``{"bits/read": 12}`` (the names W&B and the CSV use)."""
    out: dict[str, Any] = {}
    for key, value in obj.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, dict):
            out.update(flatten(value, name, sep))
        else:
            out[name] = value
    return out


def split_intervals(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"ci95/metrics/ppl": [lo, hi]}`` → ``{"ci95/metrics/ppl/lo": lo, "ci95/metrics/ppl/hi": hi}``."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        if key.startswith("ci95/") and isinstance(value, (list, tuple)) and len(value) == 2:
            out[f"{key}/lo"], out[f"{key}/hi"] = value
        else:
            out[key] = value
    return out


def collect(root: str | os.PathLike):
    """Every results.json under ``root`` as one pandas DataFrame (one row per run, config excluded,
    intervals split into ``…/lo`` and ``…/hi`` columns)."""
    import pandas as pd

    rows = []
    for path in sorted(Path(root).rglob(RESULTS_FILE)):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            print(f"skipping unreadable {path}: {exc}", file=sys.stderr)
            continue
        data.pop("config", None)
        rows.append({"path": str(path.parent), **split_intervals(flatten(data))})
    return pd.DataFrame(rows)


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvquant.results", description="Collect results.json files.")
    parser.add_argument("root", nargs="?", default="outputs", help="folder to search (default: outputs)")
    parser.add_argument("--csv", help="also write the table to this CSV file")
    parser.add_argument(
        "--columns",
        default="model/name,method/name,task/name,metrics/ppl,ci95/metrics/ppl/lo,ci95/metrics/ppl/hi,"
        "fidelity/greedy_match,fidelity/kl,ci95/fidelity/kl/lo,ci95/fidelity/kl/hi,bits/stored,bits/read,"
        "timing/decode_tok_s",
        help="comma-separated columns to print ('all' for every column)",
    )
    args = parser.parse_args(argv)
    table = collect(args.root)
    if table.empty:
        print(f"no {RESULTS_FILE} under {args.root}", file=sys.stderr)
        return 1
    if args.csv:
        table.to_csv(args.csv, index=False)
        print(f"wrote {len(table)} rows to {args.csv}")
    shown = table if args.columns == "all" else table[[c for c in args.columns.split(",") if c in table.columns]]
    print(shown.to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
