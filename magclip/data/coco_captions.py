"""COCO's own caption file over its image folder: what torchvision's `CocoCaptions` and CLIP_benchmark's
`mscoco_captions` read (CLIP_benchmark's 5k test set is `coco_test_karpathy.json` in this form).

    captions_val2014.json:
    {"images": [{"id": 391895, "file_name": "COCO_val2014_000000391895.jpg", ...}, ...],
     "annotations": [{"id": 770337, "image_id": 391895, "caption": "A man with a red helmet ..."}, ...], ...}

The images are `IMAGES/file_name` (`--images` / `images:`; default the JSON file's folder), in image id
order as `CocoCaptions` lists them; each image's captions are its annotations' `caption`, in file order,
every one kept: scored by image, image->text is a hit when any of its captions is in the top k. Numbers
equal CLIP_benchmark's `zeroshot_retrieval.evaluate` over `CocoCaptions` on the same files.

Refused in one line naming the file: a file without `images` and `annotations` lists, an image without an
integer `id` or a `file_name`, an image id listed twice, an annotation without `image_id` or `caption`, an
annotation whose `image_id` is not among the images (pycocotools would drop its caption silently).
Counted and reported as a Karpathy file's are (magclip.data.captioned_images): an image without a non-empty
caption (`empty_caption`; CLIP_benchmark would count it a miss), an image whose file is not there
(`missing_image`), blank captions (`empty_caption_line`). A set where no image is found is an error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from magclip.data.captioned_images import CaptionedImages, clean_captions, read_json

LAYOUT_HELP = ('{"images": [{"id", "file_name"}, ...], "annotations": [{"image_id", "caption"}, ...]}, '
               "as captions_val2014.json")


class CocoCaptionsSet(CaptionedImages):
    """A COCO caption file, its images found."""

    @classmethod
    def open(cls, source: str | Path, images: str | Path | None = None) -> CocoCaptionsSet:
        source = Path(source).expanduser()
        return cls.from_data(source, read_json(source), images)

    @classmethod
    def from_data(cls, source: Path, data: Any, images: str | Path | None = None) -> CocoCaptionsSet:
        """The set `data` (the file's parsed JSON) lists."""
        if not is_coco_captions_data(data):
            raise ValueError(f"{source}: not a COCO caption file (expected {LAYOUT_HELP})")
        root = Path(images).expanduser() if images else source.parent
        files = _image_files(source, data["images"])
        captions: dict[int, list[Any]] = {image_id: [] for image_id in files}
        for i, ann in enumerate(data["annotations"]):
            if not isinstance(ann, dict) or "image_id" not in ann or "caption" not in ann:
                raise ValueError(f"{source}: annotation {i} has no image_id or no caption (expected {LAYOUT_HELP})")
            if ann["image_id"] not in captions:
                raise ValueError(f"{source}: annotation {i} (id {ann.get('id')}) names image_id {ann['image_id']!r}, "
                                 "which is not among its images: the file is damaged or cut; use the file as "
                                 "COCO publishes it")
            captions[ann["image_id"]].append(ann["caption"])
        out = cls(source, root, None, [])
        for image_id in sorted(files):  # CocoCaptions' order: sorted image ids
            kept, blank = clean_captions(captions[image_id])
            out.blank_captions += blank
            out.add(files[image_id], kept, [root / files[image_id]])
        out.finish()
        return out


def is_coco_captions_data(data: Any) -> bool:
    """A parsed JSON with COCO's top-level lists `images` and `annotations`."""
    return isinstance(data, dict) and isinstance(data.get("images"), list) and \
        isinstance(data.get("annotations"), list)


def _image_files(source: Path, images: list[Any]) -> dict[int, str]:
    """{image id: file_name}; an entry without them, or an id listed twice, is refused."""
    files: dict[int, str] = {}
    for i, image in enumerate(images):
        image_id = image.get("id") if isinstance(image, dict) else None
        name = image.get("file_name") if isinstance(image, dict) else None
        if isinstance(image_id, bool) or not isinstance(image_id, int) or not isinstance(name, str) or not name:
            raise ValueError(f"{source}: image {i} has no integer id or no file_name (expected {LAYOUT_HELP})")
        if image_id in files:
            raise ValueError(f"{source}: image id {image_id} is listed twice ({files[image_id]} and {name}): "
                             "pycocotools keeps one of them silently; fix the file")
        files[image_id] = name
    return files
