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
    # Intervals over the 2 windows, fidelity clustered by window, perplexity paired with fp16's on the same windows.
    assert ref.n_by_key == {"metrics/ppl": 2, "metrics/nll": 2} and not ref.paired
    for result, block in ((ref, ref.metrics), (out, out.metrics), (out, out.fidelity)):
        for name, value in block.items():
            key = f"{'metrics' if block is result.metrics else 'fidelity'}/{name}"
            if name != "ppl_tokens":
                assert result.n_by_key[key] == 2 and result.ci95[key][0] <= value <= result.ci95[key][1], key
    assert out.paired["ppl"] == pytest.approx(out.metrics["ppl"] - ref.metrics["ppl"])
    assert out.ci95["paired/ppl"][0] <= out.paired["ppl"] <= out.ci95["paired/ppl"][1]
    assert "interval_problems" not in out.info
    same = task.run(model, tok, get_method("fp16"), get_method("fp16"), reference_dir=tmp_path)
    assert same.fidelity == {"kl": 0.0, "top1_agreement": 1.0} and len(list(tmp_path.rglob("*.pt"))) == 1


def test_wikitext_window_over_context_is_refused(stories):
    model, tok = stories
    with pytest.raises(InvalidParameterError, match="task.window=1024 .* context is 512"):
        get_task("wikitext", limit=1, window=1024).run(model, tok, get_method("fp16"))
