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

Files: TSV with a header naming `score`, `sentence1`, `sentence2` (any column order), tab separated,
no quoting (the layout of ../shared/data/text/stsb).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from scipy.stats import pearsonr, spearmanr
from torch import Tensor

from magclip.similarity import Scorer


@dataclass
class STSData:
    name: str
    sentence1: list[str]
    sentence2: list[str]
    scores: np.ndarray


def read_sts(path: str | Path, name: str | None = None) -> STSData:
    path = Path(path)
    s1, s2, gold = [], [], []
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        missing = {"score", "sentence1", "sentence2"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: header {reader.fieldnames} lacks {sorted(missing)}")
        for number, row in enumerate(reader, start=2):
            if row["sentence1"] is None or row["sentence2"] is None:
                raise ValueError(f"{path}:{number}: expected 3 tab-separated fields")
            s1.append(row["sentence1"])
            s2.append(row["sentence2"])
            gold.append(float(row["score"]))
    return STSData(name or path.stem, s1, s2, np.asarray(gold, dtype=np.float64))


def pair_scores(a: Tensor, b: Tensor, scorer: Scorer | str) -> Tensor:
    """s(a_i, b_i) for each row i: the diagonal of scorer(a, b), without the full matrix."""
    scorer = Scorer.build(scorer)
    with torch.no_grad():
        return (scorer.prepare_queries(a) * scorer.prepare_docs(b)).sum(dim=-1)


def correlations(pred: np.ndarray | Tensor, gold: np.ndarray) -> dict[str, float]:
    pred = np.asarray(pred, dtype=np.float64)
    return {"spearman": float(spearmanr(pred, gold).statistic), "pearson": float(pearsonr(pred, gold).statistic)}


def sts_from_embeddings(q1: Tensor, p1: Tensor, q2: Tensor, p2: Tensor, gold: np.ndarray,
                        scorer: Scorer | str) -> dict[str, Any]:
    """Correlations from query-side (q*) and passage-side (p*) embeddings of sentence1 (·1) and sentence2 (·2)."""
    ab = pair_scores(q1, p2, scorer).double().numpy()
    ba = pair_scores(q2, p1, scorer).double().numpy()
    out: dict[str, Any] = {}
    for tag, pred in (("ab", ab), ("ba", ba), ("mean", (ab + ba) / 2)):
        for metric, value in correlations(pred, gold).items():
            out[f"{metric}_{tag}"] = value
    out["spearman"] = out["spearman_mean"]
    out["pearson"] = out["pearson_mean"]
    out["max_abs_diff_ab_ba"] = float(np.abs(ab - ba).max()) if len(ab) else 0.0
    return out


def evaluate_sts(encode: Callable[[list[str], str], Tensor], data: STSData, scorer: Scorer | str,
                 same_sides: bool = False) -> dict[str, Any]:
    """Encode each sentence on both sides (once if `same_sides`: query and passage encodings are
    identical, as for a shared tower with equal prefixes and max lengths) and correlate."""
    scorer = Scorer.build(scorer)
    q1 = encode(data.sentence1, "query")
    q2 = encode(data.sentence2, "query")
    p1, p2 = (q1, q2) if same_sides else (encode(data.sentence1, "passage"), encode(data.sentence2, "passage"))
    out = sts_from_embeddings(q1, p1, q2, p2, data.scores, scorer)
    out.update({"pairs": len(data.scores), "scorer": scorer.to_dict(),
                "norm_mean": float(torch.cat([q1, q2]).norm(dim=-1).mean())})
    return out
