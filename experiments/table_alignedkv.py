"""AlignedKV's headline check: bits read at long context, and greedy fidelity to fp16 over many prompts.

Part 1: one ``long_context``-token WikiText-2 prompt + ``long_new`` greedy tokens per method: mean
bits read for K, V and both, and the share of elements read at each width. Part 2: ``prompts``
consecutive ``prompt_tokens``-token windows, ``new_tokens`` greedy tokens each: share of generated
tokens equal to fp16's at the same position, share before the first divergence, prompts fully
identical, bits read. One CSV row per method; ``render`` writes ``table_alignedkv.md`` from the CSV.
(Formerly ``scripts/check_alignedkv.py``, which wrote no results.json.)
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from experiments.figures import progress, publish_table, start, write_markdown

NAME = "table_alignedkv"
NOTE = (
    "Bits read count the decode steps only (prefill attends in full precision, as in the paper) and include "
    "the metadata each step reads (the per-channel max of |K|; AlignedKV+'s block exponents). Widths: share "
    "of K and V elements read at each width. Tokens equal to fp16: share of generated positions whose greedy "
    "token equals fp16's on the same prompt."
)


def width_columns(prefix: str, widths: dict[int, float]) -> dict[str, float]:
    """``{"long_k8": share, ...}``: one column per width read (8/12/16 for AlignedKV, 13 for truncation)."""
    return {f"{prefix}{w}": share for w, share in widths.items()}


def _widths(row: dict[str, Any], side: str) -> str:
    found = sorted(
        (int(m.group(1)), v)
        for k, v in row.items()
        if (m := re.fullmatch(rf"long_{side}(\d+)", k)) and v == v  # NaN: width not read by this method
    )
    return " / ".join(f"{w}: {v:.2f}" for w, v in found) or "–"


def _num(value: Any, digits: int) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def render(table, stem: Path, results: dict[str, Any] | None = None) -> list[Path]:
    """``stem.md``: the two tables of the check (long-context bits read, greedy fidelity), from the CSV."""
    exp = (results or {}).get("experiment", {})
    model = (results or {}).get("model", {}).get("name", "")
    rows = table.to_dict(orient="records")
    lines = [
        f"## Bits read: {model} {exp.get('long_context', '?')}-token WikiText-2 prompt + {exp.get('long_new', '?')}"
        " greedy tokens",
        "",
        "| method | bits read K | bits read V | bits read | K widths (share) | V widths (share) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {_num(r['long_bits_read_k'], 2)} | {_num(r['long_bits_read_v'], 2)} "
            f"| {_num(r['long_bits_read'], 2)} | {_widths(r, 'k')} | {_widths(r, 'v')} |"
        )
    lines += [
        "",
        f"## Greedy fidelity to fp16: {exp.get('prompts', '?')} WikiText-2 windows of {exp.get('prompt_tokens', '?')}"
        f" tokens × {exp.get('new_tokens', '?')} greedy tokens",
        "",
        "| method | tokens equal to fp16 | before first divergence | prompts identical | bits read |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['greedy_match']:.4f} | {r['before_divergence']:.4f} "
            f"| {int(r['prompts_identical'])}/{int(r['prompts'])} | {_num(r['bits_read'], 2)} |"
        )
    skipped = exp.get("skipped") or {}
    lines += [f"| {label} | skipped: {reason} |" for label, reason in skipped.items()]
    return [write_markdown(stem, [*lines, "", NOTE])]


def run(cfg: DictConfig) -> dict[str, Any]:
    from experiments.greedy import build_methods, check_fits, compare, references, wikitext_ids, windows
    from kvquant.eval.fidelity import greedy_decode

    exp, model, tok, device = start(cfg)
    check_fits(model, int(exp.long_context), int(exp.long_new), "experiment.long_context")
    check_fits(model, int(exp.prompt_tokens), int(exp.new_tokens), "experiment.prompt_tokens")
    ids = wikitext_ids(tok)
    long_prompt = windows(ids, 1, int(exp.long_context))[0]
    prompts = windows(ids, int(exp.prompts), int(exp.prompt_tokens))
    methods, skipped = build_methods(OmegaConf.to_container(exp.methods, resolve=True))
    refs = references(model, prompts, int(exp.new_tokens))
    rows = []
    for label, method in progress(methods.items(), cfg, NAME):
        with method.attach(model):
            long = greedy_decode(model, long_prompt, method.new_cache(model), int(exp.long_new)).counts.summary()
            fid = compare(model, prompts, refs, lambda m=method: m.new_cache(model), int(exp.new_tokens)).row()
        rows.append(
            {
                "method": label,
                "long_bits_read_k": long["bits_read_k"],
                "long_bits_read_v": long["bits_read_v"],
                "long_bits_read": long["bits_read"],
                **width_columns("long_k", long["widths_k"]),
                **width_columns("long_v", long["widths_v"]),
                **fid,
            }
        )
    experiment = {
        "name": NAME,
        **{k: int(exp[k]) for k in ("long_context", "long_new", "prompts", "prompt_tokens", "new_tokens")},
        "skipped": skipped,
    }
    return publish_table(render, NAME, rows, cfg, model, experiment, device)
