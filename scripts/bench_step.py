#!/usr/bin/env python
"""A whole decode step on a random-weight model of a hub layout: each method's cache vs DynamicCache.

    python scripts/bench_step.py                                         # Llama-2-7B layout, 4K and 32K, batch 1
    python scripts/bench_step.py --layout smollm2_135m --contexts 1024,8192 --methods fp16,kivi2,alignedkv_block
    python scripts/bench_step.py --layout llama2_7b --layers 4 --contexts 4096     # fewer layers: a CPU's memory

One token per sequence through every layer of ``kvquant.analysis.timing.layout_model`` (the hub model's
sizes, random weights, no download; fp16 on a GPU, fp32 on a CPU), after every layer's cache was filled
with synthetic K/V untimed (``model_step_time``); medians of ``--repeats`` steps after 2 warm-up steps.
``x dyn`` is the time over transformers' ``DynamicCache`` on the same model in the same run (issue 33's whole-step
criteria: fp16 <= 1.05, kivi2/kivi4 <= 0.8, gear2/gear4 <= 0.9, higgs_post_rope <= 1.0 at 32K); ``x fp16`` over our
fp16 cache; ``bits`` the mean bits read per K/V element; ``ops/layer`` the torch operators one more (untimed) step
dispatched per layer, views excepted (``kvquant.analysis.timing.OpCounter``: on a GPU each is a launch or a sync,
what a batch-1 step is bound by), ``syncs/layer`` those among them that wait for a GPU (``syncs_host``: ``item``,
``bincount``, boolean-mask indexing, copies to the host; on a CPU, what a GPU run of the same code would wait on
where the code does not branch on the device), ``kernels/layer`` a kernel backend's own launches in that step
(CuPy's; blank elsewhere). AQUA-KV methods (``aquakv``, ``aquakv_k_only``, ``aquakv_v_only``) get random predictors of
calibration's scale for the random model (written once to a temporary folder: the weights' values do not change the
time) and a floor row (``<name>_floor``: DynamicCache's step plus the predictors' matmuls over the coded history,
issue 33's floor). Methods are built on ``--backend`` (``auto``: the device's kernels where they are picked
automatically, else torch;
``cupy``/``cpu``/``torch`` by name), or ``name@backend`` for one (``kivi2@cupy``). Needs torch and
transformers only (no Hydra, W&B or lm-eval), so ``scripts/gpu_check.sh`` runs it on a bare GPU machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

METHODS = "fp16,kivi2,kivi4,gear2,gear4,higgs_post_rope,truncation,alignedkv,alignedkv_block"
COLUMNS = (
    "layout", "batch", "context", "method", "backend", "ms", "x dyn", "x fp16", "bits", "x floor", "ops/layer",
    "syncs/layer", "kernels/layer",
)  # fmt: skip


def table(rows: list[dict]) -> str:
    """The markdown table of the rows measured so far (a skipped cell says why in its method column)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = [row.get(c, "") for c in COLUMNS]
        cells = [f"{v:.3f}" if isinstance(v, float) else str(v) for v in cells]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def random_predictors(method, model, folder: Path):
    """``method`` (AQUA-KV) reading random predictors of calibration's scale made for ``model``'s config and
    quantizers, written once into ``folder``; other methods unchanged."""
    if getattr(method, "predict", "none") == "none":
        return method
    from kvquant.cache import KVGeometry
    from kvquant.methods.aquakv.predictors import FORMAT, Predictors, model_identity

    geometry = KVGeometry.of(model.config)
    quants = method.quantizers(geometry)
    identity = model_identity(model.config.get_text_config(decoder=True))
    path = method.default_path(identity, quants)
    path = folder / path.parent.name / path.name
    if not path.is_file():
        c, gen = geometry.n_kv_heads * geometry.head_dim, torch.Generator().manual_seed(0)
        header = {"format": FORMAT, "model": identity, "quantizer": method.quantizer_identity(quants)}
        pred = Predictors(header)
        for i in range(1, geometry.n_layers):
            if method.predict in ("k", "kv"):
                pred.k[i] = (torch.randn(c, c, generator=gen) * c**-0.5, torch.zeros(c))
            if method.predict in ("v", "kv"):
                pred.v[i] = (torch.randn(2 * c, c, generator=gen) * (2 * c) ** -0.5, torch.zeros(c))
        pred.save(path)
    return method.with_params(predictors=str(path))


def predictor_floor(method, model, batch: int, context: int, device: str, repeats: int) -> float | None:
    """Seconds of AQUA-KV's predictor matmuls in one decode step (every layer with predictors: ``[B·n, C] @ W_k``
    and ``[B·n, 2C] @ W_v`` plus bias over the ``n`` coded tokens, fp32 as the cache runs them), median of
    ``repeats`` after a warm-up; None for a method without predictors."""
    if getattr(method, "predict", "none") == "none":
        return None
    pred = method.load_predictors(model)
    n = max(1, batch * (context - method.sink - method.window))
    weights = [(w.to(device), b.to(device)) for w, b in (*pred.k.values(), *pred.v.values())]
    inputs = {w.shape[0]: torch.randn(n, w.shape[0], device=device) for w, _ in weights}
    times = []
    for _ in range(repeats + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for w, b in weights:
            torch.addmm(b, inputs[w.shape[0]], w)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def measure(layout: str, batch: int, context: int, methods: dict, args, device: str) -> list[dict]:
    """One cell: DynamicCache first, then each method (an AQUA-KV one after its floor), each row with its ratios."""
    from kvquant.analysis.timing import layout_model, model_step_time

    def time_of(method, profile=False):
        return model_step_time(
            method, layout, context, args.repeats, device=device, batch=batch, layers=args.layers, profile=profile
        )

    profile = set(args.profile.split(",")) if args.profile else set()
    dynamic = time_of(None, "DynamicCache" in profile)
    timed = {name: time_of(method, name in profile) for name, method in methods.items()}
    for name, t in [("DynamicCache", dynamic), *timed.items()]:
        if t.profile:
            where = f"{layout}, batch {batch}, {context} tokens"
            print(f"\n{name}, {where}: one step's operators by host time\n{t.profile}")
    base = timed["fp16"].seconds if "fp16" in timed else None
    rows = [{"method": "DynamicCache", "backend": "torch", "ms": dynamic.seconds * 1e3, "x dyn": 1.0}]
    rows[0] |= {"ops/layer": f"{dynamic.ops_per_layer:.1f}", "syncs/layer": f"{dynamic.syncs_per_layer:.1f}"}
    floors: dict[str, float] = {}
    for name, t in timed.items():
        method = methods[name]
        family = name.partition("@")[0]
        if family not in floors:
            model = layout_model(layout, device, args.layers)
            spent = predictor_floor(method, model, batch, context, device, args.repeats)
            if spent is not None:
                floors[family] = dynamic.seconds + spent
                seconds = floors[family]
                rows.append({"method": f"{family}_floor", "backend": "torch", "ms": seconds * 1e3,
                             "x dyn": seconds / dynamic.seconds})  # fmt: skip
        row = {"method": name, "backend": t.backend, "ms": t.seconds * 1e3, "x dyn": t.seconds / dynamic.seconds}
        if base:
            row["x fp16"] = t.seconds / base
        if family in floors:
            row["x floor"] = t.seconds / floors[family]
        launches = "" if t.launches_per_layer is None else f"{t.launches_per_layer:.1f}"
        counted = {"ops/layer": f"{t.ops_per_layer:.1f}", "syncs/layer": f"{t.syncs_per_layer:.1f}"}
        rows.append(row | {"bits": t.bits_read, **counted, "kernels/layer": launches})
    return [{"layout": layout, "batch": batch, "context": context} | row for row in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", default="llama2_7b")
    parser.add_argument("--contexts", default="4096,32768")
    parser.add_argument("--batches", default="1")
    parser.add_argument(
        "--methods", default=METHODS, help="registry names, name@backend for one backend (fp16 gives x fp16)"
    )
    parser.add_argument("--backend", default="auto", help="auto | torch | cpu | cupy, for methods that take one")
    parser.add_argument("--layers", type=int, default=0, help="layers of the random model (0: the layout's own)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-seconds", type=float, default=0.0, help="stop starting new cells after this")
    parser.add_argument("--out", type=Path, help="also write the markdown table here")
    parser.add_argument(
        "--profile", default="", help="methods (as in --methods, or DynamicCache) whose extra step is profiled"
    )
    args = parser.parse_args(argv)

    from kvquant.analysis.timing import LAYOUTS
    from kvquant.errors import KvquantError
    from kvquant.methods import get_method

    if args.layout not in LAYOUTS:
        print(f"error: unknown layout '{args.layout}'; valid: {', '.join(LAYOUTS)}", file=sys.stderr)
        return 2
    try:
        methods = {}
        for label in args.methods.split(","):
            name, _, backend = label.partition("@")
            method = get_method(name)
            if hasattr(method, "backend"):
                method = method.on_backend(backend or args.backend)
            elif backend:
                raise KvquantError(f"method {name} has no backend parameter: drop '@{backend}'")
            methods[label] = method
    except KvquantError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if any(getattr(m, "predict", "none") != "none" for m in methods.values()):
        from kvquant.analysis.timing import layout_model

        folder = Path(tempfile.mkdtemp(prefix="bench_step_predictors_"))
        model = layout_model(args.layout, device, args.layers)
        methods = {name: random_predictors(m, model, folder) for name, m in methods.items()}
    where = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    header = f"device: {where}; torch {torch.__version__}; layout {args.layout} (random weights)"
    if args.layers:
        header += f", {args.layers} layers"
    print(header, flush=True)
    start, rows = time.monotonic(), []
    for batch in (int(x) for x in args.batches.split(",")):
        for context in (int(x) for x in args.contexts.split(",")):
            cell = {"layout": args.layout, "batch": batch, "context": context}
            if args.max_seconds and time.monotonic() - start > args.max_seconds:
                rows.append(cell | {"method": "skipped: time budget"})
                continue
            try:
                rows += measure(args.layout, batch, context, methods, args, device)
            except torch.OutOfMemoryError:
                rows.append(cell | {"method": "out of memory"})
            if device == "cuda":
                torch.cuda.empty_cache()
            if args.out:  # rewritten after every cell, so a cut-short run still leaves its table
                args.out.write_text(f"{header}\n\n{table(rows)}\n")
    print(f"\n{table(rows)}")
    if not any("ms" in row for row in rows):  # a benchmark that measured nothing has not passed
        print("error: no cell was measured (time budget or out of memory)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
