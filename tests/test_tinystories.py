import pytest

from kvquant import get_method, get_task
from kvquant.errors import InvalidParameterError, UnknownNameError


def test_run_reports_metrics_bits_timing_and_fidelity(stories):
    model, tok = stories
    task = get_task("tinystories", limit=2, ppl_pieces=10, max_new_tokens=16)
    result = task.run(model, tok, get_method("fp16"), reference_method=get_method("fp16"))
    assert result.n == 10 and result.metrics["ppl_tokens"] > 500
    assert 2.0 < result.metrics["ppl"] < 10.0
    assert result.fidelity["greedy_match"] == 1.0 and result.fidelity["kl"] == 0.0
    assert result.counts.summary()["bits_read"] == 16.0
    assert result.timing["decode_tok_s"] > 0
    assert task.params()["chunk_size"] == 32
    assert result.n_by_key["metrics/ppl"] == 10 and result.n_by_key["fidelity/kl"] == 12  # stories and prompts
    lo, hi = result.ci95["metrics/ppl"]
    assert lo < result.metrics["ppl"] < hi and result.ci95["paired/ppl"] == [0.0, 0.0]
    assert result.ci95["fidelity/greedy_match"] == [1.0, 1.0] and result.paired == {"ppl": 0.0, "nll": 0.0}


def test_without_reference_no_fidelity(stories):
    model, tok = stories
    result = get_task("tinystories", limit=1, ppl_pieces=1, max_new_tokens=4).run(model, tok, get_method("fp16"))
    assert result.fidelity is None


def test_over_long_settings_get_one_line_errors(stories):
    model, tok = stories
    with pytest.raises(InvalidParameterError, match="context is 512; lower it to at most 512"):
        get_task("tinystories", max_tokens=1024).run(model, tok, get_method("fp16"))
    with pytest.raises(InvalidParameterError, match="prompt_tokens"):
        get_task("tinystories", prompt_tokens=500, max_new_tokens=64).run(model, tok, get_method("fp16"))
    with pytest.raises(InvalidParameterError, match="^task tinystories: chunk_size=0 must be positive$"):
        get_task("tinystories", chunk_size=0)
    with pytest.raises(InvalidParameterError, match="parameter 'source' expects one of 'bundled', got 'hub'"):
        get_task("tinystories", source="hub")
    with pytest.raises(UnknownNameError, match="valid tasks: .*tinystories"):
        get_task("mmlu")
