"""An image-caption parquet, as the hub's CLIP sets ship (issue 61): make_shards refused it (a hint toward
--separator, then Latin-1) and `train/clip.py data.train=x.parquet` said `num_samples=0`, naming neither
the file nor the format. Now make_shards converts it, the shards decoding to `datasets`' pixels exactly,
and a run given the parquet is refused in one line that names it and says how to convert it."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from builders import ROOT
from PIL import Image

from magclip.data.image_parquet import convert_image_table
from magclip.data.shard_reader import iter_tar_samples, load_image

datasets = pytest.importorskip("datasets")


def picture(mode: str, seed: int, size=(7, 5)) -> Image.Image:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 4), dtype=np.uint8)
    image = Image.fromarray(pixels, "RGBA")
    return image.convert(mode) if mode != "RGBA" else image


def encoded(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def write_table(path: Path, listed: bool = True) -> Path:
    """Rows as `datasets` writes them: an Image column (JPEG, PNG with alpha, a palette GIF, a WebP, one
    missing, one undecodable) and a caption column (one a list of captions, one empty)."""
    images = [{"bytes": encoded(picture("RGB", 0), "JPEG"), "path": None},
              {"bytes": encoded(picture("RGBA", 1), "PNG"), "path": None},
              {"bytes": encoded(picture("P", 2), "GIF"), "path": None},
              {"bytes": encoded(picture("RGB", 3), "WEBP"), "path": None},
              None,
              {"bytes": b"not an image", "path": None},
              {"bytes": encoded(picture("L", 4), "PNG"), "path": None}]
    captions = ["a red scene", "two shapes", "a palette", "", "no image", "broken", ["first", "second"]]
    column = [c if isinstance(c, list) else [c] for c in captions] if listed else \
        [" / ".join(c) if isinstance(c, list) else c for c in captions]
    ds = datasets.Dataset.from_dict({"image": images, "caption": column, "id": list(range(7))})
    ds = ds.cast_column("image", datasets.Image())
    ds.to_parquet(str(path))
    return path


@pytest.mark.parametrize("listed", [True, False], ids=["caption_lists", "caption_strings"])
def test_make_shards_converts_an_image_parquet_to_datasets_pixels(tmp_path, listed):
    table = write_table(tmp_path / "train.parquet", listed)
    result = convert_image_table(table, tmp_path / "shards", quiet=True)
    assert result["written"] == 4
    assert result["skipped"] == {"empty_caption": 1, "missing_image": 1, "undecodable_image": 1}
    peer = datasets.load_dataset("parquet", data_files=str(table), split="train")
    kept = [0, 1, 2, 6]
    samples = list(iter_tar_samples(result["shards"], Counter()))
    assert len(samples) == len(kept)
    for (_, _, members), row in zip(samples, kept, strict=True):
        image_ext = next(e for e in members if e in ("jpg", "png", "webp"))
        ours, _, _ = load_image(members[image_ext], 10**8)
        theirs = peer[row]["image"].convert("RGB")   # datasets' decoding, as a trainer converts it
        assert np.array_equal(np.asarray(ours), np.asarray(theirs)), row
        caption = peer[row]["caption"]
        assert members["txt"].decode() == ("\n".join(caption) if listed else caption)


def test_a_run_given_a_parquet_is_refused_in_one_line_naming_it_and_make_shards(tmp_path):
    table = write_table(tmp_path / "train.parquet")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "train" / "clip.py"), f"data.train={table}",
                           f"output_dir={tmp_path / 'runs'}"], cwd=tmp_path, env=env, capture_output=True, check=False,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert f"data.train: {table} is a table, not webdataset shards: convert it with make_shards" in last
    assert f"python tools/make_shards.py {table} OUT_DIR" in last


def test_make_shards_command_takes_the_parquet_and_an_output_folder(tmp_path):
    table = write_table(tmp_path / "train.parquet")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "make_shards.py"), str(table), str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "wrote 4 samples in 1 shards" in proc.stdout and (tmp_path / "out" / "shard-000000.tar").is_file()
