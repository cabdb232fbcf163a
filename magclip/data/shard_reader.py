"""A shard's samples as the loader and the evaluation read them: tar members (damage detected, not taken for the
archive's end), webdataset's grouping into samples, the one set of checks of a sample (captions, image decode,
KEY.json), and the counter of what is skipped and why.

Below the loader (data/shards.py) and the decoded-sample cache (data/decoded_cache.py), which both read shards
through it: the cache fills from the same reader the loader would use, without either importing the other.
"""

from __future__ import annotations

import io
import json
import logging
import re
import tarfile
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from PIL import Image
from webdataset.tariterators import group_by_keys, url_opener

from magclip.data import dotted_keys
from magclip.data.captions import DEFAULT_CAPTION_KEY, CaptionKey
from magclip.data.shard_start import IMAGE_EXTS

log = logging.getLogger("magclip.data")

SKIP_REASONS = (
    "unreadable_shard",  # the shard could not be opened (per shard)
    "corrupt_tar",  # garbage or truncated tar; samples before the damage are kept (per shard)
    "pipe_failed",  # a pipe: shard's command exited with an error; samples it sent are kept (per shard)
    "bad_member",  # a member webdataset could not group, e.g. a duplicate name in one sample
    "missing_image",
    dotted_keys.REASON,  # a whole sample folded into another: its key holds a dot (one count per sample lost)
    "missing_caption",
    "bad_caption_encoding",  # caption is not UTF-8
    "empty_caption",  # empty or whitespace only
    "empty_caption_line",  # a blank line of a multi-caption KEY.txt (counts caption entries; the sample stays)
    "image_too_large",  # more pixels than max_image_pixels (checked from the header, before decoding)
    "undecodable_image",  # PIL cannot decode it (garbage, truncated, zero bytes)
)
SHARD_REASONS = ("unreadable_shard", "corrupt_tar", "pipe_failed")  # counted once per shard and epoch
LOG_FIRST_SKIPS = 5  # skips logged per reason (every one is counted)
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485  # PIL's Image.MAX_IMAGE_PIXELS default
_META = re.compile(r"(^|/)__[^/]*__($|/)")  # webdataset's metadata members, not samples


class _StrictTarInfo(tarfile.TarInfo):
    """tarfile ends an archive silently at an invalid header after the first member (a bad
    checksum looks like the end); this raises instead, so the damage is counted."""

    @classmethod
    def fromtarfile(cls, tar: tarfile.TarFile) -> tarfile.TarInfo:
        try:
            return super().fromtarfile(tar)
        except tarfile.InvalidHeaderError as exn:
            raise tarfile.SubsequentHeaderError(f"invalid header at byte {tar.offset}: {exn}") from None


def tar_members(fileobj: Any) -> Iterator[tuple[str, Callable[[], bytes]]]:
    """(name, read) for each regular non-metadata member of a tar stream; raises on damage.

    tarfile alone treats a file cut at a header boundary, or a corrupt header after the first
    member, as a normal end. A proper end is a zero block after the last member, which tarfile
    has read (pos >= offset + 512) when it stops; a corrupt header raises (`_StrictTarInfo`)."""
    tar = tarfile.open(fileobj=fileobj, mode="r|*", tarinfo=_StrictTarInfo)
    for info in tar:
        if info.isreg() and not _META.search(info.name):
            yield info.name, tar.extractfile(info).read  # type: ignore[union-attr]
        tar.members = []  # stream mode would otherwise keep every header
    if tar.fileobj.pos < tar.offset + tarfile.BLOCKSIZE:  # type: ignore[union-attr]
        raise tarfile.ReadError(f"truncated: no end-of-archive block after byte {tar.offset}")




class SkipCounter:
    """Counts and logs skipped samples inside one worker; `take()` hands them to the next batch."""

    def __init__(self, log_first: int, count_shards: bool = True):
        self.count_shards = count_shards  # False: shard damage was counted by another reader this epoch
        self.pending: Counter[str] = Counter()
        self.seen: Counter[str] = Counter()
        self.log_first = log_first
        self.damaged: set[tuple[str, str | None]] = set()  # (reason, url) of shard-level skips, this epoch

    def skip(self, reason: str, url: str | None, key: str | None, detail: object = "") -> None:
        if reason in SHARD_REASONS:  # a shard read again (a fixed-length epoch's next pass) is one damage
            if (reason, url) in self.damaged or not self.count_shards:
                return
            self.damaged.add((reason, url))
        self.pending[reason] += 1
        self.seen[reason] += 1
        if self.seen[reason] <= self.log_first:
            last = self.seen[reason] == self.log_first
            more = " (further skips for this reason are counted, not logged)" if last else ""
            where = f"shard {url}" + (f" key {key}" if key is not None else "")
            log.warning("skipped %s: %s: %s%s", reason, where, str(detail)[:200], more)

    def take(self) -> dict[str, int]:
        out = dict(self.pending)
        self.pending.clear()
        return out

    def open_failed(self, exn: Exception) -> bool:
        url = next((a for a in reversed(exn.args) if isinstance(a, str)), None)
        self.skip("unreadable_shard", url, None, exn)
        return True

    def bad_member(self, exn: Exception) -> bool:
        url = next((a for a in reversed(exn.args[1:]) if isinstance(a, str)), None)
        self.skip("bad_member", url, None, exn.args[0] if exn.args else exn)
        return True




def _tar_members(sources: Iterable[dict[str, Any]], skips: SkipCounter) -> Iterator[dict[str, Any]]:
    """Members of each opened tar as {fname, data, __url__}, then {} (webdataset's end-of-shard).

    A tar that is garbage, cut inside a member, or cut at a header boundary (which tarfile
    treats as a normal end) counts one `corrupt_tar`; members read before the damage are kept.
    """
    for source in sources:
        url, stream = source["url"], source["stream"]
        damage, finished = None, False
        try:
            for name, read in tar_members(stream):
                # "url" too: webdataset's group_by_keys appends it to a grouping error's args
                yield {"fname": name, "data": read(), "__url__": url, "url": url}
            finished = True
        except Exception as exn:
            damage = f"{type(exn).__name__}: {exn}"
        finally:
            try:  # a pipe: URL reports its command's exit status here
                stream.close()
            except Exception as exn:
                if finished or damage is not None:  # not when closed early on purpose (the consumer stopped)
                    # a failed command explains a damaged stream: it is the one reason counted
                    damage = None
                    reason = "pipe_failed" if url.startswith("pipe:") else "unreadable_shard"
                    skips.skip(reason, url, None, f"{type(exn).__name__}: {exn}")
            if damage is not None:
                skips.skip("corrupt_tar", url, None, damage)
        yield {}


def read_grouped(sources: Iterable[dict[str, Any]], skips: SkipCounter) -> Iterator[dict[str, Any]]:
    """The grouped samples of the shards `sources` name ({"url": ...}), in order: open, tar members, webdataset's
    grouping; unreadable and damaged shards and members webdataset cannot group are counted in `skips`."""
    opened = url_opener(sources, handler=skips.open_failed)
    return group_by_keys(_tar_members(opened, skips), handler=skips.bad_member)


def iter_tar_samples(urls: list[str], skipped: Counter) -> Iterator[tuple[str, str, dict[str, bytes]]]:
    """(shard url, key, {ext: bytes}) per sample, shard by shard in order, in one process (evaluation):
    the training reader's stages (open, members, grouping), so unreadable and damaged shards and
    duplicate members are skipped, logged and counted alike; counts go to `skipped` as they happen."""
    skips = SkipCounter(log_first=LOG_FIRST_SKIPS)
    for sample in read_grouped([{"url": u} for u in urls], skips):
        skipped.update(skips.take())
        yield sample["__url__"], sample["__key__"], {k: v for k, v in sample.items() if not k.startswith("__")}
    skipped.update(skips.take())


def load_image(data: bytes, max_pixels: int) -> tuple[Image.Image | None, str, str]:
    """(RGB image, "", "") or (None, reason, detail). The size comes from the header, so a
    decompression bomb is refused before any pixel is decoded."""
    if not data:
        return None, "undecodable_image", "zero bytes"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DecompressionBombWarning, palette transparency notes
        try:
            img = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as exn:  # beyond PIL's own global limit
            return None, "image_too_large", str(exn)
        except Exception as exn:
            return None, "undecodable_image", f"{type(exn).__name__}: {exn}"
        w, h = img.size
        if w * h > max_pixels:
            return None, "image_too_large", f"{w}x{h} > {max_pixels} pixels"
        try:
            return img.convert("RGB"), "", ""
        except Exception as exn:
            return None, "undecodable_image", f"{type(exn).__name__}: {exn}"


def check_sample(sample: dict[str, Any], max_pixels: int, caption: bool = True,
                 caption_key: CaptionKey = DEFAULT_CAPTION_KEY) -> tuple[dict[str, Any] | None, str, str]:
    """Validate one grouped sample: ({key, captions, image, meta, blank_captions}, "", "") or (None, reason,
    detail), the one set of sample checks of training and evaluation. `captions`: every caption the sample
    has (magclip.data.captions: KEY.txt one a line, or a KEY.json field), `blank_captions`: the blank entries
    left out. `caption=False` (classification only) skips the caption checks and gives captions None. Cheap
    caption checks come before decoding."""
    ext = next((e for e in IMAGE_EXTS if e in sample), None)
    if ext is None:
        return None, "missing_image", f"members: {sorted(k for k in sample if not k.startswith('__'))}"
    captions, blank = None, 0
    if caption:
        captions, reason, detail, blank = caption_key.read(sample)
        if captions is None:
            return None, reason, detail
    img, reason, detail = load_image(sample[ext], max_pixels)
    if img is None:
        return None, reason, detail
    return {"key": sample.get("__key__"), "captions": captions, "image": img, "meta": sample_meta(sample),
            "blank_captions": blank}, "", ""


def sample_meta(sample: dict[str, Any]) -> dict[str, Any] | None:
    """The sample's KEY.json as a dict (img2dataset's metadata, the synthetic scenes' caption_detail and
    num_objects), None when it has none or it is not a JSON object: optional, so never a reason to skip."""
    raw = sample.get("json")
    if raw is None:
        return None
    try:
        meta = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return meta if isinstance(meta, dict) else None
