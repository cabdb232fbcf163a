"""Length × relevance (magclip/experiments/length_relevance.py): the bilinear prediction's weights, the
exact sum/√n tables, and a planted corpus where short non-relevant records with large norms hurt dot."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from builders import WORDS, make_tiny_bert

from magclip.experiments.length_mix import FormTables, encode_tables
from magclip.experiments.length_relevance import (
    TARGET,
    cell_label,
    cells,
    corners,
    run_surface,
    sqrt_len_tables,
)


def write_folder(folder: Path, docs: dict[str, dict], queries: dict[str, str], qrels: str) -> Path:
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"_id": i, **d}) + "\n" for i, d in docs.items()))
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": q, "text": t}) + "\n" for q, t in queries.items()))
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + qrels)
    return folder


def test_the_grid_and_the_bilinear_weights():
    grid = cells()
    assert grid[0] == (0.0, 0.0) and len(grid) == 10 and (0.5, 0.25) in grid and (0.75, 0.0) in grid
    w = corners(TARGET)                       # p_non 0.55: 0.8 of 0.5, 0.2 of 0.75; r = 0.2/0.55: 8/11 of 0.5
    r = 0.2 / 0.55
    expected = {cell_label(0.5, 0): 0.8 * (1 - r / 0.5), cell_label(0.5, 0.25): 0.8 * r / 0.5,
                cell_label(0.75, 0): 0.2 * (1 - r / 0.5), cell_label(0.75, 0.375): 0.2 * r / 0.5}
    assert w.keys() == expected.keys() and all(w[k] == pytest.approx(v) for k, v in expected.items())
    assert corners((0.5, 0.25)) == {cell_label(0.5, 0.25): pytest.approx(1.0)}
    with pytest.raises(ValueError, match="outside the grid"):
        corners((0.9, 0.2))


def test_sqrt_len_tables_are_what_mean_sqrt_len_pooling_encodes(tmp_path):
    from magclip.models.text import BiEncoder

    rng = np.random.default_rng(0)
    docs = {f"d{i}": {"title": " ".join(rng.choice(WORDS, 3)), "text": " ".join(rng.choice(WORDS, 8 + 6 * i)) + "."}
            for i in range(8)}
    folder = write_folder(tmp_path / "toy", docs, {"q0": "cat dog", "q1": " ".join(rng.choice(WORDS, 30))},
                          "q0\td1\t1\nq1\td2\t1\n")
    bert = make_tiny_bert(tmp_path / "bert")
    mean = encode_tables(BiEncoder.from_pretrained(str(bert), pooling="mean", query_max_length=12,
                                                   passage_max_length=20), folder)
    sqrt = encode_tables(BiEncoder.from_pretrained(str(bert), pooling="mean_sqrt_len", query_max_length=12,
                                                   passage_max_length=20), folder)
    assert (mean.full_tokens > 20).any() and (np.asarray(mean.queries["test"]["tokens"]) > 12).any()  # cut texts too
    derived = sqrt_len_tables(mean, query_max_length=12)
    for a, b in ((derived.full, sqrt.full), (derived.short, sqrt.short),
                 (derived.queries["test"]["vecs"], sqrt.queries["test"]["vecs"])):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_short_non_relevant_records_with_large_norms_hurt_dot_and_relevant_ones_help(tmp_path):
    """Each query has one relevant document and 7 distractors a little further in angle; the short form of
    every document has its direction and 3x its norm. Cosine does not move; dot loses most where only
    non-relevant records are short (p_rel = 0) and nothing where both classes are short alike at p = 1."""
    g = torch.Generator().manual_seed(0)
    docs, vecs, queries, qrels = {}, [], {}, ""
    for i in range(12):
        queries[f"q{i}"] = f"query {i}"
        q = torch.zeros(16)
        q[i] = 1.0
        for j in range(8):
            v = q + (0.2 if j == 0 else 0.45) * torch.nn.functional.normalize(torch.randn(16, generator=g), dim=0)
            docs[f"d{i}_{j}"] = {"title": f"t {i} {j}", "text": "long text. more text here."}
            vecs.append(v)
        qrels += f"q{i}\td{i}_0\t1\n"
    folder = write_folder(tmp_path / "planted", docs, queries, qrels)
    full = torch.nn.functional.normalize(torch.stack(vecs), dim=-1)   # one norm: dot ranks as cosine at p = 0
    t = FormTables(list(docs), full, 3 * full, np.full(len(docs), 50), np.full(len(docs), 5), 128,
                   {"test": {"ids": list(queries), "vecs": torch.eye(16)[:12], "tokens": np.full(12, 4)}})
    analysis, records = run_surface([folder], {"m": {"planted": t}}, seeds=[0, 1, 2],
                                    contrasts={"norm": (("m", "dot"), ("m", "cosine"))}, n_resamples=200)
    entry = analysis["sets"]["planted"]
    cos = entry["means"]["m"]["cosine"]
    assert len({round(v, 12) for v in cos.values()}) == 1 and cos["0,0"] == pytest.approx(1.0)
    c = entry["contrasts"]["norm"]["cells"]
    assert c["0,0"]["diff"] == pytest.approx(0.0)
    assert c["0.75,0"]["diff"] < c["0.75,0.375"]["diff"] <= c["0.75,0.75"]["diff"] + 1e-12
    assert c["0.75,0"]["diff"] < -0.1 and c["0.75,0"]["n_seeds"] == 3
    pred = entry["contrasts"]["norm"]["prediction"]
    assert pred["item_low"] <= pred["diff"] <= pred["item_high"] and sum(pred["corners"].values()) == pytest.approx(1)
    assert entry["relevant"] == 12 and entry["non_relevant"] == 84
    assert len(records["sets"]["planted"]["ndcg@10"]["m"]["dot"]["0.5,0"]) == 3


def test_the_command_scores_added_models_against_both_baselines_and_says_what_their_norms_carry(tmp_path):
    """eval/length_relevance.py end to end on tiny encoders: an added model gets dot − cosine (cosine-trained),
    its control and dot − dot (mean-pooled); the report ends with the norm table, and both figures are drawn."""
    from magclip.cli.length_relevance import main
    from magclip.models.text import BiEncoder

    rng = np.random.default_rng(1)
    docs = {f"d{i}": {"title": " ".join(rng.choice(WORDS, 2)), "text": " ".join(rng.choice(WORDS, 6 + 3 * i)) + ". "
                      + " ".join(rng.choice(WORDS, 5)) + "."} for i in range(24)}
    queries = {f"q{i}": " ".join(rng.choice(WORDS, 4)) for i in range(6)}
    folder = write_folder(tmp_path / "toy", docs, queries, "".join(f"q{i}\td{3 * i}\t1\n" for i in range(6)))
    bert = make_tiny_bert(tmp_path / "bert")
    sqrt = BiEncoder.from_pretrained(str(bert), pooling="mean_sqrt_len").save_pretrained(tmp_path / "sqrt")
    out, report = tmp_path / "surface.json", tmp_path / "surface.md"
    main(["--data", str(folder), "--cache", str(tmp_path / "cache"), "--model", f"cosine={bert}",
          "--model", f"dot={bert}", "--model", f"sqrt={sqrt}", "--resamples", "50", "--out", str(out),
          "--query-max-length", "16", "--passage-max-length", "48",
          "--report", str(report), "--figure", str(tmp_path / "s.png"), "--figure-predictions", str(tmp_path / "p.png")])
    analysis = json.loads(out.read_text())
    contrasts = analysis["sets"]["toy"]["contrasts"]
    assert {"sqrt:dot_minus_cosine", "sqrt:directions", "sqrt:minus_mean_dot"} <= set(contrasts)
    assert contrasts["sqrt:directions"]["cells"]["0,0"]["diff"] == pytest.approx(0.0, abs=1e-6)  # mean's direction
    norms = analysis["norms"]["toy"]
    assert set(norms) == {"cosine", "dot", "sqrt"} and norms["sqrt"]["relevant"] == 6
    assert norms["sqrt"]["rho_length"]["value"] > norms["cosine"]["rho_length"]["value"]
    text = report.read_text()
    assert "What the document norm carries" in text and "| toy | sqrt |" in text
    assert (tmp_path / "s.png").stat().st_size > 0 and (tmp_path / "p.png").stat().st_size > 0


def test_a_set_whose_documents_are_all_relevant_has_no_surface_and_says_so(tmp_path):
    """xquad_en's contexts are each some question's gold passage: p_non has nothing to shorten there, so
    the set is left out with its counts, not reported as a surface that only p_rel moves."""
    from magclip.experiments.length_relevance import markdown_report

    docs = {f"d{i}": {"title": f"t{i}", "text": "long text. more text here."} for i in range(4)}
    folder = write_folder(tmp_path / "all_relevant", docs, {f"q{i}": f"query {i}" for i in range(4)},
                          "".join(f"q{i}\td{i}\t1\n" for i in range(4)))
    full = torch.nn.functional.normalize(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)), dim=-1)
    t = FormTables(list(docs), full, 2 * full, np.full(4, 20), np.full(4, 3), 64,
                   {"test": {"ids": [f"q{i}" for i in range(4)], "vecs": full.clone(), "tokens": np.full(4, 3)}})
    analysis, records = run_surface([folder], {"m": {"all_relevant": t}}, seeds=[0, 1], n_resamples=50)
    assert analysis["sets"] == {} and records["sets"] == {}
    assert analysis["left_out"]["all_relevant"].startswith("4 relevant and 0 other documents")
    assert "Left out: all_relevant: 4 relevant and 0 other documents" in markdown_report(analysis)
