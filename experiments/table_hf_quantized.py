"""Side by side with transformers' own ``QuantizedCache``: greedy fidelity to fp16 on the same prompts.

Every cache — transformers' ``QuantizedCache`` per ``hf_caches`` (backend ``quanto`` needs
``pip install -e '.[compare]'``; ``fp8`` needs nothing) and kvquant's per ``methods`` — decodes
``new_tokens`` greedy tokens after each of ``prompts`` consecutive ``prompt_tokens``-token WikiText-2
windows (``experiments/greedy.py``). Columns: tokens equal to fp16's, share before the first divergence,
prompts identical, bits stored and read (measured for kvquant caches; by :func:`hf_bits`' formula for
transformers' caches, which expose no byte count), decode time as a ratio to fp16's in the same run.
A cache that cannot run here is listed with the reason. (Formerly ``scripts/compare_hf_quantized.py``.)
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from experiments.figures import progress, publish_table, skipped_line, start, write_markdown

NAME = "table_hf_quantized"
RESUME = "never"  # run.py: timings are measured again on every run, never reused
COMPARE_EXTRA = "pip install -e '.[compare]'"
NOTE = (
    "Bits per element at this context, fp16 windows included: measured from the tensors kvquant's caches "
    "hold; for transformers' caches, which expose no byte count, by formula (quanto: codes plus an fp16 scale "
    "and zero per group of 64, the newest tokens in its fp16 window; fp8: 8 bits). Decode × fp16: summed decode "
    "time over fp16's in the same run (CPU reference paths, a loaded machine moves it)."
)


def hf_bits(backend: str, nbits: int, prompt: int, steps: int, residual: int = 128, group: int = 64) -> float:
    """Bits per element transformers' cache holds after ``prompt`` tokens and ``steps`` decode steps.

    ``quanto``: the whole prompt is quantized at once, then everything again each time the fp16 window
    reaches ``residual`` tokens; codes plus an fp16 scale and zero per ``group``. ``fp8``: 8-bit codes
    and one fp32 scale per tensor (negligible).
    """
    if backend == "fp8":
        return 8.0
    quantized = prompt + steps // residual * residual
    return (quantized * (nbits + 32 / group) + (prompt + steps - quantized) * 16) / (prompt + steps)


def hf_cache_factory(model, spec: dict[str, Any]):
    """A ``() -> QuantizedCache`` for ``{backend, nbits?}``; raises ``KvquantError`` with the fix if it cannot run."""
    from transformers import QuantizedCache

    from kvquant.errors import InvalidParameterError, KvquantError

    spec = dict(spec)
    backend = spec.pop("backend")
    if backend == "quanto":
        try:
            import optimum.quanto  # noqa: F401
        except ImportError:
            raise KvquantError(f"transformers' quanto backend needs optimum-quanto: {COMPARE_EXTRA}") from None
    try:
        QuantizedCache(backend=backend, config=model.config, **spec)  # refuses bad settings before any decode
    except (ValueError, ImportError) as exc:
        raise InvalidParameterError(f"QuantizedCache(backend={backend!r}): {' '.join(str(exc).split())}") from None
    return lambda: QuantizedCache(backend=backend, config=model.config, **spec)


def _num(value: Any, digits: int) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def render(table, stem: Path, results: dict[str, Any] | None = None) -> list[Path]:
    """``stem.md`` from the CSV: one row per cache, skipped caches with their reason."""
    exp = (results or {}).get("experiment", {})
    model = (results or {}).get("model", {}).get("name", "")
    lines = [
        f"## Greedy fidelity to fp16 vs transformers' QuantizedCache: {model}, {exp.get('prompts', '?')} WikiText-2"
        f" windows of {exp.get('prompt_tokens', '?')} tokens × {exp.get('new_tokens', '?')} greedy tokens",
        "",
        "| cache | tokens equal to fp16 | before first divergence | prompts identical | bits stored | bits read "
        "| decode × fp16 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in table.to_dict(orient="records"):
        if skipped := skipped_line(r, "cache"):
            lines.append(skipped)
            continue
        formula = " (formula)" if r["bits_source"] == "formula" else ""
        lines.append(
            f"| {r['cache']} | {r['greedy_match']:.3f} | {r['before_divergence']:.3f} "
            f"| {int(r['prompts_identical'])}/{int(r['prompts'])} | {_num(r['bits_stored'], 2)}{formula} "
            f"| {_num(r['bits_read'], 2)}{formula} | {_num(r['decode_ratio_fp16'], 2)} |"
        )
    return [write_markdown(stem, [*lines, "", NOTE])]


def run(cfg: DictConfig) -> dict[str, Any]:
    from experiments.greedy import build_methods, compare, prompt_windows, references
    from kvquant.errors import KvquantError

    exp, model, tok, device = start(cfg)
    new_tokens, prompt_tokens = int(exp.new_tokens), int(exp.prompt_tokens)
    prompts = prompt_windows(model, tok, exp)
    refs = references(model, prompts, new_tokens)
    fp16_decode_s = sum(r.decode_s for r in refs)
    methods, skipped = build_methods(OmegaConf.to_container(exp.methods, resolve=True))
    rows: list[dict[str, Any]] = []
    for label, spec in OmegaConf.to_container(exp.hf_caches, resolve=True).items():
        try:
            fid = compare(model, prompts, refs, hf_cache_factory(model, spec), new_tokens).row()
        except KvquantError as exc:
            rows.append({"cache": label, "source": "transformers", "reason": " ".join(str(exc).split())})
            continue
        shape = {"residual": spec.get("residual_length") or 128, "group": spec.get("q_group_size") or 64}
        bits = hf_bits(spec["backend"], int(spec.get("nbits") or 4), prompt_tokens, new_tokens - 1, **shape)
        rows.append(
            {"cache": label, "source": "transformers", **fid, "bits_stored": bits, "bits_read": bits}
            | {"bits_source": "formula", "decode_ratio_fp16": fid["decode_s"] / fp16_decode_s}
        )
    for label, method in progress(methods.items(), cfg, NAME):
        with method.attach(model):
            fid = compare(model, prompts, refs, lambda m=method: m.new_cache(model), new_tokens).row()
        rows.append(
            {"cache": label, "source": "kvquant", **fid, "bits_source": "measured"}
            | {"decode_ratio_fp16": fid["decode_s"] / fp16_decode_s}
        )
    rows += [{"cache": label, "source": "kvquant", "reason": reason} for label, reason in skipped.items()]
    experiment = {"name": NAME, "prompts": len(prompts), "prompt_tokens": prompt_tokens, "new_tokens": new_tokens}
    return publish_table(render, NAME, rows, cfg, model, experiment, device)
