"""Benchmark: decode-step time of each KV method's cache vs the fp16 cache, measured in the same run.

For each context length the model prefills ``context − 1`` WikiText-2 tokens once (a plain
``DynamicCache``); every cache then receives those exact K/V through its own ``update`` (what the
model's prefill would hand it) and decodes ``new_tokens`` greedy tokens. Repeats are interleaved
across caches (so background load hits them alike), one warm-up excluded; the table gives the median
ms per decode step and its ratio to kvquant's fp16 cache and to transformers' ``DynamicCache``
(``hf_dynamic``). Timing is never asserted in a test: only this table reports it.

A second part checks that a decode step does not re-quantize the cache: from the first context it
feeds ``profile_steps`` single-token K/V into all layers (cache work only, no model) and reports, per
bucket of steps, the median and max step time as ratios to fp16's. A flat median ratio means per-step
work grows only like fp16's own read of the history; the max shows the periodic block flushes.
A method entry ``name@backend`` (``kivi2@cpu``) times that method on that backend, and
``name(key=value, ...)`` with its parameters (``"alignedkv_plus_block(v_block=8)@cpu"``, quoted on the command
line); the baseline is kvquant's fp16 cache on the torch path. AQUA-KV entries add a floor row
(``aquakv_floor``): DynamicCache's step plus the predictors' matmuls over the history (the method's own
weights, so the same shapes, on the tokens coded at the middle decode step), timed in the same repeats;
``ratio_floor`` is each row's time over it (AQUA-KV's predictors must run over the whole history every step,
so no AQUA-KV step can beat it). (Formerly ``scripts/bench_kv_methods.py``.) ``render`` writes
``bench_kv_methods.md`` from the CSV.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from omegaconf import DictConfig

from experiments.figures import progress, publish_table, start, write_markdown

NAME = "bench_kv_methods"
RESUME = "never"  # run.py: timings are measured again on every run, never reused
BASELINE = "fp16"
HF = "hf_dynamic"
FLOOR = "_floor"


def context_ids(tokenizer, n: int) -> torch.Tensor:
    """The first ``n`` tokens of WikiText-2 (test)."""
    from kvquant.data import wikitext2_test
    from kvquant.errors import InvalidParameterError

    ids = tokenizer(wikitext2_test()[: 12 * n]).input_ids
    if len(ids) < n:
        raise InvalidParameterError(f"not enough bundled text for a {n}-token context")
    return torch.tensor(ids[:n])


ENTRY = re.compile(r"(?P<name>[\w.-]+)(?:\((?P<params>[^()]*)\))?(?:@(?P<backend>\w+))?")


def method_spec(entry: str) -> tuple[str, dict[str, Any]]:
    """``name``, ``name@backend`` (e.g. ``kivi2@cpu``: the C++ kernels) or ``name(key=value, ...)@backend``
    (``alignedkv_plus_block(v_block=8)@cpu``; values read as YAML scalars) → (label, build spec)."""
    from kvquant.errors import InvalidParameterError

    match = ENTRY.fullmatch(entry.replace(" ", ""))
    pairs = [p.partition("=") for p in (match["params"] or "").split(",") if p] if match else []
    if match is None or any(not key or not eq for key, eq, _ in pairs):
        raise InvalidParameterError(
            f"method entry {entry!r}: write name, name@backend or name(key=value,...)@backend, "
            "e.g. 'alignedkv_plus_block(v_block=8)@cpu'"
        )
    params = {key: yaml.safe_load(value) for key, _, value in pairs}
    backend = {"backend": match["backend"]} if match["backend"] else {}
    return entry, {"name": match["name"], **params, **backend}


def filled_cache(make: Callable[[], Any], kv: list[tuple[torch.Tensor, torch.Tensor]]):
    """A fresh cache that has received ``kv`` through its own ``update``, layer by layer."""
    cache = make()
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i)
    return cache


def predictor_matmuls(method, model, history: int) -> Callable[[], float] | None:
    """A timer of what AQUA-KV's predictors cost per decode step at ``history`` coded tokens: for every
    layer with predictors, ``[n, C] @ W_k`` and ``[n, 2C] @ W_v`` (+ bias; the method's own weights, so
    the same shapes) over random rows; returns seconds per call. None for a method without predictors."""
    if getattr(method, "predict", "none") == "none":
        return None
    pred = method.load_predictors(model)
    gen = torch.Generator().manual_seed(0)
    weights = (*pred.k.values(), *pred.v.values())
    pairs = [(torch.randn(max(history, 1), w.shape[0], generator=gen), w, b) for w, b in weights]

    def run() -> float:
        t0 = time.perf_counter()
        for x, w, b in pairs:
            torch.addmm(b, x, w)
        return time.perf_counter() - t0

    return run


def floor_name(label: str) -> str:
    """The floor row of an AQUA-KV entry (``aquakv@cpu`` → ``aquakv_floor``: one per registry name)."""
    return f"{label.partition('@')[0]}{FLOOR}"


def decode_times(
    model, kv, last: torch.Tensor, methods: dict, new_tokens: int, repeats: int, floors: dict | None = None
) -> dict[str, float]:
    """Median seconds per decode step for each cache (None: transformers' DynamicCache), interleaved;
    with ``floors`` (``{floor name: predictor_matmuls timer}``) each floor is DynamicCache's step plus
    the median of its predictor matmuls, timed in the same repeats."""
    from transformers import DynamicCache

    from kvquant.eval.fidelity import greedy_decode
    from kvquant.methods import get_method

    fp16 = get_method(BASELINE, backend="torch")  # the documented baseline: the torch path, whatever the default
    floors = floors or {}
    times: dict[str, list[float]] = {name: [] for name in (*methods, *floors)}
    for rep in range(repeats + 1):
        for name, method in methods.items():
            with (method or fp16).attach(model):
                make = (lambda m=method: m.new_cache(model)) if method else DynamicCache
                run = greedy_decode(model, last, filled_cache(make, kv), new_tokens)
            if rep:
                times[name].append(run.decode_s / (new_tokens - 1))
        for name, timer in floors.items():
            spent = statistics.median(timer() for _ in range(new_tokens - 1))
            if rep:
                times[name].append(spent)
    out = {name: statistics.median(ts) for name, ts in times.items()}
    for name in floors:
        out[name] += out[HF]
    return out


def step_profile(kv, methods: dict, model, steps: int, bucket: int, seed: int = 0) -> dict[str, list[tuple]]:
    """Per bucket of single-token cache updates (all layers): (median, max) seconds per step."""
    from transformers import DynamicCache

    from kvquant.methods import get_method

    gen = torch.Generator().manual_seed(seed)
    k0, v0 = kv[0]
    new = [
        [(torch.randn(*k0.shape[:2], 1, k0.shape[-1], generator=gen) * k.std()).to(k.dtype) for k, _ in kv]
        for _ in range(steps)
    ]
    out: dict[str, list[tuple[float, float]]] = {}
    for name, method in methods.items():
        per_step = []
        with (method or get_method(BASELINE)).attach(model):
            cache = filled_cache((lambda m=method: m.new_cache(model)) if method else DynamicCache, kv)
            for s in range(steps):
                t0 = time.perf_counter()
                for i, k in enumerate(new[s]):
                    cache.update(k, k.to(v0.dtype), i)
                per_step.append(time.perf_counter() - t0)
        out[name] = [
            (statistics.median(per_step[b : b + bucket]), max(per_step[b : b + bucket]))
            for b in range(0, steps, bucket)
        ]
    return out


def render(table, stem: Path, results: dict[str, Any] | None = None) -> list[Path]:
    """``stem.md``: ms per decode step with ratios to fp16 and DynamicCache, then the cache-only profile."""
    results = results or {}
    exp = results.get("experiment", {})
    title = ", ".join(str(x) for x in (results.get("model", {}).get("name"), results.get("env", {}).get("device")) if x)
    decode = table[table.part == "decode"]
    floors = "ratio_floor" in decode and bool(decode.ratio_floor.notna().any())
    lines = [
        f"## Decode step vs fp16{': ' + title if title else ''} ({exp.get('new_tokens', '?')} greedy tokens, "
        f"median of {exp.get('repeats', '?')} interleaved repeats, torch threads: {exp.get('threads', '?')})",
        "",
        f"| context | cache | ms/step | × fp16 | × {HF} |" + (" × floor |" if floors else ""),
        "|---|---|---|---|---|" + ("---|" if floors else ""),
    ]
    for r in decode.to_dict(orient="records"):
        floor = r.get("ratio_floor")
        cell = f" {floor:.2f} |" if isinstance(floor, float) and floor == floor else " – |"
        lines.append(
            f"| {int(r['context'])} | {r['cache']} | {r['ms_per_step']:.2f} | {r['ratio_fp16']:.2f} "
            f"| {r['ratio_hf_dynamic']:.2f} |" + (cell if floors else "")
        )
    if floors:
        lines += [
            "",
            f"`<method>{FLOOR}`: DynamicCache's step plus that AQUA-KV method's predictor matmuls over the history "
            "(its own weights, the coded tokens at the middle step), timed in the same run: what no AQUA-KV step "
            "can beat; `× floor` is a row's time over it.",
        ]
    lines += [f"| – | {label} | skipped: {reason} |" for label, reason in (exp.get("skipped") or {}).items()]
    profile = table[table.part == "profile"]
    if len(profile):
        spans = list(dict.fromkeys(profile.steps))
        start = int(profile.context.iloc[0])
        lines += [
            "",
            f"## Cache-only update time per step, all layers, from context {start}: median ms (× fp16), "
            "max × fp16's max",
            "",
            "| cache | " + " | ".join(f"steps {s}" for s in spans) + " |",
            "|---" * (1 + len(spans)) + "|",
        ]
        for cache, rows in profile.groupby("cache", sort=False):
            cells = [
                f"{r['ms_per_step']:.2f} (×{r['ratio_fp16']:.2f}); max ×{r['max_ratio_fp16']:.1f}"
                for r in rows.to_dict(orient="records")
            ]
            lines.append(f"| {cache} | " + " | ".join(cells) + " |")
    return [write_markdown(stem, lines)]


def run(cfg: DictConfig) -> dict[str, Any]:
    from experiments.greedy import build_methods
    from kvquant.analysis.capture import capture_kv
    from kvquant.errors import KvquantError

    if cfg.experiment.threads:
        torch.set_num_threads(int(cfg.experiment.threads))
    exp, model, tokenizer, device = start(cfg)
    built, skipped = build_methods({BASELINE: {}, **dict(method_spec(str(m)) for m in exp.methods if m != BASELINE)})
    for name, method in list(built.items()):
        try:
            method.new_cache(model)  # model-dependent refusals (predictors, group sizes) before any timing
        except KvquantError as exc:
            skipped[name] = " ".join(str(exc).split())
            del built[name]
    methods = {**built, HF: None}
    limit = model.config.max_position_embeddings
    contexts = sorted({min(int(c), limit - int(exp.new_tokens)) for c in exp.contexts})
    rows = []
    for ctx in progress(contexts, cfg, NAME):
        ids = context_ids(tokenizer, ctx)
        kv = capture_kv(model, ids[:-1])
        floors = {}
        for name, method in built.items():  # AQUA-KV's floor: coded tokens at the middle decode step
            history = ctx + int(exp.new_tokens) // 2 - getattr(method, "sink", 0) - getattr(method, "window", 0)
            timer = predictor_matmuls(method, model, history)
            if timer is not None:
                floors.setdefault(floor_name(name), timer)
        step = decode_times(model, kv, ids[-1:], methods, int(exp.new_tokens), int(exp.repeats), floors)
        for name, s in step.items():
            floor = step.get(name if name in floors else floor_name(name))  # AQUA-KV rows and their floor
            rows.append(
                {"part": "decode", "context": ctx, "cache": name, "ms_per_step": 1e3 * s}
                | {"ratio_fp16": s / step[BASELINE], "ratio_hf_dynamic": s / step[HF]}
                | ({"ratio_floor": s / floor} if floor is not None else {})
            )
        if exp.profile_steps and ctx == contexts[0]:
            bucket = int(exp.bucket)
            profiles = step_profile(kv, methods, model, int(exp.profile_steps), bucket)
            base = profiles[BASELINE]
            for name, buckets in profiles.items():
                for i, ((med, top), (bmed, btop)) in enumerate(zip(buckets, base, strict=True)):
                    rows.append(
                        {"part": "profile", "context": ctx, "cache": name, "ms_per_step": 1e3 * med}
                        | {"steps": f"{ctx + i * bucket + 1}-{ctx + (i + 1) * bucket}", "ratio_fp16": med / bmed}
                        | {"max_ratio_fp16": top / btop}
                    )
    experiment = {
        "name": NAME,
        "contexts": contexts,
        "new_tokens": int(exp.new_tokens),
        "repeats": int(exp.repeats),
        "threads": torch.get_num_threads(),
        "skipped": skipped,
    }
    return publish_table(render, NAME, rows, cfg, model, experiment, device, env=True)
