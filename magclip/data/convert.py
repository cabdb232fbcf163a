"""A folder of images + a caption table (CSV/TSV or JSONL) -> img2dataset-style webdataset shards.

Each row becomes one sample: KEY.{jpg,jpeg,png,webp} (bytes copied as they are; other formats
PIL reads are re-encoded to PNG), KEY.txt (the caption) and KEY.json (the row, so the original
file name and any extra columns survive). Shards are `{prefix}-{000000..}.tar` with a
`sizes.json` beside them, the layout `build_clip_loader` and open_clip read. Bad rows (no file,
file missing, undecodable image, empty caption, malformed line) are skipped, counted by reason,
returned and printed — never silently dropped and never fatal.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import tarfile
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from PIL import Image

from magclip.data.synthetic import add_member

log = logging.getLogger("magclip.data")

KEEP_EXTS = {".jpg": "jpg", ".jpeg": "jpeg", ".png": "png", ".webp": "webp"}


def read_rows(captions_file: Path, columns: tuple[str, ...] = ()) -> Iterator[dict[str, Any] | None]:
    """Rows of a .csv/.tsv (header line) or .jsonl file; None for a line that is not a JSON object.

    A CSV header without all of `columns` is a ValueError (a typo would otherwise skip every row)."""
    suffix = captions_file.suffix.lower()
    with open(captions_file, newline="", encoding="utf-8") as f:
        if suffix in (".csv", ".tsv"):
            reader = csv.DictReader(f, delimiter="\t" if suffix == ".tsv" else ",")
            missing = [c for c in columns if c not in (reader.fieldnames or [])]
            if missing:
                raise ValueError(f"{captions_file}: no column {missing} in header {reader.fieldnames}")
            yield from reader
        elif suffix in (".jsonl", ".json"):
            for line in f:
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    row = None
                yield row if isinstance(row, dict) else None
        else:
            raise ValueError(f"{captions_file}: expected .csv, .tsv or .jsonl")


def _image_bytes(path: Path, verify: bool) -> tuple[bytes, str] | None:
    """(bytes, extension) ready for the tar, or None if PIL cannot decode the file."""
    ext = KEEP_EXTS.get(path.suffix.lower())
    data = path.read_bytes()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            img = Image.open(io.BytesIO(data))
            if ext is not None:
                if verify:
                    img.load()
                return data, ext
            buf = io.BytesIO()
            img.convert("RGB").save(buf, format="PNG")
            return buf.getvalue(), "png"
    except Exception:
        return None


class _ShardWriter:
    """Writes `{prefix}-NNNNNN.tar` shards of `shard_size` samples, each renamed into place when full."""

    def __init__(self, out_dir: Path, prefix: str, shard_size: int):
        self.out_dir, self.prefix, self.shard_size = out_dir, prefix, shard_size
        self.sizes: dict[str, int] = {}
        self.tar: tarfile.TarFile | None = None
        self.count = 0

    def add(self, key: str, members: list[tuple[str, bytes]]) -> None:
        if self.tar is None:
            name = f"{self.prefix}-{len(self.sizes):06d}.tar"
            self.sizes[name] = 0
            self.tar = tarfile.open(self.out_dir / (name + ".tmp"), "w", format=tarfile.USTAR_FORMAT)
        for ext, data in members:
            add_member(self.tar, f"{key}.{ext}", data)
        name = list(self.sizes)[-1]
        self.sizes[name] += 1
        self.count += 1
        if self.sizes[name] == self.shard_size:
            self.close()

    def close(self) -> None:
        if self.tar is not None:
            self.tar.close()
            name = list(self.sizes)[-1]
            os.replace(self.out_dir / (name + ".tmp"), self.out_dir / name)
            self.tar = None


def convert_to_shards(
    images_dir: str | Path,
    captions_file: str | Path,
    out_dir: str | Path,
    shard_size: int = 1000,
    prefix: str = "shard",
    *,
    file_column: str = "file",
    caption_column: str = "caption",
    verify: bool = True,
    quiet: bool = False,
) -> dict[str, Any]:
    """Write shards for every usable row; returns {"written", "shards", "urls", "sizes_file", "skipped"}.

    `file_column` paths are relative to `images_dir` (absolute paths are used as they are).
    `verify` fully decodes each image so a broken file is skipped here rather than at training.
    An existing `sizes.json` in `out_dir` is updated, not replaced, so several prefixes can share
    a folder.
    """
    if shard_size < 1:
        raise ValueError("shard_size must be >= 1")
    images_dir, captions_file, out = Path(images_dir), Path(captions_file), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    skipped: Counter[str] = Counter()
    writer = _ShardWriter(out, prefix, shard_size)

    def skip(reason: str, row_number: int, detail: object = "") -> None:
        skipped[reason] += 1
        if skipped[reason] <= 5:
            log.warning("%s row %d skipped (%s) %s", captions_file, row_number, reason, detail)

    for number, row in enumerate(read_rows(captions_file, (file_column, caption_column)), start=1):
        if row is None:
            skip("bad_row", number)
            continue
        file, caption = row.get(file_column), row.get(caption_column)
        if not file or not isinstance(file, str):
            skip("missing_file", number, f"no {file_column!r}")
            continue
        caption = caption.strip() if isinstance(caption, str) else ""
        if not caption:
            skip("empty_caption", number, file)
            continue
        path = images_dir / file
        if not path.is_file():
            skip("missing_file", number, path)
            continue
        image = _image_bytes(path, verify)
        if image is None:
            skip("undecodable_image", number, path)
            continue
        meta = {k: v for k, v in row.items() if isinstance(k, str) and k != caption_column}
        meta_json = json.dumps(meta, ensure_ascii=False, sort_keys=True).encode("utf-8")
        members = [(image[1], image[0]), ("txt", caption.encode("utf-8")), ("json", meta_json)]
        writer.add(f"{writer.count:09d}", members)
    writer.close()

    sizes_file = out / "sizes.json"
    sizes = json.loads(sizes_file.read_text()) if sizes_file.is_file() else {}
    sizes.update(writer.sizes)
    sizes_file.write_text(json.dumps(sizes, indent=1, sort_keys=True) + "\n")
    names = list(writer.sizes)
    last = len(names) - 1
    pattern = f"{prefix}-{{000000..{last:06d}}}.tar" if last > 0 else f"{prefix}-000000.tar"
    urls = str(out / pattern) if names else ""
    result = {"written": writer.count, "shards": [str(out / n) for n in names], "urls": urls,
              "sizes_file": str(sizes_file), "skipped": dict(skipped)}
    if not quiet:
        print(f"wrote {writer.count} samples in {len(names)} shards: {urls or '(none)'}")
        print(f"skipped {sum(skipped.values())} rows" + (f": {dict(skipped)}" if skipped else ""))
    return result
