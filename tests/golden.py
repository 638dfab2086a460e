"""Golden outputs of every registered method: greedy tokens and bits, recorded before a refactor.

``python tests/golden.py`` (from the repo root, after ``make setup``) records, for every registered
method on 3 stories260k and 3 smollm2_135m prompts, the 64 greedy tokens, each step's top-2 margin
(so a check can tell a near-tie from a real change) and the cache's bits stored/read, into
``tests/data/golden_outputs.json``; ``python tests/golden.py MODEL... --methods a,b`` records only those methods of
those models (a change that moves one method's bits on purpose), keeping every other recording.
``tests/test_golden.py`` teacher-forces the recorded tokens
through today's code and compares. AQUA-KV uses predictors calibrated here with a small, seeded
setting (``CALIB``). stories260k's are recorded with the outputs (``tests/data/predictors/``): its tokens
are checked at every firm margin, and a calibration's least-squares sums follow the BLAS code path
(predictors fitted under ``MKL_CBWR=COMPATIBLE`` flipped a token at a 0.58-nat margin). smollm2's are
calibrated in the fixture: only its bits are checked, which do not depend on the predictors.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "golden_outputs.json"
NEW_TOKENS = 64
CALIB = {"n_seqs": 4, "seq_len": 256, "seed": 0, "progress": False, "log": None}
MODELS = {"stories260k": (3, 160), "smollm2_135m": (3, 200)}  # prompts, prompt tokens: > KIVI's fp16 window
# Parameters a model needs today (stories260k's head_dim 8 takes no default group size of KIVI/GEAR).
PARAMS = {"stories260k": {"kivi": {"group_size": 8}, "gear": {"group_size": 8}}}
NEEDS_PREDICTORS = ("aquakv", "aquakv_k_only", "aquakv_v_only")
SHIPPED_PREDICTORS = ROOT / "tests" / "data" / "predictors"
SHIPS_PREDICTORS = ("stories260k",)


def method_params(model_name: str, method: str) -> dict:
    for family, params in PARAMS.get(model_name, {}).items():
        if method.startswith(family):
            return dict(params)
    return {}


def prompts(model_name: str, tok) -> list[torch.Tensor]:
    """Fixed prompts: TinyStories for stories260k, WikiText-2 for smollm2."""
    from kvquant.data import tinystories_pieces, wikitext2_test

    n, length = MODELS[model_name]
    if model_name == "stories260k":
        texts = [" ".join(tinystories_pieces()[10 * i : 10 * i + 6]) for i in range(n)]
    else:
        words = wikitext2_test().split(" ")
        texts = [" ".join(words[4000 * (i + 1) : 4000 * (i + 1) + 600]) for i in range(n)]
    out = []
    for text in texts:
        ids = tok(text, return_tensors="pt").input_ids[0][:length]
        assert ids.numel() == length, (model_name, ids.numel())
        out.append(ids)
    return out


def predictor_dir(model, tok, where: Path, recording: bool = False) -> None:
    """Put every AQUA-KV variant's predictors for ``model`` into ``where`` (to be named by
    ``KVQUANT_PREDICTOR_DIR``): the recorded ones for a model in ``SHIPS_PREDICTORS``, else calibrated
    here; ``recording`` calibrates them all afresh and records the shipped ones."""
    import os
    import shutil

    from kvquant import get_method
    from kvquant.methods.aquakv import model_identity
    from kvquant.methods.aquakv.calibration import calibration_kv

    before = os.environ.get("KVQUANT_PREDICTOR_DIR")
    os.environ["KVQUANT_PREDICTOR_DIR"] = str(where)
    kv = None  # the model's calibration K/V, collected once for every variant that calibrates
    try:
        for name in NEEDS_PREDICTORS:
            method = get_method(name)
            identity = model_identity(model.config.get_text_config(decoder=True))
            path = method.default_path(identity, method.quantizers(model.config))
            shipped = SHIPPED_PREDICTORS / path.relative_to(where)
            ships = next((m for m in SHIPS_PREDICTORS if identity["id"].startswith(m)), None)
            if path.is_file():
                continue
            if recording or ships is None:
                options = {k: v for k, v in CALIB.items() if k in ("n_seqs", "seq_len", "seed")}
                kv = kv or calibration_kv(model, tok, **options, sink=method.sink)
                method.calibrate(model, tok, **CALIB, kv=kv).save(path)
                if ships:
                    shipped.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(path, shipped)
            elif shipped.is_file():
                path.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(shipped, path)
            else:
                raise FileNotFoundError(f"{shipped} is missing: record it with `python tests/golden.py {ships}`")
    finally:
        if before is None:
            os.environ.pop("KVQUANT_PREDICTOR_DIR")
        else:
            os.environ["KVQUANT_PREDICTOR_DIR"] = before


def decode(model, prompt: torch.Tensor, method, forced: torch.Tensor | None = None):
    """Greedy tokens through ``method``'s torch reference (the goldens' backend, whatever the default)."""
    from kvquant.eval.fidelity import greedy_decode

    method = method.on_backend("torch")
    with method.attach(model):
        return greedy_decode(model, prompt, method.new_cache(model), NEW_TOKENS, forced=forced)


def bits_of(decoded) -> dict[str, float]:
    s = decoded.counts.summary()
    return {k: float(s[k]) for k in ("bits_stored", "bits_read", "bits_read_k", "bits_read_v")}


def record(model_names: list[str], pred_root: Path, methods: list[str] | None = None) -> dict:
    import os

    from kvquant import get_method, load_model, method_names
    from kvquant.eval.fidelity import top2_margin

    os.environ["KVQUANT_PREDICTOR_DIR"] = str(pred_root)
    names = methods or method_names()

    out: dict = {"new_tokens": NEW_TOKENS, "calib": {k: v for k, v in CALIB.items() if k != "log"}, "models": {}}
    for model_name in model_names:
        model, tok = load_model(model_name, device="cpu")
        if set(names) & set(NEEDS_PREDICTORS):
            predictor_dir(model, tok, pred_root, recording=True)
        rows = {}
        for i, prompt in enumerate(prompts(model_name, tok)):
            for name in names:
                params = method_params(model_name, name)
                d = decode(model, prompt, get_method(name, **params))
                rows.setdefault(name, {"params": params, "prompts": []})["prompts"].append(
                    {
                        "prompt": prompt.tolist(),
                        "tokens": d.tokens.tolist(),
                        "margins": [round(float(m), 6) for m in top2_margin(d.logprobs)],
                        **bits_of(d),
                    }
                )
                print(model_name, i, name, bits_of(d), file=sys.stderr, flush=True)
        out["models"][model_name] = rows
    return out


if __name__ == "__main__":
    import tempfile

    torch.manual_seed(0)
    args = sys.argv[1:]
    only = None
    if "--methods" in args:
        at = args.index("--methods")
        only = args[at + 1].split(",")
        args = args[:at] + args[at + 2 :]
    names = args or list(MODELS)
    with tempfile.TemporaryDirectory() as tmp:
        data = record(names, Path(tmp), only)
    if OUT.is_file():  # models not named, and methods not named, keep their recording
        kept = json.loads(OUT.read_text(encoding="utf-8"))["models"]
        for m, rows in data["models"].items():
            data["models"][m] = {**kept.get(m, {}), **rows} if only else rows
        data["models"] = {**{m: r for m, r in kept.items() if m not in data["models"]}, **data["models"]}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(data) + "\n", encoding="utf-8")
    print(f"wrote {OUT}")
