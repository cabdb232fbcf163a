"""The decoded-sample cache (magclip/data/decoded_cache.py): the same batches, skips and counts as reading the shards,
over two epochs, with and without loader workers; damaged shards stay uncached; the rule and the budget."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import pytest
import torch
from torchvision import transforms as T

from magclip.data import decoded_cache
from magclip.data.captions import CaptionKey
from magclip.data import shards as shards_module
from magclip.data.shards import build_clip_loader
from builders import good, png, write_tar

# a random crop: the augmentation must draw the same numbers from the same generator with and without the cache
PRE = T.Compose([T.RandomResizedCrop(8, scale=(0.5, 1.0)), T.PILToTensor()])


def tokenize(texts: list[str]) -> torch.Tensor:
    out = torch.zeros(len(texts), 16, dtype=torch.long)
    for i, t in enumerate(texts):
        ids = [ord(c) for c in t[:16]]
        out[i, :len(ids)] = torch.tensor(ids)
    return out


def shards(folder: Path) -> list[str]:
    """Four shards: clean ones with a few bad samples, one cut short (corrupt_tar), one with a duplicate member."""
    urls = []
    for s in range(4):
        members = [m for i in range(20) for m in good(f"s{s}k{i:02d}", size=10)]
        members += [(f"s{s}bad.png", b"not a png"), (f"s{s}bad.txt", b"caption")]      # undecodable_image
        members += [(f"s{s}nocap.png", png(s))]                                          # missing_caption
        members += [(f"s{s}multi.png", png(100 + s)), (f"s{s}multi.txt", b"one\ntwo\n\nthree")]
        if s == 3:
            members += [(f"s{s}dup.png", png(7)), (f"s{s}dup.txt", b"a"), (f"s{s}dup.txt", b"b")]  # bad_member
        urls.append(str(write_tar(folder / f"shard-{s}.tar", members)))
    cut = Path(urls[2]).read_bytes()
    Path(urls[2]).write_bytes(cut[: len(cut) * 2 // 3])                                  # corrupt_tar
    return urls


def run(urls: list[str], cache, workers: int, epochs: int = 2) -> tuple[list[dict], Counter]:
    batches, counts = [], Counter()
    for epoch in range(epochs):
        torch.manual_seed(epoch)  # with 0 workers the augmentation draws from the global generator
        loader = build_clip_loader(urls, preprocess=PRE, tokenizer=tokenize, batch_size=8, num_samples=None,
                                   shuffle=True, shuffle_buffer=16, workers=workers, seed=3, epoch=epoch,
                                   decoded_cache=cache)
        batches += [{k: b[k] for k in ("images", "texts", "keys", "captions", "skipped")} for b in loader]
        counts += loader.skip_counts
    return batches, counts


def fill(urls: list[str], budget_mb: int = 64):
    return decoded_cache.fill(urls, max_pixels=10**8, caption_key=CaptionKey("txt"), budget_mb=budget_mb)


@pytest.mark.parametrize("workers", [0, 2])
def test_the_cache_gives_the_same_batches_and_skips_as_reading_the_shards(tmp_path, monkeypatch, workers: int) -> None:
    urls = shards(tmp_path)
    cache = fill(urls)
    assert set(cache.shards) == {urls[0], urls[1]}, "damaged shards (cut, duplicate member) must not be cached"
    decodes: list[str] = []  # samples decoded in this process (workers=0): the cached shards' must not be
    check = shards_module.check_sample
    monkeypatch.setattr(shards_module, "check_sample", lambda sample, *a, **k: decodes.append(sample["__url__"])
                        or check(sample, *a, **k))
    read, read_counts = run(urls, None, workers)
    read_decodes, decodes[:] = list(decodes), []
    cached, cached_counts = run(urls, cache, workers)
    if workers == 0:
        assert set(read_decodes) == set(urls) and set(decodes) == {urls[2], urls[3]}
        (memo,) = cache.memos.values()  # the captions' tokens, kept across the epochs' loaders
        assert memo.rows and not memo.off and memo.nbytes <= cache.budget_bytes - cache.nbytes
    assert read_counts == cached_counts
    assert {"undecodable_image", "missing_caption", "corrupt_tar", "bad_member", "empty_caption_line"} <= set(read_counts)
    assert len(read) == len(cached) > 4
    for a, b in zip(read, cached):
        assert a["keys"] == b["keys"] and a["captions"] == b["captions"] and a["skipped"] == b["skipped"]
        assert torch.equal(a["images"], b["images"]) and torch.equal(a["texts"], b["texts"])


def test_cached_samples_are_never_changed_by_a_pass(tmp_path) -> None:
    urls = shards(tmp_path)[:2]
    cache = fill(urls)
    before = {u: [(s["__key__"], s[decoded_cache.DECODED][0] and dict(s[decoded_cache.DECODED][0]))
                  for s in samples] for u, samples in cache.shards.items()}
    run(urls, cache, workers=0, epochs=1)
    after = {u: [(s["__key__"], s[decoded_cache.DECODED][0] and dict(s[decoded_cache.DECODED][0]))
                 for s in samples] for u, samples in cache.shards.items()}
    assert before == after


def test_a_set_over_the_budget_is_not_kept(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, "magclip.data")
    urls = shards(tmp_path)[:2]
    assert fill(urls, budget_mb=0) is None
    assert "data.cache_max_mb=0" in caplog.text


@pytest.mark.parametrize("setting, passes, resampled, wanted", [
    ("auto", 5.0, False, True), ("auto", 1.0, False, False), ("auto", None, False, False),
    (True, 1.0, False, True), (False, 5.0, False, False), ("auto", 5.0, True, False), (True, 5.0, True, False)])
def test_the_rule(setting, passes, resampled, wanted) -> None:
    assert decoded_cache.cache_wanted(setting, passes, resampled)[0] is wanted
