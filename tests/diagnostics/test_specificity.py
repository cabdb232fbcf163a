"""Caption specificity diagnostics (magclip.diagnostics.specificity) against a computation by hand
(plain loops and textbook formulas, no shared code) on a tiny synthetic set, and read through the real
loader from the synthetic shards' KEY.json."""

import json
import math

import numpy as np
import pytest
import torch

from magclip.cli.diagnose import main as diagnose_main
from magclip.data.shards import build_clip_loader
from magclip.data.synthetic import ensure_synthetic
from magclip.diagnostics.specificity import DETAIL_BINS, PREFIX, detail_bin, specificity_metrics
from magclip.evaluation.clip import encode_loader, evaluate_retrieval, retrieval_from_features
from magclip.models.clip import create_clip
from magclip.similarity import Scorer


@pytest.fixture(scope="module")
def tiny_set(tmp_path_factory):
    return ensure_synthetic(tmp_path_factory.mktemp("synthetic"), num_train=8, num_val=40, image_size=16,
                            shard_size=20, seed=5)


def val_batches(data, batch_size=16, preprocess=None, tokenizer=None):
    import open_clip

    tokenizer = tokenizer or open_clip.get_tokenizer("RN50")
    preprocess = preprocess or (lambda image: torch.zeros(3, 16, 16))
    return build_clip_loader(data.val_urls, preprocess=preprocess, tokenizer=tokenizer, batch_size=batch_size,
                             num_samples=None, shuffle=False, workers=0, rank=0, world_size=1, drop_last=False)


def ranks_by_hand(values):
    """Average ranks (1-based), ties sharing the mean of their positions."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for m in range(i, j + 1):
            ranks[order[m]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def pearson_by_hand(x, y):
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    return sxy / math.sqrt(sum((a - mx) ** 2 for a in x) * sum((b - my) ** 2 for b in y))


def cohens_d_by_hand(a, b):
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    va = sum((x - ma) ** 2 for x in a) / (len(a) - 1)
    vb = sum((x - mb) ** 2 for x in b) / (len(b) - 1)
    return (ma - mb) / math.sqrt(((len(a) - 1) * va + (len(b) - 1) * vb) / (len(a) + len(b) - 2))


def bin_by_hand(detail):
    return "vague" if detail <= 1 / 3 + 1e-3 else "partial" if detail <= 2 / 3 + 1e-3 else "detailed"


def gap_by_hand(queries, candidates, captions, i, scorer, k):
    scores = [float(scorer(queries[i:i + 1], candidates[j:j + 1])) for j in range(len(candidates))]
    others = sorted((j for j in range(len(candidates)) if captions[j] != captions[i]), key=lambda j: -scores[j])[:k]
    norm = lambda j: float(candidates[j].norm())
    return math.log(norm(i)) - sum(math.log(norm(j)) for j in others) / len(others)


def test_the_specificity_numbers_match_a_computation_by_hand(tiny_set):
    enc = {"keys": [], "captions": [], "metas": []}
    for batch in val_batches(tiny_set):
        for name, values in enc.items():
            values.extend(batch[name])
    n = len(enc["keys"])
    assert n == 40 and all(m and "caption_detail" in m for m in enc["metas"])   # read from KEY.json
    details = [m["caption_detail"] for m in enc["metas"]]
    objects = [m["num_objects"] for m in enc["metas"]]
    assert {detail_bin(x) for x in details} == {name for name, _, _ in DETAIL_BINS}
    gen = torch.Generator().manual_seed(0)
    # text norms that grow with the caption's detail (plus noise), image norms unrelated to the scene
    texts = torch.randn(n, 8, generator=gen)
    texts = texts / texts.norm(dim=1, keepdim=True) * torch.tensor([1 + 2 * d for d in details])[:, None]
    texts = texts * (1 + 0.2 * torch.rand(n, 1, generator=gen))
    images = texts + 0.5 * torch.randn(n, 8, generator=gen)
    scorers = {"i2t": Scorer("dnorm"), "t2i": Scorer("qnorm")}
    metrics = retrieval_from_features(images, texts, enc["captions"], scorers)
    spec = specificity_metrics(images, texts, enc["captions"], enc["keys"], enc["metas"], scorers, metrics.ranks, k=3)

    text_norms = [float(t.norm()) for t in texts]
    image_norms = [float(v.norm()) for v in images]
    rho = pearson_by_hand(ranks_by_hand(text_norms), ranks_by_hand(details))
    assert spec[PREFIX + "rho_text_norm_detail"] == pytest.approx(rho, abs=1e-12) and rho > 0.5
    assert spec[PREFIX + "rho_image_norm_objects"] == pytest.approx(
        pearson_by_hand(ranks_by_hand(image_norms), ranks_by_hand(objects)), abs=1e-12)
    half = 1.959964 * math.sqrt(1.06 / (n - 3))
    assert spec[PREFIX + "rho_text_norm_detail_ci_low"] == pytest.approx(math.tanh(math.atanh(rho) - half))
    detailed = [t for t, d in zip(text_norms, details) if bin_by_hand(d) == "detailed"]
    vague = [t for t, d in zip(text_norms, details) if bin_by_hand(d) == "vague"]
    assert spec[PREFIX + "d_text_norm_detailed_vs_vague"] == pytest.approx(cohens_d_by_hand(detailed, vague))

    for direction, short, queries, candidates in (("image_to_text", "i2t", images, texts),
                                                  ("text_to_image", "t2i", texts, images)):
        for name, _, _ in DETAIL_BINS:
            members = [i for i, d in enumerate(details) if bin_by_hand(d) == name]
            hits = []
            for i in members:   # R@1 by caption identity: the best-scored candidate carries the query's caption
                scores = [float(scorers[short](queries[i:i + 1], candidates[j:j + 1])) for j in range(n)]
                hits.append(enc["captions"][int(np.argmax(scores))] == enc["captions"][i])
            assert spec[f"{PREFIX}{direction}_n_{name}"] == len(members)
            assert spec[f"{PREFIX}{direction}_R@1_{name}"] == pytest.approx(sum(hits) / len(hits))
            assert spec.values[f"{PREFIX}{direction}_R@1_{name}"].tolist() == [float(h) for h in hits]
        gaps = [gap_by_hand(queries, candidates, enc["captions"], i, scorers[short], 3) for i in range(n)]
        assert spec.values[f"{PREFIX}{direction}_match_norm_gap"] == pytest.approx(gaps, abs=1e-5)
        assert spec[f"{PREFIX}{direction}_match_norm_gap"] == pytest.approx(sum(gaps) / n, abs=1e-6)
        assert spec[f"{PREFIX}{direction}_match_longer_share"] == pytest.approx(sum(g > 0 for g in gaps) / n)


def test_samples_without_the_metadata_give_no_specificity_numbers():
    feats = torch.randn(6, 4)
    spec = specificity_metrics(feats, feats, list("abcdef"), list("123456"), [None, {"x": 1}] * 3,
                               {"i2t": Scorer("cosine"), "t2i": Scorer("cosine")}, {})
    assert dict(spec) == {} and spec.values == {}


def test_a_retrieval_evaluation_of_the_synthetic_shards_carries_them(tiny_set):
    """Through the real loader and a real (untrained) CLIP: the numbers ride in the metrics dict, their
    per-query values pair by the evaluated keys."""
    bundle = create_clip("tiny-resnet")
    loader = val_batches(tiny_set, preprocess=bundle.preprocess_val, tokenizer=bundle.tokenizer)
    scorers = {"i2t": Scorer("cosine"), "t2i": Scorer("cosine")}
    metrics = evaluate_retrieval(bundle.model.eval(), scorers, loader, "cpu")
    enc = encode_loader(bundle.model, val_batches(tiny_set, preprocess=bundle.preprocess_val,
                                                 tokenizer=bundle.tokenizer), "cpu")
    assert metrics[PREFIX + "samples_with_detail"] == 40
    assert math.isfinite(metrics[PREFIX + "rho_text_norm_detail"])
    assert metrics.values[PREFIX + "image_to_text_match_norm_gap"].shape == (40,)
    assert len(enc["metas"]) == 40 and enc["metas"][0]["num_objects"] in (1, 2, 3)


def test_the_diagnose_command_reports_them_for_a_clip_model(tiny_set, tmp_path, capsys):
    out = tmp_path / "diag"
    diagnose_main(["--model", "tiny-resnet", "--data", tiny_set.val_urls, "--skip-fisher", "--n-boot", "20",
                   "--k", "3", "--out", str(out)])
    saved = json.loads((out / "diagnostics.json").read_text())["specificity"]
    assert saved["samples_with_detail"] == 40 and "text_to_image_R@1_detailed" in saved
    assert "Spearman(text norm, detail)" in capsys.readouterr().out
