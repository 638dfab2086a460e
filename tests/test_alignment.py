"""The precision-alignment rules and the plane layout (kvquant/alignment.py)."""

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvquant import bits
from kvquant.alignment import (
    BLOCK,
    accumulation_margin,
    block_exponent_field,
    block_key_widths,
    block_value_widths,
    block_widths,
    check_thresholds,
    key_widths,
    strided_topk_indices,
    value_widths,
    widths_from_gap,
)
from kvquant.errors import InvalidParameterError
from kvquant.formats.planes import PlaneStore, scores

T = (4.0, 8.0)
INF = (float("inf"), float("inf"))


def rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_widths_from_gap_tiers():
    gap = torch.tensor([0, 3.9, 4, 7, 8, 100])
    assert widths_from_gap(gap, T).tolist() == [16, 16, 12, 12, 8, 8]


def test_key_rule_by_hand():
    # one KV head, 3 channels: P = e(|q|) + e(colmax) = [3+2, 0+1, -3+0] -> gaps [0, 4, 8]
    q = torch.tensor([[[[8.0, 1.0, 0.125]]]])
    absmax = torch.tensor([[[4.0, 2.0, 1.0]]], dtype=torch.float16)
    assert key_widths(q, absmax, T).tolist() == [[[16, 12, 8]]]


def test_key_rule_gqa_uses_max_q_of_the_group():
    q = torch.zeros(1, 2, 1, 2)
    q[0, 0, 0] = torch.tensor([1.0, 2**-9])
    q[0, 1, 0] = torch.tensor([2**-9, 1.0])  # second query head needs channel 1
    absmax = torch.ones(1, 1, 2, dtype=torch.float16)
    assert key_widths(q, absmax, T).tolist() == [[[16, 16]]]
    assert key_widths(q[:, :1], absmax, T).tolist() == [[[16, 8]]]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), channel=st.integers(0, 15), factor=st.floats(1.0, 1e4))
def test_raising_q_never_lowers_that_channels_width(seed, channel, factor):
    q = rand(1, 4, 1, 16, seed=seed)
    absmax = rand(1, 2, 16, seed=seed + 1).abs().half() + 0.01
    before = key_widths(q, absmax, T)
    q2 = q.clone()
    q2[..., channel] *= factor
    after = key_widths(q2, absmax, T)
    assert (after[..., channel] >= before[..., channel]).all()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), scale=st.floats(1e-3, 1e3))
def test_channel_with_largest_p_reads_16(seed, scale):
    q = rand(2, 3, 1, 8, seed=seed, scale=scale)
    absmax = (rand(2, 3, 8, seed=seed + 7).abs() * scale).half() + 1e-3
    p = bits.floor_log2(q.abs().amax(2)) + bits.floor_log2(absmax)
    widths = key_widths(q, absmax, T)
    top = p.argmax(-1, keepdim=True)
    assert (widths.gather(-1, top) == 16).all()
    assert set(widths.unique().tolist()) <= {8, 12, 16}


def test_infinite_thresholds_read_everything():
    q, absmax = rand(1, 2, 1, 8), rand(1, 1, 8).abs().half()
    assert (key_widths(q, absmax, INF) == 16).all()
    scores = torch.softmax(rand(1, 2, 1, 100) * 5, -1)
    scores[..., :10] = 0.0
    v_high = bits.split_planes(rand(1, 1, 100, 8).half())[0]
    assert (value_widths(scores, v_high, INF) == 16).all()


def test_value_rule_small_scores_read_fewer_bits():
    n, d = 200, 8
    v = torch.ones(1, 1, n, d)
    logits = torch.zeros(1, 1, 1, n)
    logits[..., 0] = 20.0  # one dominant token
    logits[..., 1] = 20.0 - 6 * 0.693  # 2^-6 of it: gap ≈ 6 -> 12 bits
    scores = torch.softmax(logits, -1)
    widths = value_widths(scores, bits.split_planes(v.half())[0], T)
    assert widths[0, 0, 0] == 16 and widths[0, 0, 1] == 12
    assert (widths[0, 0, 2:] == 8).all()  # scores ~e^-20 of the top


def test_value_rule_needs_alignment_in_every_channel():
    # token 1 is small in channel 0 but as large as the output in channel 1 -> must read 16
    v = torch.tensor([[[[1.0, 2**-12], [2**-12, 1.0]]]])
    scores = torch.tensor([[[[0.999, 0.001]]]])
    v_high = bits.split_planes(v.half())[0]
    widths = value_widths(scores, v_high, T)
    assert widths.tolist() == [[[16, 16]]]  # O_est[1] ≈ 0.001: token 1 is the output in channel 1


def test_strided_topk():
    s = torch.tensor([[5.0, 1, 2, 9, 3, 4, 0, 8]])
    assert strided_topk_indices(s, 2).tolist() == [[0, 3]]
    assert strided_topk_indices(s, 3).tolist() == [[3, 7, 5]]  # groups {0,3,6} {1,4,7} {2,5}
    assert strided_topk_indices(s[:, :2], 4).tolist() == [[0, 1]]


def test_thresholds_validation():
    assert check_thresholds([4, 8], "k") == (4.0, 8.0)
    for bad in ([8, 4], [0, 4], [4], [-1, 2]):
        with pytest.raises(InvalidParameterError, match="increasing positive"):
            check_thresholds(bad, "k")


def with_tiny_values(x: torch.Tensor, seed: int) -> torch.Tensor:
    """Sprinkle ±0 and values below 2^-16 (whose high byte reads as ±0) into ``x``."""
    g = torch.Generator().manual_seed(seed)
    pick = torch.rand(x.shape, generator=g)
    x = torch.where(pick < 0.05, 0.0, x)
    x = torch.where((pick >= 0.05) & (pick < 0.08), -0.0, x)
    return torch.where((pick >= 0.08) & (pick < 0.12), 2.0**-20 * torch.sign(x), x)


@pytest.mark.parametrize("tiny", [False, True])
@pytest.mark.parametrize("chunks", [[200], [1] * 70, [63, 1, 64, 2], [130, 1, 1]])
def test_plane_store_layout_and_round_trip(chunks, tiny):
    b, h, d = 2, 3, 16
    store = PlaneStore()
    ks, vs = [], []
    for i, n in enumerate(chunks):
        k, v = rand(b, h, n, d, seed=i), rand(b, h, n, d, seed=100 + i)
        if tiny:
            k, v = with_tiny_values(k, i), with_tiny_values(v, 50 + i)
        k, v = k.half(), v.half()
        ks.append(k)
        vs.append(v)
        store.append(k, v)
    k_all, v_all = torch.cat(ks, 2), torch.cat(vs, 2)
    total = k_all.shape[2]
    full = total // BLOCK * BLOCK
    assert store.n_tokens == total and store.n_full == full and store.tail_k.shape[2] == total - full
    assert torch.equal(store.read_keys(16), k_all) and torch.equal(store.read_values(16), v_all)
    assert torch.equal(store.read_keys(16, torch.float32), k_all.float())
    if tiny and full:
        assert store.tiny_k and store.tiny_v
    assert torch.equal(store.k_absmax, k_all.abs().amax(2))
    if full:
        assert store.k_a.shape == (b, h, full // BLOCK, d, BLOCK) and store.k_b.shape[-1] == BLOCK // 2
        assert store.v_a.shape == (b, h, full, d) and store.v_b.shape == (b, h, full, d // 2)
        # channel-major: one channel of one block is 64 consecutive tokens
        assert torch.equal(store.k_a[0, 0, 0, 5], (bits.fp16_bits(k_all[0, 0, :BLOCK, 5]) >> 8).to(torch.uint8))
        wk = torch.randint(0, 3, (b, h, d)).mul(4).add(8)
        expected = torch.cat([bits.truncate(k_all[:, :, :full], wk[:, :, None, :]), k_all[:, :, full:]], 2)
        assert torch.equal(store.read_keys(wk), expected)
        wv = torch.randint(0, 3, (b, h, full)).mul(4).add(8)
        expected_v = torch.cat([bits.truncate(v_all[:, :, :full], wv[..., None]), v_all[:, :, full:]], 2)
        assert torch.equal(store.read_values(wv), expected_v)
        for w in (8, 12):  # scalar widths take the same path
            assert torch.equal(store.read_keys(w)[:, :, :full], bits.truncate(k_all[:, :, :full], w))
            assert torch.equal(store.read_values(w)[:, :, :full], bits.truncate(v_all[:, :, :full], w))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 300), seed=st.integers(0, 1000))
def test_value_widths_are_valid_for_any_length(n, seed):
    scores = torch.softmax(rand(1, 4, 1, n, seed=seed) * 4, -1)
    v_high = bits.split_planes(rand(1, 2, n, 4, seed=seed + 1).half())[0]
    w = value_widths(scores, v_high, T, topk=32)
    assume(n > 0)
    assert w.shape == (1, 2, n) and set(w.unique().tolist()) <= {8, 12, 16}


def test_reads_refuse_widths_outside_8_12_16():
    store = PlaneStore()
    store.append(rand(1, 1, 64, 8).half(), rand(1, 1, 64, 8).half())
    with pytest.raises(InvalidParameterError, match="widths 8, 12 or 16, got \\[10\\]"):
        store.read_keys(10)
    with pytest.raises(InvalidParameterError, match="got \\[8, 13\\]"):
        store.read_values(torch.tensor([[[8] * 63 + [13]]]))


def test_one_block_plus_equals_whole_column_rule():
    store = PlaneStore(block_exponents=True)
    store.append(rand(2, 3, BLOCK, 16, seed=1).half(), rand(2, 3, BLOCK, 16, seed=2).half())
    q = rand(2, 6, 1, 16, seed=3)
    blockwise = block_key_widths(q, store.k_absmax, store.k_exp, T)
    assert blockwise.shape == (2, 3, 1, 16)
    assert torch.equal(blockwise[:, :, 0], key_widths(q, store.k_absmax, T))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), blocks=st.integers(1, 5), spread=st.floats(0.0, 12.0))
def test_block_widths_never_exceed_column_widths_and_match_it_at_the_column_max(seed, blocks, spread):
    k = rand(1, 2, blocks * BLOCK, 8, seed=seed)
    k = k * torch.exp2(torch.linspace(-spread, 0, blocks * BLOCK)).view(1, 1, -1, 1)  # blocks differ in scale
    store = PlaneStore(block_exponents=True)
    store.append(k.half(), k.half())
    q = rand(1, 4, 1, 8, seed=seed + 1)
    column = key_widths(q, store.k_absmax, T)
    blockwise = block_key_widths(q, store.k_absmax, store.k_exp, T)
    assert (blockwise <= column[:, :, None, :]).all()
    block_max = k.half().abs().view(1, 2, blocks, BLOCK, 8).amax(3)
    at_column_max = bits.floor_log2(block_max) == bits.floor_log2(store.k_absmax)[:, :, None, :]
    normal = store.k_absmax.float()[:, :, None, :].expand_as(block_max) >= 2**-14
    same = at_column_max & normal
    assert torch.equal(blockwise[same], column[:, :, None, :].expand_as(blockwise)[same])


def test_block_exponents_round_trip():
    k = rand(1, 2, 3 * BLOCK, 8, seed=5).half()
    store = PlaneStore(block_exponents=True)
    store.append(k, k)
    block_max = k.abs().view(1, 2, 3, BLOCK, 8).amax(3)
    assert torch.equal(store.k_exp.to(torch.int32) - 15, bits.floor_log2(block_max.float()))
    assert torch.equal(block_exponent_field(store.k_a), store.k_exp)
    assert PlaneStore().k_exp is None  # plain AlignedKV stores no exponents


def test_accumulation_margin():
    assert accumulation_margin(1) == accumulation_margin(3) == 0.0
    assert accumulation_margin(12) == pytest.approx(1.0)  # sqrt(12/3) = 2 -> one binade
    assert accumulation_margin(64) == pytest.approx((6 - 1.5849625) / 2)
    assert all(accumulation_margin(n) <= accumulation_margin(n + 1) for n in range(1, 5000, 7))


def test_block_widths_read_each_block_at_its_own_width():
    k = rand(1, 2, 3 * BLOCK + 5, 16, seed=9).half()
    store = PlaneStore(block_exponents=True)
    store.append(k, k)
    widths = torch.randint(0, 3, (1, 2, 3, 16), generator=torch.Generator().manual_seed(1)).mul(4).add(8)
    per_token = widths.repeat_interleave(BLOCK, dim=2)  # [1, 2, 3·64, 16]
    expected = torch.cat([bits.truncate(k[:, :, : 3 * BLOCK], per_token), k[:, :, 3 * BLOCK :]], dim=2)
    assert torch.equal(store.read_keys(widths), expected)


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 200), block=st.integers(1, 70), offset=st.integers(0, 300), seed=st.integers(0, 2**16))
def test_block_widths_are_the_widest_of_each_block(n, block, offset, seed):
    """``v_block``: every token of a block (counted from ``offset`` tokens before the first) reads at
    the widest width any of its tokens needs; never narrower; a block of 1 changes nothing."""
    gen = torch.Generator().manual_seed(seed)
    widths = (8 + 4 * torch.randint(0, 3, (2, 3, n), generator=gen)).to(torch.int32)
    out = block_widths(widths, block, offset)
    assert out.shape == widths.shape and out.dtype == widths.dtype
    assert bool((out >= widths).all())
    blocks = (torch.arange(n) + offset) // block
    for b in blocks.unique().tolist():
        inside = blocks == b
        assert torch.equal(out[..., inside], widths[..., inside].amax(-1, keepdim=True).expand_as(out[..., inside]))
    if block == 1:
        assert torch.equal(out, widths)


def block_case(b: int, hq: int, hkv: int, n: int, d: int, q_len: int, v_block: int, seed: int, first: int = 0):
    """A plane store kept with ``v_block`` exponent bytes, masked probabilities over its tokens from
    ``first`` on, and both rules' value widths of those plane tokens (the paper's: per token)."""
    gen = torch.Generator().manual_seed(seed)
    spread = torch.exp(torch.randn(b, hkv, n, 1, generator=gen) * 2)  # tokens of very different sizes
    v = (torch.randn(b, hkv, n, d, generator=gen) * spread).half()
    v.view(-1)[torch.randint(0, v.numel(), (max(1, v.numel() // 50),), generator=gen)] = 0.0
    store = PlaneStore(value_block=v_block)
    store.append(v, v)
    logits = torch.randn(b, hq, q_len, n - first, generator=gen, dtype=torch.float64) * 4
    allowed = torch.rand(b, 1, q_len, n - first, generator=gen) > 0.2
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    paper = value_widths(probs, store.value_high_bytes()[:, :, first:], T, 32)[:, :, : store.n_full - first]

    def rows_at(idx):
        return store.high_bytes_at(idx + first)

    ours = block_value_widths(probs, store.v_exp, rows_at, T, 32, v_block, first)
    return store, paper, ours


@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 2),
    groups=st.integers(1, 3),
    hkv=st.integers(1, 2),
    n=st.integers(64, 300),
    q_len=st.integers(1, 3),
    v_block=st.sampled_from([2, 8, 16, 32, 64]),
    first=st.integers(0, 40),
    seed=st.integers(0, 2**16),
)
def test_block_rule_never_reads_fewer_bits_than_the_paper_rule(b, groups, hkv, n, q_len, v_block, first, seed):
    """Random values of very different sizes, exact zeros, GQA, chunks, masks, a sliding window's first
    visible token and the fp16 tail: each block reads one width, at least every token's own."""
    store, paper, ours = block_case(b, groups * hkv, hkv, n, 8, q_len, v_block, seed, first)
    assert ours.shape == paper.shape == (b, hkv, store.n_full - first)
    assert bool((ours >= paper).all())
    blocks = torch.nn.functional.pad(ours, (first, 0), value=-1).unflatten(-1, (-1, v_block))
    seen = blocks[..., -(-first // v_block) :, :]  # the blocks wholly in view
    assert bool((seen == seen[..., :1]).all())  # one width per block


def test_block_rule_exponent_bytes_are_the_blocks_largest_fields():
    store, _, _ = block_case(1, 2, 1, 200, 16, 1, 16, seed=3)
    fields = (store.v_a >> 2) & 0x1F
    assert store.v_exp.shape == (1, 1, 192 // 16, 16)
    assert torch.equal(store.v_exp, fields.unflatten(2, (-1, 16)).amax(3))
    store.drop_blocks(1)  # a sliding layer's oldest 64 tokens: their 4 exponent rows go too
    assert torch.equal(store.v_exp, fields[:, :, 64:].unflatten(2, (-1, 16)).amax(3))
    two, _, _ = block_case(2, 2, 1, 130, 8, 1, 32, seed=4)
    before = two.v_exp.clone()
    two.map_tensors(lambda t: t[[1, 0]])  # a beam reorder moves the exponent bytes with their rows
    assert torch.equal(two.v_exp, before[[1, 0]])
    with pytest.raises(InvalidParameterError, match="value_block 48 must divide"):
        PlaneStore(value_block=48).append(torch.zeros(1, 1, 1, 8).half(), torch.zeros(1, 1, 1, 8).half())


def test_v_exp_max_is_a_running_bound_on_every_blocks_exponent_bytes():
    """``v_exp_max`` (what lets the CPU kernel settle runs of blocks without their bytes) is each channel's
    largest exponent byte over the blocks stored, appended in pieces that fill blocks unevenly; after a
    sliding layer drops blocks it stays the running max, so still a bound; it moves with a beam reorder."""
    g = torch.Generator().manual_seed(5)
    k = torch.randn(2, 3, 300, 16, generator=g).half()
    v = (torch.randn(2, 3, 300, 16, generator=g) * torch.logspace(3, -3, 300).view(1, 1, 300, 1)).half()
    store = PlaneStore(value_block=8)
    assert store.v_exp_max is None
    for start, stop in ((0, 70), (70, 71), (71, 200), (200, 300)):
        store.append(k[:, :, start:stop], v[:, :, start:stop])
        if store.v_exp is not None:
            assert torch.equal(store.v_exp_max, store.v_exp.amax(2))
    assert store.v_exp.shape[2] == 256 // 8
    full = store.v_exp_max.clone()
    store.drop_blocks(2)
    assert torch.equal(store.v_exp_max, full) and bool((store.v_exp_max >= store.v_exp.amax(2)).all())
    assert not torch.equal(store.v_exp_max, store.v_exp.amax(2))  # the largest values were in the dropped blocks
    store.map_tensors(lambda t: t[[1, 0]])
    assert torch.equal(store.v_exp_max, full[[1, 0]])
    assert PlaneStore().v_exp_max is None
    paper = PlaneStore()  # the paper's rule keeps no v_exp, but its fields have the same bound
    paper.append(k, v)
    assert torch.equal(paper.v_exp_max, ((paper.v_a >> 2) & 0x1F).amax(2))


def test_block_rule_on_real_values_reads_fewer_bits_than_16_and_no_fewer_than_the_paper(stories):
    """stories260K's values after a 300-token prompt: the block rule stays between the paper's widths and 16."""
    from kvquant.analysis.capture import capture_kv

    model, tok = stories
    text = "Once upon a time there was a little girl named Lily. She liked to play in the park with her dog. " * 6
    ids = tok(text, return_tensors="pt").input_ids[0][:300]
    for k, v in capture_kv(model, ids):
        store = PlaneStore(value_block=32)
        store.append(k.half(), v.half())
        q = k[:, :, -1:].repeat_interleave(2, dim=1).float()  # 8 query heads on 4 KV heads
        probs = scores(q, k.half(), None, 8**-0.5, None, torch.float64)
        paper = value_widths(probs, store.value_high_bytes(), T, 32)[:, :, : store.n_full]
        ours = block_value_widths(probs, store.v_exp, store.high_bytes_at, T, 32, 32)
        assert bool((ours >= paper).all()) and float(ours.double().mean()) < 16
