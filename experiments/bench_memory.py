"""Benchmark: memory each method's cache really takes — held between steps, plus a decode step's peak.

Each method runs in a fresh process (so nothing one method allocated is charged to the next): the
model is loaded, one short forward warms it, and the process's peak resident memory is read (the
model-only baseline). Then, for each context (ascending), a fresh cache receives a WikiText-2 prefix
in chunks of ``chunk_size`` tokens and decodes one token. Per row:

- ``held_mib``: every tensor storage the cache holds after the step (``kvquant.analysis.memory.held_bytes``:
  codes, scales, windows, growth slack, working buffers it keeps);
- ``step_peak_mib``: the most bytes the decode step's ops had allocated at once (``StepPeak``): the
  transient of re-expanding a history to fp32, of dequantizing, of attention — and the model's own
  activations, which every method shares — plus the per-forward workspaces a kernel path reuses
  (``transient_bytes``: AQUA-KV's reconstruction buffers, overwritten every forward);
- ``total_mib`` = held before the step + step peak, and its ratio to fp16's at the same context;
- ``rss_over_model_mib``: the process's peak resident memory minus the model-only baseline (prefill
  included; allocator behaviour included: what a user's ``top`` would show).

``longest_context`` (per method, from its two longest contexts): the context at which ``total`` would
reach ``budget_mib``, extrapolated linearly from the measured bytes per token — labelled as such.
A method entry ``name@backend`` runs that method on that backend. ``render`` writes ``bench_memory.md``.
"""

from __future__ import annotations

import multiprocessing
import resource
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from experiments.figures import progress, publish_table, start, write_markdown

NAME = "bench_memory"
RESUME = "never"  # run.py: measured again on every run, never reused (memory depends on code, not config)
BASELINE = "fp16"
HF = "hf_dynamic"
MIB = 1 << 20


def _peak_rss() -> int:
    """This process's peak resident set, bytes (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def measure(model_name: str, entry: str, contexts: list[int], chunk_size: int, threads: int) -> list[dict[str, Any]]:
    """Rows for one cache (``name``, ``name@backend`` or ``hf_dynamic``) in this process, contexts ascending."""
    import torch
    from transformers import DynamicCache

    from experiments.bench_kv_methods import context_ids, method_spec
    from kvquant.analysis.memory import StepPeak, held_bytes, transient_bytes
    from kvquant.errors import KvquantError
    from kvquant.methods import get_method
    from kvquant.models import load_model

    if threads:
        torch.set_num_threads(threads)
    model, tokenizer = load_model(model_name)
    ids = context_ids(tokenizer, max(contexts) + 1)
    with torch.no_grad():
        model(input_ids=ids[None, :16], use_cache=True)
    baseline = _peak_rss()
    method = None
    if entry != HF:
        spec = method_spec(entry)[1]
        try:
            method = get_method(spec.pop("name"), **spec)
            method.new_cache(model)
        except KvquantError as exc:
            return [{"cache": entry, "status": " ".join(str(exc).split())}]
    rows = []
    for context in sorted(contexts):
        cache = DynamicCache(config=model.config) if method is None else method.new_cache(model)
        with torch.no_grad():
            for start in range(0, context, chunk_size):
                chunk = ids[None, start : min(start + chunk_size, context)]
                model(input_ids=chunk, past_key_values=cache, use_cache=True, logits_to_keep=1)
            held_before = held_bytes(cache)
            with StepPeak() as peak:
                model(input_ids=ids[None, context : context + 1], past_key_values=cache, use_cache=True)
            transient = transient_bytes(cache)  # a kernel path's per-forward workspace, alive the whole step
        stats = cache.stats() if hasattr(cache, "stats") else {}
        rows.append(
            {
                "cache": entry,
                "status": "ok",
                "context": context,
                "held_mib": held_bytes(cache) / MIB,
                "step_peak_mib": (peak.peak + transient) / MIB,
                "total_mib": (held_before + peak.peak + transient) / MIB,
                "rss_over_model_mib": (_peak_rss() - baseline) / MIB,
                "bits_stored": stats.get("bits_stored", 32.0 if method is None else float("nan")),
                "backend": getattr(cache, "backend", None) or "torch",
            }
        )
        del cache
    return rows


def longest_context(rows: list[dict[str, Any]], budget_mib: float) -> float | None:
    """Context at which ``total_mib`` reaches ``budget_mib``, extrapolated from the two longest contexts."""
    ok = sorted((r for r in rows if r.get("status") == "ok"), key=lambda r: r["context"])
    if len(ok) < 2:
        return None
    a, b = ok[-2], ok[-1]
    per_token = (b["total_mib"] - a["total_mib"]) / (b["context"] - a["context"])
    if per_token <= 0:
        return None
    return b["context"] + (budget_mib - b["total_mib"]) / per_token


def render(table, stem: Path, results: dict[str, Any] | None = None) -> list[Path]:
    """``stem.md``: held, step peak and total per cache and context (× fp16), then the budget column."""
    results = results or {}
    exp = results.get("experiment", {})
    budget = exp.get("budget_mib", "?")
    model = results.get("model", {}).get("name", "")
    ok = table[table.status == "ok"]
    lines = [
        f"## KV memory per cache{': ' + model if model else ''} (held between steps + one decode step's peak; "
        f"each cache in a fresh process; torch threads {exp.get('threads', '?')})",
        "",
        "| cache | backend | context | bits stored | held MiB | step peak MiB | held + peak MiB | × fp16 "
        "| process peak over model MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    fp16 = {int(r["context"]): r["total_mib"] for r in ok.to_dict(orient="records") if r["cache"] == BASELINE}
    for r in ok.to_dict(orient="records"):
        ratio = r["total_mib"] / fp16[int(r["context"])] if int(r["context"]) in fp16 else float("nan")
        lines.append(
            f"| {r['cache']} | {r['backend']} | {int(r['context'])} | {r['bits_stored']:.2f} | {r['held_mib']:.1f} "
            f"| {r['step_peak_mib']:.1f} | {r['total_mib']:.1f} | {ratio:.2f} | {r['rss_over_model_mib']:.0f} |"
        )
    for r in table[table.status != "ok"].to_dict(orient="records"):
        lines.append(f"| {r['cache']} | – | – | skipped: {r['status']} |||||")
    lines += [
        "",
        f"## Longest context within {budget} MiB of held + step peak (extrapolated from the measured MiB per "
        "token between the two longest contexts)",
        "",
        "| cache | longest context (tokens) |",
        "|---|---|",
    ]
    for cache, rows in ok.groupby("cache", sort=False):
        longest = longest_context(rows.to_dict(orient="records"), float(budget)) if budget != "?" else None
        lines.append(f"| {cache} | {'–' if longest is None else f'{longest:,.0f}'} |")
    return [write_markdown(stem, lines)]


def run(cfg: DictConfig) -> dict[str, Any]:
    exp, model, _, device = start(cfg)
    if device != "cpu":
        from kvquant.errors import InvalidParameterError

        raise InvalidParameterError("experiment=bench_memory measures the CPU path; run it with device=cpu")
    limit = int(exp.max_context) if exp.get("max_context") else None
    contexts = sorted({int(c) for c in exp.contexts})
    if limit is not None and contexts[-1] > limit:
        contexts = [c for c in contexts if c <= limit]
    entries = [BASELINE, *[str(m) for m in exp.methods if str(m) != BASELINE], HF]
    rows: list[dict[str, Any]] = []
    spawn = multiprocessing.get_context("spawn")
    args = (str(cfg.model.name), contexts, int(exp.chunk_size), int(exp.threads))
    for entry in progress(entries, cfg, NAME):
        with spawn.Pool(1) as pool:
            rows += pool.apply(measure, (args[0], entry, *args[1:]))
    experiment = {
        "name": NAME,
        "contexts": contexts,
        "chunk_size": int(exp.chunk_size),
        "threads": int(exp.threads),
        "budget_mib": float(exp.budget_mib),
        "methods": OmegaConf.to_container(exp.methods),
    }
    return publish_table(render, NAME, rows, cfg, model, experiment, device, env=True)
