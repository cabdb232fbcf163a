"""Paired statistics (magclip.experiments.stats): hand-computed cases, and scipy where it has the
same test (bootstrap, permutation_test, ttest_rel / ttest_ind intervals) and published power tables."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as st

from magclip.experiments import stats as S

# ----------------------------------------------------------------------------- bootstrap


def test_bootstrap_hand_cases():
    # two items with differences 0 and 1: resampled means are 0, 0.5, 1 with probabilities 1/4, 1/2, 1/4
    out = S.bootstrap_ci([0.0, 1.0], n_resamples=20_000)
    assert out["mean"] == 0.5 and (out["low"], out["high"]) == (0.0, 1.0)
    assert out["se"] == pytest.approx(math.sqrt(0.125), rel=0.03)    # sd of that distribution
    same = S.bootstrap_ci(np.full((3, 7), 0.25))
    assert same == {"mean": 0.25, "low": 0.25, "high": 0.25, "se": 0.0}


def test_bootstrap_matches_scipy_percentile():
    rng = np.random.default_rng(0)
    d = rng.normal(0.3, 1.0, size=200)
    ours = S.bootstrap_ci(d, n_resamples=40_000, seed=1)
    ref = st.bootstrap((d,), np.mean, method="percentile", n_resamples=40_000, random_state=2).confidence_interval
    width = ref.high - ref.low
    assert ours["low"] == pytest.approx(ref.low, abs=0.03 * width)
    assert ours["high"] == pytest.approx(ref.high, abs=0.03 * width)


def test_bootstrap_resamples_an_item_in_every_seed_at_once():
    """All seeds are scored on the same items: scipy's paired bootstrap over the seeds' rows (one
    index draw for every row) is the same procedure; identical seeds give the one-seed interval."""
    rng = np.random.default_rng(3)
    item_effect = rng.normal(0, 1, size=150)
    d = item_effect + rng.normal(0.2, 0.5, size=(4, 150))            # items correlated across seeds
    ours = S.bootstrap_ci(d, n_resamples=40_000, seed=4)
    ref = st.bootstrap(tuple(d), lambda *rows, axis=-1: np.mean(np.stack(rows), axis=(0, axis)), paired=True,
                       vectorized=True, method="percentile", n_resamples=40_000, random_state=5).confidence_interval
    width = ref.high - ref.low
    assert ours["low"] == pytest.approx(ref.low, abs=0.03 * width)
    assert ours["high"] == pytest.approx(ref.high, abs=0.03 * width)
    one = S.bootstrap_ci(d[0], seed=6)
    assert S.bootstrap_ci(np.stack([d[0]] * 3), seed=6) == pytest.approx(one, rel=1e-12)
    # resampling each seed's items on its own would understate the spread of correlated items
    independent = np.mean([d[s][rng.integers(0, 150, (4000, 150))].mean(axis=1) for s in range(4)], axis=0)
    assert independent.std() < 0.6 * ours["se"]


# ----------------------------------------------------------------------------- permutation test


@pytest.mark.parametrize("d, p", [([1, 1, 1], 0.25), ([1, -1], 1.0), ([0, 0, 1, 1, 1], 0.25),
                                  ([2, 1, 1], 0.25), ([3, -1], 1.0), ([0, 0], 1.0)])
def test_permutation_hand_cases(d, p):
    # [1,1,1]: of the 8 sign patterns only +++ and --- reach |sum| 3; zeros do not count;
    # [3,-1]: |3-1| = 2 is the smallest |sum| any pattern gives, so every pattern is as extreme
    assert S.permutation_pvalue(d) == p


def test_permutation_exact_matches_scipy():
    rng = np.random.default_rng(7)
    x = rng.integers(0, 2, size=12).astype(float)
    y = (rng.random(12) < 0.3).astype(float) + rng.normal(0, 0.1, 12)
    ref = st.permutation_test((y, x), lambda a, b, axis=-1: np.mean(a - b, axis=axis), vectorized=True,
                              permutation_type="samples", n_resamples=10**6).pvalue
    assert S.permutation_pvalue(y - x) == pytest.approx(ref, abs=1e-12)


def test_permutation_randomized_matches_scipy():
    rng = np.random.default_rng(8)
    x = (rng.random(300) < 0.40).astype(float)
    y = (rng.random(300) < 0.48).astype(float)
    ours = S.permutation_pvalue(y - x, n_resamples=20_000, seed=1)
    ref = st.permutation_test((y, x), lambda a, b, axis=-1: np.mean(a - b, axis=axis), vectorized=True,
                              permutation_type="samples", n_resamples=20_000, random_state=2).pvalue
    assert 0.0 < ours < 1.0 and ours == pytest.approx(ref, abs=0.015)


# ----------------------------------------------------------------------------- seed level, power


def test_t_interval_matches_scipy_ttest_rel():
    rng = np.random.default_rng(9)
    base = rng.normal(0.25, 0.02, 5)
    row = base + rng.normal(0.02, 0.015, 5)
    ref = st.ttest_rel(row, base).confidence_interval()
    got = S.t_interval(row - base)
    assert (got["low"], got["high"]) == pytest.approx((ref.low, ref.high), abs=1e-12)
    assert got["n"] == 5 and got["sd"] == pytest.approx(np.std(row - base, ddof=1))
    one = S.t_interval([0.1])
    assert one["mean"] == 0.1 and math.isnan(one["low"]) and one["n"] == 1


def test_compare_summary_interval_is_welchs():
    rng = np.random.default_rng(10)
    a, b = rng.normal(0.3, 0.02, 5), rng.normal(0.33, 0.03, 7)
    ref = st.ttest_ind(b, a, equal_var=False).confidence_interval()
    got = S.compare_summary({"mean": a.mean(), "std": a.std(ddof=1), "n": 5},
                            {"mean": b.mean(), "std": b.std(ddof=1), "n": 7})
    assert (got.seed_low, got.seed_high) == pytest.approx((ref.low, ref.high), abs=1e-12)
    assert not got.paired and got.n_seeds == 5
    assert S.compare_summary({"mean": 1, "std": None, "n": 1}, {"mean": 2, "std": None, "n": 1}).verdict == S.ONE_SEED


@pytest.mark.parametrize("effect, paired, n", [(0.5, True, 34), (0.8, True, 15), (1.0, True, 10),
                                               (0.5, False, 64), (0.8, False, 26)])
def test_seeds_needed_matches_power_tables(effect, paired, n):
    """Sample sizes for 80 % power at α = 0.05, two-sided (Cohen's tables / G*Power): a paired
    (one-sample) t test needs 34 / 15 / 10 pairs for d = 0.5 / 0.8 / 1; two groups need 64 / 26 runs
    each (sd of a difference of two runs = √2 · the per-run sd)."""
    sd = 1.0 if paired else math.sqrt(2.0)
    assert S.seeds_needed(effect, sd, paired=paired) == n


def test_mde_has_the_asked_power_and_tends_to_the_normal_formula():
    z = st.norm.ppf(0.975) + st.norm.ppf(0.8)
    assert S.mde_normal(0.01) == pytest.approx(z * 0.01)
    for n in (2, 3, 5, 20):
        mde = S.mde_t(2.0, n)
        assert S.t_power(mde, 2.0, n) == pytest.approx(0.8, abs=1e-6)
        assert mde > z * 2.0 / math.sqrt(n)          # few seeds: worse than the large-sample formula
    assert S.mde_t(2.0, 2000) == pytest.approx(z * 2.0 / math.sqrt(2000), rel=2e-3)
    assert S.t_power(0.0, 1.0, 5) == pytest.approx(0.05)
    assert math.isnan(S.mde_t(0.0, 5)) and math.isnan(S.mde_t(1.0, 1))
    assert S.seeds_needed(0.0, 1.0) is None and S.seeds_needed(1.0, 0.0) is None


# ----------------------------------------------------------------------------- verdicts


def test_compare_verdicts():
    rng = np.random.default_rng(11)
    items = (rng.random((5, 400)) < 0.35).astype(float) - (rng.random((5, 400)) < 0.25).astype(float)
    clear = S.compare(items.mean(axis=1), items, n_resamples=2000)
    assert clear.verdict == S.BETTER and clear.seed_low > 0 and clear.item_low > 0 and clear.p_items < 0.01
    assert clear.n_seeds == 5 and clear.n_items == 400 and clear.decided
    lower_better = S.compare(items.mean(axis=1), items, higher_is_better=False, n_resamples=2000)
    assert lower_better.verdict == S.WORSE
    # seeds agree but the items do not: no verdict without both
    noisy = np.zeros((3, 50))
    noisy[:, 0] = 1.0
    seeds_only = S.compare([0.02, 0.021, 0.019], noisy, n_resamples=2000)
    assert seeds_only.seed_low > 0 and seeds_only.item_low <= 0 and seeds_only.verdict == S.NO_DIFFERENCE
    # few differing queries: the percentile bootstrap excludes 0, the exact permutation test does not
    sparse = np.zeros((2, 60))
    sparse[0, :4] = 1.0                  # 4 differing (seed, query) pairs, all in favour: exact p = 2/16
    few = S.compare([2 / 60, 2 / 60 + 1e-4], sparse, n_resamples=4000)
    assert few.seed_low > 0 and few.item_low > 0 and few.p_items == 0.125 and few.verdict == S.NO_DIFFERENCE
    # MDE: the larger of the seed-level and the item-level one
    assert seeds_only.mde == pytest.approx(max(S.mde_t(seeds_only.seed_sd, 3), S.mde_normal(seeds_only.item_se)))
    one = S.compare([0.05], items[:1], n_resamples=500)
    assert one.verdict == S.ONE_SEED and math.isnan(one.seed_low) and one.item_low is not None
    d = one.to_dict()
    assert d["seed_low"] is None and all(not isinstance(v, np.floating) for v in d.values())
