"""Two evaluated models, query by query: ROW − BASE on every per-query metric both outputs kept.

A compare grid pairs runs by seed and by query; outside a grid (a trained checkpoint against the
model it started from on a full corpus, two checkpoints of one run) there is one run per side, so
the only noise that can be measured is the evaluation set's: the queries are resampled with both
their outcomes (percentile bootstrap) and a sign-flip permutation test gives p. A decided difference
says these two models differ on these queries, not that their settings do (that needs seeds: a grid).

Each side is an evaluation output (`results.json` of eval/beir.py, eval/rag.py, eval/zeroshot.py or a
training run) with its per-query file beside it (`<stem>.queries.npz`). Keys pair by name, or by
prefix (`scifact.modes.cosine.` on one side for `scifact.` on the other, `zero_shot.` for `metrics.`),
and only where both sides were evaluated on the same queries (the digest each value array carries).
An STS evaluation keeps per-pair scores, not per-query means: its Spearman is paired instead, bootstrapped
over pairs (`paired_correlation`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from magclip.evaluation.suite import suite_outcomes
from magclip.experiments import stats
from magclip.experiments.report import format_p, interval, signed
from magclip.metrics.ranks import DIGEST_MARK, load_query_values, queries_path
from magclip.metrics.sts import correlations

HIGHER, LOWER = "row higher", "row lower"
STS_PARTS = ("pred_ab", "pred_ba", "gold")   # what an STS evaluation keeps per pair (evaluation.text.evaluate_sts)


@dataclass
class PairedMetric:
    """ROW − BASE on one per-query metric (raw units, 0-1 for nDCG or recall)."""

    base_key: str
    row_key: str
    n_queries: int
    base: float
    row: float
    diff: float
    low: float
    high: float
    p: float
    mde: float            # the smallest true difference this test detects at 80 % power
    verdict: str


def per_query_values(path: str | Path) -> dict[str, object]:
    """The per-query values beside an evaluation output (its `.queries.npz`, or that file itself)."""
    path = Path(path)
    npz = path if path.name.endswith(".npz") else queries_path(path)
    if not npz.is_file():
        raise FileNotFoundError(f"{npz}: no per-query values beside {path} (written by every evaluation "
                                "since they were kept; re-run the evaluation)")
    return load_query_values(npz)


def key_pairs(base: dict[str, object], row: dict[str, object], base_prefix: str = "",
              row_prefix: str = "") -> list[tuple[str, str]]:
    """(base key, row key) for every value array of `base` under `base_prefix` whose name with
    `row_prefix` in its place is in `row`, in `base`'s order."""
    pairs = []
    for key in base:
        if key.endswith(DIGEST_MARK) or not key.startswith(base_prefix):
            continue
        other = row_prefix + key[len(base_prefix):]
        if other in row and not other.endswith(DIGEST_MARK):
            pairs.append((key, other))
    return pairs


def compare_outputs(base_path: str | Path, row_path: str | Path, base_prefix: str = "", row_prefix: str = "",
                    n_resamples: int = stats.N_RESAMPLES) -> tuple[list[PairedMetric], list[str]]:
    """Every paired metric, and one line per key that could not be paired (other queries, other sizes)."""
    base, row = per_query_values(base_path), per_query_values(row_path)
    pairs = key_pairs(base, row, base_prefix, row_prefix)
    if not pairs:
        raise ValueError(f"no per-query metric of {base_path} (prefix {base_prefix!r}) has a counterpart in "
                         f"{row_path} (prefix {row_prefix!r}); keys there: "
                         + ", ".join(k for k in list(row)[:8] if not k.endswith(DIGEST_MARK)))
    found, skipped = [], []
    sts = {bk[:-len(STS_PARTS[0])]: rk[:-len(STS_PARTS[0])] for bk, rk in pairs
           if _has_sts_parts(base, bk) and _has_sts_parts(row, rk)}
    for bk, rk in sts.items():
        paired = paired_correlation(bk, rk, base, row, n_resamples)
        (found if isinstance(paired, PairedMetric) else skipped).append(paired)
    for bk, rk in pairs:
        if any(bk == prefix + part for prefix in sts for part in STS_PARTS):
            continue  # per-pair scores, not per-query means: paired above as their correlation
        b, r = np.asarray(base[bk], dtype=np.float64), np.asarray(row[rk], dtype=np.float64)
        if b.shape != r.shape or base.get(bk + DIGEST_MARK) != row.get(rk + DIGEST_MARK):
            skipped.append(f"{bk} / {rk}: evaluated on different queries ({len(b)} vs {len(r)}, or another digest)")
            continue
        found.append(paired_metric(bk, rk, b, r, n_resamples))
    return found, skipped


def _has_sts_parts(values: dict[str, object], key: str) -> bool:
    """`key` is an STS evaluation's `<prefix>pred_ab` with its `pred_ba` and `gold` beside it."""
    return key.endswith(STS_PARTS[0]) and all(key[:-len(STS_PARTS[0])] + part in values for part in STS_PARTS)


def paired_correlation(base_prefix: str, row_prefix: str, base: dict[str, object], row: dict[str, object],
                       n_resamples: int = stats.N_RESAMPLES) -> PairedMetric | str:
    """ROW − BASE Spearman of an STS evaluation's pair scores (the mean of both directions, as
    metrics.sts reports `spearman`) with the gold scores, bootstrapped over pairs
    (stats.correlation_item_stats); a line saying why not where the two were scored on other pairs."""
    (b_ab, b_ba, gold), (r_ab, r_ba, r_gold) = ([np.asarray(v[p + part], dtype=np.float64) for part in STS_PARTS]
                                                for v, p in ((base, base_prefix), (row, row_prefix)))
    key, other = base_prefix + "spearman", row_prefix + "spearman"
    same_pairs = all(base.get(base_prefix + part + DIGEST_MARK) == row.get(row_prefix + part + DIGEST_MARK)
                     for part in STS_PARTS)
    if b_ab.shape != r_ab.shape or not same_pairs or not np.array_equal(gold, r_gold):
        return f"{key} / {other}: scored on other pairs or against other gold scores"
    b_pred, r_pred = (b_ab + b_ba) / 2, (r_ab + r_ba) / 2
    found = stats.correlation_item_stats(gold, b_pred[None], r_pred[None], "spearman", n_resamples=n_resamples)
    b_corr, r_corr = (correlations(pred, gold)["spearman"] for pred in (b_pred, r_pred))
    diff = r_corr - b_corr
    return PairedMetric(key, other, found.n_items, b_corr, r_corr, diff, found.low, found.high, found.p,
                        stats.mde_normal(found.se), _verdict(found.p, found.low, found.high))


def compare_suites(base: str | Path, row: str | Path,
                   n_resamples: int = stats.N_RESAMPLES) -> tuple[list[PairedMetric], list[str]]:
    """Two benchmark suites' outputs (magclip.evaluation.suite): ROW − BASE per set and metric, paired by query
    on the images' and captions' R@k hits and the images' top-k classification hits; (paired metrics, one
    line per metric that could not be paired)."""
    a, b = suite_outcomes(base), suite_outcomes(row)
    found, skipped = [], []
    for key, (values_a, digest_a) in a.items():
        if key not in b:
            skipped.append(f"{key}: only in {base}")
            continue
        values_b, digest_b = b[key]
        if values_a.shape != values_b.shape or digest_a != digest_b:
            skipped.append(f"{key}: evaluated on different queries ({len(values_a)} vs {len(values_b)}, or another "
                           "digest)")
            continue
        found.append(paired_metric(key, key, values_a, values_b, n_resamples))
    skipped += [f"{key}: only in {row}" for key in b if key not in a]
    return found, skipped


def paired_metric(base_key: str, row_key: str, base: np.ndarray, row: np.ndarray,
                  n_resamples: int = stats.N_RESAMPLES) -> PairedMetric:
    d = (row - base)[None, :]
    boot = stats.bootstrap_ci(d, n_resamples=n_resamples)
    p = stats.permutation_pvalue(d, n_resamples=n_resamples)
    return PairedMetric(base_key, row_key, len(base), float(base.mean()), float(row.mean()), boot["mean"],
                        boot["low"], boot["high"], float(p), stats.mde_normal(boot["se"]),
                        _verdict(p, boot["low"], boot["high"]))


def _verdict(p: float, low: float, high: float) -> str:
    """Decided where the permutation p and the interval agree (excludes 0); else no difference detected."""
    decided = p < 1 - stats.CONFIDENCE and (low > 0 or high < 0)
    return (HIGHER if low > 0 else LOWER) if decided else stats.NO_DIFFERENCE


def markdown_table(found: list[PairedMetric], scale: float = 100.0, digits: int = 2) -> str:
    def f(x: float) -> str:
        return f"{x * scale:.{digits}f}".replace("-", "−")

    lines = ["| base key | row key | queries | base | row | Δ | 95 % CI (queries) | p | MDE (80 % power) | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for m in found:
        lines.append(f"| {m.base_key} | {m.row_key} | {m.n_queries} | {f(m.base)} | {f(m.row)} "
                     f"| {signed(m.diff, scale, digits)} | {interval(m.low, m.high, scale, digits)} "
                     f"| {format_p(m.p)} | {f(m.mde)} | {m.verdict} |")
    return "\n".join(lines)


def as_records(found: list[PairedMetric]) -> list[dict[str, object]]:
    return [asdict(m) for m in found]


__all__ = ["HIGHER", "LOWER", "PairedMetric", "as_records", "compare_outputs", "compare_suites", "key_pairs",
           "markdown_table", "paired_correlation", "paired_metric", "per_query_values"]
