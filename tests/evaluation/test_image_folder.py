"""eval/zeroshot.py on an image folder (torchvision's ImageFolder, CLIP_benchmark's --dataset_root) with
CLIP_benchmark's JSON class-name and "{c}" template files: the same predictions as the shard path on the
same images, bad images counted, top-k only up to the number of classes, and one-line errors.

The class-name and template excerpts below are copied from clip_benchmark 1.6.2
(clip_benchmark/datasets/en_classnames.json, en_zeroshot_classification_templates.json): a dict
{data set: [names]} and a dict {data set: [templates with "{c}"]}.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from builders import write_tar
from PIL import Image, ImageDraw

from magclip import Scorer
from magclip.data.classes import fill_template, load_classes, resolve_templates
from magclip.data.image_folder import IMG_EXTENSIONS, resolve_image_folder
from magclip.evaluation.zeroshot import class_prototypes, format_zeroshot_table, top_classes

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("eval_zeroshot_folder", ROOT / "eval" / "zeroshot.py")
eval_zeroshot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(eval_zeroshot)

# the folders (sorted, as ImageFolder indexes them) and CLIP_benchmark-style prose names for them
FOLDERS = ["blue_square", "green_triangle", "red_circle"]
NAMES = {"shapes": ["a blue square", "a green triangle", "a red circle"]}
CLASSNAMES = {  # real excerpt of en_classnames.json, plus our set's entry
    "eurosat": ["annual crop land", "forest", "brushland or shrubland", "highway or road",
                "industrial buildings or commercial buildings", "pasture land", "permanent crop land",
                "residential buildings or homes or apartments", "river", "lake or sea"],
    "pcam": ["lymph node", "lymph node containing metastatic tumor tissue"],
    **NAMES,
    "shapes_shards": NAMES["shapes"],  # the same images as shards: looked up by that set's name
}
TEMPLATES = {  # real excerpt of en_zeroshot_classification_templates.json
    "eurosat": ["a centered satellite photo of {c}.", "a centered satellite photo of a {c}.",
                "a centered satellite photo of the {c}."],
    "imagenet1k": ["a bad photo of a {c}.", "a photo of many {c}.", "a sculpture of a {c}."],
}


def _png(folder: str, i: int) -> Image.Image:
    colour = {"blue_square": (20, 40, 230), "green_triangle": (30, 200, 40), "red_circle": (230, 30, 30)}[folder]
    img = Image.new("RGB", (16, 16), (255 - 20 * i, 255, 255))
    draw = ImageDraw.Draw(img)
    if folder == "blue_square":
        draw.rectangle((3 + i, 3, 12, 12), fill=colour)
    elif folder == "green_triangle":
        draw.polygon([(8, 2 + i), (2, 13), (14, 13)], fill=colour)
    else:
        draw.ellipse((2, 2 + i, 13, 13), fill=colour)
    return img


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    """3 classes x 3 PNGs + one corrupt file as an image folder, the same files as one labelled shard
    (ImageFolder's order; .cls = class index), the class-name and template JSON files."""
    root = tmp_path_factory.mktemp("ifolder")
    folder, members = root / "shapes", []
    for c, name in enumerate(FOLDERS):
        (folder / name).mkdir(parents=True)
        files = []
        for i in range(3):
            _png(name, i).save(folder / name / f"{i}.png")
            files.append(f"{i}.png")
        if name == "green_triangle":
            (folder / name / "3_broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")  # undecodable
            files.append("3_broken.png")
        (folder / name / "notes.txt").write_text("not an image: ImageFolder ignores it")
        for f in files:
            key = f"{name}_{Path(f).stem}"
            members += [(f"{key}.png", (folder / name / f).read_bytes()), (f"{key}.cls", str(c).encode())]
    shards = root / "shards"
    write_tar(shards / "shapes-000.tar", members)
    (root / "classnames.json").write_text(json.dumps(CLASSNAMES, indent=4))
    (root / "templates.json").write_text(json.dumps(TEMPLATES, indent=4))
    return {"folder": folder, "shards": shards, "classes": root / "classnames.json",
            "templates": root / "templates.json", "root": root}


def test_image_folder_matches_shards_with_json_classes(data, tmp_path, one_thread):
    """One run, two sets: the image folder and the same images as labelled shards. Each set's class
    names come from the CLIP_benchmark dict by its set name; the templates' "{c}" entry falls back to
    imagenet1k as CLIP_benchmark does. Same features, labels, predictions and metrics on both paths."""
    out, emb = tmp_path / "r.json", tmp_path / "emb"
    res = eval_zeroshot.main(["--model", "tiny-resnet", "--mode", "qnorm",
                              "--data", f"shapes={data['folder']}", "--data", f"shapes_shards={data['shards']}",
                              "--classes", str(data["classes"]), "--templates", str(data["templates"]),
                              "--task", "classification", "--batch-size", "64",
                              "--out", str(out), "--save-embeddings", str(emb)])
    assert json.loads(out.read_text())["sets"] == res["sets"]
    folder, shards = res["sets"]["shapes"], res["sets"]["shapes_shards"]
    # the corrupt image: skipped, counted, reported (never fatal, never silent) on both paths alike
    for s in (folder, shards):
        assert s["counts"]["samples"] == 9 and s["counts"]["skipped"] == {"undecodable_image": 1}
        assert "1 " in s["warning"] and "undecodable_image" in s["warning"]
    assert folder["counts"]["files"] == 10  # ImageFolder indexes the PNGs only, not notes.txt
    # 3 classes: top-1 and no top-5 (it would be 1 by construction), and nothing is nan
    m = folder["metrics"]["classification"]["all"]
    assert "top1" in m and "top5" not in m and not any(math.isnan(v) for v in m.values())
    table = format_zeroshot_table(res)
    assert "nan" not in table and "shapes: 3-way classification over " in table
    # the class names of the JSON entry, matched to the sorted folders in order; "{c}" filled
    assert folder["classification"]["classes"].endswith("classnames.json[shapes]")
    assert folder["classification"]["folder_classes"] == dict(zip(FOLDERS, NAMES["shapes"]))
    assert folder["classification"]["templates"] == [t.replace("{c}", "{}") for t in TEMPLATES["imagenet1k"]]
    assert shards["classification"]["classes"].endswith("classnames.json[shapes_shards]")
    assert res["classification"]["classes"] is None  # per-set lists: each set records its own
    assert [json.loads(x) for x in (emb / "shapes" / "classes" / "class_names.jsonl").read_text().splitlines()] \
        == NAMES["shapes"]
    # parity with the shard path: identical inputs, features, labels, predictions and metrics
    assert (emb / "shapes" / "keys.txt").read_text().split()[:2] == ["blue_square/0.png", "blue_square/1.png"]
    img_f = torch.from_numpy(np.load(emb / "shapes" / "image_features.npy"))
    img_s = torch.from_numpy(np.load(emb / "shapes_shards" / "image_features.npy"))
    assert torch.allclose(img_f, img_s, atol=1e-6)
    labels = torch.from_numpy(np.load(emb / "shapes" / "labels.npy"))
    assert labels.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert torch.equal(labels, torch.from_numpy(np.load(emb / "shapes_shards" / "labels.npy")))
    feats = torch.from_numpy(np.load(emb / "shapes" / "classes" / "class_text_features.npy"))
    assert feats.shape[:2] == (3, 3)
    proto = class_prototypes(feats, Scorer("qnorm"))
    assert torch.equal(top_classes(img_f, proto, Scorer("qnorm"), k=3), top_classes(img_s, proto, Scorer("qnorm"), k=3))
    assert folder["metrics"] == shards["metrics"]


def test_clip_benchmark_files_read_as_written(data, tmp_path):
    assert load_classes(data["classes"], lookup=["eurosat"]).names == CLASSNAMES["eurosat"]
    assert load_classes(data["classes"], lookup=["nope", "pcam"]).names == CLASSNAMES["pcam"]  # first key found
    with pytest.raises(ValueError, match=r"no entry for 'cifar10' \(keys: eurosat, pcam, shapes, shapes_shards\)"):
        load_classes(data["classes"], lookup=["cifar10"])
    got = resolve_templates([str(data["templates"])], lookup=["eurosat"])
    assert fill_template(got[0], "forest") == "a centered satellite photo of forest."
    assert resolve_templates([str(data["templates"])], lookup=["cifar10"]) == TEMPLATES["imagenet1k"]  # fallback
    plain = tmp_path / "list.json"
    plain.write_text(json.dumps(["a photo of a {c}.", "art of the {}"]))  # a plain list; "{}" still works
    assert [fill_template(t, "cat") for t in resolve_templates([str(plain), "a {c}"])] == \
        ["a photo of a cat.", "art of the cat", "a cat"]
    cupl = tmp_path / "cupl.json"
    cupl.write_text(json.dumps({"imagenet1k": {"tench": ["a tench is a fish"]}}))
    with pytest.raises(ValueError, match="class-specific prompts"):
        resolve_templates([str(cupl)])
    wnids = tmp_path / "wnids.json"
    wnids.write_text(json.dumps({"n01440764": "tench", "n01443537": "goldfish"}))  # {key: name}: matched by key
    assert load_classes(wnids).index_of("n01443537", "x") == 1
    from torchvision.datasets.folder import IMG_EXTENSIONS as TORCHVISION

    assert IMG_EXTENSIONS == TORCHVISION  # the torch-free copy that tells folders apart


def test_class_dict_without_the_sets_name_lists_keys(data, tmp_path):
    out, holdout = tmp_path / "r.json", tmp_path / "holdout"
    holdout.symlink_to(data["folder"], target_is_directory=True)  # the same images under a name no key has
    with pytest.raises(ValueError, match=r"classnames.json is a dict by data set with no entry for 'mystery', "
                                         r"'holdout' \(keys: eurosat, pcam, shapes, shapes_shards\).*--class-set"):
        eval_zeroshot.main(["--model", "tiny-resnet", "--data", f"mystery={holdout}",
                            "--classes", str(data["classes"]), "--out", str(out)])
    # the set's name, then the folder's own name are tried (`--data DIR/shapes` finds "shapes");
    # --class-set picks another entry (a list of the wrong length here)
    with pytest.raises(ValueError, match=r"classnames.json\[pcam\] has 2 names but image folder .*shapes has 3 "
                                         r"class folders \(blue_square, green_triangle, red_circle\)"):
        eval_zeroshot.main(["--model", "tiny-resnet", "--data", str(data["folder"]), "--class-set", "pcam",
                            "--classes", str(data["classes"]), "--out", str(out)])
    with pytest.raises(ValueError, match=r"shapes is an image folder \(no captions\).*--task classification"):
        eval_zeroshot.main(["--model", "tiny-resnet", "--data", str(data["folder"]), "--task", "both",
                            "--out", str(out)])
    assert not out.exists()


def test_folder_without_images_is_a_one_line_error(data, tmp_path):
    empty = tmp_path / "unpacked"
    (empty / "train").mkdir(parents=True)
    (empty / "train" / "labels.csv").write_text("file,label\n")
    proc = subprocess.run([sys.executable, str(ROOT / "eval" / "zeroshot.py"), "--model", "tiny-resnet",
                           "--data", f"val={empty}", "--out", str(tmp_path / "r.json")],
                          check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert f"--data val: {empty} is neither a folder of .tar shards nor an image folder" in lines[0]
    assert "1 sub-folders without image files" in lines[0]
    # a folder of shards is still its shards, and a plain shard path is not a folder
    assert resolve_image_folder(str(data["shards"])) is None
    assert resolve_image_folder(str(data["shards"] / "shapes-000.tar")) is None
    assert resolve_image_folder(str(data["folder"])) == data["folder"]
