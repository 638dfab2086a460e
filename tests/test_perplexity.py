import pytest
import torch

from kvquant import get_method
from kvquant.data import tinystories_pieces
from kvquant.eval.perplexity import chunked_nll, perplexity
from kvquant.eval.tinystories import encode

pytestmark = pytest.mark.numerics


def test_stories260k_perplexity_on_first_200_stories(stories):
    model, tok = stories
    seqs = [encode(tok, p, 512) for p in tinystories_pieces()[:200]]
    assert all(s[0].item() == tok.bos_token_id for s in seqs)
    fp16 = get_method("fp16")
    metrics, counts = perplexity(model, seqs, lambda: fp16.new_cache(model), chunk_size=32)
    assert metrics["ppl_tokens"] == 19_380
    assert metrics["ppl"] == pytest.approx(4.216, abs=0.005)
    assert counts.summary()["bits_stored"] == 16.0


def test_chunked_equals_single_pass_for_fp16(stories):
    model, tok = stories
    ids = encode(tok, tinystories_pieces()[3], 512)
    fp16 = get_method("fp16")
    chunked, n = chunked_nll(model, ids, fp16.new_cache(model), chunk_size=7)
    whole, n2 = chunked_nll(model, ids, fp16.new_cache(model), chunk_size=ids.numel())
    with torch.no_grad():
        logits = model(ids.view(1, -1)).logits[0, :-1]
    plain = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum").item()
    assert n == n2 == ids.numel() - 1
    assert chunked == pytest.approx(whole, rel=1e-4)
    assert whole == pytest.approx(plain, rel=1e-3)


def test_chunk_size_must_be_positive(stories):
    model, _ = stories
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_nll(model, torch.tensor([1, 2, 3]), get_method("fp16").new_cache(model), chunk_size=0)
