"""The field's benchmark layouts: CLIP_benchmark's webdataset folders (written with its own writers) scored by
magclip equal to CLIP_benchmark's own numbers, several captions per image, ties, long captions, Karpathy split
files, and the bad inputs each layout can hold.

A random-init tiny-resnet and 16x16 PNGs keep this fast; parity needs no trained model, only the same weights.
"""

from __future__ import annotations

import importlib.util
import io
import json
import random
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from builders import save_tiny_resnet
from PIL import Image

from magclip import Scorer
from magclip.data.eval_sets import resolve_eval_set
from magclip.data.karpathy import KarpathySet
from magclip.evaluation.clip import retrieval_from_features
from magclip.metrics.ranks import load_query_values, queries_path
from magclip.models.clip import create_clip

cb_builder = pytest.importorskip("clip_benchmark.datasets.builder")
from clip_benchmark.metrics import zeroshot_classification, zeroshot_retrieval
from clip_benchmark.webdataset_builder import convert_dataset, convert_retrieval_dataset

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("eval_zeroshot", ROOT / "eval" / "zeroshot.py")
eval_zeroshot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(eval_zeroshot)

WORDS = ["red", "blue", "green", "yellow", "circle", "square", "cross", "star", "small", "large", "left", "right", "top", "bottom", "dog", "cat"]
CLASSES = ["red circle", "blue square", "green cross", "yellow star", "purple heart", "black arrow", "white cloud"]


def png(seed: int, size: int = 16) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def caption(rng: random.Random, n: int = 5) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    """A random-init tiny-resnet's weights: what both tools load."""
    return save_tiny_resnet(tmp_path_factory.mktemp("model"))


RETRIEVAL_ROWS = 40


@pytest.fixture(scope="module")
def retrieval_set(tmp_path_factory) -> tuple[Path, int]:
    """CLIP_benchmark's own writer: 40 images with 1 to 4 captions each (KEY.txt, one a line), 3 shards;
    (the folder, the number of captions)."""
    rng = random.Random(0)
    root = tmp_path_factory.mktemp("cb_retrieval")
    rows = [(png(i), [caption(rng) for _ in range(rng.randint(1, 4))]) for i in range(RETRIEVAL_ROWS)]
    convert_retrieval_dataset(rows, "test", str(root), image_format="png", max_count=15, verbose=False)
    return root, sum(len(c) for _, c in rows)


@pytest.fixture(scope="module")
def classification_set(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cb_classification")
    rows = [(png(100 + i), i % len(CLASSES)) for i in range(35)]
    convert_dataset(rows, "test", str(root), image_format="png", max_count=20, verbose=False)
    (root / "classnames.txt").write_text("".join(c + "\n" for c in CLASSES))
    (root / "zeroshot_classification_templates.txt").write_text("a photo of a {c}.\nan icon of the {c}\n")
    return root


@pytest.fixture(scope="module")
def multilabel_set(tmp_path_factory) -> tuple[Path, np.ndarray]:
    """CLIP_benchmark's own writer, multilabel (VOC2007's form: KEY.npy, 0/1 over the classes): 30 images,
    some with no label at all, the last class never present; (the folder, the labels)."""
    rng = np.random.default_rng(1)
    labels = (rng.random((30, len(CLASSES))) < 0.3).astype(np.float32)
    labels[::7] = 0
    labels[:, -1] = 0
    root = tmp_path_factory.mktemp("cb_multilabel")
    convert_dataset([(png(200 + i), torch.from_numpy(y)) for i, y in enumerate(labels)], "test", str(root),
                    image_format="png", max_count=12, multilabel=True, verbose=False)
    (root / "classnames.txt").write_text("".join(c + "\n" for c in CLASSES))
    (root / "zeroshot_classification_templates.txt").write_text("a photo of a {c}.\nan icon of the {c}\n")
    return root, labels


def clip_benchmark_model(weights: Path):
    """The open_clip model with the same weights, as CLIP_benchmark evaluates it."""
    bundle = create_clip("tiny-resnet", str(weights))
    return bundle.model.clip.eval(), bundle.preprocess_val, bundle.tokenizer


def run_magclip(args: list[str], out: Path) -> dict:
    eval_zeroshot.main([*args, "--out", str(out)])
    return json.loads(out.read_text())


def test_retrieval_equals_clip_benchmark_on_its_own_folder(retrieval_set, weights, tmp_path):
    retrieval_set, num_captions = retrieval_set
    model, preprocess, tokenizer = clip_benchmark_model(weights)
    dataset = cb_builder.build_wds_dataset("wds_mine", preprocess, split="test", data_dir=str(retrieval_set))
    loader = torch.utils.data.DataLoader(dataset.batched(8), batch_size=None)  # as its cli.py for wds/ sets
    theirs = zeroshot_retrieval.evaluate(model, loader, tokenizer, "cpu", amp=False, recall_k_list=[1, 5, 10])
    # --data NAME=ROOT alone: the layout says retrieval and scoring by image, the split is CLIP_benchmark's test
    res = run_magclip(["--model", "tiny-resnet", "--pretrained", str(weights), "--mode", "cosine",
                       "--data", f"mine={retrieval_set}"], tmp_path / "r.json")
    entry = res["sets"]["mine"]
    assert (entry["layout"], entry["matching"], entry["split"]) == ("clip_benchmark", "image", "test")
    mine = entry["metrics"]["retrieval"]
    assert (mine["num_samples"], mine["num_captions"]) == (RETRIEVAL_ROWS, num_captions)
    for k in (1, 5, 10):  # CLIP_benchmark names by what is retrieved: "image retrieval" = text->image
        assert mine[f"text_to_image_R@{k}"] == pytest.approx(theirs[f"image_retrieval_recall@{k}"], abs=1e-6)
        assert mine[f"image_to_text_R@{k}"] == pytest.approx(theirs[f"text_retrieval_recall@{k}"], abs=1e-6)
    assert 0.0 < mine["image_to_text_R@5"] < 1.0  # not a degenerate set
    # the old reading (the joined lines as one caption) scores another task: this must not be it
    assert res["retrieval_matching"].startswith("a caption is relevant to its own image")


def test_classification_equals_clip_benchmark_classifier(classification_set, weights, tmp_path):
    """CLIP_benchmark's zeroshot_classification.evaluate fails under numpy 2 in its accuracy helper (a
    1-element array converted to float), so the accuracy is computed here from its own zero_shot_classifier
    and run_classification, as that helper would."""
    from sklearn.metrics import balanced_accuracy_score

    model, preprocess, tokenizer = clip_benchmark_model(weights)
    dataset = cb_builder.build_wds_dataset("wds_mine", preprocess, split="test", data_dir=str(classification_set))
    loader = torch.utils.data.DataLoader(dataset.batched(16), batch_size=None)
    classifier = zeroshot_classification.zero_shot_classifier(model, tokenizer, dataset.classes, dataset.templates,
                                                              "cpu", amp=False)
    logits, target = zeroshot_classification.run_classification(model, classifier, loader, "cpu", amp=False)
    top5 = logits.topk(5, dim=1).indices
    theirs = {"top1": float((top5[:, 0] == target).float().mean()),
              "top5": float((top5 == target[:, None]).any(dim=1).float().mean()),
              "mean_per_class_recall": balanced_accuracy_score(target.numpy(), top5[:, 0].numpy())}
    res = run_magclip(["--model", "tiny-resnet", "--pretrained", str(weights), "--mode", "cosine",
                       "--data", f"mine={classification_set}"], tmp_path / "c.json")
    mine = res["sets"]["mine"]["metrics"]["classification"]["all"]
    assert res["sets"]["mine"]["tasks"] == ["classification"]
    for key, value in theirs.items():
        assert mine[key] == pytest.approx(value, abs=1e-6), key


# ----------------------------------------------------------------------------- multi-caption rules


def test_multilabel_equals_clip_benchmark_evaluate(multilabel_set, weights, tmp_path):
    """A multilabel folder scored by CLIP_benchmark's own evaluate (its mean-average-precision path does not
    reach the accuracy helper that fails under numpy 2) and, class by class, by its average_precision_per_class;
    a class without a positive counts 0 in both, and magclip says so."""
    root, labels = multilabel_set
    model, preprocess, tokenizer = clip_benchmark_model(weights)
    dataset = cb_builder.build_wds_dataset("wds_mine", preprocess, split="test", data_dir=str(root))
    loader = torch.utils.data.DataLoader(dataset, batch_size=8)  # torch's collate makes the label vectors a tensor
    theirs = zeroshot_classification.evaluate(model, loader, tokenizer, dataset.classes, dataset.templates, "cpu",
                                              amp=False)
    classifier = zeroshot_classification.zero_shot_classifier(model, tokenizer, dataset.classes, dataset.templates,
                                                              "cpu", amp=False)
    logits, target = zeroshot_classification.run_classification(model, classifier, loader, "cpu", amp=False)
    their_ap = zeroshot_classification.average_precision_per_class(logits, target)
    out = tmp_path / "m.json"
    res = run_magclip(["--model", "tiny-resnet", "--pretrained", str(weights), "--mode", "cosine",
                       "--data", f"voc={root}"], out)
    entry = res["sets"]["voc"]
    mine = entry["metrics"]["classification"]["all"]
    assert entry["multilabel"] and entry["tasks"] == ["classification"]
    assert entry["classification"]["label_field"] == "KEY.npy" and mine["num_samples"] == len(labels)
    assert mine["mean_average_precision"] == pytest.approx(theirs["mean_average_precision"], abs=1e-6)
    assert 0.0 < mine["mean_average_precision"] < 1.0
    per_class = load_query_values(queries_path(out))["sets.voc.metrics.classification.per_class.AP"]
    np.testing.assert_allclose(per_class, their_ap.numpy(), atol=1e-6)
    assert mine["num_classes_present"] == len(CLASSES) - 1 and per_class[-1] == 0.0
    assert "classes without a positive sample: 1" in entry["warning"]
    assert mine["mean_average_precision_present"] == pytest.approx(per_class[:-1].mean())


@pytest.mark.parametrize("npy, message", [
    (np.zeros(3, dtype=np.float32), r"key s0000000: \.npy has shape \(3,\); a multilabel label is one 0/1 entry per "
                                    r"class \(7 in classnames\.txt\)"),
    (np.full(7, 2.0, dtype=np.float32), r"key s0000000: \.npy holds \[2\.0\], not only 0 and 1"),
    (None, r"key s0000000 has no \.npy label vector"),
])
def test_a_bad_multilabel_label_is_named(weights, tmp_path, npy, message):
    buf = io.BytesIO()
    if npy is not None:
        np.save(buf, npy)
    members = {"s0000000.png": png(1), **({"s0000000.npy": buf.getvalue()} if npy is not None else {"s0000000.cls": b"1"})}
    _shard(tmp_path / "set" / "test" / "0.tar", members)
    (tmp_path / "set" / "test" / "nshards.txt").write_text("1\n")
    (tmp_path / "set" / "dataset_type.txt").write_text("multilabel\n")
    (tmp_path / "set" / "classnames.txt").write_text("".join(c + "\n" for c in CLASSES))
    (tmp_path / "set" / "zeroshot_classification_templates.txt").write_text("a photo of a {c}.\n")
    with pytest.raises(ValueError, match=message):
        run_magclip(["--model", "tiny-resnet", "--pretrained", str(weights), "--data", f"set={tmp_path / 'set'}"],
                    tmp_path / "r.json")
    assert not (tmp_path / "r.json").exists()


def test_an_image_whose_best_caption_ranks_second():
    """Image 0 has captions 0 and 1; a foreign caption (2) scores highest, caption 1 second, caption 0 last:
    image->text rank 1 (R@1 0, R@5 1), while each of image 0's captions is still a text->image query."""
    images = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    texts = torch.tensor([[-1.0, 0.2, 0.0], [0.9, 0.0, 0.1], [1.0, 0.05, 0.0], [0.0, 1.0, 0.0]])
    counts = [2, 2]  # image 1 owns captions 2 ("c") and 3 ("d")
    m = retrieval_from_features(images, texts, ["a", "b", "c", "d"], {"i2t": Scorer("cosine"), "t2i": Scorer("cosine")},
                                caption_counts=counts, matching="image")
    # image 0: caption 2 (image 1's) scores 1.0 > caption 1's 0.99 > caption 0: first relevant at rank 1
    assert m.ranks["image_to_text"].tolist() == [1, 0]
    assert m["image_to_text_R@1"] == 0.5 and m["image_to_text_R@5"] == 1.0
    assert len(m.ranks["text_to_image"]) == 4 and m["num_captions"] == 4
    # relevance is by image: the chance of a random ranking is 2 captions in 4 for an image, 1 image in 2 for a caption
    assert m["image_to_text_chance_R@1"] == 0.5 and m["text_to_image_chance_R@1"] == 0.5


def test_one_and_several_captions_mixed_equal_a_brute_force_by_image():
    g = torch.Generator().manual_seed(3)
    counts = [1, 3, 1, 2, 5, 1, 1, 4]
    owners = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    images = torch.randn(len(counts), 6, generator=g)
    texts = images[owners] + torch.randn(len(owners), 6, generator=g)
    captions = [f"t{i}" for i in range(len(owners))]
    for mode in ("cosine", "qnorm", "dot"):
        m = retrieval_from_features(images, texts, captions, {"i2t": Scorer(mode), "t2i": Scorer(mode)},
                                    caption_counts=counts, matching="image")
        scores = Scorer(mode)(images, texts)
        for i in range(len(counts)):  # best relevant position in the sorted row
            order = scores[i].argsort(descending=True)
            assert m.ranks["image_to_text"][i] == int((owners[order] == i).float().argmax())
        t_scores = Scorer(mode)(texts, images)
        for t in range(len(owners)):
            assert m.ranks["text_to_image"][t] == int((t_scores[t] > t_scores[t, owners[t]]).sum())


def test_caption_identity_with_several_captions_counts_a_shared_caption_for_every_image():
    """Two drawings of one emoji share the caption "dog": under caption identity image 1 retrieving image 0's
    "dog" entry is a hit; by image it is not."""
    images = torch.tensor([[1.0, 0.0], [0.9, 0.1]])
    texts = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])  # "dog" (image 0), "cat" (0), "dog" (image 1)
    scorers = {"i2t": Scorer("cosine"), "t2i": Scorer("cosine")}
    by_caption = retrieval_from_features(images, texts, ["dog", "cat", "dog"], scorers, caption_counts=[2, 1])
    by_image = retrieval_from_features(images, texts, ["dog", "cat", "dog"], scorers, caption_counts=[2, 1],
                                       matching="image")
    assert by_caption.ranks["image_to_text"].tolist() == [0, 0]
    assert by_image.ranks["image_to_text"].tolist() == [0, 1]


def test_long_captions_are_counted_and_do_not_score_as_hits(weights, tmp_path):
    """Captions that share their first 32 tokens (tiny-resnet's context) embed identically: R@1 is what a
    model that cannot tell them apart gets, and the results say how many were cut and the longest."""
    rng = random.Random(1)
    preamble = " ".join(["a rendered test scene showing"] * 8)
    rows = [(png(i), [f"{preamble} {caption(rng)}"]) for i in range(30)]
    convert_retrieval_dataset(rows, "test", str(tmp_path / "long"), image_format="png", verbose=False)
    res = run_magclip(["--model", "tiny-resnet", "--pretrained", str(weights), "--data", f"long={tmp_path / 'long'}"],
                      tmp_path / "r.json")
    m = res["sets"]["long"]["metrics"]["retrieval"]
    assert m["long_captions"] == 30 and m["context_length"] == 32 and m["longest_caption_tokens"] > 40
    assert m["image_to_text_R@1"] == 0.0  # every caption ties: none counts for the query (it read 100 % before)
    assert "30 captions longer than the text tower's context of 32 tokens" in res["sets"]["long"]["warning"]


# ----------------------------------------------------------------------------- CLIP_benchmark folders: bad input


def _shard(path: Path, members: dict[str, bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _folder(root: Path, n: int = 2, dataset_type: str | None = "retrieval", txt: bytes = b"a\nb\n") -> Path:
    for i in range(n):
        _shard(root / "test" / f"{i}.tar", {f"s{i:07d}.png": png(i), f"s{i:07d}.txt": txt})
    (root / "test" / "nshards.txt").write_text(f"{n}\n")
    if dataset_type is not None:
        (root / "dataset_type.txt").write_text(dataset_type + "\n")
    return root


@pytest.mark.parametrize("break_it, message", [
    (lambda r: (r / "test" / "nshards.txt").write_text("3\n"), r"2\.tar: not found: .*nshards\.txt says 3 shards"),
    (lambda r: _shard(r / "test" / "2.tar", {"x.png": png(9), "x.txt": b"c"}),
     r"nshards\.txt says 2 shards but .* also holds 2\.tar: CLIP_benchmark would leave them out"),
    (lambda r: (r / "test" / "nshards.txt").write_text("two\n"), r"nshards\.txt: holds 'two', not a number"),
    (lambda r: (r / "dataset_type.txt").write_text("segmentation\n"), r"dataset_type\.txt: unknown dataset type "
                                                                       r"'segmentation'"),
    (lambda r: (r / "dataset_type.txt").write_text("multilabel\n"), r"classnames\.txt: not found: the multilabel"),
    (lambda r: (r / "dataset_type.txt").write_text("classification\n"), r"classnames\.txt: not found"),
])
def test_a_broken_clip_benchmark_folder_is_named(tmp_path, break_it, message):
    root = _folder(tmp_path / "set")
    break_it(root)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        resolve_eval_set("set", str(root))


def test_a_missing_split_lists_the_splits_there(tmp_path):
    root = _folder(tmp_path / "set")
    with pytest.raises(FileNotFoundError, match=r"no split 'val' \(the splits here are test; choose one with --split"):
        resolve_eval_set("set", str(root), split="val")


def test_empty_caption_lines_are_left_out_and_counted(weights, tmp_path):
    root = _folder(tmp_path / "set", txt=b"a red circle\n\n  \na blue square\n")
    res = run_magclip(["--model", "tiny-resnet", "--pretrained", str(weights), "--data", f"set={root}"],
                      tmp_path / "r.json")
    entry = res["sets"]["set"]
    assert entry["metrics"]["retrieval"]["num_captions"] == 4  # 2 images x 2 captions
    assert entry["counts"]["skipped"] == {"empty_caption_line": 4}


def test_the_command_refuses_a_broken_folder_in_one_line(tmp_path):
    import subprocess
    import sys

    root = _folder(tmp_path / "set")
    (root / "test" / "nshards.txt").write_text("5\n")
    proc = subprocess.run([sys.executable, str(ROOT / "eval" / "zeroshot.py"), "--model", "tiny-resnet",
                           "--data", f"coco={root}", "--out", str(tmp_path / "r.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "nshards.txt says 5 shards, 3 of 0..4 are missing" in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "r.json").exists()


def test_a_split_folder_is_read_as_the_benchmark_it_is_a_split_of(weights, tmp_path):
    """ROOT/test (where nshards.txt is) given itself: the same set scored the same way as ROOT (by image, its
    dataset_type), not plain shards scored by caption identity, where two images sharing a caption both count
    as hits; a --split naming another split is refused."""
    rng = random.Random(3)
    rows = [(png(300 + i), [f"a photo {i % 3}", caption(rng, 2)]) for i in range(16)]  # images share captions
    root = tmp_path / "cb"
    convert_retrieval_dataset(rows, "test", str(root), image_format="png", max_count=10, verbose=False)
    args = ["--model", "tiny-resnet", "--pretrained", str(weights), "--mode", "cosine"]
    whole = run_magclip([*args, "--data", f"set={root}"], tmp_path / "root.json")["sets"]["set"]
    split = run_magclip([*args, "--data", f"set={root / 'test'}"], tmp_path / "split.json")["sets"]["set"]
    assert (split["layout"], split["matching"], split["split"]) == ("clip_benchmark", "image", "test")
    assert split["benchmark_root"] == str(root) and split["data"] == str(root / "test")
    assert split["metrics"]["retrieval"] == whole["metrics"]["retrieval"]
    as_shards = run_magclip([*args, "--data", f"set={root}", "--matching", "caption"], tmp_path / "c.json")
    assert as_shards["sets"]["set"]["metrics"]["retrieval"]["text_to_image_R@1"] != \
        whole["metrics"]["retrieval"]["text_to_image_R@1"]  # the old reading of the split folder scores otherwise
    with pytest.raises(ValueError, match=r"is the split 'test' of the CLIP_benchmark folder .*cb \(it holds "
                                         r"nshards\.txt\), not split 'val': give the folder .*cb with split 'val'"):
        resolve_eval_set("set", str(root / "test"), split="val")


# ----------------------------------------------------------------------------- Karpathy split files


def _karpathy(tmp_path: Path) -> Path:
    """A hand-written dataset_coco.json: 3 test images (one without its file, one with an empty sentence),
    1 val, 1 restval."""
    images = tmp_path / "coco"
    for name in ("val2014/a.png", "val2014/b.png", "val2014/d.png", "val2014/e.png"):
        (images / name).parent.mkdir(parents=True, exist_ok=True)
        (images / name).write_bytes(png(len(name) + ord(name[-5])))
    entries = [
        {"filepath": "val2014", "filename": "a.png", "split": "test",
         "sentences": [{"raw": "A dog on a mat. ", "tokens": ["a", "dog"]}, {"raw": "a small dog"}]},
        {"filepath": "val2014", "filename": "b.png", "split": "test",
         "sentences": [{"raw": "a cat"}, {"raw": "  "}, {"raw": "a grey cat"}, {"raw": "cat on a sofa"}]},
        {"filepath": "val2014", "filename": "c.png", "split": "test", "sentences": [{"raw": "missing"}]},
        {"filepath": "val2014", "filename": "d.png", "split": "val", "sentences": [{"raw": "a bird"}]},
        {"filepath": "val2014", "filename": "e.png", "split": "restval", "sentences": [{"raw": "a fish"}]},
    ]
    path = tmp_path / "dataset_coco.json"
    path.write_text(json.dumps({"dataset": "coco", "images": entries}))
    return path


def test_karpathy_file_reads_every_sentence_of_the_split(tmp_path):
    path = _karpathy(tmp_path)
    kset = KarpathySet.open(path, tmp_path / "coco")
    assert [i.key for i in kset.items] == ["val2014/a.png", "val2014/b.png"]
    assert [i.captions for i in kset.items] == [["A dog on a mat.", "a small dog"], ["a cat", "a grey cat", "cat on a sofa"]]
    assert kset.skipped == {"missing_image": 1} and kset.blank_captions == 1
    assert [i.key for i in KarpathySet.open(path, tmp_path / "coco", "val").items] == ["val2014/d.png"]
    with pytest.raises(ValueError, match=r"no image of split 'train'; its splits are restval \(1\), test \(3\), val \(1\)"):
        KarpathySet.open(path, tmp_path / "coco", "train")
    with pytest.raises(FileNotFoundError, match=r"none of the 3 images of split 'test' was found under"):
        KarpathySet.open(path, tmp_path)   # the wrong images folder
    (tmp_path / "other.json").write_text(json.dumps({"annotations": []}))
    with pytest.raises(ValueError, match="not a Karpathy split file"):
        KarpathySet.open(tmp_path / "other.json")


def test_karpathy_file_scored_by_image_through_the_command(weights, tmp_path):
    path = _karpathy(tmp_path)
    res = run_magclip(["--model", "tiny-resnet", "--pretrained", str(weights), "--data", f"coco5k={path}",
                       "--images", str(tmp_path / "coco")], tmp_path / "r.json")
    entry = res["sets"]["coco5k"]
    assert (entry["layout"], entry["matching"], entry["split"]) == ("karpathy", "image", "test")
    m = entry["metrics"]["retrieval"]
    assert (m["num_samples"], m["num_captions"]) == (2, 5)
    assert entry["counts"]["skipped"] == {"missing_image": 1, "empty_caption_line": 1}
    assert m["image_to_text_chance_R@1"] == pytest.approx(0.5)  # (2/5 + 3/5) / 2: relevance by image
    assert m["text_to_image_chance_R@1"] == pytest.approx(0.5)


def test_export_index_and_embeddings_keep_every_caption(retrieval_set, weights, tmp_path):
    """With several captions per image the i2t index holds every caption (ids KEY#j), the t2i index every image,
    and the saved embeddings say which image each caption belongs to."""
    from magclip.evaluation.index import load_index

    root, num_captions = retrieval_set
    res = run_magclip(["--model", "tiny-resnet", "--pretrained", str(weights), "--data", f"cb={root}",
                       "--export-index", str(tmp_path / "index"), "--save-embeddings", str(tmp_path / "emb")],
                      tmp_path / "r.json")
    docs, ids, record = load_index(tmp_path / "index" / "cb" / "i2t")
    assert docs.shape[0] == len(ids) == num_captions and ids[0].endswith("#0")
    assert record["documents"] == "text"
    docs, ids, _ = load_index(tmp_path / "index" / "cb" / "t2i")
    assert len(ids) == RETRIEVAL_ROWS and "#" not in ids[0]
    owners = np.load(tmp_path / "emb" / "caption_image_index.npy")
    texts = np.load(tmp_path / "emb" / "text_features.npy")
    assert len(owners) == len(texts) == num_captions and owners.max() == RETRIEVAL_ROWS - 1
    assert res["sets"]["cb"]["counts"]["captions"] == num_captions
