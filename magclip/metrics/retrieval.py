"""Image<->text retrieval metrics scored with the run's `Scorer`, chunked over queries.

Why not open_clip's `get_clip_metrics`: it scores with a plain dot product of L2-normalised
features (cosine only), materialises the full N x N logit matrix and argsorts it (O(N^2 log N)
time, O(N^2) memory), and assumes exactly one caption per image. Here the documents are prepared
once (`scorer.prepare_docs`), queries are prepared chunk by chunk, and for each query we only count
the documents that score strictly higher than its best relevant document. That count equals the
argsort position of the first relevant document when there are no ties, so on one-caption-per-image
cosine data the numbers are open_clip's, with keys in the same format.

Relevance is defined by integer ids: document j is relevant to query i iff
`doc_ids[j] == query_ids[i]`. With several captions per image, give each caption the index of its
image (CLIP_benchmark's definition: an image query is a hit at k if ANY of its captions is in the
top k). To score caption identity (duplicate captions count as one), give both sides ids of the
caption string via `ids_from_labels`.

Per-query outcomes. `retrieval_metrics` returns a `RetrievalMetrics` (magclip.metrics.ranks): the
plain dict of numbers (what results.json and metrics.jsonl record) that also carries the per-query
ranks behind them in `.ranks`, so paired statistics can compare two runs query by query (R@k of one
query = rank < k); magclip.metrics.ranks writes and reads them beside a results file.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

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
from magclip.similarity import Scorer


def ids_from_labels(labels: Sequence[Hashable]) -> Tensor:
    """Equal labels -> equal int64 ids (numbered in order of first appearance)."""
    index: dict[Hashable, int] = {}
    return torch.tensor([index.setdefault(label, len(index)) for label in labels], dtype=torch.long)


@torch.no_grad()
def ranks_of_first_relevant(
    queries: Tensor,
    docs: Tensor,
    scorer: Scorer,
    query_ids: Tensor,
    doc_ids: Tensor,
    *,
    chunk_size: int = 1024,
) -> Tensor:
    """0-based rank of each query's best-ranked relevant document, as an int64 tensor [Nq] on CPU.

    rank = number of documents scoring strictly higher than the best relevant one (the argsort
    position when there are no ties; ties are resolved in the query's favour). Peak memory is a
    few chunk_size x Nd buffers, never Nq x Nd.
    """
    _check_shapes(queries, docs, chunk_size)
    query_ids = _as_ids(query_ids, len(queries), "query_ids").to(queries.device)
    doc_ids = _as_ids(doc_ids, len(docs), "doc_ids").to(queries.device)
    relevant = _RelevantDocs(query_ids, doc_ids)
    docs_p = scorer.prepare_docs(docs)
    ranks = []
    for start in range(0, len(queries), chunk_size):
        stop = min(start + chunk_size, len(queries))
        with torch.autocast(device_type=queries.device.type, enabled=False):
            scores = scorer.prepare_queries(queries[start:stop]) @ docs_p.T
        best = relevant.best_scores(scores, start, stop)
        # int32 sum: several times faster than the default int64 sum of a bool matrix on CPU
        ranks.append((scores > best.unsqueeze(1)).sum(dim=1, dtype=torch.int32).long().cpu())
    return torch.cat(ranks) if ranks else torch.zeros(0, dtype=torch.long)


class _RelevantDocs:
    """Which docs are relevant to which query, kept as ranges over the docs sorted by id.

    Why: a dense chunk x Nd relevance mask plus masked_fill costs more than the matmul itself; the
    relevant pairs are usually few (1-5 per query), so the best relevant score is a cheap gather.
    Raises if any query has no relevant doc, before any scoring is done.
    """

    def __init__(self, query_ids: Tensor, doc_ids: Tensor):
        sorted_ids, self.order = torch.sort(doc_ids)
        self.start = torch.searchsorted(sorted_ids, query_ids, side="left")
        self.count = torch.searchsorted(sorted_ids, query_ids, side="right") - self.start
        self.query_ids, self.doc_ids = query_ids, doc_ids
        missing = self.count == 0
        if missing.any():
            first = missing.nonzero()[:5, 0].tolist()
            raise ValueError(
                f"{int(missing.sum())} of {len(query_ids)} queries have no relevant document "
                f"(no doc id equals their query id; first such query indices: {first})"
            )

    def best_scores(self, scores: Tensor, start: int, stop: int) -> Tensor:
        """[stop - start] best score among each query's relevant docs, read from `scores` itself
        (recomputing it could differ in the last bit and make a doc outrank itself)."""
        count = self.count[start:stop]
        n_pairs = int(count.sum())
        if n_pairs > scores.numel() // 8:  # many relevant docs per query (e.g. class ids): dense
            mask = self.query_ids[start:stop].unsqueeze(1) == self.doc_ids.unsqueeze(0)
            return scores.masked_fill(~mask, float("-inf")).amax(dim=1)
        rows = torch.repeat_interleave(torch.arange(len(count), device=scores.device), count)
        first_pair = torch.repeat_interleave(count.cumsum(0) - count, count)
        offset = torch.arange(n_pairs, device=scores.device) - first_pair
        cols = self.order[torch.repeat_interleave(self.start[start:stop], count) + offset]
        best = torch.full((len(count),), float("-inf"), device=scores.device, dtype=scores.dtype)
        return best.scatter_reduce_(0, rows, scores[rows, cols], reduce="amax")


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
    chunk_size: int = 1024,
) -> dict[str, Tensor]:
    """Direction -> 0-based rank of each query's first relevant item (`ranks_of_first_relevant`), for
    the directions that have a scorer."""
    image_ids, text_ids = _default_ids(len(image_features), len(text_features), image_ids, text_ids)
    ranks = {}
    for prefix, scorer, queries, docs, q_ids, d_ids in (
        ("image_to_text", i2t, image_features, text_features, image_ids, text_ids),
        ("text_to_image", t2i, text_features, image_features, text_ids, image_ids),
    ):
        if scorer is not None:
            ranks[prefix] = ranks_of_first_relevant(queries, docs, scorer, q_ids, d_ids, chunk_size=chunk_size)
    return ranks


def retrieval_metrics(
    image_features: Tensor,
    text_features: Tensor,
    *,
    i2t: Scorer | None,
    t2i: Scorer | None,
    image_ids: Tensor | None = None,
    text_ids: Tensor | None = None,
    ks: Iterable[int] = (1, 5, 10),
    chunk_size: int = 1024,
) -> RetrievalMetrics:
    """Image->text (queries = images, scorer `i2t`) and text->image (queries = texts, scorer `t2i`).

    Keys as in open_clip's get_clip_metrics ("image_to_text_R@1", ...); a direction whose scorer is
    None is omitted. ids default to arange, i.e. text i is the one caption of image i. The per-query
    ranks ride along in `.ranks` (see `RetrievalMetrics`).
    """
    ks = tuple(ks)
    metrics = RetrievalMetrics()
    for prefix, ranks in retrieval_ranks(image_features, text_features, i2t=i2t, t2i=t2i, image_ids=image_ids,
                                         text_ids=text_ids, chunk_size=chunk_size).items():
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
