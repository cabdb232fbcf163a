"""What the document norm carries (magclip/experiments/norm_signal.py): a norm that is only length shows a
relevance d that vanishes at equal length; a norm that tracks relevance keeps it."""

import numpy as np
import torch
from scipy.stats import spearmanr

from magclip.diagnostics.magnitude import cohens_d
from magclip.experiments.length_mix import FormTables
from magclip.experiments.norm_signal import markdown_table, norm_signal

N = 600


def planted(norm_of) -> tuple[FormTables, set[str]]:
    """Relevant documents are longer (as in real corpora); each row's norm is `norm_of(tokens, relevant, noise)`."""
    rng = np.random.default_rng(0)
    relevant = rng.random(N) < 0.2
    tokens = np.where(relevant, rng.integers(60, 200, N), rng.integers(10, 150, N))
    norms = norm_of(np.minimum(tokens, 160), relevant, rng.normal(0, 0.05, N))
    directions = torch.nn.functional.normalize(torch.randn(N, 8, generator=torch.Generator().manual_seed(0)), dim=1)
    full = directions * torch.from_numpy(norms).float()[:, None]
    ids = [f"d{i}" for i in range(N)]
    tables = FormTables(ids, full, full.clone(), tokens, tokens.copy(), 160, {})
    return tables, {d for d, r in zip(ids, relevant) if r}


def test_a_norm_that_is_only_length_loses_its_relevance_d_at_equal_length():
    tables, relevant = planted(lambda n, rel, noise: 4.0 / np.sqrt(n) * np.exp(noise))
    s = norm_signal(tables, relevant, n_boot=200)
    norms = tables.full.double().norm(dim=1).numpy()
    is_rel = np.array([d in relevant for d in tables.doc_ids])
    assert s["rho_length"]["value"] == spearmanr(norms, np.minimum(tables.full_tokens, 160)).statistic
    assert s["rho_length"]["high"] < -0.9
    assert s["d_relevant"]["value"] == cohens_d(norms[is_rel], norms[~is_rel]) and s["d_relevant"]["high"] < -0.5
    assert s["d_residual"]["low"] < 0 < s["d_residual"]["high"] and s["length_r2"] > 0.9
    assert s["length_slope"] == np.polyfit(np.log(np.minimum(tables.full_tokens, 160)), np.log(norms), 1)[0]
    assert s["lengths"]["relevant_median"] > s["lengths"]["other_median"] and s["relevant"] == is_rel.sum()


def test_a_norm_that_tracks_relevance_keeps_its_d_at_equal_length():
    tables, relevant = planted(lambda n, rel, noise: 1.0 + 0.1 * rel + noise)
    s = norm_signal(tables, relevant, n_boot=200)
    assert s["d_residual"]["low"] > 1.0 and s["d_relevant"]["low"] > 1.0
    assert s["rho_length"]["low"] > 0          # relevant documents are longer, so the norm follows length a little
    norms = tables.full.double().norm(dim=1).numpy()
    assert s["norm_cv"] == norms.std() / norms.mean() and 0.05 < s["norm_cv"] < 0.2
    table = markdown_table({"toy": {"planted": s}})
    assert "| toy | planted |" in table and table.count("\n") == 3 and table.count("|---") == 8
