"""Image<->text retrieval metrics scored with the run's `Scorer`, chunked over queries.

Why not open_clip's `get_clip_metrics`: it scores with a plain dot product of L2-normalised
features (cosine only), materialises the full N x N logit matrix and argsorts it (O(N^2 log N)
time, O(N^2) memory), and assumes exactly one caption per image. Here the documents are prepared
once (`scorer.prepare_docs`), queries are prepared chunk by chunk, and for each query we count the
non-relevant documents that score at least as high as its best relevant document. Without ties that
count is the argsort position of the first relevant document, so on one-caption-per-image cosine
data the numbers are open_clip's (and CLIP_benchmark's on its multi-caption sets), with keys in the
same format; a tie never counts for the query.

Relevance (`magclip.metrics.relevance`): a `Relevance` per direction, built by `clip_relevance` from
each caption's image and the rule ("image": CLIP_benchmark's, an image query is a hit at k if ANY of
its captions is in the top k; "caption": caption identity, duplicate captions count as one), or
integer ids (document j is relevant to query i iff `doc_ids[j] == query_ids[i]`).

Per-query outcomes. `retrieval_metrics` returns a `RetrievalMetrics` (magclip.metrics.ranks): the
plain dict of numbers (what results.json and metrics.jsonl record) that also carries the per-query
ranks behind them in `.ranks`, so paired statistics can compare two runs query by query (R@k of one
query = rank < k); magclip.metrics.ranks writes and reads them beside a results file.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import Tensor

from magclip.metrics.ranks import (  # noqa: F401  (the per-query ranks' file format, re-exported)
    DIRECTIONS,
    ITEMS_KEY,
    RetrievalMetrics,
    compact,
    items_digest,
    load_ranks,
    ranks_path,
    save_per_query_outcomes,
    save_ranks,
)
from magclip.metrics.relevance import Relevance, ids_from_labels  # noqa: F401  (re-exported)
from magclip.similarity import Scorer


@torch.no_grad()
def ranks_of_first_relevant(
    queries: Tensor,
    docs: Tensor,
    scorer: Scorer,
    query_ids: Tensor | None = None,
    doc_ids: Tensor | None = None,
    *,
    relevance: Relevance | None = None,
    chunk_size: int = 1024,
) -> Tensor:
    """0-based rank of each query's best-ranked relevant document, as an int64 tensor [Nq] on CPU.

    Relevance: `relevance`, or equal ids (`query_ids`, `doc_ids`). rank = the number of NON-relevant
    documents scoring at least as high as the best relevant one: a tie never counts for the query
    (the pessimistic rank). Without ties it is the argsort position, so the numbers are open_clip's
    and CLIP_benchmark's; with ties (identical embeddings, e.g. captions cut to the same tokens) their
    orders are whatever the sort returns, and crediting the query would make every tie a hit. Peak
    memory is a few chunk_size x Nd buffers, never Nq x Nd.
    """
    _check_shapes(queries, docs, chunk_size)
    if relevance is None:
        if query_ids is None or doc_ids is None:
            raise ValueError("pass relevance, or both query_ids and doc_ids")
        relevance = Relevance.from_ids(_as_ids(query_ids, len(queries), "query_ids"),
                                       _as_ids(doc_ids, len(docs), "doc_ids"))
    if (relevance.num_queries, relevance.num_docs) != (len(queries), len(docs)):
        raise ValueError(f"relevance is for {relevance.num_queries} queries x {relevance.num_docs} docs, "
                         f"got {len(queries)} x {len(docs)}")
    relevance.check_every_query_has_one()
    relevance = relevance.to(queries.device)
    docs_p = scorer.prepare_docs(docs)
    ranks = []
    for start in range(0, len(queries), chunk_size):
        stop = min(start + chunk_size, len(queries))
        with torch.autocast(device_type=queries.device.type, enabled=False):
            scores = scorer.prepare_queries(queries[start:stop]) @ docs_p.T
        ranks.append(_pessimistic_ranks(scores, relevance, start, stop).cpu())
    return torch.cat(ranks) if ranks else torch.zeros(0, dtype=torch.long)


def _pessimistic_ranks(scores: Tensor, relevance: Relevance, start: int, stop: int) -> Tensor:
    """Per row of `scores` (queries start..stop): non-relevant documents scoring >= the best relevant
    score. The best relevant score is read from `scores` itself (recomputing it could differ in the
    last bit and make a document outrank itself)."""
    rows, cols = relevance.pairs(start, stop)
    if len(cols) > scores.numel() // 8:  # many relevant docs per query (e.g. class ids): a dense mask
        mask = relevance.mask(start, stop)
        best = scores.masked_fill(~mask, float("-inf")).amax(dim=1, keepdim=True)
        # int32 sums: several times faster than the default int64 sum of a bool matrix on CPU
        return ((scores >= best) & ~mask).sum(dim=1, dtype=torch.int32).long()
    relevant_scores = scores[rows, cols]
    best = torch.full((stop - start,), float("-inf"), device=scores.device, dtype=scores.dtype)
    best.scatter_reduce_(0, rows, relevant_scores, reduce="amax")
    at_or_above = (scores >= best.unsqueeze(1)).sum(dim=1, dtype=torch.int32).long()
    relevant_at_best = torch.zeros(stop - start, dtype=torch.long, device=scores.device)
    relevant_at_best.scatter_add_(0, rows, (relevant_scores >= best[rows]).long())
    return at_or_above - relevant_at_best


def _check_shapes(queries: Tensor, docs: Tensor, chunk_size: int) -> None:
    if queries.ndim != 2 or docs.ndim != 2 or queries.shape[1] != docs.shape[1]:
        raise ValueError(
            f"expected [Nq, D] queries and [Nd, D] docs, got {tuple(queries.shape)} and {tuple(docs.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def _as_ids(ids: Tensor, n: int, name: str) -> Tensor:
    ids = torch.as_tensor(ids)
    if ids.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},), got {tuple(ids.shape)}")
    if ids.is_floating_point() or ids.is_complex():
        raise ValueError(f"{name} must be integer ids, got dtype {ids.dtype}; use ids_from_labels for labels")
    return ids.long()


def rank_metrics(ranks: Tensor, prefix: str, ks: Iterable[int] = (1, 5, 10)) -> dict[str, float]:
    """open_clip's summary of 0-based ranks: 1-based mean/median rank and R@k (numpy, as open_clip)."""
    preds = ranks.numpy()
    metrics = {
        f"{prefix}_mean_rank": float(preds.mean() + 1),
        f"{prefix}_median_rank": float(np.floor(np.median(preds)) + 1),
    }
    metrics.update({f"{prefix}_R@{k}": float(np.mean(preds < k)) for k in ks})
    return metrics


def retrieval_ranks(
    image_features: Tensor,
    text_features: Tensor,
    *,
    i2t: Scorer | None,
    t2i: Scorer | None,
    image_ids: Tensor | None = None,
    text_ids: Tensor | None = None,
    relevance: tuple[Relevance, Relevance] | None = None,
    chunk_size: int = 1024,
) -> dict[str, Tensor]:
    """Direction -> 0-based rank of each query's first relevant item (`ranks_of_first_relevant`), for
    the directions that have a scorer. Relevance: `relevance` = (image->text, text->image), e.g. from
    `magclip.metrics.relevance.clip_relevance`, or equal ids (default: text i is image i's caption)."""
    if relevance is None:
        image_ids, text_ids = _default_ids(len(image_features), len(text_features), image_ids, text_ids)
        image_ids = _as_ids(image_ids, len(image_features), "image_ids")
        text_ids = _as_ids(text_ids, len(text_features), "text_ids")
        relevance = (Relevance.from_ids(image_ids, text_ids), Relevance.from_ids(text_ids, image_ids))
    ranks = {}
    for prefix, scorer, queries, docs, rel in (
        ("image_to_text", i2t, image_features, text_features, relevance[0]),
        ("text_to_image", t2i, text_features, image_features, relevance[1]),
    ):
        if scorer is not None:
            ranks[prefix] = ranks_of_first_relevant(queries, docs, scorer, relevance=rel, chunk_size=chunk_size)
    return ranks


def retrieval_metrics(
    image_features: Tensor,
    text_features: Tensor,
    *,
    i2t: Scorer | None,
    t2i: Scorer | None,
    image_ids: Tensor | None = None,
    text_ids: Tensor | None = None,
    relevance: tuple[Relevance, Relevance] | None = None,
    ks: Iterable[int] = (1, 5, 10),
    chunk_size: int = 1024,
) -> RetrievalMetrics:
    """Image->text (queries = images, scorer `i2t`) and text->image (queries = texts, scorer `t2i`).

    Keys as in open_clip's get_clip_metrics ("image_to_text_R@1", ...); a direction whose scorer is
    None is omitted. Relevance as in `retrieval_ranks`. The per-query ranks ride along in `.ranks`
    (see `RetrievalMetrics`).
    """
    ks = tuple(ks)
    metrics = RetrievalMetrics()
    for prefix, ranks in retrieval_ranks(image_features, text_features, i2t=i2t, t2i=t2i, image_ids=image_ids,
                                         text_ids=text_ids, relevance=relevance, chunk_size=chunk_size).items():
        metrics.update(rank_metrics(ranks, prefix, ks))
        metrics.ranks[prefix] = compact(ranks.numpy())
    return metrics


def _default_ids(
    n_images: int, n_texts: int, image_ids: Tensor | None, text_ids: Tensor | None
) -> tuple[Tensor, Tensor]:
    """arange ids for a missing side; both missing means one caption per image, so counts must match."""
    if image_ids is None and text_ids is None and n_images != n_texts:
        raise ValueError(
            f"{n_images} images but {n_texts} texts: pass text_ids (index of each caption's image) "
            "when there is not exactly one caption per image"
        )
    image_ids = torch.arange(n_images) if image_ids is None else image_ids
    text_ids = torch.arange(n_texts) if text_ids is None else text_ids
    return image_ids, text_ids
