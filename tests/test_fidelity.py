import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvquant import get_method
from kvquant.cache import KVCache
from kvquant.data import tinystories_pieces
from kvquant.eval.fidelity import compare_to_reference, decode_timing, greedy_decode, kl_divergence
from kvquant.eval.tinystories import encode
from kvquant.methods.fp16 import Fp16Layer

pytestmark = pytest.mark.numerics


class NoisyValuesLayer(Fp16Layer):
    """A deliberately lossy store (values perturbed) so the metrics have something to detect."""

    def update(self, key_states, value_states, *args, **kwargs):
        noise = 0.5 * torch.randn(value_states.shape, generator=torch.Generator().manual_seed(7))
        return super().update(key_states, value_states + noise, *args, **kwargs)


def prompts(tok, n=3):
    return [encode(tok, p, 12) for p in tinystories_pieces()[:n]]


def test_fp16_against_itself_is_perfect(stories):
    model, tok = stories
    fp16 = get_method("fp16")
    run = compare_to_reference(model, prompts(tok), lambda: fp16.new_cache(model), lambda: fp16.new_cache(model), 24)
    s = run.summary()
    assert s == {
        "greedy_match": 1.0,
        "first_divergence": 24.0,
        "prompts_identical": 1.0,
        "kl": 0.0,
        "top1_agreement": 1.0,
    }


def test_lossy_cache_is_detected(stories):
    model, tok = stories
    fp16 = get_method("fp16")
    noisy = lambda: KVCache([NoisyValuesLayer() for _ in range(model.config.num_hidden_layers)])  # noqa: E731
    s = compare_to_reference(model, prompts(tok), noisy, lambda: fp16.new_cache(model), 24).summary()
    assert s["kl"] > 1e-3
    assert s["greedy_match"] < 1.0 and s["first_divergence"] < 24 and s["top1_agreement"] < 1.0


def test_teacher_forcing_follows_forced_tokens(stories):
    model, tok = stories
    prompt = prompts(tok, 1)[0]
    forced = torch.tensor([5, 6, 7, 8])
    out = greedy_decode(model, prompt, get_method("fp16").new_cache(model), 4, forced=forced)
    assert torch.equal(out.tokens, forced) and out.logprobs.shape == (4, model.config.vocab_size)
    assert out.counts.summary()["bits_read"] == 16.0
    timing = decode_timing([out])
    assert timing["prefill_tok_s"] > 0 and timing["decode_tok_s"] > 0


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 50), st.integers(0, 2**16))
def test_kl_is_nonnegative_and_zero_on_identity(vocab, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.log_softmax(torch.randn(3, vocab, generator=g), -1)
    q = torch.log_softmax(torch.randn(3, vocab, generator=g), -1)
    assert (kl_divergence(p, q) >= 0).all()
    assert torch.allclose(kl_divergence(p, p), torch.zeros(3))
    assert kl_divergence(p, q).sum() > 0
    assert (
        pytest.approx(kl_divergence(p, q)[0].item(), rel=1e-4)
        == torch.nn.functional.kl_div(q[0], p[0], log_target=True, reduction="sum").item()
    )
