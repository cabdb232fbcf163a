"""Semantic textual similarity: Spearman and Pearson between model scores and gold scores.

A pair (a, b) is scored with the Scorer on single pairs, s(a, b) = <prep_q(q(a)), prep_d(p(b))>,
a encoded on the query side and b on the passage side (prefixes and towers apply). For a mode
that is asymmetric in its two sides (qnorm, dnorm, fixed/learnable with gamma_q != gamma_d, or
different query and passage encoders) the order matters, so three results are reported:

- `*_ab`:   correlation of s(a, b) with gold,
- `*_ba`:   correlation of s(b, a) with gold,
- `*_mean`: correlation of the symmetrised score (s(a, b) + s(b, a)) / 2 with gold.

`spearman` / `pearson` (the headline numbers) are the `_mean` ones; for a symmetric mode with a
shared tower and equal prefixes all three coincide. Correlations are scipy's `spearmanr` /
`pearsonr` (×1, not ×100).

The files are read by magclip.data.sts; magclip.evaluation.text encodes and calls these.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from scipy.stats import pearsonr, spearmanr
from torch import Tensor

from magclip.similarity import Scorer


def pair_scores(a: Tensor, b: Tensor, scorer: Scorer | str) -> Tensor:
    """s(a_i, b_i) for each row i: the diagonal of scorer(a, b), without the full matrix."""
    scorer = Scorer.build(scorer)
    with torch.no_grad():
        return (scorer.prepare_queries(a) * scorer.prepare_docs(b)).sum(dim=-1)


def correlations(pred: np.ndarray | Tensor, gold: np.ndarray) -> dict[str, float]:
    pred = np.asarray(pred, dtype=np.float64)
    return {"spearman": float(spearmanr(pred, gold).statistic), "pearson": float(pearsonr(pred, gold).statistic)}


def sts_pair_scores(q1: Tensor, p1: Tensor, q2: Tensor, p2: Tensor, scorer: Scorer | str) -> tuple[np.ndarray, np.ndarray]:
    """(s(a, b), s(b, a)) per pair from query-side (q*) and passage-side (p*) embeddings of sentence1
    (·1) and sentence2 (·2), float64."""
    return pair_scores(q1, p2, scorer).double().numpy(), pair_scores(q2, p1, scorer).double().numpy()


def sts_from_scores(ab: np.ndarray, ba: np.ndarray, gold: np.ndarray) -> dict[str, Any]:
    """Every correlation of the module docstring from the per-pair scores both ways."""
    out: dict[str, Any] = {}
    for tag, pred in (("ab", ab), ("ba", ba), ("mean", (ab + ba) / 2)):
        for metric, value in correlations(pred, gold).items():
            out[f"{metric}_{tag}"] = value
    out["spearman"] = out["spearman_mean"]
    out["pearson"] = out["pearson_mean"]
    out["max_abs_diff_ab_ba"] = float(np.abs(ab - ba).max()) if len(ab) else 0.0
    return out


def sts_from_embeddings(q1: Tensor, p1: Tensor, q2: Tensor, p2: Tensor, gold: np.ndarray,
                        scorer: Scorer | str) -> dict[str, Any]:
    """Correlations from query-side (q*) and passage-side (p*) embeddings of sentence1 (·1) and sentence2 (·2)."""
    return sts_from_scores(*sts_pair_scores(q1, p1, q2, p2, scorer), gold)
