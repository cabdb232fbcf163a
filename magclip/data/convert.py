"""A folder of images + a caption table (CSV/TSV or JSONL) -> img2dataset-style webdataset shards.

Each row becomes one sample: KEY.{jpg,jpeg,png,webp} (bytes copied as they are; other formats
PIL reads are re-encoded to PNG), KEY.txt (the caption) and KEY.json (the row, so the original
file name and any extra columns survive). Shards are `{prefix}-{000000..}.tar` with a
`sizes.json` beside them, the layout `build_clip_loader` and open_clip read.

A table is read as pandas' `read_csv(file, sep=...)` reads it, which is how open_clip's `CsvDataset`
reads its tab-separated `.csv` (columns `filepath`, `title`): the csv module's quoting rules (a quoted
caption may hold the separator, a doubled quote or a newline), UTF-8 with or without a byte-order mark,
blank lines ignored. The separator is given or sniffed from the header line. Everything that would make
the whole table unreadable (wrong encoding, missing columns, a quote never closed) is refused before any
image is read; bad rows (more or fewer fields than the header, no file, file missing, undecodable image,
empty caption) are skipped, counted by reason with their line numbers, returned and printed — never
silently dropped and never fatal.

The output folder is written whole beside its final place and swapped in at the end: a reader sees the
old complete set or the new one. A folder that already holds anything is replaced only when asked.
"""

from __future__ import annotations

import codecs
import csv
import glob
import io
import itertools
import json
import logging
import os
import tarfile
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from magclip.data.synthetic import add_member
from magclip.io import publishing_dir, recover_dir

log = logging.getLogger("magclip.data")

KEEP_EXTS = {".jpg": "jpg", ".jpeg": "jpeg", ".png": "png", ".webp": "webp"}
TABLE_SUFFIXES = (".csv", ".tsv", ".txt")
JSONL_SUFFIXES = (".jsonl", ".json")
IMAGE_COLUMNS = ("file", "filepath")  # magclip's name, open_clip's (`--csv-img-key` default)
CAPTION_COLUMNS = ("caption", "title")  # magclip's name, open_clip's (`--csv-caption-key` default)
SEPARATOR_NAMES = {"\t": "tab", ",": "comma", ";": "semicolon", "|": "pipe"}  # the ones sniffed
DEFAULT_ENCODING = "utf-8-sig"  # UTF-8 with or without a byte-order mark, as pandas reads it
SIZES_FILE = "sizes.json"
SHOWN_LINES = 5  # line numbers kept (and logged) per skip reason
# fed to the csv reader after the file's last line: found inside a field, a quote opened and never closed
_END = "\x00magclip: end of the caption table\x00"


@dataclass(frozen=True)
class CaptionTable:
    """A caption table checked before any image is read: how to split it and which columns to use."""

    path: Path
    separator: str | None  # None: JSON lines
    encoding: str
    image_column: str
    caption_column: str
    header: tuple[str, ...] = ()
    how: str = ""  # how the separator was chosen, for the log

    def describe(self) -> str:
        split = "JSON lines" if self.separator is None else f"{_name(self.separator)}-separated ({self.how})"
        return (f"{self.path}: {split}, image column {self.image_column!r}, caption column "
                f"{self.caption_column!r}, {_encoding_name(self.encoding)}")


def _name(separator: str) -> str:
    return SEPARATOR_NAMES.get(separator, repr(separator))


def _encoding_name(encoding: str) -> str:
    return "UTF-8" if encoding == DEFAULT_ENCODING else encoding


def parse_separator(text: str) -> str:
    """One separator character from an option value: the character, a name (tab, comma, semicolon, pipe)
    or `\\t` as a shell passes open_clip's `--csv-separator "\\t"` (pandas takes it as a regex for tab)."""
    names = {name: char for char, name in SEPARATOR_NAMES.items()}
    value = {"\\t": "\t", **names}.get(text.lower(), text)
    if len(value) != 1 or value in '"\r\n':
        raise ValueError(f"--separator {text!r}: expected one character such as ',' or '\\t' "
                         f"(or a name: {', '.join(names)})")
    return value


def check_decodes(path: Path, encoding: str) -> None:
    """Decode the whole table once, so a wrong encoding is refused before any image is read and the
    refusal names the line (Python's own error names neither the file nor the line)."""
    try:
        codecs.lookup(encoding)
    except LookupError:
        raise ValueError(f"--encoding {encoding!r}: unknown encoding (e.g. utf-8, latin-1, cp1252)") from None
    try:
        with open(path, encoding=encoding, newline="") as f:
            while f.read(1 << 20):
                pass
    except UnicodeDecodeError:
        line, bad = _decode_error_at(path, encoding)
        raise ValueError(f"{path}: line {line}: bytes {bad!r} are not valid {_encoding_name(encoding)}; if "
                         "the file is Latin-1 or Windows-1252 (as Excel saves CSV), pass --encoding latin-1 "
                         "or --encoding cp1252") from None


def _decode_error_at(path: Path, encoding: str) -> tuple[int, bytes]:
    """(line, offending bytes) of the first decoding error: the lines are fed to one incremental decoder,
    so a character split across lines still decodes as it did in the whole file."""
    decoder = codecs.getincrementaldecoder(encoding)()
    number = 0
    try:
        with open(path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                decoder.decode(raw)
        decoder.decode(b"", final=True)  # a character cut off by the end of the file
    except UnicodeDecodeError as exn:
        return max(number, 1), exn.object[exn.start:exn.end]
    return number, b""


def _table_records(path: Path, encoding: str, separator: str) -> Iterator[tuple[int, int, list[str]]]:
    """(first line, last line, fields) of each non-blank record, header included, by the csv module's
    quoting rules (pandas' defaults: `"` quotes, `""` inside quotes is one quote)."""
    with open(path, encoding=encoding, newline="") as f:
        reader = csv.reader(itertools.chain(f, [_END + "\n"]), delimiter=separator)
        start = 1
        try:
            for fields in reader:
                first, last, start = start, reader.line_num, reader.line_num + 1
                if fields == [_END]:
                    return
                if any(_END in field for field in fields):
                    raise ValueError(f"{path}: line {first}: a quote opened on this line is never closed, so the "
                                     "rest of the file would read as one caption; close it, or write a quote "
                                     'inside a quoted caption as ""')
                if fields and (len(fields) > 1 or fields[0].strip()):  # pandas skips blank lines
                    yield first, last, fields
        except csv.Error as exn:
            raise ValueError(f"{path}: line {start}: {exn} (an unclosed quote?)") from None


def _json_records(path: Path, encoding: str) -> Iterator[tuple[int, int, dict[str, Any] | None]]:
    """(line, line, object) of each non-blank line; None for a line that is not a JSON object."""
    with open(path, encoding=encoding) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            yield number, number, row if isinstance(row, dict) else None


def _split(line: str, separator: str) -> list[str]:
    return next(csv.reader([line], delimiter=separator), [])


def _sniff(path: Path, encoding: str, wanted: tuple[tuple[str, ...], tuple[str, ...]]) -> str:
    """The separator that splits the header line into the wanted columns; else the one that splits it
    into most fields. The file suffix's own separator (tab for .tsv, comma for .csv) wins ties."""
    with open(path, encoding=encoding, newline="") as f:
        line = next((text for text in f if text.strip()), "").lstrip("\ufeff")
    own = "\t" if path.suffix.lower() == ".tsv" else ","
    order = sorted(SEPARATOR_NAMES, key=lambda sep: sep != own)
    splits = {sep: _split(line, sep) for sep in order}
    for sep in order:
        if all(any(name in splits[sep] for name in names) for names in wanted):
            return sep
    return max(order, key=lambda sep: len(splits[sep]))


def _header(path: Path, encoding: str, separator: str) -> list[str]:
    """The first record's fields, less a byte-order mark read under --encoding utf-8 (pandas drops it too)."""
    records = _table_records(path, encoding, separator)
    header = next(records, (0, 0, []))[2]
    records.close()
    return [header[0].lstrip("\ufeff"), *header[1:]] if header else []


def _pick(found: list[str], given: str | None, candidates: tuple[str, ...], role: str, option: str) -> str:
    """The column for `role`: `given`, else the one of `candidates` found; a LookupError saying why not."""
    if given is not None:
        if given in found:
            return given
        raise LookupError(f"no {role} column {given!r} ({option})")
    present = [name for name in candidates if name in found]
    if len(present) > 1:
        raise LookupError(f"both {' and '.join(map(repr, present))} could be the {role} column ({option} NAME "
                          "chooses)")
    if not present:
        raise LookupError(f"no {role} column ({' or '.join(map(repr, candidates))}; {option} NAME names it)")
    return present[0]


def _columns(path: Path, found: list[str], where: str, image_column: str | None,
             caption_column: str | None) -> tuple[str, str]:
    """Both columns, or one line naming the file, every problem, the columns found and the options."""
    picked, problems = [], []
    for given, candidates, role, option in ((image_column, IMAGE_COLUMNS, "image", "--image-column"),
                                            (caption_column, CAPTION_COLUMNS, "caption", "--caption-column")):
        try:
            picked.append(_pick(found, given, candidates, role, option))
        except LookupError as exn:
            problems.append(str(exn.args[0]))
    if problems:
        raise ValueError(f"{path}: {'; '.join(problems)}; {where}: {found}")
    return picked[0], picked[1]


def open_table(path: str | Path, image_column: str | None = None, caption_column: str | None = None,
               separator: str | None = None, encoding: str = DEFAULT_ENCODING) -> CaptionTable:
    """Check a caption table and resolve how to read it, refusing in one line whatever would spoil every
    row. Columns not given are `file`/`filepath` and `caption`/`title`; a separator not given is
    sniffed from the header line. JSON lines (.jsonl/.json) take their keys from the first object."""
    path = Path(path)
    suffix = path.suffix.lower()
    if separator is None and suffix not in TABLE_SUFFIXES + JSONL_SUFFIXES:
        raise ValueError(f"{path}: expected a .csv, .tsv, .txt or .jsonl file; for a table named otherwise "
                         "pass --separator")
    check_decodes(path, encoding)
    if suffix in JSONL_SUFFIXES and separator is None:
        first = next(((line, row) for line, _, row in _json_records(path, encoding) if row is not None), None)
        keys = list(first[1]) if first else []
        where = f"the keys of its first object (line {first[0]})" if first else "no line holds a JSON object"
        return CaptionTable(path, None, encoding, *_columns(path, keys, where, image_column, caption_column))
    wanted = ((image_column,) if image_column else IMAGE_COLUMNS,
              (caption_column,) if caption_column else CAPTION_COLUMNS)
    sep = parse_separator(separator) if separator is not None else _sniff(path, encoding, wanted)
    how = "--separator" if separator is not None else "sniffed from the header; --separator chooses"
    header = _header(path, encoding, sep)
    where = f"the header's columns, split on {_name(sep)} ({how})"
    columns = _columns(path, header, where, image_column, caption_column)
    for _ in _table_records(path, encoding, sep):  # a quote never closed is refused before any image is read
        pass
    return CaptionTable(path, sep, encoding, *columns, header=tuple(header), how=how)


def iter_rows(table: CaptionTable) -> Iterator[tuple[int, int, dict[str, Any] | None]]:
    """(first line, last line, row) of each data row; row None for a line that is no row: a JSON line
    that is not an object, a table row with more or fewer fields than the header."""
    if table.separator is None:
        yield from _json_records(table.path, table.encoding)
        return
    records = _table_records(table.path, table.encoding, table.separator)
    next(records, None)  # the header
    for first, last, fields in records:
        yield first, last, _first_wins(table.header, fields) if len(fields) == len(table.header) else None


def _first_wins(header: Iterable[str], fields: Iterable[str]) -> dict[str, str]:
    """The row as a dict; of two columns of one name the first counts, as in pandas (which renames the
    second `NAME.1`)."""
    row: dict[str, str] = {}
    for name, value in zip(header, fields):
        row.setdefault(name, value)
    return row


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
    except Exception:  # noqa: BLE001  (whatever PIL's decoders raise, the image is unusable)
        return None


class ShardWriter:
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
            self.tar = tarfile.open(  # noqa: SIM115  (open across `add` calls; `close` closes it)
                self.out_dir / (name + ".tmp"), "w", format=tarfile.USTAR_FORMAT)
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


class _Tally:
    """Rows counted by reason, with the lines of the first few of each: what the summary and log show."""

    def __init__(self, path: Path, what: str, level: int = logging.WARNING):
        self.path, self.what, self.level = path, what, level
        self.counts: Counter[str] = Counter()
        self.lines: dict[str, list[str]] = {}

    def add(self, reason: str, first: int, last: int, detail: object = "") -> None:
        self.counts[reason] += 1
        if self.counts[reason] <= SHOWN_LINES:
            lines = f"{first}" if first == last else f"{first}-{last}"
            self.lines.setdefault(reason, []).append(lines)
            where = "line" if first == last else "lines"
            log.log(self.level, "%s %s %s %s (%s): %s", self.path, where, lines, self.what, reason, detail)

    def lines_of(self, reason: str) -> str:
        more = ", ..." if self.counts[reason] > SHOWN_LINES else ""
        plural = self.counts[reason] > 1 or "-" in self.lines[reason][0]
        return f"line{'s' * plural} {', '.join(self.lines[reason])}{more}"

    def summary(self) -> str:
        return ", ".join(f"{reason} {self.counts[reason]} ({self.lines_of(reason)})" for reason in sorted(self.counts))


def _write_samples(table: CaptionTable, images_dir: Path, writer: ShardWriter, verify: bool,
                   skipped: _Tally, multiline: _Tally) -> None:
    """One sample per usable row, every other row counted in `skipped` by reason."""
    for first, last, row in iter_rows(table):
        if row is None:
            skipped.add("malformed" if table.separator else "bad_row", first, last,
                        f"not the header's {len(table.header)} fields" if table.separator
                        else "not a JSON object")
            continue
        file, caption = row.get(table.image_column), row.get(table.caption_column)
        if not file or not isinstance(file, str):
            skipped.add("missing_file", first, last, f"no {table.image_column!r}")
            continue
        caption = caption.strip() if isinstance(caption, str) else ""
        if not caption:
            skipped.add("empty_caption", first, last, file)
            continue
        path = images_dir / file
        if not path.is_file():
            skipped.add("missing_file", first, last, path)
            continue
        image = _image_bytes(path, verify)
        if image is None:
            skipped.add("undecodable_image", first, last, path)
            continue
        if first != last:
            multiline.add("multiline", first, last, "a quoted newline in a caption")
        meta = {k: v for k, v in row.items() if isinstance(k, str) and k != table.caption_column}
        meta_json = json.dumps(meta, ensure_ascii=False, sort_keys=True).encode("utf-8")
        members = [(image[1], image[0]), ("txt", caption.encode("utf-8")), ("json", meta_json)]
        writer.add(f"{writer.count:09d}", members)
    writer.close()


def _ours(path: Path) -> bool:
    """A file make_shards writes: what `--overwrite` may delete."""
    return path.is_file() and (path.name == SIZES_FILE or path.name.endswith((".tar", ".tar.tmp")))


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def check_out_dir(out: Path, overwrite: bool, inputs: tuple[Path, ...]) -> None:
    """Refuse before any work: an output folder that holds anything is replaced only with `overwrite`
    (shards of an earlier run left beside new ones would be read as data), and then only if all it
    holds is what make_shards writes, never the inputs or anybody's other files; nor the current
    folder (a shell left in the replaced folder would list nothing)."""
    recover_dir(out)  # a replacement killed between its two renames: the old folder comes back first
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out} is a file, not a folder: choose another output folder")
    if os.path.ismount(out):
        raise ValueError(f"{out} is a mount point, which cannot be swapped for a new folder: pass a folder "
                         f"inside it, e.g. {out / 'shards'}")
    for what, path in (*[("the input", p) for p in inputs], ("the current folder", Path.cwd())):
        if out.resolve() == path.resolve() or out.resolve() in path.resolve().parents:
            raise ValueError(f"output folder {out} is or holds {what} {path}: choose a folder of its own "
                             "for the shards")
    entries = sorted(out.iterdir()) if out.is_dir() else []
    if entries and not overwrite:
        raise FileExistsError(f"{out} is not empty ({_few([p.name for p in entries])}): pass --overwrite to "
                              "replace it with the new shards, or choose a new folder")
    foreign = [p.name for p in entries if not _ours(p)]
    if foreign:
        raise FileExistsError(f"{out}: --overwrite would delete {_few(foreign)}, which make_shards does not "
                              "write; move them away or choose another folder")
    stale = sorted(out.parent.glob(f".{glob.escape(out.name)}.*.tmp"))
    if stale:
        log.warning("%s: left by an interrupted (or a still running) make_shards; delete it to free the space",
                    _few([str(p) for p in stale]))


def convert_to_shards(
    images_dir: str | Path,
    captions_file: str | Path,
    out_dir: str | Path,
    shard_size: int = 1000,
    prefix: str = "shard",
    *,
    image_column: str | None = None,
    caption_column: str | None = None,
    separator: str | None = None,
    encoding: str = DEFAULT_ENCODING,
    overwrite: bool = False,
    verify: bool = True,
    quiet: bool = False,
) -> dict[str, Any]:
    """Write shards for every usable row; returns {"written", "shards", "urls", "sizes_file", "skipped",
    "skipped_lines", "multiline"}.

    `image_column` paths are relative to `images_dir` (absolute paths are used as they are); columns and
    separator not given are found as `open_table` says. `verify` fully decodes each image so a broken
    file is skipped here rather than at training. `out_dir` must be empty or new unless `overwrite`;
    it is written beside its place and swapped in whole.
    """
    if shard_size < 1:
        raise ValueError("shard_size must be >= 1")
    images_dir, captions_file, out = Path(images_dir), Path(captions_file), Path(out_dir)
    if not images_dir.is_dir():
        raise FileNotFoundError(f"images folder {images_dir}: not found (or not a folder)")
    if not captions_file.is_file():
        raise FileNotFoundError(f"caption table {captions_file}: not found (or not a file)")
    target = out.resolve()  # "." has no name to put a sibling beside; a symlinked folder is replaced in place
    check_out_dir(target, overwrite, (images_dir, captions_file))
    table = open_table(captions_file, image_column, caption_column, separator, encoding)
    log.info("%s", table.describe())
    skipped = _Tally(captions_file, "skipped")
    multiline = _Tally(captions_file, "read as one row", logging.INFO)
    with publishing_dir(target) as tmp:
        writer = ShardWriter(tmp, prefix, shard_size)
        _write_samples(table, images_dir, writer, verify, skipped, multiline)
        (tmp / SIZES_FILE).write_text(json.dumps(writer.sizes, indent=1, sort_keys=True) + "\n")
    names = list(writer.sizes)
    last = len(names) - 1
    pattern = f"{prefix}-{{000000..{last:06d}}}.tar" if last > 0 else f"{prefix}-000000.tar"
    urls = str(out / pattern) if names else ""
    result = {"written": writer.count, "shards": [str(out / n) for n in names], "urls": urls,
              "sizes_file": str(out / SIZES_FILE), "skipped": dict(skipped.counts),
              "skipped_lines": skipped.lines, "multiline": multiline.counts["multiline"]}
    if not quiet:
        print(f"wrote {writer.count} samples in {len(names)} shards: {urls or '(none)'}")
        print(f"skipped {sum(skipped.counts.values())} rows" + (f": {skipped.summary()}" if skipped.counts else ""))
        if multiline.counts:
            n = multiline.counts["multiline"]
            print(f"{n} caption{'s' * (n > 1)} with a quoted newline ({multiline.lines_of('multiline')}); if "
                  "unintended, look for a stray quote there")
    return result
