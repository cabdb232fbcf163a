"""webdataset pipelines for image-text shards (img2dataset layout: KEY.{jpg,jpeg,png,webp} + KEY.txt).

One rank's pipeline, built from webdataset's own stages, once per sample stream (`_RankStream`: the rank's
batches come from `streams` streams in turn, each run by the loader worker congruent to it, or in the training
process; the same batches for any worker count that divides the streams):

    shard list   all sources' shards; deterministic shuffle per (seed, epoch, pass), or weighted
                 resampling with replacement per (seed, epoch, pass, rank, stream)
    split        by rank (explicit rank/world, no process group needed), then by stream
    read         wds url_opener -> tar members -> wds group_by_keys (samples never span shards), or the
                 shard's samples already read and decoded (data/decoded_cache.py, later epochs)
    shuffle      wds.shuffle buffer over raw bytes (5,000 samples by default, as open_clip_train; the
                 first batch waits for a quarter of it), seeded per rank/stream/pass
    decode       validate, decode (data/shard_reader.py), preprocess, in training with each sample's random
                 draws seeded by (seed, epoch, pass, key) (data/sample_augment.py); bad samples are skipped and
                 counted by reason
    batch        batches without lookahead, the tokenizer as part of the collation

Epoch length. With `num_samples`, every rank yields exactly `num_samples // (batch_size *
world_size)` full batches: a stream whose shards run out starts another pass over them (open_clip's
`with_epoch` semantics), so distributed all-gathers never wait on a rank that ran dry. With
`num_samples=None` (not resampled) the loader makes one pass over this rank's shards, keeping a
last partial batch unless `drop_last`; this is what evaluation wants, but ranks can then yield
different batch counts, so use `num_samples` for distributed training.

Bad data never stops a run and never disappears silently: each skip is counted under a reason
(`shard_reader.SKIP_REASONS`), logged (first few per reason per worker and epoch) on the `magclip.data`
logger with shard URL and key, reported per batch in `batch["skipped"]` and summed in
`ShardLoader.skip_counts`. `corrupt_tar` and `unreadable_shard` count shards, not samples (how
many samples a broken tar held is unknown); every other reason counts samples.

Why not `wds.tarfile_to_samples`: on a tar cut at a header boundary Python's tarfile stops
silently, and on one cut inside a member it may raise twice; the reader here detects both and
counts one `corrupt_tar` per shard, keeping the samples read before the damage.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import random
import signal
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from itertools import count, islice
from pathlib import Path
from typing import Any

import torch
import webdataset as wds
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from webdataset.tariterators import base_plus_ext

from magclip import distributed
from magclip.data import dotted_keys
from magclip.data.captions import TXT, CaptionKey, choose_caption
from magclip.data.decoded_cache import DECODED, DecodedCache
from magclip.data.sample_augment import SeededAugment, sample_seed
from magclip.data.shard_reader import (
    DEFAULT_MAX_IMAGE_PIXELS,
    LOG_FIRST_SKIPS,
    SkipCounter,
    check_sample,
    read_grouped,
    tar_members,
)
from magclip.data.shard_start import IMAGE_EXTS
from magclip.data.urls import check_shards_exist, check_sources_exist, expand_sources, local_path

log = logging.getLogger("magclip.data")


# ----------------------------------------------------------------------------- urls and sizes


def _count_tar(path: Path) -> int:
    """Number of distinct sample keys in one tar, read as far as it is readable; samples whose keys hold a
    dot, which webdataset folds into another sample, are counted and named in a warning (magclip.data.dotted_keys)."""
    keys: dict[str, list[str]] = {}  # key -> its fields that hold a dot
    try:
        with open(path, "rb") as f:
            for name, _ in tar_members(f):
                key, field = base_plus_ext(name)
                if key is not None:
                    dotted = keys.setdefault(key, [])
                    if field is not None and "." in field:
                        dotted.append(field)
    except Exception as exn:
        log.warning("counting %s: tar damaged after %d samples (%s)", path, len(keys), exn)
    folded = {key: n for key, fields in keys.items() if (n := len(dotted_keys.folded_samples(fields, IMAGE_EXTS)))}
    if folded:
        example = next(iter(folded))
        log.warning("%s: %d samples are lost to %d (e.g. %d under the key %r): %s", path, sum(folded.values()),
                    len(folded), folded[example], example, dotted_keys.CAUSE)
    return len(keys)


SIZES_FILE = "sizes.json"  # {shard name: samples} beside the shards (open_clip's convention)
SIZES_CHECK_MAX_BYTES = 2**30  # local shards up to this size are counted at start to check sizes.json


def shard_sizes(urls: list[str], check_claims: bool = False) -> list[int | None]:
    """Samples per shard from a `sizes.json` beside the shards (open_clip's convention), else by
    reading the tar; for a `pipe:` URL whose command names a local shard path with a sizes.json
    beside it (`pipe:cat /data/shard-000003.tar`), that table; None for any other remote shard.
    `check_claims`: the counts a sizes.json gives for local shards are checked (`_checked_claims`)."""
    tables: dict[Path, dict[str, int]] = {}
    out: list[int | None] = []
    claimed: dict[int, Path] = {}  # index in `out` -> the local shard whose count sizes.json gave
    for url in urls:
        path = local_path(url)
        named = path or _pipe_shard(url)
        n = _sizes_table(named.parent, tables).get(named.name) if named is not None else None
        if check_claims and n is not None and named is not None and named.is_file():
            claimed[len(out)] = named
        out.append(int(n) if n is not None else _count_tar(path) if path is not None else None)
    return _checked_claims(out, claimed) if claimed else out


def _sizes_table(folder: Path, tables: dict[Path, dict[str, int]]) -> dict[str, int]:
    if folder not in tables:
        sizes = folder / SIZES_FILE
        tables[folder] = json.loads(sizes.read_text()) if sizes.is_file() else {}
    return tables[folder]


def _checked_claims(sizes: list[int | None], claimed: dict[int, Path]) -> list[int | None]:
    """`sizes` with each count a sizes.json gave for a local shard (`claimed`) replaced by the shard's
    own count, where those shards hold at most SIZES_CHECK_MAX_BYTES: a sizes.json that claims more
    samples than a shard holds would otherwise make an epoch read the data several times over (it is
    what sets the epoch's length); one warning names the file, the claimed and the real count."""
    total = sum(p.stat().st_size for p in claimed.values())
    if total > SIZES_CHECK_MAX_BYTES:
        log.info("sizes.json taken as it is: its %d shards (%.1f GiB) are too large to count at start",
                 len(claimed), total / 2**30)
        return sizes
    real = {i: _count_tar(path) for i, path in claimed.items()}
    wrong = [(claimed[i], sizes[i], n) for i, n in real.items() if n != sizes[i]]
    checked = [real.get(i, n) for i, n in enumerate(sizes)]
    if wrong:
        files = sorted({str(p.parent / SIZES_FILE) for p, _, _ in wrong})
        path, said, held = wrong[0]
        log.warning("%s: claims %d samples for %d shards that hold %d (e.g. %s: %d claimed, %d there); an epoch "
                    "is what the shards hold: %d samples, not %d", ", ".join(files), sum(c for _, c, _ in wrong),
                    len(wrong), sum(h for _, _, h in wrong), path.name, said, held, sum(n or 0 for n in checked),
                    sum(n or 0 for n in sizes))
    return checked


def _pipe_shard(url: str) -> Path | None:
    """The local shard a `pipe:` command reads, when its last `.tar` argument is a path (else None)."""
    if not url.startswith("pipe:"):
        return None
    tars = [t.strip("'\"") for t in url[len("pipe:"):].split() if t.strip("'\"").endswith(".tar")]
    return Path(tars[-1]) if tars else None


def count_samples(urls: str | list[str]) -> int:
    """Total samples in all sources: an epoch's length. A sizes.json is checked against the local
    shards it describes when they are small enough to count at start (`shard_sizes(check_claims=True)`)."""
    flat = check_sources_exist(urls)
    sizes = shard_sizes(flat, check_claims=True)
    missing = [u for u, n in zip(flat, sizes) if n is None]
    if missing:
        raise ValueError(f"cannot count the samples of remote shards {missing[:3]}: no sizes.json beside them "
                         "names them; set data.num_samples (samples per epoch, all ranks together) or put a "
                         "sizes.json ({shard name: samples}) beside the shards")
    return sum(n for n in sizes if n is not None)


def _parse_weights(weights: str | list[float] | None, n_sources: int) -> list[float] | None:
    if weights is None:
        return None
    ws = [float(w) for w in (weights.split("::") if isinstance(weights, str) else weights)]
    if len(ws) != n_sources:
        raise ValueError(f"got {len(ws)} weights for {n_sources} sources")
    if any(w < 0 for w in ws) or sum(ws) <= 0:
        raise ValueError(f"weights must be >= 0 and not all 0, got {ws}")
    return ws


def leave_signals_to_the_trainer(worker_id: int) -> None:
    """A loader worker ignores the signals that stop a run (SIGTERM, SIGUSR1, SIGINT): a scheduler sends
    them to every process of a job, and a worker killed by one would fail the training process's next
    batch before it could save (training/preemption.py); the trainer ends its workers itself. A worker
    whose trainer dies anyway (SIGKILL, the OOM killer) is killed with it (`die_with_the_parent`)."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    die_with_the_parent()


PR_SET_PDEATHSIG = 1   # linux/prctl.h


def die_with_the_parent() -> None:
    """Ask Linux to SIGKILL this process when the thread that started it exits (prctl PR_SET_PDEATHSIG).
    torch's watchdog only notices a lost trainer between batches: a worker blocked on a batch nobody
    reads waits forever, ignoring the stop signals and holding the trainer's stdout open (seen in the
    preemption soak). The loader is iterated from the trainer's main thread, so the parent's exit is
    the trainer's. Elsewhere than Linux: nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:     # the trainer died before the request took effect
        os._exit(1)


def _seed(*parts: object) -> str:
    """A seed for random.Random: strings are hashed with sha512, stable across processes."""
    return ":".join(map(str, parts))


# ----------------------------------------------------------------------------- worker stages


class NoUsableDataError(ValueError):
    """A rank's shards gave no complete batch: every shard unreadable, every sample skipped."""


def _decode(samples: Iterable[dict[str, Any]], preprocess: Callable, max_pixels: int, skips: SkipCounter,
            caption_key: CaptionKey, one_caption: Callable[[dict[str, Any]], str] | None,
            augment: Callable[[Image.Image, str], Any] | None = None):
    """Checked, decoded, preprocessed samples. `one_caption` (training) picks the sample's caption of the
    step; without it (evaluation) every caption stays. `augment` (training): (image, key) -> the transformed image,
    its random draws seeded by the key (data/sample_augment.py); without it `preprocess`, drawing from the global
    RNGs."""
    for sample in samples:
        folded = dotted_keys.folded_samples(sample, IMAGE_EXTS)
        for stem in folded:
            skips.skip(dotted_keys.REASON, sample.get("__url__"), sample.get("__key__"),
                       f"sample {sample.get('__key__')}.{stem}: {dotted_keys.CAUSE}")
        if folded and not any(e in sample for e in IMAGE_EXTS):
            continue  # every sample of the group is counted lost above, not as one without an image
        cached = sample.get(DECODED)  # the decoded-sample cache's (data/decoded_cache.py): a copy, never changed
        good, reason, detail = ((dict(cached[0]) if cached[0] is not None else None, cached[1], cached[2])
                                if cached is not None else check_sample(sample, max_pixels, caption_key=caption_key))
        if good is None:
            skips.skip(reason, sample.get("__url__"), sample.get("__key__"), detail)
            continue
        for _ in range(good.pop("blank_captions")):
            skips.skip("empty_caption_line", sample.get("__url__"), sample.get("__key__"), "a blank caption entry")
        if one_caption is not None:
            good["captions"] = [one_caption(good)]
        # a failure here is a bug, not bad data: raise
        good["image"] = preprocess(good["image"]) if augment is None else augment(good["image"], good["key"])
        yield good


def _collate(samples: list[dict[str, Any]], tokenizer: Callable, skips: SkipCounter) -> dict[str, Any]:
    """A batch; "captions" and "texts" hold every caption of every sample in order, "caption_counts" how
    many each sample has (1 each in training)."""
    captions = [c for s in samples for c in s["captions"]]
    return {
        "images": torch.stack([s["image"] for s in samples]),
        "texts": tokenizer(captions),
        "keys": [s["key"] for s in samples],
        "captions": captions,
        "caption_counts": [len(s["captions"]) for s in samples],
        "metas": [s["meta"] for s in samples],
        "skipped": skips.take(),
    }


def _batched(samples: Iterable[dict[str, Any]], batch_size: int, collate: Callable,
             partial: bool) -> Iterator[dict[str, Any]]:
    """Batches yielded as soon as they are full.

    wds.batched waits for the next sample before yielding a full batch; that one-sample lookahead
    augments a sample before a checkpoint saves the RNG (breaking exact resume with workers=0) and
    pulls the first sample of the next pass at an epoch's end (counting its skips twice).
    """
    batch: list[dict[str, Any]] = []
    for sample in samples:
        batch.append(sample)
        if len(batch) == batch_size:
            yield collate(batch)
            batch = []
    if batch and partial:
        yield collate(batch)


def _split_by_rank(src: Iterable[dict[str, Any]], rank: int, world_size: int) -> Iterator[dict[str, Any]]:
    """wds.split_by_node with an explicit rank, so it works before/without a process group."""
    return islice(src, rank, None, world_size)


class _WeightedShards(IterableDataset):
    """`n` shards drawn with replacement, shard i with probability proportional to weights[i]."""

    def __init__(self, urls: list[str], weights: list[float], n: int, seed: str):
        self.urls, self.weights, self.n, self.seed = urls, weights, n, seed

    def __iter__(self) -> Iterator[dict[str, str]]:
        rng = random.Random(self.seed)
        for url in rng.choices(self.urls, weights=self.weights, k=self.n):
            yield {"url": url}


def _seeded_sample(seeded: SeededAugment, seed: int, epoch: int, rep: int, image: Image.Image, key: str) -> Any:
    """A training sample's transform, its random draws seeded by (seed, epoch, pass, key)."""
    return seeded(image, sample_seed(seed, epoch, rep, key))


def _draw_caption(sample: dict[str, Any], seed: int, epoch: int) -> str:
    return choose_caption(sample["captions"], seed, epoch, sample["key"])


def epoch_order(urls: list[str], shuffle: bool, seed: int, epoch: int, rep: int = 0) -> list[str]:
    """The shard order of one pass; the same on every rank so that the rank split is disjoint."""
    urls = list(urls)
    if shuffle:
        random.Random(_seed(seed, epoch, rep, "shards")).shuffle(urls)
    return urls


def _grouped_samples(sources: Iterable[dict[str, Any]], skips: SkipCounter,
                     cache: DecodedCache | None) -> Iterator[dict[str, Any]]:
    """Each shard's grouped samples: from the decoded-sample cache where it holds the shard, else read from the
    tar (open, members, webdataset's grouping; damage counted in `skips`)."""
    for source in sources:
        cached = cache.shards.get(source["url"]) if cache is not None else None
        if cached is not None:
            yield from cached
            continue
        yield from read_grouped([source], skips)


class _RankStream(IterableDataset):
    """One rank's batches from `streams` sample streams; each DataLoader worker (or the training process, for 0
    workers) runs the streams congruent to its index modulo the workers.

    A sample stream is what a loader worker was: a share of the rank's shards (every `streams`-th of the pass's
    order), its own shuffle buffer and seeds, its own batches. The rank's batches take the streams in turn
    (stream 0, 1, ..., streams - 1, 0, ...), which is also the order in which a DataLoader takes its workers'
    batches when the workers divide the streams. So the batches, their samples and (with the per-sample
    augmentation seeds) their crops are the same for 0, 1 or `streams` workers: where the loader runs is a speed
    choice, not part of the experiment."""

    def __init__(self, urls: list[str], shard_weights: list[float] | None, *, preprocess: Callable,
                 tokenizer: Callable, batch_size: int, num_batches: int | None, resampled: bool,
                 shuffle: bool, shuffle_buffer: int, seed: int, rank: int, world_size: int,
                 drop_last: bool, max_image_pixels: int, log_first: int, caption_key: CaptionKey,
                 all_captions: bool, decoded_cache: DecodedCache | None = None, streams: int = 1):
        self.caption_key, self.all_captions = caption_key, all_captions
        self.decoded_cache = decoded_cache
        self.urls, self.shard_weights = urls, shard_weights
        self.preprocess, self.tokenizer = preprocess, tokenizer
        self.batch_size, self.num_batches = batch_size, num_batches
        self.resampled, self.shuffle, self.shuffle_buffer = resampled, shuffle, shuffle_buffer
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.drop_last, self.max_image_pixels, self.log_first = drop_last, max_image_pixels, log_first
        self.streams = streams
        self.seeded = SeededAugment(preprocess)
        self.epoch = 0
        self.count_shard_damage = True

    def _pass(self, rep: int, stream: int, skips: SkipCounter) -> wds.DataPipeline:
        if self.resampled:  # every rank and stream draws its own shards: no splitting
            weights = self.shard_weights or [1.0] * len(self.urls)
            seed = _seed(self.seed, self.epoch, rep, self.rank, stream, "resample")
            stages: list[Any] = [_WeightedShards(self.urls, weights, len(self.urls), seed)]
        else:
            order = epoch_order(self.urls, self.shuffle, self.seed, self.epoch, rep)
            stages = [wds.SimpleShardList(order),
                      partial(_split_by_rank, rank=self.rank, world_size=self.world_size),
                      partial(_split_by_rank, rank=stream, world_size=self.streams)]
        stages.append(partial(_grouped_samples, skips=skips, cache=self.decoded_cache))
        if self.shuffle and self.shuffle_buffer > 1:
            rng = random.Random(_seed(self.seed, self.epoch, rep, self.rank, stream, "samples"))
            initial = min(self.shuffle_buffer, max(100, self.shuffle_buffer // 4))
            stages.append(wds.shuffle(self.shuffle_buffer, initial=initial, rng=rng))
        training = not self.all_captions
        one_caption = partial(_draw_caption, seed=self.seed, epoch=self.epoch) if training else None
        augment = partial(_seeded_sample, self.seeded, self.seed, self.epoch, rep) if training else None
        stages.append(partial(_decode, preprocess=self.preprocess, max_pixels=self.max_image_pixels,
                              skips=skips, caption_key=self.caption_key, one_caption=one_caption, augment=augment))
        return wds.DataPipeline(*stages)

    def _samples(self, stream: int, skips: SkipCounter) -> Iterator[dict[str, Any]]:
        for rep in count():
            n = 0
            for sample in self._pass(rep, stream, skips):
                n += 1
                yield sample
            if self.num_batches is None or n == 0:  # one-pass mode, or nothing usable left
                return

    def _stream_batches(self, stream: int, skips: SkipCounter) -> Iterator[dict[str, Any]]:
        keep_partial = self.num_batches is None and not self.drop_last
        collate = partial(_collate, tokenizer=self.tokenizer, skips=skips)
        batches = _batched(self._samples(stream, skips), self.batch_size, collate, keep_partial)
        if self.num_batches is None:
            return batches
        share = self.num_batches // self.streams + (stream < self.num_batches % self.streams)
        return islice(batches, share)  # this stream's share of the rank's batches

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        skips = SkipCounter(self.log_first, self.count_shard_damage)
        yield from _in_turn([self._stream_batches(s, skips) for s in range(worker, self.streams, workers)])
        if skips.pending:  # skips after the last batch: report them in a batch-less record
            yield {"images": None, "skipped": skips.take()}


def _in_turn(iterators: list[Iterator[dict[str, Any]]]) -> Iterator[dict[str, Any]]:
    """One item of each iterator in turn, dropping those that end, until all have ended."""
    active = list(iterators)
    while active:
        for it in list(active):
            item = next(it, None)
            if item is None:
                active.remove(it)
            else:
                yield item


# ----------------------------------------------------------------------------- the loader


def _as_collated(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch as `_collate` made it: DataLoader's default (default_convert) would walk every key, caption and
    KEY.json of every batch again to convert what is already converted (15 % of a cached batch's loading)."""
    return batch


class ShardLoader:
    """Iterable over one rank's batches of one epoch; wraps a DataLoader over a webdataset pipeline.

    Each batch: {"images": FloatTensor[B,3,H,W], "texts": LongTensor[T,L], "keys": list[str],
    "captions": list[str] (T: one per sample in training, every caption with `all_captions`),
    "caption_counts": list[int] (per sample), "metas": list[dict | None] (KEY.json), "skipped": {reason: count since the
    previous batch}}. `skip_counts` sums every skip of every epoch in this process; it also holds skips
    that happened after the epoch's last batch, which no batch can carry, so use it (not the per-batch
    sums) for totals.
    """

    def __init__(self, stream: _RankStream, *, workers: int, num_samples: int | None, epoch: int,
                 shard_sizes: list[int | None] | None, seed: int):
        self._stream, self.workers, self.seed = stream, workers, seed
        self.num_samples = num_samples
        self._sizes = shard_sizes
        self.skip_counts: Counter[str] = Counter()
        self.num_batches: int | None = stream.num_batches
        self.set_epoch(epoch)

    @property
    def batch_size(self) -> int:
        return self._stream.batch_size

    def set_epoch(self, epoch: int) -> None:
        """Reseed shard order, resampling and shuffle buffers for `epoch` (takes effect at the next
        `iter()`; workers are not persistent, so they start from this state)."""
        self.epoch = epoch
        self._stream.epoch = epoch
        if self._stream.num_batches is None:
            self.num_batches = self._one_pass_batches(self._stream.rank)

    def _one_pass_batches(self, rank: int) -> int | None:
        """Batches rank `rank` yields in one pass if no sample is skipped (None if sizes unknown)."""
        if self._sizes is None or any(n is None for n in self._sizes):
            return None
        s = self._stream
        size_of = dict(zip(s.urls, self._sizes))
        mine = epoch_order(s.urls, s.shuffle, s.seed, self.epoch)[rank::s.world_size]
        k = max(1, min(s.streams, len(mine)))
        total = 0
        for stream in range(k):
            n = sum(size_of[u] or 0 for u in mine[stream::k])
            total += n // s.batch_size if s.drop_last else math.ceil(n / s.batch_size)
        return total

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("number of batches unknown (remote shards without sizes.json)")
        return self.num_batches

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._stream.epoch = self.epoch
        s = self._stream
        # Seeds the workers' torch/random/numpy RNGs (random augmentations) per (seed, epoch, rank).
        gen = torch.Generator().manual_seed(
            random.Random(_seed(self.seed, self.epoch, s.rank, "torch")).getrandbits(62))
        loader = DataLoader(s, batch_size=None, num_workers=self.workers, generator=gen,
                            pin_memory=torch.cuda.is_available(), persistent_workers=False,
                            worker_init_fn=leave_signals_to_the_trainer, collate_fn=_as_collated)
        n = 0
        carry: Counter[str] = Counter()  # skips a worker reported after its last batch
        for item in loader:
            self.skip_counts.update(item["skipped"])
            if item["images"] is None:
                carry.update(item["skipped"])
                continue
            if carry:
                item["skipped"] = dict(carry + Counter(item["skipped"]))
                carry.clear()
            n += 1
            yield item
        if s.num_batches is not None and n < s.num_batches and s.streams > 1:
            # a stream ran out of usable data (e.g. its only shard is empty): the others' data makes
            # up its share, read again in this process from the start of the rank's shards
            log.warning("rank %d: %d of %d batches from %d sample streams (a stream had no usable data; skips %s); "
                        "reading the rank's shards again for the rest", s.rank, n, s.num_batches, s.streams,
                        dict(self.skip_counts))
            for item in self._top_up(s.num_batches - n):
                if carry:  # the idle worker's skips ride on the first batch that makes up for it
                    item["skipped"] = dict(carry + Counter(item["skipped"]))
                    carry.clear()
                n += 1
                yield item
        if s.num_batches is not None and n < s.num_batches:
            if n == 0:
                raise NoUsableDataError(
                    f"rank {s.rank} yielded 0 of {s.num_batches} batches: no usable data (all its shards "
                    f"unreadable or all samples skipped; skips {dict(self.skip_counts)})")
            log.warning("rank %d: the epoch ends after %d of %d batches: no usable data left (skips %s)",
                        s.rank, n, s.num_batches, dict(self.skip_counts))

    def _top_up(self, missing: int) -> Iterator[dict[str, Any]]:
        """Up to `missing` batches of this rank's shards, read in this process."""
        stream = copy.copy(self._stream)
        stream.num_batches, stream.streams = missing, 1
        stream.count_shard_damage = False  # the workers counted each damaged shard of this epoch already
        for item in stream:
            self.skip_counts.update(item["skipped"])
            if item["images"] is not None:
                yield item


def _workers_for(streams: int, workers: int) -> int:
    """The most workers, up to `workers`, that divide `streams` (each worker then runs as many streams)."""
    usable = max((w for w in range(1, min(workers, streams) + 1) if streams % w == 0), default=0)
    if usable != workers:
        log.warning("%d loader workers for %d sample streams: using %d (the workers must divide the streams; "
                    "data.streams sets them)", workers, streams, usable)
    return usable


def build_clip_loader(
    urls: str | list[str],
    *,
    preprocess: Callable[[Image.Image], torch.Tensor],
    tokenizer: Callable[[list[str]], torch.Tensor],
    batch_size: int,
    num_samples: int | None = None,
    weights: str | list[float] | None = None,
    resampled: bool = False,
    shuffle: bool = True,
    shuffle_buffer: int = 5000,
    workers: int = 0,
    streams: int | None = None,
    seed: int = 0,
    epoch: int = 0,
    rank: int | None = None,
    world_size: int | None = None,
    drop_last: bool = True,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    log_first: int = LOG_FIRST_SKIPS,
    caption_key: str | CaptionKey = TXT,
    all_captions: bool = False,
    decoded_cache: DecodedCache | None = None,
) -> ShardLoader:
    """A loader over image-text shards for one rank.

    urls: brace patterns, several sources joined with '::' (or a list, one pattern per source).
    num_samples: epoch length in samples across all ranks; each rank then yields exactly
        `num_samples // (batch_size * world_size)` full batches (drop_last is implied). None: one
        pass over this rank's shards (not with `resampled`); `num_batches` then comes from
        sizes.json or counting the tars, and is an upper bound if samples get skipped.
    weights: per-source upsampling factors like open_clip's `--train-data-upsampling-factors`
        ('1::2'): every shard of source i is drawn with probability proportional to weights[i];
        needs `resampled=True`.
    resampled: draw shards with replacement (each rank and worker independently).
    workers: DataLoader worker processes; each runs the sample streams congruent to its index. Workers
        that do not divide `streams` are lowered to the largest count that does (with a warning).
    streams: sample streams of the rank (`_RankStream`: each a share of the rank's shards with its own
        shuffle buffer, the batches taken from the streams in turn); None: one per worker (at least one).
        Without resampling each stream needs its own shards: with fewer shards per rank than streams the
        stream count is lowered (with a warning); fewer shards than ranks is a ValueError. The batches
        are the same for any `workers` that divides `streams`.
    rank, world_size: default to torch.distributed when initialised, else 0 and 1.
    max_image_pixels: larger images are skipped as `image_too_large` before decoding.
    log_first: skips logged per reason, worker and epoch (all are counted).
    caption_key: where captions are read (magclip.data.captions: `txt`, one a line, or `json:FIELD`).
    all_captions: every caption of a sample in the batch (evaluation; `caption_counts` says how many per
        sample); else one caption per sample, drawn per (seed, epoch, key) where a sample has several.
    decoded_cache: shards already read and decoded (magclip.data.decoded_cache.fill): the same batches, without
        reading or decoding those shards again, nor (with 0 workers) tokenizing a caption twice.

    Deterministic given (seed, epoch, rank, streams) for the sample order. In training (one caption a sample)
    each sample's random augmentation in `preprocess` is seeded by (seed, epoch, pass, key), so its crop does
    not depend on the workers either (data/sample_augment.py).
    """
    rank = distributed.rank() if rank is None else rank
    world_size = distributed.world_size() if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} not in [0, {world_size})")
    one_per_worker = streams is None
    streams = max(1, workers) if one_per_worker else streams
    if batch_size < 1 or workers < 0 or streams < 1:
        raise ValueError(f"batch_size and streams must be >= 1 and workers >= 0, got {batch_size}, {streams}, "
                         f"{workers}")
    sources = expand_sources(urls)  # once: the per-source lists weight the sources below
    flat = [u for source in sources for u in source]
    check_shards_exist(flat)
    source_weights = _parse_weights(weights, len(sources))
    if source_weights is not None and not resampled:
        raise ValueError("weights need resampled=True (without resampling every shard is read once per pass)")
    shard_weights = [w for src, w in zip(sources, source_weights) for _ in src] if source_weights else None

    sizes: list[int | None] | None = None
    if num_samples is None:
        if resampled:
            raise ValueError("resampled=True needs num_samples (a resampled stream has no end)")
        num_batches = None
        sizes = shard_sizes(flat)
        known = None if any(n is None for n in sizes) else sum(n or 0 for n in sizes)
    else:
        num_batches = num_samples // (batch_size * world_size)
        if num_batches < 1:
            raise ValueError(f"num_samples={num_samples} is less than one global batch "
                             f"({batch_size} x {world_size} ranks)")
        known = num_samples

    if not resampled:
        per_rank = len(flat) // world_size  # the fewest shards any rank gets
        if per_rank < 1:
            raise ValueError(f"{len(flat)} shards cannot be split over {world_size} ranks: need at least "
                             f"{world_size} shards (or resampled=True)")
        mine = len(range(rank, len(flat), world_size))
        if streams > mine:
            log.warning("%d shards for rank %d (of %d shards, %d ranks) cannot feed %d %s: using %d", mine, rank,
                        len(flat), world_size, streams, "workers" if one_per_worker else "sample streams", mine)
            streams = mine
    workers = min(workers, streams) if one_per_worker else _workers_for(streams, workers)

    if decoded_cache is not None and workers == 0:
        # the same captions every epoch: their tokens are kept beside the samples (a worker's memo would end with
        # the worker at the epoch's end)
        tokenizer = decoded_cache.tokenizer(tokenizer)
    stream = _RankStream(flat, shard_weights, preprocess=preprocess, tokenizer=tokenizer,
                         batch_size=batch_size,
                         num_batches=num_batches, resampled=resampled, shuffle=shuffle,
                         shuffle_buffer=shuffle_buffer, seed=seed, rank=rank, world_size=world_size,
                         drop_last=drop_last, max_image_pixels=max_image_pixels, log_first=log_first,
                         caption_key=CaptionKey(caption_key) if isinstance(caption_key, str) else caption_key,
                         all_captions=all_captions, decoded_cache=decoded_cache, streams=streams)
    loader = ShardLoader(stream, workers=workers, num_samples=known, epoch=epoch, shard_sizes=sizes,
                         seed=seed)
    if num_batches is None and world_size > 1:
        counts = {r: loader._one_pass_batches(r) for r in range(world_size)}
        if len(set(counts.values())) > 1:
            log.warning("one pass gives ranks different batch counts %s; pass num_samples for distributed "
                        "training", counts)
    return loader
