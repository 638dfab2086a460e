"""95% intervals over examples: a percentile bootstrap with a fixed seed, and paired differences to fp16.

Every task metric is a function of per-example numbers: a mean (exact match, mc2, a passkey hit,
a fidelity number), a ratio of sums (perplexity = exp(Σ NLL / Σ tokens); fidelity averaged over the
units of each example), or a mean over strata (LongBench's average of per-task scores). An
``Estimator`` holds those numbers; its ``value`` reproduces the task's own number and its
``statistic`` evaluates it on many resamples of the examples at once.

Why the percentile bootstrap: the scores are bounded and skewed (0/1 hits, KL near 0), so a normal
interval (mean ± 1.96 s.e.) can leave the metric's range; the percentile interval stays inside it
and treats a mean, a ratio and a macro average alike with no formula per metric. For a plain mean it
equals ``scipy.stats.bootstrap(method="percentile")`` given the same generator (checked in the tests);
it is written in numpy because resampling within strata, and one index matrix shared by a method and
fp16, are what scipy's function does not offer.
Why a fixed seed: a rerun or a resumed table must print the same interval for the same examples.
Why paired: method and fp16 run on the same examples, so the difference is resampled per example
(one resample, both statistics), which removes the spread of example difficulty that two separate
intervals would count twice; a method differs from fp16 only where that interval excludes 0.
Fewer than 2 examples give no interval (``None``): one example says nothing about the spread, and a
zero-width interval would claim certainty. A stratified estimate (LongBench's average over tasks) gets
one when some stratum has 2 examples or more: a stratum of one example is held fixed in every
resample (it has no spread to resample), so the interval covers the other strata's sampling noise only.

Limits: a sample with no spread (0 hits of n) gives a zero-width
interval, since no resample can differ (for 0 of n hits read 3/n as an upper bound, the rule of
three); and at small n the percentile bootstrap is too narrow (n = 2 has 3 distinct resample means),
so tables mark a paired difference as beyond noise only from ``MIN_N_CLAIM`` examples on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

LEVEL = 0.95
N_RESAMPLES = 2000
SEED = 0
MIN_N_CLAIM = 10  # fewest examples at which a table calls a paired interval that excludes 0 a difference

Interval = tuple[float, float]


@dataclass(frozen=True, eq=False)
class Estimator:
    """``scale · mean over strata of transform(Σ num / Σ den)`` over the examples of each stratum.

    One entry of ``num``/``den``/``strata`` per example; ``den`` of ones makes a mean, ``strata=None``
    one stratum.
    """

    num: np.ndarray
    den: np.ndarray
    strata: np.ndarray | None = None
    transform: Callable[[np.ndarray], np.ndarray] | None = None
    scale: float = 1.0
    _groups: list[np.ndarray] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        num = np.asarray(self.num, dtype=np.float64)
        den = np.asarray(self.den, dtype=np.float64)
        if num.shape != den.shape or num.ndim != 1:
            raise ValueError(f"num and den must be 1-D of one length, got {num.shape} and {den.shape}")
        object.__setattr__(self, "num", num)
        object.__setattr__(self, "den", den)
        if self.strata is None:
            groups = [np.arange(num.size)]
        else:
            strata = np.asarray(self.strata)
            if strata.shape != num.shape:
                raise ValueError(f"strata must have one label per example, got {strata.shape} for {num.shape}")
            object.__setattr__(self, "strata", strata)
            groups = [np.flatnonzero(strata == s) for s in np.unique(strata)]
        object.__setattr__(self, "_groups", groups)

    @property
    def n(self) -> int:
        return int(self.num.size)

    @property
    def resamplable(self) -> bool:
        """At least 2 examples, in a stratum of at least 2 (one that a resample can change)."""
        return self.n >= 2 and any(g.size >= 2 for g in self._groups)

    def statistic(self, idx: np.ndarray) -> np.ndarray:
        """The estimate on each row of ``idx`` (resamples × examples, positions into the examples)."""
        parts = []
        for cols in self._groups:
            rows = idx[:, cols]
            with np.errstate(invalid="ignore", divide="ignore"):
                ratio = self.num[rows].sum(-1) / self.den[rows].sum(-1)
            parts.append(self.transform(ratio) if self.transform is not None else ratio)
        return self.scale * np.mean(parts, axis=0)

    @property
    def value(self) -> float:
        """The estimate on the examples themselves (what the task reports)."""
        return float(self.statistic(np.arange(self.n)[None, :])[0]) if self.n else math.nan

    def same_design(self, other: Estimator) -> bool:
        """Same examples count and strata, so one resample applies to both (a paired comparison)."""
        if self.n != other.n:
            return False
        if self.strata is None or other.strata is None:
            return self.strata is None and other.strata is None
        return bool(np.array_equal(self.strata, other.strata))


def mean(values: Sequence[float], scale: float = 1.0, strata: Sequence | None = None) -> Estimator:
    """The (scaled) mean of per-example values; with ``strata``, the mean of the strata's means."""
    values = np.asarray(values, dtype=np.float64)
    return Estimator(values, np.ones_like(values), None if strata is None else np.asarray(strata), scale=scale)


def ratio(num: Sequence[float], den: Sequence[float], transform=None, scale: float = 1.0) -> Estimator:
    """``transform(Σ num / Σ den)``: token-weighted NLL, perplexity, or a mean over each example's units."""
    return Estimator(np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64), None, transform, scale)


def resample_indices(
    n: int, strata: np.ndarray | None = None, n_resamples: int = N_RESAMPLES, seed: int = SEED
) -> np.ndarray:
    """``n_resamples × n`` positions drawn with replacement; within each stratum when ``strata`` is given
    (so every resample keeps each stratum's size and each position keeps its stratum)."""
    rng = np.random.default_rng(seed)
    if strata is None:
        return rng.integers(0, n, size=(n_resamples, n))
    out = np.empty((n_resamples, n), dtype=np.int64)
    for label in np.unique(strata):
        cols = np.flatnonzero(strata == label)
        out[:, cols] = cols[rng.integers(0, cols.size, size=(n_resamples, cols.size))]
    return out


def _percentiles(stats: np.ndarray, level: float) -> Interval | None:
    if not np.all(np.isfinite(stats)):
        return None
    lo, hi = np.percentile(stats, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def interval(est: Estimator, level: float = LEVEL, n_resamples: int = N_RESAMPLES, seed: int = SEED) -> Interval | None:
    """Percentile bootstrap interval of ``est`` over its examples; None where no stratum has 2 examples."""
    if not est.resamplable:
        return None
    idx = resample_indices(est.n, est.strata, n_resamples, seed)
    return _percentiles(est.statistic(idx), level)


def paired_interval(
    est: Estimator, ref: Estimator, level: float = LEVEL, n_resamples: int = N_RESAMPLES, seed: int = SEED
) -> Interval | None:
    """Interval of ``est − ref`` on the same examples: each resample evaluates both on the same positions."""
    if not est.same_design(ref):
        raise ValueError("a paired interval needs the same examples (count and strata) on both sides")
    if not est.resamplable:
        return None
    idx = resample_indices(est.n, est.strata, n_resamples, seed)
    return _percentiles(est.statistic(idx) - ref.statistic(idx), level)


def consistent(est: Estimator, reported: float, rel: float = 1e-6) -> bool:
    """Whether ``est`` reproduces the number the task reported (a guard against a wrong estimator)."""
    return math.isclose(est.value, float(reported), rel_tol=rel, abs_tol=1e-9)


def blocks(
    estimators: Mapping[str, Mapping[str, Estimator]],
    reported: Mapping[str, Mapping[str, float]],
    paired: Mapping[str, tuple[Estimator, Estimator]] | None = None,
) -> tuple[dict[str, list[float]], dict[str, int], dict[str, float], list[str]]:
    """results.json's ``ci95`` and ``n`` (keys ``<block>/<name>``) and ``paired`` blocks, plus problems.

    ``estimators[block][name]`` must reproduce ``reported[block][name]`` (a mismatch is listed, not
    written); ``paired[name]`` is (method, fp16) on the same examples, reported as method − fp16.
    """
    ci95: dict[str, list[float]] = {}
    counts: dict[str, int] = {}
    diffs: dict[str, float] = {}
    problems: list[str] = []
    for block, named in estimators.items():
        for name, est in named.items():
            value = (reported.get(block) or {}).get(name)
            if value is None or not math.isfinite(float(value)):
                continue
            if not consistent(est, value):
                problems.append(f"{block}/{name}: estimator gives {est.value!r}, the task reported {value!r}")
                continue
            counts[f"{block}/{name}"] = est.n
            found = interval(est)
            if found is not None:
                ci95[f"{block}/{name}"] = list(found)
    for name, (est, ref) in (paired or {}).items():
        diff = est.value - ref.value
        if not math.isfinite(diff) or not est.same_design(ref):
            continue
        diffs[name] = diff
        counts[f"paired/{name}"] = est.n
        found = paired_interval(est, ref)
        if found is not None:
            ci95[f"paired/{name}"] = list(found)
    return ci95, counts, diffs, problems
