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
An image the split lists twice is scored once with the sentences of both entries, counted and said
(magclip.data.captioned_images: CLIP_benchmark groups captions by image).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from magclip.data.captioned_images import CaptionedImages, clean_captions, is_json_file, read_json

DEFAULT_SPLIT = "test"


class KarpathySet(CaptionedImages):
    """One split of a Karpathy JSON, its images found."""

    @classmethod
    def open(cls, source: str | Path, images: str | Path | None = None, split: str | None = None) -> KarpathySet:
        source = Path(source).expanduser()
        return cls.from_data(source, read_json(source), images, split)

    @classmethod
    def from_data(cls, source: Path, data: Any, images: str | Path | None = None,
                  split: str | None = None) -> KarpathySet:
        """The split of `data` (the file's parsed JSON)."""
        root = Path(images).expanduser() if images else source.parent
        split = split or DEFAULT_SPLIT
        entries = _entries(source, data)
        sizes: dict[str, int] = {}
        for e in entries:
            sizes[str(e.get("split"))] = sizes.get(str(e.get("split")), 0) + 1
        chosen = [e for e in entries if str(e.get("split")) == split]
        if not chosen:
            listed = ", ".join(f"{name} ({n})" for name, n in sorted(sizes.items()))
            raise ValueError(f"{source}: no image of split {split!r}; its splits are {listed} (choose one with "
                             "--split / split:)")
        out = cls(source, root, split, [])
        for i, entry in enumerate(chosen):
            name = entry.get("filename")
            if not isinstance(name, str) or not name:
                raise ValueError(f"{source}: image {i} of split {split!r} has no filename")
            key = "/".join(p for p in (entry.get("filepath"), name) if isinstance(p, str) and p)
            sentences = entry.get("sentences") or []
            captions, blank = clean_captions([s.get("raw") if isinstance(s, dict) else s for s in sentences])
            out.blank_captions += blank
            out.add(key, captions, [root / key, root / name])
        out.finish()
        return out


def is_karpathy_file(path: str | Path) -> bool:
    """A .json file (the layout itself is checked when it is opened)."""
    return is_json_file(path)


def is_karpathy_data(data: Any) -> bool:
    """A parsed JSON of this layout: {"images": [{..., "sentences": ...}, ...]}."""
    images = data.get("images") if isinstance(data, dict) else None
    return isinstance(images, list) and all(isinstance(e, dict) for e in images) and \
        any("sentences" in e for e in images)


def _entries(source: Path, data: Any) -> list[dict[str, Any]]:
    if not is_karpathy_data(data):
        raise ValueError(f"{source}: not a Karpathy split file (expected {{\"images\": [{{\"filename\", \"split\", "
                         "\"sentences\": [{\"raw\": ...}]}, ...]}, as dataset_coco.json / dataset_flickr30k.json)")
    return data["images"]
