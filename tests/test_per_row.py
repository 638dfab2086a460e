"""Batched evaluation equals unbatched, for every registered method (``kvquant/per_row.py``).

Requests of different lengths (prompts past KIVI's fp16 window, so every method compresses) run
once alone and once in one batch. Per unit: bits stored equal exactly, bits read within 0.5%
(AlignedKV's widths follow float values), log-likelihoods within 1e-3 nats per token, greedy tokens
identical or parting first at a near-tie of the unbatched run. Per token, not per continuation: the
batch's projections sum in another order (BLAS picks kernels by shape), and a K element that sits on
a truncation or quantization boundary then rounds the other way.
"""

import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from kvquant import get_method, method_names
from kvquant.data import tinystories_pieces
from kvquant.eval.engine import Engine, Generation
from kvquant.eval.fidelity import NEAR_TIE
from kvquant.per_row import PerRowCache, row_mask
from tests.conftest import require_kernels_cpu
from tests.golden import NEEDS_PREDICTORS, method_params

pytestmark = pytest.mark.numerics
_PREDICTORS = Path(tempfile.mkdtemp(prefix="kvquant-per-row-predictors-"))


@pytest.fixture(autouse=True, scope="module")
def remove_predictors():
    yield
    shutil.rmtree(_PREDICTORS, ignore_errors=True)


def method_on_stories(name: str, model, tok):
    params = method_params("stories260k", name)
    if name in NEEDS_PREDICTORS:
        path = _PREDICTORS / f"{name}.safetensors"
        if not path.is_file():
            get_method(name).calibrate(model, tok, n_seqs=1, seq_len=64, progress=False, log=None).save(path)
        params["predictors"] = str(path)
    return get_method(name, **params)


def text_ids(tok, i: int, n: int) -> list[int]:
    ids = tok(" ".join(tinystories_pieces()[10 * i : 10 * i + 8])).input_ids[:n]
    assert len(ids) == n
    return ids


def run(model, tok, method, batch_size: int):
    engine = Engine(model, tok, method, chunk_size=48, batch_size=batch_size)
    gens = [
        Generation("g/0", text_ids(tok, 0, 131), 12),
        Generation("g/1", text_ids(tok, 1, 176), 8),
        Generation("g/2", text_ids(tok, 2, 150), 10, stops=("zzz",), chunked_prefill=True),
    ]
    texts = engine.generate_many(gens)
    lls = engine.loglikelihood_many(
        [
            ("l/0", text_ids(tok, 4, 140), [text_ids(tok, 5, 9)[1:], text_ids(tok, 6, 5)[1:]]),
            ("l/1", text_ids(tok, 7, 171), [text_ids(tok, 8, 12)[1:]]),
        ]
    )
    scores = engine.score_many([("s/0", text_ids(tok, 9, 140)), ("s/1", text_ids(tok, 10, 170))])
    return engine, texts, lls, scores


KERNELS = ["fp16@cpu", "kivi2@cpu", "gear2@cpu", "alignedkv@cpu", "truncation@cpu", "higgs@cpu"]


@pytest.mark.parametrize("name", method_names() + KERNELS)
def test_a_batch_equals_each_row_alone(stories, name):
    model, tok = stories
    name, _, backend = name.partition("@")
    method = method_on_stories(name, model, tok)
    if backend:  # the C++ kernels read each row's store behind the batch's attention
        require_kernels_cpu()
        method = method.with_params(backend=backend)
    attention = model.config._attn_implementation
    alone, _, lls1, scores1 = run(model, tok, method, 1)
    batched, _, lls4, scores4 = run(model, tok, method, 3)
    assert batched.n_caches == alone.n_caches
    for key, ref in alone.recording.units.items():
        got = batched.recording.units[key]
        if ref.generated:
            n = min(len(ref.tokens), len(got.tokens))
            differ = (ref.tokens[:n] != got.tokens[:n]).nonzero()
            if differ.numel():  # the runs may part only where the unbatched run's top two nearly tie
                at = int(differ[0])
                assert float(ref.top_lp[at, 0] - ref.top_lp[at, 1]) < NEAR_TIE, (key, at)
                continue
            assert torch.equal(ref.tokens, got.tokens), key
        one, many = alone.unit_counts[key], batched.unit_counts[key]
        assert (many.bytes_k, many.bytes_v, many.elements_k, many.elements_v) == (
            one.bytes_k,
            one.bytes_v,
            one.elements_k,
            one.elements_v,
        ), key
        assert many.summary()["bits_read"] == pytest.approx(one.summary()["bits_read"], rel=5e-3), key
    for a, b, n in zip(lls1, lls4, [[8, 4], [11]], strict=True):  # per token: a K element on a
        for (ll1, _), (ll4, _), m in zip(a, b, n, strict=True):  # rounding boundary may round apart
            assert ll4 == pytest.approx(ll1, abs=1e-3 * m)
    for (s1, t1), (s4, t4) in zip(scores1, scores4, strict=True):
        assert t1 == t4 and s4 == pytest.approx(s1, abs=1e-3 * t1)
    assert model.config._attn_implementation == attention  # the engine puts the model's attention back


def test_rows_sit_out_forwards_and_keep_their_own_columns(stories):
    model, tok = stories
    method = get_method("fp16")
    cache = PerRowCache([method.new_cache(model) for _ in range(2)], model)
    cache.set_chunk(torch.tensor([[False, True, True], [True, True, True]]))
    cache.set_chunk(torch.tensor([[False, False], [True, True]]))
    cache.set_chunk(torch.tensor([[True], [True]]))
    assert cache.lengths == [3, 6] and cache.columns[0].tolist() == [1, 2, 5]
    with pytest.raises(Exception, match="contiguous"):
        cache.set_chunk(torch.tensor([[True, False, True], [True, True, True]]))


def test_row_mask_is_dropped_only_where_an_unbatched_forward_drops_it():
    cols = torch.arange(4)
    square = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    assert row_mask(square, 0, 0, 4, cols) is None
    chunk = torch.ones(1, 1, 2, 4, dtype=torch.bool).tril(2)  # two new tokens after two held ones
    assert torch.equal(row_mask(chunk, 0, 0, 2, cols), chunk)
    padded = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    padded[1, ..., :2] = False
    assert row_mask(padded, 1, 0, 1, torch.arange(2, 6)) is None
    assert row_mask(padded, 1, 0, 1, torch.arange(1, 5)) is not None
