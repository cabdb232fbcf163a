"""Caption specificity and the norm: does a CLIP embedding's length carry how much its caption says
(`caption_detail`, mentioned attributes / (3 x objects)) or how much its image holds (`num_objects`)?

The synthetic scenes (magclip.data.synthetic) write both into every sample's KEY.json; any shard set
whose KEY.json carries them is read the same way. With caption identity as relevance (as the
retrieval evaluation), per evaluation:

- Spearman ρ(text norm, caption_detail) and ρ(image norm, num_objects), each with its 95 % interval
  (Fisher z with the Fieller-Hartley-Pearson variance 1.06 / (n - 3), the usual one for Spearman);
- Cohen's d of text norms, detailed captions against vague ones (DETAIL_BINS);
- R@1 per direction and detail bin (the query's own caption's bin), the per-query hits kept;
- per direction, how the matching candidate's norm stands against the query's top-k competitors
  (the best-scored candidates with another caption): log ||match|| - mean log ||competitor||, one
  value per query, kept, so that two runs on the same items pair query by query.

The numbers are flat keys under `specificity/` so that they sit in a results.json's metrics dict
beside R@1 and a grid column can name them (`metrics.specificity/rho_text_norm_detail`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from scipy import stats as sps
from torch import Tensor

from magclip.diagnostics.magnitude import cohens_d
from magclip.metrics.ranks import RetrievalMetrics
from magclip.metrics.retrieval import ids_from_labels
from magclip.similarity import Scorer

PREFIX = "specificity/"
# (name, low, high]: vague = at most a third of what there is to say (one attribute of each object, or
# less), detailed = more than two thirds (on the synthetic scenes: everything about every object)
DETAIL_BINS: tuple[tuple[str, float, float], ...] = (("vague", 0.0, 1 / 3), ("partial", 1 / 3, 2 / 3),
                                                     ("detailed", 2 / 3, 1.0))
COMPETITORS = 5      # top-k non-matching candidates a matching candidate's norm is compared with
SPEARMAN_VARIANCE = 1.06
_TOLERANCE = 1e-3    # detail values are rounded fractions (0.6667 is two thirds)
DIRECTIONS = {"image_to_text": ("i2t", "image", "text"), "text_to_image": ("t2i", "text", "image")}


def detail_bin(detail: float) -> str | None:
    """The DETAIL_BINS name of a caption_detail value (the first bin whose top it does not pass), None
    outside [0, 1]."""
    if not 0.0 <= detail <= 1.0 + _TOLERANCE:
        return None
    return next(name for name, _, high in DETAIL_BINS if detail <= high + _TOLERANCE)


def specificity_values(metas: Sequence[Mapping[str, Any] | None]) -> tuple[np.ndarray, np.ndarray]:
    """(caption_detail, num_objects) per sample as floats, NaN where KEY.json did not give it."""
    def number(meta: Mapping[str, Any] | None, key: str) -> float:
        value = meta.get(key) if isinstance(meta, Mapping) else None
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan

    return (np.array([number(m, "caption_detail") for m in metas], dtype=np.float64),
            np.array([number(m, "num_objects") for m in metas], dtype=np.float64))


def spearman_with_interval(x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """ρ, its 95 % interval and n over the pairs where both are finite (NaN where n < 4 or a side is constant)."""
    keep = np.isfinite(x) & np.isfinite(y)
    n = int(keep.sum())
    if n < 4 or np.ptp(x[keep]) == 0 or np.ptp(y[keep]) == 0:
        return {"rho": math.nan, "ci_low": math.nan, "ci_high": math.nan, "n": n}
    rho = float(sps.spearmanr(x[keep], y[keep]).statistic)
    z, half = math.atanh(min(max(rho, -0.999999), 0.999999)), 1.959964 * math.sqrt(SPEARMAN_VARIANCE / (n - 3))
    return {"rho": rho, "ci_low": math.tanh(z - half), "ci_high": math.tanh(z + half), "n": n}


@torch.no_grad()
def match_norm_gaps(queries: Tensor, candidates: Tensor, ids: Tensor, scorer: Scorer, k: int = COMPETITORS,
                    chunk_size: int = 1024) -> np.ndarray:
    """Per query i (its matching candidate is candidate i): log ||candidate i|| - the mean log norm of
    its top-k candidates under `scorer` whose id differs from its own (NaN with no such candidate)."""
    log_norms = candidates.float().norm(dim=-1).clamp_min(1e-12).log()
    gaps = []
    for start in range(0, len(queries), chunk_size):
        q_ids = ids[start:start + chunk_size]
        scores = scorer(queries[start:start + chunk_size].float(), candidates.float())
        scores = scores.masked_fill(q_ids[:, None] == ids[None, :], -math.inf)
        top = scores.topk(min(k, scores.shape[1]), dim=1)
        competitor = torch.where(torch.isfinite(top.values), log_norms[top.indices], torch.nan)
        gaps.append(log_norms[start:start + len(q_ids)] - competitor.nanmean(dim=1))
    return torch.cat(gaps).numpy().astype(np.float64)


def specificity_metrics(image_features: Tensor, text_features: Tensor, captions: Sequence[str],
                        keys: Sequence[str], metas: Sequence[Mapping[str, Any] | None],
                        scorers: Mapping[str, Scorer], ranks: Mapping[str, np.ndarray],
                        k: int = COMPETITORS) -> RetrievalMetrics:
    """The module's numbers for one evaluation (empty when no sample's KEY.json gives caption_detail);
    `ranks`: a retrieval evaluation's 0-based ranks per direction, in sample order."""
    detail, objects = specificity_values(metas)
    out = RetrievalMetrics()
    if not np.isfinite(detail).any():
        return out
    image_norms = image_features.float().norm(dim=-1).numpy().astype(np.float64)
    text_norms = text_features.float().norm(dim=-1).numpy().astype(np.float64)
    out[PREFIX + "samples_with_detail"] = int(np.isfinite(detail).sum())
    for name, (norms, values) in {"text_norm_detail": (text_norms, detail),
                                  "image_norm_objects": (image_norms, objects)}.items():
        r = spearman_with_interval(norms, values)
        out[f"{PREFIX}rho_{name}"] = r["rho"]
        out[f"{PREFIX}rho_{name}_ci_low"], out[f"{PREFIX}rho_{name}_ci_high"] = r["ci_low"], r["ci_high"]
    bins = np.array([detail_bin(x) if np.isfinite(x) else None for x in detail], dtype=object)
    out[PREFIX + "d_text_norm_detailed_vs_vague"] = cohens_d(text_norms[bins == "detailed"],
                                                              text_norms[bins == "vague"])
    ids = ids_from_labels(list(captions))
    for direction, (short, query_side, _) in DIRECTIONS.items():
        if direction not in ranks or short not in scorers:
            continue
        hits = (np.asarray(ranks[direction]) == 0).astype(np.float64)
        for name, _, _ in DETAIL_BINS:
            chosen = np.flatnonzero(bins == name)
            out[f"{PREFIX}{direction}_R@1_{name}"] = float(hits[chosen].mean()) if chosen.size else math.nan
            out[f"{PREFIX}{direction}_n_{name}"] = int(chosen.size)
            if chosen.size:
                out.add_values(f"{PREFIX}{direction}_R@1_{name}", hits[chosen], [keys[i] for i in chosen])
        queries, candidates = ((image_features, text_features) if query_side == "image"
                               else (text_features, image_features))
        gaps = match_norm_gaps(queries, candidates, ids, scorers[short], k)
        finite = np.isfinite(gaps)
        out[f"{PREFIX}{direction}_match_norm_gap"] = float(gaps[finite].mean()) if finite.any() else math.nan
        out[f"{PREFIX}{direction}_match_longer_share"] = float((gaps[finite] > 0).mean()) if finite.any() else math.nan
        if finite.any():
            out.add_values(f"{PREFIX}{direction}_match_norm_gap", gaps[finite],
                           [keys[i] for i in np.flatnonzero(finite)])
    return out
