"""Bits read vs fidelity for uniform truncation, AlignedKV and AlignedKV+ at several margins and,
beyond the paper, at several value-width blocks (``v_block``, margin 0), the block-bound value rule
(``alignedkv_block``) included.

For each context length: ``prompts`` consecutive WikiText-2 windows of that many tokens; each rule
decodes ``new_tokens`` greedy tokens (match to fp16 per position), is teacher-forced along fp16's
tokens (mean KL(fp16 ‖ rule)), and its ``QKᵀ``/``SV`` relative errors are bucketed at the decode
step after the first prompt. Writes ``frontier_alignedkv.csv`` and a plot (bits read on x, greedy
match and KL on y, one line per rule — ``<rule> v_block`` lines are the block axis, each point
labelled with its ``v_block`` — one column per context) into ``figures_dir`` and the run folder;
``render`` redraws it from the CSV alone (``make figures``). A point whose method equals another's
(``v_block=1`` is ``margin=0``) is computed once and reported under both labels.

Decodes run on ``backend`` (``auto``: the C++ kernels where built — the same widths as the torch
rule, see ``kernels_cpu/README.md``). Attention time: where the model's attention shape is in
``kvquant.analysis.timing.SHAPES``, each point's KV time of one decode step at the context
(``decode_step_time``: synthetic K/V with log-normal channel scales and outlier channels, a random
query, ``time_repeats`` steps, median) beside fp16's on the same backend, with the bits that step
read and the byte-proportional ideal (fp16's time × bits read / 16); a third row of the plot.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from experiments.figures import publish, records, start
from kvquant.plots import method_color, pyplot, save_figure

NAME = "frontier_alignedkv"
RESUME = "never"  # run.py: timings are measured again on every run, never reused
PRINTED = ("context", "label", "bits_read", "bits_read_k", "bits_read_v", "greedy_match", "kl", "attention_x_fp16")


def v_blocks_of(cfg: DictConfig, rule: str) -> list[int]:
    """The ``v_block`` points of ``rule``: ``v_blocks`` is one list for every rule, or a mapping from rule
    to its list (the block rule takes 2..64, the paper's rule 1 too); a rule it does not name gets none."""
    blocks = cfg.get("v_blocks") or []
    if isinstance(blocks, Mapping):
        blocks = blocks.get(rule) or []
    return [int(b) for b in blocks]


def rule_configs(cfg: DictConfig) -> list[tuple[str, str, float, Any]]:
    """``(label, method, x_param, method)`` for every point of the frontier."""
    from kvquant.methods import get_method

    points = [(f"truncation keep={k}", "truncation", k, get_method("truncation", keep_bits=int(k))) for k in cfg.keep]
    for rule in cfg.rules:
        points += [(f"{rule} margin={m}", rule, m, get_method(rule, margin=float(m))) for m in cfg.margins]
        blocks = v_blocks_of(cfg, rule)
        points += [(f"{rule} v_block={b}", f"{rule} v_block", b, get_method(rule, v_block=b)) for b in blocks]
    return points


def decode_and_compare(model, prompt, method, reference, new_tokens: int) -> dict[str, float]:
    """Free greedy decode (match, bits) and teacher-forced decode along fp16's tokens (KL)."""
    import torch

    from kvquant.eval.fidelity import greedy_decode, kl_divergence

    cache = method.new_cache(model)
    free = greedy_decode(model, prompt, cache, new_tokens)
    forced = free  # where it kept fp16's tokens, teacher forcing feeds the same ones: the same run again
    if not torch.equal(free.tokens, reference.tokens):
        forced = greedy_decode(model, prompt, method.new_cache(model), new_tokens, forced=reference.tokens)
    stats = cache.stats()
    return {
        "match": (free.tokens == reference.tokens).float().mean().item(),
        "kl": kl_divergence(reference.logprobs, forced.logprobs).mean().item(),
        "bits_read": stats["bits_read"],
        "bits_read_k": stats["bits_read_k"],
        "bits_read_v": stats["bits_read_v"],
    }


def render(table, stem: Path) -> list[Path]:
    """Greedy match (top) and KL (bottom) against bits read, one line per rule, one column per context."""
    plt = pyplot()
    contexts = sorted(table.context.unique())
    rules = sorted(table.rule.unique())
    positive = table.kl[table.kl > 0]
    linthresh = max(float(positive.min()) if len(positive) else 1e-6, 1e-12)  # KL is 0 at 16 bits: symlog
    timed = "attention_x_fp16" in table and table.attention_x_fp16.notna().any()
    fig, axes = plt.subplots(
        3 if timed else 2, len(contexts), figsize=(5.5 * len(contexts), 11.2 if timed else 7.6), squeeze=False
    )
    for col, ctx in enumerate(contexts):
        for i, rule in enumerate(rules):
            rows = table[(table.context == ctx) & (table.rule == rule)].sort_values("bits_read")
            style = {"marker": "os^Dv"[i % 5], "color": method_color(rule), "label": rule, "alpha": 0.85}
            axes[0][col].plot(rows.bits_read, rows.greedy_match, **style)
            axes[1][col].plot(rows.bits_read, rows.kl, **style)
            if timed:
                axes[2][col].plot(rows.attention_bits_read, rows.attention_x_fp16, **style)
            if rule.endswith(" v_block"):
                for x, y, b in zip(rows.bits_read, rows.greedy_match, rows.param, strict=True):
                    axes[0][col].annotate(f"{b:g}", (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
        axes[0][col].set_title(f"context {ctx} tokens")
        axes[1][col].set_xlabel("mean bits read per K/V element (bits)")
        axes[1][col].set_yscale("symlog", linthresh=linthresh)
        if timed:
            ideal = table[table.context == ctx].sort_values("attention_bits_read")
            axes[2][col].plot(ideal.attention_bits_read, ideal.ideal_x_fp16, ls="--", color="gray", lw=0.8)
            axes[2][col].axhline(1.0, color="black", lw=0.8)
            axes[2][col].set_xlabel("bits read per element in the timed step (synthetic K/V)")
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("greedy tokens equal to fp16 (share)")
    axes[1][0].set_ylabel("KL(fp16 ‖ rule) per token (nats)")
    if timed:
        axes[2][0].set_ylabel("KV time of a decode step / fp16's (dashed: bits / 16)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), bbox_to_anchor=(0.5, -0.01), frameon=False)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return save_figure(fig, stem)


def run(cfg: DictConfig) -> dict[str, Any]:
    import pandas as pd
    from hydra.core.hydra_config import HydraConfig
    from tqdm.auto import tqdm

    from experiments.greedy import wikitext_ids
    from kvquant.analysis.relerr import relative_error_table
    from kvquant.analysis.timing import SHAPES, decode_step_time
    from kvquant.errors import InvalidParameterError
    from kvquant.eval.fidelity import greedy_decode
    from kvquant.methods import get_method
    from kvquant.models import model_info

    exp, model, tok, device = start(cfg)
    limit = model.config.max_position_embeddings
    if max(exp.contexts) + exp.new_tokens > limit:
        raise InvalidParameterError(f"experiment.contexts up to {max(exp.contexts)} + {exp.new_tokens} exceed {limit}")
    ids = wikitext_ids(tok)
    points = [(label, rule, x, method.on_backend(exp.backend)) for label, rule, x, method in rule_configs(exp)]
    fp16 = get_method("fp16").on_backend(exp.backend)  # the reference on the same backend: no kernel-vs-SDPA noise
    shape = cfg.model.name if cfg.model.name in SHAPES and exp.time_repeats else None
    rows = []
    for ctx in exp.contexts:
        prompts = [ids[i * ctx : (i + 1) * ctx] for i in range(exp.prompts)]
        if len(prompts[-1]) < ctx:
            raise InvalidParameterError(f"WikiText-2 holds fewer than {exp.prompts} windows of {ctx} tokens")
        unique = {method: label for label, _, _, method in reversed(points)}  # method -> its first label
        relerr = relative_error_table(model, prompts[0], {label: m for m, label in unique.items()})
        sums = {
            label: {"match": 0.0, "kl": 0.0, "bits_read": 0.0, "bits_read_k": 0.0, "bits_read_v": 0.0}
            for label in unique.values()
        }
        bar = tqdm(total=len(prompts) * len(unique), desc=f"{NAME} ctx={ctx}", disable=not cfg.progress)
        for prompt in prompts:
            reference = greedy_decode(model, prompt, fp16.new_cache(model), exp.new_tokens)
            for method, label in unique.items():
                for key, value in decode_and_compare(model, prompt, method, reference, exp.new_tokens).items():
                    sums[label][key] += value
                bar.update(1)
        bar.close()
        timed = {}
        if shape is not None:
            base = decode_step_time(fp16, shape, ctx, int(exp.time_repeats), device=device)
            for method, label in unique.items():
                t = decode_step_time(method, shape, ctx, int(exp.time_repeats), device=device)
                timed[label] = {
                    "attention_ms": t.seconds * 1e3,
                    "attention_x_fp16": t.seconds / base.seconds,
                    "attention_bits_read": t.bits_read,
                    "ideal_x_fp16": t.bits_read / 16,
                    "backend": t.backend,
                }
        for label, rule, x, method in points:
            first = unique[method]
            mean = {k: v / len(prompts) for k, v in sums[first].items()}
            row = {"context": ctx, "rule": rule, "param": x, "label": label, "greedy_match": mean.pop("match"), **mean}
            row["v_block"] = getattr(method, "v_block", None)
            row.update(timed.get(first, {}))
            for kind in ("qk", "sv"):
                row.update({f"{kind} {bucket}": share for bucket, share in relerr[first][kind].items()})
            rows.append(row)

    out_dir = Path(HydraConfig.get().runtime.output_dir)
    table, _ = publish(render, NAME, pd.DataFrame(rows), out_dir, exp.figures_dir)
    print(table[[c for c in PRINTED if c in table]].to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    return {
        "model": model_info(model, cfg.model.name),
        "experiment": {"name": NAME, "n_points": len(table), "figures": str(Path(exp.figures_dir) / NAME)},
        "table": records(table),
        "device": device,
    }
