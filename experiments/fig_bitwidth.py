"""AlignedKV's bits read: width histograms for K and V and mean bits read vs context, per layer and overall.

For each method and context length ``P``: prefill ``P`` tokens of WikiText-2, decode
``decode_steps`` greedy tokens, and count what the decode steps read (the prefill is not counted:
it attends in full precision). Writes ``fig_bitwidth.{csv,png,pdf}``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from tqdm.auto import tqdm

from kvquant.data import wikitext2_test
from kvquant.errors import InvalidParameterError
from kvquant.eval.fidelity import greedy_decode
from kvquant.methods import get_method
from kvquant.methods.alignedkv import WIDTHS, width_histograms
from kvquant.models import load_model, model_info, resolve_device
from kvquant.plots import method_color, pyplot, save_figure

NAME = "fig_bitwidth"


def _row(method: str, context: int, layer: str, hist: dict[str, dict[int, int]], series: dict | None) -> dict:
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
    cache = get_method(method_name).new_cache(model)
    greedy_decode(model, ids[:context], cache, steps + 1)
    per_layer = [
        {side: {w: sum(head[w] for head in layer[side]) for w in WIDTHS} for side in ("k", "v")}
        for layer in width_histograms(cache)
    ]
    rows = [_row(method_name, context, str(i), layer, None) for i, layer in enumerate(per_layer)]
    total = {side: {w: sum(layer[side][w] for layer in per_layer) for w in WIDTHS} for side in ("k", "v")}
    return [_row(method_name, context, "all", total, cache.counts().position_series()), *rows]


def plot(table, stem: Path, copies: list[Path]) -> None:
    plt = pyplot()
    overall = table[table.layer == "all"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    ax = axes[0]
    for method, rows in overall.groupby("method"):
        rows = rows.sort_values("context")
        color = method_color(method)
        ax.plot(rows.context, rows.bits_read, marker="o", color=color, label=f"{method} (K+V)")
        ax.plot(rows.context, rows.bits_read_k, ls="--", color=color, alpha=0.7, label=f"{method} K")
        ax.plot(rows.context, rows.bits_read_v, ls=":", color=color, alpha=0.7, label=f"{method} V")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("mean bits read per element (decode)")
    ax.set_title("bits read vs context")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)

    largest = overall.context.max()
    ax = axes[1]
    methods = sorted(overall.method.unique())
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        row = overall[(overall.method == method) & (overall.context == largest)].iloc[0]
        xs = [j + i * width for j in range(6)]
        shares = [row[f"{side}{w}"] for side in ("k", "v") for w in WIDTHS]
        ax.bar(xs, shares, width=width, color=method_color(method), label=method)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(6)], [f"{s.upper()} {w}b" for s in ("k", "v") for w in WIDTHS])
    ax.set_ylabel("share of elements read")
    ax.set_title(f"widths read at {largest} tokens")
    ax.legend(fontsize=8)

    ax = axes[2]
    per_layer = table[(table.layer != "all") & (table.context == largest)]
    for method, rows in per_layer.groupby("method"):
        rows = rows.assign(layer_idx=rows.layer.astype(int)).sort_values("layer_idx")
        ax.plot(rows.layer_idx, rows.bits_read, marker=".", color=method_color(method), label=method)
    ax.set_xlabel("layer")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("mean bits read per element")
    ax.set_title(f"per layer at {largest} tokens")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, stem, copies)


def run(cfg: DictConfig) -> dict[str, Any]:
    import pandas as pd

    exp = cfg.experiment
    device = resolve_device(cfg.device)
    model, tok = load_model(cfg.model.path or cfg.model.name, dtype=cfg.model.dtype, device=device)
    limit = model.config.max_position_embeddings
    contexts = [int(c) for c in exp.contexts if int(c) + exp.decode_steps < limit]
    if not contexts:
        raise InvalidParameterError(f"experiment.contexts leave no room to decode within the model's {limit} tokens")
    ids = tok(wikitext2_test(), return_tensors="pt").input_ids[0]
    rows = []
    bar = tqdm(total=len(contexts) * len(exp.methods), desc=NAME, disable=not cfg.progress)
    for method in exp.methods:
        for context in contexts:
            rows += measure(model, ids, method, context, exp.decode_steps)
            bar.update(1)
    bar.close()
    table = pd.DataFrame(rows)
    out = Path(HydraConfig.get().runtime.output_dir)
    table.to_csv(out / f"{NAME}.csv", index=False)
    plot(table, out / NAME, [Path(exp.figures_dir)])
    overall = table[table.layer == "all"]
    print(overall[["method", "context", "bits_read_k", "bits_read_v", "bits_read"]].to_string(index=False))
    return {
        "model": model_info(model, cfg.model.name),
        "experiment": {"name": NAME, "contexts": contexts, "figures": str(Path(exp.figures_dir) / NAME)},
        "table": overall.to_dict(orient="records"),
        "device": device,
    }
