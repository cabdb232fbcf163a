"""Training samples kept decoded in memory, so that the epochs after the first skip reading and decoding.

Why: on a training set that fits memory the loader's work per epoch is mostly Python tar parsing, grouping
and image decoding, repeated identically every epoch, on the cores the training step needs (the main job's
profile: benchmarks/README.md). The cache holds, per shard, what the reader's stages give (the grouped samples)
with each sample's check and decode already done (`shard_reader.check_sample`: the RGB image before augmentation, the
captions, KEY.json, or the skip reason). Everything after -- shard order, rank and worker split, shuffle buffer,
augmentation, caption draw, tokenizer, collation -- runs as before, so the batches are the same, bit for bit,
and so are the skip counts. A shard with damage (unreadable, corrupt, a member webdataset cannot group, a
key with a dot) is not cached: it is read, and its damage counted, every epoch as before.

The rule (`data.cache`, README "Decoded-sample cache"): `auto` keeps the decoded set when the run reads
its training shards more than once and without resampling, and the set fits `data.cache_max_mb` (default:
a tenth of the machine's memory, shared by the node's processes, at most 4 GiB each); filling stops, and the
run reads as before, the moment it would not fit. `true` keeps it whatever the passes (still within the
budget), `false` never. Loader workers are forked from the process that filled it and share its pages.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from magclip.data import dotted_keys
from magclip.data.captions import CaptionKey
from magclip.data.shard_reader import SkipCounter, check_sample, read_grouped
from magclip.data.shard_start import IMAGE_EXTS
from magclip.data.token_memo import TokenMemo
from magclip.data.urls import expand_sources

log = logging.getLogger("magclip.data")

DECODED = "__decoded__"   # a cached grouped sample's (checked sample or None, skip reason, detail)
MAX_DEFAULT_MB = 4096
SAMPLE_OVERHEAD_BYTES = 1024  # the Python objects around one cached sample (dicts, strings, the image header)


@dataclass
class DecodedCache:
    """Per shard URL, its grouped samples with their decode done (see module docstring)."""

    shards: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    nbytes: int = 0
    samples: int = 0
    seconds: float = 0.0
    budget_bytes: int = 0
    memos: dict[int, TokenMemo] = field(default_factory=dict)  # by id() of the tokenizer each memo holds

    def tokenizer(self, tokenizer: Callable[[list[str]], Any]) -> TokenMemo:
        """`tokenizer` with a memo of the captions' tokens that lasts as long as the cache (every epoch's loader)."""
        memo = self.memos.get(id(tokenizer))
        if memo is None or memo.tokenizer is not tokenizer:
            room = self.budget_bytes - self.nbytes - sum(m.nbytes for m in self.memos.values())
            memo = self.memos[id(tokenizer)] = TokenMemo(tokenizer, max(0, room))
        return memo

    def summary(self) -> str:
        return (f"{self.samples} decoded training samples of {len(self.shards)} shards kept in memory "
                f"({self.nbytes / 2**20:.1f} MiB, filled in {self.seconds:.1f} s): later epochs skip reading and decoding")


def default_budget_mb() -> int:
    """A tenth of the machine's memory, shared by this node's processes, at most MAX_DEFAULT_MB each."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
    processes = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return min(MAX_DEFAULT_MB, int(total / 10 / processes / 2**20))


def cache_wanted(setting: bool | str, passes: float | None, resampled: bool) -> tuple[bool, str]:
    """(fill the cache?, why) by the rule in the module docstring for `data.cache` (auto, True, False); `passes`:
    reads of the training set the run makes (None: unknown)."""
    if setting is False:
        return False, "data.cache=false"
    if resampled:
        return False, "data.resampled: shards are drawn, not read in passes"
    if setting is True:
        return True, "data.cache=true"
    if passes is None or passes <= 1:
        return False, ("the run reads its training shards once" if passes is not None else
                       "data.num_samples sets the epoch, so the passes over the shards are unknown: data.cache=true keeps them")
    return True, f"the run reads its training shards {passes:.1f} times"


def sample_bytes(decoded: tuple[dict[str, Any] | None, str, str]) -> int:
    """Memory one cached sample holds: its image's pixels (PIL keeps RGB in 4 bytes), captions, KEY.json."""
    good = decoded[0]
    if good is None:
        return SAMPLE_OVERHEAD_BYTES
    w, h = good["image"].size
    captions = sum(len(c.encode()) for c in good["captions"] or [])
    meta = len(repr(good["meta"])) if good["meta"] else 0
    return SAMPLE_OVERHEAD_BYTES + 4 * w * h + captions + meta


class _OverBudget(Exception):
    """The decoded set passed the budget while a shard was being read."""


def _cached_shard(url: str, max_pixels: int, caption_key: CaptionKey,
                  room: int) -> tuple[list[dict[str, Any]] | None, int]:
    """(the shard's grouped samples with their decode, bytes) or (None, 0) when the shard has damage; raises
    _OverBudget as soon as its samples take more than `room` bytes."""

    skips = SkipCounter(log_first=0)
    out, nbytes = [], 0
    for sample in read_grouped([{"url": url}], skips):
        if dotted_keys.folded_samples(sample, IMAGE_EXTS):
            return None, 0
        decoded = check_sample(sample, max_pixels, caption_key=caption_key)  # the image comes decoded (convert)
        out.append({"__key__": sample.get("__key__"), "__url__": sample.get("__url__"), DECODED: decoded})
        nbytes += sample_bytes(decoded)
        if nbytes > room:
            raise _OverBudget
    if skips.take():
        return None, 0
    return out, nbytes


def fill(urls: str | list[str], *, max_pixels: int, caption_key: CaptionKey, budget_mb: int) -> DecodedCache | None:
    """Every shard of `urls` (brace patterns, sources joined by '::', as the loader takes them) read and decoded once,
    in this process; None (logged) when the set passes the budget."""
    t0 = time.perf_counter()
    urls = [u for source in expand_sources(urls) for u in source]
    budget = budget_mb * 2**20
    cache = DecodedCache(budget_bytes=budget)
    for i, url in enumerate(urls):
        try:
            samples, nbytes = _cached_shard(url, max_pixels, caption_key, budget - cache.nbytes)
        except _OverBudget:
            log.info("decoded-sample cache off: the decoded set passes data.cache_max_mb=%d while reading shard %d "
                     "of %d; reading every epoch from the shards", budget_mb, i + 1, len(urls))
            return None
        if samples is None:
            continue  # damaged: read from the tar every epoch, its damage counted there
        cache.shards[url] = samples
        cache.nbytes += nbytes
        cache.samples += len(samples)
    cache.seconds = time.perf_counter() - t0
    log.info("%s", cache.summary())
    return cache
