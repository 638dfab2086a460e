"""Same answers on every backend: each method's greedy tokens with its kernels vs its torch reference.

For each method in ``methods`` (registry names with a ``backend`` parameter), every prompt (consecutive
WikiText-2 windows, ``experiments/greedy.py``) is decoded greedily with ``backend=torch`` and with
``backend`` (``cpu``: the C++ kernels). Columns: tokens equal, prompts identical, the first
difference's position and the torch run's top-2 margin there (a near-tie, below ``NEAR_TIE`` nats,
is what fp32 summation order may flip), bits read on each backend (equal: the kernels read what the
rules chose), and the decode time ratio kernel/torch in the same run. Methods that round to codes
(KIVI, GEAR) may differ beyond a near-tie: the kernel's attention differs from SDPA's in the last fp32
bits, which moves later layers' K/V by as much and flips the odd code sitting on a rounding boundary —
a whole quantization step; the teacher-forced KL between the backends (``tests/test_window.py``) is
what shows the kernels compute the same attention.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from experiments.figures import progress, publish_table, skipped_line, start, write_markdown

NAME = "table_backends"
RESUME = "never"  # run.py: timings are measured again on every run, never reused


def render(table, stem: Path, results: dict[str, Any] | None = None) -> list[Path]:
    """``stem.md``: one row per method."""
    exp = (results or {}).get("experiment", {})
    lines = [
        f"## Greedy tokens, backend {exp.get('backend', '?')} vs torch ({exp.get('prompts', '?')} prompts × "
        f"{exp.get('new_tokens', '?')} tokens)",
        "",
        "| method | tokens equal | prompts identical | first differences (position: torch's top-2 margin) "
        "| bits read torch / kernel | decode time kernel / torch |",
        "|---|---|---|---|---|---|",
    ]
    for r in table.to_dict(orient="records"):
        if skipped := skipped_line(r, "method", 4):
            lines.append(skipped)
            continue
        firsts = r["first_differences"] if isinstance(r["first_differences"], str) else "–"  # NaN: none
        lines.append(
            f"| {r['method']} | {r['tokens_equal']:.4f} | {int(r['prompts_identical'])}/{int(r['prompts'])} "
            f"| {firsts} | {r['bits_read_torch']:.3f} / {r['bits_read_kernel']:.3f} "
            f"| {r['decode_ratio']:.2f} |"
        )
    lines += [
        "",
        f"A first difference at a top-2 margin below {exp.get('near_tie_nats', 0.01)} nats is a near-tie that fp32 "
        "summation order may flip. KIVI and GEAR round to codes: the kernel's attention differs from SDPA's in the "
        "last fp32 bits, later layers' K/V move by as much, and a code on a rounding boundary flips by a whole step, "
        "so their greedy paths part beyond near-ties; the same bits are read on both backends.",
    ]
    return [write_markdown(stem, lines)]


def compare_backends(model, prompts, method, backend: str, new_tokens: int) -> dict[str, Any]:
    """Greedy decodes of every prompt on torch and on ``backend``; the row of the table."""
    from kvquant.eval.fidelity import NEAR_TIE, greedy_decode, top2_margin

    runs: dict[str, list] = {"torch": [], backend: []}
    for name in runs:
        m = method.with_params(backend=name)
        with m.attach(model):
            runs[name] = [greedy_decode(model, p, m.new_cache(model), new_tokens) for p in prompts]
    equal, identical, firsts, near = 0.0, 0, [], True
    for ref, out in zip(runs["torch"], runs[backend], strict=True):
        same = out.tokens == ref.tokens
        equal += same.float().mean().item()
        identical += int(bool(same.all()))
        differ = (~same).nonzero()
        if differ.numel():
            pos = int(differ[0, 0])
            margin = float(top2_margin(ref.logprobs[pos]))
            near = near and margin < NEAR_TIE
            firsts.append(f"{pos}: {margin:.4f}")

    def bits(decodes) -> float:
        total = decodes[0].counts
        for d in decodes[1:]:
            total = total + d.counts
        return total.summary()["bits_read"]

    return {
        "tokens_equal": equal / len(prompts),
        "prompts_identical": identical,
        "prompts": len(prompts),
        "first_differences": "; ".join(firsts),
        "all_first_differences_near_ties": near,
        "bits_read_torch": bits(runs["torch"]),
        "bits_read_kernel": bits(runs[backend]),
        "decode_ratio": sum(d.decode_s for d in runs[backend]) / sum(d.decode_s for d in runs["torch"]),
    }


def run(cfg: DictConfig) -> dict[str, Any]:
    from experiments.greedy import prompt_windows
    from kvquant.errors import KvquantError
    from kvquant.eval.fidelity import NEAR_TIE
    from kvquant.methods import get_method

    exp, model, tok, device = start(cfg)
    new_tokens, prompt_tokens = int(exp.new_tokens), int(exp.prompt_tokens)
    prompts = prompt_windows(model, tok, exp)
    rows = []
    for name in progress([str(m) for m in exp.methods], cfg, NAME):
        try:
            method = get_method(name, backend=str(exp.backend))
            method.new_cache(model)  # refusals (no kernels here, a model they cannot run) before any decoding
            rows.append({"method": name} | compare_backends(model, prompts, method, str(exp.backend), new_tokens))
        except KvquantError as exc:
            rows.append({"method": name, "reason": " ".join(str(exc).split())})
    experiment = {
        "name": NAME,
        "backend": str(exp.backend),
        "prompts": len(prompts),
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "near_tie_nats": NEAR_TIE,
    }
    return publish_table(render, NAME, rows, cfg, model, experiment, device)
