"""Retrieval metrics: open_clip parity (cosine), brute-force equality for other scorers, multi-caption."""

import json
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from open_clip_train.train import get_clip_metrics

from magclip import Scorer
from magclip.metrics.relevance import clip_relevance
from magclip.metrics.retrieval import (
    RetrievalMetrics,
    ids_from_labels,
    load_ranks,
    ranks_of_first_relevant,
    ranks_path,
    retrieval_metrics,
    save_per_query_outcomes,
    save_ranks,
)


def _features(n: int, dim: int = 32, seed: int = 0, spread: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    if spread:  # norms over two orders of magnitude, so magnitude matters for raw modes
        x = x * torch.logspace(-1, 1, n)[torch.randperm(n, generator=g)].unsqueeze(1)
    return x


def _paired(n: int, dim: int = 32, seed: int = 0, spread: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Images and texts with text i a noisy copy of image i, so ranks are spread, not all ~N/2."""
    images = _features(n, dim, seed, spread)
    texts = images + 1.5 * _features(n, dim, seed + 1000, spread)
    return images, texts


def _brute_force_ranks(queries, docs, scorer, query_ids, doc_ids) -> torch.Tensor:
    """Full score matrix + argsort: the position of the first relevant doc in each sorted row."""
    order = torch.argsort(scorer(queries, docs), dim=1, descending=True)
    relevant_sorted = doc_ids[order] == query_ids.unsqueeze(1)
    return relevant_sorted.float().argmax(dim=1)


def _brute_force_metrics(images, texts, scorer, image_ids, text_ids) -> dict[str, float]:
    out = {}
    for prefix, q, d, qi, di in (
        ("image_to_text", images, texts, image_ids, text_ids),
        ("text_to_image", texts, images, text_ids, image_ids),
    ):
        preds = _brute_force_ranks(q, d, scorer, qi, di).numpy()
        out[f"{prefix}_mean_rank"] = preds.mean() + 1
        out[f"{prefix}_median_rank"] = np.floor(np.median(preds)) + 1
        for k in (1, 5, 10):
            out[f"{prefix}_R@{k}"] = np.mean(preds < k)
    return out


@pytest.mark.parametrize("n, chunk_size", [(10, 3), (257, 64), (1000, 128), (1000, 1000), (513, 1024)])
def test_cosine_parity_with_open_clip(n, chunk_size):
    images, texts = _paired(n, seed=n)
    # open_clip's evaluate() passes model outputs that are already L2-normalised and logit_scale.mean()
    img_n, txt_n = F.normalize(images, dim=-1), F.normalize(texts, dim=-1)
    expected = get_clip_metrics(img_n, txt_n, torch.tensor(100.0))
    cosine = Scorer("cosine")
    got = retrieval_metrics(images, texts, i2t=cosine, t2i=cosine, chunk_size=chunk_size)
    assert set(got) == set(expected)
    diffs = {k: abs(got[k] - float(expected[k])) for k in expected}
    assert max(diffs.values()) == 0.0, diffs
    if n >= 100:
        assert 0 < got["image_to_text_R@1"] < 1  # non-degenerate case


def test_parity_on_normalised_inputs_too():
    images, texts = _paired(300, seed=7)
    img_n, txt_n = F.normalize(images, dim=-1), F.normalize(texts, dim=-1)
    expected = get_clip_metrics(img_n, txt_n, torch.tensor(1.0))
    got = retrieval_metrics(img_n, txt_n, i2t=Scorer("cosine"), t2i=Scorer("cosine"), chunk_size=77)
    assert got == {k: float(v) for k, v in expected.items()}


@pytest.mark.parametrize("mode", ["qnorm", "dnorm", "dot", "cosine"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equals_brute_force_dense_argsort(mode, seed):
    images, texts = _paired(300, seed=seed, spread=True)
    scorer = Scorer(mode)
    ids = torch.arange(300)
    for q, d in ((images, texts), (texts, images)):
        fast = ranks_of_first_relevant(q, d, scorer, ids, ids, chunk_size=37)
        assert torch.equal(fast, _brute_force_ranks(q, d, scorer, ids, ids))


def test_qnorm_differs_from_cosine_when_doc_norms_vary():
    # image 0's true caption points the right way but is short; caption 1 is off-axis but long:
    # cosine ranks the true caption first, qnorm (keeps doc magnitude) ranks the long one first.
    images = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    texts = torch.tensor([[0.1, 0.0], [3.0, 3.0]])
    cos = retrieval_metrics(images, texts, i2t=Scorer("cosine"), t2i=None)
    qn = retrieval_metrics(images, texts, i2t=Scorer("qnorm"), t2i=None)
    assert cos["image_to_text_R@1"] == 1.0
    assert qn["image_to_text_R@1"] == 0.5
    assert qn["image_to_text_mean_rank"] == 1.5
    assert set(qn) == {"image_to_text_mean_rank", "image_to_text_median_rank",
                       "image_to_text_R@1", "image_to_text_R@5", "image_to_text_R@10"}


def test_qnorm_metrics_equal_brute_force_and_differ_from_cosine_on_random_data():
    images, texts = _paired(400, seed=3, spread=True)
    ids = torch.arange(400)
    qnorm = Scorer("qnorm")
    got = retrieval_metrics(images, texts, i2t=qnorm, t2i=qnorm, chunk_size=64)
    assert got == pytest.approx(_brute_force_metrics(images, texts, qnorm, ids, ids), abs=0, rel=0)
    cosine = retrieval_metrics(images, texts, i2t=Scorer("cosine"), t2i=Scorer("cosine"), chunk_size=64)
    assert got != cosine


@pytest.mark.parametrize("mode", ["cosine", "qnorm"])
def test_multi_caption_hit_if_any_caption_in_top_k(mode):
    n_images, per_image = 120, 5
    g = torch.Generator().manual_seed(11)
    images = _features(n_images, seed=11, spread=True)
    text_ids = torch.arange(n_images).repeat_interleave(per_image)
    texts = images[text_ids] + 2.0 * torch.randn(n_images * per_image, images.shape[1], generator=g)
    image_ids = torch.arange(n_images)
    scorer = Scorer(mode)
    got = retrieval_metrics(images, texts, i2t=scorer, t2i=scorer, image_ids=image_ids,
                            text_ids=text_ids, chunk_size=50)
    # default image_ids (arange) are the same thing
    assert got == retrieval_metrics(images, texts, i2t=scorer, t2i=scorer, text_ids=text_ids, chunk_size=50)
    assert got == _brute_force_metrics(images, texts, scorer, image_ids, text_ids)
    # the any-caption rule is really exercised: with only the first caption relevant (same doc
    # pool), ranks can only get worse, and do for some images
    first_only_ids = torch.where(torch.arange(len(texts)) % per_image == 0, text_ids, -1)
    any_ranks = ranks_of_first_relevant(images, texts, scorer, image_ids, text_ids)
    first_ranks = ranks_of_first_relevant(images, texts, scorer, image_ids, first_only_ids)
    assert (any_ranks <= first_ranks).all() and (any_ranks < first_ranks).any()


def test_many_relevant_docs_per_query_dense_path_matches_brute_force():
    # class-like ids (3 classes): most pairs relevant, so the dense-mask path is taken
    images, texts = _paired(200, seed=4, spread=True)
    g = torch.Generator().manual_seed(4)
    image_ids, text_ids = torch.randint(0, 3, (200,), generator=g), torch.randint(0, 3, (200,), generator=g)
    scorer = Scorer("dnorm")
    got = ranks_of_first_relevant(images, texts, scorer, image_ids, text_ids, chunk_size=30)
    assert torch.equal(got, _brute_force_ranks(images, texts, scorer, image_ids, text_ids))


def test_a_tie_never_counts_for_the_query():
    """The pessimistic rank: every non-relevant document scoring as high as the best relevant one is ahead
    of it; relevant documents tied with it are not (they are hits too)."""
    query = torch.tensor([[1.0, 0.0]])
    docs = torch.tensor([[2.0, 0.0], [2.0, 0.0], [2.0, 0.0], [0.0, 1.0]])
    ranks = ranks_of_first_relevant(query, docs, Scorer("dot"), torch.tensor([5]), torch.tensor([0, 1, 5, 5]))
    assert ranks.tolist() == [2]


@pytest.mark.parametrize("mode", ["cosine", "dot", "qnorm"])
def test_identical_embeddings_score_no_hit(mode):
    """Captions cut to the same tokens embed identically: every ranking is a tie, and R@1 must be what a
    model that cannot tell them apart earns (0 here), not 100 % (crediting each tie to the query), while
    open_clip's get_clip_metrics puts the true caption first only by the sort's accident."""
    images = torch.randn(40, 8, generator=torch.Generator().manual_seed(0))
    texts = torch.ones(40, 8)
    for matching in ("image", "caption"):
        captions = [f"caption {i}" for i in range(40)]
        m = retrieval_metrics(images, texts, i2t=Scorer(mode), t2i=Scorer(mode),
                              relevance=clip_relevance(captions, None, matching))
        assert m["image_to_text_R@1"] == 0.0 and m["image_to_text_R@10"] == 0.0
        assert m["image_to_text_median_rank"] == 40.0  # 39 ties ahead of every query's caption


def test_caption_identity_ids_from_labels():
    captions = ["a dog", "a cat", "a dog", "a bird"]
    ids = ids_from_labels(captions)
    assert ids.tolist() == [0, 1, 0, 2]
    assert ids.dtype == torch.long
    # duplicate captions: query "a dog" (index 0) is a hit if either "a dog" doc ranks first
    feats = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.01], [-1.0, 0.0]])
    ranks = ranks_of_first_relevant(feats, feats, Scorer("cosine"), ids, ids)
    assert ranks.tolist() == [0, 0, 0, 0]


def test_query_without_relevant_doc_raises():
    images, texts = _features(6), _features(6, seed=1)
    with pytest.raises(ValueError, match=r"2 of 6 queries have no relevant document"):
        query_ids = torch.tensor([0, 1, 2, 3, 7, 8])
        ranks_of_first_relevant(images, texts, Scorer("cosine"), query_ids, torch.arange(6))
    with pytest.raises(ValueError, match="pass text_ids"):
        retrieval_metrics(images, texts[:4], i2t=Scorer("cosine"), t2i=None)


def test_direction_omitted_when_scorer_none():
    images, texts = _paired(20)
    got = retrieval_metrics(images, texts, i2t=None, t2i=Scorer("dot"), ks=(1, 3))
    assert set(got) == {"text_to_image_mean_rank", "text_to_image_median_rank",
                        "text_to_image_R@1", "text_to_image_R@3"}
    assert retrieval_metrics(images, texts, i2t=None, t2i=None) == {}


def test_20k_by_20k_chunked_runs_fast():
    # dense would be a 1.6 GB score matrix plus an O(N^2 log N) argsort; chunked it is ~4 s on 2 CPUs
    images, texts = _paired(20_000, dim=32, seed=5)
    start = time.perf_counter()
    got = retrieval_metrics(images, texts, i2t=Scorer("qnorm"), t2i=None, chunk_size=512)
    assert time.perf_counter() - start < 30.0  # loose: guards against a dense fallback, not CI load
    assert 0.0 < got["image_to_text_R@10"] < 1.0
    assert 1.0 <= got["image_to_text_mean_rank"] <= 20_000


# ----------------------------------------------------------------------------- per-query ranks


def test_metrics_carry_the_per_query_ranks_behind_them():
    """R@k of one query = rank < k: the aggregates are the means of the kept ranks, which equal the
    brute-force argsort ranks; the JSON (and metrics.jsonl) form stays a plain dict of numbers."""
    images, texts = _paired(300, seed=9, spread=True)
    ids = torch.arange(300)
    got = retrieval_metrics(images, texts, i2t=Scorer("qnorm"), t2i=Scorer("dnorm"), ks=(1, 5))
    assert isinstance(got, RetrievalMetrics) and set(got.ranks) == {"image_to_text", "text_to_image"}
    for direction, q, d, mode in (("image_to_text", images, texts, "qnorm"), ("text_to_image", texts, images, "dnorm")):
        ranks = got.ranks[direction]
        assert ranks.dtype == np.uint16 and ranks.shape == (300,)
        assert np.array_equal(ranks, _brute_force_ranks(q, d, Scorer(mode), ids, ids).numpy())
        for k in (1, 5):
            assert got[f"{direction}_R@{k}"] == np.mean(ranks < k)
        assert got[f"{direction}_mean_rank"] == pytest.approx(ranks.mean() + 1)
    assert json.loads(json.dumps(got)) == dict(got)            # the ranks stay out of the JSON


def test_ranks_file_round_trip_and_compact_types(tmp_path):
    small = np.array([0, 3, 65_535], dtype=np.int64)
    large = np.array([0, 70_000], dtype=np.int64)           # beyond uint16: int32
    path = tmp_path / "r.ranks.npz"
    save_ranks(path, {"metrics": {"image_to_text": small, "items": "abc"}, "eval_sets.ood": {"text_to_image": large}})
    with np.load(path) as raw:
        assert raw["metrics/image_to_text"].dtype == np.uint16 and raw["eval_sets.ood/text_to_image"].dtype == np.int32
    back = load_ranks(path)
    assert back["metrics"]["items"] == "abc" and back["eval_sets.ood"]["items"] is None
    assert np.array_equal(back["metrics"]["image_to_text"], small)
    assert np.array_equal(back["eval_sets.ood"]["text_to_image"], large)
    with pytest.raises(ValueError, match=">= 0"):
        save_ranks(path, {"metrics": {"image_to_text": np.array([-1])}})


def test_save_per_query_outcomes_finds_every_evaluation_and_clears_a_stale_file(tmp_path):
    images, texts = _paired(50, seed=2)
    val = retrieval_metrics(images, texts, i2t=Scorer("cosine"), t2i=Scorer("cosine"))
    val.item_digest = "d1"
    ood = retrieval_metrics(texts, images, i2t=Scorer("dot"), t2i=None)
    record = {"metrics": val, "eval_sets": {"ood": ood, "empty": {}}, "steps": 3}
    results = tmp_path / "results.json"
    assert ranks_path(results) == tmp_path / "results.ranks.npz"
    assert save_per_query_outcomes(record, results) == [ranks_path(results)]
    back = load_ranks(ranks_path(results))
    assert set(back) == {"metrics", "eval_sets.ood"} and back["metrics"]["items"] == "d1"
    assert np.array_equal(back["eval_sets.ood"]["image_to_text"], ood.ranks["image_to_text"])
    # a later run in the same folder without ranks (e.g. no validation data) removes the old file
    assert save_per_query_outcomes({"metrics": {}}, results) == [] and not ranks_path(results).exists()
