"""Where the loader runs is not part of the experiment (data/shards.py `_RankStream`, data/sample_augment.py): with
the same sample streams, 0, 1 and 2 workers give the same batches -- keys, captions and the crops of a random
transform, bit for bit -- in the same order, over several epochs and with the decoded-sample cache; the global RNGs
are left where they were; a batch holds samples of one stream; workers that do not divide the streams are lowered."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch
from torchvision import transforms as T

from magclip.data import decoded_cache
from magclip.data.captions import CaptionKey
from magclip.data.sample_augment import SeededAugment, sample_seed, torch_draws_only
from magclip.data.shards import build_clip_loader
from builders import good, write_tar

PRE = T.Compose([T.RandomResizedCrop(8, scale=(0.3, 1.0)), T.RandomHorizontalFlip(), T.PILToTensor()])


def tokenize(texts: list[str]) -> torch.Tensor:
    out = torch.zeros(len(texts), 8, dtype=torch.long)
    for i, t in enumerate(texts):
        out[i, :min(8, len(t))] = torch.tensor([ord(c) for c in t[:8]])
    return out


@pytest.fixture(scope="module")
def urls(tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("streams")
    return [str(write_tar(folder / f"shard-{s}.tar", [m for i in range(13) for m in good(f"s{s}k{i:02d}", size=12)]))
            for s in range(4)]


def batches(urls: list[str], workers: int, streams: int, epochs: int = 3, cache=None, num_samples: int = 60,
            reseed: bool = True) -> list[dict]:
    out = []
    for epoch in range(epochs):
        if reseed:  # the global RNG differs per layout: crops must not follow it
            torch.manual_seed(1000 + epoch + workers)
        loader = build_clip_loader(urls, preprocess=PRE, tokenizer=tokenize, batch_size=5, num_samples=num_samples,
                                   shuffle=True, shuffle_buffer=20, workers=workers, streams=streams, seed=7,
                                   epoch=epoch, decoded_cache=cache)
        out += [{k: b[k] for k in ("images", "texts", "keys")} for b in loader]
    return out


def assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) == 36
    for x, y in zip(a, b):
        assert x["keys"] == y["keys"]
        assert torch.equal(x["images"], y["images"]) and torch.equal(x["texts"], y["texts"])


def test_the_workers_do_not_change_the_batches(urls):
    in_process = batches(urls, workers=0, streams=2)
    assert_same(in_process, batches(urls, workers=1, streams=2))
    assert_same(in_process, batches(urls, workers=2, streams=2))
    cache = decoded_cache.fill(urls, max_pixels=10**6, caption_key=CaptionKey("txt"), budget_mb=16)
    assert_same(in_process, batches(urls, workers=0, streams=2, cache=cache))


def test_streams_are_the_experiment(urls):
    """Another stream count is another sample order; each batch comes from one stream's shards, in turn."""
    one = batches(urls, workers=0, streams=1, epochs=1, num_samples=40)
    two = batches(urls, workers=0, streams=2, epochs=1, num_samples=40)  # one pass of each stream (20 of 26 samples)
    assert [b["keys"] for b in one] != [b["keys"] for b in two]
    shard_sets = [{k.split("k")[0] for k in b["keys"]} for b in two]
    assert len(shard_sets) == 8 and all(len(s) <= 2 for s in shard_sets)  # each batch: its stream's 2 shards
    assert all(not (a & b) for a, b in zip(shard_sets[::2], shard_sets[1::2]))  # consecutive batches: other stream


def test_crops_are_seeded_per_sample_and_leave_the_global_rngs(urls):
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    first = batches(urls, workers=0, streams=2, epochs=1, reseed=False)
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert np.array_equal(np.random.get_state()[1], before[2])
    again = batches(urls, workers=0, streams=2, epochs=1, reseed=False)
    assert_same(first * 3, again * 3)
    # two epochs of the same sample draw different crops; the seed is the sample's, not the batch position's
    assert sample_seed(7, 0, 0, "k") != sample_seed(7, 1, 0, "k") != sample_seed(7, 0, 1, "k")
    image = T.ToPILImage()(torch.rand(3, 12, 12))
    crop = SeededAugment(PRE)
    assert crop.torch_only and torch.equal(crop(image, 3), crop(image, 3))
    assert not all(torch.equal(crop(image, 3), crop(image, s)) for s in range(4, 12))


def test_a_step_outside_torchvision_gets_every_rng_seeded():
    """A step that may draw from Python's or numpy's generator (timm's, a user's): those are seeded and put back too."""
    def jitter(image):
        return image.point(lambda v: min(255, v + random.randint(0, 50) + int(np.random.randint(0, 50))))

    image = T.ToPILImage()(torch.rand(3, 12, 12))
    with_jitter = T.Compose([T.RandomResizedCrop(8), jitter, T.PILToTensor()])
    assert torch_draws_only(PRE) and not torch_draws_only(with_jitter)
    seeded = SeededAugment(with_jitter)
    random.seed(1)
    np.random.seed(1)
    before = (random.getstate(), np.random.get_state()[1].copy())
    assert torch.equal(seeded(image, 9), seeded(image, 9))
    assert random.getstate() == before[0] and np.array_equal(np.random.get_state()[1], before[1])


def test_workers_that_do_not_divide_the_streams_are_lowered(urls, caplog):
    with caplog.at_level(logging.WARNING, logger="magclip.data"):
        loader = build_clip_loader(urls, preprocess=PRE, tokenizer=tokenize, batch_size=5, num_samples=60,
                                   workers=3, streams=4, seed=7)
    assert loader.workers == 2 and "3 loader workers for 4 sample streams: using 2" in caplog.text
    with pytest.raises(ValueError, match="streams must be >= 1"):
        build_clip_loader(urls, preprocess=PRE, tokenizer=tokenize, batch_size=5, num_samples=60, streams=0)
