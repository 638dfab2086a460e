import math

import pytest

from kvquant import get_method, get_task
from kvquant.errors import InvalidParameterError
from kvquant.eval import suite


def test_wikitext_perplexity_budget_and_reference_cached_once(stories, tmp_path, monkeypatch):
    model, tok = stories
    task = get_task("wikitext", limit=2, window=128)
    ref = task.run(model, tok, get_method("fp16"), reference_dir=tmp_path)
    assert ref.n == 2 and ref.metrics["ppl_tokens"] == 2 * 127 and 10 < ref.metrics["ppl"] < 2000
    assert ref.metrics["nll"] == pytest.approx(math.log(ref.metrics["ppl"]))
    [saved] = list(tmp_path.rglob("*.pt"))  # the fp16 run leaves its outputs as the reference

    passes = []
    original = suite.SuiteTask._pass
    monkeypatch.setattr(suite.SuiteTask, "_pass", lambda self, *a: passes.append(a[2].name) or original(self, *a))
    out = task.run(model, tok, get_method("truncation", keep_bits=9), get_method("fp16"), reference_dir=tmp_path)
    assert passes == ["truncation"]  # the reference came from disk
    assert out.metrics["ppl"] != ref.metrics["ppl"] and out.fidelity["kl"] > 1e-3
    assert "answer_agreement" not in out.fidelity  # perplexity has no answers
    same = task.run(model, tok, get_method("fp16"), get_method("fp16"), reference_dir=tmp_path)
    assert same.fidelity == {"kl": 0.0, "top1_agreement": 1.0} and len(list(tmp_path.rglob("*.pt"))) == 1


def test_wikitext_window_over_context_is_refused(stories):
    model, tok = stories
    with pytest.raises(InvalidParameterError, match="task.window=1024 .* context is 512"):
        get_task("wikitext", limit=1, window=1024).run(model, tok, get_method("fp16"))
