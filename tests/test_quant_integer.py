import math

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from kvquant.quant.integer import BITS, cat, dequantize, drop_leading, levels, pack, quantize, unpack

pytestmark = pytest.mark.usefixtures("one_thread")


def per_element(q, t):
    """Broadcast a per-group tensor (scale or zero) to the logical shape of ``q``."""
    padded = q.padded_shape
    grouped = (*padded[: q.axis], padded[q.axis] // q.group_size, q.group_size, *padded[q.axis + 1 :])
    return t.float().expand(grouped).reshape(padded).narrow(q.axis, 0, q.shape[q.axis])


@settings(max_examples=150, deadline=None)
@given(
    bits=st.sampled_from(BITS),
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    data=st.data(),
    group_size=st.integers(1, 12),
    offset=st.floats(-1e3, 1e3),
    spread=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**16),
)
def test_round_trip_within_half_a_step(bits, shape, data, group_size, offset, spread, seed):
    axis = data.draw(st.integers(0, len(shape) - 1))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * spread + offset
    q = quantize(x, bits, axis, group_size)
    y = dequantize(q)
    assert y.shape == x.shape and torch.isfinite(y).all()
    step = per_element(q, q.scale)
    # Half a stored step, plus fp32 rounding of the arithmetic itself.
    slack = 4 * torch.finfo(torch.float32).eps * (x.abs() + per_element(q, q.zero).abs() + levels(bits) * step)
    assert ((y - x).abs() <= step / 2 + slack).all()


@settings(max_examples=60, deadline=None)
@example(bits=4, n=2, lo=64.0, width=0.01)  # a step one fp32 ulp below the ideal (found by CI)
@given(bits=st.sampled_from(BITS), n=st.integers(2, 200), lo=st.floats(-100, 100), width=st.floats(1e-2, 100))
def test_stored_step_is_the_ideal_step_up_to_fp16_rounding(bits, n, lo, width):
    x = torch.linspace(lo, lo + width, n)
    assume(float(x.max() - x.min()) > 0)
    q = quantize(x, bits, 0, n)
    ideal = float(x.max() - x.min()) / levels(bits)
    # zero is rounded down by at most one fp16 ulp of min, scale up by one fp16 ulp of itself
    ulp_min = 2.0 ** (math.frexp(max(abs(float(x.min())), 2.0**-14))[1] - 11)
    # coverage is checked in fp32 arithmetic (zero + steps·scale ≥ max), so the step may sit below the
    # real-number ideal by what one fp32 ulp of the largest magnitude hides, spread over the steps
    ulp32_max = 2.0 ** (math.frexp(float(x.abs().max()))[1] - 24)
    low = ideal * (1 - 2.0**-12) - ulp32_max / levels(bits)
    assert low <= float(q.scale) <= (ideal + ulp_min / levels(bits)) * (1 + 2.0**-9) + 2.0**-24


@settings(max_examples=100, deadline=None)
@given(
    bits=st.sampled_from(BITS),
    lead=st.lists(st.integers(1, 4), max_size=2),
    n=st.integers(1, 40),
    seed=st.integers(0, 999),
)
def test_packing_is_lossless_and_dense(bits, lead, n, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (*lead, n), generator=gen, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (*lead, math.ceil(n * bits / 8))
    assert torch.equal(unpack(packed, bits, n), codes)


def test_codes_are_packed_four_or_two_per_byte():
    x = torch.randn(2, 3, 64, 64)
    for bits, per_byte in ((2, 4), (4, 2), (8, 1)):
        for axis in (2, 3):
            q = quantize(x, bits, axis, 32)
            assert q.codes.dtype == torch.uint8 and q.codes.shape == (2, 3, 64, 64 // per_byte)
            assert q.scale.dtype == q.zero.dtype == torch.float16
            assert q.scale.numel() == q.zero.numel() == x.numel() // 32
            assert 8 * q.nbytes / x.numel() == bits + 32 / 32


@pytest.mark.parametrize("bits", BITS)
def test_the_grid_has_two_to_the_b_points_and_two_to_the_b_minus_one_steps(bits):
    x = torch.arange(float(1 << bits)) * 0.5 - 3.0  # exactly the grid points, step 0.5
    q = quantize(x, bits, 0, x.numel())
    assert float(q.scale) == 0.5 and float(q.zero) == -3.0
    assert torch.equal(unpack(q.codes, bits, x.numel()), torch.arange(1 << bits, dtype=torch.uint8))
    assert torch.equal(dequantize(q), x)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("value", [0.0, 1.5, -7.25, 1000.5, -6e4, 0.1, 1000.3])
def test_constant_groups_are_exact_never_nan(bits, value):
    x = torch.full((2, 5, 16), value)
    x[1] = torch.randn(5, 16)  # other groups vary; the constant ones must not care
    for axis in (1, 2):  # groups inside the constant half
        q = quantize(x, bits, axis, 4)
        y = dequantize(q)
        assert torch.isfinite(y).all()
        if float(torch.tensor(value).half()) == value:  # an fp16 number, as the caches feed: exact
            assert torch.equal(y[0], x[0]) and (q.scale[0] == 0).all()
        else:  # fp16 cannot hold it: a tiny step, within half of it
            scale = per_element(q, q.scale)[0]
            assert (scale <= abs(value) * 2.0**-10).all() and ((y[0] - x[0]).abs() <= scale / 2 + 1e-6).all()


@pytest.mark.parametrize("bits", BITS)
def test_single_token_groups_and_single_token_tails(bits):
    x = torch.randn(3, 7, 8) * 10
    x = x.half().float()  # fp16 numbers, as the caches feed
    # group of one element: each is a constant group
    assert torch.equal(dequantize(quantize(x, bits, 1, 1)), x)
    # one token along the grouped axis (padded to a whole group by repetition)
    one = x[:, :1]
    q = quantize(one, bits, 1, 32)
    assert q.scale.shape == (3, 1, 1, 8) and torch.equal(dequantize(q), one)
    # 7 tokens in groups of 3: the last group holds a single token and is exact
    q = quantize(x, bits, 1, 3)
    assert torch.equal(dequantize(q)[:, 6], x[:, 6])


def test_masked_elements_leave_the_group_range():
    x = torch.randn(4, 64)
    x[2, 10] = 1e3
    mask = torch.zeros_like(x, dtype=torch.bool)
    mask[2, 10] = True
    plain = quantize(x, 2, 1, 64)
    masked = quantize(x, 2, 1, 64, mask=mask)
    assert float(masked.scale[2].max()) < float(plain.scale[2].max()) / 50
    keep = ~mask
    assert ((dequantize(masked) - x).abs()[keep] <= per_element(masked, masked.scale)[keep] / 2 + 1e-5).all()
    fully = quantize(x, 4, 1, 64, mask=torch.ones_like(mask))
    assert torch.isfinite(dequantize(fully)).all()


def test_cat_along_tokens_equals_quantizing_the_concatenation():
    x = torch.randn(1, 2, 96, 16)
    for axis in (2, 3):
        parts = [quantize(x[:, :, :64], 2, axis, 32), quantize(x[:, :, 64:], 2, axis, 32)]
        whole = quantize(x, 2, axis, 32)
        joined = cat(parts, dim=2)
        for a, b in zip(joined.tensors(), whole.tensors(), strict=True):
            assert torch.equal(a, b)
        assert joined.shape == whole.shape
    with pytest.raises(ValueError, match="whole groups"):
        cat([quantize(x[:, :, :40], 2, 2, 32), quantize(x[:, :, 40:], 2, 2, 32)], dim=2)


def test_dequantize_into_a_strided_view():
    x = torch.randn(2, 3, 64, 16)
    q = quantize(x, 4, 2, 32)
    out = torch.full((2, 3, 80, 16), float("nan"))
    dequantize(q, out=out[:, :, :64])
    assert torch.equal(out[:, :, :64], dequantize(q)) and torch.isnan(out[:, :, 64:]).all()
    assert dequantize(q, torch.float16).dtype == torch.float16


def test_bad_input():
    with pytest.raises(ValueError, match="bits must be one of"):
        quantize(torch.randn(8), 3, 0, 4)
    with pytest.raises(ValueError, match="fp16 range"):
        quantize(torch.tensor([0.0, 1e6]), 2, 0, 2)
    quantize(torch.tensor([0.0, 1e6]), 2, 0, 2, checked=True)  # the caller vouches: no check, no host sync


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_values_in_fp16_range_always_get_finite_scales(bits):
    """Why ``checked`` may skip the check: any group within fp16's range (the extremes, a full-range group,
    the smallest subnormals) gets a finite fp16 scale and zero."""
    x = torch.tensor([[-65504.0, 65504.0], [65504.0, 65504.0], [-65504.0, -65504.0], [-6e-8, 6e-8], [0.0, -0.0]])
    q = quantize(x, bits, 1, 2, checked=True)
    assert bool(torch.isfinite(q.scale.float()).all() and torch.isfinite(q.zero.float()).all())
    assert torch.equal(q.scale, quantize(x, bits, 1, 2).scale)


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from(BITS),
    per_channel=st.booleans(),
    groups=st.integers(1, 5),
    drop_groups=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_dropping_leading_tokens_keeps_the_rest_bit_for_bit(bits, per_channel, groups, drop_groups, seed):
    """Keys (grouped along tokens) lose whole groups, values (grouped along channels) any tokens; what
    stays dequantizes exactly as before and owns its storage."""
    g, d = 4, 8
    x = torch.randn(2, 3, groups * g, d, generator=torch.Generator().manual_seed(seed))
    axis = 2 if per_channel else 3
    q = quantize(x, bits, axis, g)
    n = min(drop_groups, groups) * (g if per_channel else 3)
    n = min(n, x.shape[2])
    kept = drop_leading(q, 2, n)
    assert kept.shape == (2, 3, x.shape[2] - n, d)
    assert torch.equal(dequantize(kept), dequantize(q)[:, :, n:])
    for t in kept.tensors():
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_dropping_part_of_a_group_is_refused():
    q = quantize(torch.randn(1, 1, 8, 4), 2, 2, 4)
    with pytest.raises(ValueError, match="whole groups"):
        drop_leading(q, 2, 3)


def test_coding_one_value_token_dispatches_28_torch_operators():
    """A KIVI decode step codes the value leaving its fp16 window: on a GPU each operator is a launch, so the
    count is held (37 before ``aminmax``, the cached constants and the multiply-sum packing; the same codes)."""
    from kvquant.analysis.timing import OpCounter

    x = torch.randn(1, 3, 1, 64).half()
    with OpCounter() as counter:
        quantize(x, 2, -1, 32, checked=True)
    assert counter.total == 28, counter.counts
