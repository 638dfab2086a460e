"""AlignedKV's bits read: width histograms for K and V and mean bits read vs context, per layer and overall.

For each method and context length ``P``: prefill ``P`` tokens of WikiText-2, decode
``decode_steps`` greedy tokens, and count what the decode steps read (the prefill is not counted:
it attends in full precision). Writes ``fig_bitwidth.{csv,png,pdf}``; results.json holds every CSV row
(overall and per layer), and ``render`` redraws the figure from the CSV alone (``make figures``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from experiments.figures import progress, publish, records, start
from kvquant.plots import method_color, pyplot, save_figure

NAME = "fig_bitwidth"


def _row(method: str, context: int, layer: str, hist: dict[str, dict[int, int]], series: dict | None) -> dict:
    from kvquant.methods.alignedkv import WIDTHS

    row: dict[str, Any] = {"method": method, "context": context, "layer": layer}
    for side in ("k", "v"):
        total = sum(hist[side].values())
        for w in WIDTHS:
            row[f"{side}{w}"] = hist[side][w] / total if total else float("nan")
        row[f"bits_read_{side}"] = sum(w * n for w, n in hist[side].items()) / total if total else float("nan")
    n_k, n_v = sum(hist["k"].values()), sum(hist["v"].values())
    row["bits_read"] = (row["bits_read_k"] * n_k + row["bits_read_v"] * n_v) / (n_k + n_v)
    if series:  # overall rows: include the metadata read each step, as cache.stats() does
        row["bits_read_with_metadata"] = sum(series["bits_read"]) / len(series["bits_read"])
    return row


def measure(model, ids, method_name: str, context: int, steps: int) -> list[dict]:
    from kvquant.eval.fidelity import greedy_decode
    from kvquant.methods import get_method
    from kvquant.methods.alignedkv import WIDTHS, width_histograms

    cache = get_method(method_name).new_cache(model)
    greedy_decode(model, ids[:context], cache, steps + 1)
    per_layer = [
        {side: {w: sum(head[w] for head in layer[side]) for w in WIDTHS} for side in ("k", "v")}
        for layer in width_histograms(cache)
    ]
    rows = [_row(method_name, context, str(i), layer, None) for i, layer in enumerate(per_layer)]
    total = {side: {w: sum(layer[side][w] for layer in per_layer) for w in WIDTHS} for side in ("k", "v")}
    return [_row(method_name, context, "all", total, cache.counts().position_series()), *rows]


def render(table, stem: Path) -> list[Path]:
    """Three panels from the CSV: bits read vs context, width shares at the largest context, bits per layer."""
    from matplotlib.lines import Line2D

    plt = pyplot()
    widths = sorted(int(c[1:]) for c in table.columns if re.fullmatch(r"k\d+", c))
    overall = table[table.layer.astype(str) == "all"]
    methods = sorted(overall.method.unique())
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    ax = axes[0]
    for method, rows in overall.groupby("method"):
        rows = rows.sort_values("context")
        color = method_color(method)
        ax.plot(rows.context, rows.bits_read, marker="o", color=color)
        ax.plot(rows.context, rows.bits_read_k, ls="--", color=color, alpha=0.7)
        ax.plot(rows.context, rows.bits_read_v, ls=":", color=color, alpha=0.7)
    ax.set_xscale("log", base=2)
    contexts = sorted(overall.context.unique())
    ax.set_xticks(contexts, [str(c) for c in contexts])
    ax.minorticks_off()
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("mean bits read per element (bits, decode)")
    ax.set_title("bits read vs context")
    ax.grid(alpha=0.3)

    largest = overall.context.max()
    ax = axes[1]
    bar = 0.8 / max(len(methods), 1)
    labels = [f"{side.upper()} {w}b" for side in ("k", "v") for w in widths]
    for i, method in enumerate(methods):
        row = overall[(overall.method == method) & (overall.context == largest)].iloc[0]
        shares = [row[f"{side}{w}"] for side in ("k", "v") for w in widths]
        ax.bar([j + i * bar for j in range(len(labels))], shares, width=bar, color=method_color(method))
    ax.set_xticks([j + 0.4 - bar / 2 for j in range(len(labels))], labels)
    ax.set_ylabel("share of elements read at that width")
    ax.set_title(f"widths read at {largest} tokens")

    ax = axes[2]
    per_layer = table[(table.layer.astype(str) != "all") & (table.context == largest)]
    for method, rows in per_layer.groupby("method"):
        rows = rows.assign(layer_idx=rows.layer.astype(int)).sort_values("layer_idx")
        ax.plot(rows.layer_idx, rows.bits_read, marker=".", color=method_color(method))
    ax.set_xlabel("layer")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("mean bits read per element (bits)")
    ax.set_title(f"per layer at {largest} tokens (K+V)")
    ax.grid(alpha=0.3)

    handles = [Line2D([], [], color=method_color(m), marker="o", label=m) for m in methods]
    styles = (("-", "K+V"), ("--", "K"), (":", "V"))
    handles += [Line2D([], [], color="black", ls=ls, label=label) for ls, label in styles]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), bbox_to_anchor=(0.5, -0.02), frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return save_figure(fig, stem)


def run(cfg: DictConfig) -> dict[str, Any]:
    import pandas as pd
    from hydra.core.hydra_config import HydraConfig

    from experiments.greedy import wikitext_ids
    from kvquant.errors import InvalidParameterError
    from kvquant.models import model_info

    exp, model, tok, device = start(cfg)
    limit = model.config.max_position_embeddings
    contexts = [int(c) for c in exp.contexts if int(c) + exp.decode_steps < limit]
    if not contexts:
        raise InvalidParameterError(f"experiment.contexts leave no room to decode within the model's {limit} tokens")
    ids = wikitext_ids(tok)
    rows = []
    for method, context in progress([(m, c) for m in exp.methods for c in contexts], cfg, NAME):
        rows += measure(model, ids, method, context, exp.decode_steps)
    out = Path(HydraConfig.get().runtime.output_dir)
    table, _ = publish(render, NAME, pd.DataFrame(rows), out, exp.figures_dir)
    overall = table[table.layer.astype(str) == "all"]
    print(overall[["method", "context", "bits_read_k", "bits_read_v", "bits_read"]].to_string(index=False))
    return {
        "model": model_info(model, cfg.model.name),
        "experiment": {"name": NAME, "contexts": contexts, "figures": str(Path(exp.figures_dir) / NAME)},
        "table": records(table),
        "device": device,
    }
