"""The embedded synthetic dataset: deterministic, cached, consistent with sizes.json."""

from __future__ import annotations

import hashlib
import json
import tarfile
import time
from pathlib import Path

import pytest
import torch
from torchvision import transforms as T

from magclip.data.shards import build_clip_loader, count_samples
from magclip.data.synthetic import ensure_synthetic

SMALL = dict(num_train=120, num_val=30, image_size=32, shard_size=50, seed=1)


def zeros_tokenizer(texts: list[str]) -> torch.Tensor:
    return torch.zeros(len(texts), 4, dtype=torch.long)


def digests(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.glob("*.tar"))}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory):
    return ensure_synthetic(tmp_path_factory.mktemp("a"), **SMALL)


def test_deterministic(data, tmp_path: Path) -> None:
    again = ensure_synthetic(tmp_path, **SMALL)
    assert again.root != data.root and digests(again.root) == digests(data.root)
    other = ensure_synthetic(tmp_path, **dict(SMALL, seed=2))
    assert other.root != again.root and digests(other.root) != digests(again.root)


def test_layout_and_sizes(data) -> None:
    sizes = json.loads(data.sizes_file.read_text())
    assert sizes == {"train-000000.tar": 40, "train-000001.tar": 40, "train-000002.tar": 40,
                     "val-000000.tar": 15, "val-000001.tar": 15}
    assert data.train_urls == str(data.root / "train-{000000..000002}.tar")
    assert count_samples(data.train_urls) == data.num_train == 120
    assert count_samples(data.val_urls) == data.num_val == 30
    with tarfile.open(data.root / "train-000000.tar") as tar:
        members = tar.getmembers()
    assert [m.name for m in members[:3]] == ["000000000.png", "000000000.txt", "000000000.json"]
    assert len(members) == 3 * 40 and all(m.mtime == 0 and m.uid == 0 for m in members)


def test_captions_and_metadata(data) -> None:
    details = []
    for shard in sorted(data.root.glob("*.tar")):
        with tarfile.open(shard) as tar:
            files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        for name, raw in files.items():
            if name.endswith(".txt"):
                caption = raw.decode("utf-8")
                meta = json.loads(files[name[:-4] + ".json"])
                assert caption.strip() == caption and caption
                assert 1 <= meta["num_objects"] == len(meta["objects"]) <= 3
                assert 0 < meta["caption_detail"] <= 1
                for obj in meta["objects"]:  # a full caption names every object's attributes
                    if meta["caption_detail"] == 1:
                        assert f"{obj['colour']} {obj['shape']} {obj['position']}" in caption
                details.append(meta["caption_detail"])
    assert len(details) == 150 and min(details) < 0.34 and max(details) == 1  # specificity varies


def test_reuses_cache(data) -> None:
    before = {p: p.stat().st_mtime_ns for p in data.root.iterdir()}
    start = time.perf_counter()
    again = ensure_synthetic(data.root.parent, **SMALL)
    assert time.perf_counter() - start < 0.1
    assert again == data and {p: p.stat().st_mtime_ns for p in data.root.iterdir()} == before
    assert not [p for p in data.root.parent.iterdir() if ".tmp" in p.name]


def test_default_root_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MAGCLIP_CACHE", str(tmp_path))
    d = ensure_synthetic(num_train=4, num_val=2, shard_size=2)
    assert d.root.parent == tmp_path / "synthetic-v1"


def test_loads_through_the_loader(data) -> None:
    loader = build_clip_loader(data.val_urls, preprocess=T.ToTensor(), tokenizer=zeros_tokenizer,
                               batch_size=8, shuffle=False, drop_last=False, workers=2)
    batches = list(loader)
    assert sum(len(b["keys"]) for b in batches) == 30 and batches[0]["images"].shape == (8, 3, 32, 32)
    assert not loader.skip_counts


def _generate(root: str) -> str:
    return str(ensure_synthetic(root, **SMALL).root)


def test_concurrent_generation(tmp_path: Path) -> None:
    # Two ranks starting together both generate; one rename wins, the other keeps the winner's copy.
    import multiprocessing as mp

    with mp.get_context("fork").Pool(2) as pool:
        roots = pool.map(_generate, [str(tmp_path)] * 2)
    assert roots[0] == roots[1]
    assert [p.name for p in tmp_path.iterdir()] == [Path(roots[0]).name]
    assert count_samples(ensure_synthetic(tmp_path, **SMALL).train_urls) == 120
