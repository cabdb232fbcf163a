"""CLIP image<->text retrieval with the run's own Scorers: one implementation for a training run's
validation and for zero-shot evaluation of a checkpoint.

Relevance is caption identity: a retrieved item is a hit when it carries the query's caption, so
identical captions (frequent in the synthetic scenes, and in emoji with two art styles) count as
one. With unique captions this is exactly open_clip's `get_clip_metrics` in cosine mode.

The metrics come back as a `RetrievalMetrics` (magclip.metrics.ranks): a plain dict of numbers
that also carries each direction's per-query ranks and a digest of the evaluated keys, which a
training run writes beside its results.json (`results.ranks.npz`) for paired statistics.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from magclip.diagnostics.specificity import specificity_metrics
from magclip.metrics.ranks import RetrievalMetrics, items_digest
from magclip.metrics.retrieval import ids_from_labels, retrieval_metrics
from magclip.models.clip import RawCLIP
from magclip.similarity import Scorer


@torch.no_grad()
def encode_loader(clip: RawCLIP, loader: Iterable[dict], device: torch.device | str,
                  allow_empty: bool = False) -> dict[str, Any] | None:
    """Raw features of every sample in `loader`, in loader order: the one CLIP encoding loop of
    evaluation (training validation, zero-shot, diagnostics). A batch holds "images" and, unless it is
    image-only, "texts" (token ids); its other per-sample lists ("keys", "captions", "labels", ...)
    are concatenated alongside, its "skipped" counts summed. Nothing to encode: None with
    `allow_empty`, else a ValueError."""
    images, texts = [], []
    lists: dict[str, list] = {}
    skipped: dict[str, int] = {}
    for batch in loader:
        images.append(clip.encode_image(batch["images"].to(device)).float().cpu())
        if "texts" in batch:
            texts.append(clip.encode_text(batch["texts"].to(device)).float().cpu())
        for name, values in batch.items():
            if isinstance(values, list):
                lists.setdefault(name, []).extend(values)
        for reason, n in batch.get("skipped", {}).items():
            skipped[reason] = skipped.get(reason, 0) + n
    if not images:
        if allow_empty:
            return None
        raise ValueError("the evaluation data yielded no sample")
    return {"image_features": torch.cat(images), "text_features": torch.cat(texts) if texts else None,
            **lists, "skipped": skipped}


def retrieval_from_features(image_features: Tensor, text_features: Tensor, captions: Sequence[str],
                            scorers: Mapping[str, Scorer], chunk_size: int = 1024) -> RetrievalMetrics:
    """R@1/5/10, mean and median rank per direction, chance R@1, counts and mean norms (+ `.ranks`)."""
    ids = ids_from_labels(list(captions))
    metrics = retrieval_metrics(image_features, text_features, i2t=scorers["i2t"], t2i=scorers["t2i"],
                                image_ids=ids, text_ids=ids, chunk_size=chunk_size)
    metrics["chance_R@1"] = chance_recall_at_1(ids)
    metrics["num_samples"] = len(captions)
    metrics["num_unique_captions"] = int(ids.unique().numel())
    metrics["image_norm_mean"] = float(image_features.norm(dim=-1).mean())
    metrics["text_norm_mean"] = float(text_features.norm(dim=-1).mean())
    return metrics


def evaluate_retrieval(clip: RawCLIP, scorers: Mapping[str, Scorer], loader, device) -> RetrievalMetrics:
    """`retrieval_from_features` of every sample of a loader, plus the samples it skipped; the
    per-query ranks carry a digest of the loader's keys (so only runs on the same items pair up)."""
    enc = encode_loader(clip, loader, device)
    metrics = retrieval_from_features(enc["image_features"], enc["text_features"], enc["captions"], scorers)
    metrics.item_digest = items_digest(enc["keys"])
    metrics["skipped_total"] = sum(enc["skipped"].values())
    return with_specificity(metrics, enc, scorers)


def with_specificity(metrics: RetrievalMetrics, enc: Mapping[str, Any], scorers: Mapping[str, Scorer]
                     ) -> RetrievalMetrics:
    """`metrics` with the caption-specificity numbers (magclip.diagnostics.specificity) where the samples'
    KEY.json give caption_detail (the synthetic scenes do); returns `metrics`."""
    spec = specificity_metrics(enc["image_features"], enc["text_features"], enc["captions"], enc["keys"],
                               enc.get("metas") or [None] * len(enc["keys"]), scorers, metrics.ranks)
    metrics.update(spec)
    return metrics.with_outcomes(spec)


def chance_recall_at_1(ids: Tensor) -> float:
    """Expected R@1 of a random ranking: the mean share of relevant items per query."""
    _, inverse, counts = ids.unique(return_inverse=True, return_counts=True)
    return float((counts[inverse].float() / ids.numel()).mean())
