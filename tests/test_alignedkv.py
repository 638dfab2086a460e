"""AlignedKV end to end on real models: bit-identity at infinite thresholds, fewer bits otherwise."""

import pytest
import torch

from kvquant import get_method
from kvquant.data import tinystories_pieces, wikitext2_test
from kvquant.errors import InvalidParameterError, KvquantError
from kvquant.eval.fidelity import first_flip_is_near_tie, greedy_decode, kl_divergence, unexplained_flips
from kvquant.eval.perplexity import chunked_nll
from kvquant.methods.alignedkv import head_width_counts, width_histograms

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
    fp16_cache = get_method("fp16", backend="torch").new_cache(model)
    al_cache = get_method("alignedkv", k_thresholds=INF, v_thresholds=INF, backend="torch").new_cache(model)
    with torch.no_grad():
        model(ids, past_key_values=fp16_cache)
        model(ids, past_key_values=al_cache)
        nxt = ids[:, -1:]
        a = model(nxt, past_key_values=fp16_cache).logits
        b = model(nxt, past_key_values=al_cache).logits
    assert torch.equal(a, b)


def forced_run(model, prompt, name, new, reference=None, **kw):
    """``name`` teacher-forced along fp16's greedy tokens (``reference``, decoded here if not given)."""
    reference = reference or greedy_decode(model, prompt, get_method("fp16", backend="torch").new_cache(model), new)
    cache = get_method(name, **kw, backend="torch").new_cache(model)
    forced = greedy_decode(model, prompt, cache, new, forced=reference.tokens)
    return reference, forced, cache


@pytest.mark.numerics
def test_reads_fewer_bits_and_keeps_greedy_output(stories):
    model, tok = stories
    prompt = story_ids(tok)[0]
    ref, forced, cache = forced_run(model, prompt, "alignedkv", 60)
    s = cache.stats()
    assert s["bits_read"] < 15.0 and s["bits_read_v"] < s["bits_read_k"] <= 16.0
    assert set(s["widths_v"]) <= {8, 12, 16} and s["widths_v"].get(8, 0) > 0.2
    # fp16's next token everywhere along its own path, but where fp16 itself is at a near-tie, and
    # its distribution too: KL ~5e-7 here; keys all read at 8 bits give 2e-3, values at 8 bits 5e-5
    assert unexplained_flips(ref.tokens, ref.logprobs, forced.logprobs) == []
    assert kl_divergence(ref.logprobs, forced.logprobs).mean() < 5e-6
    assert s["bits_stored"] > 16.0  # fp16 planes + the per-channel max: nothing is saved in storage
    series = cache.counts().position_series()
    assert series["position"][-1] == prompt.numel() + 59 and len(series["position"]) == 59


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
    fp16, _ = chunked_nll(model, ids, get_method("fp16", backend="torch").new_cache(model), 32)
    plain, _ = chunked_nll(model, ids, get_method("alignedkv", backend="torch").new_cache(model), 32)
    aligned_cache = get_method("alignedkv", prefill_aligned=True, backend="torch").new_cache(model)
    aligned, _ = chunked_nll(model, ids, aligned_cache, 32)
    assert plain == pytest.approx(fp16, rel=1e-6)  # prefill reads in full precision, as in the paper
    assert aligned != fp16 and aligned == pytest.approx(fp16, rel=2e-2)
    assert aligned_cache.stats()["bits_read"] < 16.0


@pytest.mark.numerics
def test_batch_with_left_padding_matches_fp16(stories):
    model, tok = stories
    texts = [" ".join(tinystories_pieces()[i : i + 2]) for i in (1, 7)]
    rows = [tok(t).input_ids[:n] for t, n in zip(texts, (140, 90), strict=True)]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    kw = {"attention_mask": mask, "max_new_tokens": 30, "do_sample": False, "pad_token_id": 0}
    ref = model.generate(
        ids,
        past_key_values=get_method("fp16", backend="torch").new_cache(model),
        output_logits=True,
        return_dict_in_generate=True,
        **kw,
    )
    exact = model.generate(
        ids,
        past_key_values=get_method("alignedkv", k_thresholds=INF, v_thresholds=INF, backend="torch").new_cache(model),
        **kw,
    )
    assert torch.equal(exact, ref.sequences)  # the same reads in the same order: equal bit for bit
    cache = get_method("alignedkv", backend="torch").new_cache(model)
    out = model.generate(ids, past_key_values=cache, **kw)
    ref_logprobs = torch.log_softmax(torch.stack(ref.logits, 1).float(), -1)
    for row in range(len(rows)):
        assert first_flip_is_near_tie(ref.sequences[row, width:], ref_logprobs[row], out[row, width:]), row
    assert cache.stats()["bits_read"] < 16


def test_captured_products_compare_full_and_read(stories):
    model, tok = stories
    ids = story_ids(tok)
    cache = get_method("alignedkv", backend="torch").new_cache(model)
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
        get_method("alignedkv", k_thresholds=[8, 4], backend="torch")
    with pytest.raises(InvalidParameterError, match="topk"):
        get_method("alignedkv", topk=0, backend="torch")
    layer = get_method("alignedkv", backend="torch").new_cache(stories[0]).layers[4]
    with pytest.raises(KvquantError, match="layer 4: 2 value values are NaN/inf or outside fp16"):
        v = torch.ones(1, 4, 3, 8)
        v[0, 1, 1, :2] = float("inf")
        layer.update(torch.ones(1, 4, 3, 8), v)


def _tiny_llama(cls=None, **config):
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    cfg = LlamaConfig(**sizes, num_key_value_heads=1, pad_token_id=0, bos_token_id=1, eos_token_id=2, **config)
    return (cls or LlamaForCausalLM)(cfg).eval()


def test_layouts_it_cannot_read_are_refused_in_one_line():
    """Not the model family: what the reader needs (the attention interface, a head dim of 8k)."""
    from transformers import LlamaForCausalLM

    class Bypassing(LlamaForCausalLM):
        _supports_attention_backend = False

    with pytest.raises(InvalidParameterError, match="does not route its attention through transformers'"):
        get_method("alignedkv", backend="torch").new_cache(_tiny_llama(Bypassing))
    with pytest.raises(InvalidParameterError, match="head_dim 12 of model_type 'llama' must be a multiple of 8"):
        get_method("alignedkv", backend="torch").new_cache(_tiny_llama(head_dim=12))


def test_gpt2_layout_reads_like_fp16_at_infinite_thresholds():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=128)).eval()
    ids = torch.randint(0, 32, (1, 70))
    logits = []
    for method in (
        get_method("fp16", backend="torch"),
        get_method("alignedkv", k_thresholds=INF, v_thresholds=INF, backend="torch"),
    ):
        with method.attach(model), torch.no_grad():
            cache = method.new_cache(model)
            model(ids, past_key_values=cache)
            logits.append(model(ids[:, -1:], past_key_values=cache).logits)
    assert torch.equal(*logits)


def test_width_rule_scores_soft_cap_scale_and_cut_the_mask():
    """Gemma-2's order: scale, ``tanh(x/c)·c``, then the mask (here longer than the keys, additive)."""
    from kvquant.formats.planes import scores as _scores

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 2, 8, generator=gen) * 30, torch.randn(1, 2, 5, 8, generator=gen) * 30
    allowed = torch.rand(1, 1, 2, 7, generator=gen) > 0.3
    allowed[..., 0] = True
    additive = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    logits = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.2
    want = torch.softmax(torch.tanh(logits / 50.0) * 50.0 + additive[..., :5], dim=-1)
    torch.testing.assert_close(_scores(q, k, additive, 0.2, softcap=50.0), want)
    torch.testing.assert_close(_scores(q, k, allowed, 0.2, softcap=50.0), want)
    assert not torch.allclose(_scores(q, k, allowed, 0.2), want)  # the cap matters at these magnitudes


def test_sliding_layer_hands_attention_its_window_and_drops_whole_blocks():
    """A sliding layer: attention sees the newest ``window − 1`` plus the new tokens, as
    ``DynamicSlidingWindowLayer``; blocks wholly out of the window are dropped before an append."""
    from kvquant.alignment import BLOCK
    from kvquant.methods.alignedkv import AlignedLayer

    window, gen = 40, torch.Generator().manual_seed(0)
    method = get_method("alignedkv", k_thresholds=INF, v_thresholds=INF, backend="torch")  # every read at 16 bits
    layer = AlignedLayer(0, method.rule(), n_kv_heads=2, window=window)
    assert layer.is_sliding and layer.get_mask_sizes(5) == (5, 0)
    history = []
    for n in (100, 1, 60, 1, 1):
        k, v = torch.randn(1, 2, n, 8, generator=gen), torch.randn(1, 2, n, 8, generator=gen)
        seen = layer.get_seq_length()
        length, offset = layer.get_mask_sizes(n)
        history.append((k, v))
        out_k, _ = layer.update(k, v)
        assert out_k.shape[2] == length and layer.get_seq_length() == seen + n
        assert offset == max(0, seen - window + 1) and layer.dropped <= offset
        assert layer.dropped % BLOCK == 0 and layer.dropped > offset - BLOCK
        all_k, all_v = (torch.cat([h[i] for h in history], dim=2).half()[:, :, offset:] for i in (0, 1))
        if n > 1:  # prefill chunks come back read at 16 bits: exactly the window's fp16 keys
            assert torch.equal(out_k.half(), all_k)
        else:
            q = torch.randn(1, 4, 1, 8, generator=gen)
            keys, values, _, _ = layer.aligned_read(q, None, 8**-0.5)
            assert torch.equal(keys.half(), all_k) and torch.equal(values.half(), all_v)
    assert layer.store.n_tokens == layer.get_seq_length() - layer.dropped and layer.dropped == BLOCK


@pytest.mark.slow
@pytest.mark.numerics
def test_smollm2_gqa_long_prompt(smollm2):
    model, tok = smollm2
    prompt = tok(wikitext2_test()[:20000], return_tensors="pt").input_ids[0, :320]
    ref, forced, cache = forced_run(model, prompt, "alignedkv", 8)
    s = cache.stats()
    assert unexplained_flips(ref.tokens, ref.logprobs, forced.logprobs) == []
    assert s["bits_read_k"] < 16 and s["bits_read_v"] < 14


@pytest.mark.numerics
def test_plus_reads_no_more_key_bits_and_counts_its_metadata(stories):
    model, tok = stories
    prompt = story_ids(tok, 300)[0]
    ref, _, col = forced_run(model, prompt, "alignedkv", 30)  # both along fp16's tokens: the same K/V
    _, forced_blk, blk = forced_run(model, prompt, "alignedkv_plus", 30, reference=ref)
    assert blk.layers[0].store.k_exp.shape == (1, 4, blk.get_seq_length() // 64, 8)
    assert blk.stats()["bits_stored_k"] > col.stats()["bits_stored_k"]  # + one exponent byte per block channel
    col_hist, blk_hist = col.counts().read_k, blk.counts().read_k
    n_col, n_blk = sum(col_hist.values()), sum(blk_hist.values())
    assert n_col == n_blk
    elem_bits = lambda h: sum(w * n for w, n in h.items())  # noqa: E731
    assert elem_bits(blk_hist) <= elem_bits(col_hist) * 1.001
    assert unexplained_flips(ref.tokens, ref.logprobs, forced_blk.logprobs) == []


def test_margin_only_raises_widths(stories):
    model, tok = stories
    ids = story_ids(tok, 200)
    bits = {}
    for kw in ({}, {"margin": 2}, {"accumulation_margin": True}):
        _, cache = run(model, ids, "alignedkv_plus", new=4, **kw)
        bits[str(kw)] = cache.stats()["bits_read"]
    assert bits["{}"] < bits["{'margin': 2}"] and bits["{}"] < bits["{'accumulation_margin': True}"]
    with pytest.raises(InvalidParameterError, match="margin"):
        get_method("alignedkv", margin=-1, backend="torch")


def test_v_block_is_validated_in_one_line():
    for bad in (0, -4, 2.5, True, "8"):
        with pytest.raises(InvalidParameterError, match="v_block") as info:
            get_method("alignedkv", v_block=bad, backend="torch")
        assert "\n" not in str(info.value)
    with pytest.raises(
        InvalidParameterError, match=r"^v_block must be a positive integer \(tokens per width\), got 0$"
    ):
        get_method("alignedkv_plus", v_block=0, backend="torch")
    assert (
        get_method("alignedkv", backend="torch").v_block == get_method("alignedkv_plus", backend="torch").v_block == 1
    )


def test_layer_value_widths_are_the_block_max_of_the_paper_rule(stories):
    """One decode step, the same store and query: ``v_block`` raises each token's width to the widest
    in its block of the store (never lower), and ``v_block=1`` is the rule's own per-token widths."""
    from kvquant.alignment import block_widths, value_widths
    from kvquant.formats.planes import scores as _scores

    model, tok = stories
    cache = get_method("alignedkv", backend="torch").new_cache(model)
    with torch.no_grad():
        model(story_ids(tok, 200), past_key_values=cache)
    layer, gen = cache.layers[2], torch.Generator().manual_seed(0)
    query = torch.randn(1, model.config.num_attention_heads, 1, 8, generator=gen)
    keys, wk, paper = layer.decide_widths(query, None, 8**-0.5)
    store = layer.store
    scores = _scores(query, keys, None, 8**-0.5, None, torch.float64)
    own = value_widths(scores, store.value_high_bytes(), layer.rule.v_thresholds)[:, :, : store.n_full]
    assert torch.equal(paper, own) and paper.shape[-1] == 192 and set(paper.unique().tolist()) >= {8, 16}
    for v_block in (8, 16, 64):
        layer.rule = get_method("alignedkv", v_block=v_block).rule()
        _, wk_b, wv = layer.decide_widths(query, None, 8**-0.5)
        assert torch.equal(wk_b, wk) and torch.equal(wv, block_widths(paper, v_block))
        assert bool((wv >= paper).all()) and torch.equal(
            wv.unflatten(-1, (-1, v_block)).amin(-1), paper.unflatten(-1, (-1, v_block)).amax(-1)
        )


@pytest.mark.numerics
def test_larger_v_block_reads_more_bits_and_keeps_greedy_output(stories):
    """Along fp16's greedy tokens (300-token prompt, 40 steps): value bits read grow with ``v_block``
    (measured 9.36 / 9.94 / 10.19 / 10.93 for 1 / 8 / 16 / 64) and fp16's next token stays first wherever
    fp16 is not at a near-tie."""
    model, tok = stories
    prompt = story_ids(tok, 300)[0]
    reference = greedy_decode(model, prompt, get_method("fp16", backend="torch").new_cache(model), 40)
    bits = []
    for v_block in (1, 8, 16, 64):
        _, forced, cache = forced_run(model, prompt, "alignedkv", 40, reference=reference, v_block=v_block)
        assert unexplained_flips(reference.tokens, reference.logprobs, forced.logprobs) == [], v_block
        assert kl_divergence(reference.logprobs, forced.logprobs).mean() < 1e-5
        bits.append(cache.stats()["bits_read_v"])
    assert bits == sorted(bits) and bits[0] < bits[1] and bits[-1] < 16.0


@pytest.mark.numerics
def test_block_rule_reads_at_least_the_paper_rule_and_keeps_greedy_output(stories):
    """``alignedkv_block`` along fp16's greedy tokens (300-token prompt, 40 steps): per ``v_block`` at least
    the value bits the paper's rule raised to the block's widest reads (its bound covers every token), below
    16, fp16's next token first wherever fp16 is not at a near-tie; its exponent bytes count as bits read."""
    model, tok = stories
    prompt = story_ids(tok, 300)[0]
    reference = greedy_decode(model, prompt, get_method("fp16", backend="torch").new_cache(model), 40)
    for v_block in (16, 64):
        _, _, paper = forced_run(model, prompt, "alignedkv", 40, reference=reference, v_block=v_block)
        _, forced, block = forced_run(model, prompt, "alignedkv_block", 40, reference=reference, v_block=v_block)
        assert unexplained_flips(reference.tokens, reference.logprobs, forced.logprobs) == [], v_block
        assert kl_divergence(reference.logprobs, forced.logprobs).mean() < 1e-5
        layers = zip(width_histograms(block), width_histograms(paper), strict=True)
        for mine, theirs in layers:  # elements read at 16 (and at >= 12) never fewer, head by head
            for ours, its in zip(mine["v"], theirs["v"], strict=True):
                assert ours[16] >= its[16] and ours[16] + ours[12] >= its[16] + its[12]
        bits = block.stats()["bits_read_v"]
        assert paper.stats()["bits_read_v"] < bits < 16.0
        store = block.layers[0].store
        assert store.v_exp.shape == (1, store.tail_v.shape[1], store.n_full // v_block, 8)


def test_block_rule_method_parameters():
    method = get_method("alignedkv_block")
    assert (
        method.v_block == 32
        and method.rule().value_rule == "block"
        and get_method("alignedkv").rule().value_rule == "token"
    )
    for bad in (1, 3, 48, 128):
        with pytest.raises(InvalidParameterError, match=f"v_block must divide 64 and be at least 2 .*got {bad}"):
            get_method("alignedkv_block", v_block=bad)


def test_plus_block_takes_the_plus_key_widths_and_the_block_value_widths(stories):
    """``alignedkv_plus_block`` is the two rules together: on one store and query, its key widths are
    AlignedKV+'s (per block, from the key exponent bytes) and its value widths the block rule's, exactly;
    each differs from the other rule's side (the widths move, so the test can fail)."""
    model, tok = stories
    cache = get_method("alignedkv_plus_block", v_block=16, backend="torch").new_cache(model)
    with torch.no_grad():
        model(story_ids(tok, 200), past_key_values=cache)
    layer, gen = cache.layers[2], torch.Generator().manual_seed(0)
    assert layer.store.k_exp is not None and layer.store.v_exp is not None
    query = torch.randn(1, model.config.num_attention_heads, 1, 8, generator=gen) * 4
    _, wk, wv = layer.decide_widths(query, None, 8**-0.5)
    widths = {}
    for name in ("alignedkv_plus", "alignedkv_block", "alignedkv"):
        layer.rule = get_method(name, v_block=16).rule()
        widths[name] = layer.decide_widths(query, None, 8**-0.5)[1:]
    assert torch.equal(wk, widths["alignedkv_plus"][0]) and torch.equal(wv, widths["alignedkv_block"][1])
    assert not torch.equal(wk, widths["alignedkv"][0]) and not torch.equal(wv, widths["alignedkv_plus"][1])
    assert get_method("alignedkv_plus_block").v_block == 32


def assert_same_reads(mine, theirs, moved: float = 1e-4) -> None:
    """Same stores; per layer, KV head and side the same elements read, at most ``moved`` of them at
    another width (and bits read within that share of 8 bits)."""
    a, b = mine.stats(), theirs.stats()
    read = {k for k in a if k.startswith(("bits_read", "widths_"))}
    assert {k: v for k, v in a.items() if k not in read} == {k: v for k, v in b.items() if k not in read}
    for side in ("k", "v"):
        total = other = 0
        for la, lb in zip(width_histograms(mine), width_histograms(theirs), strict=True):
            for ha, hb in zip(la[side], lb[side], strict=True):
                assert sum(ha.values()) == sum(hb.values())
                total += sum(ha.values())
                other += sum(abs(ha[w] - hb[w]) for w in ha) // 2
        assert other <= moved * total, (side, other, total)
    for key in ("bits_read", "bits_read_k", "bits_read_v"):
        assert a[key] == pytest.approx(b[key], abs=8 * moved)


@pytest.mark.numerics
@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("alignedkv", {}),
        ("alignedkv_plus", {}),
        ("alignedkv", {"v_block": 16}),
        ("alignedkv_block", {}),
        ("alignedkv_plus_block", {"v_block": 8}),
    ],
    ids=str,
)
def test_the_cpu_kernel_follows_the_torch_path(stories, name, params):
    """``backend=cpu``: the torch rules choose the widths, ``kernels_cpu`` attends over the planes at
    them. Teacher-forced along the torch path's greedy tokens the mean KL between the two is below
    1e-6 (measured 2-3e-8: fp32 summation order), the widths (so the bits read) are the same per layer
    and head up to float boundaries, its own greedy run first differs (if ever) at a near-tie, and beam
    search runs. Up to float boundaries: the two paths sum attention in another fp32 order, so a stored
    fp16 element can round the other way and move a score across a width threshold (on an AVX2 CPU one
    value element of ~10^4 did); on the same stores the kernel's rule gives the torch rule's widths
    exactly (test_kernels_cpu). So: what is stored is equal, and at most 1 in 10^4 elements per side is
    read at another width."""
    from conftest import require_kernels_cpu
    from test_kivi import beam_search_runs

    require_kernels_cpu()
    model, tok = stories
    ids = story_ids(tok, 100)[0]
    runs = {}
    for backend in ("torch", "cpu"):
        method = get_method(name, backend=backend, **params)
        with method.attach(model):
            cache = method.new_cache(model)
            free = greedy_decode(model, ids, cache, 40)
            forced_cache = method.new_cache(model)
            forced = greedy_decode(model, ids, forced_cache, 40, forced=runs["torch"][0].tokens if runs else None)
            runs[backend] = (free, forced, forced_cache)
        assert cache.backend == backend
    (free_t, _, forced_t), (free_c, forced_c, cache_c) = runs["torch"], runs["cpu"]
    assert kl_divergence(free_t.logprobs, forced_c.logprobs).mean() < 1e-6
    assert first_flip_is_near_tie(free_t.tokens, free_t.logprobs, free_c.tokens)
    assert_same_reads(cache_c, forced_t)
    with get_method(name, backend="cpu", **params).attach(model) as routed:
        beam_search_runs(routed, tok, get_method(name, backend="cpu", **params))


def test_kernels_that_cannot_run_fall_back_or_refuse(monkeypatch, capsys):
    """What a backend's kernels lack they say (``limits``): cpu has no sliding window, CuPy decides value
    widths per token only. ``auto`` then runs the torch reference with one warning line; an explicit
    backend is refused in one line."""
    from conftest import require_kernels_cpu

    from kvquant import backends
    from kvquant.cache import KVGeometry

    require_kernels_cpu()
    sliding = KVGeometry(1, 4, 2, 8, "llama", 32, ("sliding_attention",))
    rule = get_method("alignedkv").rule(sliding)
    assert backends.get_backend("cpu").limits("planes", sliding, rule) == ["sliding-window layers (32)"]
    model = _tiny_llama()
    assert get_method("alignedkv", backend="auto").new_cache(model).backend == "cpu"
    geometry = KVGeometry.of(model.config)
    cupy = backends.get_backend("cupy")
    assert cupy.limits("planes", geometry, get_method("alignedkv").rule(geometry)) == []
    monkeypatch.setattr(backends, "_WARNED", set())  # each fallback line is said once per process
    monkeypatch.setattr(backends, "auto_candidate", lambda device_type, fmt: "cupy")  # as if this CPU were a GPU
    monkeypatch.setattr(backends, "_why_unusable", lambda *args: None)
    assert get_method("alignedkv", backend="auto", v_block=8).new_cache(model).backend == "torch"
    assert "value widths per block (v_block=8)" in capsys.readouterr().err
    with pytest.raises(InvalidParameterError, match=r"backend=cupy cannot run this model: .*v_block=8"):
        get_method("alignedkv", backend="cupy", v_block=8).new_cache(model)
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 1}  # as accelerate leaves a sharded model
    assert get_method("alignedkv", backend="auto").new_cache(model).backend == "torch"
    assert "backend=auto uses torch: the model is spread over several devices (0, 1)" in capsys.readouterr().err
    with pytest.raises(InvalidParameterError, match=r"backend=cupy cannot run this model: the model is spread"):
        get_method("alignedkv", backend="cupy").new_cache(model)


def test_cpu_kernel_with_prefill_aligned_chunks(stories):
    """Multi-token chunks through the rules (``prefill_aligned``): the kernel takes ``q_len`` > 1 with
    the causal mask, reads at the same widths, and the chunked log-likelihood equals the torch path's
    to fp32 accuracy (measured 1.7e-6 relative; the fp16 kernel against SDPA here: 5.6e-6)."""
    from conftest import require_kernels_cpu

    require_kernels_cpu()
    model, tok = stories
    ids = story_ids(tok, 200)[0]
    nll, stats = {}, {}
    for backend in ("torch", "cpu"):
        method = get_method("alignedkv_plus", prefill_aligned=True, v_block=8, backend=backend)
        with method.attach(model):
            cache = method.new_cache(model)
            nll[backend], _ = chunked_nll(model, ids, cache, 32)
        assert cache.backend == backend
        stats[backend] = cache.stats()
    assert nll["cpu"] == pytest.approx(nll["torch"], rel=1e-5)
    assert stats["cpu"] == stats["torch"] and stats["cpu"]["bits_read"] < 16.0


def test_a_whole_prompt_without_a_mask_is_causal_for_the_rules(stories, monkeypatch):
    """A prompt run as one forward gets no mask from transformers (plain causal). The rules must not
    let a query's scores over later keys raise an earlier token's width: the torch rule decides what it
    decides with the causal mask spelled out (and not what an all-visible mask gives), and the C++
    backend takes the fused call for it (no torch rule) with the same widths and the log-likelihood to
    fp32 accuracy (measured 8e-7 relative; fp16's kernel against SDPA on this prompt: 2.2e-5)."""
    from conftest import require_kernels_cpu

    from kvquant.attention import causal_allowed
    from kvquant.methods.alignedkv import AlignedLayer

    model, tok = stories
    ids = story_ids(tok, 300)[0]
    n = ids.numel()
    attend, queries = AlignedLayer.attend, {}

    def keep_query(self, module, query, *args, **kwargs):
        queries.setdefault(self.layer_idx, query)
        return attend(self, module, query, *args, **kwargs)

    monkeypatch.setattr(AlignedLayer, "attend", keep_query)
    method = get_method("alignedkv", prefill_aligned=True, backend="torch")
    with method.attach(model), torch.no_grad():
        cache = method.new_cache(model)
        model(input_ids=ids.view(1, -1), past_key_values=cache, use_cache=True)
    monkeypatch.setattr(AlignedLayer, "attend", attend)
    layer, query = cache.layers[0], queries[0]
    scaling = query.shape[-1] ** -0.5
    _, _, plain = layer.decide_widths(query, None, scaling)
    _, _, causal = layer.decide_widths(query, causal_allowed(n, n)[None, None], scaling)
    _, _, everything = layer.decide_widths(query, torch.ones(1, 1, n, n, dtype=torch.bool), scaling)
    assert torch.equal(plain, causal) and not torch.equal(plain, everything)
    assert (plain >= everything).all()  # a query that sees few keys weighs each more: wider reads

    require_kernels_cpu()
    torch_rule, ruled = AlignedLayer.aligned_read, []

    def count_rule(self, *args, **kwargs):
        ruled.append(self.layer_idx)
        return torch_rule(self, *args, **kwargs)

    monkeypatch.setattr(AlignedLayer, "aligned_read", count_rule)
    nll, stats = {}, {}
    for backend in ("torch", "cpu"):
        ruled.clear()
        method = get_method("alignedkv", prefill_aligned=True, backend=backend)
        with method.attach(model):
            cache = method.new_cache(model)
            nll[backend], _ = chunked_nll(model, ids, cache, n)
        stats[backend] = cache.stats()
        assert bool(ruled) == (backend == "torch")
    assert nll["cpu"] == pytest.approx(nll["torch"], rel=5e-5)
    assert stats["cpu"] == stats["torch"] and stats["cpu"]["bits_read"] < 16.0


@pytest.mark.parametrize("in_numpy", [True, False], ids=["numpy", "torch"])
@pytest.mark.parametrize("blockwise", [False, True], ids=["per-column", "per-block"])
@pytest.mark.parametrize("first", [0, 10, 64, 200])
def test_head_width_counts_count_each_heads_reads_in_the_window(blockwise, first, in_numpy):
    """The bits-read histogram's per-step counts, in numpy (CPU tensors) and in torch ops (other devices, run
    here on CPU tensors): every (key token, channel) of the window ``first..n_full`` and every value token, per
    KV head and width, counted one by one here."""
    g = torch.Generator().manual_seed(first + blockwise)
    widths = torch.tensor([8, 12, 16], dtype=torch.int32)
    b, h, nb, d = 2, 3, 4, 16
    wk = widths[torch.randint(0, 3, (b, h, nb, d) if blockwise else (b, h, d), generator=g)]
    wv = widths[torch.randint(0, 3, (b, h, nb * 64), generator=g)]
    per_k, per_v = head_width_counts(wk, wv, first, nb * 64, in_numpy=in_numpy)
    want_k, want_v = torch.zeros(h, 3, dtype=torch.int64), torch.zeros(h, 3, dtype=torch.int64)
    for i in range(b):
        for j in range(h):
            for t in range(first, nb * 64):
                for c in range(d):
                    w = int(wk[i, j, t // 64, c] if blockwise else wk[i, j, c])
                    want_k[j, (w - 8) // 4] += 1
            for t in range(nb * 64):
                want_v[j, (int(wv[i, j, t]) - 8) // 4] += 1
    assert per_k.dtype == per_v.dtype == torch.int64
    assert torch.equal(per_k, want_k) and torch.equal(per_v, want_v)


@pytest.mark.parametrize("blockwise", [False, True], ids=["per-column", "per-block"])
def test_head_width_counts_on_a_device_never_wait_for_it(blockwise):
    """A GPU counts a step's widths in torch ops every layer: none of them may read values back to the host (CUDA's
    ``bincount`` reads its input's min and max: four syncs a layer and step, which kept the host from running ahead
    of the device), and the counts are numpy's."""
    from kvquant.analysis.timing import OpCounter

    widths = torch.tensor([8, 12, 16], dtype=torch.int32)
    g = torch.Generator().manual_seed(7)
    wk = widths[torch.randint(0, 3, (2, 3, 5, 16) if blockwise else (2, 3, 16), generator=g)]
    wv = widths[torch.randint(0, 3, (2, 3, 5 * 64), generator=g)]
    head_width_counts(wk, wv, 70, 5 * 64, in_numpy=False)  # the first call places the widths on the device
    with OpCounter(cpu_as_gpu=True) as counter:
        on_device = head_width_counts(wk, wv, 70, 5 * 64, in_numpy=False)
    assert not counter.syncs, counter.syncs
    assert counter.total == (11 if blockwise else 5)  # a compare and a sum each, then the window (12 with bincount)
    for got, want in zip(on_device, head_width_counts(wk, wv, 70, 5 * 64, in_numpy=True), strict=True):
        assert torch.equal(got, want)
