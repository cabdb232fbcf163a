"""An image-caption parquet (a `datasets.Image` column and a caption column, as the hub's CLIP sets ship)
-> img2dataset-style webdataset shards, the images exactly as `datasets` decodes them.

The image column is recognised by its signature: the `datasets` features stored in the file's metadata
name it `Image`, or (a file written without that metadata) it is a struct of `bytes` and `path`, the
form `datasets` stores an image in. The caption column is `caption`, `title` or `text` (one of them;
`caption_column` names another). A caption that is a list (several captions per image) is written one
caption a line, the KEY.txt form magclip reads. An image's bytes are copied as they are (JPEG, PNG, WebP;
another format PIL reads is re-encoded to PNG, losslessly), so the shard's pixels are those `datasets`
decodes; an image stored only by `path` is read from that path as `datasets` reads it. A row without an
image, with one PIL cannot decode or without a caption is skipped, counted by reason with its row numbers.
"""

from __future__ import annotations

import io
import json
import logging
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

from PIL import Image

from magclip.data.convert import KEEP_EXTS, SIZES_FILE, ShardWriter, check_out_dir
from magclip.io import publishing_dir

log = logging.getLogger("magclip.data")

CAPTION_NAMES = ("caption", "title", "text")
PIL_EXTS = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}
SHOWN_ROWS = 5


def is_image_table(path: Path) -> bool:
    return path.is_file() and path.suffix == ".parquet"


def _features(schema) -> dict[str, Any]:
    meta = (schema.metadata or {}).get(b"huggingface")
    return json.loads(meta).get("info", {}).get("features", {}) if meta else {}


def image_columns(path: Path, schema, caption_column: str | None = None,
                  image_column: str | None = None) -> tuple[str, str]:
    """(image column, caption column), recognised by signature, or a one-line refusal naming the columns."""
    import pyarrow as pa

    names = schema.names
    features = _features(schema)
    images = [n for n in names if (features.get(n) or {}).get("_type") == "Image"
              or (pa.types.is_struct(schema.field(n).type)
                  and {f.name for f in schema.field(n).type} == {"bytes", "path"})]
    image = image_column or (images[0] if len(images) == 1 else None)
    if image is None or image not in names:
        raise ValueError(f"{path}: {'no' if not images else 'more than one'} image column (a datasets.Image, or a "
                         f"struct of bytes and path) among {names}; name it with --image-column")
    captions = [caption_column] if caption_column else [n for n in CAPTION_NAMES if n in names]
    if len(captions) != 1 or captions[0] not in names:
        raise ValueError(f"{path}: {'no' if not captions else 'which'} caption column among {names} (read: "
                         f"{', '.join(CAPTION_NAMES)}{'; several are there' if len(captions) > 1 else ''}); "
                         "name it with --caption-column")
    return image, captions[0]


def _image(cell: Any, folder: Path) -> tuple[bytes, str] | str:
    """(bytes, extension) for the tar, or the skip reason."""
    data = cell.get("bytes") if isinstance(cell, dict) else None
    where = cell.get("path") if isinstance(cell, dict) else None
    if data is None and where:
        path = Path(where) if Path(where).is_absolute() or Path(where).is_file() else folder / where
        if not path.is_file():
            return "missing_image"
        data = path.read_bytes()
    if data is None:
        return "missing_image"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            img = Image.open(io.BytesIO(data))
            img.load()
            ext = PIL_EXTS.get(img.format or "")
            if ext in KEEP_EXTS.values():
                return data, ext
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            return buf.getvalue(), "png"
    except Exception:  # noqa: BLE001  (whatever PIL's decoders raise, the image is unusable)
        return "undecodable_image"


def _caption(value: Any) -> str:
    """One caption a line (a caption's own line breaks become spaces)."""
    values = value if isinstance(value, list) else [value]
    return "\n".join(" ".join(v.splitlines()).strip() for v in values if isinstance(v, str) and v.strip())


def convert_image_table(table: str | Path, out_dir: str | Path, shard_size: int = 1000, prefix: str = "shard", *,
                        image_column: str | None = None, caption_column: str | None = None,
                        overwrite: bool = False, quiet: bool = False) -> dict[str, Any]:
    """Write shards for every usable row of an image-caption parquet; returns {"written", "shards", "urls",
    "sizes_file", "skipped", "skipped_rows"} as `convert_to_shards` does."""
    import pyarrow.parquet as pq

    if shard_size < 1:
        raise ValueError("shard_size must be >= 1")
    table, out = Path(table), Path(out_dir)
    if not table.is_file():
        raise FileNotFoundError(f"image table {table}: not found (or not a file)")
    parquet = pq.ParquetFile(table)
    image, caption = image_columns(table, parquet.schema_arrow, caption_column, image_column)
    log.info("%s: image column %r, caption column %r", table, image, caption)
    target = out.resolve()
    check_out_dir(target, overwrite, (table,))
    skipped: Counter[str] = Counter()
    rows: dict[str, list[int]] = {}
    others = [n for n in parquet.schema_arrow.names if n not in (image, caption)]
    with publishing_dir(target) as tmp:
        writer = ShardWriter(tmp, prefix, shard_size)
        number = 0
        for batch in parquet.iter_batches(batch_size=256):
            for row in batch.to_pylist():
                number += 1
                found, text = _image(row[image], table.parent), _caption(row[caption])
                reason = found if isinstance(found, str) else "" if text else "empty_caption"
                if reason:
                    skipped[reason] += 1
                    if skipped[reason] <= SHOWN_ROWS:
                        rows.setdefault(reason, []).append(number)
                    continue
                meta = {"row": number, **{k: row[k] for k in others if isinstance(row[k], (str, int, float, bool))}}
                writer.add(f"{writer.count:09d}", [(found[1], found[0]), ("txt", text.encode("utf-8")),
                                                   ("json", json.dumps(meta, sort_keys=True).encode("utf-8"))])
        writer.close()
        (tmp / SIZES_FILE).write_text(json.dumps(writer.sizes, indent=1, sort_keys=True) + "\n")
    names = list(writer.sizes)
    last = len(names) - 1
    pattern = f"{prefix}-{{000000..{last:06d}}}.tar" if last > 0 else f"{prefix}-000000.tar"
    urls = str(out / pattern) if names else ""
    if not quiet:
        print(f"wrote {writer.count} samples in {len(names)} shards: {urls or '(none)'}")
        print(f"skipped {sum(skipped.values())} rows" + (": " + ", ".join(
            f"{r} {n} (rows {', '.join(map(str, rows[r]))}{', ...' if n > SHOWN_ROWS else ''})"
            for r, n in sorted(skipped.items())) if skipped else ""))
    return {"written": writer.count, "shards": [str(out / n) for n in names], "urls": urls,
            "sizes_file": str(out / SIZES_FILE), "skipped": dict(skipped), "skipped_rows": rows}
