"""Classification metrics: multilabel average precision equal to CLIP_benchmark's own function where scores do
not tie, the pessimistic rule where they do, and hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from magclip.metrics.classification import average_precision_per_class, multilabel_metrics

zeroshot_classification = pytest.importorskip("clip_benchmark.metrics.zeroshot_classification")


@pytest.mark.parametrize("seed", range(5))
def test_average_precision_equals_clip_benchmark_without_ties(seed):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(200, 13, generator=gen)
    targets = (torch.rand(200, 13, generator=gen) < 0.1 * (1 + seed)).float()
    targets[:, 0] = 0  # a class without positives: 0 in both
    theirs = zeroshot_classification.average_precision_per_class(scores, targets)
    np.testing.assert_allclose(average_precision_per_class(scores, targets).numpy(), theirs.double().numpy(),
                               atol=1e-6)


def test_a_hand_ranking():
    scores = torch.tensor([[0.9], [0.8], [0.7], [0.6]])
    targets = torch.tensor([[0.0], [1.0], [0.0], [1.0]])
    assert average_precision_per_class(scores, targets).item() == pytest.approx((1 / 2 + 2 / 4) / 2)


def test_ties_rank_against_the_class():
    """Identical scores: the negatives come first, whatever order the images arrive in."""
    targets = torch.tensor([[1.0], [0.0], [0.0], [1.0]])
    ap = average_precision_per_class(torch.zeros(4, 1), targets).item()
    assert ap == pytest.approx((1 / 3 + 2 / 4) / 2)
    assert average_precision_per_class(torch.zeros(4, 1), targets.flip(0)).item() == ap


def test_the_mean_counts_absent_classes_as_clip_benchmark_does():
    ap = torch.tensor([0.5, 1.0, 0.0], dtype=torch.float64)
    targets = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    m = multilabel_metrics(ap, targets)
    assert m["mean_average_precision"] == pytest.approx(0.5)
    assert m["mean_average_precision_present"] == pytest.approx(0.75)
    assert (m["num_classes_present"], m["num_classes"], m["labels_per_sample"]) == (2, 3, pytest.approx(4 / 3))
