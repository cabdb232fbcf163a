"""magclip.evaluation.zeroshot and eval/zeroshot.py: open_clip parity in cosine mode, the checkpoint's own scorers
for other modes, prototype rule, classification metrics, and clear errors that write nothing.

A tiny random-init tiny-resnet and shards of a few 8x8 PNGs built in tmp_path keep this fast.
"""

from __future__ import annotations

import importlib.util
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import open_clip
import pytest
import torch
import torch.nn.functional as F
from open_clip_train.train import get_clip_metrics

from magclip import Scorer
from magclip.models.clip import CHECKPOINT_META
from magclip.metrics.ir import faiss_available
from magclip.metrics.ranks import items_digest, load_ranks, ranks_path
from magclip.metrics.retrieval import ids_from_labels, retrieval_metrics
from magclip.models.clip import save_checkpoint_for_open_clip
from magclip.evaluation.checkpoint import load_checkpoint, load_open_clip, resolve_checkpoint, scorers_from_meta
from magclip.evaluation.emoji import emoji_benchmark
from magclip.data.classes import ClassSet, load_classes
from magclip.evaluation.zeroshot import class_prototypes, class_text_features, encode_shards, top_classes
from magclip.metrics.classification import classification_metrics

from builders import png

ROOT = Path(__file__).resolve().parents[2]
EMOJI = ROOT.parent / "shared" / "data" / "emoji"
spec = importlib.util.spec_from_file_location("eval_zeroshot", ROOT / "eval" / "zeroshot.py")
eval_zeroshot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(eval_zeroshot)

NAMES = ["red circle", "blue square", "green cross", "yellow star", "purple heart", "black arrow",
         "white cloud", "orange fish", "grey cat", "pink flower", "brown dog", "golden key"]
TEMPLATES = ["{}", "a photo of a {}.", "an emoji of the {}"]


# ----------------------------------------------------------------------------- fixtures and builders




def _write_shard(path: Path, samples: list[dict[str, bytes]]) -> str:
    """samples: [{"__key__": key, ext: bytes, ...}] -> one tar, members in sample order."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for s in samples:
            for ext, data in s.items():
                if ext == "__key__":
                    continue
                info = tarfile.TarInfo(f"{s['__key__']}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


def _labelled_samples(n: int, seed: int = 0, caption: bool = True) -> list[dict[str, bytes]]:
    """n samples of class i % len(NAMES): caption = the class name, .cls = index, .json = key/group."""
    out = []
    for i in range(n):
        c = i % len(NAMES)
        s = {"__key__": f"s{seed}_{i:04d}", "png": png(1000 * seed + i), "cls": str(c).encode(),
             "json": json.dumps({"cid": f"C{c}", "group": "even" if c % 2 == 0 else "odd"}).encode()}
        if caption:
            s["txt"] = f"{NAMES[c]} number {i}".encode()  # unique captions: one per image
        out.append(s)
    return out


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_open_clip("tiny-resnet", None, mode="cosine")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("shards")
    samples = _labelled_samples(40)
    _write_shard(root / "t-000.tar", samples[:25])
    _write_shard(root / "t-001.tar", samples[25:])
    return str(root / "t-{000..001}.tar")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny):
    """A run folder as the trainer writes it, with qnorm i2t and a learnable t2i at (0.3, 0.7)."""
    run = tmp_path_factory.mktemp("run")
    step = run / "checkpoints" / "step_00000010"
    save_checkpoint_for_open_clip(tiny.clip, step / "model.pt", logit_scale=10.0)
    (step / CHECKPOINT_META).write_text(json.dumps({
        "model": "tiny-resnet", "logit_scale": 10.0, "config": {},
        "scorers": {"i2t": {"mode": "qnorm", "gamma_q": 1.0, "gamma_d": 0.0, "weight": 1.0},
                    "t2i": {"mode": "learnable", "gamma_q": 0.3, "gamma_d": 0.7, "weight": 0.5}}}))
    (run / "checkpoints" / "latest").write_text("step_00000010\n")
    return run


# ----------------------------------------------------------------------------- open_clip parity (cosine)


def test_cosine_classifier_equals_open_clip(tiny):
    expected = open_clip.build_zero_shot_classifier(tiny.clip.clip, tiny.tokenizer, NAMES, TEMPLATES,
                                                    num_classes_per_batch=5)  # [D, C]
    feats = class_text_features(tiny, NAMES, TEMPLATES, batch_size=7)
    got = class_prototypes(feats, Scorer("cosine"))
    diff = (got - expected.T).abs().max().item()
    assert diff < 1e-5, diff
    # dnorm also normalizes the documents: the same prototypes
    assert torch.equal(class_prototypes(feats, Scorer("dnorm")), got)
    # and the same predictions as open_clip's `100 * image_features @ classifier`
    images = torch.randn(50, got.shape[1])
    ref = (100.0 * F.normalize(images, dim=-1) @ expected).topk(5, dim=1).indices
    assert torch.equal(top_classes(images, got, Scorer("cosine"), k=5)[:, 0], ref[:, 0])


def test_cosine_retrieval_equals_open_clip_end_to_end(tiny, shards, tmp_path):
    out, emb = tmp_path / "r.json", tmp_path / "emb"
    res = eval_zeroshot.main(["--model", "tiny-resnet", "--mode", "cosine", "--data", shards,
                              "--out", str(out), "--save-embeddings", str(emb), "--batch-size", "16"])
    assert json.loads(out.read_text())["sets"]["data"]["metrics"] == res["sets"]["data"]["metrics"]
    img = torch.from_numpy(np.load(emb / "image_features.npy"))
    txt = torch.from_numpy(np.load(emb / "text_features.npy"))
    keys = (emb / "keys.txt").read_text().split()
    assert keys == [f"s0_{i:04d}" for i in range(40)]  # sample order
    assert img.norm(dim=-1).std() > 0 and not torch.allclose(img.norm(dim=-1), torch.ones(40))  # raw, not unit
    expected = get_clip_metrics(F.normalize(img, dim=-1), F.normalize(txt, dim=-1), torch.tensor(100.0))
    got = res["sets"]["data"]["metrics"]["retrieval"]
    diff = max(abs(got[k] - float(v)) for k, v in expected.items())
    assert diff == 0.0
    assert res["scorers"]["i2t"]["mode"] == res["scorers"]["t2i"]["mode"] == "cosine"
    assert res["sets"]["data"]["counts"]["samples"] == 40 and res["date"]
    # the per-query ranks beside the results (r.ranks.npz), with the digest of the samples' keys
    ranks = load_ranks(ranks_path(out))["sets.data.metrics.retrieval"]
    assert ranks["items"] == items_digest(keys)
    assert (ranks["image_to_text"] < 1).mean() == got["image_to_text_R@1"]


# ----------------------------------------------------------------------------- the checkpoint's own scorers


def test_resolve_checkpoint_forms(checkpoint):
    step = checkpoint / "checkpoints" / "step_00000010"
    for form in (checkpoint, checkpoint / "checkpoints", step, step / "model.pt"):
        assert resolve_checkpoint(form) == step


def test_scorers_from_meta_keep_each_direction():
    s = scorers_from_meta({"t2i": {"mode": "learnable", "gamma_q": 0.25, "gamma_d": 0.9, "weight": 1.0}})
    assert s["t2i"].mode == "learnable" and (s["t2i"].gamma_q, s["t2i"].gamma_d) == pytest.approx((0.25, 0.9))
    assert (s["i2t"].gamma_q, s["i2t"].gamma_d) == pytest.approx((0.9, 0.25))  # untrained direction: transposed
    assert not any(p.requires_grad for p in s["t2i"].parameters())
    with pytest.raises(ValueError, match="bad scorer for i2t"):
        scorers_from_meta({"i2t": {"mode": "qnorm", "gamma_q": 0.5}}, where="x/magclip.json")


def test_qnorm_and_cosine_pick_different_classes():
    """One image, two prototypes: cosine prefers the well-aligned short one, qnorm the long one."""
    image = torch.tensor([[1.0, 0.0]])
    short_aligned = torch.tensor([0.5, 0.05])  # cos ~ 0.995, norm ~ 0.5
    long_off = torch.tensor([3.0, 3.0])        # cos ~ 0.71, norm ~ 4.2
    feats = torch.stack([short_aligned, long_off]).unsqueeze(1)  # [C=2, T=1, D=2]
    meta = {"i2t": {"mode": "qnorm", "gamma_q": 1.0, "gamma_d": 0.0}, "t2i": {"mode": "cosine"}}
    qnorm = scorers_from_meta(meta)["i2t"]
    cosine = Scorer("cosine")
    assert top_classes(image, class_prototypes(feats, cosine), cosine, k=1).item() == 0
    assert top_classes(image, class_prototypes(feats, qnorm), qnorm, k=1).item() == 1


def test_checkpoint_scorers_are_used_not_cosine(checkpoint, shards, tmp_path):
    out, emb = tmp_path / "r.json", tmp_path / "emb"
    res = eval_zeroshot.main(["--checkpoint", str(checkpoint), "--data", f"val={shards}", "--classes",
                              _txt_classes(tmp_path), "--out", str(out), "--save-embeddings", str(emb)])
    assert res["scorers"]["i2t"] == {"mode": "qnorm", "gamma_q": 1.0, "gamma_d": 0.0}
    assert res["scorers"]["t2i"]["mode"] == "learnable"
    assert (res["scorers"]["t2i"]["gamma_q"], res["scorers"]["t2i"]["gamma_d"]) == pytest.approx((0.3, 0.7))
    assert res["classification"]["prototype_rule"].startswith("mean of prepare_docs")
    img = torch.from_numpy(np.load(emb / "image_features.npy"))
    txt = torch.from_numpy(np.load(emb / "text_features.npy"))
    captions = [json.loads(line) for line in (emb / "captions.jsonl").read_text().splitlines()]
    ids = ids_from_labels(captions)
    own = retrieval_metrics(img, txt, i2t=Scorer("qnorm"), t2i=Scorer("fixed", 0.3, 0.7), image_ids=ids, text_ids=ids)
    cos = retrieval_metrics(img, txt, i2t=Scorer("cosine"), t2i=Scorer("cosine"), image_ids=ids, text_ids=ids)
    got = res["sets"]["val"]["metrics"]["retrieval"]
    for d in ("image_to_text", "text_to_image"):
        assert cos[f"{d}_mean_rank"] != own[f"{d}_mean_rank"]  # the case separates the modes ...
        assert got[f"{d}_mean_rank"] == own[f"{d}_mean_rank"]  # ... and the checkpoint's own one is used
    # classification: qnorm i2t on prototypes = mean of raw template features (gamma_d = 0)
    cls_feats = torch.from_numpy(np.load(emb / "classes" / "class_text_features.npy"))
    labels = torch.from_numpy(np.load(emb / "labels.npy"))
    top_own = top_classes(img, cls_feats.mean(dim=1), Scorer("qnorm"))
    top_cos = top_classes(img, F.normalize(F.normalize(cls_feats, dim=-1).mean(dim=1), dim=-1), Scorer("cosine"))
    assert not torch.equal(top_own, top_cos)
    assert res["sets"]["val"]["metrics"]["classification"]["all"] == classification_metrics(top_own, labels, len(NAMES))
    # --mode overrides both directions
    over = eval_zeroshot.main(["--checkpoint", str(checkpoint), "--data", shards, "--mode", "cosine",
                               "--out", str(tmp_path / "c.json")])
    assert over["sets"]["data"]["metrics"]["retrieval"]["image_to_text_mean_rank"] == cos["image_to_text_mean_rank"]


# ----------------------------------------------------------------------------- prototypes and metrics


@pytest.mark.parametrize("scorer", [Scorer("qnorm"), Scorer("dot"), Scorer("fixed", 0.4, 0.6)])
def test_raw_doc_prototype_scores_are_template_means(scorer):
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(6, 4, 8, generator=g) * torch.logspace(-1, 1, 6).view(6, 1, 1)
    images = torch.randn(5, 8, generator=g) * 3
    proto = class_prototypes(feats, scorer)
    per_template = torch.stack([scorer(images, feats[:, t]) for t in range(4)]).mean(0)
    assert torch.allclose(scorer.prepare_queries(images) @ proto.T, per_template, atol=1e-5)
    one = class_prototypes(feats[:, :1], scorer)  # a single template: exactly the prepared document
    assert torch.allclose(one, scorer.prepare_docs(feats[:, 0]))


def test_classification_metrics_by_hand():
    top = torch.tensor([[0, 1], [1, 0], [2, 0], [0, 2], [1, 3]])
    labels = torch.tensor([0, 0, 2, 2, 2])  # class 0: 1/2 top-1, class 2: 1/3 top-1
    m = classification_metrics(top, labels, num_classes=4, ks=(1, 2))
    assert m["top1"] == pytest.approx(2 / 5) and m["top2"] == pytest.approx(4 / 5)
    assert m["mean_per_class_recall"] == pytest.approx((1 / 2 + 1 / 3) / 2)
    assert m["num_classes_present"] == 2 and m["chance_top1"] == 0.25


def test_json_labels_with_groups(tiny, tmp_path):
    shard = _write_shard(tmp_path / "j.tar", _labelled_samples(24, caption=False))
    classes = tmp_path / "classes.jsonl"
    classes.write_text("".join(json.dumps({"cid": f"C{c}", "title": n, "group": "even" if c % 2 == 0 else "odd"}) + "\n"
                               for c, n in enumerate(NAMES)))
    res = eval_zeroshot.main(["--model", "tiny-resnet", "--data", shard, "--task", "classification",
                              "--classes", str(classes), "--class-name-field", "title", "--class-key-field", "cid",
                              "--class-group-field", "group", "--label-field", "cid", "--exclude-group", "odd",
                              "--templates", "identity", "a drawing of a {}", "--out", str(tmp_path / "r.json")])
    c = res["sets"]["data"]["metrics"]["classification"]
    assert c["all"]["num_samples"] == 24 and c["without_odd"]["num_samples"] == 12
    assert set(c["per_group_top1"]) == {"even", "odd"}
    assert res["classification"]["templates"] == ["{}", "a drawing of a {}"]
    assert "retrieval" not in res["sets"]["data"]["metrics"]


# ----------------------------------------------------------------------------- errors write nothing


def _txt_classes(tmp_path: Path, names=NAMES) -> str:
    path = tmp_path / "classes.txt"
    path.write_text("\n".join(names) + "\n")
    return str(path)


def test_missing_checkpoint(tmp_path):
    out = tmp_path / "r.json"
    with pytest.raises(FileNotFoundError, match="nope"):
        eval_zeroshot.main(["--checkpoint", str(tmp_path / "nope"), "--data", "x.tar", "--out", str(out)])
    (tmp_path / "step").mkdir()
    (tmp_path / "step" / "model.pt").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="magclip.json"):
        load_checkpoint(tmp_path / "step")
    assert not out.exists()


def test_shards_without_captions(tiny, tmp_path):
    shard = _write_shard(tmp_path / "nocap-000.tar", _labelled_samples(6, caption=False))
    out, emb = tmp_path / "r.json", tmp_path / "emb"
    with pytest.raises(ValueError, match="nocap-000.tar has no KEY.txt captions"):
        eval_zeroshot.main(["--model", "tiny-resnet", "--data", shard, "--out", str(out), "--save-embeddings", str(emb)])
    assert not out.exists() and not emb.exists()
    with pytest.raises(FileNotFoundError, match="missing-000.tar"):
        encode_shards(tiny, str(tmp_path / "missing-000.tar"))


def test_class_list_not_matching_labels(tmp_path):
    shard = _write_shard(tmp_path / "lab-000.tar", _labelled_samples(len(NAMES)))
    classes = _txt_classes(tmp_path, NAMES[:5])  # labels go up to 11
    out = tmp_path / "r.json"
    with pytest.raises(ValueError, match=r"label '5' of shard .*lab-000.tar key s0_0005 is not in the class list .*classes.txt"):
        eval_zeroshot.main(["--model", "tiny-resnet", "--data", shard, "--classes", classes, "--out", str(out)])
    assert not out.exists()
    with pytest.raises(ValueError, match="duplicate class keys"):
        ClassSet(["a", "b"], ["k", "k"])


# ----------------------------------------------------------------------------- the emoji data


@pytest.mark.skipif(not (EMOJI / "emoji_index.jsonl").is_file(),
                    reason=f"emoji data not found at {EMOJI} (shared data folder absent in this checkout)")
def test_emoji_labels_map_to_the_1906_names(tiny):
    bench = emoji_benchmark(EMOJI, ["ood_heldcat"])
    classes = bench["classes"]
    assert len(classes) == 1906 and classes.groups is not None and "Flags" in classes.groups
    enc = encode_shards(tiny, bench["data"]["ood_heldcat"], classes=classes, label_field=bench["label_field"])
    assert len(enc.keys) == bench["set_info"]["ood_heldcat"]["expected_samples"] == 131
    # the KEY.txt caption is the class name of the sample's label
    assert all(classes.names[i] == c for i, c in zip(enc.labels.tolist(), enc.captions))
    assert {classes.groups[i] for i in enc.labels.tolist()} == {"Food & Drink"}
    assert load_classes(EMOJI / "emoji_index.jsonl", name_field="annotation", key_field="unified").keys == classes.keys


# ----------------------------------------------------------------------------- the serving index


def test_exported_index_ranks_exactly_as_the_run_scores(checkpoint, shards, tmp_path):
    """--export-index writes prepared documents + the scorer: a faiss IndexFlatIP (or a plain inner
    product) over them, searched with prepared queries, gives the Scorer's own ranking exactly; plain
    L2-normalised vectors (open_clip's normalising forward) would not, for a qnorm model."""
    from magclip.evaluation.index import load_index, prepare_queries

    out = tmp_path / "index"
    eval_zeroshot.main(["--checkpoint", str(checkpoint), "--data", f"val={shards}", "--task", "retrieval",
                        "--out", str(tmp_path / "r.json"), "--save-embeddings", str(tmp_path / "emb"),
                        "--export-index", str(out)])
    images = torch.from_numpy(np.load(tmp_path / "emb" / "image_features.npy"))
    texts = torch.from_numpy(np.load(tmp_path / "emb" / "text_features.npy"))
    model = load_checkpoint(checkpoint)
    for direction, queries, docs in (("i2t", images, texts), ("t2i", texts, images)):
        prepared_docs, ids, record = load_index(out / "val" / direction)
        assert record["mode"] == model.scorers[direction].mode and len(ids) == len(docs) == 40
        expected = model.scorers[direction](queries, docs).topk(10, dim=1).indices
        q = prepare_queries(record, queries)
        got = torch.from_numpy(q @ prepared_docs.T).topk(10, dim=1).indices
        assert torch.equal(got, expected), direction
        if faiss_available():
            import faiss

            _, found = faiss.read_index(str(out / "val" / direction / "index.faiss")).search(q, 10)
            assert torch.equal(torch.from_numpy(found).long(), expected), direction
    naive = (F.normalize(images, dim=-1) @ F.normalize(texts, dim=-1).T).argmax(dim=1)
    own = model.scorers["i2t"](images, texts).argmax(dim=1)
    assert model.scorers["i2t"].mode == "qnorm" and not torch.equal(naive, own)  # cosine ranks otherwise
