"""sentence-transformers 5 Router and StaticEmbedding folders, evaluated and trained (issue 55, item 2).

Both were refused. The folders are built with sentence-transformers' own API (`Router.for_query_document`
over two tiny local BERTs; `StaticEmbedding` from a local tokenizer with random weights; a Router whose
query route is static, the inference-free layout), saved by it, and: magclip's eval/beir.py nDCG@10
equals sentence-transformers' `encode_query` / `encode_document` + `model.similarity` + pytrec_eval on
the same BEIR folder; a training run trains each route's tower (a static model's embedding table) and
saves a folder that sentence-transformers loads to the same vectors.
"""

import json
import sys

import numpy as np
import pytest
import torch
from builders import make_tiny_bert, toy_rows, write_toy_eval

from magclip.data.beir import doc_text, load_beir
from magclip.models.text import BiEncoder

st = pytest.importorskip("sentence_transformers")
try:
    from sentence_transformers.sentence_transformer import modules as stm
except ImportError:  # sentence-transformers 5
    from sentence_transformers import models as stm

TEXTS = ["the cat sat on the mat " * 5, "a dog", "protein cell study results in human brain white matter", "red"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{kind: folder} saved by sentence-transformers."""
    root = tmp_path_factory.mktemp("st")
    bert_q, bert_d = make_tiny_bert(root / "bert_q", seed=1), make_tiny_bert(root / "bert_d", seed=2)

    def transformer(bert, length):
        return [stm.Transformer(str(bert), max_seq_length=length), stm.Pooling(32, "mean")]

    def static(seed, cut=None):
        from transformers import AutoTokenizer

        torch.manual_seed(seed)
        module = stm.StaticEmbedding(AutoTokenizer.from_pretrained(str(bert_q)), embedding_dim=32)
        if cut:  # a saved tokenizer that truncates: StaticEmbedding's encode cuts there (issue 61)
            module.tokenizer.enable_truncation(cut)
        return module

    made = {"router": [stm.Router.for_query_document(transformer(bert_q, 8), transformer(bert_d, 24))],
            "static": [static(3)],
            "static_query_router": [stm.Router.for_query_document([static(4)], transformer(bert_d, 24))],
            "static_truncated": [static(5, cut=6)],
            "static_document_router": [stm.Router.for_query_document(transformer(bert_q, 24), [static(6, cut=5)])]}
    for kind, modules in made.items():
        st.SentenceTransformer(modules=modules, device="cpu").save(str(root / kind))
    return {kind: root / kind for kind in made}


def peer_ndcg(folder, beir) -> float:
    """sentence-transformers' own encode_query / encode_document / similarity, scored by pytrec_eval."""
    import pytrec_eval

    data = load_beir(beir)
    model = st.SentenceTransformer(str(folder), device="cpu")
    dids, qids = list(data.corpus), list(data.queries)
    scores = model.similarity(model.encode_query([data.queries[q] for q in qids], convert_to_tensor=True),
                              model.encode_document([doc_text(data.corpus[d]) for d in dids], convert_to_tensor=True))
    run = {q: {d: float(scores[i, j]) for j, d in enumerate(dids)} for i, q in enumerate(qids)}
    per_query = pytrec_eval.RelevanceEvaluator(data.qrels, {"ndcg_cut.10"}).evaluate(run)
    return float(np.mean([v["ndcg_cut_10"] for v in per_query.values()]))


@pytest.mark.parametrize("kind", ["router", "static", "static_query_router", "static_truncated",
                                  "static_document_router"])
def test_the_folder_evaluates_as_sentence_transformers_does(folders, kind, tmp_path, monkeypatch):
    from magclip.cli.beir import console

    folder = folders[kind]
    model = BiEncoder.from_pretrained(folder)
    peer = st.SentenceTransformer(str(folder), device="cpu")
    assert torch.allclose(model.encode(TEXTS, "query"), peer.encode_query(TEXTS, convert_to_tensor=True), atol=1e-5)
    assert torch.allclose(model.encode(TEXTS, "passage"), peer.encode_document(TEXTS, convert_to_tensor=True),
                          atol=1e-5)
    if kind == "router":   # each route its own length, as sentence-transformers cuts
        assert (model.settings.query_max_length, model.settings.passage_max_length) == (8, 24)
    if kind == "static_truncated":   # the saved tokenizer's cut, and it matters for the long text
        assert model.settings.passage_max_length == 6
        assert model.tokenize(TEXTS[:1], "passage")["input_ids"].shape[1] == 6
        assert model.tokenize(TEXTS[:1], "passage", max_length=10**6)["input_ids"].shape[1] == 30
    if kind == "static_document_router":
        assert model.settings.passage_max_length == 5

    beir, _ = write_toy_eval(tmp_path, toy_rows(24, seed=5))
    monkeypatch.setattr(sys, "argv", ["magclip-beir", "--model", str(folder), "--data", str(beir),
                                      "--out", str(tmp_path / "r.json"), "--no-progress"])
    console()
    ours = json.loads((tmp_path / "r.json").read_text())["toybeir"]["ndcg@10"]
    assert ours == pytest.approx(peer_ndcg(folder, beir), abs=1e-6)


@pytest.mark.parametrize("kind", ["router", "static"])
def test_the_folder_trains_and_saves_what_sentence_transformers_loads(folders, kind, tmp_path):
    from pathlib import Path

    from magclip.config import load_text_config
    from magclip.training.text import train_text

    rows = toy_rows(8)
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = Path(__file__).resolve().parents[2] / "configs" / "text" / "scifact.yaml"
    results = train_text(load_text_config(recipe, [
        f"model.name={folders[kind]}", f"model.shared={'false' if kind == 'router' else 'true'}",
        "model.query_max_length=null", "model.passage_max_length=null",
        f"data.train={tmp_path / 'pairs.jsonl'}", "data.beir=null", f"output_dir={tmp_path / 'runs'}",
        f"name={kind}", "train.batch_size=4", "train.max_steps=2", "train.warmup_steps=0", "train.lr=0.05",
        "eval.at_start=false", "eval.beir={}", "eval.sts={}", "eval.rag={}", "eval.length_bins=0"]))
    trained = results["final_model"]
    before, after = BiEncoder.from_pretrained(folders[kind]), BiEncoder.from_pretrained(trained)
    peer = st.SentenceTransformer(trained, device="cpu")
    for side, encode in (("query", peer.encode_query), ("passage", peer.encode_document)):
        ours = after.encode(TEXTS, side)
        assert torch.allclose(ours, encode(TEXTS, convert_to_tensor=True), atol=1e-5)
        assert not torch.allclose(ours, before.encode(TEXTS, side), atol=1e-4)   # this side's tower trained


def test_what_cannot_work_is_refused_in_one_line(folders, tmp_path):
    import shutil

    with pytest.raises(ValueError, match="Router with separate query and document routes; load it with shared=False"):
        BiEncoder.from_pretrained(folders["router"], shared=True)
    with pytest.raises(ValueError, match="a StaticEmbedding model pools by the mean of its tokens; pooling='cls'"):
        BiEncoder.from_pretrained(folders["static"], pooling="cls")
    renamed = shutil.copytree(folders["router"], tmp_path / "renamed")
    config = json.loads((renamed / "router_config.json").read_text())
    config["structure"]["passage"] = config["structure"].pop("document")
    (renamed / "router_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        BiEncoder.from_pretrained(renamed)
    assert "\n" not in str(err.value) and "routes ['passage', 'query']; magclip reads a Router with the routes " \
        "'query' and 'document'" in str(err.value)
