"""Poolings whose magnitude does not fall with length (issue 63): mean × sqrt(n) (`mean_sqrt_len`,
sentence-transformers' `mean_sqrt_len_tokens`) and a learned magnitude (models/magnitude.py: the mean's
direction, the norm softplus(w·h + b)). Checked against sentence-transformers' own modules and encode."""

import json
from pathlib import Path

import pytest
import torch
from builders import make_tiny_bert, toy_rows, write_toy_eval

from magclip.io import copy_weights_folder
from magclip.models.magnitude import LearnedMagnitude, inverse_softplus, magnitude_head
from magclip.models.text import BiEncoder, mean_pool, pool, sqrt_len_pool

st = pytest.importorskip("sentence_transformers")
from sentence_transformers.sentence_transformer import modules as stm

TEXTS = ["the cat sat on the mat", "a dog", "protein cell study results in human brain white matter",
         "red", "gene data model for cancer and cell study with large small blue green results"]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> Path:
    return make_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


def unit(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(x, dim=-1)


def padded(n_tokens: list[int], dim: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token states [B, T, D] right-padded with garbage, and their mask."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(len(n_tokens), max(n_tokens), dim, generator=g)
    mask = torch.zeros(len(n_tokens), max(n_tokens), dtype=torch.long)
    for i, n in enumerate(n_tokens):
        mask[i, :n] = 1
        hidden[i, n:] = 1e3
    return hidden, mask


def test_mean_sqrt_len_is_the_mean_times_sqrt_n_and_matches_sentence_transformers():
    hidden, mask = padded([3, 7, 1, 12])
    n = mask.sum(1, keepdim=True).float()
    assert torch.allclose(sqrt_len_pool(hidden, mask), mean_pool(hidden, mask) * n.sqrt(), atol=1e-5)
    assert torch.allclose(unit(pool(hidden, mask, "mean_sqrt_len")), unit(mean_pool(hidden, mask)), atol=1e-6)
    theirs = stm.Pooling(16, "mean_sqrt_len_tokens")({"token_embeddings": hidden, "attention_mask": mask})
    assert torch.allclose(theirs["sentence_embedding"], sqrt_len_pool(hidden, mask), atol=1e-5)


def test_for_independent_token_directions_sqrt_n_keeps_the_norm_where_the_mean_loses_it():
    """The arithmetic behind the length prior: the mean of n independent directions has norm ∝ n^-1/2;
    the sum over sqrt(n) has a norm that does not depend on n."""
    norms = {}
    for n in (4, 64, 1024):
        hidden, mask = padded([n] * 64, dim=32, seed=n)
        norms[n] = (mean_pool(hidden, mask).norm(dim=-1).mean().item(),
                    sqrt_len_pool(hidden, mask).norm(dim=-1).mean().item())
    assert norms[4][0] / norms[1024][0] == pytest.approx(16.0, rel=0.1)        # sqrt(1024 / 4)
    assert norms[4][1] / norms[1024][1] == pytest.approx(1.0, abs=0.1)


def test_learned_magnitude_keeps_the_mean_direction_and_sets_the_norm():
    head = LearnedMagnitude(16, init_norm=2.0)
    hidden, mask = padded([3, 7, 1, 12])
    pooled = mean_pool(hidden, mask)
    out = head({"sentence_embedding": pooled.clone()})["sentence_embedding"]
    assert torch.allclose(unit(out), unit(pooled), atol=1e-6)
    assert torch.allclose(out.norm(dim=-1), torch.full((4,), 2.0), atol=1e-5)   # w = 0 at start: one norm
    with torch.no_grad():
        head.norm_head.weight.normal_()
    out = head({"sentence_embedding": pooled.clone()})["sentence_embedding"]
    expected = torch.nn.functional.softplus(pooled @ head.norm_head.weight[0] + head.norm_head.bias)
    assert torch.allclose(out.norm(dim=-1), expected, atol=1e-5)
    assert torch.allclose(unit(out), unit(pooled), atol=1e-6)


def test_learned_magnitude_gradient_is_the_analytic_one():
    """d‖out‖/dw = sigmoid(w·h + b) h and d‖out‖/db = sigmoid(w·h + b): the head learns from w = 0 on."""
    head = LearnedMagnitude(8)
    h = torch.randn(3, 8)
    out = head({"sentence_embedding": h.clone()})["sentence_embedding"]
    out.norm(dim=-1).sum().backward()
    s = torch.sigmoid(h @ head.norm_head.weight[0].detach() + head.norm_head.bias.detach())
    assert torch.allclose(head.norm_head.weight.grad[0], (s[:, None] * h).sum(0), atol=1e-5)
    assert torch.allclose(head.norm_head.bias.grad, s.sum()[None], atol=1e-5)
    assert head.norm_head.weight.grad.abs().sum() > 0
    assert inverse_softplus(1.0) == pytest.approx(0.5413, abs=1e-4)


def test_a_learned_magnitude_model_saves_and_loads_in_sentence_transformers_and_magclip(tiny_bert, tmp_path):
    m = BiEncoder.from_pretrained(tiny_bert, pooling="mean")
    plain = m.encode(TEXTS, "passage")
    m.add_head(lambda width: magnitude_head("learned", width))
    with pytest.raises(ValueError, match="already has a LearnedMagnitude"):
        m.add_head(lambda width: magnitude_head("learned", width))
    with torch.no_grad():
        m.query_head[0].norm_head.weight.normal_(std=0.5)
    ours = m.encode(TEXTS, "passage")
    assert torch.allclose(unit(ours), unit(plain), atol=1e-5)
    assert ours.norm(dim=-1).std() > 1e-3
    saved = m.save_pretrained(tmp_path / "learned")
    modules = json.loads((saved / "modules.json").read_text())
    assert modules[2] == {"idx": 2, "name": "2", "path": "2_LearnedMagnitude",
                          "type": "magclip.models.magnitude.LearnedMagnitude"}
    assert torch.equal(BiEncoder.from_pretrained(saved).encode(TEXTS, "passage"), ours)
    with pytest.raises(ValueError, match="trust_remote_code"):   # custom code: sentence-transformers asks first
        st.SentenceTransformer(str(saved), device="cpu")
    theirs = st.SentenceTransformer(str(saved), device="cpu", trust_remote_code=True)
    assert torch.allclose(theirs.encode(TEXTS, convert_to_tensor=True).cpu(), ours, atol=1e-5)
    # kept as the committed models are (float16 records, restored in float32): the head's own weights go along
    copy_weights_folder(saved, tmp_path / "half", "float16")
    copy_weights_folder(tmp_path / "half", tmp_path / "restored", "float32")
    head = "2_LearnedMagnitude/model.safetensors"
    assert (tmp_path / "restored" / head).read_bytes() == (saved / head).read_bytes()
    restored = BiEncoder.from_pretrained(tmp_path / "restored")
    assert torch.equal(restored.query_head[0].norm_head.weight, m.query_head[0].norm_head.weight)
    assert torch.allclose(restored.encode(TEXTS, "passage"), ours, rtol=1e-2, atol=1e-3)
    peer = st.SentenceTransformer(str(tmp_path / "restored"), device="cpu", trust_remote_code=True)
    assert torch.allclose(peer.encode(TEXTS, convert_to_tensor=True).cpu(), restored.encode(TEXTS, "passage"), atol=1e-5)


def test_a_mean_sqrt_len_model_saves_and_loads_in_sentence_transformers_and_magclip(tiny_bert, tmp_path):
    m = BiEncoder.from_pretrained(tiny_bert, pooling="mean_sqrt_len")
    ours = m.encode(TEXTS, "passage")
    saved = m.save_pretrained(tmp_path / "sqrt")
    assert json.loads((saved / "1_Pooling" / "config.json").read_text())["pooling_mode_mean_sqrt_len_tokens"]
    back = BiEncoder.from_pretrained(saved)
    assert back.settings.pooling == "mean_sqrt_len" and torch.equal(back.encode(TEXTS, "passage"), ours)
    theirs = st.SentenceTransformer(str(saved), device="cpu")
    assert torch.allclose(theirs.encode(TEXTS, convert_to_tensor=True).cpu(), ours, atol=1e-5)


def test_training_with_a_learned_magnitude_moves_the_head(tiny_bert, tmp_path):
    """model.magnitude=learned in a text run: the head is built from the config, trained, saved."""
    from magclip.config import load_text_config
    from magclip.training.text import train_text

    rows = toy_rows(16)
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    beir, _ = write_toy_eval(tmp_path, rows[:8])
    cfg = load_text_config(Path(__file__).resolve().parents[2] / "configs" / "text" / "scifact.yaml", [
        f"model.name={tiny_bert}", "model.pooling=mean", "model.magnitude=learned", "model.query_max_length=16",
        "model.passage_max_length=24", f"data.train={tmp_path / 'pairs.jsonl'}", "data.beir=null",
        f"output_dir={tmp_path / 'runs'}", "name=learned", "loss.mode=dot", "train.batch_size=4",
        "train.max_steps=2", "train.lr=1e-2", "train.warmup_steps=0", "eval.at_start=false",
        f"eval.beir={{toy: {beir}}}", "eval.sts={}", "eval.rag={}", "eval.length_bins=0"])
    results = train_text(cfg)
    trained = BiEncoder.from_pretrained(results["final_model"])
    head = trained.query_head[0]
    assert isinstance(head, LearnedMagnitude) and head.norm_head.weight.abs().sum() > 0
