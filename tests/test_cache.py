import math

import torch

from kvquant.cache import CacheCounts, KVCache, nbytes
from kvquant.methods.fp16 import Fp16Layer


def test_counts_add_fieldwise_and_summarise_per_element():
    a = CacheCounts(elements_k=10, elements_v=10, bytes_k=5, bytes_v=20)
    a.add_read({8: 6, 16: 4}, {}, position=3)
    b = CacheCounts(elements_k=30, elements_v=30, bytes_k=15, bytes_v=60)
    b.add_read({}, {16: 40}, position=3)
    b.add_read({12: 10}, {12: 10}, position=4)
    s = (a + b).summary()
    assert s["bits_stored_k"] == 8 * 20 / 40 == 4.0
    assert s["bits_stored_v"] == 8 * 80 / 40 == 16.0
    assert s["bits_stored"] == 10.0
    assert s["bits_read_k"] == (48 + 64 + 120) / 20
    assert s["bits_read_v"] == (640 + 120) / 50
    assert s["bits_read"] == (48 + 64 + 120 + 640 + 120) / 70
    assert s["widths_k"] == {8: 0.3, 12: 0.5, 16: 0.2} and s["widths_v"] == {12: 0.2, 16: 0.8}
    assert s["bytes"] == 100 and s["bytes_fp16"] == 160
    series = (a + b).position_series()
    assert series["position"] == [3, 4]
    assert series["bits_read_k"] == [112 / 10, 12.0] and series["bits_read_v"] == [16.0, 12.0]
    assert a.summary()["bits_read_k"] == 11.2  # adding did not mutate the operands


def test_empty_counts_give_nan_not_zero():
    s = CacheCounts().summary()
    assert math.isnan(s["bits_stored"]) and math.isnan(s["bits_read"]) and s["bytes"] == 0


def test_nbytes_counts_real_element_sizes():
    assert nbytes([torch.zeros(3, dtype=torch.uint8), torch.zeros(2, dtype=torch.float16), None]) == 3 + 4


def test_kvcache_sums_layers_and_reports_length():
    cache = KVCache([Fp16Layer(), Fp16Layer()])
    for i in range(2):
        cache.update(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4), layer_idx=i)
    assert cache.get_seq_length() == 5
    stats = cache.stats()
    assert stats["elements"] == 2 * 2 * (2 * 5 * 4) and stats["bytes"] == 2 * stats["elements"]
    cache.layers[0].reset()
    assert cache.layers[0].counts() == CacheCounts()


def test_metadata_bits_count_towards_bits_read():
    c = CacheCounts()
    c.add_read({8: 64}, {16: 64}, position=64, meta_k=64.0)
    s = c.summary()
    assert s["bits_read_k"] == 9.0 and s["bits_read_v"] == 16.0 and s["bits_read"] == 12.5
    assert c.position_series()["bits_read_k"] == [9.0]
    assert (c + c).meta_bits_k == 128.0
