"""Dense b-bit packing: exact round trips, the byte counts it promises, a hand-checked layout."""

import pytest
import torch

from kvquant.quant.bitpack import pack, packed_size, unpack


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [1, 5, 8, 96, 97])
def test_round_trip_and_size(bits, n):
    codes = torch.randint(0, 1 << bits, (3, 2, n), generator=torch.Generator().manual_seed(bits * 100 + n))
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 2, packed_size(n, bits))
    assert packed_size(n, bits) * 8 < n * bits + 64  # dense: less than one word of slack
    assert torch.equal(unpack(packed, bits, n), codes)


def test_six_bit_layout_low_bits_first():
    # word = 1 | 2<<6 | 3<<12 | 4<<18 = 1060993 = 0x103081, stored little-endian in 3 bytes
    assert pack(torch.tensor([1, 2, 3, 4]), 6).tolist() == [0x81, 0x30, 0x10]
    assert packed_size(96, 6) == 72 and packed_size(96, 4) == 48 and packed_size(96, 8) == 96


def test_bits_out_of_range_refused():
    for bits in (0, 9):
        with pytest.raises(ValueError, match="bits"):
            pack(torch.zeros(4, dtype=torch.int64), bits)
