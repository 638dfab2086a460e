"""Add the intervals a finished cell lacks, recomputed from its own examples.jsonl (and fp16's).

For cells written before an interval rule changed: LongBench's average over tasks had none while the
bundled 2wikimqa holds one example; it now gets one with that example held fixed
(``kvquant.eval.intervals``). The recomputation uses the same examples and seed as the run, so every
interval, n and paired difference the cell already has must come out the same: any mismatch stops it
with nothing written. Only metric and paired keys are recomputed (fidelity needs per-unit numbers that
examples.jsonl does not keep).

    python -m experiments.reinterval <cell dir> --reference <fp16 cell dir>
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from experiments.evaluate import EXAMPLES_FILE
from kvquant.errors import KvquantError
from kvquant.eval import intervals
from kvquant.eval.reference import Reference
from kvquant.eval.tasks import get_task
from kvquant.results import RESULTS_FILE, write_results


def _rows(cell: Path) -> list[dict[str, Any]]:
    path = cell / EXAMPLES_FILE
    if not path.is_file():
        raise KvquantError(f"{path} not found: reinterval needs the cell's per-example rows")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _same(old: Any, new: Any) -> bool:
    if isinstance(old, list):
        return len(old) == len(new) and all(_same(a, b) for a, b in zip(old, new, strict=True))
    return math.isclose(float(old), float(new), rel_tol=1e-9, abs_tol=1e-12)


def reinterval(cell: str | Path, reference: str | Path | None = None) -> list[str]:
    """Add the ``ci95``/``n``/``paired`` keys ``cell`` lacks; return them (empty: nothing to add)."""
    cell = Path(cell)
    results = json.loads((cell / RESULTS_FILE).read_text(encoding="utf-8"))
    params = {k: v for k, v in results["config"]["task"].items() if k != "name"}
    task = get_task(results["config"]["task"]["name"], **params)
    if not hasattr(task, "paired"):
        raise KvquantError(f"task {task.name} has no per-example estimators; reinterval cannot recompute it")
    rows, keys = _rows(cell), list(results["metrics"])
    paired = None
    if reference is not None:  # fp16's rows as the reference values the run itself paired against
        paired = task.paired(rows, keys, Reference(values={str(r["id"]): r for r in _rows(Path(reference))}))
    ci95, counts, diffs, problems = intervals.blocks(
        {"metrics": task.estimators(rows, keys)}, {"metrics": results["metrics"]}, paired
    )
    if problems:
        raise KvquantError(f"{cell}: the examples do not reproduce the reported metrics: {'; '.join(problems)}")
    added = []
    for block, new in (("ci95", ci95), ("n", counts), ("paired", diffs)):
        have = results.get(block) or {}
        for key, value in new.items():
            if key in have and not _same(have[key], value):
                raise KvquantError(f"{cell}: {block}/{key} recomputes as {value}, the cell has {have[key]}")
        fresh = {key: value for key, value in new.items() if key not in have}
        added += [f"{block}/{key}" for key in fresh]
        results[block] = {**have, **fresh}
    if added:
        write_results(cell, results)
    return added


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cells", nargs="+", type=Path, help="cell folders (results.json + examples.jsonl)")
    parser.add_argument("--reference", type=Path, help="fp16's cell for the same task, for paired differences")
    args = parser.parse_args(argv)
    for cell in args.cells:
        try:
            added = reinterval(cell, args.reference)
        except KvquantError as err:
            raise SystemExit(f"error: {err}") from None
        print(f"{cell}: {'added ' + ', '.join(added) if added else 'nothing to add'}")


if __name__ == "__main__":
    main()
