"""The length-mixing scorer: variants assembled from the full/short tables rank as the variant folders
evaluated directly do, and the residual norm removes length and keeps what is left."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from builders import WORDS, make_tiny_bert  # noqa: E402

from magclip.data.beir import load_beir  # noqa: E402
from magclip.data.length_mix import replaced_ids, write_variants  # noqa: E402
from magclip.experiments.length_mix import (  # noqa: E402
    RESIDUAL,
    FormTables,
    VariantScorer,
    analyse_set,
    assemble,
    choose_alpha,
    encode_tables,
    residual_docs,
    residual_log_norm,
)


def write_folder(folder: Path, docs: dict[str, dict], queries: dict[str, str], qrels: dict[str, str]) -> Path:
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"_id": i, **d}) + "\n" for i, d in docs.items()))
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": q, "text": t}) + "\n" for q, t in queries.items()))
    for split, rows in qrels.items():
        (folder / "qrels" / f"{split}.tsv").write_text("query-id\tcorpus-id\tscore\n" + rows)
    return folder


def test_residual_fit_removes_log_length_and_keeps_the_rest():
    rng = np.random.default_rng(0)
    tokens = rng.integers(5, 300, size=200)
    x = np.log(np.minimum(tokens, 128))
    r = rng.normal(0, 0.1, size=200)
    basis = np.stack([np.ones_like(x), x], 1)
    r -= basis @ np.linalg.lstsq(basis, r, rcond=None)[0]       # r orthogonal to [1, log n]: what the fit leaves
    norms = 2.0 * np.minimum(tokens, 128) ** -0.3 * np.exp(r)
    resid, fit = residual_log_norm(norms, tokens, max_length=128)
    assert fit["slope"] == pytest.approx(-0.3, abs=1e-9) and fit["intercept"] == pytest.approx(np.log(2.0), abs=1e-9)
    np.testing.assert_allclose(resid, r, atol=1e-9)
    assert 0 < fit["r2"] < 1


def test_residual_at_alpha_zero_is_cosine():
    g = torch.Generator().manual_seed(0)
    q, d = torch.randn(5, 8, generator=g), torch.randn(30, 8, generator=g) * torch.rand(30, 1, generator=g)
    resid = np.random.default_rng(1).normal(size=30)
    cos = torch.nn.functional.normalize(q, dim=-1) @ torch.nn.functional.normalize(d, dim=-1).T
    torch.testing.assert_close(torch.nn.functional.normalize(q, dim=-1) @ residual_docs(d, resid, 0.0).T, cos)
    scaled = torch.nn.functional.normalize(q, dim=-1) @ residual_docs(d, resid, 1.5).T
    torch.testing.assert_close(scaled, cos * torch.from_numpy(np.exp(1.5 * resid)).float())


def planted_tables(tmp_path: Path) -> tuple[Path, FormTables]:
    """6 queries (basis vectors); each has 3 distractors slightly closer in angle than its relevant document,
    whose norm is 3x larger at the same length: cosine ranks it 4th, the residual norm (α > 0) 1st."""
    docs, vecs, queries = {}, [], {}
    for i in range(6):
        queries[f"q{i}"] = f"query {i}"
        for j in range(3):
            v = torch.zeros(8)
            v[i], v[(i + j + 1) % 6] = 1.0, 0.3
            docs[f"d{i}_{j}"], _ = {"title": f"distractor {i} {j}", "text": "long text. more text here."}, vecs.append(v)
        v = torch.zeros(8)
        v[i], v[7] = 1.0, 0.35
        docs[f"r{i}"], _ = {"title": f"relevant {i}", "text": "long text. more text here."}, vecs.append(3 * v)
    test = "".join(f"q{i}\tr{i}\t1\n" for i in range(3))
    train = "".join(f"q{i}\tr{i}\t1\n" for i in range(3, 6))
    folder = write_folder(tmp_path / "planted", docs, queries, {"test": test, "train": train})
    full = torch.stack(vecs)
    qvecs = torch.eye(8)[:6]
    tables = FormTables(list(docs), full, full / 2, np.full(len(docs), 50), np.full(len(docs), 5), 128,
                        {"test": {"ids": ["q0", "q1", "q2"], "vecs": qvecs[:3], "tokens": np.full(3, 4)},
                         "train": {"ids": ["q3", "q4", "q5"], "vecs": qvecs[3:], "tokens": np.full(3, 4)}})
    return folder, tables


def test_alpha_is_chosen_where_the_residual_norm_carries_relevance(tmp_path):
    folder, tables = planted_tables(tmp_path)
    alpha, curve = choose_alpha(folder, "train", tables, alphas=(-2.0, 0.0, 2.0, 4.0))
    assert curve["0"] == pytest.approx(1 / np.log2(5)) and alpha > 0 and curve[f"{alpha:g}"] == pytest.approx(1.0)
    scores = VariantScorer(folder, "test", {"m": tables}).score([0.0, 0.5], [0, 1, 2], {"m": alpha}, cache=tmp_path / "c")
    again = VariantScorer(folder, "test", {"m": tables}).score([0.0, 0.5], [0, 1, 2], {"m": alpha}, cache=tmp_path / "c")
    assert (tmp_path / "c" / "m" / "planted.scores.json").is_file() and again.rho["m"]["0.5"] == scores.rho["m"]["0.5"]
    np.testing.assert_array_equal(again.ndcg["m"][RESIDUAL]["0.5"], scores.ndcg["m"][RESIDUAL]["0.5"])
    assert scores.ndcg["m"]["cosine"]["0"].shape == (1, 3) and scores.ndcg["m"]["cosine"]["0.5"].shape == (3, 3)
    a = analyse_set(scores, {"res": (("m", RESIDUAL), ("m", "cosine"))}, n_resamples=200)
    assert a["contrasts"]["res"]["0"]["diff"] == pytest.approx(1 - 1 / np.log2(5))
    assert a["curves"]["m"]["dot"]["0"]["mean"] == pytest.approx(1.0)       # dot sees the 3x norm too


def test_assembled_variants_rank_as_the_variant_folders(tmp_path):
    """Tables encoded once + `assemble` == encoding each variant folder and evaluating it as eval/beir.py does."""
    from magclip.evaluation.text import evaluate_beir_data
    from magclip.models.text import BiEncoder

    rng = np.random.default_rng(0)

    def words(n):
        return " ".join(rng.choice(WORDS, size=n))

    docs = {f"d{i}": {"title": words(3), "text": f"{words(6)}. {words(20)}."} for i in range(24)}
    queries = {f"q{i}": words(4) for i in range(6)}
    folder = write_folder(tmp_path / "toy", docs, queries,
                          {"test": "".join(f"q{i}\td{3 * i}\t1\nq{i}\td{3 * i + 1}\t2\n" for i in range(6))})
    model = BiEncoder.from_pretrained(str(make_tiny_bert(tmp_path / "bert")))
    tables = encode_tables(model, folder, batch_size=5)
    write_variants(folder, tmp_path / "out", shares=(0.5,), seeds=(1,))
    variant = load_beir(tmp_path / "out" / "toy" / "p=0.5,seed=1", "test")
    replaced = replaced_ids(list(docs), 0.5, 1)
    direct = model.encode(variant.doc_texts(), "passage", batch_size=5)
    vecs, tokens = assemble(tables, replaced)
    torch.testing.assert_close(vecs, direct, atol=1e-5, rtol=1e-4)
    assert tokens.tolist() == model.token_lengths(variant.doc_texts(), "passage")
    expected = evaluate_beir_data(model, variant, ["cosine", "dot"], batch_size=5, metrics=("ndcg@10",))
    scorer = VariantScorer(folder, "test", {"m": tables})
    for mode in ("cosine", "dot"):
        found, _, _ = scorer.rank("m", mode, replaced)
        values = expected["modes"][mode].values["ndcg@10"]
        np.testing.assert_allclose([found.ndcg[q] for q in sorted(found.ndcg)], values, atol=1e-6)
