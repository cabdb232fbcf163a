"""Karpathy's split files over a folder of images: the COCO 5k and Flickr30k 1k test sets most CLIP
papers report retrieval on.

    dataset_coco.json / dataset_flickr30k.json / dataset_flickr8k.json:
    {"dataset": "coco", "images": [{"filepath": "val2014", "filename": "COCO_val2014_000000391895.jpg",
                                    "split": "test", "sentences": [{"raw": "A man with a red helmet ...",
                                                                    "tokens": [...]}, ...], ...}, ...]}

The images of a split are `IMAGES/filepath/filename` (COCO) or `IMAGES/filename` (Flickr, which has no
filepath); IMAGES defaults to the JSON file's folder. Each image's captions are its sentences' `raw` text
(the original sentence; `tokens` are Karpathy's lower-cased tokens for captioning metrics), every
caption kept: scored by image, image->text is a hit when any of its five captions is in the top k.

Bad input is named or counted: a file that is not this layout, or a split that is not in it (the splits
that are are listed with their sizes), is a ValueError naming the file; an image without a non-empty
sentence is left out and counted (`empty_caption`), as is one whose file is not there (`missing_image`,
the first few named in the log); a set where no image is found is an error naming the folder searched.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("magclip.data")

DEFAULT_SPLIT = "test"
LOG_FIRST = 5


@dataclass
class KarpathyItem:
    path: Path            # the image file
    key: str              # filepath/filename, as the JSON names it
    captions: list[str]


@dataclass
class KarpathySet:
    """One split of a Karpathy JSON, its images found: what `iter_batches` encodes."""

    source: Path
    images: Path
    split: str
    items: list[KarpathyItem]
    skipped: Counter = field(default_factory=Counter)  # images left out at opening, by reason
    blank_captions: int = 0                           # empty sentences left out of kept images

    def __len__(self) -> int:
        return len(self.items)

    @classmethod
    def open(cls, source: str | Path, images: str | Path | None = None, split: str | None = None) -> KarpathySet:
        source = Path(source).expanduser()
        root = Path(images).expanduser() if images else source.parent
        split = split or DEFAULT_SPLIT
        entries = _read_entries(source)
        sizes = Counter(str(e.get("split")) for e in entries)
        chosen = [e for e in entries if str(e.get("split")) == split]
        if not chosen:
            listed = ", ".join(f"{name} ({n})" for name, n in sorted(sizes.items()))
            raise ValueError(f"{source}: no image of split {split!r}; its splits are {listed} (choose one with "
                             "--split / split:)")
        out = cls(source, root, split, [])
        for i, entry in enumerate(chosen):
            item = out._item(entry, i)
            if item is not None:
                out.items.append(item)
        if not out.items:
            raise FileNotFoundError(f"{source}: none of the {len(chosen)} images of split {split!r} was found under "
                                    f"{root} (skipped: {dict(out.skipped)}); pass the images folder with --images / images:")
        if out.skipped:
            log.warning("%s split %s: %d of %d images left out: %s", source, split, sum(out.skipped.values()),
                        len(chosen), dict(out.skipped))
        return out

    def _item(self, entry: dict[str, Any], index: int) -> KarpathyItem | None:
        name = entry.get("filename")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.source}: image {index} of split {self.split!r} has no filename")
        key = "/".join(p for p in (entry.get("filepath"), name) if isinstance(p, str) and p)
        captions, blank = _captions(entry.get("sentences"))
        self.blank_captions += blank
        if not captions:
            return self._skip("empty_caption", key)
        for path in dict.fromkeys((self.images / key, self.images / name)):
            if path.is_file():
                return KarpathyItem(path, key, captions)
        return self._skip("missing_image", key)

    def _skip(self, reason: str, key: str) -> None:
        self.skipped[reason] += 1
        if self.skipped[reason] <= LOG_FIRST:
            log.warning("skipped %s: %s image %s (under %s)", reason, self.source.name, key, self.images)

    def iter_batches(self, preprocess: Callable, tokenizer: Callable, batch_size: int, skipped: Counter, *,
                     workers: int = 0, max_image_pixels: int | None = None) -> Iterator[dict[str, Any]]:
        """Batches in the shard loader's evaluation form ({"images", "texts", "keys", "captions",
        "caption_counts", "metas"}), in file order; undecodable images are counted in `skipped`."""
        import torch

        from magclip.data.image_folder import read_image_batches

        skipped.update(self.skipped)
        if self.blank_captions:
            skipped["empty_caption_line"] += self.blank_captions
        for good in read_image_batches([item.path for item in self.items], preprocess, batch_size, skipped,
                                       workers=workers, max_image_pixels=max_image_pixels):
            items = [self.items[i] for i, _ in good]
            captions = [c for item in items for c in item.captions]
            yield {"images": torch.stack([image for _, image in good]), "texts": tokenizer(captions),
                   "keys": [item.key for item in items], "captions": captions,
                   "caption_counts": [len(item.captions) for item in items], "metas": [None] * len(items)}


def is_karpathy_file(path: str | Path) -> bool:
    """A .json file (the layout itself is checked when it is opened)."""
    path = Path(path).expanduser()
    return path.is_file() and path.suffix.lower() == ".json"


def _read_entries(source: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(source.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exn:
        raise ValueError(f"{source}: not valid JSON ({exn})") from None
    images = data.get("images") if isinstance(data, dict) else None
    if not isinstance(images, list) or not all(isinstance(e, dict) for e in images) or \
            not any("sentences" in e for e in images):
        raise ValueError(f"{source}: not a Karpathy split file (expected {{\"images\": [{{\"filename\", \"split\", "
                         "\"sentences\": [{\"raw\": ...}]}, ...]}, as dataset_coco.json / dataset_flickr30k.json)")
    return images


def _captions(sentences: Any) -> tuple[list[str], int]:
    """(the non-empty `raw` sentences, stripped; how many were empty)."""
    raw = [s.get("raw") if isinstance(s, dict) else s for s in sentences or []]
    captions = [r.strip() for r in raw if isinstance(r, str) and r.strip()]
    return captions, len(raw) - len(captions)
