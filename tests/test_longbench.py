import pytest

from kvquant import get_method, get_task
from kvquant.data import longbench_tasks
from kvquant.errors import InvalidParameterError
from kvquant.eval.longbench import middle_truncate


def test_bundled_tasks_and_middle_truncation():
    assert longbench_tasks() == sorted(
        [
            "2wikimqa",
            "multi_news",
            "multifieldqa_en",
            "passage_retrieval_en",
            "qasper",
            "qmsum",
            "samsum",
            "trec",
            "triviaqa",
        ]
    )
    assert middle_truncate(list(range(10)), 4) == [0, 1, 8, 9]
    assert middle_truncate([1, 2], 4) == [1, 2]


def test_longbench_truncates_long_prompts_counts_them_and_scores(stories):
    model, tok = stories
    task = get_task("longbench", limit=1, tasks=["trec", "passage_retrieval_en"], max_length=300)
    result = task.run(model, tok, get_method("fp16"))
    assert result.info["middle_truncated"] == 2 and result.info["n_by_task"] == {"trec": 1, "passage_retrieval_en": 1}
    assert all(e["prompt_tokens"] == 300 for e in result.examples)
    assert set(result.metrics) == {"trec", "passage_retrieval_en", "longbench_avg"}
    assert result.info["generation_capped"] == 0
    # One example per task: n is written, but no interval (resampling within a task of one says nothing).
    assert result.n_by_key == {"metrics/trec": 1, "metrics/passage_retrieval_en": 1, "metrics/longbench_avg": 2}
    assert result.ci95 == {}


def test_longbench_caps_generation_and_counts_it(stories):
    model, tok = stories
    task = get_task("longbench", limit=1, tasks=["trec", "passage_retrieval_en"], max_length=200, max_gen_tokens=40)
    result = task.run(model, tok, get_method("fp16"))
    assert result.info["generation_capped"] == 1  # trec asks for 64 tokens, passage_retrieval_en for 32
    assert task.params()["max_gen_tokens"] == 40
    with pytest.raises(InvalidParameterError, match="no bundled data for lcc"):
        get_task("longbench", tasks=["lcc"])
