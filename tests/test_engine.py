import pytest
import torch

from kvquant import get_method
from kvquant.data import tinystories_pieces
from kvquant.eval.engine import Engine, cut_at_stop
from kvquant.eval.fidelity import NEAR_TIE, top2_margin

pytestmark = pytest.mark.numerics


def ids_of(tok, i=0, n=60):
    return tok(tinystories_pieces()[i]).input_ids[:n]


def test_chunked_shared_prefix_loglikelihood_equals_one_plain_forward(stories):
    model, tok = stories
    ctx, conts = ids_of(tok, 0, 50), [ids_of(tok, 1, 12)[1:], ids_of(tok, 2, 7)[1:]]
    engine = Engine(model, tok, get_method("fp16"), chunk_size=7)
    got = engine.loglikelihood("t/0", ctx, conts)
    for (ll, greedy), cont in zip(got, conts, strict=True):
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ctx + cont])).logits[0, :-1], -1)
        want = lp[len(ctx) - 1 :].gather(1, torch.tensor(cont).view(-1, 1)).sum().item()
        assert ll == pytest.approx(want, rel=1e-3)  # fp16 K/V storage vs the fp32 forward
        steps = lp[len(ctx) - 1 :]
        if bool((top2_margin(steps) >= NEAR_TIE).all()):  # else fp16 storage may legitimately flip an argmax
            assert greedy == bool((steps.argmax(-1) == torch.tensor(cont)).all())
    assert set(engine.recording.units) == {"t/0#0", "t/0#1"} and engine.n_caches == 2  # the context cache + one copy
    assert engine.counts.summary()["bits_read"] == 16.0


def test_generation_with_fresh_cache_matches_plain_greedy_and_stops(stories):
    model, tok = stories
    prompt = ids_of(tok, 3, 16)
    engine = Engine(model, tok, get_method("fp16"))
    text = engine.generate("g/0", prompt, 20)
    plain = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt) :]
    assert text == tok.decode(plain, skip_special_tokens=True)
    first_word = text.split()[1]
    cut = engine.generate("g/1", prompt, 20, stops=[first_word])
    assert cut == text.split(first_word)[0]
    chunked = engine.generate("g/2", prompt, 20, chunked_prefill=True)
    assert chunked == text
    assert engine.timing()["decode_tok_s"] > 0 and engine.truncated == 0


def test_over_long_inputs_are_left_truncated_and_counted(stories):
    model, tok = stories
    engine = Engine(model, tok, get_method("fp16"), max_length=64)
    long = ids_of(tok, 4, 200)
    assert len(long) > 100
    engine.generate("g/0", long, 8)
    [(ll, _)] = engine.loglikelihood("l/0", long, [long[:5]])
    assert engine.truncated == 2 and ll < 0


def test_lossy_method_is_compared_unit_by_unit(stories):
    model, tok = stories
    fp16 = Engine(model, tok, get_method("fp16"))
    prompt = ids_of(tok, 5, 24)
    fp16.generate("g/0", prompt, 64)
    fp16.loglikelihood("l/0", prompt, [ids_of(tok, 6, 10)[1:]])
    lossy = Engine(model, tok, get_method("truncation", keep_bits=9), reference=fp16.recording)
    lossy.generate("g/0", prompt, 64)
    lossy.loglikelihood("l/0", prompt, [ids_of(tok, 6, 10)[1:]])
    summary = lossy.fidelity.summary()
    assert summary["kl"] > 1e-3 and summary["greedy_match"] < 1.0
    same = Engine(model, tok, get_method("fp16"), reference=fp16.recording)
    same.generate("g/0", prompt, 64)
    same.loglikelihood("l/0", prompt, [ids_of(tok, 6, 10)[1:]])
    assert same.fidelity.summary() == {"greedy_match": 1.0, "first_divergence": 64.0, "kl": 0.0, "top1_agreement": 1.0}


@pytest.mark.parametrize("chunked_prefill", [False, True])
@pytest.mark.parametrize("name", ["truncation", "kivi2"])
def test_teacher_forcing_from_the_kept_prefill_equals_feeding_the_prompts_again(
    stories, monkeypatch, name, chunked_prefill
):
    """Rows that part from fp16 are teacher-forced from a copy of their state after the prompt: the same
    KL, top-1 agreement and bits as feeding each prompt again (what happens above ``KEEP_PREFILL_BYTES``)."""
    from kvquant.eval import engine as engine_module
    from kvquant.eval.engine import Generation

    model, tok = stories
    params = {"group_size": 8, "residual": 16} if name == "kivi2" else {"keep_bits": 8}
    asks = [Generation(f"g/{i}", ids_of(tok, 10 + i, 20 + 9 * i), 24, (), chunked_prefill) for i in range(3)]
    fp16 = Engine(model, tok, get_method("fp16"), chunk_size=16, batch_size=3)
    fp16.generate_many(asks)
    outcome = {}
    for limit in (engine_module.KEEP_PREFILL_BYTES, 0):
        monkeypatch.setattr(engine_module, "KEEP_PREFILL_BYTES", limit)
        lossy = Engine(model, tok, get_method(name, **params), chunk_size=16, reference=fp16.recording, batch_size=3)
        lossy.generate_many(asks)
        outcome[limit] = (lossy.fidelity.summary(), lossy.counts.summary(), lossy.n_caches)
    (fidelity, counts, caches), again = outcome.values()
    assert counts == again[1] and caches == again[2] and fidelity["greedy_match"] < 1  # some rows were forced
    # the batch's last prompt token runs with the rows that part only when fed again: fp32 summation order
    assert fidelity == pytest.approx(again[0], rel=1e-6) and fidelity["kl"] > 0


@pytest.mark.parametrize("chunked_prefill", [False, True])
@pytest.mark.parametrize("name", ["alignedkv", "kivi2"])
def test_teacher_forcing_along_own_tokens_reproduces_free_decoding(stories, name, chunked_prefill):
    """Forced decoding is one decode step per token, as in generation: along the method's own greedy
    tokens it must give the same log-probs (fed in chunks, AlignedKV would attend in full precision)."""
    model, tok = stories
    params = {"group_size": 8, "residual": 16} if name == "kivi2" else {}
    engine = Engine(model, tok, get_method(name, **params), chunk_size=16)
    prompt = ids_of(tok, 7, 40)
    tokens, logprobs = engine._generate(prompt, 24, (), chunked_prefill)
    forced = engine.forced_logprobs(prompt, tokens, chunked_prefill)
    assert forced.shape == logprobs.shape
    torch.testing.assert_close(forced, logprobs, rtol=0, atol=1e-4)


def test_cut_at_stop():
    assert cut_at_stop("42\n\nQuestion: x", ["Question:", "\n\n"]) == "42"
    assert cut_at_stop("no stop", ["Q:"]) == "no stop"
