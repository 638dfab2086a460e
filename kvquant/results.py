"""results.json: the contract between runs, tables, plots and W&B.

A run's identity is the hash of its resolved config minus where it writes (``results_dir``,
``hydra``), whether it forces (``rerun``) and how it is logged (``logger``), combined with the sha256
of every parameter file its method reads (AQUA-KV's predictors: a recalibration keeps the file name,
not its digest): a sweep that finds a results.json with the same identity skips that run. A result
whose config names such a file (``FILE_PARAMS``) but which records no digest of it
(``method.files.<name>.sha256``, written since 2f7f30f) is *unverifiable*: it is never reused.
``python -m kvquant.results DIR`` collects every results.json under DIR into one table, each 95%
interval as two columns (``ci95/<block>/<name>/lo`` and ``/hi``; absent for runs written before
intervals existed or with one example), lists the unverifiable results, and warns in one line when the
results come from different code commits or different digests of one parameter file.
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
#: method parameters that name a file the method reads its parameters from (``null``: a default path)
FILE_PARAMS = ("predictors",)


def config_hash(config: dict[str, Any]) -> str:
    """Stable hash of a resolved config, ignoring output location, ``rerun`` and the logger."""
    kept = {k: v for k, v in config.items() if k not in IGNORED_KEYS}
    blob = json.dumps(kept, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def identity(digest: str, files: dict[str, str] | None = None) -> str:
    """A run's identity: its config hash ``digest`` and the sha256 of each parameter file it reads
    (``{name: sha256}``). Without files it is the config hash itself, so results of runs that read
    none keep the identity they were written with."""
    if not files:
        return digest
    blob = json.dumps({"config_hash": digest, "files": files}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def recorded_files(data: dict[str, Any]) -> dict[str, str]:
    """``{name: sha256}`` of the parameter files a results.json says its method read (``method.files``)."""
    files = (data.get("method") or {}).get("files") or {}
    return {name: f["sha256"] for name, f in files.items() if isinstance(f, dict) and f.get("sha256")}


def unverifiable(data: dict[str, Any]) -> list[str]:
    """The file parameters a result's config names (its method reads such a file) whose digest the
    result does not record: nothing says which file it was made with."""
    method = (data.get("config") or {}).get("method") or {}
    recorded = recorded_files(data)
    return [name for name in FILE_PARAMS if isinstance(method, dict) and name in method and name not in recorded]


def result_identity(data: dict[str, Any]) -> str | None:
    """The identity of a written result (``identity`` of its hash and the recorded digests of the files
    its config names); None for an unverifiable result or one without a hash, which no run reuses."""
    digest = data.get("config_hash")
    if not isinstance(digest, str) or unverifiable(data):
        return None
    method = (data.get("config") or {}).get("method") or {}
    named = {k: v for k, v in recorded_files(data).items() if k in FILE_PARAMS and k in method}
    return identity(digest, named)


def find_results(root: str | os.PathLike, ident: str) -> Path | None:
    """The first results.json under ``root`` whose identity (``result_identity``) is ``ident``."""
    root = Path(root)
    if not root.is_dir():
        return None
    for path in sorted(root.rglob(RESULTS_FILE)):
        try:
            if result_identity(json.loads(path.read_text(encoding="utf-8"))) == ident:
                return path
        except (OSError, json.JSONDecodeError, AttributeError):
            continue
    return None


def file_role(record: dict[str, Any]) -> str:
    """Which file a ``method.files`` entry is, across machines: its folder and name (the predictor
    folder itself differs from one home to the next)."""
    path = Path(str(record.get("path", "?")))
    return f"{path.parent.name}/{path.name}"


def mix_warning(results: list[dict[str, Any]], what: str = "results") -> str | None:
    """One line when ``results`` (results.json contents, ``what`` in the line) come from different code
    commits (``env.git_commit``) or read different digests of the same parameter file; None when they agree."""
    commits = sorted({c for r in results if (c := (r.get("env") or {}).get("git_commit"))})
    digests: dict[str, set[str]] = {}
    for r in results:
        for record in ((r.get("method") or {}).get("files") or {}).values():
            if isinstance(record, dict) and record.get("sha256"):
                digests.setdefault(file_role(record), set()).add(str(record["sha256"]))
    parts = []
    if len(commits) > 1:
        short = ", ".join(c[:7] + ("+dirty" if c.endswith("+dirty") else "") for c in commits)
        parts.append(f"{len(commits)} code commits ({short})")
    parts += [
        f"{len(shas)} digests of {role} ({', '.join(s[:12] for s in sorted(shas))})"
        for role, shas in sorted(digests.items())
        if len(shas) > 1
    ]
    if not parts:
        return None
    return f"warning: {len(results)} {what} mix {'; '.join(parts)}: the numbers may not be comparable"


def kernels_build_key() -> str | None:
    """The C++ kernels' build key (sources, compiler, flags, CPU), which a timing depends on; None where
    ``kernels_cpu`` cannot say (imported lazily: this module runs where the kernels are absent)."""
    try:
        from kernels_cpu.loader import build_key

        return build_key()
    except Exception:  # any failure (no compiler, sources moved) means: no key to record
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


def env_info(device: str | None = None, kernels: bool = False) -> dict[str, Any]:
    """Where a result was made; ``kernels``: also the C++ kernels' build key (a timing depends on it)."""
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
        **({"kernels_cpu_build_key": kernels_build_key()} if kernels else {}),
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
        missing = unverifiable(data)
        data.pop("config", None)
        row = {"path": str(path.parent), **split_intervals(flatten(data))}
        rows.append(row | ({"unverifiable": ",".join(missing)} if missing else {}))
    return pd.DataFrame(rows)


def read_all(root: str | os.PathLike) -> list[dict[str, Any]]:
    """Every readable results.json under ``root``, parsed (what ``mix_warning`` reads)."""
    out = []
    for path in sorted(Path(root).rglob(RESULTS_FILE)):
        try:
            out.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, json.JSONDecodeError):
            continue
    return out


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
    if "unverifiable" in table:
        listed = table[table["unverifiable"].notna()]
        print(
            f"unverifiable: {len(listed)} results read a parameter file without recording its sha256 "
            "(method.files); no run reuses them:"
        )
        for row in listed.itertuples():
            print(f"  {row.path} ({row.unverifiable})")
    warning = mix_warning(read_all(args.root))
    if warning:
        print(warning, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
