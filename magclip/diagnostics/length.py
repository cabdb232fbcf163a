"""Length confounds: is a magnitude effect about relevance, or about how long the text is?

A cosine-pretrained encoder with mean pooling gives short texts large raw norms (averaging fewer
token vectors cancels less). A mode that keeps the document magnitude then prefers short documents
whatever their relevance, and a "magnitude helps / hurts" result can be a length effect. These
diagnostics separate the two. Everything works on raw vectors, token counts and one `Scorer`.

What is computed (`length_report`)
-----------------------------------
- Lengths: untruncated token counts (prefix and special tokens included, `BiEncoder.token_lengths`);
  `over_max` = share of texts longer than the encoder's max length (those were cut when encoded).
- Norm-length correlation (`length_correlation`): Spearman's rho (scipy.stats.spearmanr) between
  the L2 norm and the token count, per side (documents, queries). rho < 0: shorter texts get
  larger norms.
- Within-length-bin Cohen's d (`within_bin_cohens_d`): the document side of the magnitude
  diagnostics (each query's relevant documents vs its top-k non-relevant documents under the
  Scorer, see `magnitude.relevance_norms`), but computed separately inside each length bin
  (quantile bins of the pooled samples' lengths), so relevant and non-relevant documents are
  compared at similar length. The summary `d_within` is the weighted mean of the per-bin d with
  weights n_a n_b / (n_a + n_b) (the inverse of d's sampling-variance factor); `d_plain` is the
  ordinary d over all samples, for comparison. If `d_plain` is large and `d_within` near 0, the
  norm "relevance signal" was length.
- Length-stratified retrieval (`length_stratified_metrics`): the judged documents are put in
  quantile bins of their length (bins of equal numbers of relevant (query, document) pairs); for bin b, every
  query with a judged document in b is scored with pytrec_eval on the SAME run, its qrels
  restricted to its judged documents in b. So bin b's nDCG@10 says how well relevant documents of
  that length are retrieved. `slope` is the least-squares slope of the metric over the bin index
  (0, 1, ...): > 0 favours long documents, < 0 short ones. With one bin this is the plain metric.
- Retrieved length (`retrieved_length`): median token count of the top-10 documents of every
  query (pooled) over the median of the corpus and of the relevant documents: < 1 means the
  ranking pulls short documents up.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from magclip.diagnostics.magnitude import cohens_d, relevance_from_ids, relevance_norms
from magclip.diagnostics.plots import pyplot, save_figure
from magclip.metrics.ir import Qrels, Retrieval, Run, evaluate_run
from magclip.similarity import Scorer


def length_correlation(norms: Sequence[float] | np.ndarray | torch.Tensor,
                       lengths: Sequence[int] | np.ndarray) -> dict[str, float]:
    """Spearman's rho (and its p-value) between norms and token lengths."""
    from scipy.stats import spearmanr

    n, m = _np(norms), _np(lengths)
    if n.ndim == 2:
        n = np.linalg.norm(n, axis=1)
    if n.shape != m.shape:
        raise ValueError(f"{n.shape[0]} norms but {m.shape[0]} lengths")
    if n.size < 3 or np.ptp(n) == 0 or np.ptp(m) == 0:
        return {"spearman": float("nan"), "p": float("nan"), "n": int(n.size)}
    res = spearmanr(n, m)
    return {"spearman": float(res.statistic), "p": float(res.pvalue), "n": int(n.size)}


def quantile_edges(values: Sequence[float] | np.ndarray, n_bins: int) -> np.ndarray:
    """Inner bin edges at the 1/n, 2/n, ... quantiles (duplicates dropped: tied lengths never split)."""
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    v = _np(values)
    if n_bins == 1 or v.size == 0:
        return np.empty(0)
    return np.unique(np.quantile(v, np.arange(1, n_bins) / n_bins))


def assign_bins(values: Sequence[float] | np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Bin index of each value: bin b holds edges[b-1] < v <= edges[b] (bin 0: v <= edges[0])."""
    return np.searchsorted(edges, _np(values), side="left")


def within_bin_cohens_d(a: np.ndarray, a_lengths: np.ndarray, b: np.ndarray, b_lengths: np.ndarray,
                        n_bins: int = 4) -> dict[str, Any]:
    """Cohen's d of a vs b inside quantile bins of length; see the module docstring for the summary."""
    a, b, la, lb = _np(a), _np(b), _np(a_lengths), _np(b_lengths)
    edges = quantile_edges(np.concatenate([la, lb]), n_bins)
    ba, bb = assign_bins(la, edges), assign_bins(lb, edges)
    bins, num, den = [], 0.0, 0.0
    bounds = [-np.inf, *edges.tolist(), np.inf]
    for i in range(len(edges) + 1):
        xa, xb = a[ba == i], b[bb == i]
        d = cohens_d(xa, xb)
        bins.append({"length_above": _edge(bounds[i]), "length_upto": _edge(bounds[i + 1]), "n_a": int(xa.size),
                     "n_b": int(xb.size), "d": d})
        if np.isfinite(d):
            w = xa.size * xb.size / (xa.size + xb.size)
            num, den = num + w * d, den + w
    return {"d_within": num / den if den else float("nan"), "d_plain": cohens_d(a, b), "bins": bins}


def length_stratified_metrics(qrels: Qrels, run: Run, doc_lengths: Mapping[str, int], n_bins: int = 4,
                              metrics: Sequence[str] = ("ndcg@10",)) -> dict[str, Any]:
    """Metrics per length bin of the judged documents (see the module docstring), plus their slope."""
    judged = [doc_lengths[d] for docs in qrels.values() for d, s in docs.items() if s > 0 and d in doc_lengths]
    edges = quantile_edges(judged, n_bins)
    bounds = [-np.inf, *edges.tolist(), np.inf]
    per_bin: list[dict[str, Any]] = []
    for i in range(len(edges) + 1):
        lo, hi = bounds[i], bounds[i + 1]
        sub = {q: {d: s for d, s in docs.items() if d in doc_lengths and lo < doc_lengths[d] <= hi}
               for q, docs in qrels.items()}
        sub = {q: docs for q, docs in sub.items() if docs}
        entry: dict[str, Any] = {"length_above": _edge(lo), "length_upto": _edge(hi),
                                 "relevant_pairs": sum(lo < n <= hi for n in judged)}
        m = evaluate_run(sub, run, metrics) if sub else {name: float("nan") for name in metrics}
        entry.update({name: m[name] for name in metrics})
        entry["queries"] = int(m.get("evaluated_queries", 0))
        per_bin.append(entry)
    out: dict[str, Any] = {"bins": per_bin}
    for name in metrics:
        y = np.array([b[name] for b in per_bin], dtype=float)
        ok = np.isfinite(y)
        out[f"{name}_slope"] = float(np.polyfit(np.arange(len(y))[ok], y[ok], 1)[0]) if ok.sum() > 1 else float("nan")
    return out


def retrieved_length(run: Run, qrels: Qrels, doc_lengths: Mapping[str, int], depth: int = 10) -> dict[str, float]:
    """Median token count of the top-`depth` documents (pooled over queries) vs the corpus and relevant ones."""
    top = [doc_lengths[d] for hits in run.values()
           for d in sorted(hits, key=lambda x: (-hits[x], x))[:depth] if d in doc_lengths]
    rel = [doc_lengths[d] for docs in qrels.values() for d, s in docs.items() if s > 0 and d in doc_lengths]
    corpus = np.median(list(doc_lengths.values())) if doc_lengths else float("nan")
    med_top = float(np.median(top)) if top else float("nan")
    med_rel = float(np.median(rel)) if rel else float("nan")
    return {f"top{depth}_median": med_top, "corpus_median": float(corpus), "relevant_median": med_rel,
            "ratio_to_corpus": med_top / corpus if corpus else float("nan"),
            "ratio_to_relevant": med_top / med_rel if med_rel else float("nan")}


def length_report(retrieval: Retrieval, qrels: Qrels, query_lengths: Sequence[int], doc_lengths: Sequence[int],
                  scorer: Scorer | str, *, n_bins: int = 4, k: int = 10, metrics: Sequence[str] = ("ndcg@10",),
                  max_length: int | None = None,
                  relevance_samples: Mapping[str, np.ndarray] | None = None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """All length diagnostics for one search (lengths aligned with `retrieval.query_ids` / `doc_ids`).

    `relevance_samples`: `magnitude.relevance_norms` of the same vectors, scorer and k when the
    caller already has them (the magnitude report computes the same thing).
    Returns (JSON-able summary, samples for `plot_norm_vs_length`).
    """
    scorer = Scorer.build(scorer)
    ql, dl = np.asarray(query_lengths), np.asarray(doc_lengths)
    if ql.size != len(retrieval.query_ids) or dl.size != len(retrieval.doc_ids):
        raise ValueError("one length per query and per document is needed")
    doc_norm = retrieval.doc_vecs.float().norm(dim=-1).numpy()
    query_norm = retrieval.query_vecs.float().norm(dim=-1).numpy()
    relevance = relevance_from_ids(retrieval.query_ids, retrieval.doc_ids, qrels)
    r = relevance_samples if relevance_samples is not None else \
        relevance_norms(retrieval.query_vecs, retrieval.doc_vecs, relevance, scorer, k=k)
    by_id = dict(zip(retrieval.doc_ids, dl.tolist()))
    summary = {
        "scorer": scorer.to_dict(), "n_bins": n_bins, "k": k,
        "lengths": {"documents": _length_stats(dl, max_length), "queries": _length_stats(ql, max_length)},
        "norm_length": {"documents": length_correlation(doc_norm, dl), "queries": length_correlation(query_norm, ql)},
        "within_bin_d": within_bin_cohens_d(r["rel_norm"], dl[r["rel_doc"]], r["neg_norm"], dl[r["neg_doc"]], n_bins),
        "stratified": length_stratified_metrics(qrels, retrieval.run, by_id, n_bins, metrics),
        "retrieved_length": retrieved_length(retrieval.run, qrels, by_id, depth=10),
    }
    relevant_any = np.zeros(dl.size, dtype=bool)
    relevant_any[list(set().union(*relevance))] = True
    return summary, {"doc_norm": doc_norm, "doc_length": dl, "relevant": relevant_any}


def flat_length_metrics(summary: Mapping[str, Any], metric: str = "ndcg@10") -> dict[str, float]:
    """The headline numbers of a `length_report` as flat keys (for training metrics and compare tables)."""
    out = {"len_rho_docs": summary["norm_length"]["documents"]["spearman"],
           "len_rho_queries": summary["norm_length"]["queries"]["spearman"],
           "len_d_within": summary["within_bin_d"]["d_within"], "len_d_plain": summary["within_bin_d"]["d_plain"],
           f"len_{metric}_slope": summary["stratified"][f"{metric}_slope"],
           "len_top10_ratio": summary["retrieved_length"]["ratio_to_corpus"]}
    for i, b in enumerate(summary["stratified"]["bins"]):
        out[f"len_{metric}_bin{i + 1}"] = b[metric]
    return out


def format_length_table(results: Mapping[str, Mapping[str, Any]], metric: str = "ndcg@10") -> str:
    """Markdown: per dataset and mode, the length diagnostics of `evaluate_beir_folders(..., length_bins=N)`."""
    rows = ["| data | mode | rho(norm, len) docs | rho queries | d plain | d within bins | "
            f"{metric} by length bin (short -> long) | slope | top-10 / corpus median length |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, entry in results.items():
        modes = entry.get("modes") or {entry["scorer"]["mode"]: entry}
        for label, m in modes.items():
            if "length" not in m:
                continue
            f = flat_length_metrics(m["length"], metric)
            bins = " / ".join(f"{100 * b[metric]:.1f}" for b in m["length"]["stratified"]["bins"])
            rows.append(f"| {name} | {label} | {f['len_rho_docs']:+.2f} | {f['len_rho_queries']:+.2f} | "
                        f"{f['len_d_plain']:+.2f} | {f['len_d_within']:+.2f} | {bins} | "
                        f"{100 * f[f'len_{metric}_slope']:+.2f} | {f['len_top10_ratio']:.2f} |")
    return "\n".join(rows)


def plot_norm_vs_length(samples: Mapping[str, np.ndarray], path: str | Path, title: str = "") -> Path:
    """Document norm against token length (log), relevant documents highlighted."""

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    rel = samples["relevant"]
    ax.scatter(samples["doc_length"][~rel], samples["doc_norm"][~rel], s=4, alpha=0.35, label="other documents")
    ax.scatter(samples["doc_length"][rel], samples["doc_norm"][rel], s=6, alpha=0.7, color="C3",
               label="relevant to a query")
    ax.set_xscale("log")
    ax.set_xlabel("tokens (untruncated)")
    ax.set_ylabel("raw document norm")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def _length_stats(lengths: np.ndarray, max_length: int | None) -> dict[str, float]:
    if lengths.size == 0:
        return {"n": 0}
    out = {"n": int(lengths.size), "median": float(np.median(lengths)), "mean": float(lengths.mean()),
           "q05": float(np.quantile(lengths, 0.05)), "q95": float(np.quantile(lengths, 0.95))}
    if max_length:
        out["over_max"] = float((lengths > max_length).mean())
        out["max_length"] = int(max_length)
    return out


def _edge(x: float) -> float | None:
    return None if not np.isfinite(x) else float(x)


def _np(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=float)


__all__ = ["assign_bins", "flat_length_metrics", "format_length_table", "length_correlation", "length_report", "length_stratified_metrics",
           "plot_norm_vs_length", "quantile_edges", "retrieved_length", "within_bin_cohens_d"]
