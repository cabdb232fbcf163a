"""Magnitude diagnostics: norm statistics, Cohen's d of norms by relevance, and plots.

Does embedding magnitude carry relevance? If relevant documents are systematically longer than
the documents they compete with, a score that keeps the document magnitude (qnorm, dot) can use
it; if they are shorter, keeping it hurts and dnorm/cosine is safer. The same question on the
query side (queries as the candidates of a document) is the case for dnorm in the transposed
direction. Everything here works on RAW (unnormalized) features and one `Scorer`.

What is computed (`relevance_norms`, `magnitude_report`)
----------------------------------------------------------
Input: raw query features Q [Nq, D], raw document features X [Nd, D], the relevant documents of
each query (`relevance[i]`: a set of document indices) and a Scorer that ranks documents.

- `norm_stats`: count, mean, std (ddof=1), min, quantiles (5/25/50/75/95 %), max and coefficient
  of variation of the L2 norms of one side.
- Cohen's d (`cohens_d`): d = (mean(a) - mean(b)) / s_p with the pooled standard deviation
  s_p = sqrt(((n_a - 1) var_a + (n_b - 1) var_b) / (n_a + n_b - 2)), variances with ddof=1.
  a = norms of relevant items, b = norms of non-relevant items, so d > 0 means relevant items are
  LONGER than non-relevant ones.
- Document side, scope "topk" (default): for every query, a = the norms of its relevant
  documents, b = the norms of its k highest-scoring NON-relevant documents under the Scorer (the
  competitors it has to beat; k = `k`, default 10). Samples are pooled over queries (a document
  relevant to two queries counts twice).
- Document side, scope "corpus": a = every document relevant to at least one query, b = every
  other document; each document once. (For CLIP with one caption per image every document is
  relevant to something, so this scope is skipped there.)
- Query side: the same "topk" analysis transposed: every document that has a relevant query is
  an anchor, a = norms of its relevant queries, b = norms of its k highest-scoring non-relevant
  queries under the transposed Scorer (`Scorer.transposed()`: same score, roles swapped).
- Query success: a = norms of queries whose top-1 document is relevant, b = the others.
- Confidence interval (`bootstrap_cohens_d`): percentile bootstrap, `n_boot` resamples (default
  1000, fixed seed). For "topk" scopes the resampling unit is the anchor (query or document) with
  all its samples (a cluster bootstrap: samples of one query are not independent); for "corpus"
  and query success the unit is the single value, resampled within each group.

CLIP: documents of image->text are captions, of text->image images. Relevance is the retrieval
evaluation's (magclip.metrics.relevance): caption identity (an image's relevant captions are every
caption identical to one of its own) or by image (CLIP_benchmark's), over any number of captions per
image. So "text as document" is the i2t doc side and "image as document" the t2i doc side.

Plots (matplotlib, Agg backend): norm histograms by relevance, the norm of each relevant document
against its rank, and gamma_q / gamma_d, logit scale and mean norms over training from a run's
metrics.jsonl.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from magclip.diagnostics.plots import pyplot, save_figure
from magclip.metrics.relevance import MATCHING, clip_relevance
from magclip.similarity import Scorer

QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


# ============================================================================ statistics


def norm_stats(x: Tensor | np.ndarray) -> dict[str, float]:
    """Statistics of the L2 norms of the rows of `x` (or of `x` itself when 1-D: already norms)."""
    n = _as_numpy(x)
    if n.ndim == 2:
        n = np.linalg.norm(n, axis=1)
    if n.size == 0:
        return {"n": 0}
    out = {"n": int(n.size), "mean": float(n.mean()), "std": float(n.std(ddof=1)) if n.size > 1 else 0.0,
           "min": float(n.min()), "max": float(n.max())}
    for q, v in zip(QUANTILES, np.quantile(n, QUANTILES)):
        out[f"q{round(100 * q):02d}"] = float(v)
    out["cv"] = out["std"] / out["mean"] if out["mean"] > 0 else float("nan")
    return out


def cohens_d(a: Sequence[float] | np.ndarray | Tensor, b: Sequence[float] | np.ndarray | Tensor) -> float:
    """(mean(a) - mean(b)) / pooled SD, variances with ddof=1 (the textbook two-sample d).

    NaN when either group has fewer than 1 value, or both together fewer than 3, or the pooled SD
    is 0.
    """
    a, b = _as_numpy(a).ravel(), _as_numpy(b).ravel()
    na, nb = a.size, b.size
    if na < 1 or nb < 1 or na + nb < 3:
        return float("nan")
    va = a.var(ddof=1) if na > 1 else 0.0
    vb = b.var(ddof=1) if nb > 1 else 0.0
    sp = math.sqrt(((na - 1) * va + (nb - 1) * vb) / (na + nb - 2))
    if sp == 0:
        return float("nan")
    return float((a.mean() - b.mean()) / sp)


def _d_from_moments(n_a, s_a, ss_a, n_b, s_b, ss_b) -> np.ndarray:
    """Vectorized Cohen's d from counts, sums and sums of squares (arrays of bootstrap replicates)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        m_a, m_b = s_a / n_a, s_b / n_b
        ssd_a = np.maximum(ss_a - n_a * m_a ** 2, 0.0)  # (n - 1) * var
        ssd_b = np.maximum(ss_b - n_b * m_b ** 2, 0.0)
        sp = np.sqrt((ssd_a + ssd_b) / (n_a + n_b - 2))
        d = (m_a - m_b) / sp
    bad = (n_a < 1) | (n_b < 1) | (n_a + n_b < 3) | ~np.isfinite(d)
    return np.where(bad, np.nan, d)


def bootstrap_cohens_d(a: Sequence[float] | np.ndarray | Tensor, b: Sequence[float] | np.ndarray | Tensor, *,
                       clusters_a: Sequence[int] | np.ndarray | None = None,
                       clusters_b: Sequence[int] | np.ndarray | None = None,
                       n_boot: int = 1000, level: float = 0.95, seed: int = 0) -> dict[str, Any]:
    """Cohen's d of a vs b with a percentile bootstrap confidence interval.

    Without clusters each group's values are resampled with replacement on their own. With
    `clusters_a` and `clusters_b` (one cluster id per value, e.g. the query a sample belongs to)
    whole clusters are resampled with replacement, each drawn cluster bringing all its a and b
    values (cluster bootstrap). Replicates where d is undefined are dropped (counted in
    `n_boot_valid`).
    """
    a, b = _as_numpy(a).ravel().astype(np.float64), _as_numpy(b).ravel().astype(np.float64)
    d = cohens_d(a, b)
    out: dict[str, Any] = {"d": d, "n_a": int(a.size), "n_b": int(b.size), "mean_a": _mean(a), "mean_b": _mean(b),
                           "n_boot": int(n_boot), "level": level}
    rng = np.random.default_rng(seed)
    if (clusters_a is None) != (clusters_b is None):
        raise ValueError("give clusters for both groups or for neither")
    if clusters_a is not None:
        ca, cb = np.asarray(clusters_a).ravel(), np.asarray(clusters_b).ravel()
        if ca.size != a.size or cb.size != b.size:
            raise ValueError("one cluster id per value is needed")
        ids, inv = np.unique(np.concatenate([ca, cb]), return_inverse=True)
        ia, ib = inv[:a.size], inv[a.size:]
        k = ids.size
        mom_a = np.stack([np.bincount(ia, minlength=k), np.bincount(ia, a, k), np.bincount(ia, a * a, k)], 1)
        mom_b = np.stack([np.bincount(ib, minlength=k), np.bincount(ib, b, k), np.bincount(ib, b * b, k)], 1)
        counts = rng.multinomial(k, np.full(k, 1.0 / k), size=n_boot).astype(np.float64)  # [B, K]
        ma, mb = counts @ mom_a, counts @ mom_b
        reps = _d_from_moments(ma[:, 0], ma[:, 1], ma[:, 2], mb[:, 0], mb[:, 1], mb[:, 2])
        out["resampled"] = f"clusters ({k})"
    else:
        reps = np.full(n_boot, np.nan)
        if a.size and b.size:
            chunk = max(1, int(2e7 // max(a.size, b.size)))
            parts = []
            for start in range(0, n_boot, chunk):
                m = min(chunk, n_boot - start)
                ca = rng.multinomial(a.size, np.full(a.size, 1.0 / a.size), size=m).astype(np.float64)
                cb = rng.multinomial(b.size, np.full(b.size, 1.0 / b.size), size=m).astype(np.float64)
                parts.append(_d_from_moments(ca.sum(1), ca @ a, ca @ (a * a), cb.sum(1), cb @ b, cb @ (b * b)))
            reps = np.concatenate(parts)
        out["resampled"] = "values within each group"
    valid = reps[np.isfinite(reps)]
    out["n_boot_valid"] = int(valid.size)
    alpha = (1 - level) / 2
    if valid.size:
        lo, hi = np.quantile(valid, [alpha, 1 - alpha])
        out["ci_low"], out["ci_high"] = float(lo), float(hi)
    else:
        out["ci_low"] = out["ci_high"] = float("nan")
    return out


# ============================================================================ relevance and ranks


def relevance_from_ids(query_ids: Sequence[str], doc_ids: Sequence[str], qrels: Mapping[str, Mapping[str, int]],
                       min_score: int = 1) -> list[set[int]]:
    """Relevant document indices per query from BEIR-style qrels (score >= min_score, doc present)."""
    pos = {d: j for j, d in enumerate(doc_ids)}
    return [{pos[d] for d, s in qrels.get(q, {}).items() if s >= min_score and d in pos} for q in query_ids]


def relevance_from_labels(query_labels: Sequence[Any], doc_labels: Sequence[Any]) -> list[set[int]]:
    """Relevant = same label (e.g. caption identity for CLIP)."""
    by_label: dict[Any, set[int]] = {}
    for j, lab in enumerate(doc_labels):
        by_label.setdefault(lab, set()).add(j)
    return [set(by_label.get(lab, ())) for lab in query_labels]


def transpose_relevance(relevance: Sequence[set[int]], num_docs: int) -> list[set[int]]:
    """Relevant queries per document."""
    out: list[set[int]] = [set() for _ in range(num_docs)]
    for i, rel in enumerate(relevance):
        for j in rel:
            out[j].add(i)
    return out


@torch.no_grad()
def relevance_norms(queries: Tensor, docs: Tensor, relevance: Sequence[set[int]], scorer: Scorer | str,
                    k: int = 10, chunk: int = 256) -> dict[str, np.ndarray]:
    """Per-query samples for the "topk" analysis and the rank of every relevant document.

    Returns numpy arrays: `rel_norm`, `rel_anchor`, `rel_doc` (norm, query index and document index
    of each (query, relevant document) pair), `rel_rank` (its 1-based rank among all documents under the scorer, ties
    counted against it: 1 + number of documents scoring strictly higher), `neg_norm`, `neg_anchor`,
    `neg_doc` (the k highest-scoring non-relevant documents of each query), `hit1` (per query: is the top-1
    document relevant) and `query_norm`. Queries without any relevant document are skipped (their
    `hit1` is False and they are listed in `skipped_queries`).
    """
    scorer = Scorer.build(scorer)
    if queries.shape[0] != len(relevance):
        raise ValueError(f"{queries.shape[0]} queries but {len(relevance)} relevance sets")
    q = scorer.prepare_queries(queries)
    x = scorer.prepare_docs(docs)
    doc_norm = docs.float().norm(dim=-1).numpy()
    nd = docs.shape[0]
    rel_norm, rel_anchor, rel_rank, rel_doc, neg_norm, neg_anchor, neg_doc = [], [], [], [], [], [], []
    hit1 = np.zeros(len(relevance), dtype=bool)
    skipped = []
    for start in range(0, q.shape[0], chunk):
        s = q[start:start + chunk] @ x.T
        for r in range(s.shape[0]):
            i = start + r
            rel = sorted(relevance[i])
            if not rel:
                skipped.append(i)
                continue
            row = s[r]
            rel_idx = torch.tensor(rel, dtype=torch.long)
            rel_scores = row[rel_idx]
            ranks = 1 + (row.unsqueeze(0) > rel_scores.unsqueeze(1)).sum(dim=1)
            rel_norm.extend(doc_norm[rel].tolist())
            rel_anchor.extend([i] * len(rel))
            rel_doc.extend(rel)
            rel_rank.extend(ranks.tolist())
            hit1[i] = bool(int(row.argmax()) in relevance[i])
            masked = row.clone()
            masked[rel_idx] = -torch.inf
            kk = min(k, nd - len(rel))
            if kk > 0:
                top = masked.topk(kk).indices.numpy()
                neg_norm.extend(doc_norm[top].tolist())
                neg_anchor.extend([i] * kk)
                neg_doc.extend(top.tolist())
    return {"rel_norm": np.asarray(rel_norm), "rel_anchor": np.asarray(rel_anchor, dtype=np.int64),
            "rel_rank": np.asarray(rel_rank, dtype=np.int64), "rel_doc": np.asarray(rel_doc, dtype=np.int64),
            "neg_norm": np.asarray(neg_norm), "neg_anchor": np.asarray(neg_anchor, dtype=np.int64),
            "neg_doc": np.asarray(neg_doc, dtype=np.int64), "hit1": hit1,
            "query_norm": queries.float().norm(dim=-1).numpy(), "skipped_queries": np.asarray(skipped, dtype=np.int64)}


def side_report(queries: Tensor, docs: Tensor, relevance: Sequence[set[int]], scorer: Scorer | str, *, k: int = 10,
                corpus_scope: bool = True, n_boot: int = 1000, seed: int = 0) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Cohen's d of document norms (topk, and corpus when asked) and of query success for one direction.

    Returns (JSON-able summary, the raw samples of `relevance_norms` for plots).
    """
    scorer = Scorer.build(scorer)
    r = relevance_norms(queries, docs, relevance, scorer, k=k)
    out: dict[str, Any] = {"scorer": scorer.to_dict(), "k": k,
                           "queries_with_relevant": int(len(relevance) - r["skipped_queries"].size)}
    out["doc_topk"] = bootstrap_cohens_d(r["rel_norm"], r["neg_norm"], clusters_a=r["rel_anchor"],
                                         clusters_b=r["neg_anchor"], n_boot=n_boot, seed=seed)
    if corpus_scope:
        relevant_any = set().union(*relevance) if relevance else set()
        doc_norm = docs.float().norm(dim=-1).numpy()
        mask = np.zeros(docs.shape[0], dtype=bool)
        mask[list(relevant_any)] = True
        if mask.all() or not mask.any():
            out["doc_corpus"] = {"d": float("nan"), "note": "every document (or none) is relevant to some query"}
        else:
            out["doc_corpus"] = bootstrap_cohens_d(doc_norm[mask], doc_norm[~mask], n_boot=n_boot, seed=seed)
    have = np.ones(len(relevance), dtype=bool)
    have[r["skipped_queries"]] = False
    qn = r["query_norm"][have]
    h = r["hit1"][have]
    out["query_hit1"] = bootstrap_cohens_d(qn[h], qn[~h], n_boot=n_boot, seed=seed)
    out["hit1_rate"] = float(h.mean()) if h.size else float("nan")
    ranks = r["rel_rank"]
    out["spearman_rel_norm_vs_rank"] = float("nan")
    if ranks.size > 2 and np.ptp(ranks) > 0 and np.ptp(r["rel_norm"]) > 0:
        from scipy.stats import spearmanr
        rho = spearmanr(r["rel_norm"], ranks).correlation
        out["spearman_rel_norm_vs_rank"] = float(rho)
    out["rel_rank_median"] = float(np.median(ranks)) if ranks.size else float("nan")
    return out, r


def magnitude_report(queries: Tensor, docs: Tensor, relevance: Sequence[set[int]], scorer: Scorer | str, *,
                     k: int = 10, n_boot: int = 1000, seed: int = 0, corpus_scope: bool = True,
                     names: tuple[str, str] = ("query", "document")) -> tuple[dict[str, Any], dict[str, Any]]:
    """Norm statistics of both sides, Cohen's d of document norms and of query norms (transposed).

    Returns (summary for JSON, samples for plots). In the summary:
    `norms` (per side), `doc_side` (this direction: documents are the candidates) and `query_side`
    (the transposed direction: queries are the candidates of each document that has a relevant
    query), each with `doc_topk` d + CI (and `doc_corpus` on the document side when asked).
    """
    scorer = Scorer.build(scorer)
    qname, dname = names
    doc_side, doc_samples = side_report(queries, docs, relevance, scorer, k=k, corpus_scope=corpus_scope,
                                        n_boot=n_boot, seed=seed)
    rel_t = transpose_relevance(relevance, docs.shape[0])
    query_side, query_samples = side_report(docs, queries, rel_t, scorer.transposed(), k=k, corpus_scope=False,
                                            n_boot=n_boot, seed=seed)
    summary = {"norms": {qname: norm_stats(queries), dname: norm_stats(docs)},
               "doc_side": {"candidates": dname, "anchors": qname, **doc_side},
               "query_side": {"candidates": qname, "anchors": dname, **query_side},
               "definition": "Cohen's d = (mean relevant - mean non-relevant) / pooled SD; topk: per anchor, its "
                             f"relevant candidates vs its top-{k} non-relevant candidates under the scorer, pooled "
                             "over anchors, cluster bootstrap over anchors"}
    return summary, {"doc_side": doc_samples, "query_side": query_samples, "names": names}


# ============================================================================ data entry points


def clip_magnitude_report(image_features: Tensor, text_features: Tensor, captions: Sequence[str],
                          scorers: Mapping[str, Scorer], *, k: int = 10, n_boot: int = 1000,
                          seed: int = 0, caption_counts: Sequence[int] | None = None,
                          matching: str = "caption") -> tuple[dict[str, Any], dict[str, Any]]:
    """Magnitude report for CLIP features, relevance by `matching` (magclip.metrics.relevance: caption
    identity, or by image) over images with `caption_counts[i]` captions each (None: one each).

    doc_side: texts as candidates of image queries, ranked by scorers["i2t"]; query_side: images as
    candidates of text queries, ranked by scorers["t2i"] (the t2i direction's own document side).
    The "corpus" scope is skipped: every caption is relevant to its own image."""
    rel_i2t, rel_t2i = clip_relevance(captions, caption_counts, matching)
    doc_side, doc_samples = side_report(image_features, text_features, rel_i2t.as_sets(), scorers["i2t"], k=k,
                                        corpus_scope=False, n_boot=n_boot, seed=seed)
    query_side, query_samples = side_report(text_features, image_features, rel_t2i.as_sets(), scorers["t2i"], k=k,
                                            corpus_scope=False, n_boot=n_boot, seed=seed)
    summary = {"norms": {"image": norm_stats(image_features), "text": norm_stats(text_features)},
               "doc_side": {"candidates": "text", "anchors": "image", "direction": "i2t", **doc_side},
               "query_side": {"candidates": "image", "anchors": "text", "direction": "t2i", **query_side},
               "relevance": MATCHING[matching], "matching": matching,
               "data": {"samples": int(image_features.shape[0]), "captions": len(captions),
                        "unique_captions": len(set(captions))},
               "definition": "Cohen's d = (mean relevant - mean non-relevant) / pooled SD; per anchor, its "
                             f"relevant candidates vs its top-{k} non-relevant candidates under the direction's "
                             "scorer, pooled over anchors, cluster bootstrap over anchors"}
    return summary, {"doc_side": doc_samples, "query_side": query_samples, "names": ("image", "text")}


# ============================================================================ plots



def plot_norm_histograms(samples: Mapping[str, Any], summary: Mapping[str, Any], path: str | Path,
                         title: str = "") -> Path:
    """Two panels (document side, query side): norms of relevant vs top-k non-relevant candidates."""
    plt = pyplot()
    qname, dname = samples.get("names", ("query", "document"))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, side, cand in ((axes[0], "doc_side", dname), (axes[1], "query_side", qname)):
        s, info = samples[side], summary[side]["doc_topk"]
        rel, neg = s["rel_norm"], s["neg_norm"]
        if rel.size and neg.size:
            lo, hi = float(min(rel.min(), neg.min())), float(max(rel.max(), neg.max()))
            bins = np.linspace(lo, hi if hi > lo else lo + 1, 40)
            ax.hist(neg, bins=bins, density=True, alpha=0.5, label=f"top-k non-relevant (n={neg.size})")
            ax.hist(rel, bins=bins, density=True, alpha=0.5, label=f"relevant (n={rel.size})")
        ax.set_xlabel(f"{cand} norm")
        ax.set_ylabel("density")
        ax.set_title(f"{cand} as candidate: d = {info['d']:.3f} [{info['ci_low']:.3f}, {info['ci_high']:.3f}]",
                     fontsize=9)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_norm_vs_rank(samples: Mapping[str, Any], summary: Mapping[str, Any], path: str | Path, title: str = "") -> Path:
    """Norm of every relevant candidate against its rank (log scale), both sides."""
    plt = pyplot()
    qname, dname = samples.get("names", ("query", "document"))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, side, cand in ((axes[0], "doc_side", dname), (axes[1], "query_side", qname)):
        s = samples[side]
        if s["rel_rank"].size:
            ax.scatter(s["rel_norm"], s["rel_rank"], s=6, alpha=0.5)
            ax.set_yscale("log")
        rho = summary[side].get("spearman_rel_norm_vs_rank", float("nan"))
        mode = summary[side]["scorer"]["mode"]
        ax.set_xlabel(f"norm of the relevant {cand}")
        ax.set_ylabel(f"its rank ({mode})")
        ax.set_title(f"{cand} as candidate: Spearman(norm, rank) = {rho:.3f}", fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The training log lines of a run's metrics.jsonl (lines with a `step`; others ignored)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and "step" in row:
                rows.append(row)
    return rows


def training_curves(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """(step, value) series of every gamma_*, logit_scale and norm_* key in the log."""
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in row.items():
            if (key.startswith(("gamma_", "norm_")) or key == "logit_scale") and \
                    isinstance(value, (int, float)):
                series.setdefault(key, []).append((int(row["step"]), float(value)))
    return series


def plot_training_curves(metrics_path: str | Path, path: str | Path, title: str = "") -> Path | None:
    """gamma_q/gamma_d (per direction), logit scale and mean norms over training; None if the log has none."""
    series = training_curves(read_metrics(metrics_path))
    if not series:
        return None
    plt = pyplot()
    panels = [("exponents", [k for k in series if k.startswith("gamma_")], (-0.05, 1.05)),
              ("logit scale", [k for k in series if k == "logit_scale"], None),
              ("mean raw norm", [k for k in series if k.startswith("norm_")], None)]
    panels = [p for p in panels if p[1]]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (name, keys, ylim) in zip(axes[0], panels):
        for key in sorted(keys):
            steps, values = zip(*series[key])
            ax.plot(steps, values, label=key, marker="." if len(steps) < 30 else None)
        ax.set_xlabel("step")
        ax.set_title(name, fontsize=9)
        if ylim:
            ax.set_ylim(*ylim)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)




# ============================================================================ helpers


def _as_numpy(x) -> np.ndarray:
    if isinstance(x, Tensor):
        return x.detach().double().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def _mean(x: np.ndarray) -> float:
    return float(x.mean()) if x.size else float("nan")


__all__ = [
    "bootstrap_cohens_d",
    "clip_magnitude_report",
    "cohens_d",
    "magnitude_report",
    "norm_stats",
    "plot_norm_histograms",
    "plot_norm_vs_rank",
    "plot_training_curves",
    "read_metrics",
    "relevance_from_ids",
    "relevance_from_labels",
    "relevance_norms",
    "side_report",
    "training_curves",
    "transpose_relevance",
]
