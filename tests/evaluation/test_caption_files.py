"""Caption files over an images folder: COCO's own caption file scored by magclip equal to CLIP_benchmark's
`mscoco_captions` (torchvision's `CocoCaptions` under its own builder) on the same files, its bad inputs
refused in one line, and an image a caption file lists twice scored once, counted and said.

A random-init tiny-resnet and 16x16 PNGs keep this fast; parity needs no trained model, only the same weights.
"""

from __future__ import annotations

import importlib.util
import io
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from builders import png, save_tiny_resnet

from magclip.data.coco_captions import CocoCaptionsSet
from magclip.data.eval_sets import resolve_eval_set
from magclip.data.karpathy import KarpathySet
from magclip.models.clip import create_clip

cb_builder = pytest.importorskip("clip_benchmark.datasets.builder")
pytest.importorskip("pycocotools")
from clip_benchmark.metrics import zeroshot_retrieval

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("eval_zeroshot", ROOT / "eval" / "zeroshot.py")
eval_zeroshot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(eval_zeroshot)

WORDS = ["red", "blue", "green", "circle", "square", "star", "small", "large", "left", "right", "dog", "cat"]
IMAGES = 24


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    """A random-init tiny-resnet's weights: what both tools load."""
    return save_tiny_resnet(tmp_path_factory.mktemp("model"))


def coco_file(root: Path, n: int = IMAGES) -> tuple[Path, int]:
    """CLIP_benchmark's mscoco_captions layout: ROOT/val2014/<file_name> and a COCO caption file, its image ids
    not in file order, 1 to 4 captions per image (two images share a caption), the annotations shuffled;
    (the file, the number of captions)."""
    rng = random.Random(0)
    (root / "val2014").mkdir(parents=True, exist_ok=True)
    images, annotations = [], []
    for i in range(n):
        image_id = 1000 - 7 * i
        name = f"COCO_val2014_{image_id:012d}.png"
        (root / "val2014" / name).write_bytes(png(i, 16))
        images.append({"id": image_id, "file_name": name, "height": 16, "width": 16})
        for _ in range(rng.randint(1, 4)):
            annotations.append({"image_id": image_id, "caption": " ".join(rng.choice(WORDS) for _ in range(4)) + " "})
    annotations.append({"image_id": images[1]["id"], "caption": annotations[0]["caption"]})
    rng.shuffle(annotations)
    for j, ann in enumerate(annotations):
        ann["id"] = 5000 + j
    path = root / "coco_test_karpathy.json"
    path.write_text(json.dumps({"info": {}, "licenses": [], "images": images, "annotations": annotations}))
    return path, len(annotations)


def run_magclip(args: list[str], out: Path) -> dict:
    eval_zeroshot.main([*args, "--out", str(out)])
    return json.loads(out.read_text())


def test_coco_caption_file_equals_clip_benchmark_mscoco_captions(weights, tmp_path):
    ann, num_captions = coco_file(tmp_path / "coco")
    bundle = create_clip("tiny-resnet", str(weights))
    model = bundle.model.clip.eval()
    dataset = cb_builder.build_dataset("mscoco_captions", root=str(tmp_path / "coco"), split="test",
                                       annotation_file=str(ann), transform=bundle.preprocess_val,
                                       task="zeroshot_retrieval")
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, collate_fn=cb_builder.get_dataset_collate_fn(
        "mscoco_captions"))
    theirs = zeroshot_retrieval.evaluate(model, loader, bundle.tokenizer, "cpu", amp=False, recall_k_list=[1, 5, 10])
    res = run_magclip(["--model", "tiny-resnet", "--pretrained", str(weights), "--mode", "cosine",
                       "--data", f"coco={ann}", "--images", str(tmp_path / "coco" / "val2014")], tmp_path / "r.json")
    entry = res["sets"]["coco"]
    assert (entry["layout"], entry["matching"], entry["tasks"]) == ("coco_captions", "image", ["retrieval"])
    mine = entry["metrics"]["retrieval"]
    assert (mine["num_samples"], mine["num_captions"]) == (len(dataset), num_captions) == (IMAGES, num_captions)
    for k in (1, 5, 10):  # CLIP_benchmark names by what is retrieved: "image retrieval" = text->image
        assert mine[f"text_to_image_R@{k}"] == pytest.approx(theirs[f"image_retrieval_recall@{k}"], abs=1e-6)
        assert mine[f"image_to_text_R@{k}"] == pytest.approx(theirs[f"text_retrieval_recall@{k}"], abs=1e-6)
    assert 0.0 < mine["image_to_text_R@5"] < 1.0 and "warning" not in entry


def test_coco_caption_file_counts_a_missing_image_as_karpathy_does(tmp_path):
    ann, _ = coco_file(tmp_path, n=4)
    gone = min((tmp_path / "val2014").iterdir())
    gone.unlink()
    cset = resolve_eval_set("coco", str(ann), images=str(tmp_path / "val2014")).captioned
    assert isinstance(cset, CocoCaptionsSet) and len(cset) == 3 and cset.skipped == {"missing_image": 1}
    assert [i.key for i in cset.items] == sorted(i.key for i in cset.items)  # image id order: ids fall with the name
    with pytest.raises(FileNotFoundError, match=r"none of the 4 images was found under .*; pass the images folder "
                                                r"with --images"):
        CocoCaptionsSet.open(ann)  # the default folder is the file's own, where the images are not
    with pytest.raises(ValueError, match=r"split 'val': .* is a COCO caption file, which holds one split"):
        resolve_eval_set("coco", str(ann), split="val", images=str(tmp_path / "val2014"))


@pytest.mark.parametrize("damage, message", [
    (lambda d: d.pop("annotations"), r"neither a Karpathy split file .* nor a COCO caption file"),
    (lambda d: d["annotations"].append({"image_id": 7, "caption": "x", "id": 1}),
     r"annotation 4 \(id 1\) names image_id 7, which is not among its images"),
    (lambda d: d["annotations"][0].pop("caption"), r"annotation 0 has no image_id or no caption"),
    (lambda d: d["images"][0].pop("file_name"), r"image 0 has no integer id or no file_name"),
    (lambda d: d["images"].append(dict(d["images"][0])), r"image id 1000 is listed twice"),
])
def test_a_damaged_coco_caption_file_is_refused_in_one_line(tmp_path, damage, message):
    ann, _ = coco_file(tmp_path, n=2)
    data = json.loads(ann.read_text())
    data["annotations"] = data["annotations"][:4]
    damage(data)
    ann.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        resolve_eval_set("coco", str(ann), images=str(tmp_path / "val2014"))


def test_the_command_refuses_a_coco_file_with_a_stray_annotation_in_one_line(tmp_path):
    ann, _ = coco_file(tmp_path, n=2)
    data = json.loads(ann.read_text())
    data["annotations"].append({"id": 9, "image_id": 12345, "caption": "a cat"})
    ann.write_text(json.dumps(data))
    proc = subprocess.run([sys.executable, str(ROOT / "eval" / "zeroshot.py"), "--model", "tiny-resnet",
                           "--data", f"coco={ann}", "--images", str(tmp_path / "val2014"),
                           "--out", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "names image_id 12345, which is not among its images" in proc.stderr.strip().splitlines()[-1]


def test_an_image_a_karpathy_file_lists_twice_is_scored_once_as_clip_benchmark_does(weights, tmp_path):
    """CLIP_benchmark groups captions by image (its Flickr reader by file name, CocoCaptions by id): the two
    entries of one image are one image with the sentences of both, scored equal to CLIP_benchmark's Flickr
    reader over the same images and captions, and the run says so."""
    from clip_benchmark.datasets.flickr import Flickr
    from PIL import Image

    rng = random.Random(5)
    entries, lines = [], ["image,caption"]
    for i in range(6):
        Image.open(io.BytesIO(png(40 + i, 16))).save(tmp_path / f"{i}.jpg", quality=95)
        sentences = [" ".join(rng.choice(WORDS) for _ in range(3)) for _ in range(2)]
        entries.append({"filename": f"{i}.jpg", "split": "test", "sentences": [{"raw": c} for c in sentences]})
    entries.insert(4, {"filename": "1.jpg", "split": "test", "sentences": [{"raw": "the same image again"}]})
    lines += [f"{e['filename']},{s['raw']}" for e in entries for s in e["sentences"]]
    path = tmp_path / "dataset_flickr30k.json"
    path.write_text(json.dumps({"images": entries}))
    (tmp_path / "flickr30k_test_karpathy.txt").write_text("\n".join(lines) + "\n")
    kset = KarpathySet.open(path)
    assert [i.key for i in kset.items] == [f"{i}.jpg" for i in range(6)] and kset.merged_duplicates == 1
    assert kset.items[1].captions == [s["raw"] for s in entries[1]["sentences"]] + ["the same image again"]

    bundle = create_clip("tiny-resnet", str(weights))
    theirs_set = Flickr(str(tmp_path), str(tmp_path / "flickr30k_test_karpathy.txt"), transform=bundle.preprocess_val)
    loader = torch.utils.data.DataLoader(theirs_set, batch_size=4, collate_fn=cb_builder.get_dataset_collate_fn(
        "flickr30k"))
    theirs = zeroshot_retrieval.evaluate(bundle.model.clip.eval(), loader, bundle.tokenizer, "cpu", amp=False,
                                         recall_k_list=[1, 5])
    res = run_magclip(["--model", "tiny-resnet", "--pretrained", str(weights), "--mode", "cosine",
                       "--data", f"flickr={path}"], tmp_path / "r.json")
    entry = res["sets"]["flickr"]
    mine = entry["metrics"]["retrieval"]
    assert (mine["num_samples"], mine["num_captions"]) == (len(theirs_set), 13) == (6, 13)
    for k in (1, 5):
        assert mine[f"text_to_image_R@{k}"] == pytest.approx(theirs[f"image_retrieval_recall@{k}"], abs=1e-6)
        assert mine[f"image_to_text_R@{k}"] == pytest.approx(theirs[f"text_retrieval_recall@{k}"], abs=1e-6)
    assert entry["merged_duplicate_images"] == 1
    assert "1 listings of an image already listed: each image is scored once" in entry["warning"]
