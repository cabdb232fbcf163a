"""Sample keys that hold a dot: samples webdataset reads as one.

webdataset (and open_clip with it) splits a member's name at the first dot of its base name: the key is
before it, the member's field after it. `TarWriter` writes a sample keyed `img.v2.001` as `img.v2.001.jpg`
and `img.v2.001.txt`, which group under the key `img` as the fields `v2.001.jpg` and `v2.001.txt`; the
samples `img.v2.001` ... `img.v2.006` become one sample `img` without a `jpg`. Read as such, five of six
samples vanish and the sixth is counted as a sample without an image.

Here such a sample is recognised from its fields: a field `STEM.EXT` whose STEM also has an image field
(`STEM.jpg` beside `STEM.txt` or `STEM.json`) is a whole sample folded into another; a lone extra image
such as `KEY.seg.png` (a mask beside `KEY.jpg`) is not. Each folded sample is counted (`dotted_key`) with
the cause named, so the count says how many samples were lost, not one.
"""

from __future__ import annotations

from collections.abc import Iterable

REASON = "dotted_key"
CAUSE = ("sample keys that hold a dot (img.v2.001.jpg): webdataset groups a tar's members by the key's first dot, "
         "so several samples read as one; write the shards with keys without dots")


def folded_samples(fields: Iterable[str], image_exts: Iterable[str]) -> list[str]:
    """The stems of whole samples folded into one grouped sample, from its field names (`v2.001.jpg`,
    `v2.001.txt` -> `v2.001`): a stem with an image field and at least one other field."""
    exts: dict[str, set[str]] = {}
    for name in fields:
        if name.startswith("__") or "." not in name:
            continue
        stem, ext = name.rsplit(".", 1)
        exts.setdefault(stem, set()).add(ext.lower())
    images = set(image_exts)
    return sorted(stem for stem, found in exts.items() if found & images and len(found) > 1)
