"""Paired statistics for "is setting B better than setting A?", with the uncertainty computed.

Two sources of noise decide whether a difference between two grid rows means anything:

- training (seed) noise: another seed gives another model. Measured by the spread of the per-seed
  differences (row seed s − baseline seed s): `t_interval`, a paired t interval over seeds.
- evaluation-set noise: a few hundred queries are a sample. Measured from per-query outcomes
  (R@k of a query = its rank < k): `bootstrap_ci` resamples queries, and `permutation_pvalue`
  swaps the two settings' outcomes within each (seed, query) pair.

Every seed is scored on the same queries, so a query is resampled together with its outcomes in
every seed (the statistic is the mean over seeds and queries; each seed keeps its own queries:
stratified by seed). Resampling each seed's queries independently would treat one query's
outcomes in five seeds as five independent draws and understate the evaluation-set noise.

`compare` turns both into one verdict: "better" / "worse" only when every available 95 %
interval excludes 0 on the same side (and the permutation test agrees), otherwise "no difference detected", with the minimum
detectable effect (MDE) at 80 % power for this grid and the seeds that a difference of the
observed size would need. The MDE uses the noncentral t distribution (exact power of the paired
t test) rather than (z_0.975 + z_0.8)·sd/√n, which is too optimistic for 2-5 seeds.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

# scipy is imported inside the functions that use it: the compare command imports this module, and
# its --help and argument errors should not wait for scipy.stats

CONFIDENCE = 0.95
POWER = 0.80
N_RESAMPLES = 10_000
EXACT_LIMIT = 16            # at most 2**16 sign patterns are enumerated exactly
BETTER = "better"
WORSE = "worse"
NO_DIFFERENCE = "no difference detected"
HIGHER = "higher"   # a decided difference on a column with no better side (an effect size)
LOWER = "lower"
ONE_SEED = "no verdict (one seed)"


def _as_matrix(diffs: Any) -> np.ndarray:
    """[seeds, items] float array (a 1-D input is one seed)."""
    d = np.asarray(diffs, dtype=float)
    if d.ndim == 1:
        d = d[None, :]
    if d.ndim != 2 or d.shape[1] == 0:
        raise ValueError(f"expected per-item differences as [items] or [seeds, items], got shape {d.shape}")
    return d


def bootstrap_ci(diffs: Any, *, confidence: float = CONFIDENCE, n_resamples: int = N_RESAMPLES,
                 seed: int = 0) -> dict[str, float]:
    """Percentile bootstrap CI of the mean paired difference over [seeds, items] (or [items]).

    Items are resampled with replacement, the same draw for every seed (see the module docstring).
    The statistic is linear, so resampling item columns equals resampling the per-item means over
    seeds, which is what is done (in chunks, to bound memory). Returns mean, low, high and se
    (the bootstrap standard error).
    """
    item_means = _as_matrix(diffs).mean(axis=0)
    n = len(item_means)
    rng = np.random.default_rng(seed)
    boot = np.empty(n_resamples)
    chunk = max(1, 4_000_000 // n)
    for start in range(0, n_resamples, chunk):
        stop = min(n_resamples, start + chunk)
        boot[start:stop] = item_means[rng.integers(0, n, size=(stop - start, n))].mean(axis=1)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(boot, [alpha, 1 - alpha])
    return {"mean": float(item_means.mean()), "low": float(low), "high": float(high),
            "se": float(boot.std(ddof=1)) if n_resamples > 1 else math.nan}


def permutation_pvalue(diffs: Any, *, n_resamples: int = N_RESAMPLES, seed: int = 0) -> float:
    """Two-sided p-value of the paired permutation (sign-flip) test of mean difference 0.

    Under "the two settings are exchangeable", each (seed, item) pair's outcomes may be swapped,
    i.e. its difference's sign flipped. Exact (all 2^m patterns of the m nonzero differences) when
    m <= EXACT_LIMIT, else n_resamples random patterns with p = (hits + 1) / (n_resamples + 1), as
    scipy.stats.permutation_test(permutation_type='samples') does.
    """
    d = _as_matrix(diffs).ravel()
    d = d[d != 0]                       # a zero difference is the same under either sign
    m = len(d)
    if m == 0:
        return 1.0
    observed = abs(d.sum())             # sums, not means: the same test with m fixed
    tol = 1e-9 * max(1.0, observed)
    if m <= EXACT_LIMIT:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=m)))
        return float(np.mean(np.abs(signs @ d) >= observed - tol))
    rng = np.random.default_rng(seed)
    hits = 0
    chunk = max(1, 4_000_000 // m)
    for start in range(0, n_resamples, chunk):
        size = min(chunk, n_resamples - start)
        signs = rng.integers(0, 2, size=(size, m)) * 2.0 - 1.0
        hits += int(np.sum(np.abs(signs @ d) >= observed - tol))
    return (hits + 1) / (n_resamples + 1)


def t_interval(per_seed: Any, *, confidence: float = CONFIDENCE) -> dict[str, float]:
    """Mean of the per-seed paired differences with its t interval (n - 1 degrees of freedom).

    Returns mean, low, high, sd (of the differences), n; low/high/sd are nan for one seed.
    """
    from scipy import stats as st

    x = np.asarray(per_seed, dtype=float).ravel()
    n = len(x)
    if n == 0:
        raise ValueError("no per-seed differences")
    mean = float(x.mean())
    if n < 2:
        return {"mean": mean, "low": math.nan, "high": math.nan, "sd": math.nan, "n": 1}
    sd = float(x.std(ddof=1))
    half = st.t.ppf(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n)
    return {"mean": mean, "low": float(mean - half), "high": float(mean + half), "sd": sd, "n": n}


def t_power(effect: float, sd: float, n: int, *, alpha: float = 1 - CONFIDENCE, df: float | None = None) -> float:
    """Power of the two-sided paired t test on n pairs to detect a true mean difference `effect`
    when the differences have standard deviation `sd` (noncentral t, noncentrality effect·√n/sd).
    `df` (default n - 1): 2(n - 1) for two independent groups of n runs, whose difference of
    means has the standard error sd/√n with sd² = s_a² + s_b²."""
    from scipy import integrate, special
    from scipy import stats as st

    if n < 2 or not sd > 0:
        return math.nan
    df = n - 1 if df is None else df
    crit = st.t.ppf(1 - alpha / 2, df)
    ncp = abs(effect) * math.sqrt(n) / sd
    power = float(st.nct.sf(crit, df, ncp) + st.nct.cdf(-crit, df, ncp))
    if math.isnan(power):  # scipy's nct fails for some (df, ncp), e.g. df = 1: integrate over the chi² instead
        log_norm = (df / 2) * math.log(2) + math.lgamma(df / 2)

        def rejects(v: float) -> float:  # P(|Z + ncp| > crit·sqrt(v/df)) times the chi²(df) density at v
            if v <= 0:
                return 0.0
            c = crit * math.sqrt(v / df)
            density = math.exp((df / 2 - 1) * math.log(v) - v / 2 - log_norm)
            return float(special.ndtr(ncp - c) + special.ndtr(-c - ncp)) * density
        power = float(integrate.quad(rejects, 0, math.inf)[0])
    return min(1.0, power)


def mde_t(sd: float, n: int, *, power: float = POWER, alpha: float = 1 - CONFIDENCE, df: float | None = None) -> float:
    """Smallest true difference the paired t test on n seeds detects with the given power (`df`: as
    in `t_power`)."""
    if n < 2 or not sd > 0:
        return math.nan
    return sd * _mde_in_sd_units(n, power, alpha, df)


@functools.lru_cache(maxsize=256)
def _mde_in_sd_units(n: int, power: float, alpha: float, df: float | None) -> float:
    """The MDE for sd = 1 (it scales with sd), cached: a results page asks it for the same few (n, df)
    dozens of times, and at small df each power evaluation is a numerical integral."""
    from scipy import optimize
    from scipy import stats as st

    hi = (st.norm.ppf(1 - alpha / 2) + st.norm.ppf(power)) / math.sqrt(n)
    while t_power(hi, 1.0, n, alpha=alpha, df=df) < power:
        hi *= 2
    return float(optimize.brentq(lambda e: t_power(e, 1.0, n, alpha=alpha, df=df) - power, 0.0, hi, xtol=1e-12))


def mde_normal(se: float, *, power: float = POWER, alpha: float = 1 - CONFIDENCE) -> float:
    """(z_{1-α/2} + z_power) · se: the MDE of a test whose estimate has standard error se (many items)."""
    from scipy import stats as st

    return float((st.norm.ppf(1 - alpha / 2) + st.norm.ppf(power)) * se) if se > 0 else math.nan


def seeds_needed(effect: float, sd: float, *, power: float = POWER, alpha: float = 1 - CONFIDENCE,
                 paired: bool = True, limit: int = 10_000) -> int | None:
    """Fewest seeds (runs per setting) for the t test to detect `effect` with `power`, given the sd of
    a per-seed difference (paired: df = n - 1; unpaired: df = 2(n - 1)); None when effect or sd is
    0/unknown or the answer exceeds `limit`."""
    if not (sd > 0) or not abs(effect) > 0:
        return None
    n = 2
    while n <= limit:
        if t_power(effect, sd, n, alpha=alpha, df=None if paired else 2 * (n - 1)) >= power:
            return n
        n += 1 if n < 100 else max(1, n // 50)
    return None


@dataclass
class Comparison:
    """One row against the baseline on one metric (differences are row − baseline, raw units)."""

    diff: float                        # mean difference over the paired seeds
    n_seeds: int                       # seeds present in both rows
    seed_low: float = math.nan         # paired t interval over seeds (training noise)
    seed_high: float = math.nan
    seed_sd: float = math.nan          # sd of the per-seed differences
    paired: bool = True                # False: from summary stats (unpaired, Welch-like)
    n_items: int = 0                   # items per seed with per-query outcomes (0: none)
    item_low: float = math.nan         # item bootstrap over the same seeds (evaluation-set noise)
    item_high: float = math.nan
    item_se: float = math.nan
    p_items: float = math.nan          # paired permutation p-value over (seed, item) pairs
    mde: float = math.nan              # smallest difference this grid detects at 80 % power
    seeds_for_diff: int | None = None  # seeds a true difference of the observed size would need
    verdict: str = NO_DIFFERENCE
    sign: int = 1                      # +1: higher is better, -1: lower is better

    @property
    def decided(self) -> bool:
        return self.verdict in (BETTER, WORSE)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in asdict(self).items():
            if isinstance(v, (float, np.floating)):
                v = None if math.isnan(v) else float(v)
            out[k] = v
        return out


def _verdict(intervals: list[tuple[float, float]], sign: int) -> str:
    usable = [(lo, hi) for lo, hi in intervals if not (math.isnan(lo) or math.isnan(hi))]
    if not usable:
        return NO_DIFFERENCE
    if all(lo > 0 for lo, _ in usable):
        return BETTER if sign > 0 else WORSE
    if all(hi < 0 for _, hi in usable):
        return WORSE if sign > 0 else BETTER
    return NO_DIFFERENCE


def compare(per_seed_diff: Any, item_diffs: Any = None, *, item_stats: "ItemStats | None" = None,
            higher_is_better: bool = True, confidence: float = CONFIDENCE, power: float = POWER,
            n_resamples: int = N_RESAMPLES, seed: int = 0) -> Comparison:
    """Row vs baseline from the per-seed differences (row seed s − baseline seed s) and, when every
    paired cell kept per-query outcomes, the [seeds, items] per-item differences of the same seeds
    (a mean over items: bootstrap and sign-flip test here) or, for a statistic that is not a mean over
    items (a correlation over pairs: `correlation_item_stats`), its item-level `item_stats`.

    Verdict: better/worse when the seed interval (≥ 2 seeds) and the item interval (if any) all
    exclude 0 on the same side, and the permutation test agrees (p < 1 - confidence: a percentile
    bootstrap over a handful of differing queries can exclude 0 when the exact test does not);
    with one seed no verdict is possible (the item interval alone says two particular models
    differ, not two settings). MDE: the larger of the seed-level (t test)
    and the item-level (normal) MDE, since a verdict needs both intervals.
    """
    sign = 1 if higher_is_better else -1
    seeds = t_interval(per_seed_diff, confidence=confidence)
    out = Comparison(diff=seeds["mean"], n_seeds=seeds["n"], seed_low=seeds["low"], seed_high=seeds["high"],
                     seed_sd=seeds["sd"], sign=sign)
    mdes = [mde_t(seeds["sd"], seeds["n"], power=power, alpha=1 - confidence)] if seeds["n"] >= 2 else []
    if item_diffs is not None:
        d = _as_matrix(item_diffs)
        boot = bootstrap_ci(d, confidence=confidence, n_resamples=n_resamples, seed=seed)
        item_stats = ItemStats(d.shape[1], boot["low"], boot["high"], boot["se"],
                               permutation_pvalue(d, n_resamples=n_resamples, seed=seed))
    if item_stats is not None:
        out.n_items, out.item_low, out.item_high = item_stats.n_items, item_stats.low, item_stats.high
        out.item_se, out.p_items = item_stats.se, item_stats.p
        mdes.append(mde_normal(item_stats.se, power=power, alpha=1 - confidence))
    finite = [m for m in mdes if not math.isnan(m)]
    out.mde = max(finite) if finite else math.nan
    out.seeds_for_diff = seeds_needed(out.diff, out.seed_sd, power=power, alpha=1 - confidence)
    out.verdict = _verdict([(out.seed_low, out.seed_high), (out.item_low, out.item_high)] if out.n_items
                           else [(out.seed_low, out.seed_high)], sign) if out.n_seeds >= 2 else ONE_SEED
    if out.n_items and out.decided and not out.p_items < 1 - confidence:
        out.verdict = NO_DIFFERENCE   # the percentile bootstrap is optimistic when few queries differ
    return out


@dataclass
class ItemStats:
    """The evaluation-set noise of one comparison: items per seed, the 95 % bootstrap interval and
    standard error of the difference, and the paired permutation p-value."""

    n_items: int
    low: float
    high: float
    se: float
    p: float


def _row_corr(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Pearson correlation of each row of x with the same row of y ([R, n] -> [R])."""
    x = x - x.mean(axis=1, keepdims=True)
    y = y - y.mean(axis=1, keepdims=True)
    denom = np.sqrt((x * x).sum(axis=1) * (y * y).sum(axis=1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return (x * y).sum(axis=1) / denom


def _for_correlation(x: np.ndarray, method: str) -> np.ndarray:
    """What the correlation is the Pearson correlation of, row by row: average ranks for spearman
    (scipy's spearmanr), the values themselves for pearson."""
    if method == "spearman":
        from scipy.stats import rankdata

        return rankdata(x, axis=-1)
    return x


def _on_one_scale(scores: np.ndarray, method: str) -> np.ndarray:
    """[seeds, n] scores as values comparable across models: ranks (spearman) or z-scores (pearson), per seed."""
    if method == "spearman":
        return _for_correlation(scores, method)
    centred = scores - scores.mean(axis=1, keepdims=True)
    spread = scores.std(axis=1, keepdims=True)
    return np.divide(centred, spread, out=np.zeros_like(centred), where=spread > 0)


def correlation_item_stats(gold: Any, base_pred: Any, row_pred: Any, method: str = "spearman", *,
                           confidence: float = CONFIDENCE, n_resamples: int = N_RESAMPLES, seed: int = 0,
                           chunk: int = 500) -> ItemStats:
    """Evaluation-set noise of a correlation difference (STS: Spearman of the model's pair scores with
    the gold scores). `base_pred`, `row_pred`: [seeds, pairs] scores of the same pairs; the statistic
    is the mean over seeds of corr(row_s, gold) − corr(base_s, gold). Bootstrap: pairs resampled with
    replacement, the same draw in every seed (as `bootstrap_ci`), the correlation recomputed on each
    draw; permutation p: each (seed, pair)'s two scores swapped at random, two-sided, after each model's
    scores are put on one scale (ranks for spearman, z-scores for pearson; neither changes the observed
    correlations): raw scores of two scoring modes live on different scales (cosine in [-1, 1], dot
    unbounded), and swapping them would mix the scales, lower both correlations and widen the null."""
    if method not in ("spearman", "pearson"):
        raise ValueError(f"unknown correlation {method!r}; use spearman or pearson")
    gold = np.asarray(gold, dtype=float)
    base, row = _as_matrix(base_pred), _as_matrix(row_pred)
    if base.shape != row.shape or base.shape[1] != len(gold):
        raise ValueError(f"scores of shape {base.shape} and {row.shape} for {len(gold)} gold scores")
    n_seeds, n = base.shape
    rng = np.random.default_rng(seed)

    def statistic(b: np.ndarray, r: np.ndarray, g: np.ndarray) -> np.ndarray:
        """[R, seeds, n] scores, [R, n] gold already `_for_correlation` -> [R]."""
        b, r = _for_correlation(b, method), _for_correlation(r, method)
        return np.mean([_row_corr(r[:, s], g) - _row_corr(b[:, s], g) for s in range(n_seeds)], axis=0)

    fixed_gold = _for_correlation(gold[None], method)
    observed = float(statistic(base[None], row[None], fixed_gold)[0])
    base_common, row_common = _on_one_scale(base, method), _on_one_scale(row, method)  # exchangeable under the null
    boot, hits = [], 0
    for start in range(0, n_resamples, chunk):
        size = min(chunk, n_resamples - start)
        idx = rng.integers(0, n, size=(size, n))
        boot.append(statistic(base[:, idx].transpose(1, 0, 2), row[:, idx].transpose(1, 0, 2),
                              _for_correlation(gold[idx], method)))
        swap = rng.integers(0, 2, size=(size, n_seeds, n)).astype(bool)
        b = np.where(swap, row_common[None], base_common[None])
        r = np.where(swap, base_common[None], row_common[None])
        perm = statistic(b, r, np.broadcast_to(fixed_gold, (size, n)))
        hits += int(np.sum(np.abs(perm) >= abs(observed) - 1e-12 * max(1.0, abs(observed))))
    draws = np.concatenate(boot)
    draws = draws[np.isfinite(draws)]
    alpha = (1 - confidence) / 2
    low, high = np.quantile(draws, [alpha, 1 - alpha]) if len(draws) else (math.nan, math.nan)
    return ItemStats(n, float(low), float(high), float(draws.std(ddof=1)) if len(draws) > 1 else math.nan,
                     (hits + 1) / (n_resamples + 1))


def compare_summary(base: dict[str, Any], row: dict[str, Any], *, higher_is_better: bool = True,
                    confidence: float = CONFIDENCE, power: float = POWER) -> Comparison:
    """Row vs baseline from per-row summaries only ({mean, std, n} over seeds: older reports kept no
    per-seed values). Unpaired: the interval and the MDE are Welch's (its degrees of freedom); the
    seeds needed are those of the two-sample t test with that many runs per setting and
    sd² = s_a² + s_b² (the variance of the difference of two independent runs)."""
    from scipy import stats as st

    sign = 1 if higher_is_better else -1
    ma, sa, na = base["mean"], base.get("std"), int(base.get("n") or 0)
    mb, sb, nb = row["mean"], row.get("std"), int(row.get("n") or 0)
    out = Comparison(diff=float(mb - ma), n_seeds=min(na, nb), paired=False, sign=sign)
    if na < 2 or nb < 2 or sa is None or sb is None:
        out.verdict = ONE_SEED
        return out
    va, vb = sa ** 2 / na, sb ** 2 / nb
    se = math.sqrt(va + vb)
    n = out.n_seeds
    df = (va + vb) ** 2 / (va ** 2 / (na - 1) + vb ** 2 / (nb - 1)) if se > 0 else 2 * (n - 1)
    half = float(st.t.ppf(0.5 + confidence / 2, df)) * se
    out.seed_low, out.seed_high = out.diff - half, out.diff + half
    out.seed_sd = math.sqrt(sa ** 2 + sb ** 2)
    out.mde = mde_t(out.seed_sd, n, power=power, alpha=1 - confidence, df=df)
    out.seeds_for_diff = seeds_needed(out.diff, out.seed_sd, power=power, alpha=1 - confidence, paired=False)
    out.verdict = _verdict([(out.seed_low, out.seed_high)], sign)
    return out


__all__ = ["BETTER", "NO_DIFFERENCE", "ONE_SEED", "WORSE", "Comparison", "ItemStats", "bootstrap_ci", "compare",
           "compare_summary", "correlation_item_stats",
           "mde_normal", "mde_t", "permutation_pvalue", "seeds_needed", "t_interval", "t_power"]
