"""Latency of the KV part of one decode step vs position, every method against fp16 in the same run.

``kvquant.analysis.timing.decode_step_time`` for each method and context on one attention shape
(the model's, or a named one such as ``llama2_7b``); medians over repeats, warm-up excluded. Writes
``fig_latency.{csv,png,pdf}``: time per step (left) and the ratio to fp16 (right). CPU here; the
CuPy AlignedKV kernel joins this figure where a GPU is present (see ``kernels_cupy``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from tqdm.auto import tqdm

from kvquant.analysis.timing import SHAPES, decode_step_time
from kvquant.errors import InvalidParameterError
from kvquant.methods import get_method
from kvquant.models import resolve_device
from kvquant.plots import method_color, pyplot, save_figure

NAME = "fig_latency"


def plot(table, stem: Path, copies: list[Path], title: str) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method, rows in table.groupby("method"):
        rows = rows.sort_values("context")
        left.plot(rows.context, rows.ms, marker="o", color=method_color(method), label=method)
        right.plot(rows.context, rows.ratio_to_fp16, marker="o", color=method_color(method), label=method)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("position (tokens in the cache)")
        ax.grid(alpha=0.3)
    left.set_yscale("log")
    left.set_ylabel("KV time of one decode step (ms, median)")
    right.set_ylabel("time / fp16 time (same run)")
    right.axhline(1.0, color="black", lw=0.8)
    left.set_title(title)
    right.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, stem, copies)


def run(cfg: DictConfig) -> dict[str, Any]:
    import pandas as pd

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
    table = pd.DataFrame(rows)
    out = Path(HydraConfig.get().runtime.output_dir)
    table.to_csv(out / f"{NAME}.csv", index=False)
    hq, hkv, d = SHAPES[exp.shape]
    device = resolve_device(cfg.device)
    plot(table, out / NAME, [Path(exp.figures_dir)], f"{exp.shape} shape ({hq}q/{hkv}kv×{d}), {device}")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    return {
        "experiment": {"name": NAME, "shape": exp.shape, "threads": torch.get_num_threads()},
        "table": rows,
        "device": device,
    }
