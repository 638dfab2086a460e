import pytest
import torch

from kvquant import get_method
from kvquant.analysis.relerr import BUCKETS, decode_step_inputs, relative_error_buckets, relative_error_table
from kvquant.data import tinystories_pieces


def test_buckets_by_hand():
    full = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    read = torch.tensor([1.0, 1.00005, 1.0005, 1.005, 1.5, 0.0, 1e-9])
    shares = relative_error_buckets(full, read)
    assert list(shares) == list(BUCKETS)
    assert shares == pytest.approx(
        {"=0": 2 / 7, "(0,1e-4]": 1 / 7, "(1e-4,1e-3]": 1 / 7, "(1e-3,1e-2]": 1 / 7, ">1e-2": 2 / 7}
    )


def test_table_orders_methods_as_the_paper_does(stories):
    model, tok = stories
    ids = tok(" ".join(tinystories_pieces()[3:6]), return_tensors="pt").input_ids[0, :200]
    inputs = decode_step_inputs(model, ids)
    assert len(inputs) == model.config.num_hidden_layers and inputs[0][0].shape == (1, 8, 1, 8)
    table = relative_error_table(
        model,
        ids,
        {m: get_method(m, **kw) for m, kw in [("fp16", {}), ("alignedkv", {}), ("truncation", {"keep_bits": 13})]},
    )
    assert table["fp16"]["qk"]["=0"] == 1.0 and table["fp16"]["sv"]["=0"] == 1.0
    for kind in ("qk", "sv"):
        assert sum(table["alignedkv"][kind].values()) == pytest.approx(1.0)
        # AlignedKV leaves more results exact than removing 3 bits everywhere
        assert table["alignedkv"][kind]["=0"] > table["truncation"][kind]["=0"]
