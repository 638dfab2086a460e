"""AQUA-KV calibration: held-out text, the K/V a model writes for it, and the layer-by-layer ridge fit.

Calibration text is TinyStories validation stories evaluation never reads (the last ``CALIB_POOL``).
Predictors are fitted in layer order, each on the quantize→dequantize reconstruction of the layers
before it — the rule the cache applies (``predictors.encode_pair``) — and the file header records
the data, seed, λ and each layer's fit error.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvquant.cache import KVGeometry, to_fp16_checked
from kvquant.errors import InvalidParameterError
from kvquant.methods.aquakv.cache import find_rotary
from kvquant.methods.aquakv.method import SINK, AquaKVMethod
from kvquant.methods.aquakv.predictors import FORMAT, Predictors, apply_predictor, model_identity, to_rows
from kvquant.quant.higgs import Higgs
from kvquant.quant.ridge import DEFAULT_LAMBDA, RidgeStats
from kvquant.quant.rope import rope_layer_types, rope_tables, undo_rope

CALIB_POOL = 2000  # calibration draws from the last CALIB_POOL TinyStories validation stories


@dataclass(frozen=True)
class CalibrationKV:
    """The K/V a model writes for the calibration sequences, sinks dropped (``collect_kv``), with their data
    record. Every AQUA-KV variant of one model fits on the same K/V for one (``n_seqs``, ``seq_len``, seed),
    so fitting several variants needs the model's forward passes once (``calibrate(..., kv=)``)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    data: dict
    seed: int
    sink: int
    seconds: float  # what collecting them took


def calibration_kv(
    model: Any,
    tokenizer: Any,
    n_seqs: int = 16,
    seq_len: int = 1024,
    seed: int = 0,
    sink: int = SINK,
    progress: bool = False,
) -> CalibrationKV:
    """Collect the calibration K/V once, to pass to ``calibrate`` for several variants."""
    config = model.config.get_text_config(decoder=True)
    started = time.perf_counter()
    ids, data = calibration_ids(tokenizer, n_seqs, min(seq_len, config.max_position_embeddings), seed)
    keys, values = collect_kv(model, ids, sink, progress)
    return CalibrationKV(keys, values, data, seed, sink, time.perf_counter() - started)


def calibrate(
    method: AquaKVMethod,
    model: Any,
    tokenizer: Any,
    n_seqs: int = 16,
    seq_len: int = 1024,
    seed: int = 0,
    lam: float = DEFAULT_LAMBDA,
    progress: bool = True,
    log: Callable[[str], None] | None = print,
    kv: CalibrationKV | None = None,
) -> Predictors:
    """Fit ``method``'s predictors for ``model`` on ``n_seqs`` held-out sequences of ``seq_len`` tokens: on
    ``kv`` where given (collected by ``calibration_kv`` with the same settings and the method's sink)."""
    if method.predict == "none":
        raise InvalidParameterError(f"method {method.label}: no predictors to calibrate (predict=none)")
    geometry = KVGeometry.of(model.config)
    quants = method.quantizers(geometry)
    config = model.config.get_text_config(decoder=True)
    if kv is None:
        kv = calibration_kv(model, tokenizer, n_seqs, seq_len, seed, method.sink, progress)
    want = {
        "n_seqs": n_seqs,
        "seq_len": min(seq_len, config.max_position_embeddings),
        "seed": seed,
        "sink": method.sink,
    }
    got = {"n_seqs": kv.data["n_seqs"], "seq_len": kv.data["seq_len"], "seed": kv.seed, "sink": kv.sink}
    if got != want or len(kv.keys) != geometry.n_layers:
        raise InvalidParameterError(
            f"calibration: the K/V given were collected for {got} ({len(kv.keys)} layers), this calibration "
            f"needs {want} ({geometry.n_layers} layers); collect them with calibration_kv(...) for these settings"
        )
    pred = fit_predictors(
        kv,
        quants={i: quants[method.layer_bits(i)] for i in range(geometry.n_layers)},
        predict=method.predict,
        lam=lam,
        progress=progress,
        log=log,
    )
    pred.header.update(
        {
            "format": FORMAT,
            "model": model_identity(config),
            "quantizer": method.quantizer_identity(quants),
            "data": kv.data,
            "seed": seed,
            "lambda": lam,
        }
    )
    return pred


def calibration_ids(tokenizer: Any, n_seqs: int, seq_len: int, seed: int) -> tuple[list[torch.Tensor], dict]:
    """``n_seqs`` sequences of ``seq_len`` tokens of TinyStories validation stories never used for evaluation.

    Stories come from the last ``CALIB_POOL`` pieces (evaluation reads the first ones), in a seeded
    order, joined by blank lines; each sequence starts with BOS when the tokenizer has one.
    """
    from kvquant.data import tinystories_pieces

    if n_seqs < 1 or seq_len < 2 * SINK:
        raise InvalidParameterError(f"calibration: need n_seqs >= 1 and seq_len >= {2 * SINK}")
    pieces = tinystories_pieces()
    first = len(pieces) - CALIB_POOL
    pool = pieces[first:]
    order = torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed)).tolist()
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    sep = tokenizer("\n\n", add_special_tokens=False).input_ids
    seqs, cur, used = [], list(bos), 0
    for idx in order:
        cur += tokenizer(pool[idx], add_special_tokens=False).input_ids + sep
        used += 1
        while len(cur) >= seq_len and len(seqs) < n_seqs:
            seqs.append(torch.tensor(cur[:seq_len]))
            cur = list(bos) + cur[seq_len:]
        if len(seqs) == n_seqs:
            break
    if len(seqs) < n_seqs:
        raise InvalidParameterError(
            f"calibration: {CALIB_POOL} held-out stories give only {len(seqs)} sequences of {seq_len} tokens"
        )
    data = {
        "source": "tinystories_val",
        "pieces": f"{first}..{len(pieces) - 1} (seeded order)",
        "stories_used": used,
        "n_seqs": n_seqs,
        "seq_len": seq_len,
        "tokens": n_seqs * seq_len,
    }
    return seqs, data


@torch.no_grad()
def collect_kv(
    model: Any, ids: list[torch.Tensor], sink: int, progress: bool = False
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, pre-RoPE keys and values ``[N, C]`` (fp16, as the cache's window holds them), sinks
    dropped; each layer's keys un-rotated with its own layer type's tables (Gemma-3: local and global)."""
    from tqdm.auto import tqdm

    from kvquant.analysis.capture import capture_kv

    rotary = find_rotary(model)
    types = rope_layer_types(rotary, KVGeometry.of(model.config).layer_types)
    keys: list[list[torch.Tensor]] = []
    values: list[list[torch.Tensor]] = []
    for seq in tqdm(ids, desc="aquakv calibration (collect K/V)", disable=not progress):
        kv = capture_kv(model, seq)
        pos = torch.arange(seq.numel(), device=kv[0][0].device).unsqueeze(0)
        tables = {t: rope_tables(rotary, pos, t) for t in set(types)}
        for layer, (k, v) in enumerate(kv):
            cos, sin = tables[types[layer]]
            k16 = to_fp16_checked(k, layer, "key").float()
            v16 = to_fp16_checked(v, layer, "value")
            if layer >= len(keys):
                keys.append([])
                values.append([])
            keys[layer].append(to_rows(undo_rope(k16, cos, sin))[0, sink:].half().cpu())
            values[layer].append(to_rows(v16)[0, sink:].cpu())
    return [torch.cat(k) for k in keys], [torch.cat(v) for v in values]


def relative_mse(x: torch.Tensor, xhat: torch.Tensor) -> float:
    return float((x - xhat).pow(2).sum() / x.pow(2).sum().clamp_min(1e-30))


def equivalent_bits(rel_mse: float) -> float:
    """Bits per value a Gaussian source needs for this relative MSE (``−½·log2``): comparable across methods."""
    return -0.5 * math.log2(max(rel_mse, 1e-30))


def fit_predictors(
    kv: CalibrationKV,
    quants: dict[int, Higgs],
    predict: str = "kv",
    lam: float = DEFAULT_LAMBDA,
    progress: bool = True,
    log: Callable[[str], None] | None = print,
) -> Predictors:
    """Fit predictors layer by layer, each on the quantize→dequantize reconstruction of the layers before it."""
    from tqdm.auto import tqdm

    started = time.perf_counter()
    keys, values = kv.keys, kv.values
    pred = Predictors({})
    fit: list[dict[str, float]] = []
    prev_k = prev_v = None
    bar = tqdm(range(len(keys)), desc="aquakv calibration (layers)", disable=not progress)
    for layer in bar:
        k, v = keys[layer].float(), values[layer].float()
        quant = quants[layer]
        k_higgs, v_higgs = (
            quant.roundtrip(k),
            quant.roundtrip(v),
        )  # HIGGS alone: also the residual's without a predictor
        pk = ridge_fit(prev_k, k, lam) if layer > 0 and predict in ("k", "kv") else None
        out_k = apply_predictor(pk, prev_k) if pk is not None else torch.zeros_like(k)
        rk = (quant.roundtrip(k - out_k) if pk is not None else k_higgs) + out_k
        pv = ridge_fit(torch.cat([rk, prev_v], dim=-1), v, lam) if layer > 0 and predict in ("v", "kv") else None
        out_v = apply_predictor(pv, torch.cat([rk, prev_v], dim=-1)) if pv is not None else torch.zeros_like(v)
        rv = (quant.roundtrip(v - out_v) if pv is not None else v_higgs) + out_v
        if pk is not None:
            pred.k[layer] = pk
        if pv is not None:
            pred.v[layer] = pv
        row = {"layer": layer, "k_rel_mse": relative_mse(k, rk), "v_rel_mse": relative_mse(v, rv)}
        row["k_rel_mse_higgs"] = relative_mse(k, k_higgs)
        row["v_rel_mse_higgs"] = relative_mse(v, v_higgs)
        for kind in ("k", "v"):
            row[f"{kind}_equivalent_bits"] = equivalent_bits(row[f"{kind}_rel_mse"])
            row[f"{kind}_equivalent_bits_higgs"] = equivalent_bits(row[f"{kind}_rel_mse_higgs"])
        fit.append(row)
        if log is not None:
            (bar.write if log is print else log)(
                f"layer {layer:>2}: K rel MSE {row['k_rel_mse']:.4f} (≈{row['k_equivalent_bits']:.2f} bits; "
                f"HIGGS alone {row['k_rel_mse_higgs']:.4f} ≈{row['k_equivalent_bits_higgs']:.2f}) · "
                f"V rel MSE {row['v_rel_mse']:.4f} (≈{row['v_equivalent_bits']:.2f} bits; "
                f"HIGGS alone {row['v_rel_mse_higgs']:.4f} ≈{row['v_equivalent_bits_higgs']:.2f})"
            )
        prev_k, prev_v = rk, rv
    pred.header = {"fit": fit, "seconds": {"collect": kv.seconds, "total": kv.seconds + time.perf_counter() - started}}
    return pred


def ridge_fit(x: torch.Tensor, y: torch.Tensor, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    stats = RidgeStats(x.shape[-1], y.shape[-1])
    stats.add(x, y)
    return stats.fit(lam)
