"""Bit-level properties of the fp16 planes, checked on all 65,536 patterns."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvquant import bits
from kvquant.errors import InvalidParameterError

ALL = torch.arange(65536, dtype=torch.int32)  # every fp16 bit pattern
ALL_FP16 = bits.bits_to_fp16(ALL)
EXPONENT = (ALL >> 10) & 0x1F
MANTISSA = ALL & 0x3FF
IS_NAN = (EXPONENT == 31) & (MANTISSA != 0)
IS_INF = (EXPONENT == 31) & (MANTISSA == 0)
IS_ZERO = (ALL & 0x7FFF) == 0


def test_bits_round_trip_every_pattern():
    assert torch.equal(bits.fp16_bits(ALL_FP16), ALL)


def test_split_join_is_identity_on_every_pattern():
    x = ALL_FP16.view(256, 256)
    a, b, c = bits.split_planes(x)
    assert a.dtype == b.dtype == c.dtype == torch.uint8
    assert a.shape == (256, 256) and b.shape == c.shape == (256, 128)
    assert torch.equal(bits.fp16_bits(bits.join_planes(a, b, c)).flatten(), ALL)
    assert torch.equal(a.flatten().to(torch.int32), ALL >> 8)


@pytest.mark.parametrize("keep", range(6, 17))
def test_truncate_keeps_top_bits_and_fills_every_pattern(keep):
    out = bits.fp16_bits(bits.truncate(ALL_FP16, keep))
    drop = 16 - keep
    top = (0xFFFF << drop) & 0xFFFF
    assert torch.equal(out & top, ALL & top), "kept bits changed"
    assert torch.equal(out >> 10, ALL >> 10), "sign or exponent changed"
    low = out & ~top & 0xFFFF
    fill = (1 << (drop - 1)) if drop else 0
    kept_is_zero = ((ALL & top) & 0x7FFF) == 0
    plain = ~IS_NAN & ~IS_INF & ~kept_is_zero
    assert (low[plain] == fill).all(), "fill is not 1000…"
    assert (low[kept_is_zero & ~IS_NAN] == 0).all(), "a read of ±0 must stay ±0"
    special = IS_ZERO | IS_INF | IS_NAN
    assert torch.equal(out[special], ALL[special]), "±0, ±inf or NaN altered"


def test_truncate_keep16_is_identity_and_midpoint_fill_halves_the_error():
    assert torch.equal(bits.fp16_bits(bits.truncate(ALL_FP16, 16)), ALL)
    finite = ~(IS_NAN | IS_INF)
    x = ALL_FP16[finite].float()
    for keep in (8, 12, 13):
        err = (bits.truncate(ALL_FP16[finite], keep).float() - x).abs()
        # width of the interval the kept bits leave open (subnormals share the -14 scale)
        interval = torch.ldexp(torch.ones_like(x), (bits.floor_log2(x).clamp_min(-14) - (keep - 6)))
        kept_zero = (ALL[finite] & ((0xFFFF << (16 - keep)) & 0x7FFF)) == 0
        assert (err[~kept_zero] <= interval[~kept_zero] / 2).all()
        assert (err[kept_zero] < interval[kept_zero]).all()  # read as ±0: below the kept precision


def test_per_element_widths_equal_scalar_truncation():
    widths = torch.tensor([8, 12, 16]).repeat_interleave(4)
    x = torch.randn(12).half()
    expected = torch.cat([bits.truncate(x[i : i + 4], w) for i, w in zip(range(0, 12, 4), (8, 12, 16), strict=True)])
    assert torch.equal(bits.truncate(x, widths), expected)


def test_read_planes_equals_truncation():
    x = ALL_FP16[~IS_NAN][: 64 * 990].view(990, 64)
    a, b, c = bits.split_planes(x)
    for w in bits.PLANE_WIDTHS:
        assert torch.equal(bits.read_planes(a, b, c, w), bits.truncate(x, w))


def test_high_byte_exponent_matches_floor_log2_for_normals():
    normal = (EXPONENT > 0) & (EXPONENT < 31)
    a = (ALL >> 8).to(torch.uint8)
    assert torch.equal(bits.high_byte_exponent(a)[normal], bits.floor_log2(ALL_FP16[normal].float()))
    assert (bits.high_byte_exponent(a)[IS_ZERO] == bits.ZERO_EXPONENT).all()
    sub = (EXPONENT == 0) & ~IS_ZERO & ((ALL & 0x7F00) != 0)
    assert (bits.high_byte_exponent(a)[sub] >= bits.floor_log2(ALL_FP16[sub].float())).all()


def test_floor_log2():
    x = torch.tensor([1.0, 1.5, 2.0, 0.75, -8.0, 0.0, 3e-8])
    assert bits.floor_log2(x).tolist() == [0, 0, 1, -1, 3, bits.ZERO_EXPONENT, -25]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 15), min_size=2, max_size=64).filter(lambda v: len(v) % 2 == 0))
def test_nibble_packing_is_lossless(values):
    n = torch.tensor(values, dtype=torch.uint8)
    packed = bits.pack_nibbles(n)
    assert packed.numel() == n.numel() // 2
    assert torch.equal(bits.unpack_nibbles(packed), n)


def test_bad_widths_and_odd_dims_are_refused():
    with pytest.raises(InvalidParameterError, match="keep_bits must lie in 6..16"):
        bits.truncate(torch.ones(2), 5)
    with pytest.raises(InvalidParameterError, match="6..16"):
        bits.truncate(torch.ones(2), torch.tensor([8, 17]))
    with pytest.raises(InvalidParameterError, match="even"):
        bits.pack_nibbles(torch.zeros(3, dtype=torch.uint8))


def test_bits_imports_with_torch_only():
    import subprocess
    import sys

    code = (
        "import sys; import kvquant.bits; "
        "bad = [m for m in ('transformers', 'hydra', 'wandb', 'lm_eval') if m in sys.modules]; "
        "assert not bad, bad"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
