"""RULER's synthetic tasks: seeded generators, needle placement, exact lengths, scoring, bad input, run.py."""

import json
import re
from collections import Counter

import pytest
from conftest import run_py

from kvquant import get_method, get_task
from kvquant.errors import InvalidParameterError
from kvquant.eval.ruler_tasks import SUBTASKS, generate, string_match_all, tokens_to_generate

NIAH = [s for s in SUBTASKS if s.startswith("niah")]


@pytest.fixture(scope="module")
def tok(stories):
    return stories[1]


@pytest.mark.parametrize("subtask", list(SUBTASKS))
def test_generators_are_seeded_and_fill_the_length(tok, subtask):
    length = 1024  # a pure function of the tokenizer: lengths beyond stories260k's context are fine here
    ex = generate(subtask, length, 0, 0, tok)
    again = generate(subtask, length, 0, 0, tok)
    assert ex.ids == again.ids and ex.answers == again.answers  # same seed → same prompt
    other = generate(subtask, length, 1, 0, tok)
    assert other.answers != ex.answers and other.ids != ex.ids  # another index → other needles
    assert generate(subtask, length, 0, 1, tok).answers != ex.answers  # another seed too
    target = length - tokens_to_generate(subtask)  # RULER counts the generation in the length
    assert target - 2 <= len(ex.ids) <= target


@pytest.mark.parametrize("subtask", NIAH)
def test_needles_sit_at_the_recorded_depth(tok, subtask):
    depths = set()
    for index in range(4):
        ex = generate(subtask, 1024, index, 0, tok)
        needle = tok(ex.needle, add_special_tokens=False).input_ids
        assert ex.ids[ex.needle_pos : ex.needle_pos + len(needle)] == needle
        assert any(a in ex.needle for a in ex.answers) and ex.query.split(",")[0] in ex.needle
        depths.add(ex.depth)
        # the recorded depth is where the needle sits in the context (within one haystack unit)
        assert abs(ex.needle_pos / len(ex.ids) - ex.depth) < 0.25
        text = tok.decode(ex.ids)
        assert all(a in text for a in ex.answers)
    assert len(depths) > 1  # depth varies across examples


@pytest.mark.parametrize("subtask", ["niah_multikey_2", "niah_multikey_3"])
def test_multikey_distractors_differ_from_the_asked_key(tok, subtask):
    for index in range(3):
        ex = generate(subtask, 1024, index, 0, tok)
        assert len(ex.distractors) >= 3
        assert all(ex.query not in d and d not in ex.query for d in ex.distractors)
        text = tok.decode(ex.ids)
        assert text.count(f"for {ex.query} is:") == 1  # the asked key's needle appears once


def test_variable_tracking_chain_resolves_to_the_answer(tok):
    for index in range(3):
        ex = generate("vt", 1024, index, 0, tok)
        text = tok.decode(ex.ids)
        question = text.rindex("Question:")
        body = text[text.rindex("\n\n", 0, question) : question]  # the asked prompt, after the one-shot example
        value = re.search(r"assigned the value (\d+)", text[question:]).group(1)
        assigned = dict(re.findall(r"VAR ([A-Z]{5}) = (\d+|VAR [A-Z]{5})", body))

        def resolve(name, assigned):
            while assigned[name].startswith("VAR "):
                name = assigned[name][4:]
            return assigned[name]

        holding = sorted(n for n in assigned if resolve(n, assigned) == value)
        assert holding == sorted(ex.answers) and len(ex.answers) == 5
        assert ex.ids[ex.needle_pos : ex.needle_pos + 3] == tok(ex.needle, add_special_tokens=False).input_ids[:3]


def test_frequent_words_answers_are_the_most_frequent(tok):
    for index in range(3):
        ex = generate("fwe", 1024, index, 0, tok)
        text = tok.decode(ex.ids)
        body = text[: text.rindex("Question:")]
        counts = Counter(w for w in body.split() if re.fullmatch(r"[a-z]{6}", w))
        top = [w for w, _ in counts.most_common()]
        assert sorted(top[:3]) == sorted(ex.answers)
        assert counts[top[2]] > counts[top[3]]  # strictly: no tie with the fourth


def test_scoring_is_the_share_of_answers_found():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 1.0
    assert string_match_all("The numbers are 123.", ["123", "456"]) == 0.5
    assert string_match_all("nothing", ["123"]) == 0.0
    assert string_match_all(" VAR abcde", ["ABCDE"]) == 1.0  # any case, as RULER


def test_bad_input_is_one_line_with_the_fix(stories):
    model, tok = stories
    with pytest.raises(InvalidParameterError, match=r"unknown subtask 'qa_9'; valid subtasks: niah_single_1, "):
        get_task("ruler", subtasks=["qa_9"])
    with pytest.raises(InvalidParameterError, match="n=0 must be positive"):
        get_task("ruler", n=0)
    task = get_task("ruler", subtasks=["niah_single_1"], lengths=[4096], n=1)
    with pytest.raises(InvalidParameterError, match=r"length 4096 exceeds the model's context \(512, .*at most 512"):
        task.run(model, tok, get_method("fp16"))
    with pytest.raises(InvalidParameterError, match="too short for vt"):
        generate("vt", 300, 0, 0, tok)


def test_run_py_writes_metrics_fidelity_and_intervals(tmp_path):
    args = [
        "model=stories260k",
        "logger=none",
        "progress=false",
        f"results_dir={tmp_path}",
        "task=ruler",
        "task.subtasks=[niah_single_1,niah_multikey_2,fwe]",
        "task.lengths=[512]",
        "task.n=2",
        "task.max_new_tokens=8",
    ]
    fp16 = run_py(tmp_path, *args, "method=fp16", timeout=300)
    assert fp16.returncode == 0, fp16.stderr[-2000:]
    lossy = run_py(tmp_path, *args, "method=truncation", "method.keep_bits=9", timeout=300)
    assert lossy.returncode == 0, lossy.stderr[-2000:]
    [res] = [
        json.loads(p.read_text())
        for p in tmp_path.rglob("results.json")
        if json.loads(p.read_text())["method"]["name"] == "truncation"
    ]
    metrics = res["metrics"]
    assert {"niah_single_1_512", "fwe_512", "niah_multikey_2", "len_512", "ruler_avg"} <= set(metrics)
    assert all(0.0 <= v <= 100.0 for v in metrics.values())
    assert {"kl", "top1_agreement", "answer_agreement"} <= set(res["fidelity"])
    assert res["task"]["n"] == 2 and res["task"]["examples"] == 6 and res["task"]["generation_capped"] == 6
    assert res["n"]["metrics/niah_single_1_512"] == 2 and res["n"]["metrics/ruler_avg"] == 6
    assert "metrics/ruler_avg" in res["ci95"] and "paired/ruler_avg" in res["n"]


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["task.subtasks=[qa_9]"], "error: task ruler: unknown subtask 'qa_9'; valid subtasks: niah_single_1,"),
        (["task.n=0"], "error: task ruler: n=0 must be positive"),
        (["task.lengths=[1024]"], "error: task ruler: length 1024 exceeds the model's context (512, "),
    ],
)
def test_bad_input_through_run_py_is_one_line(tmp_path, args, line):
    proc = run_py(tmp_path, "model=stories260k", "logger=none", f"results_dir={tmp_path}", "task=ruler", *args)
    lines = [
        x for x in proc.stderr.strip().splitlines() if not x.startswith("Loading weights")
    ]  # a length needs the model
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(line), proc.stderr[-2000:]
