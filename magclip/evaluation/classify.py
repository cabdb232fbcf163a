"""Zero-shot classification scored with the evaluated model's own Scorer: class prototypes, top-k, and
mean average precision for multilabel sets.

Images are the queries, class prototypes the documents, so the i2t Scorer scores
them. Class names x prompt templates are encoded raw, then reduced to one prototype per class in
the Scorer's *prepared document space* (`class_prototypes`), and an image's scores are
`prepare_queries(image) @ prototypes.T`:

- gamma_d == 1 (cosine, dnorm, or a learnable run that ended at gamma_d = 1): documents carry no
  magnitude by construction, so the prototype is open_clip's `build_zero_shot_classifier`:
  L2-normalise each template embedding, average, L2-normalise again. In cosine mode the result
  equals open_clip's classifier (tests check it).
- gamma_d < 1 (qnorm, dot, learnable): the document's magnitude is part of the score the model
  was trained with, so renormalising would throw away what is evaluated. The prototype is the mean
  of the *prepared* template embeddings, `mean_t prepare_docs(d_t)`. By linearity its score is the
  mean of the per-template scores, `s(q, proto) = mean_t s(q, d_t)` (any gamma_q), and with a
  single template it is exactly `prepare_docs(d)`: the class keeps the mean magnitude its texts
  have under the model's own exponent.

Metrics: top-1, top-5 accuracy (each k up to the number of classes) and mean per-class recall
(balanced accuracy over the classes that occur in the data), over all samples and again without the
samples of chosen class groups (e.g. the emoji Flags category); the candidate set is always every class.

A multilabel set (labels [N, C], 0/1 over the classes: CLIP_benchmark's `multilabel` folders, VOC2007) is
scored as CLIP_benchmark scores it: each class ranks every image, and the metric is the mean over the
classes of each one's average precision (`magclip.metrics.classification.average_precision_per_class`;
ties rank against the class).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from magclip.data.classes import ClassSet, fill_template
from magclip.evaluation.checkpoint import EvalModel
from magclip.evaluation.encode import encode_texts
from magclip.metrics.classification import (
    average_precision_per_class,
    classification_metrics,
    multilabel_metrics,
)
from magclip.metrics.ranks import RetrievalMetrics
from magclip.similarity import Scorer

TOP_K = (1, 5)  # classification accuracies reported (each k up to the number of classes)


def class_text_features(model: EvalModel, names: Sequence[str], templates: Sequence[str | Callable[[str], str]],
                        *, batch_size: int = 256, device: str | torch.device = "cpu") -> Tensor:
    """Raw features of every (class, template) text: [C, T, D]."""
    texts = [fill_template(t, n) for n in names for t in templates]
    return encode_texts(model, texts, batch_size=batch_size, device=device).reshape(len(names), len(templates), -1)


def class_prototypes(template_features: Tensor, scorer: Scorer) -> Tensor:
    """[C, D] class prototypes in the i2t Scorer's prepared-document space from [C, T, D] raw
    template features (see the module docstring for the rule and why).

    gamma_d == 1: normalise, mean, renormalise (open_clip's `build_zero_shot_classifier`, as rows).
    gamma_d < 1: mean over templates of `scorer.prepare_docs(template feature)`.
    """
    if template_features.ndim != 3:
        raise ValueError(f"expected [classes, templates, dim] features, got {tuple(template_features.shape)}")
    prepared = scorer.prepare_docs(template_features)
    mean = prepared.mean(dim=1)
    if scorer.gamma_d == 1.0:
        return mean / mean.norm(dim=-1, keepdim=True)
    return mean


def _class_scores(image_features: Tensor, prototypes: Tensor, scorer: Scorer,
                  chunk_size: int = 4096) -> Iterator[Tensor]:
    """`prepare_queries(image) @ prototypes.T` in fp32, [chunk, C] at a time."""
    for start in range(0, len(image_features), chunk_size):
        with torch.no_grad(), torch.autocast(device_type=image_features.device.type, enabled=False):
            yield scorer.prepare_queries(image_features[start:start + chunk_size]) @ prototypes.float().T


def top_classes(image_features: Tensor, prototypes: Tensor, scorer: Scorer, k: int = 5,
                chunk_size: int = 4096) -> Tensor:
    """[N, min(k, C)] class indices by descending score `prepare_queries(image) @ prototypes.T`."""
    k = min(k, len(prototypes))
    return torch.cat([s.topk(k, dim=1).indices.cpu()
                      for s in _class_scores(image_features, prototypes, scorer, chunk_size)])


def classify(image_features: Tensor, labels: Tensor, prototypes: Tensor, scorer: Scorer, classes: ClassSet,
             exclude_groups: Sequence[str] = (), items: Sequence[str] | None = None) -> dict[str, Any]:
    """Metrics over all samples, without each excluded group and all of them, and top-1 per group.
    Top-k only for k <= the number of classes (a top-5 of 3 classes would always be 1). With `items` (the
    samples' keys) each sample's top-k hits ride along (`per_sample`, a `RetrievalMetrics` whose values the
    results file keeps beside it) for paired statistics. Labels [N, C] (0/1 over the classes) are a
    multilabel set: `classify_multilabel`."""
    if labels.ndim == 2:
        if exclude_groups:
            raise ValueError(f"excluding groups {list(exclude_groups)} needs one label a sample; this set is multilabel")
        return classify_multilabel(image_features, labels, prototypes, scorer, classes)
    ks = tuple(k for k in TOP_K if k <= len(classes))
    top = top_classes(image_features, prototypes, scorer, k=max(ks))
    out: dict[str, Any] = {"all": classification_metrics(top, labels, len(classes), ks)}
    if items is not None:  # the hits themselves go beside the results file (<stem>.queries.npz), keyed per_sample.topK
        out["per_sample"] = RetrievalMetrics({"num_samples": len(items)})
        for k in ks:
            out["per_sample"].add_values(f"top{k}", (top[:, :k] == labels.unsqueeze(1)).any(dim=1).double().numpy(),
                                         items)
    if classes.groups is not None:
        group_of = np.array(classes.groups)[labels.numpy()]
        for g in exclude_groups:
            keep = torch.from_numpy(group_of != g)
            out[f"without_{g}"] = classification_metrics(top[keep], labels[keep], len(classes), ks)
        correct = (top[:, 0] == labels).double().numpy()
        out["per_group_top1"] = {g: float(correct[group_of == g].mean()) for g in sorted(set(group_of.tolist()))}
    return out


def classify_multilabel(image_features: Tensor, labels: Tensor, prototypes: Tensor, scorer: Scorer,
                        classes: ClassSet) -> dict[str, Any]:
    """Mean average precision over the classes, each class ranking every image by its score (CLIP_benchmark's
    multilabel metric; `average_precision_per_class`). Each class's AP rides along (`per_class`, keyed by
    class name) for paired statistics: in a multilabel set the class is the query."""
    scores = torch.cat([s.cpu() for s in _class_scores(image_features, prototypes, scorer)])
    ap = average_precision_per_class(scores, labels)
    per_class = RetrievalMetrics({"num_classes": len(classes)})
    per_class.add_values("AP", ap.numpy(), classes.names)
    return {"all": multilabel_metrics(ap, labels), "per_class": per_class}
