"""What the document norm carries (magclip/experiments/norm_signal.py): a norm that is only length shows a
relevance d that vanishes at equal length; a norm that tracks relevance keeps it."""

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from magclip.diagnostics.magnitude import cohens_d
from magclip.experiments.length_mix import FormTables
from magclip.experiments.norm_signal import markdown_table, norm_signal

N = 600


def planted(norm_of) -> tuple[FormTables, set[str]]:
    """Relevant documents are longer (as in real corpora), every third one has a short form of 5-15 tokens;
    each text's norm is `norm_of(tokens, relevant, noise)`."""
    rng = np.random.default_rng(0)
    relevant = rng.random(N) < 0.2
    tokens = np.where(relevant, rng.integers(60, 200, N), rng.integers(10, 150, N))
    short_tokens = np.where(np.arange(N) % 3 == 0, rng.integers(5, 16, N), tokens)
    directions = torch.nn.functional.normalize(torch.randn(N, 8, generator=torch.Generator().manual_seed(0)), dim=1)

    def vectors(t: np.ndarray) -> torch.Tensor:
        norms = norm_of(np.minimum(t, 160), relevant, rng.normal(0, 0.05, N))
        return directions * torch.from_numpy(norms).float()[:, None]

    full, short = vectors(tokens), vectors(short_tokens)
    short[short_tokens == tokens] = full[short_tokens == tokens]
    ids = [f"d{i}" for i in range(N)]
    tables = FormTables(ids, full, short, tokens, short_tokens, 160, {})
    return tables, {d for d, r in zip(ids, relevant) if r}


def test_a_norm_that_is_only_length_loses_its_relevance_d_at_equal_length():
    tables, relevant = planted(lambda n, rel, noise: 4.0 / np.sqrt(n) * np.exp(noise))
    s = norm_signal(tables, relevant, n_boot=200)
    shorts = (tables.short != tables.full).any(dim=1).numpy()       # a third, less the few cut to equal length
    assert N / 3 - 10 < shorts.sum() <= N / 3
    norms = np.concatenate([tables.full.double().norm(dim=1).numpy(), tables.short[shorts].double().norm(dim=1).numpy()])
    lengths = np.minimum(np.concatenate([tables.full_tokens, tables.short_tokens[shorts]]), 160)
    is_rel = np.array([d in relevant for d in tables.doc_ids])
    is_rel = np.concatenate([is_rel, is_rel[shorts]])
    assert s["texts"] == N + shorts.sum() and s["docs"] == N and s["forms"] == "both"
    assert s["rho_length"]["value"] == spearmanr(norms, lengths).statistic
    assert s["rho_length"]["high"] < -0.9
    assert s["d_relevant"]["value"] == cohens_d(norms[is_rel], norms[~is_rel]) and s["d_relevant"]["high"] < -0.1
    assert s["d_residual"]["low"] < 0 < s["d_residual"]["high"] and s["length_r2"] > 0.9
    assert s["length_slope"] == pytest.approx(np.polyfit(np.log(lengths), np.log(norms), 1)[0])
    assert s["lengths"]["relevant_median"] > s["lengths"]["other_median"] and s["relevant"] == is_rel[:N].sum()
    full_only = norm_signal(tables, relevant, forms="full", n_boot=50)
    assert full_only["texts"] == N and full_only["rho_length"]["value"] == spearmanr(
        norms[:N], lengths[:N]).statistic


def test_a_norm_that_tracks_relevance_keeps_its_d_at_equal_length():
    tables, relevant = planted(lambda n, rel, noise: 1.0 + 0.1 * rel + noise)
    s = norm_signal(tables, relevant, n_boot=200)
    assert s["d_residual"]["low"] > 1.0 and s["d_relevant"]["low"] > 1.0
    assert s["rho_length"]["low"] > 0          # relevant documents are longer, so the norm follows length a little
    norms = np.concatenate([tables.full.double().norm(dim=1).numpy(),
                            tables.short[(tables.short != tables.full).any(dim=1)].double().norm(dim=1).numpy()])
    assert s["norm_cv"] == pytest.approx(norms.std() / norms.mean()) and 0.05 < s["norm_cv"] < 0.2
    table = markdown_table({"toy": {"planted": s}})
    assert "| toy | planted |" in table and table.count("\n") == 3 and table.count("|---") == 8
