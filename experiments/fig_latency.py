"""Latency of the KV part of one decode step vs position, on the caches users get, against fp16 in the same run.

``kvquant.analysis.timing.decode_step_time`` for each method (built with ``experiment.backend``
where the method has a backend: the C++ kernels, CuPy or torch, as ``auto`` resolves on this
machine) and each attention shape with its contexts (smollm2_135m up to 8K, Llama-2-7B's 32×128 up
to 32K); fp16 on the same backend is the ratio's baseline and transformers' ``DynamicCache``
(``hf_dynamic``) the outside reference. Beside each time: bits and bytes read per step and the
rate they were read at, next to the machine's measured copy bandwidth, and the byte-proportional
ideal ratio (bits read / 16: what reading fewer bytes alone would give). ``v_blocks`` adds each
AlignedKV method at those value-width blocks (``<name> v_block=<b>``). Writes
``fig_latency.{csv,png,pdf}``: time per step (left) and ratio to fp16 (right), one row per shape.
``render`` redraws the figure from the CSV alone (``make figures``), titles from results.json.
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


def render(table, stem: Path, results: dict[str, Any] | None = None) -> list[Path]:
    """Per shape: time per step (left) and ratio to fp16 (right); titles name the shape, device and CPU."""
    plt = pyplot()
    shapes = list(dict.fromkeys(table["shape"]))
    fig, axes = plt.subplots(len(shapes), 2, figsize=(11, 4.2 * len(shapes)), squeeze=False)
    experiment = (results or {}).get("experiment", {})
    where = ", ".join(str(x) for x in ((results or {}).get("env", {}).get("device"), experiment.get("cpu")) if x)
    for (left, right), shape in zip(axes, shapes, strict=True):
        rows_of_shape = table[table["shape"] == shape]
        for method, rows in rows_of_shape.groupby("method", sort=False):
            rows = rows.sort_values("context")
            label = f"{method} ({rows.backend.iloc[0]})"
            left.plot(rows.context, rows.ms, marker="o", color=method_color(method), label=label)
            right.plot(rows.context, rows.ratio_to_fp16, marker="o", color=method_color(method), label=label)
        contexts = sorted(rows_of_shape.context.unique())
        for ax in (left, right):
            ax.set_xscale("log", base=2)
            ax.set_xticks(contexts, [str(c) for c in contexts])
            ax.minorticks_off()
            ax.set_xlabel("position (tokens in the cache)")
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
        left.set_ylabel("KV time of one decode step (ms, median)")
        right.set_ylabel("time / fp16 time (same run)")
        right.axhline(1.0, color="black", lw=0.8)
        label = (experiment.get("shape_labels") or {}).get(shape, shape)
        left.set_title(f"{label}{', ' + where if where else ''}", fontsize=9)
        right.set_title("ratio to fp16 (same backend)", fontsize=9)
        left.legend(fontsize=7, frameon=False)
    fig.tight_layout()
    return save_figure(fig, stem)


def run(cfg: DictConfig) -> dict[str, Any]:
    import pandas as pd
    import torch
    from hydra.core.hydra_config import HydraConfig
    from tqdm.auto import tqdm

    from kvquant.analysis.timing import HF_DYNAMIC, SHAPES, copy_bandwidth, cpu_model, decode_step_time
    from kvquant.errors import InvalidParameterError
    from kvquant.methods import get_method
    from kvquant.models import resolve_device

    exp = cfg.experiment
    unknown = [s for s in exp.shapes if s not in SHAPES]
    if unknown:
        raise InvalidParameterError(f"unknown experiment.shapes {unknown}; valid: {', '.join(SHAPES)}")
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
    cells = [(shape, int(c)) for shape in exp.shapes for c in exp.contexts[shape]]
    for shape, context in tqdm(cells, desc=NAME, disable=not cfg.progress):
        timed = {
            label: decode_step_time(method, shape, context, int(exp.repeats), device=device)
            for label, method in methods.items()
        }
        base, hf = timed[BASELINE].seconds, timed[HF_DYNAMIC].seconds
        for label, t in timed.items():
            rows.append(
                {"shape": shape, "method": label, "backend": t.backend, "context": context, "ms": t.seconds * 1e3}
                | {"ratio_to_fp16": t.seconds / base, "ratio_to_hf_dynamic": t.seconds / hf}
                | {"bits_read": t.bits_read, "mb_read": t.bytes_read / 1e6, "gb_per_s": t.bytes_read / t.seconds / 1e9}
                | {"ideal_x_fp16": t.bits_read / 16 if label != HF_DYNAMIC else None}
            )
    experiment = {
        "name": NAME,
        "shapes": {s: list(exp.contexts[s]) for s in exp.shapes},
        "shape_labels": {s: f"{s} shape ({SHAPES[s][0]}q/{SHAPES[s][1]}kv×{SHAPES[s][2]})" for s in exp.shapes},
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
