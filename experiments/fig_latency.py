"""Latency of the KV part of one decode step vs position, every method against fp16 in the same run.

``kvquant.analysis.timing.decode_step_time`` for each method and context on one attention shape
(the model's, or a named one such as ``llama2_7b``); medians over repeats, warm-up excluded. Writes
``fig_latency.{csv,png,pdf}``: time per step (left) and the ratio to fp16 (right). CPU here; the
CuPy AlignedKV kernel joins this figure where a GPU is present (see ``kernels_cupy``). ``render`` redraws
the figure from the CSV alone (``make figures``), its title from results.json.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from experiments.figures import publish, records
from kvquant.plots import method_color, pyplot, save_figure

NAME = "fig_latency"


def render(table, stem: Path, results: dict[str, Any] | None = None) -> list[Path]:
    """Time per step (left) and ratio to fp16 (right) from the CSV; the title names the shape and device."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method, rows in table.groupby("method"):
        rows = rows.sort_values("context")
        left.plot(rows.context, rows.ms, marker="o", color=method_color(method), label=method)
        right.plot(rows.context, rows.ratio_to_fp16, marker="o", color=method_color(method), label=method)
    contexts = sorted(table.context.unique())
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.minorticks_off()
        ax.set_xlabel("position (tokens in the cache)")
        ax.grid(alpha=0.3)
    left.set_yscale("log")
    right.set_yscale("log")
    left.set_ylabel("KV time of one decode step (ms, median)")
    right.set_ylabel("time / fp16 time (ratio, same run)")
    right.axhline(1.0, color="black", lw=0.8)
    experiment = (results or {}).get("experiment", {})
    device = (results or {}).get("env", {}).get("device")
    title = ", ".join(str(x) for x in (experiment.get("shape_label"), device) if x)
    left.set_title(title or "KV part of one decode step")
    right.set_title("ratio to fp16")
    handles, labels = left.get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    fig.tight_layout()
    return save_figure(fig, stem)


def run(cfg: DictConfig) -> dict[str, Any]:
    import pandas as pd
    import torch
    from hydra.core.hydra_config import HydraConfig
    from tqdm.auto import tqdm

    from kvquant.analysis.timing import SHAPES, decode_step_time
    from kvquant.errors import InvalidParameterError
    from kvquant.methods import get_method
    from kvquant.models import resolve_device

    exp = cfg.experiment
    if exp.shape not in SHAPES:
        raise InvalidParameterError(f"unknown experiment.shape '{exp.shape}'; valid: {', '.join(SHAPES)}")
    if exp.threads:
        torch.set_num_threads(int(exp.threads))
    methods = {name: get_method(name) for name in exp.methods}
    fp16 = get_method("fp16")
    rows = []
    for context in tqdm(list(exp.contexts), desc=NAME, disable=not cfg.progress):
        base, _ = decode_step_time(fp16, exp.shape, int(context), exp.repeats)
        rows.append({"method": "fp16", "context": context, "ms": base * 1e3, "ratio_to_fp16": 1.0, "bits_read": 16.0})
        for label, method in methods.items():
            t, bits = decode_step_time(method, exp.shape, int(context), exp.repeats)
            rows.append(
                {"method": label, "context": context, "ms": t * 1e3, "ratio_to_fp16": t / base, "bits_read": bits}
            )
    hq, hkv, d = SHAPES[exp.shape]
    device = resolve_device(cfg.device)
    experiment = {
        "name": NAME,
        "shape": exp.shape,
        "shape_label": f"{exp.shape} shape ({hq}q/{hkv}kv×{d})",
        "threads": torch.get_num_threads(),
    }
    out = Path(HydraConfig.get().runtime.output_dir)
    results = {"experiment": experiment, "env": {"device": device}}
    table, _ = publish(render, NAME, pd.DataFrame(rows), out, exp.figures_dir, results)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    return {"experiment": experiment, "table": records(table), "device": device}
