"""Zero-shot classification metrics from ranked class predictions: pure functions of tensors."""

from __future__ import annotations

from collections.abc import Sequence

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
