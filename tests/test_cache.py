import math

import torch

from kvquant.cache import CacheCounts, KVCache, nbytes
from kvquant.methods.fp16 import Fp16Layer


def test_counts_add_fieldwise_and_summarise_per_element():
    a = CacheCounts(elements_k=10, elements_v=10, bytes_k=5, bytes_v=20, read_elements_k=10, read_bits_k=40)
    b = CacheCounts(elements_k=30, elements_v=30, bytes_k=15, bytes_v=60, read_elements_v=40, read_bits_v=640)
    s = (a + b).summary()
    assert s["bits_stored_k"] == 8 * 20 / 40 == 4.0
    assert s["bits_stored_v"] == 8 * 80 / 40 == 16.0
    assert s["bits_stored"] == 10.0
    assert s["bits_read_k"] == 4.0 and s["bits_read_v"] == 16.0
    assert s["bits_read"] == (40 + 640) / 50
    assert s["bytes"] == 100 and s["bytes_fp16"] == 160


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
