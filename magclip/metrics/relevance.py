"""Which documents are relevant to which query, for image<->text retrieval with any number of captions
per image.

A retrieval set is a list of images and a list of caption entries, in order, image i owning the next
`caption_counts[i]` of them (`caption_owners`: the index of each caption's image). Two rules say what counts as a hit (`MATCHING`):

- "image" (CLIP_benchmark's `texts_image_index`, the rule COCO/Flickr papers report): a caption is
  relevant to its own image only. Image->text: a hit at k when ANY of the image's captions is in the
  top k; text->image: per caption, a hit when its image is in the top k.
- "caption" (caption identity): equal caption strings are interchangeable. A caption is relevant to
  every image that carries the same string, and an image to every caption entry whose string is one
  of its own. With one caption per image and unique captions both rules coincide; where one caption
  repeats across images (a vague "a red circle" in the synthetic scenes, the emoji drawn in two art
  styles) "image" would count a retrieved twin as a miss that no model can avoid.

`Relevance` keeps, per query, the relevant document indices in CSR form (`ptr`, `cols`), so the
ranking code gathers each query's relevant scores instead of building a dense query x document mask.
Relevance built from equal ids (`Relevance.from_ids`, the one-caption-per-image case) keeps ids and
sorted ranges instead, so a class of thousands of equal ids costs no N^2 index.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import torch
from torch import Tensor

from magclip.config import MATCHINGS

MATCHING = {
    "image": "a caption is relevant to its own image only (CLIP_benchmark's texts_image_index)",
    "caption": "caption identity: a caption is relevant to every image carrying the same caption string",
}
assert tuple(sorted(MATCHING)) == tuple(sorted(MATCHINGS))


def ids_from_labels(labels: Sequence[Hashable]) -> Tensor:
    """Equal labels -> equal int64 ids (numbered in order of first appearance)."""
    index: dict[Hashable, int] = {}
    return torch.tensor([index.setdefault(label, len(index)) for label in labels], dtype=torch.long)


class Relevance:
    """Relevant document indices per query: `pairs(start, stop)` gives the (row, doc) pairs of queries
    [start, stop) (rows relative to start), `mask(start, stop)` the same as a dense bool matrix."""

    num_queries: int
    num_docs: int

    @property
    def counts(self) -> Tensor:
        """[num_queries] int64: relevant documents per query."""
        raise NotImplementedError

    def pairs(self, start: int, stop: int) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def mask(self, start: int, stop: int) -> Tensor:
        rows, cols = self.pairs(start, stop)
        out = torch.zeros(stop - start, self.num_docs, dtype=torch.bool, device=cols.device)
        out[rows, cols] = True
        return out

    def to(self, device: torch.device | str) -> Relevance:
        raise NotImplementedError

    def chance_recall_at_1(self) -> float:
        """Expected R@1 of a random ranking: the mean share of relevant documents per query."""
        return float(self.counts.double().mean() / self.num_docs) if self.num_queries else float("nan")

    def check_every_query_has_one(self) -> None:
        missing = self.counts == 0
        if missing.any():
            first = missing.nonzero()[:5, 0].tolist()
            raise ValueError(f"{int(missing.sum())} of {self.num_queries} queries have no relevant document "
                             f"(first such query indices: {first})")

    def as_sets(self) -> list[set[int]]:
        """Relevant document indices per query as Python sets (the diagnostics' form)."""
        rows, cols = self.pairs(0, self.num_queries)
        out: list[set[int]] = [set() for _ in range(self.num_queries)]
        for r, c in zip(rows.tolist(), cols.tolist()):
            out[r].add(c)
        return out

    @staticmethod
    def from_ids(query_ids: Tensor, doc_ids: Tensor) -> Relevance:
        """Document j is relevant to query i iff doc_ids[j] == query_ids[i]."""
        return _IdRelevance(query_ids, doc_ids)

    @staticmethod
    def from_csr(ptr: np.ndarray | Tensor, cols: np.ndarray | Tensor, num_docs: int) -> Relevance:
        return _CsrRelevance(torch.as_tensor(np.asarray(ptr), dtype=torch.long),
                             torch.as_tensor(np.asarray(cols), dtype=torch.long), num_docs)


class _IdRelevance(Relevance):
    """Equal ids, kept as ranges over the documents sorted by id: a query's relevant documents are
    `order[start[i] : start[i] + count[i]]`."""

    def __init__(self, query_ids: Tensor, doc_ids: Tensor):
        self.query_ids, self.doc_ids = query_ids, doc_ids
        self.num_queries, self.num_docs = len(query_ids), len(doc_ids)
        sorted_ids, self.order = torch.sort(doc_ids)
        self.start = torch.searchsorted(sorted_ids, query_ids, side="left")
        self._counts = torch.searchsorted(sorted_ids, query_ids, side="right") - self.start

    @property
    def counts(self) -> Tensor:
        return self._counts

    def pairs(self, start: int, stop: int) -> tuple[Tensor, Tensor]:
        count = self._counts[start:stop]
        rows = torch.repeat_interleave(torch.arange(len(count), device=count.device), count)
        offset = torch.arange(int(count.sum()), device=count.device) - torch.repeat_interleave(
            count.cumsum(0) - count, count)
        return rows, self.order[torch.repeat_interleave(self.start[start:stop], count) + offset]

    def mask(self, start: int, stop: int) -> Tensor:
        return self.query_ids[start:stop].unsqueeze(1) == self.doc_ids.unsqueeze(0)

    def to(self, device: torch.device | str) -> Relevance:
        return _IdRelevance(self.query_ids.to(device), self.doc_ids.to(device))


class _CsrRelevance(Relevance):
    def __init__(self, ptr: Tensor, cols: Tensor, num_docs: int):
        if ptr.ndim != 1 or len(ptr) < 1 or int(ptr[0]) != 0 or int(ptr[-1]) != len(cols):
            raise ValueError("ptr must start at 0 and end at len(cols)")
        self.ptr, self.cols, self.num_docs = ptr, cols, num_docs
        self.num_queries = len(ptr) - 1

    @property
    def counts(self) -> Tensor:
        return self.ptr[1:] - self.ptr[:-1]

    def pairs(self, start: int, stop: int) -> tuple[Tensor, Tensor]:
        count = self.counts[start:stop]
        rows = torch.repeat_interleave(torch.arange(len(count), device=count.device), count)
        return rows, self.cols[int(self.ptr[start]):int(self.ptr[stop])]

    def to(self, device: torch.device | str) -> Relevance:
        return _CsrRelevance(self.ptr.to(device), self.cols.to(device), self.num_docs)


def caption_owners(counts: Sequence[int]) -> Tensor:
    """The image index of every caption, from how many captions each image has, in order."""
    return torch.repeat_interleave(torch.arange(len(counts)), torch.as_tensor(list(counts), dtype=torch.long))


def clip_relevance(captions: Sequence[str], caption_counts: Sequence[int] | None,
                   matching: str) -> tuple[Relevance, Relevance]:
    """(image->text, text->image) relevance of a set whose images have `caption_counts[i]` of the captions each,
    in order (None: one caption per image)."""
    if matching not in MATCHING:
        raise ValueError(f"unknown matching {matching!r}; allowed: {', '.join(MATCHING)}")
    counts = [1] * len(captions) if caption_counts is None else list(caption_counts)
    if sum(counts) != len(captions) or any(n < 0 for n in counts):
        raise ValueError(f"{len(captions)} captions do not fit the caption counts of {len(counts)} images "
                         f"({sum(counts)} in all)")
    owners, num_images = caption_owners(counts), len(counts)
    if matching == "image" or all(n == 1 for n in counts):
        # one caption per image: caption identity is an equivalence on both sides alike
        ids = ids_from_labels(list(captions)) if matching == "caption" else owners
        image_ids = ids if matching == "caption" else torch.arange(num_images)
        return Relevance.from_ids(image_ids, ids), Relevance.from_ids(ids, image_ids)
    return _caption_identity(ids_from_labels(list(captions)).numpy(), owners.numpy(), num_images)


def _caption_identity(caption_ids: np.ndarray, owners: np.ndarray, num_images: int) -> tuple[Relevance, Relevance]:
    """Images x caption strings (A) and caption entries x caption strings (B): image->text relevance is
    the non-zero pattern of A @ B.T, text->image its transpose."""
    from scipy import sparse

    num_strings = int(caption_ids.max()) + 1 if caption_ids.size else 0
    ones = np.ones(len(owners), dtype=np.int32)
    image_strings = sparse.csr_matrix((ones, (owners, caption_ids)), shape=(num_images, num_strings))
    image_strings.data[:] = 1  # an image holding one string twice is still one match
    entry_strings = sparse.csr_matrix((ones, (np.arange(len(owners)), caption_ids)), shape=(len(owners), num_strings))
    i2t = (image_strings @ entry_strings.T).tocsr()
    i2t.sort_indices()
    t2i = i2t.T.tocsr()
    t2i.sort_indices()
    return (Relevance.from_csr(i2t.indptr, i2t.indices, len(owners)),
            Relevance.from_csr(t2i.indptr, t2i.indices, num_images))
