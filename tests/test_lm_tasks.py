"""gsm8k and truthfulqa through lm-eval on stories260k: fast, fp16-faithful, and reached by quantization."""

import time

import pytest
from conftest import run_py

from kvquant import get_method, get_task
from kvquant.errors import InvalidParameterError, KvquantError


@pytest.fixture(scope="module")
def lossy():
    return get_method("truncation", keep_bits=9)


def test_truthfulqa_mc2_limit_2_is_fast_and_quantization_reaches_the_loglikelihoods(stories, lossy):
    model, tok = stories
    task = get_task("truthfulqa_mc2", limit=2)
    started = time.perf_counter()
    ref = task.run(model, tok, get_method("fp16"), reference_method=get_method("fp16"))
    assert time.perf_counter() - started < 60
    assert ref.n == 2 and 0.0 <= ref.metrics["mc2"] <= 1.0
    assert ref.fidelity == {"kl": 0.0, "top1_agreement": 1.0, "answer_agreement": 1.0}
    assert ref.counts.summary()["bits_read"] == 16.0
    out = task.run(model, tok, lossy, reference_method=get_method("fp16"))
    lls = [[c[0] for c in ex["output"]] for ex in out.examples]
    ref_lls = [[c[0] for c in ex["output"]] for ex in ref.examples]
    assert lls != ref_lls  # the log-likelihoods changed: the quantized cache was read
    assert out.fidelity["kl"] > 1e-3 and out.fidelity["top1_agreement"] < 1.0
    assert out.counts.summary()["bits_read"] == 9.0
    assert {"fp16_answer", "agrees_with_fp16", "fidelity", "answer", "mc2"} <= set(out.examples[0])
    # Intervals over the 2 questions (fidelity resampled by question with all its choices), mc2 paired with fp16.
    for block, values in (("metrics", out.metrics), ("fidelity", out.fidelity)):
        for name, value in values.items():
            lo, hi = out.ci95[f"{block}/{name}"]
            assert out.n_by_key[f"{block}/{name}"] == 2 and lo <= value <= hi
    assert out.paired["mc2"] == pytest.approx(out.metrics["mc2"] - ref.metrics["mc2"])
    assert out.ci95["paired/mc2"][0] <= out.paired["mc2"] <= out.ci95["paired/mc2"][1]
    assert ref.ci95["paired/mc2"] == [0.0, 0.0]  # fp16 against itself


def test_gsm8k_limit_2_is_fast_and_quantization_reaches_the_generations(stories, lossy):
    model, tok = stories
    task = get_task("gsm8k", limit=2, max_gen_toks=48)
    started = time.perf_counter()
    ref = task.run(model, tok, get_method("fp16"))
    assert time.perf_counter() - started < 60
    assert set(ref.metrics) == {"exact_match_strict", "exact_match_flexible"} and ref.n == 2
    assert ref.info["num_fewshot"] == 5
    assert ref.info["truncated"] == 2  # five shots do not fit stories260k's 512 tokens: left-truncated, counted
    assert ref.examples[0]["prompt_tail"].endswith("Answer:")
    out = task.run(model, tok, lossy, reference_method=get_method("fp16"))
    assert [e["output"] for e in out.examples] != [e["output"] for e in ref.examples]
    assert out.fidelity["greedy_match"] < 1.0 and out.fidelity["kl"] > 1e-3
    assert 0.0 <= out.fidelity["answer_agreement"] <= 1.0


def test_truthfulqa_gen_reports_bleu_and_rouge(stories):
    model, tok = stories
    result = get_task("truthfulqa_gen", limit=1, max_gen_toks=16).run(model, tok, get_method("fp16"))
    assert {"bleu_max", "bleu_acc", "rouge1_max", "rougeL_diff"} <= set(result.metrics) and result.n == 1


def test_missing_data_file_names_its_path_and_the_hub_alternative(monkeypatch, tmp_path):
    import kvquant.data

    monkeypatch.setattr(kvquant.data, "DATASETS", tmp_path)
    for name in ("gsm8k", "truthfulqa_mc2", "truthfulqa_gen"):
        with pytest.raises(KvquantError, match=rf"data file not found: {tmp_path}/.*task.source=hub"):
            get_task(name).lm_config()


def test_hub_source_swaps_in_the_hub_dataset():
    cfg = get_task("gsm8k", source="hub").lm_config()
    assert cfg["dataset_path"] == "openai/gsm8k" and cfg["fewshot_split"] == "train" and "dataset_kwargs" not in cfg
    mc = get_task("truthfulqa_mc2", source="hub").lm_config()
    assert mc["dataset_path"] == "truthfulqa/truthful_qa" and "custom_dataset" not in mc
    bundled = get_task("gsm8k").lm_config()
    assert bundled["dataset_path"] == "json" and bundled["dataset_kwargs"]["data_files"]["test"].endswith("test.jsonl")
    with pytest.raises(InvalidParameterError, match="task 'gsm8k': parameter 'source' expects one of 'bundled', 'hub'"):
        get_task("gsm8k", source="web")


def test_a_bad_parameter_through_run_py_names_the_task(tmp_path):
    """The lm-eval tasks share one class: the line still says which task refused the value."""
    args = ("model=stories260k", "logger=none", f"results_dir={tmp_path}", "task=gsm8k", "task.batch_size=0")
    proc = run_py(tmp_path, *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == ["error: task gsm8k: batch_size=0 must be positive"]
    assert not list(tmp_path.rglob("results.json"))
