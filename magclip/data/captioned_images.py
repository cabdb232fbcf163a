"""Image files with their captions, listed by a caption file: what a Karpathy split file
(magclip.data.karpathy) and COCO's own caption file (magclip.data.coco_captions) both become once read.

Each image is scored once with every one of its captions (relevance by image, CLIP_benchmark's
`texts_image_index`). An image a file lists more than once is scored once with the captions of every
listing, in file order, as CLIP_benchmark's readers group captions by image (torchvision's `CocoCaptions`
by image id, its Flickr reader by file name); such listings are counted (`merged_duplicates`), logged and
recorded, never scored twice without a word. An image left out is counted by reason (`skipped`): one
without a non-empty caption (`empty_caption`), one whose file is not there (`missing_image`, the first
few named in the log).
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

LOG_FIRST = 5


@dataclass
class CaptionedImage:
    path: Path            # the image file
    key: str              # the image as the caption file names it
    captions: list[str]


@dataclass
class CaptionedImages:
    """Images found under `images`, each with its captions: what `iter_batches` encodes."""

    source: Path
    images: Path
    split: str | None
    items: list[CaptionedImage]
    skipped: Counter = field(default_factory=Counter)  # images left out at opening, by reason
    blank_captions: int = 0                           # empty captions left out of kept images
    merged_duplicates: int = 0                        # listings of an image already listed, merged into it
    _listed: dict[str, tuple[list[str], list[Path]]] = field(default_factory=dict, repr=False)  # key -> (captions, files)

    def __len__(self) -> int:
        return len(self.items)

    @property
    def what(self) -> str:
        """The set in words, for logs and errors."""
        return f"{self.source} split {self.split}" if self.split else str(self.source)

    def add(self, key: str, captions: list[str], candidates: list[Path]) -> None:
        """One listing of an image (`candidates`: where its file may be); a later listing of the same key is
        merged into the first. `finish` then finds the files."""
        listed = self._listed.get(key)
        if listed is not None:
            self.merged_duplicates += 1
            listed[0].extend(captions)
            return
        self._listed[key] = (list(captions), candidates)

    def finish(self) -> None:
        """After every listing was added: each image kept where one of its candidate files is there, else
        counted (no caption, no file); an error where no image was found, else the log's account of what
        was left out or merged."""
        for key, (captions, candidates) in self._listed.items():
            if not captions:
                self.skip("empty_caption", key)
                continue
            path = next((p for p in dict.fromkeys(candidates) if p.is_file()), None)
            if path is None:
                self.skip("missing_image", key)
                continue
            self.items.append(CaptionedImage(path, key, captions))
        listed = len(self._listed)
        if not self.items:
            raise FileNotFoundError(f"{self.source}: none of the {listed} images{self._of_split} was found under "
                                    f"{self.images} (skipped: {dict(self.skipped)}); pass the images folder with "
                                    "--images / images:")
        if self.skipped:
            log.warning("%s: %d of %d images left out: %s", self.what, sum(self.skipped.values()), listed,
                        dict(self.skipped))
        if self.merged_duplicates:
            log.warning("%s: %s", self.what, self.duplicates_note())

    def skip(self, reason: str, key: str) -> None:
        self.skipped[reason] += 1
        if self.skipped[reason] <= LOG_FIRST:
            log.warning("skipped %s: %s image %s (under %s)", reason, self.source.name, key, self.images)

    @property
    def _of_split(self) -> str:
        return f" of split {self.split!r}" if self.split else ""

    def duplicates_note(self) -> str:
        return (f"{self.merged_duplicates} listings of an image already listed: each image is scored once with "
                "the captions of all its listings, as CLIP_benchmark groups captions by image")

    def describe(self) -> dict[str, object]:
        """What results.json records about how the file was read."""
        return {"images": str(self.images),
                **({"merged_duplicate_images": self.merged_duplicates} if self.merged_duplicates else {})}

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


def is_json_file(path: str | Path) -> bool:
    """A .json file (its layout is told from its keys when it is read)."""
    path = Path(path).expanduser()
    return path.is_file() and path.suffix.lower() == ".json"


def read_json(source: Path) -> Any:
    try:
        return json.loads(source.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exn:
        raise ValueError(f"{source}: not valid JSON ({exn})") from None


def clean_captions(raw: list[Any]) -> tuple[list[str], int]:
    """(the non-empty strings, stripped; how many were empty or not text)."""
    captions = [r.strip() for r in raw if isinstance(r, str) and r.strip()]
    return captions, len(raw) - len(captions)
