"""fp16 reference outputs, cached on disk, and fidelity of a method's outputs to them.

A reference holds, per unit (one generation or one scored continuation), fp16's tokens and the
top-``TOPK`` next-token log-probabilities at each position, plus each example's answer and the
per-example numbers its metrics are computed from (``values``: the paired differences to fp16). It is
computed once per (model, task parameters — limit and seed included, reference method) and saved,
so a sweep over methods pays for it once.

Fidelity, per unit then averaged over units (positions compared: the shorter of the two runs):

- ``greedy_match``: share of generated positions whose token equals fp16's (a length difference
  counts as mismatches); ``first_divergence``: index of the first differing token (fp16's length if
  none); generation units only.
- ``kl``: KL(fp16 ‖ method) of next-token distributions with the method teacher-forced along fp16's
  tokens, over fp16's top-``TOPK`` tokens plus one bucket for the rest (a coarsening: never above
  the full KL, equal when the top tokens hold all of fp16's mass); ``top1_agreement``: share of
  positions whose argmax equals fp16's.
- ``answer_agreement`` (computed by the task): share of examples whose answer equals fp16's.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

TOPK = 64
FORMAT = 2  # 2: per-example ``values``; a reference of format 1 is recomputed


@dataclass
class UnitRecord:
    """fp16's tokens and top-k log-probabilities for one unit."""

    tokens: torch.Tensor
    top_ids: torch.Tensor
    top_lp: torch.Tensor
    generated: bool

    @classmethod
    def from_logprobs(cls, tokens: torch.Tensor, logprobs: torch.Tensor, generated: bool) -> UnitRecord:
        k = min(TOPK, logprobs.shape[-1])
        lp, ids = logprobs.float().topk(k, dim=-1)
        return cls(tokens.to(torch.int32).cpu(), ids.to(torch.int32).cpu(), lp.cpu(), generated)


@dataclass
class Reference:
    """Every unit of a reference run, every example's answer and its metric inputs (``values``)."""

    units: dict[str, UnitRecord] = field(default_factory=dict)
    answers: dict[str, str] = field(default_factory=dict)
    values: dict[str, dict[str, Any]] = field(default_factory=dict)

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically (a tensor-and-string payload; loaded with ``weights_only``, so no code runs)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "format": FORMAT,
            "answers": dict(self.answers),
            "values": {k: dict(v) for k, v in self.values.items()},
            "units": {
                k: {"tokens": u.tokens, "top_ids": u.top_ids, "top_lp": u.top_lp, "generated": u.generated}
                for k, u in self.units.items()
            },
        }
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            torch.save(payload, tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Reference | None:
        """The reference at ``path``, or None if absent, unreadable or of another format."""
        try:
            payload = torch.load(path, weights_only=True)
        except (OSError, RuntimeError, EOFError, ValueError):
            return None
        if not isinstance(payload, dict) or payload.get("format") != FORMAT:
            return None
        units = {k: UnitRecord(**u) for k, u in payload["units"].items()}
        return cls(units=units, answers=dict(payload["answers"]), values=dict(payload.get("values") or {}))


def reference_path(root: str | os.PathLike, model, task_name: str, task_params: dict, reference: dict) -> Path:
    """Where the reference for (model, task parameters, reference method) lives under ``root``."""
    ident = {
        "model": str(getattr(model.config, "name_or_path", "")),
        "dtype": str(model.dtype),
        "device": model.device.type,
        "task": task_name,
        "params": task_params,
        "reference": reference,
        "format": FORMAT,
        "topk": TOPK,
    }
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]
    model_tag = Path(ident["model"]).name or "model"
    return Path(root) / model_tag / task_name / f"{reference.get('name', 'ref')}-{digest}.pt"


def topk_kl(ref: UnitRecord, logprobs: torch.Tensor) -> torch.Tensor:
    """KL(ref ‖ method) per position over ref's top-k tokens plus a bucket for the remaining mass."""
    n = min(ref.top_lp.shape[0], logprobs.shape[0])
    ref_lp = ref.top_lp[:n].double()
    q_lp = logprobs[:n].double().gather(1, ref.top_ids[:n].long())
    p = ref_lp.exp()
    kl = (p * (ref_lp - q_lp)).sum(-1)
    p_rest = (1 - p.sum(-1)).clamp_min(0)
    q_rest = (1 - q_lp.exp().sum(-1)).clamp_min(1e-30)
    rest = p_rest * (p_rest.clamp_min(1e-30).log() - q_rest.log())
    rest = torch.where(p_rest > 1e-12, rest, torch.zeros_like(rest))
    return (kl + rest).clamp_min(0).float()


def token_match(ref_tokens: torch.Tensor, tokens: torch.Tensor) -> tuple[float, int]:
    """(share of positions equal, first differing index) of two token runs; lengths may differ."""
    n = min(ref_tokens.numel(), tokens.numel())
    same = ref_tokens[:n].long() == tokens[:n].long()
    longest = max(ref_tokens.numel(), tokens.numel(), 1)
    diverged = (~same).nonzero()
    first = int(diverged[0, 0]) if diverged.numel() else n
    return float(same.sum()) / longest, first


@dataclass
class FidelityStats:
    """Per-unit fidelity numbers, keyed by unit, averaged over units in ``summary``."""

    per_unit: dict[str, dict[str, float]] = field(default_factory=dict)

    def add(
        self, key: str, ref: UnitRecord, tokens: torch.Tensor, forced_logprobs: torch.Tensor, generated: bool
    ) -> None:
        kl = topk_kl(ref, forced_logprobs)
        n = kl.numel()
        top1 = forced_logprobs[:n].argmax(-1) == ref.top_ids[:n, 0].long()
        row = {
            "kl": float(kl.mean()) if n else float("nan"),
            "top1_agreement": float(top1.float().mean()) if n else float("nan"),
        }
        if generated:
            row["greedy_match"], row["first_divergence"] = token_match(ref.tokens, tokens)
        self.per_unit[key] = row

    def for_prefix(self, prefix: str) -> dict[str, float]:
        """Mean of each number over the units of one example (keys ``<prefix>#<i>``)."""
        rows = [r for k, r in self.per_unit.items() if k.rsplit("#", 1)[0] == prefix]
        return _means(rows)

    def summary(self) -> dict[str, float]:
        return _means(list(self.per_unit.values()))


def _means(rows: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, Any] = {}
    for name in ("greedy_match", "first_divergence", "kl", "top1_agreement"):
        values = [r[name] for r in rows if name in r and r[name] == r[name]]
        if values:
            out[name] = sum(values) / len(values)
    return out
