"""A look at an evaluation set's first shard when a run starts, before torch or a model loads: are its captions
where `data.caption_key` says? A set of shards read with the wrong key loses every sample, and a training run
used to find out only when it evaluated the set, after training.

The first local shard is read member by member and grouped as webdataset groups it (the key is the name up
to the first dot of its base name) until one sample with an image has its captions where the key says: the
usual case costs one sample. A shard whose images all lack them is refused in one line naming the set, the
shard and the key (the evaluation reader refuses such a shard too, at its end). Remote and `pipe:` shards are
left to the reader; a damaged tar ends the look, and the reader counts the damage.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator

from magclip.data.captions import CaptionKey
from magclip.data.urls import expand_sources, local_path

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")  # the image members every shard reader takes


def check_shard_captions(urls: str, caption_key: str, where: str) -> None:
    """A ValueError naming `where`, the shard and the key where the set's first local shard has images but no
    captions under `caption_key` (see the module docstring)."""
    key = CaptionKey(caption_key)
    first = next((p for source in expand_sources(urls) for u in source if (p := local_path(u)) is not None), None)
    if first is None or not first.is_file():
        return
    images = 0
    for sample in _samples(first):
        if not any(ext in sample for ext in IMAGE_EXTS):
            continue
        images += 1
        if key.read(sample)[1] != "missing_caption":
            return
    if images:
        what = "KEY.txt" if key.member == "txt" else f"a KEY.json field {key.spec[len('json:'):]!r}"
        hint = " (json:FIELD reads a caption from KEY.json)" if key.member == "txt" else ""
        raise ValueError(f"{where}: shard {first} has no captions where data.caption_key={key.spec!r} looks ({what}) "
                         f"in any of its {images} images: every set of shards is read with that key; give the key "
                         f"that holds this set's captions{hint}, or a set with its captions there")


def _samples(path) -> Iterator[dict[str, bytes]]:
    """{field: bytes} per sample of one tar, grouped by key as webdataset groups consecutive members."""
    current: dict[str, bytes] = {}
    current_key = None
    try:
        with tarfile.open(path, mode="r|*") as tar:
            for info in tar:
                if not info.isreg():
                    continue
                folder, _, base = info.name.rpartition("/")
                if "." not in base or base.startswith("__"):
                    continue
                stem, field = base.split(".", 1)
                sample_key = f"{folder}/{stem}" if folder else stem
                if sample_key != current_key and current:
                    yield current
                    current = {}
                current_key = sample_key
                current[field.lower()] = tar.extractfile(info).read()  # type: ignore[union-attr]
    except (tarfile.TarError, OSError, EOFError):
        pass  # damage: the reader counts it
    if current:
        yield current
