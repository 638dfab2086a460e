"""HIGGS: storage it promises, error close to the grid's, and the cases that need padding or care."""

import math

import pytest
import torch

from kvquant.errors import InvalidParameterError
from kvquant.quant.grids import PRESETS, gaussian_samples, grid_mse, load_grid
from kvquant.quant.higgs import Higgs, cat_rows


def rel_mse(x, y):
    return float((x - y).pow(2).sum() / x.pow(2).sum())


@pytest.mark.parametrize("channels,group", [(1024, 1024), (2048, 1024), (192, 1024), (64, 1024), (256, 128)])
@pytest.mark.parametrize("bits", sorted(PRESETS))
def test_bits_per_value_is_code_bits_plus_fp16_scale_per_group(bits, channels, group):
    q = Higgs(channels, bits, group)
    d, n = PRESETS[bits]
    g = min(group, channels)
    assert not q.padded and q.padding_note() is None
    assert q.bits_per_value() == pytest.approx(math.log2(n) / d + 16 / g)
    t = q.quantize(torch.randn(2, 7, channels))
    assert t.codes.dtype == torch.uint8 and t.scales.dtype == torch.float16
    assert 8 * (t.codes[0, 0].numel() + 2 * t.scales[0, 0].numel()) == pytest.approx(q.bits_per_value() * channels)


@pytest.mark.parametrize("bits", sorted(PRESETS))
def test_error_on_rotated_heavy_tailed_rows_is_the_grids_gaussian_error(bits):
    d, n = PRESETS[bits]
    x = torch.randn(2000, 192, generator=torch.Generator().manual_seed(0))
    x[:, 5] *= 30.0  # an outlier channel, as keys have: the Hadamard rotation spreads it
    x += 4.0  # and an offset
    q = Higgs(192, bits)
    err = rel_mse(x, q.roundtrip(x))
    expected = grid_mse(gaussian_samples(1 << 15, d, seed=3), load_grid(d, n))
    assert err == pytest.approx(expected, rel=0.15)


def test_zero_rows_stay_zero_and_rows_concatenate():
    q = Higgs(64, 2)
    x = torch.randn(3, 64)
    x[1] = 0
    a, b = q.quantize(x[:2]), q.quantize(x[2:])
    both = cat_rows([a, b], dim=0)
    y = q.dequantize(both)
    assert torch.isfinite(y).all() and torch.equal(y[1], torch.zeros(64))
    assert torch.equal(y, q.dequantize(q.quantize(x)))


def test_group_without_a_hadamard_transform_is_padded_and_said():
    q = Higgs(10, 2)
    assert q.padded and q.padded_group == 12
    assert "zero-padded to 12" in q.padding_note()
    x = torch.randn(50, 10)
    y = q.roundtrip(x)
    assert y.shape == x.shape and rel_mse(x, y) < 0.2
    assert q.bits_per_value() == pytest.approx((8 * 3 + 16) / 10)  # 6 codes of 4 bits + one scale, over 10


def test_bad_parameters_refused():
    with pytest.raises(InvalidParameterError, match="bits must be one of 2, 3, 4"):
        Higgs(64, 5)
    with pytest.raises(ValueError, match="expected 64 channels"):
        Higgs(64, 2).quantize(torch.zeros(1, 32))


def test_a_decode_steps_coding_is_27_operators_and_pads_only_what_it_must():
    """A cache codes each new token with ``quantize`` every layer and step, and on a GPU each torch operator is a
    launch: an unpadded group dispatches no pad (no copy of nothing) and a one-block nearest-point search no buffer
    to copy into — 27 operators where there were 31 — with the codes a padded group gets as before."""
    from kvquant.analysis.timing import OpCounter

    x, y = torch.randn(1, 3, 1, 192), torch.randn(1, 3, 1, 200)
    plain, padded = Higgs(192, 2), Higgs(200, 2, group=100)  # 192 has a transform; 100 pads to 104
    plain.quantize(x), padded.quantize(y)  # the first codings place the tables
    with OpCounter() as counted:
        codes = plain.quantize(x)
    assert counted.total == 27 and "constant_pad_nd" not in counted.counts and "empty" not in counted.counts
    assert torch.equal(plain.dequantize(codes), plain.roundtrip(x))
    with OpCounter() as decoding:  # what a cache that decodes nothing it reads no longer pays twice a layer and step
        plain.dequantize(codes)
    assert decoding.total == 13
    with OpCounter() as padding:
        padded.quantize(y)
    assert padding.counts["constant_pad_nd"] == 1  # 100 → 104 within each group; 2 × 100 channels fill the groups
