import pytest

from kvquant import get_method, get_task
from kvquant.errors import InvalidParameterError, KvquantError
from kvquant.eval import coqa

DOC = {
    "story": "Tom has a red car. He drives it to work every day.",
    "questions": {"input_text": ["What does Tom have?", "What colour is it?"]},
    "answers": {"input_text": ["a car", "red"]},
    "additional_answers": {"0": {"input_text": ["car", "Red."]}},
}


def test_prompt_keeps_earlier_turns_and_collects_golds():
    prompt, golds = coqa.coqa_prompt(DOC)
    assert prompt.endswith("Q: What does Tom have?\n\nA: a car\n\nQ: What colour is it?\n\nA:")
    assert golds == ["red", "Red."]


def test_offline_error_is_one_line_and_bundled_is_refused(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(coqa, "HUB_ID", "kvquant-test/no-such-coqa")
    with pytest.raises(KvquantError, match="needs the hub dataset kvquant-test/no-such-coqa"):
        coqa.load_coqa()
    with pytest.raises(InvalidParameterError, match="task 'coqa': parameter 'source' expects one of 'hub'"):
        get_task("coqa", source="bundled")


def test_coqa_runs_on_given_docs(stories, monkeypatch):
    model, tok = stories
    monkeypatch.setattr(coqa.CoQATask, "docs", lambda self: [DOC, DOC])
    result = get_task("coqa", limit=1, max_gen_toks=8).run(model, tok, get_method("fp16"), get_method("fp16"))
    assert result.n == 1 and set(result.metrics) == {"em", "f1"} and result.fidelity["answer_agreement"] == 1.0
