import pytest
import torch

from kvquant.eval import reference as r


def logprobs(seed, rows=4, vocab=10):
    return torch.log_softmax(torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)), -1)


def full_kl(p, q):
    return (p.exp() * (p - q)).sum(-1)


def test_topk_kl_is_exact_with_the_whole_vocabulary_and_a_lower_bound_with_fewer(monkeypatch):
    p, q = logprobs(0), logprobs(1)
    rec = r.UnitRecord.from_logprobs(torch.zeros(4, dtype=torch.long), p, generated=False)
    assert torch.allclose(r.topk_kl(rec, q), full_kl(p, q), atol=1e-5)
    assert torch.allclose(r.topk_kl(rec, p), torch.zeros(4), atol=1e-6)
    monkeypatch.setattr(r, "TOPK", 3)
    coarse = r.UnitRecord.from_logprobs(torch.zeros(4, dtype=torch.long), p, generated=False)
    kl = r.topk_kl(coarse, q)
    assert (kl <= full_kl(p, q) + 1e-6).all() and (kl > 0).all()


def test_token_match_and_first_divergence():
    ref = torch.tensor([1, 2, 3, 4])
    assert r.token_match(ref, torch.tensor([1, 2, 3, 4])) == (1.0, 4)
    assert r.token_match(ref, torch.tensor([1, 9, 3, 4])) == (0.75, 1)
    assert r.token_match(ref, torch.tensor([1, 2])) == (0.5, 2)  # shorter: missing positions mismatch


def test_reference_round_trip_and_fidelity_stats(tmp_path):
    p = logprobs(2)
    ref = r.Reference(answers={"t/0": "42"}, values={"t/0": {"score": 0.5, "task": "trec"}})
    ref.units["t/0#0"] = r.UnitRecord.from_logprobs(p.argmax(-1), p, generated=True)
    path = ref.save(tmp_path / "a" / "ref.pt")
    back = r.Reference.load(path)
    assert (
        back.answers == {"t/0": "42"}
        and back.values == ref.values
        and torch.equal(back.units["t/0#0"].top_ids, ref.units["t/0#0"].top_ids)
    )
    assert r.Reference.load(tmp_path / "missing.pt") is None
    stats = r.FidelityStats()
    stats.add("t/0#0", back.units["t/0#0"], p.argmax(-1), p, generated=True)
    assert stats.summary() == {
        "greedy_match": 1.0,
        "first_divergence": 4.0,
        "kl": pytest.approx(0.0, abs=1e-6),
        "top1_agreement": 1.0,
    }
    assert stats.for_prefix("t/0") == stats.summary() and stats.for_prefix("t/1") == {}
