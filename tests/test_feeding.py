"""Feeding rows of caches: the chunk schedule, batch order, and the batched path equal to rows fed alone."""

import pytest
import torch

from kvquant import get_method
from kvquant.data import tinystories_pieces
from kvquant.eval.feeding import Feeder, batches, chunks_of, schedule


def test_chunks_are_cut_as_an_unbatched_feed_cuts_them():
    assert chunks_of(range(7), 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert chunks_of([], 3) == []


def test_rows_start_together_or_end_together():
    chunked = [chunks_of(range(5), 2), chunks_of(range(2), 2)]  # three chunks, one chunk
    assert schedule(chunked, align_end=False) == [[[0, 1], [0, 1]], [[2, 3], []], [[4], []]]
    assert schedule(chunked, align_end=True) == [[[0, 1], []], [[2, 3], []], [[4], [0, 1]]]


def test_batches_run_longest_first_in_batches_of_size():
    lengths = [3, 9, 1, 7, 5]
    assert list(batches(lengths, 2, lambda n: n)) == [[1, 3], [4, 0], [2]]


@pytest.mark.parametrize("align_end", [False, True])
def test_the_batched_path_gives_each_row_the_logits_it_gets_alone(stories, align_end):
    """On a GPU rows are fed in shared, left-padded forwards; on a CPU each alone. Both give each row
    its own logits and each row's cache holds exactly its own tokens. Within 2e-3: the batch's
    projections sum in another order (BLAS picks kernels by shape), and a K/V element on an fp16
    rounding boundary then rounds the other way (``tests/test_per_row.py`` says the same per method)."""
    model, tok = stories
    seqs = [tok(tinystories_pieces()[i]).input_ids[:n] for i, n in ((0, 45), (1, 20), (2, 33))]
    out = {}
    for batched in (False, True):
        feeder = Feeder(model, tok, chunk_size=16)
        feeder.batch_prefill = batched
        rows = feeder.rows([get_method("fp16").new_cache(model) for _ in seqs])
        with feeder.routed():
            out[batched] = (feeder.feed_rows(rows, seqs, align_end, keep=True), rows.cache.lengths)
    (alone, alone_lengths), (together, together_lengths) = out[False], out[True]
    assert alone_lengths == together_lengths == [45, 20, 33]
    for seq, a, b in zip(seqs, alone, together, strict=True):
        assert a.shape == b.shape == (len(seq), model.config.vocab_size)
        torch.testing.assert_close(a, b, rtol=0, atol=2e-3)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
