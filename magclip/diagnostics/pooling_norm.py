"""Where the norm's length prior comes from: the arithmetic of pooling n token states.

Mean pooling averages n token states. Where their directions spread, the mean's norm falls with n: for
n states drawn independently from one distribution (mean μ, covariance Σ), E‖mean‖² = ‖μ‖² + tr(Σ)/n,
∝ n^-1/2 while tr(Σ)/n dominates. So a mean-pooled norm can be a length prior by construction, before
any training. This module measures, on the same texts and per model:

- `pooled_norms`: ‖mean‖, ‖sum/√n‖ (mean × √n) and ‖CLS‖ of each text's own token states, and n (the
  tokens the encoder saw, special tokens included: what mean pooling divides by);
- `shuffled_mean_norms`: the independent-directions baseline: each text's n replaced by n token states
  drawn without replacement from ALL texts' tokens (one pool, seeded), so the norm depends on n alone;
- `arithmetic_curve`: the closed form sqrt(‖μ‖² + tr(Σ)/n) of that baseline, from the pooled tokens;
- `explained`: how much of the norm-length relation the arithmetic accounts for: Spearman ρ(norm, n) of
  the real and the shuffled means, the log-log slopes of both (their ratio: the share of the real slope
  the arithmetic gives), and ρ of the real norm divided by the arithmetic curve (what is left once the
  arithmetic is taken out), each with a bootstrap interval over texts.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import numpy as np
import torch
from scipy.stats import spearmanr


@torch.no_grad()
def token_states(model, texts: Sequence[str], side: str = "passage", batch_size: int = 32) -> list[torch.Tensor]:
    """Each text's last-layer token states [n, D] (float32, padding dropped) from a BiEncoder's tower."""
    tower = model.tower(side)
    tower.eval()
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out: list[torch.Tensor | None] = [None] * len(texts)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        batch = model.tokenize([texts[i] for i in idx], side)
        hidden = tower(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       **({"token_type_ids": batch["token_type_ids"]} if "token_type_ids" in batch else {})
                       ).last_hidden_state.float()
        for row, i in enumerate(idx):
            out[i] = hidden[row, :int(batch["attention_mask"][row].sum())].clone()
    return [t for t in out if t is not None]


def pooled_norms(states: Sequence[torch.Tensor]) -> dict[str, np.ndarray]:
    """n, ‖mean‖, ‖sum/√n‖ and ‖first token‖ of each text."""
    n = np.array([len(s) for s in states], dtype=float)
    mean = np.array([s.mean(0).norm().item() for s in states])
    return {"n": n, "mean": mean, "sqrt_len": mean * np.sqrt(n), "cls": np.array([s[0].norm().item() for s in states])}


def shuffled_mean_norms(states: Sequence[torch.Tensor], seed: int = 0) -> np.ndarray:
    """‖mean‖ of n token states drawn without replacement from every text's tokens, for each text's n."""
    pool = torch.cat(list(states))
    rng = np.random.default_rng(seed)
    return np.array([pool[torch.from_numpy(rng.choice(len(pool), size=len(s), replace=False))].mean(0).norm().item()
                     for s in states])


def arithmetic_curve(states: Sequence[torch.Tensor], n: np.ndarray) -> np.ndarray:
    """sqrt(‖μ‖² + tr(Σ)/n): the expected mean norm of n independent draws from the pooled tokens."""
    pool = torch.cat(list(states)).double()
    mu = pool.mean(0)
    trace = float(pool.var(0, unbiased=True).sum())
    return np.sqrt(float(mu @ mu) + trace / np.asarray(n, dtype=float))


def log_slope(norms: np.ndarray, n: np.ndarray) -> float:
    """Least-squares slope of log‖·‖ on log n."""
    return float(np.polyfit(np.log(n), np.log(norms), 1)[0])


def _stats(norm: np.ndarray, shuffled: np.ndarray, curve: np.ndarray, n: np.ndarray) -> dict[str, float]:
    slope, slope_shuffled = log_slope(norm, n), log_slope(shuffled, n)
    return {"rho": float(spearmanr(norm, n)[0]), "rho_shuffled": float(spearmanr(shuffled, n)[0]),
            "slope": slope, "slope_shuffled": slope_shuffled, "slope_share": slope_shuffled / slope if slope else float("nan"),
            "rho_after_arithmetic": float(spearmanr(norm / curve, n)[0])}


def explained(norm: np.ndarray, shuffled: np.ndarray, curve: np.ndarray, n: np.ndarray, n_boot: int = 2000,
              seed: int = 0) -> dict[str, Any]:
    """The statistics of the module docstring, each with a 95 % percentile bootstrap interval over texts."""
    point = _stats(norm, shuffled, curve, n)
    rng = np.random.default_rng(seed)
    draws = [_stats(norm[i], shuffled[i], curve[i], n[i]) for i in (rng.integers(0, len(n), len(n)) for _ in range(n_boot))]
    return {k: {"value": v, "low": float(np.percentile([d[k] for d in draws], 2.5)),
                "high": float(np.percentile([d[k] for d in draws], 97.5))} for k, v in point.items()}


def binned_curve(n: np.ndarray, values: np.ndarray, edges: Sequence[float]) -> list[dict[str, float]]:
    """Median of `values` per bin of n (for the figure and the table)."""
    out = []
    for lo, hi in pairwise(edges):
        sel = (n >= lo) & (n < hi)
        if sel.any():
            out.append({"n_low": float(lo), "n_high": float(hi), "texts": int(sel.sum()),
                        "n_median": float(np.median(n[sel])), "median": float(np.median(values[sel]))})
    return out
