"""CLIP image<->text retrieval with the run's own Scorers: one implementation for a training run's
validation, zero-shot evaluation of a checkpoint, the benchmark suite and the diagnostics.

A set is images and their captions, any number per image (KEY.txt one a line, CLIP_benchmark's
layout; magclip.data.captions). Relevance follows a rule (magclip.metrics.relevance.MATCHING):
"caption" identity (a retrieved item is a hit when it carries the query's caption, so identical
captions, frequent in the synthetic scenes and in emoji with two art styles, count as one) or
"image" (CLIP_benchmark's: a caption is relevant to its own image only). Image->text queries are the
images (a hit when any relevant caption is in the top k), text->image queries are the captions. With
one unique caption per image both rules are exactly open_clip's `get_clip_metrics` in cosine mode;
ties never count for the query (magclip.metrics.retrieval).

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
from magclip.distributed import ONE_PROCESS, Share
from magclip.metrics.ranks import DIRECTIONS, RetrievalMetrics, items_digest
from magclip.metrics.relevance import clip_relevance
from magclip.metrics.retrieval import retrieval_metrics
from magclip.models.clip import RawCLIP
from magclip.models.tokens import long_captions
from magclip.similarity import Scorer


@torch.no_grad()
def encode_loader(clip: RawCLIP, loader: Iterable[dict], device: torch.device | str,
                  allow_empty: bool = False, share: Share = ONE_PROCESS) -> dict[str, Any] | None:
    """Raw features of every sample in `loader`, in loader order: the one CLIP encoding loop of
    evaluation (training validation, zero-shot, diagnostics). A batch holds "images" and, unless it is
    image-only, "texts" (token ids); its other per-sample lists ("keys", "captions", "labels", ...)
    are concatenated alongside, its "skipped" counts summed. Nothing to encode: None with
    `allow_empty`, else a ValueError.

    With a sharded `share` (a sharded model: every rank calls this, each reading the whole loader) each
    rank encodes its share of the batches through the model's forward (where a sharded model gathers its
    weights), the features are gathered in batch order on the leading rank, which gets the result; the
    others get None."""
    features: dict[int, tuple[Tensor, Tensor | None]] = {}
    lists: dict[str, list] = {}
    skipped: dict[str, int] = {}
    batches, last = 0, None
    for i, batch in enumerate(loader):
        batches, last = i + 1, batch
        if share.owns(i):
            features[i] = _encode_batch(clip, batch, device, share)
        for name, values in batch.items():
            if isinstance(values, list):
                lists.setdefault(name, []).extend(values)
        for reason, n in batch.get("skipped", {}).items():
            skipped[reason] = skipped.get(reason, 0) + n
    for _ in range(share.padding(batches)):  # the same number of forwards on every rank
        _encode_batch(clip, last, device, share)
    encoded = share.gather_rows(features)
    if encoded is None:
        return None
    if not encoded:
        if allow_empty:
            return None
        raise ValueError("the evaluation data yielded no sample")
    texts = [t for _, t in encoded if t is not None]
    return {"image_features": torch.cat([i for i, _ in encoded]), "text_features": torch.cat(texts) if texts else None,
            **lists, "skipped": skipped}


def _encode_batch(clip: RawCLIP, batch: dict, device: torch.device | str, share: Share) -> tuple[Tensor, Tensor | None]:
    """One batch's raw image (and text) features, float32 on the CPU. Sharded, both towers run in one call of the
    model's forward, the call where FSDP gathers the towers' outer weights."""
    images = batch["images"].to(device)
    if share.sharded:
        if "texts" not in batch:
            raise ValueError("a sharded model encodes image-caption batches only (its forward takes both)")
        image, text = clip(images, batch["texts"].to(device))
        return image.float().cpu(), text.float().cpu()
    image = clip.encode_image(images).float().cpu()
    return image, clip.encode_text(batch["texts"].to(device)).float().cpu() if "texts" in batch else None


def first_samples(enc: dict[str, Any], n: int) -> dict[str, Any]:
    """An `encode_loader` result cut to its first `n` images and their captions."""
    counts = enc.get("caption_counts") or [1] * len(enc["keys"])
    n_images = min(n, len(counts))
    n_texts = sum(counts[:n_images])
    out = dict(enc)
    for name in ("image_features", "keys", "metas", "caption_counts"):
        if out.get(name) is not None:
            out[name] = out[name][:n_images]
    for name in ("text_features", "captions"):
        if out.get(name) is not None:
            out[name] = out[name][:n_texts]
    return out


def retrieval_from_features(image_features: Tensor, text_features: Tensor, captions: Sequence[str],
                            scorers: Mapping[str, Scorer], chunk_size: int = 1024, *,
                            caption_counts: Sequence[int] | None = None, matching: str = "caption") -> RetrievalMetrics:
    """R@1/5/10, mean and median rank per direction, chance R@1 per direction, counts and mean norms
    (+ `.ranks`). `caption_counts[i]`: how many of the captions (in order) belong to image i; None: one
    each. `matching`: "caption" (identity) or "image" (CLIP_benchmark's), magclip.metrics.relevance."""
    counts = [1] * len(image_features) if caption_counts is None else list(caption_counts)
    if len(counts) != len(image_features) or len(captions) != len(text_features):
        raise ValueError(f"{len(image_features)} image and {len(text_features)} text features for {len(counts)} "
                         f"images and {len(captions)} captions")
    relevance = clip_relevance(captions, counts, matching)
    metrics = retrieval_metrics(image_features, text_features, i2t=scorers["i2t"], t2i=scorers["t2i"],
                                relevance=relevance, chunk_size=chunk_size)
    for prefix, rel in zip(DIRECTIONS, relevance):
        metrics[f"{prefix}_chance_R@1"] = rel.chance_recall_at_1()
    metrics["chance_R@1"] = metrics["image_to_text_chance_R@1"]  # the one number of one-caption sets
    metrics["num_samples"] = len(counts)
    metrics["num_captions"] = len(captions)
    metrics["num_unique_captions"] = len(set(captions))
    metrics["image_norm_mean"] = float(image_features.norm(dim=-1).mean())
    metrics["text_norm_mean"] = float(text_features.norm(dim=-1).mean())
    return metrics


def caption_items(keys: Sequence[str], counts: Sequence[int] | None) -> list[str]:
    """The evaluated items that paired statistics match runs on: the sample keys, and with several
    captions per image also how many each has (two runs pair only on the same captions per image)."""
    if counts is None or all(n == 1 for n in counts):
        return list(keys)
    return [f"{k}\t{n}" for k, n in zip(keys, counts)]


def evaluate_retrieval(clip: RawCLIP, scorers: Mapping[str, Scorer], loader, device, *,
                       matching: str = "caption", tokenizer=None,
                       share: Share = ONE_PROCESS) -> RetrievalMetrics | None:
    """`retrieval_from_features` of every sample of a loader, plus the samples it skipped; the
    per-query ranks carry a digest of the loader's keys (so only runs on the same items pair up).
    With the `tokenizer`, captions longer than the text tower's context are counted (`long_captions`).
    With a sharded `share` every rank calls this and encodes its share; the leading rank gets the metrics,
    the others None (`encode_loader`)."""
    enc = encode_loader(clip, loader, device, share=share)
    if enc is None:
        return None
    metrics = retrieval_from_features(enc["image_features"], enc["text_features"], enc["captions"], scorers,
                                      caption_counts=enc.get("caption_counts"), matching=matching)
    metrics.item_digest = items_digest(caption_items(enc["keys"], enc.get("caption_counts")))
    metrics["skipped_total"] = sum(enc["skipped"].values())
    if tokenizer is not None:
        metrics.update(long_captions(tokenizer, enc["captions"]))
    return with_specificity(metrics, enc, scorers)


def with_specificity(metrics: RetrievalMetrics, enc: Mapping[str, Any], scorers: Mapping[str, Scorer]
                     ) -> RetrievalMetrics:
    """`metrics` with the caption-specificity numbers (magclip.diagnostics.specificity) where the samples'
    KEY.json give caption_detail (the synthetic scenes do) and each image has one caption (the
    numbers pair an image with its caption); returns `metrics`."""
    if any(n != 1 for n in enc.get("caption_counts") or ()):
        return metrics
    spec = specificity_metrics(enc["image_features"], enc["text_features"], enc["captions"], enc["keys"],
                               enc.get("metas") or [None] * len(enc["keys"]), scorers, metrics.ranks)
    metrics.update(spec)
    return metrics.with_outcomes(spec)
