"""Image folders as torchvision's `ImageFolder` reads them (ROOT/<class>/<image>.png): the layout
CLIP_benchmark's `--dataset_root` points at, a classification set that needs no shards.

Why torchvision's reader rather than a walk of our own: the class order (sorted folder names ->
label index), the image extensions and the error for an empty class folder are ImageFolder's, so
labels and per-class results line up with what torchvision and CLIP_benchmark users get. Images
are decoded with the shard reader's `load_image` (same pixel limit, same skip reasons): an
undecodable, oversized or unreadable image is skipped, counted and logged, never fatal.

Class names: the folder names with underscores as spaces (`golden_retriever` -> "golden retriever"),
or a class list: plain names are matched to the folders in order (CLIP_benchmark's rule: its
class-name lists follow ImageFolder's sorted folders), a keyed list (`key_field`, or a JSON
{key: name} dict) by folder name.

A folder of .tar shards is not an image folder: it stands for its shards (`magclip.data.urls`).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from magclip.data.classes import ClassSet
from magclip.data.urls import local_path

# torch, torchvision and the shard reader are imported where used: a command tells a folder's layout
# apart (`resolve_image_folder`) before it loads anything heavy

log = logging.getLogger("magclip.data")

LAYOUT = "class sub-folders of images, DIR/<class>/<image>.png, as torchvision's ImageFolder reads them"


# torchvision.datasets.folder.IMG_EXTENSIONS, copied so that a command tells a folder's layout apart
# without importing torch (a test keeps the copy equal to torchvision's)
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def resolve_image_folder(urls: str | list[str], where: str = "data") -> Path | None:
    """The folder when `urls` names a local image folder; None for shards (files, brace patterns,
    remote URLs, a folder holding .tar files). A local folder that is neither is a ValueError naming
    it and both layouts, raised before anything heavy is loaded."""
    if not isinstance(urls, str) or "::" in urls or "{" in urls:
        return None
    path = local_path(urls)
    if path is None or not path.is_dir() or any(path.glob("*.tar")):
        return None
    subdirs = sorted(p for p in path.iterdir() if p.is_dir())
    exts = IMG_EXTENSIONS
    for sub in subdirs:
        for _, _, files in os.walk(sub, followlinks=True):
            if any(f.lower().endswith(exts) for f in files):
                return path
    loose = sum(1 for p in path.iterdir() if p.is_file() and p.name.lower().endswith(exts))
    found = (f"{len(subdirs)} sub-folders without image files ({', '.join(exts)})" if subdirs
             else f"{loose} images but no class sub-folders" if loose else "no .tar shards and no sub-folders")
    raise ValueError(f"{where}: {path} is neither a folder of .tar shards nor an image folder ({LAYOUT}): "
                     f"it holds {found}")


def folder_class_name(folder: str) -> str:
    """A class name from a folder name: underscores as spaces (CLIP_benchmark's names are prose)."""
    return folder.replace("_", " ").strip()


@dataclass
class ImageFolderSet:
    """One image folder: torchvision's ImageFolder index, the classes it is scored against and the
    class index of each of its folders (`labels[target]`)."""

    root: Path
    dataset: Any  # torchvision.datasets.ImageFolder (no transform: `iter_batches` decodes)
    classes: ClassSet
    labels: list[int]

    @property
    def folders(self) -> list[str]:
        return list(self.dataset.classes)

    def __len__(self) -> int:
        return len(self.dataset)

    @classmethod
    def open(cls, root: str | Path, classes: ClassSet | None = None) -> ImageFolderSet:
        """Index `root` with ImageFolder and match `classes` to its folders (see the module docstring);
        a class list that does not fit the folders is a ValueError naming both."""
        from torchvision.datasets import ImageFolder

        root = Path(root)
        try:
            dataset = ImageFolder(str(root), loader=_identity)
        except FileNotFoundError as exn:  # no class folder, or a class folder without images
            raise FileNotFoundError(f"image folder {root}: {exn}") from exn
        folders = list(dataset.classes)
        if classes is None:
            classes = ClassSet([folder_class_name(f) for f in folders], folders, None, f"folder names of {root}",
                               None)
            return cls(root, dataset, classes, list(range(len(folders))))
        if classes.key_field is not None:
            labels = [classes.index_of(f, f"folder {root / f}") for f in folders]
            return cls(root, dataset, classes, labels)
        if len(classes) != len(folders):
            raise ValueError(f"class list {classes.source} has {len(classes)} names but image folder {root} has "
                             f"{len(folders)} class folders ({', '.join(folders[:5])}{', ...' if len(folders) > 5 else ''}): "
                             "plain names are matched to the sorted folders in order")
        matched = ClassSet(list(classes.names), folders, classes.groups, classes.source, None)
        return cls(root, dataset, matched, list(range(len(folders))))

    def iter_batches(self, preprocess: Callable, batch_size: int, skipped: Counter, *, workers: int = 0,
                     max_image_pixels: int | None = None) -> Iterator[dict[str, Any]]:
        """Batches {"images", "keys" (paths relative to root), "labels" (class indices)} in ImageFolder
        order, read by `read_image_batches` (bad images counted in `skipped`)."""
        import torch

        for good in read_image_batches([path for path, _ in self.dataset.samples], preprocess, batch_size, skipped,
                                       workers=workers, max_image_pixels=max_image_pixels):
            yield {"images": torch.stack([img for _, img in good]),
                   "keys": [os.path.relpath(self.dataset.samples[i][0], self.root) for i, _ in good],
                   "labels": [self.labels[self.dataset.samples[i][1]] for i, _ in good]}


def read_image_batches(paths: Sequence[str], preprocess: Callable, batch_size: int, skipped: Counter, *,
                       workers: int = 0, max_image_pixels: int | None = None) -> Iterator[list[tuple[int, Any]]]:
    """Image files decoded and preprocessed in batches of `batch_size` (DataLoader `workers`), in order: each
    batch the (index into `paths`, image) pairs that were readable, empty batches left out. A bad file is
    counted in `skipped` by reason (the shard reader's names) and logged (the first few per reason);
    `max_image_pixels`: default the shard reader's. The one reader of image files (image folders, Karpathy)."""
    from torch.utils.data import DataLoader

    from magclip.data.shard_reader import DEFAULT_MAX_IMAGE_PIXELS, LOG_FIRST_SKIPS

    read = ImageReader([(str(p), i) for i, p in enumerate(paths)], preprocess,
                       max_image_pixels or DEFAULT_MAX_IMAGE_PIXELS)
    for items in DataLoader(read, batch_size=batch_size, num_workers=workers, collate_fn=list):
        good = []
        for i, image, reason, detail in items:
            if image is None:
                skipped[reason] += 1
                if skipped[reason] <= LOG_FIRST_SKIPS:
                    more = (" (further skips for this reason are counted, not logged)"
                            if skipped[reason] == LOG_FIRST_SKIPS else "")
                    log.warning("skipped %s: image %s: %s%s", reason, paths[i], str(detail)[:200], more)
                continue
            good.append((i, image))
        if good:
            yield good


def _identity(path: str) -> str:
    return path  # ImageFolder only indexes here; `ImageReader` opens the files


class ImageReader:
    """Index -> (index, preprocessed image or None, skip reason, detail): a bad file is counted, not
    raised. A map-style dataset, so DataLoader workers can decode in parallel."""

    def __init__(self, samples: list[tuple[str, int]], preprocess: Callable, max_pixels: int):
        self.samples, self.preprocess, self.max_pixels = samples, preprocess, max_pixels

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[int, Any, str, str]:
        from magclip.data.shard_reader import load_image

        try:
            data = Path(self.samples[i][0]).read_bytes()
        except OSError as exn:
            return i, None, "unreadable_image", f"{type(exn).__name__}: {exn}"
        img, reason, detail = load_image(data, self.max_pixels)
        if img is None:
            return i, None, reason, detail
        return i, self.preprocess(img), "", ""  # a failure here is a bug, not bad data: raise


__all__ = ["IMG_EXTENSIONS", "LAYOUT", "ImageFolderSet", "ImageReader", "folder_class_name", "read_image_batches",
           "resolve_image_folder"]
