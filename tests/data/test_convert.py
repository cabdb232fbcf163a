"""Folder + caption table -> shards -> build_clip_loader, with bad rows counted."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from torchvision import transforms as T

from magclip.data.convert import convert_to_shards
from magclip.data.shards import build_clip_loader, count_samples

PRE = T.Compose([T.Resize((8, 8)), T.ToTensor()])
ROOT = Path(__file__).resolve().parents[2]


def tok(texts: list[str]) -> torch.Tensor:
    return torch.tensor([[len(t), sum(map(ord, t)) % 1000] for t in texts])


@pytest.fixture
def images(tmp_path: Path) -> Path:
    folder = tmp_path / "images"
    (folder / "sub").mkdir(parents=True)
    for i in range(5):
        Image.new("RGB", (10 + i, 12), (40 * i, 0, 0)).save(folder / f"img{i}.png")
    Image.new("RGB", (9, 9), (0, 90, 0)).save(folder / "sub" / "photo.jpg")
    Image.new("RGB", (9, 9), (0, 0, 90)).save(folder / "pic.bmp")  # re-encoded to PNG
    (folder / "broken.png").write_bytes(b"not a png")
    return folder


ROWS = [
    ("img0.png", "a dark image"),
    ("img1.png", "a reddish image"),
    ("img2.png", "   "),  # empty caption
    ("nowhere.png", "missing file"),
    ("img3.png", "a red image"),
    ("broken.png", "undecodable"),
    ("", "no file name"),
    ("sub/photo.jpg", "a green photo"),
    ("pic.bmp", "a blue bitmap"),
    ("img4.png", "the reddest image, with a comma"),
]
GOOD = 6


def test_csv_round_trip(tmp_path: Path, images: Path) -> None:
    table = tmp_path / "captions.csv"
    with open(table, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["file", "caption", "source"])
        w.writerows([(a, b, "test") for a, b in ROWS])
    out = tmp_path / "shards"
    result = convert_to_shards(images, table, out, shard_size=4, quiet=True)
    assert result["written"] == GOOD
    assert result["skipped"] == {"empty_caption": 1, "missing_file": 2, "undecodable_image": 1}
    assert len(result["shards"]) == 2 and result["urls"].endswith("shard-{000000..000001}.tar")
    assert json.loads((out / "sizes.json").read_text()) == {"shard-000000.tar": 4, "shard-000001.tar": 2}
    assert count_samples(result["urls"]) == GOOD

    loader = build_clip_loader(result["urls"], preprocess=PRE, tokenizer=tok, batch_size=4, shuffle=False,
                               drop_last=False)
    batches = list(loader)
    captions = [c for b in batches for c in b["captions"]]
    assert captions == [c for f, c in ROWS if f and c.strip() and f not in ("nowhere.png", "broken.png")]
    assert batches[0]["images"].shape == (4, 3, 8, 8)
    assert not loader.skip_counts


def test_jsonl_with_custom_columns_and_bad_lines(tmp_path: Path, images: Path) -> None:
    table = tmp_path / "captions.jsonl"
    lines = [json.dumps({"image": a, "text": b, "id": i}) for i, (a, b) in enumerate(ROWS)]
    lines.insert(3, "{not json")
    lines.insert(5, json.dumps(["a", "list"]))
    table.write_text("\n".join(lines) + "\n\n")
    out = tmp_path / "out"
    result = convert_to_shards(images, table, out, prefix="train", image_column="image", caption_column="text",
                               quiet=True)
    assert result["written"] == GOOD and result["urls"] == str(out / "train-000000.tar")
    assert result["skipped"] == {"empty_caption": 1, "missing_file": 2, "undecodable_image": 1, "bad_row": 2}
    batch = next(iter(build_clip_loader(result["urls"], preprocess=PRE, tokenizer=tok, batch_size=GOOD,
                                        shuffle=False)))
    assert batch["captions"][0] == "a dark image"


def test_csv_header_without_the_columns(tmp_path: Path, images: Path) -> None:
    table = tmp_path / "c.csv"
    table.write_text("path,caption\nimg0.png,x\n")
    with pytest.raises(ValueError, match=r"c\.csv: no image column \('file' or 'filepath'.*\['path', 'caption'\]"):
        convert_to_shards(images, table, tmp_path / "o", quiet=True)


def test_cli(tmp_path: Path, images: Path) -> None:
    table = tmp_path / "c.tsv"
    table.write_text("file\tcaption\nimg0.png\tone\nimg1.png\ttwo\n")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "make_shards.py"), str(images), str(table),
                           str(tmp_path / "o"), "--shard-size", "1"],
                          capture_output=True, text=True, check=True)
    assert "wrote 2 samples in 2 shards" in proc.stdout
    assert count_samples(str(tmp_path / "o" / "shard-{000000..000001}.tar")) == 2
