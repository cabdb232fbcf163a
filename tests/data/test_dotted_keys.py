"""Sample keys that hold a dot (webdataset groups a tar's members by the key's first dot): a shard written by
webdataset's own TarWriter with six such keys loses six samples, and each reader counts six, naming the cause."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import pytest
import torch
from builders import png

from magclip.data.dotted_keys import folded_samples
from magclip.data.shards import IMAGE_EXTS, build_clip_loader, shard_sizes

wds = pytest.importorskip("webdataset")
ROOT = Path(__file__).resolve().parents[2]


def dotted_shard(path: Path) -> Path:
    """12 samples written with webdataset.TarWriter: s000..s005, then img.v2.006..img.v2.011 (one group `img`)."""
    with wds.TarWriter(str(path)) as sink:
        for i in range(12):
            key = f"s{i:03d}" if i < 6 else f"img.v2.{i:03d}"
            sink.write({"__key__": key, "png": png(i, 16), "txt": f"caption number {i}"})
    return path


def test_folded_samples_are_whole_samples_not_extra_images():
    assert folded_samples(["v2.006.png", "v2.006.txt", "v2.007.png", "v2.007.txt"], IMAGE_EXTS) == ["v2.006", "v2.007"]
    assert folded_samples(["jpg", "txt", "seg.png"], IMAGE_EXTS) == []  # a mask beside the image: one sample
    assert folded_samples(["jpg", "txt"], IMAGE_EXTS) == []


def test_every_reader_counts_the_samples_lost_to_dotted_keys(tmp_path, caplog):
    shard = dotted_shard(tmp_path / "dots.tar")
    with caplog.at_level(logging.WARNING, logger="magclip.data"):
        assert shard_sizes([str(shard)]) == [7]  # what webdataset groups: the start's count names the loss
    assert "6 samples are lost to 1 (e.g. 6 under the key 'img')" in caplog.text
    assert "webdataset groups a tar's members by the key's first dot" in caplog.text

    loader = build_clip_loader(str(shard), preprocess=lambda im: torch.zeros(3, 4, 4),
                               tokenizer=lambda c: torch.zeros(len(c), 2), batch_size=12, shuffle=False,
                               drop_last=False, all_captions=True)
    keys = [k for batch in loader for k in batch["keys"]]
    assert keys == [f"s{i:03d}" for i in range(6)] and dict(loader.skip_counts) == {"dotted_key": 6}

    spec = importlib.util.spec_from_file_location("eval_zeroshot", ROOT / "eval" / "zeroshot.py")
    zs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zs)
    zs.main(["--model", "tiny-resnet", "--data", str(shard), "--out", str(tmp_path / "r.json")])
    entry = json.loads((tmp_path / "r.json").read_text())["sets"]["data"]
    assert entry["metrics"]["retrieval"]["num_samples"] == 6
    assert entry["counts"]["skipped"] == {"dotted_key": 6}
    assert entry["warning"].startswith("6 samples/shards skipped: {'dotted_key': 6}; dotted_key: sample keys that "
                                       "hold a dot")
