"""Zero-shot classification metrics from ranked class predictions: pure functions of tensors."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor


def classification_metrics(top: Tensor, labels: Tensor, num_classes: int, ks: Sequence[int] = (1, 5)) -> dict[str, float]:
    """From `top` [N, k] (class indices by descending score) and `labels` [N]: top-k accuracy for each k
    the ranking holds (no top-5 with fewer than 5 classes), mean per-class recall (over the classes present
    in `labels`) and chance top-1."""
    if len(labels) == 0:
        return {"num_samples": 0}
    hit = top == labels.unsqueeze(1)
    metrics = {f"top{k}": float(hit[:, :k].any(dim=1).double().mean()) for k in ks if k <= top.shape[1]}
    correct = hit[:, 0].double()
    per_class_n = torch.bincount(labels, minlength=num_classes).double()
    per_class_hit = torch.bincount(labels, weights=correct, minlength=num_classes)
    present = per_class_n > 0
    metrics["mean_per_class_recall"] = float((per_class_hit[present] / per_class_n[present]).mean())
    metrics["chance_top1"] = 1.0 / num_classes
    metrics["num_samples"] = len(labels)
    metrics["num_classes_present"] = int(present.sum())
    return metrics


def average_precision_per_class(scores: Tensor, targets: Tensor) -> Tensor:
    """[C] average precision of each class from `scores` [N, C] and 0/1 `targets` [N, C]: the mean, over the
    class's positive samples, of the precision at each one's rank. CLIP_benchmark's multilabel metric (its
    `average_precision_per_class`, from tnt), a class without positives scoring 0 as there; where scores tie,
    the negatives rank first (the pessimistic rank of magclip.metrics.retrieval; CLIP_benchmark's unstable
    sort leaves tie order to chance)."""
    n = scores.shape[0]
    ranks = np.arange(1, n + 1, dtype=np.float64)
    scores_np, truth_np = scores.double().numpy(), targets.bool().numpy()
    ap = np.zeros(scores.shape[1])
    for k in range(scores.shape[1]):
        hit = truth_np[np.lexsort((truth_np[:, k], -scores_np[:, k])), k]  # score descending, negatives first in a tie
        if hit.any():
            ap[k] = (np.cumsum(hit)[hit] / ranks[hit]).mean()
    return torch.from_numpy(ap)


def multilabel_metrics(ap: Tensor, targets: Tensor) -> dict[str, float]:
    """From each class's average precision and the 0/1 `targets` [N, C]: the mean over every class (as
    CLIP_benchmark averages, absent classes included at 0), how many classes occur, and the mean over those."""
    present = targets.bool().any(dim=0)
    return {"mean_average_precision": float(ap.mean()),
            "mean_average_precision_present": float(ap[present].mean()) if present.any() else 0.0,
            "num_samples": len(targets), "num_classes": targets.shape[1],
            "num_classes_present": int(present.sum()),
            "labels_per_sample": float(targets.bool().sum(dim=1).double().mean())}
