"""Training pairs in a TSV, read as the field writes them: unquoted, one record a line, split on tabs.

MS MARCO's and BEIR's TSVs are not CSV: a quote is a character, never the start of a quoted field, so
`"Hamlet" is a play` stays as it is and a quote that never closes cannot merge the next lines into one
text. The layout is recognised by the first line (magclip/data/layouts.py):

- a header that names the pair layout's columns (`query` or `anchor`, `positive` or `positives`,
  `negative`, `negative_1..n`, label columns), read by name;
- no header and three columns: MS MARCO's `triples.train.small.tsv` (query, positive, negative), by the
  positions MS MARCO defines, said once at WARNING with the row count; every line is a record.

Refused in one line naming the file: a first line that looks like column names but names no layout
(which line is a header is not guessed), three ids (MS MARCO's `qidpidtriples`: ids, not texts), any
other column count without such a header. A later line with another number of fields is a bad row:
skipped and counted (`bad_row`), never joined with its neighbours.
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from magclip.data.layouts import (
    NEGATIVE_KEY,
    NOT_TEXT_KEYS,
    PAIRS_MSMARCO_TRIPLES,
    POSITIVE_KEYS,
    QUERY_KEYS,
    announce,
    no_layout,
)

TRIPLES = ("query", "positive", "negative")
COLUMN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")


def names_pair_columns(fields: list[str]) -> bool:
    """A header line of the named layout: a query name, a positive name, and only the layout's other names."""
    known = all(f in QUERY_KEYS or f in POSITIVE_KEYS or f in NOT_TEXT_KEYS or NEGATIVE_KEY.fullmatch(f) for f in fields)
    return known and any(f in QUERY_KEYS for f in fields) and any(f in POSITIVE_KEYS for f in fields)


def _columns(path: Path, fields: list[str]) -> tuple[tuple[str, ...], bool]:
    """(column names, whether the first line is a header), or a one-line refusal."""
    if names_pair_columns(fields):
        return tuple(fields), True
    if all(COLUMN_NAME.fullmatch(f) for f in fields):
        raise no_layout(path, "pairs", f"line 1 ({', '.join(fields)}) looks like a header but names no pair layout "
                                       "(rename its columns query/anchor, positive, negative)")
    if len(fields) == 3 and all(f.strip().isdigit() for f in fields):
        raise ValueError(f"{path}: line 1 holds three ids ({', '.join(fields)}), not texts (MS MARCO's "
                         "qidpidtriples); join them with collection.tsv and queries.tsv into query, positive and "
                         "negative texts (triples.train.small.tsv's layout)")
    if len(fields) == 3:
        return TRIPLES, False
    raise no_layout(path, "pairs", f"line 1 ({len(fields)} tab-separated columns, no header naming query and "
                                   "positive)")


def tsv_rows(path: Path) -> Iterator[dict[str, Any] | None]:
    """The records of a pair TSV as dicts by column name (None for a line of another width: a bad row)."""
    opener = gzip.open if path.name.endswith(".gz") else open
    columns: tuple[str, ...] = ()
    by_position, rows = False, 0
    try:
        with opener(path, "rt", encoding="utf-8", newline="") as f:
            for raw in f:
                line = raw.rstrip("\r\n")
                if not line.strip():
                    continue
                fields = line.split("\t")
                if not columns:
                    columns, header = _columns(path, fields)
                    by_position = not header
                    if header:
                        continue
                if len(fields) != len(columns):
                    yield None
                    continue
                rows += 1
                yield dict(zip(columns, fields, strict=True))
    finally:
        if by_position:
            announce(path, PAIRS_MSMARCO_TRIPLES, "query<-1, positive<-2, negative<-3", rows)
