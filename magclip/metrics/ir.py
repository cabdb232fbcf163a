"""Ranked retrieval metrics (nDCG@10, MRR@10, Recall@100, MAP@100) computed with pytrec_eval.

Search runs on the Scorer's prepared vectors (`prepare_queries`, `prepare_docs`), so the ranking is
exactly the one training scored: torch top-k over query x document chunks (the default), or faiss
IndexFlatIP on the same vectors when asked for (backend="faiss"). The exact flat search is faster in
torch: benchmarks/README.md measured faiss's flat index 4-5x slower at 100k and 1M documents and
1.2 GiB heavier at 1M, so "auto" means torch.

Metric definitions (names `<family>@<k>`):

| name        | computed by                               | trec_eval measure |
|-------------|-------------------------------------------|-------------------|
| ndcg@k      | pytrec_eval                               | ndcg_cut.k        |
| map@k       | pytrec_eval                               | map_cut.k         |
| recall@k    | pytrec_eval                               | recall.k          |
| precision@k | pytrec_eval                               | P.k               |
| mrr@k       | here: 1 / rank of the first relevant      | recip_rank on the |
|             | document within the top k, 0 if none     | run cut at k      |

MRR@k is BEIR's definition (reciprocal rank of the first document with relevance >= 1 among the
top k, else 0, averaged over queries). It is computed here because trec_eval's `recip_rank` has no
cut-off; documents are ordered exactly as trec_eval orders them (score descending, ties broken by
document id descending), so it equals pytrec_eval's `recip_rank` on the run truncated to k.

Left-out documents: `search_run` takes `exclude`, {query id: document id} to leave out of that
query's ranking (the query itself where a corpus holds its queries, as ArguAna and Quora do; the
caller decides which, magclip.data.beir.identical_id_exclusions): it retrieves k + 1, removes that
document, keeps k, and reports how many it removed. Means are over the queries that have judgements
(pytrec_eval's convention).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from magclip.similarity import Scorer

DEFAULT_METRICS = ("ndcg@10", "mrr@10", "recall@100", "map@100")
_FAMILIES = {"ndcg": "ndcg_cut", "map": "map_cut", "recall": "recall", "precision": "P", "p": "P"}

Run = dict[str, dict[str, float]]
Qrels = Mapping[str, Mapping[str, int]]


def faiss_available() -> bool:
    try:
        import faiss  # noqa: F401
    except ImportError:
        return False
    return True


@torch.no_grad()
def search(queries: Tensor, docs: Tensor, scorer: Scorer | str, k: int, *, backend: str = "auto",
           query_chunk: int = 512, doc_chunk: int = 100_000) -> tuple[Tensor, Tensor]:
    """Top-k documents per query under `scorer`: (scores [Nq, k'] float32, indices [Nq, k'] int64), k' = min(k, Nd).

    backend: "torch" (chunked matmul + top-k, running merge over document chunks), "faiss"
    (IndexFlatIP on the prepared vectors) or "auto" (= torch, the faster exact search). Both rank by the same
    inner products; they can differ only in the order of documents whose scores tie in float32.
    """
    scorer = Scorer.build(scorer)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if queries.ndim != 2 or docs.ndim != 2 or queries.shape[1] != docs.shape[1]:
        raise ValueError(f"expected [Nq, D] queries and [Nd, D] docs, got {tuple(queries.shape)} and {tuple(docs.shape)}")
    k = min(k, docs.shape[0])
    q = scorer.prepare_queries(queries).contiguous()
    d = scorer.prepare_docs(docs).contiguous()
    backend = backend_name(backend)
    if backend == "faiss":
        import faiss

        index = faiss.IndexFlatIP(d.shape[1])
        index.add(np.ascontiguousarray(d.cpu().numpy(), dtype=np.float32))
        scores, idx = index.search(np.ascontiguousarray(q.cpu().numpy(), dtype=np.float32), k)
        return torch.from_numpy(scores), torch.from_numpy(idx).long()
    if backend != "torch":
        raise ValueError(f"unknown search backend {backend!r}; use auto, torch or faiss")
    all_scores, all_idx = [], []
    for qs in range(0, q.shape[0], query_chunk):
        qc = q[qs:qs + query_chunk]
        best_s = best_i = None
        for ds in range(0, d.shape[0], doc_chunk):
            s = qc @ d[ds:ds + doc_chunk].T
            top_s, top_i = s.topk(min(k, s.shape[1]), dim=1)
            top_i = top_i + ds
            if best_s is not None:
                top_s, pos = torch.cat([best_s, top_s], 1).topk(k, dim=1)
                top_i = torch.cat([best_i, top_i], 1).gather(1, pos)
            best_s, best_i = top_s, top_i
        all_scores.append(best_s.cpu())
        all_idx.append(best_i.cpu())
    return torch.cat(all_scores), torch.cat(all_idx)


def search_run(queries: Tensor, docs: Tensor, query_ids: Sequence[str], doc_ids: Sequence[str], scorer: Scorer | str,
               k: int = 100, *, exclude: Mapping[str, str] | None = None, backend: str = "auto") -> tuple[Run, int]:
    """A TREC-style run {query id: {doc id: score}} with the top k per query, and the number of
    documents removed because `exclude` names them for their query."""
    if len(query_ids) != queries.shape[0] or len(doc_ids) != docs.shape[0]:
        raise ValueError("ids and vectors differ in length")
    exclude = exclude or {}
    extra = 1 if exclude else 0
    scores, idx = search(queries, docs, scorer, k + extra, backend=backend)
    run: Run = {}
    removed = 0
    for qi, qid in enumerate(query_ids):
        hits: dict[str, float] = {}
        for s, j in zip(scores[qi].tolist(), idx[qi].tolist()):
            if j < 0:
                continue
            did = doc_ids[j]
            if exclude.get(qid) == did:
                removed += 1
                continue
            if len(hits) < k:
                hits[did] = float(s)
        run[qid] = hits
    return run, removed


def parse_metric(name: str) -> tuple[str, int]:
    m = re.fullmatch(r"([a-zA-Z]+)@(\d+)", name.strip())
    if not m or (m.group(1).lower() not in _FAMILIES and m.group(1).lower() != "mrr"):
        raise ValueError(f"unknown metric {name!r}; use ndcg@k, mrr@k, recall@k, map@k or precision@k")
    return m.group(1).lower(), int(m.group(2))


def trec_order(hits: Mapping[str, float]) -> list[str]:
    """Document ids in trec_eval's order: score descending, then document id descending."""
    return [d for d, _ in sorted(hits.items(), key=lambda item: (item[1], item[0]), reverse=True)]


def mrr_at_k(qrels: Qrels, run: Run, k: int) -> dict[str, float]:
    """Per-query reciprocal rank of the first relevant (>= 1) document within the top k (0 if none)."""
    out = {}
    for qid, hits in run.items():
        if qid not in qrels:
            continue
        rel = qrels[qid]
        out[qid] = 0.0
        for rank, did in enumerate(trec_order(hits)[:k], start=1):
            if rel.get(did, 0) >= 1:
                out[qid] = 1.0 / rank
                break
    return out


def evaluate_run(qrels: Qrels, run: Run, metrics: Sequence[str] = DEFAULT_METRICS,
                 per_query: bool = False) -> dict[str, Any]:
    """Mean of each metric over the judged queries in the run (pytrec_eval's convention).

    With `per_query`, also {"per_query": {metric: {qid: value}}} in query-id order (each mean is the
    mean of these values in this order, so a kept per-query array reproduces it exactly).
    """
    import pytrec_eval

    parsed = {name: parse_metric(name) for name in metrics}
    measures = {f"{_FAMILIES[fam]}.{k}" for fam, k in parsed.values() if fam != "mrr"}
    qrels_clean = {q: {d: int(s) for d, s in docs.items()} for q, docs in qrels.items()}
    run_clean = {q: {d: float(s) for d, s in hits.items()} for q, hits in run.items() if q in qrels_clean}
    trec = pytrec_eval.RelevanceEvaluator(qrels_clean, measures).evaluate(run_clean) if measures else {}
    results: dict[str, Any] = {}
    per: dict[str, dict[str, float]] = {}
    for name, (fam, k) in parsed.items():
        if fam == "mrr":
            values = mrr_at_k(qrels_clean, run_clean, k)
        else:
            key = f"{_FAMILIES[fam]}_{k}"
            values = {q: m[key] for q, m in trec.items()}
        per[name] = {q: values[q] for q in sorted(values)}  # query-id order: what per-query files keep
        results[name] = float(np.mean(list(per[name].values()))) if values else 0.0
    results["evaluated_queries"] = len(run_clean)
    if per_query:
        results["per_query"] = per
    return results


@dataclass
class Retrieval:
    """What one search produced: ids, the raw vectors that were searched, and the run (made by
    magclip.evaluation.text.retrieve, read by the diagnostics of the same search)."""

    query_ids: list[str]
    doc_ids: list[str]
    query_vecs: Tensor
    doc_vecs: Tensor
    run: Run
    removed_identical: int
    k: int
    timings: dict[str, float]


def backend_name(backend: str) -> str:
    """The backend "auto" means (torch: the faster exact search, see the module docstring)."""
    return "torch" if backend == "auto" else backend
