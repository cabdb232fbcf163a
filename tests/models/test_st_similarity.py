"""A sentence-transformers folder's own similarity (`similarity_fn_name`) scores it (issue 55, item 3).

A folder saved with euclidean or manhattan was scored as cosine without a word when no --mode was given.
Now: dot is scored as magclip's dot mode and cosine as cosine (equal to sentence-transformers'
`model.similarity`); euclidean on a model that ends in Normalize as cosine (the same ranking, checked
against `model.similarity`); any other (euclidean on raw vectors, manhattan) is refused without --mode
in one line naming the file (magclip/models/st_similarity.py).
"""

import json
import sys

import pytest
import torch
from builders import make_tiny_bert, toy_rows, write_toy_eval

from magclip.evaluation.text import text_scorers
from magclip.models.text import BiEncoder

st = pytest.importorskip("sentence_transformers")
try:
    from sentence_transformers.sentence_transformer import modules as stm
except ImportError:  # sentence-transformers 5
    from sentence_transformers import models as stm

QUERIES = ["the cat sat", "protein cell study", "red blue green", "brain white matter"]
DOCS = ["the cat sat on the mat", "a dog", "protein cell study results in human brain", "red", "gene data model",
        "white matter of the brain and a large small human"]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    return make_tiny_bert(tmp_path_factory.mktemp("bert"))


def saved_with(bert, folder, similarity: str, normalize: bool):
    torch.manual_seed(3)
    modules = [stm.Transformer(str(bert), max_seq_length=32), stm.Pooling(32, "mean"),
               *([stm.Normalize()] if normalize else [])]
    model = st.SentenceTransformer(modules=modules, device="cpu", similarity_fn_name=similarity)
    model.save(str(folder))
    return folder


def magclip_scores(folder) -> torch.Tensor:
    model = BiEncoder.from_pretrained(folder)
    [scorer] = text_scorers(model)
    return scorer(model.encode(QUERIES, "query"), model.encode(DOCS, "passage"))


def st_scores(folder) -> torch.Tensor:
    model = st.SentenceTransformer(str(folder), device="cpu")
    return model.similarity(model.encode_query(QUERIES, convert_to_tensor=True),
                            model.encode_document(DOCS, convert_to_tensor=True)).cpu()


@pytest.mark.parametrize("similarity, normalize", [("dot", False), ("cosine", False), ("dot", True)])
def test_dot_and_cosine_score_as_sentence_transformers_does(tiny_bert, tmp_path, similarity, normalize):
    folder = saved_with(tiny_bert, tmp_path / "m", similarity, normalize)
    assert json.loads((folder / "config_sentence_transformers.json").read_text())["similarity_fn_name"] == similarity
    assert torch.allclose(magclip_scores(folder), st_scores(folder), atol=1e-4)


def test_euclidean_on_normalized_vectors_ranks_as_sentence_transformers_does(tiny_bert, tmp_path):
    folder = saved_with(tiny_bert, tmp_path / "m", "euclidean", True)
    ours, theirs = magclip_scores(folder), st_scores(folder)
    assert BiEncoder.from_pretrained(folder).default_scorer["mode"] == "cosine"
    assert torch.equal(ours.argsort(dim=1, descending=True), theirs.argsort(dim=1, descending=True))
    assert torch.allclose(-torch.sqrt((2 - 2 * ours).clamp_min(0)), theirs, atol=1e-4)   # the distance itself


@pytest.mark.parametrize("similarity, normalize", [("manhattan", True), ("euclidean", False)])
def test_a_similarity_no_mode_expresses_is_refused_without_mode(tiny_bert, tmp_path, monkeypatch, capsys,
                                                                  similarity, normalize):
    from magclip.cli.beir import console

    folder = saved_with(tiny_bert, tmp_path / "m", similarity, normalize)
    beir, _ = write_toy_eval(tmp_path, toy_rows(6))
    argv = ["magclip-beir", "--model", str(folder), "--data", str(beir), "--out", str(tmp_path / "r.json"),
            "--no-progress"]
    monkeypatch.setattr(sys, "argv", argv)
    capsys.readouterr()   # what building the folder printed
    with pytest.raises(SystemExit) as stop:
        console()
    stderr = capsys.readouterr().err
    err = stderr.strip().splitlines()[-1]    # above it: transformers' weight-loading progress bar
    assert stop.value.code == 2 and err.startswith("error: ") and "Traceback" not in stderr
    assert f"config_sentence_transformers.json: similarity_fn_name={similarity!r}" in err and "pass --mode" in err
    monkeypatch.setattr(sys, "argv", [*argv, "--mode", "cosine"])   # a mode given: scored so
    console()
    assert json.loads((tmp_path / "r.json").read_text())
