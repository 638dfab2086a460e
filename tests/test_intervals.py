"""kvquant.eval.intervals: percentile bootstrap over examples, paired differences, and the results.json blocks."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from kvquant.eval import intervals as iv
from kvquant.eval.reference import FidelityStats, UnitRecord
from kvquant.eval.suite import fidelity_estimators

finite = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, allow_infinity=False)
samples = st.lists(finite, min_size=2, max_size=40)


@settings(max_examples=60, deadline=None)
@given(samples)
def test_interval_contains_the_mean_of_a_sample_with_spread(values):
    if max(values) - min(values) < 1e-6:
        return  # no spread: the constant case below
    lo, hi = iv.interval(iv.mean(values))
    mean = float(np.mean(values))
    slack = 1e-9 * (1 + abs(mean))
    assert lo - slack <= mean <= hi + slack and lo <= hi


@settings(max_examples=30, deadline=None)
@given(samples, st.integers(min_value=0, max_value=2**31))
def test_same_seed_same_interval(values, seed):
    est = iv.mean(values)
    assert iv.interval(est, seed=seed) == iv.interval(est, seed=seed)


@settings(max_examples=30, deadline=None)
@given(finite, st.integers(min_value=2, max_value=50))
def test_a_constant_sample_gives_a_zero_width_interval(value, n):
    lo, hi = iv.interval(iv.mean([value] * n))
    assert lo == hi and lo == pytest.approx(value, rel=1e-12, abs=1e-12)


@settings(max_examples=30, deadline=None)
@given(samples)
def test_paired_difference_of_identical_samples_is_zero(values):
    assert iv.paired_interval(iv.mean(values), iv.mean(list(values))) == (0.0, 0.0)


def test_one_example_gives_no_interval_nor_do_strata_of_one():
    assert iv.interval(iv.mean([0.7])) is None
    assert iv.paired_interval(iv.mean([0.7]), iv.mean([0.2])) is None
    assert iv.interval(iv.mean([1.0, 0.0], strata=["a", "b"])) is None  # no stratum a resample can change


def test_a_stratum_of_one_example_is_held_fixed():
    """LongBench's bundled 2wikimqa has one example: the average over tasks still gets an interval, the
    one example's score entering every resample unchanged."""
    rest = [1.0, 0.0, 1.0, 1.0, 0.0, 0.5]
    lo, hi = iv.interval(iv.mean(rest))
    both = iv.interval(iv.mean([*rest, 0.25], strata=["a"] * len(rest) + ["b"]))
    assert both == pytest.approx(((lo + 0.25) / 2, (hi + 0.25) / 2), abs=1e-12)


def test_plain_mean_equals_scipy_percentile_bootstrap():
    x = np.random.default_rng(3).exponential(size=25)
    ours = iv.interval(iv.mean(x))
    ref = stats.bootstrap(
        (x,), np.mean, n_resamples=iv.N_RESAMPLES, method="percentile", rng=np.random.default_rng(iv.SEED)
    )
    assert ours == pytest.approx((ref.confidence_interval.low, ref.confidence_interval.high), rel=1e-9)


def test_ratio_and_strata_reproduce_the_task_numbers():
    nll, tokens = [250.0, 300.0, 120.0], [100, 100, 50]
    ppl = iv.ratio(nll, tokens, np.exp)
    assert ppl.value == pytest.approx(math.exp(670 / 250))
    lo, hi = iv.interval(ppl)
    assert lo <= ppl.value <= hi
    scores, tasks = [1.0, 0.0, 0.5, 0.5, 0.25], ["a", "a", "b", "b", "b"]
    macro = iv.mean(scores, 100, tasks)  # LongBench's average of per-task averages
    assert macro.value == pytest.approx(100 * (0.5 + 1.25 / 3) / 2)
    idx = iv.resample_indices(5, np.array(tasks), 50, seed=1)
    assert (np.array(tasks)[idx] == np.array(tasks)).all()  # each position stays in its stratum


def test_pairing_removes_the_spread_of_example_difficulty():
    rng = np.random.default_rng(0)
    difficulty = rng.normal(0, 1, 60)
    fp16, method = difficulty, difficulty + 0.1 + rng.normal(0, 0.01, 60)
    lo, hi = iv.paired_interval(iv.mean(method), iv.mean(fp16))
    assert 0.09 < lo < 0.1 < hi < 0.11  # the shift is seen although each score's own interval is ~0.5 wide
    (a, b), (c, d) = iv.interval(iv.mean(method)), iv.interval(iv.mean(fp16))
    assert b - a > 0.3 and d - c > 0.3
    with pytest.raises(ValueError, match="same examples"):
        iv.paired_interval(iv.mean([1.0, 2.0]), iv.mean([1.0, 2.0, 3.0]))


def test_blocks_write_n_everywhere_intervals_from_two_examples_and_refuse_a_wrong_estimator():
    est = {"metrics": {"acc": iv.mean([1.0, 0.0, 1.0]), "one": iv.mean([0.5]), "wrong": iv.mean([1.0, 1.0])}}
    reported = {"metrics": {"acc": 2 / 3, "one": 0.5, "wrong": 0.3, "nan": float("nan")}}
    paired = {"acc": (iv.mean([1.0, 0.0, 1.0]), iv.mean([1.0, 0.0, 0.0]))}
    ci95, n, diffs, problems = iv.blocks(est, reported, paired)
    assert n == {"metrics/acc": 3, "metrics/one": 1, "paired/acc": 3}
    assert set(ci95) == {"metrics/acc", "paired/acc"} and diffs == {"acc": pytest.approx(1 / 3)}
    assert ci95["metrics/acc"][0] <= 2 / 3 <= ci95["metrics/acc"][1]
    assert problems == ["metrics/wrong: estimator gives 1.0, the task reported 0.3"]


def test_fidelity_is_resampled_by_example_with_all_its_units():
    lp = np.log(np.full((3, 4), 0.25))
    ref = UnitRecord.from_logprobs(torch.zeros(3, dtype=torch.long), torch.tensor(lp), generated=False)
    stats_ = FidelityStats()
    for key, shift in [("t/0#0", 0.1), ("t/0#1", 0.3), ("t/0#2", 0.2), ("t/1#0", 0.0), ("t/2.0#0", 0.5)]:
        other = torch.tensor(lp) + torch.tensor([shift, 0.0, 0.0, 0.0])
        stats_.add(key, ref, torch.zeros(3), torch.log_softmax(other, -1), generated=False)
    est = fidelity_estimators(stats_.per_unit, ["t/0", "t/1", "t/2"], {"t/0": 1.0, "t/1": 0.0, "t/2": 1.0})
    summary = stats_.summary()
    assert est["kl"].n == 3 and est["kl"].value == pytest.approx(summary["kl"])  # mean over the 5 units
    assert est["top1_agreement"].value == pytest.approx(summary["top1_agreement"])
    assert est["answer_agreement"].value == pytest.approx(2 / 3)
