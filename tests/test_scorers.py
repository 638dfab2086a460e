"""Scorers on hand-worked cases (each expected value computed by hand from the rule in the docstring)."""

import math

import pytest

from kvquant.eval import scorers as s


def test_gsm8k_extraction_strict_and_flexible():
    text = "She sells 9 eggs for $2 each, 9 * 2 = $18.\n#### 18\n\nQuestion: next"
    assert s.gsm8k_extract(text, "strict") == "18"
    assert s.gsm8k_extract("He has 3 apples and 1,250 pears.", "flexible") == "1,250"
    assert s.gsm8k_extract("The total is $1,234.", "flexible") == "$1,234."
    assert s.gsm8k_extract("no digits here", "flexible") == s.INVALID
    assert s.gsm8k_extract("The answer is 7", "strict") == s.INVALID
    assert s.gsm8k_extract("-5 degrees", "flexible") == "-5"


def test_gsm8k_exact_match_uses_lm_eval_normalisation():
    gold = "Janet sells 9 eggs.\n#### 1234"
    assert s.gsm8k_scores("so $1,234.", gold) == {"exact_match_strict": 0.0, "exact_match_flexible": 1.0}
    assert s.gsm8k_scores("#### 1,234", gold) == {"exact_match_strict": 1.0, "exact_match_flexible": 1.0}
    assert s.gsm8k_scores("it is 123 and 4", gold)["exact_match_flexible"] == 0.0


def test_coqa_em_and_f1():
    assert s.coqa_em("The red car!", "red car") == 1.0
    assert s.coqa_f1("a blue car", "red car") == pytest.approx(0.5)  # {blue, car} vs {red, car}
    assert s.coqa_f1("", "") == 1.0 and s.coqa_f1("", "red") == 0.0
    # two golds: leave-one-out → (max over {blue car}, max over {red car}) averaged
    assert s.coqa_scores("red car", ["red car", "blue car"]) == {"em": 0.5, "f1": pytest.approx(0.75)}
    assert s.coqa_scores("red car", ["red car"]) == {"em": 1.0, "f1": 1.0}


def test_longbench_qa_f1_and_rouge_l():
    assert s.qa_f1_score("Paris, France", "paris") == pytest.approx(2 * 0.5 * 1 / 1.5)
    # LCS 3, precision 3/3, recall 3/6 → F = 2/3
    assert s.rouge_l_score("the cat sat", "the cat sat on the mat") == pytest.approx(2 / 3)
    assert s.rouge_l_score("", "anything") == 0.0


def test_longbench_classification_retrieval_count_code():
    classes = ["Location", "Other location", "Person"]
    assert s.classification_score("Other location", "Other location", all_classes=classes) == 1.0
    assert s.classification_score("Person or Other location", "Other location", all_classes=classes) == 0.5
    assert s.classification_score("Person", "Other location", all_classes=classes) == 0.0
    assert s.retrieval_score("Paragraph 3 or Paragraph 5", "Paragraph 3") == 0.5
    assert s.retrieval_score("I do not know", "Paragraph 3") == 0.0
    assert s.count_score("There are 4 unique paragraphs out of 10", 4) == 0.5
    assert s.code_sim_score("```\n# comment\nx = 1\n", "x = 1") == 1.0
    assert s.code_sim_score("x = 1", "x = 2") == 0.8  # difflib ratio 2·4/10


def test_longbench_score_takes_first_line_for_few_shot_tasks_and_best_answer():
    assert (
        s.longbench_score("trec", "\nOther location\nPerson", ["Other location"], ["Other location", "Person"]) == 1.0
    )
    assert s.longbench_score("qasper", "red car", ["blue car", "red car"]) == 1.0
    assert set(s.LONGBENCH_METRICS) >= {"trec", "qasper", "samsum", "passage_retrieval_en", "lcc", "passage_count"}


def test_passkey_exact_match():
    assert s.passkey_match(" 12345. Remember it", "12345") == 1.0
    assert s.passkey_match("1234 5", "12345") == 0.0
    assert s.passkey_match("", "12345") == 0.0
    assert s.first_number("key: 007!") == "007"


def test_truthfulqa_mc2_and_gen():
    lls = [math.log(0.2), math.log(0.2), math.log(0.6)]
    assert s.truthfulqa_mc2(lls, [1, 1, 0]) == pytest.approx(0.4)
    assert s.truthfulqa_answers([" Nothing happens ", "", "You die."], add_no_comment=True) == [
        "Nothing happens.",
        "You die.",
        "I have no comment.",
    ]
    true = "Nothing in particular happens when you eat a pomegranate."
    out = s.truthfulqa_gen_scores(true, [true], ["You will be trapped in the underworld."])
    assert out["bleu_max"] == pytest.approx(100.0) and out["bleu_acc"] == 1.0 and out["rougeL_diff"] > 0
