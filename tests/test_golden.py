"""Every registered method still produces its recorded golden outputs (``tests/golden.py``).

The recorded greedy tokens are teacher-forced through today's cache, one decode step at a time:
at every step whose recorded top-2 margin is not a near-tie the method must pick the recorded token
again, and the cache must store exactly the recorded bits and read them within float tolerance
(AlignedKV's widths follow float values; every other method's reads are counts).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from golden import OUT, decode

from kvquant import get_method, method_names
from kvquant.eval.fidelity import NEAR_TIE

pytestmark = pytest.mark.numerics

# smollm2's 3 prompts × 18 methods × 64 steps take minutes; the suite checks its first prompt, and
# KVQUANT_GOLDEN_PROMPTS=3 all of them (stories260k's 3 always).
SMOLLM2_PROMPTS = int(os.environ.get("KVQUANT_GOLDEN_PROMPTS", "1"))

GOLDEN = json.loads(OUT.read_text(encoding="utf-8"))
FLOAT_READ_WIDTHS = ("alignedkv", "alignedkv_release", "alignedkv_plus")
# Methods that round to codes: another fp32 summation order (MKL path, threads) flips a few codes, and
# at 2 bits one flipped code moves a log-prob by ~0.1-0.2 nats (gear2 and aquakv under
# MKL_CBWR=COMPATIBLE, one thread: flips at recorded margins 0.06-0.21). Their near-tie is wider.
CODE_TIE = 0.5
ROUNDING = ("kivi", "gear", "higgs", "aquakv")
# CHAOTIC: on smollm2 these methods' own greedy paths are so far from fp16 that one flipped code
# changes later tokens at any margin (kivi2 under MKL_CBWR=COMPATIBLE, one thread: flips from step 32
# on), so there their bits are held exactly and their tokens only on stories260k.


FIXTURES = {"smollm2_135m": "smollm2"}  # conftest's session fixture of each other golden model


@pytest.fixture(scope="module")
def loaded(request, stories, predictor_root):
    """Each golden model (the session's, loaded once per worker), with AQUA-KV predictors calibrated as
    the recording did, and their folder."""

    def get(name: str):
        model, tok = stories if name == "stories260k" else request.getfixturevalue(FIXTURES[name])
        return model, predictor_root(model, tok)

    return get


def test_recorded_methods_still_exist():
    """A method added after the recording needs none (docs/adding_a_method.md); a recorded one may not vanish."""
    for model_name, rows in GOLDEN["models"].items():
        assert set(rows) <= set(method_names()), model_name


@pytest.mark.parametrize("model_name", sorted(GOLDEN["models"]))
@pytest.mark.parametrize("method", sorted(GOLDEN["models"]["stories260k"]))
def test_golden_outputs(loaded, monkeypatch, model_name, method):
    row = GOLDEN["models"][model_name][method]
    model, predictors = loaded(model_name)
    monkeypatch.setenv("KVQUANT_PREDICTOR_DIR", str(predictors))
    prompts = row["prompts"] if model_name == "stories260k" else row["prompts"][:SMOLLM2_PROMPTS]
    for i, want in enumerate(prompts):
        tokens = torch.tensor(want["tokens"])
        got = decode(model, torch.tensor(want["prompt"]), get_method(method, **row["params"]), forced=tokens)
        rounding = method.startswith(ROUNDING)
        if not (rounding and model_name != "stories260k"):  # see CHAOTIC
            firm = torch.tensor(want["margins"]) >= (CODE_TIE if rounding else NEAR_TIE)
            flips = ((got.logprobs.argmax(-1) != tokens) & firm).nonzero().flatten().tolist()
            assert flips == [], (model_name, method, i, flips)
        s = got.counts.summary()
        assert s["bits_stored"] == want["bits_stored"], (model_name, method, i)
        rel = 2e-3 if method in FLOAT_READ_WIDTHS else 1e-12
        for key in ("bits_read", "bits_read_k", "bits_read_v"):
            assert s[key] == pytest.approx(want[key], rel=rel), (model_name, method, i, key)
