"""The pooling arithmetic (magclip/diagnostics/pooling_norm.py): the shuffled-token baseline and the closed
form sqrt(‖μ‖² + tr Σ / n) on token states with a known answer."""

import numpy as np
import pytest
import torch

from magclip.diagnostics.pooling_norm import (
    arithmetic_curve,
    explained,
    log_slope,
    pooled_norms,
    shuffled_mean_norms,
)


def texts_of(lengths, dim=48, offset=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, dim, generator=g) + offset for n in lengths]


def test_independent_zero_mean_tokens_give_the_inverse_square_root_law():
    lengths = np.random.default_rng(0).integers(4, 200, 300).tolist()
    states = texts_of(lengths)
    norms = pooled_norms(states)
    assert log_slope(norms["mean"], norms["n"]) == pytest.approx(-0.5, abs=0.05)
    assert log_slope(shuffled_mean_norms(states), norms["n"]) == pytest.approx(-0.5, abs=0.05)
    assert abs(log_slope(norms["sqrt_len"], norms["n"])) < 0.05
    curve = arithmetic_curve(states, norms["n"])
    assert np.allclose(curve, np.sqrt(48 / norms["n"]), rtol=0.05)   # tr Σ = 48, μ ≈ 0


def test_a_shared_mean_direction_flattens_the_curve_and_the_arithmetic_explains_it():
    lengths = np.random.default_rng(1).integers(4, 200, 300).tolist()
    states = texts_of(lengths, offset=0.2, seed=1)          # ‖μ‖² = 0.04 · 48 ≈ 1.9 = tr Σ / 25
    norms = pooled_norms(states)
    stats = explained(norms["mean"], shuffled_mean_norms(states), arithmetic_curve(states, norms["n"]), norms["n"],
                      n_boot=200)
    assert -0.5 < stats["slope"]["value"] < -0.05
    assert stats["slope_share"]["value"] == pytest.approx(1.0, abs=0.15)
    assert abs(stats["rho_after_arithmetic"]["value"]) < 0.2
    assert stats["rho"]["low"] <= stats["rho"]["value"] <= stats["rho"]["high"]


def test_cls_norm_is_the_first_token_alone():
    states = texts_of([3, 9])
    assert np.allclose(pooled_norms(states)["cls"], [s[0].norm().item() for s in states])
