"""Latency of the KV part of one decode step vs position, on the caches users get, against fp16 in the same run.

``kvquant.analysis.timing.decode_step_time`` for each method (built with ``experiment.backend``
where the method has a backend: the C++ kernels, CuPy or torch, as ``auto`` resolves on this
machine) and each attention shape with its contexts (smollm2_135m up to 8K, Llama-2-7B's 32×128 up
to 32K); fp16 on the same backend is the ratio's baseline and transformers' ``DynamicCache``
(``hf_dynamic``) the outside reference. Beside each time: bits and bytes read per step and the
rate they were read at, next to the machine's measured copy bandwidth, and the byte-proportional
ideal ratio (bits read / 16: what reading fewer bytes alone would give). ``v_blocks`` adds each
AlignedKV method at those value-width blocks (``<name> v_block=<b>``); ``batches`` times every cell
at those numbers of sequences. ``step_layouts`` adds whole decode steps (``model_step_time``: one token
through every layer of a random-weight model of a hub layout, no weights needed) at ``step_contexts``,
against fp16 and ``DynamicCache`` on the same model (``kind`` = ``step``; ``attention`` for the KV part
alone). Writes ``fig_latency.{csv,png,pdf}``: time per step (left) and ratio to fp16 (right), one row
per shape, batch and layout. ``render`` redraws the figure from the CSV alone (``make figures``),
titles from results.json.

On a GPU (``device=cuda``, ``experiment.backend=cupy`` or ``auto``) the same command gives the GPU rows:
``'experiment.shapes=[llama2_7b,llama3.1_8b]' 'experiment.batches=[1,8]'`` with contexts up to 128K, and
``'experiment.step_layouts=[llama2_7b]' 'experiment.step_contexts=[4096,32768]'``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from experiments.figures import publish, records
from kvquant.plots import method_color, pyplot, save_figure

NAME = "fig_latency"
RESUME = "never"  # run.py: timings are measured again on every run, never reused
BASELINE = "fp16"


def panels(table) -> list[tuple[str, str, int]]:
    """``(kind, shape, batch)`` of each row of the figure, in the table's order (a CSV written before whole
    steps and batches were timed holds attention rows of batch 1)."""
    kinds = table["kind"] if "kind" in table else ["attention"] * len(table)
    batches = table["batch"] if "batch" in table else [1] * len(table)
    return list(dict.fromkeys(zip(kinds, table["shape"], (int(b) for b in batches), strict=True)))


def render(table, stem: Path, results: dict[str, Any] | None = None) -> list[Path]:
    """Per shape (and batch, and whole-step layout): time per step (left) and ratio to fp16 (right);
    titles name the shape, device and CPU."""
    plt = pyplot()
    keys = panels(table)
    fig, axes = plt.subplots(len(keys), 2, figsize=(11, 4.2 * len(keys)), squeeze=False)
    experiment = (results or {}).get("experiment", {})
    where = ", ".join(str(x) for x in ((results or {}).get("env", {}).get("device"), experiment.get("cpu")) if x)
    kinds = table["kind"] if "kind" in table else "attention"
    batches = table["batch"] if "batch" in table else 1
    for (left, right), (kind, shape, batch) in zip(axes, keys, strict=True):
        panel = table[(kinds == kind) & (table["shape"] == shape) & (batches == batch)]
        for method, rows in panel.groupby("method", sort=False):
            rows = rows.sort_values("context")
            label = f"{method} ({rows.backend.iloc[0]})"
            left.plot(rows.context, rows.ms, marker="o", color=method_color(method), label=label)
            right.plot(rows.context, rows.ratio_to_fp16, marker="o", color=method_color(method), label=label)
        contexts = sorted(panel.context.unique())
        for ax in (left, right):
            ax.set_xscale("log", base=2)
            ax.set_xticks(contexts, [str(c) for c in contexts])
            ax.minorticks_off()
            ax.set_xlabel("position (tokens in the cache)")
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
        what = "KV time of one decode step" if kind == "attention" else "one whole decode step"
        left.set_ylabel(f"{what} (ms, median)")
        right.set_ylabel("time / fp16 time (same run)")
        right.axhline(1.0, color="black", lw=0.8)
        labels = experiment.get("shape_labels" if kind == "attention" else "layout_labels") or {}
        label = labels.get(shape, shape) + (f", batch {batch}" if batch != 1 else "")
        left.set_title(f"{label}{', ' + where if where else ''}", fontsize=9)
        right.set_title("ratio to fp16 (same backend)", fontsize=9)
        left.legend(fontsize=7, frameon=False)
    fig.tight_layout()
    return save_figure(fig, stem)


def layout_label(layout: str, layers: int, sizes: dict[str, Any]) -> str:
    """A whole-step panel's title: the layout, its layers, random weights."""
    n = layers or sizes["num_hidden_layers"]
    return f"whole decode step, {layout} layout ({n} layers, random weights)"


def run(cfg: DictConfig) -> dict[str, Any]:
    import pandas as pd
    import torch
    from hydra.core.hydra_config import HydraConfig
    from tqdm.auto import tqdm

    from kvquant.analysis.timing import (
        HF_DYNAMIC,
        LAYOUTS,
        SHAPES,
        copy_bandwidth,
        cpu_model,
        decode_step_time,
        model_step_time,
    )
    from kvquant.errors import InvalidParameterError
    from kvquant.methods import get_method
    from kvquant.models import resolve_device

    exp = cfg.experiment
    unknown = [s for s in exp.shapes if s not in SHAPES]
    if unknown:
        raise InvalidParameterError(f"unknown experiment.shapes {unknown}; valid: {', '.join(SHAPES)}")
    layouts = list(exp.get("step_layouts") or [])
    unknown = [s for s in layouts if s not in LAYOUTS]
    if unknown:
        raise InvalidParameterError(f"unknown experiment.step_layouts {unknown}; valid: {', '.join(LAYOUTS)}")
    batches = [int(b) for b in exp.get("batches") or [1]]
    if min(batches) < 1:
        raise InvalidParameterError(f"experiment.batches must be positive, got {batches}")
    step_layers = int(exp.get("step_layers") or 0)
    if exp.threads:
        torch.set_num_threads(int(exp.threads))
    device = resolve_device(cfg.device)

    def build(name: str):
        return get_method(name).on_backend(exp.backend)

    methods = {BASELINE: build(BASELINE), **{str(n): build(str(n)) for n in exp.methods if n != BASELINE}}
    for name in [n for n, m in methods.items() if hasattr(m, "v_block")]:  # AlignedKV's value-width blocks
        methods |= {f"{name} v_block={b}": methods[name].with_params(v_block=int(b)) for b in exp.get("v_blocks", [])}
    methods[HF_DYNAMIC] = None
    bandwidth = copy_bandwidth() if device == "cpu" else None
    rows = []
    cells = [("attention", shape, int(c), b) for b in batches for shape in exp.shapes for c in exp.contexts[shape]]
    cells += [("step", layout, int(c), b) for b in batches for layout in layouts for c in exp.step_contexts]
    for kind, shape, context, batch in tqdm(cells, desc=NAME, disable=not cfg.progress):
        timed = {}
        for label, method in methods.items():
            if kind == "attention":
                timed[label] = decode_step_time(method, shape, context, int(exp.repeats), device=device, batch=batch)
            else:
                timed[label] = model_step_time(
                    method, shape, context, int(exp.repeats), device=device, batch=batch, layers=step_layers
                )
        base, hf = timed[BASELINE].seconds, timed[HF_DYNAMIC].seconds
        for label, t in timed.items():
            rows.append(
                {"kind": kind, "shape": shape, "batch": batch, "method": label, "backend": t.backend}
                | {"context": context, "ms": t.seconds * 1e3}
                | {"ratio_to_fp16": t.seconds / base, "ratio_to_hf_dynamic": t.seconds / hf}
                | {"bits_read": t.bits_read, "mb_read": t.bytes_read / 1e6, "gb_per_s": t.bytes_read / t.seconds / 1e9}
                | {"ideal_x_fp16": t.bits_read / 16 if label != HF_DYNAMIC else None}
            )
    experiment = {
        "name": NAME,
        "shapes": {s: list(exp.contexts[s]) for s in exp.shapes},
        "shape_labels": {s: f"{s} shape ({SHAPES[s][0]}q/{SHAPES[s][1]}kv×{SHAPES[s][2]})" for s in exp.shapes},
        "layout_labels": {s: layout_label(s, step_layers, LAYOUTS[s]) for s in layouts},
        "batches": batches,
        "backend": exp.backend,
        "threads": torch.get_num_threads(),
        "copy_gb_per_s": None if bandwidth is None else bandwidth / 1e9,
        "cpu": cpu_model(),
    }
    out = Path(HydraConfig.get().runtime.output_dir)
    results = {"experiment": experiment, "env": {"device": device}}
    table, _ = publish(render, NAME, pd.DataFrame(rows), out, exp.figures_dir, results)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    if bandwidth is not None:
        print(f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s ({experiment['cpu']}, {experiment['threads']} threads)")
    return {"experiment": experiment, "table": records(table), "device": device}
