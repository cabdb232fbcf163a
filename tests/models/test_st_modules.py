"""sentence-transformers folders with more modules than Transformer + Pooling (issue 49, item 1).

A folder laid out Transformer -> Pooling -> Dense -> Normalize (LaBSE, distiluse, sentence-t5) was
encoded as the bare Transformer + Pooling. Now every module takes part as `SentenceTransformer.encode`
runs it (Normalize excepted: the scoring mode replaces it), or the folder is refused in one line
naming the module. The folders are built with sentence-transformers itself from a tiny local BERT,
and every number is checked against sentence-transformers' own `encode`.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from builders import crafted_torch_file, make_tiny_bert, toy_rows, write_toy_eval

from magclip.models.text import BiEncoder

st = pytest.importorskip("sentence_transformers")
try:
    from sentence_transformers.sentence_transformer import modules as stm
except ImportError:  # sentence-transformers 5
    from sentence_transformers import models as stm

TEXTS = ["the cat sat on the mat", "a dog", "protein cell study results in human brain white matter",
         "red", "gene data model for cancer and cell study with large small blue green results"]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> Path:
    return make_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


def st_folder(bert: Path, out: Path, *after_pooling, pooling: str = "mean", seed: int = 1) -> Path:
    """A sentence-transformers folder saved by sentence-transformers: Transformer + Pooling + `after_pooling`."""
    torch.manual_seed(seed)
    modules = [stm.Transformer(str(bert), max_seq_length=32), stm.Pooling(32, pooling), *after_pooling]
    st.SentenceTransformer(modules=modules, device="cpu").save(str(out))
    return out


def st_raw(folder: Path) -> "st.SentenceTransformer":
    """The folder as sentence-transformers loads it, less a final Normalize: the raw vectors magclip returns."""
    model = st.SentenceTransformer(str(folder), device="cpu")
    kept = [m for m in model if not isinstance(m, stm.Normalize)]
    return st.SentenceTransformer(modules=kept, device="cpu") if len(kept) < len(model) else model


def st_encode(model, texts=TEXTS) -> torch.Tensor:
    return model.encode(texts, convert_to_tensor=True, normalize_embeddings=False).cpu()


@pytest.fixture(scope="module")
def dense_folder(tiny_bert, tmp_path_factory) -> Path:
    """The LaBSE layout in small: Transformer -> Pooling(mean) -> Dense(32 -> 16, tanh) -> Normalize."""
    return st_folder(tiny_bert, tmp_path_factory.mktemp("st") / "dense",
                     stm.Dense(32, 16, activation_function=torch.nn.Tanh()), stm.Normalize())


def one_line_error(exc_info) -> str:
    message = str(exc_info.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------------------------ supported
def test_dense_folder_encodes_like_sentence_transformers(dense_folder):
    m = BiEncoder.from_pretrained(dense_folder)
    assert m.dim == 16 and m.hidden_size == 32 and m.default_scorer["mode"] == "cosine"  # it ends in Normalize
    raw = m.encode(TEXTS, "passage")
    assert raw.shape == (len(TEXTS), 16)
    assert torch.allclose(raw, st_encode(st_raw(dense_folder)), atol=1e-5)
    full = st_encode(st.SentenceTransformer(str(dense_folder), device="cpu"))   # with its Normalize
    assert torch.allclose(torch.nn.functional.normalize(raw, dim=-1), full, atol=1e-5)
    assert not torch.allclose(raw.norm(dim=-1), torch.ones(len(TEXTS)))       # Normalize left to the scorer


def test_layernorm_and_dropout_after_dense_are_run_too(tiny_bert, tmp_path):
    norm = stm.LayerNorm(16)
    with torch.no_grad():   # a LayerNorm that is not the identity, so skipping it would show
        norm.norm.weight.uniform_(0.5, 2.0)
        norm.norm.bias.uniform_(-1, 1)
    folder = st_folder(tiny_bert, tmp_path / "ln", stm.Dense(32, 16, bias=False, activation_function=torch.nn.GELU()),
                       stm.Dropout(0.3), norm)
    m = BiEncoder.from_pretrained(folder)
    assert [type(x).__name__ for x in m.query_head] == ["Dense", "Dropout", "LayerNorm"]
    assert m.default_scorer["mode"] == "cosine"   # no Normalize: the folder's similarity_fn_name
    assert torch.allclose(m.encode(TEXTS, "query"), st_encode(st.SentenceTransformer(str(folder), device="cpu")),
                          atol=1e-5)


def test_a_transformer_kept_in_a_sub_folder_loads_from_there(dense_folder, tmp_path):
    """Older sentence-transformers folders keep the Transformer in 0_Transformer/ (modules.json names it)."""
    folder = tmp_path / "sub"
    shutil.copytree(dense_folder, folder)
    (folder / "0_Transformer").mkdir()
    for f in folder.iterdir():
        if f.is_file() and f.name not in ("modules.json", "config_sentence_transformers.json", "README.md"):
            f.rename(folder / "0_Transformer" / f.name)
    modules = json.loads((folder / "modules.json").read_text())
    modules[0]["path"] = "0_Transformer"
    (folder / "modules.json").write_text(json.dumps(modules))
    ours = BiEncoder.from_pretrained(folder).encode(TEXTS, "passage")
    assert torch.allclose(ours, st_encode(st_raw(folder)), atol=1e-5)


def test_do_lower_case_lowercases_as_sentence_transformers_does(dense_folder, tiny_bert, tmp_path):
    """sentence_bert_config.json's do_lower_case=true: sentence-transformers lowercases every text even where
    the tokenizer is cased; magclip's tokenizer does too (and the folder it saves keeps doing so)."""
    from transformers import BertTokenizerFast

    folder = tmp_path / "cased"
    shutil.copytree(dense_folder, folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (folder / f).unlink()
    shutil.copy(tiny_bert / "vocab.txt", folder / "vocab.txt")
    texts = [t.upper() for t in TEXTS]
    config_file = folder / "sentence_bert_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "do_lower_case": True}))
    cased = BertTokenizerFast(vocab_file=str(folder / "vocab.txt"), vocab=str(folder / "vocab.txt"),
                              do_lower_case=False, model_max_length=32)
    assert cased.tokenize("CAT") != cased.tokenize("cat")
    cased.save_pretrained(str(folder))
    m = BiEncoder.from_pretrained(folder)
    assert torch.allclose(m.encode(texts, "passage"), st_encode(st_raw(folder), texts), atol=1e-5)
    assert torch.allclose(m.encode(texts, "passage"), m.encode(TEXTS, "passage"), atol=1e-6)
    saved = m.save_pretrained(tmp_path / "saved")
    assert torch.allclose(BiEncoder.from_pretrained(saved).encode(texts, "passage"), m.encode(TEXTS, "passage"))


def test_a_trained_head_is_saved_back_for_sentence_transformers(dense_folder, tmp_path):
    """The Dense module is part of the trained tower: it gets gradients, and save_pretrained writes it so that
    `SentenceTransformer(path)` and magclip give the same (changed) vectors; also with separate towers."""
    m = BiEncoder.from_pretrained(dense_folder)
    tokens = m.tokenize(TEXTS, "query")
    m.train()
    m.encode_tokens(tokens, "query").pow(2).sum().backward()
    assert m.query_head[0].linear.weight.grad.abs().sum() > 0
    with torch.no_grad():   # stands in for an optimizer step on the head
        m.query_head[0].linear.weight.add_(0.1 * torch.randn_like(m.query_head[0].linear.weight))
    trained = m.encode(TEXTS, "passage")
    assert not torch.allclose(trained, BiEncoder.from_pretrained(dense_folder).encode(TEXTS, "passage"), atol=1e-4)
    saved = m.save_pretrained(tmp_path / "saved")
    assert json.loads((saved / "modules.json").read_text())[2]["path"] == "2_Dense"
    assert torch.allclose(st_encode(st.SentenceTransformer(str(saved), device="cpu")), trained, atol=1e-5)
    assert torch.equal(BiEncoder.from_pretrained(saved).encode(TEXTS, "passage"), trained)

    two = BiEncoder.from_pretrained(saved, shared=False)
    with torch.no_grad():
        two.passage_head[0].linear.bias.add_(0.5)
    q, d = two.encode(TEXTS, "query"), two.encode(TEXTS, "passage")
    assert torch.allclose(q, trained, atol=1e-6) and not torch.allclose(q, d, atol=1e-3)
    routed = two.save_pretrained(tmp_path / "two")
    back = BiEncoder.from_pretrained(routed)
    assert torch.equal(back.encode(TEXTS, "query"), q) and torch.equal(back.encode(TEXTS, "passage"), d)
    model = st.SentenceTransformer(str(routed), device="cpu")
    assert torch.allclose(model.encode_query(TEXTS, convert_to_tensor=True).cpu(), q, atol=1e-5)
    assert torch.allclose(model.encode_document(TEXTS, convert_to_tensor=True).cpu(), d, atol=1e-5)


def test_training_a_dense_folder_end_to_end(dense_folder, tmp_path):
    """train/text.py from the Dense folder: the run's saved model keeps and trains the Dense module, and
    sentence-transformers loads it with magclip's vectors."""
    from magclip.config import load_text_config
    from magclip.training.text import train_text

    rows = toy_rows(16)
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    beir, _ = write_toy_eval(tmp_path, rows[:8])
    cfg = load_text_config(Path(__file__).resolve().parents[2] / "configs" / "text" / "scifact.yaml", [
        f"model.name={dense_folder}", "model.query_max_length=16", "model.passage_max_length=24",
        f"data.train={tmp_path / 'pairs.jsonl'}", "data.beir=null", f"output_dir={tmp_path / 'runs'}", "name=dense",
        "train.batch_size=4", "train.max_steps=2", "train.lr=1e-2", "train.warmup_steps=0", "eval.at_start=false",
        f"eval.beir={{toy: {beir}}}", "eval.sts={}", "eval.rag={}", "eval.length_bins=0"])
    results = train_text(cfg)
    saved = Path(results["final_model"])
    ours = BiEncoder.from_pretrained(saved)
    before = BiEncoder.from_pretrained(dense_folder)
    assert not torch.allclose(ours.query_head[0].linear.weight, before.query_head[0].linear.weight)
    texts = [r["positive"] for r in rows[:5]]
    assert torch.allclose(st_encode(st.SentenceTransformer(str(saved), device="cpu"), texts),
                          ours.encode(texts, "passage"), atol=1e-5)


# ------------------------------------------------------------------------------------ refused
def edit_modules(src: Path, dst: Path, change) -> Path:
    shutil.copytree(src, dst)
    modules = json.loads((dst / "modules.json").read_text())
    (dst / "modules.json").write_text(json.dumps(change(modules)))
    return dst


CUSTOM = {"idx": 4, "name": "4", "path": "4_Mine", "type": "my_package.modules.MyHead"}
WEIGHTED = {"idx": 1, "name": "1", "path": "1_WeightedLayerPooling",
            "type": "sentence_transformers.sentence_transformer.modules.WeightedLayerPooling"}


@pytest.mark.parametrize("change, named, expected", [
    (lambda m: m[:3] + [CUSTOM] + m[3:], 3, "is custom code"),
    (lambda m: m[:1] + [WEIGHTED] + m[1:], 1, "sits between Transformer and Pooling"),
    (lambda m: [m[0], m[1], m[3], m[2]], 2, "is followed by other modules"),   # Normalize before Dense
    (lambda m: m[:1], 0, "without a Pooling module"),
], ids=["custom", "between", "normalize_first", "no_pooling"])
def test_other_modules_are_refused_in_one_line_naming_them(dense_folder, tmp_path, change, named, expected):
    folder = edit_modules(dense_folder, tmp_path / "edited", change)
    entry = json.loads((folder / "modules.json").read_text())[named]
    with pytest.raises(ValueError) as err:
        BiEncoder.from_pretrained(folder)
    message = one_line_error(err)
    assert str(folder) in message and expected in message and "Dense / LayerNorm / Dropout" in message
    assert entry["type"] in message and (entry["path"] or "the folder root") in message


@pytest.mark.parametrize("config, expected", [
    ({"pooling_mode": "max"}, "'max'"),
    ({"pooling_mode": "weightedmean"}, "'weightedmean'"),
    ({"pooling_mode": ["mean", "max"]}, "['mean', 'max']"),
    ({"pooling_mode_max_tokens": True}, "'max'"),
    ({"pooling_mode_weightedmean_tokens": True}, "'weightedmean'"),
    ({"pooling_mode_mean_tokens": True, "pooling_mode_mean_sqrt_len_tokens": True}, "'mean_sqrt_len_tokens'"),
    ({"pooling_mode": "mean", "include_prompt": False}, "include_prompt=false"),
])
def test_other_poolings_are_refused(dense_folder, tmp_path, config, expected):
    folder = tmp_path / "pool"
    shutil.copytree(dense_folder, folder)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"embedding_dimension": 32, **config}))
    with pytest.raises(ValueError) as err:
        BiEncoder.from_pretrained(folder)
    message = one_line_error(err)
    assert str(folder / "1_Pooling" / "config.json") in message and expected in message


def test_legacy_pooling_keys_read_as_sentence_transformers_reads_them(dense_folder, tmp_path):
    """A legacy boolean config with no mode set means mean to sentence-transformers; a one-element list is that mode."""
    for name, config in (("none_set", {"pooling_mode_mean_tokens": False}), ("listed", {"pooling_mode": ["cls"]})):
        folder = tmp_path / name
        shutil.copytree(dense_folder, folder)
        (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **config}))
        m = BiEncoder.from_pretrained(folder)
        assert m.settings.pooling == ("mean" if name == "none_set" else "cls")
        assert torch.allclose(m.encode(TEXTS, "passage"), st_encode(st_raw(folder)), atol=1e-5)


@pytest.mark.parametrize("key, value, expected", [
    ("activation_function", "my_package.fancy_gelu", "is not a torch class"),
    ("module_input_name", "token_embeddings", "module_input_name='token_embeddings'"),
    ("in_features", 48, "takes 48-wide vectors, the model before it gives 32"),
])
def test_a_dense_module_run_otherwise_than_its_config_says_is_refused(dense_folder, tmp_path, key, value, expected):
    folder = tmp_path / "dense"
    shutil.copytree(dense_folder, folder)
    config_file = folder / "2_Dense" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), key: value}))
    with pytest.raises(ValueError) as err:
        BiEncoder.from_pretrained(folder)
    message = one_line_error(err)
    assert str(config_file) in message and expected in message


def test_dense_weights_that_carry_code_are_refused_and_run_nothing(dense_folder, tmp_path):
    from safetensors.torch import load_file

    from magclip.io import UnsafeFileError

    folder = tmp_path / "crafted"
    shutil.copytree(dense_folder, folder)
    weights = load_file(str(folder / "2_Dense" / "model.safetensors"))
    (folder / "2_Dense" / "model.safetensors").unlink()
    marker = tmp_path / "payload_ran"
    crafted_torch_file(folder / "2_Dense" / "pytorch_model.bin", marker, weights)
    with pytest.raises(UnsafeFileError, match=f"refusing to load {folder / '2_Dense' / 'pytorch_model.bin'}"):
        BiEncoder.from_pretrained(folder)
    assert not marker.exists()
    (folder / "2_Dense" / "pytorch_model.bin").unlink()
    with pytest.raises(ValueError) as err:
        BiEncoder.from_pretrained(folder)
    assert "the Dense module does not load" in one_line_error(err) and "model.safetensors" in str(err.value)


# ------------------------------------------------------------------------------------ the command
def run_beir_command(argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """eval/beir.py as a user runs it (the installed command: one `error:` line and exit 2 on bad input)."""
    import sys

    from magclip.cli.beir import console

    monkeypatch.setattr(sys, "argv", ["magclip-beir", *argv])
    try:
        console()
        code = 0
    except SystemExit as stop:
        code = int(stop.code or 0)
    return code, capsys.readouterr().err


def test_the_beir_command_on_a_dense_folder_matches_sentence_transformers_with_pytrec_eval(
        dense_folder, tmp_path, monkeypatch, capsys):
    """nDCG@10 of eval/beir.py equals pytrec_eval on sentence-transformers' own encode vectors (cosine, the
    folder's similarity), and the documents it searched are sentence-transformers' vectors."""
    import numpy as np
    import pytrec_eval

    rows = toy_rows(24, seed=3)
    beir, _ = write_toy_eval(tmp_path, rows)
    out = tmp_path / "results.json"
    code, err = run_beir_command(["--model", str(dense_folder), "--data", str(beir), "--out", str(out),
                                  "--export-index", str(tmp_path / "index"), "--no-progress"], monkeypatch, capsys)
    assert code == 0, err
    entry = json.loads(out.read_text())["toybeir"]
    assert entry["scorer"]["mode"] == "cosine"

    model = st.SentenceTransformer(str(dense_folder), device="cpu")
    docs = [r["positive"] for r in rows]   # title "" + " " + text, stripped
    d = model.encode_document(docs, convert_to_tensor=True).cpu()
    q = model.encode_query([r["query"] for r in rows], convert_to_tensor=True).cpu()
    exported = np.load(tmp_path / "index" / "toybeir" / "cosine" / "docs.npy")
    assert np.allclose(exported, d.numpy(), atol=1e-5)
    scores = model.similarity(q, d)
    run = {f"q{i}": {f"d{j}": float(scores[i, j]) for j in range(len(docs))} for i in range(len(rows))}
    qrels = {f"q{i}": {f"d{i}": 1} for i in range(len(rows))}
    per_query = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10"}).evaluate(run)
    peer = float(np.mean([v["ndcg_cut_10"] for v in per_query.values()]))
    assert entry["ndcg@10"] == pytest.approx(peer, abs=1e-9)


def test_the_beir_command_refuses_an_unsupported_folder_in_one_line(dense_folder, tmp_path, monkeypatch, capsys):
    folder = edit_modules(dense_folder, tmp_path / "custom", lambda m: m[:3] + [CUSTOM] + m[3:])
    beir, _ = write_toy_eval(tmp_path, toy_rows(4))
    code, err = run_beir_command(["--model", str(folder), "--data", str(beir), "--out", str(tmp_path / "r.json")],
                                 monkeypatch, capsys)
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err
    assert "my_package.modules.MyHead" in lines[0] and "4_Mine" in lines[0] and str(folder) in lines[0]
    assert not (tmp_path / "r.json").exists()
