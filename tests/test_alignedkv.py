"""AlignedKV end to end on real models: bit-identity at infinite thresholds, fewer bits otherwise."""

import pytest
import torch

from kvquant import get_method
from kvquant.data import tinystories_pieces, wikitext2_test
from kvquant.errors import InvalidParameterError, KvquantError
from kvquant.eval.perplexity import chunked_nll
from kvquant.methods.alignedkv import width_histograms

INF = (float("inf"), float("inf"))


def story_ids(tok, n_tokens=150, piece=5):
    text = " ".join(tinystories_pieces()[piece : piece + 3])
    return tok(text, return_tensors="pt").input_ids[:, :n_tokens]


def run(model, ids, method, new=40, **kw):
    cache = get_method(method, **kw).new_cache(model) if isinstance(method, str) else method.new_cache(model)
    out = model.generate(ids, max_new_tokens=new, do_sample=False, past_key_values=cache, **kw.pop("gen", {}))
    return out, cache


def test_infinite_thresholds_are_bit_identical_to_fp16(stories):
    model, tok = stories
    ids = story_ids(tok)
    ref, _ = run(model, ids, "fp16")
    out, cache = run(model, ids, "alignedkv", k_thresholds=INF, v_thresholds=INF)
    assert torch.equal(out, ref)
    s = cache.stats()
    assert s["widths_k"] == s["widths_v"] == {16: 1.0}
    assert 16.0 < s["bits_read_k"] < 16.2 and s["bits_read_v"] == 16.0  # + the per-channel max read each step
    # and the logits of a decode step, not just the argmax
    fp16_cache = get_method("fp16").new_cache(model)
    al_cache = get_method("alignedkv", k_thresholds=INF, v_thresholds=INF).new_cache(model)
    with torch.no_grad():
        model(ids, past_key_values=fp16_cache)
        model(ids, past_key_values=al_cache)
        nxt = ids[:, -1:]
        a = model(nxt, past_key_values=fp16_cache).logits
        b = model(nxt, past_key_values=al_cache).logits
    assert torch.equal(a, b)


def test_reads_fewer_bits_and_keeps_greedy_output(stories):
    model, tok = stories
    ids = story_ids(tok)
    ref, _ = run(model, ids, "fp16", new=60)
    out, cache = run(model, ids, "alignedkv", new=60)
    s = cache.stats()
    assert s["bits_read"] < 15.0 and s["bits_read_v"] < s["bits_read_k"] <= 16.0
    assert set(s["widths_v"]) <= {8, 12, 16} and s["widths_v"].get(8, 0) > 0.2
    assert (out == ref).float().mean() >= 0.99
    assert s["bits_stored"] > 16.0  # fp16 planes + the per-channel max: nothing is saved in storage
    series = cache.counts().position_series()
    assert series["position"][-1] == ids.shape[1] + 59 and len(series["position"]) == 59


def test_per_head_histograms_add_up_to_the_totals(stories):
    model, tok = stories
    _, cache = run(model, story_ids(tok), "alignedkv", new=10)
    hist = width_histograms(cache)
    assert len(hist) == model.config.num_hidden_layers
    assert len(hist[0]["k"]) == model.config.num_key_value_heads
    counts = cache.counts()
    for side, read in (("k", counts.read_k), ("v", counts.read_v)):
        for w in (8, 12):
            assert sum(head[w] for layer in hist for head in layer[side]) == read.get(w, 0)


def test_release_preset_reads_fewer_value_bits(stories):
    model, tok = stories
    ids = story_ids(tok)
    _, paper = run(model, ids, "alignedkv", new=20)
    _, release = run(model, ids, "alignedkv_release", new=20)
    assert release.stats()["bits_read_v"] < paper.stats()["bits_read_v"]


def test_prefill_aligned_reaches_chunked_log_likelihood(stories):
    model, tok = stories
    ids = story_ids(tok, 300)[0]
    fp16, _ = chunked_nll(model, ids, get_method("fp16").new_cache(model), 32)
    plain, _ = chunked_nll(model, ids, get_method("alignedkv").new_cache(model), 32)
    aligned_cache = get_method("alignedkv", prefill_aligned=True).new_cache(model)
    aligned, _ = chunked_nll(model, ids, aligned_cache, 32)
    assert plain == pytest.approx(fp16, rel=1e-6)  # prefill reads in full precision, as in the paper
    assert aligned != fp16 and aligned == pytest.approx(fp16, rel=2e-2)
    assert aligned_cache.stats()["bits_read"] < 16.0


def test_batch_with_left_padding_matches_fp16(stories):
    model, tok = stories
    texts = [" ".join(tinystories_pieces()[i : i + 2]) for i in (1, 7)]
    rows = [tok(t).input_ids[:n] for t, n in zip(texts, (140, 90), strict=True)]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    kw = {"attention_mask": mask, "max_new_tokens": 30, "do_sample": False, "pad_token_id": 0}
    ref = model.generate(ids, past_key_values=get_method("fp16").new_cache(model), **kw)
    exact = model.generate(
        ids, past_key_values=get_method("alignedkv", k_thresholds=INF, v_thresholds=INF).new_cache(model), **kw
    )
    assert torch.equal(exact, ref)
    cache = get_method("alignedkv").new_cache(model)
    out = model.generate(ids, past_key_values=cache, **kw)
    assert (out == ref).float().mean() > 0.95 and cache.stats()["bits_read"] < 16


def test_captured_products_compare_full_and_read(stories):
    model, tok = stories
    ids = story_ids(tok)
    cache = get_method("alignedkv").new_cache(model)
    with torch.no_grad():
        model(ids, past_key_values=cache)
        for layer in cache.layers:
            layer.capture_products = True
        model(ids[:, -1:], past_key_values=cache)
    p = cache.layers[2].products
    n = ids.shape[1] + 1
    assert p["qk_full"].shape == (1, model.config.num_attention_heads, 1, n) and p["sv_full"].shape[-1] == 8
    rel = ((p["qk_read"] - p["qk_full"]).abs() / p["qk_full"].abs()).flatten()
    assert rel.median() < 1e-2 and (rel == 0).float().mean() < 1.0  # near-zero dot products dominate the max
    assert not torch.equal(p["sv_read"], p["sv_full"])


def test_bad_input_is_refused_clearly(stories):
    with pytest.raises(InvalidParameterError, match="increasing positive"):
        get_method("alignedkv", k_thresholds=[8, 4])
    with pytest.raises(InvalidParameterError, match="topk"):
        get_method("alignedkv", topk=0)
    layer = get_method("alignedkv").new_cache(stories[0]).layers[4]
    with pytest.raises(KvquantError, match="layer 4: 2 value values are NaN/inf or outside fp16"):
        v = torch.ones(1, 4, 3, 8)
        v[0, 1, 1, :2] = float("inf")
        layer.update(torch.ones(1, 4, 3, 8), v)


def test_non_llama_layout_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=32))
    with pytest.raises(InvalidParameterError, match="model_type 'gpt2' is not supported"):
        get_method("alignedkv").new_cache(model)


@pytest.mark.slow
def test_smollm2_gqa_long_prompt(smollm2):
    model, tok = smollm2
    ids = tok(wikitext2_test()[:20000], return_tensors="pt").input_ids[:, :320]
    ref, _ = run(model, ids, "fp16", new=8)
    out, cache = run(model, ids, "alignedkv", new=8)
    s = cache.stats()
    assert (out == ref).float().mean() >= 0.99
    assert s["bits_read_k"] < 16 and s["bits_read_v"] < 14


def test_plus_reads_no_more_key_bits_and_counts_its_metadata(stories):
    model, tok = stories
    ids = story_ids(tok, 300)
    ref, _ = run(model, ids, "fp16", new=30)
    out_col, col = run(model, ids, "alignedkv", new=30)
    out_blk, blk = run(model, ids, "alignedkv_plus", new=30)
    assert blk.layers[0].store.k_exp.shape == (1, 4, blk.get_seq_length() // 64, 8)
    assert blk.stats()["bits_stored_k"] > col.stats()["bits_stored_k"]  # + one exponent byte per block channel
    col_hist, blk_hist = col.counts().read_k, blk.counts().read_k
    n_col, n_blk = sum(col_hist.values()), sum(blk_hist.values())
    assert n_col == n_blk
    elem_bits = lambda h: sum(w * n for w, n in h.items())  # noqa: E731
    assert elem_bits(blk_hist) <= elem_bits(col_hist) * 1.001
    assert (out_blk == ref).float().mean() >= 0.99


def test_margin_only_raises_widths(stories):
    model, tok = stories
    ids = story_ids(tok, 200)
    bits = {}
    for kw in ({}, {"margin": 2}, {"accumulation_margin": True}):
        _, cache = run(model, ids, "alignedkv_plus", new=4, **kw)
        bits[str(kw)] = cache.stats()["bits_read"]
    assert bits["{}"] < bits["{'margin': 2}"] and bits["{}"] < bits["{'accumulation_margin': True}"]
    with pytest.raises(InvalidParameterError, match="margin"):
        get_method("alignedkv", margin=-1)
