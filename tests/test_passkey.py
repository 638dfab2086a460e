import pytest

from kvquant import get_method, get_task
from kvquant.errors import InvalidParameterError
from kvquant.eval.passkey import INSTRUCTION, NEEDLE, QUESTION


def test_prompt_has_exact_length_and_needle_at_depth(stories):
    _, tok = stories
    task = get_task("passkey")
    filler = tok("word " * 2000, add_special_tokens=False).input_ids
    shallow, key = task.prompt(tok, filler, 300, 0.0, 0)
    deep, deep_key = task.prompt(tok, filler, 300, 1.0, 0)
    assert len(shallow) == len(deep) == 300 and len(key) == 5 and key.isdigit()

    def where(ids, key):
        needle = tok(NEEDLE.format(key=key), add_special_tokens=False).input_ids
        return next(i for i in range(len(ids)) if ids[i : i + len(needle)] == needle)

    def enc(text):
        return tok(text, add_special_tokens=False).input_ids

    head = 1 + len(enc(INSTRUCTION))  # BOS: the stories260k tokenizer adds one
    assert where(shallow, key) == head  # depth 0: right after the instruction
    assert where(deep, deep_key) == 300 - len(enc(QUESTION)) - len(enc(NEEDLE.format(key=deep_key)))  # depth 1
    assert task.prompt(tok, filler, 300, 0.5, 0)[1] == task.prompt(tok, filler, 300, 0.5, 0)[1]  # seeded


def test_passkey_runs_skips_long_lengths_and_reaches_the_cache(stories):
    model, tok = stories
    task = get_task("passkey", lengths=[200, 4096], depths=[0.5], filler="tinystories")
    ref = task.run(model, tok, get_method("fp16"))
    assert ref.n == 1 and ref.info["skipped_lengths"] == [4096] and set(ref.metrics) >= {"passkey_acc", "acc_len_200"}
    out = task.run(model, tok, get_method("truncation", keep_bits=9), reference_method=get_method("fp16"))
    assert out.fidelity["kl"] > 1e-3
    with pytest.raises(InvalidParameterError, match="every length"):
        get_task("passkey", lengths=[8192]).run(model, tok, get_method("fp16"))
    with pytest.raises(InvalidParameterError, match="depths"):
        get_task("passkey", depths=[1.5])
