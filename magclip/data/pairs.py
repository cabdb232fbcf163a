"""Text pairs for retrieval training: records {query, positive, negatives} from the field's files.

Sources (`read_pairs`): a `.jsonl` / `.jsonl.gz` file; a `.json` array (DPR's nq-train.json, read with
`json.load`); a `.tsv` (magclip/data/tsv_pairs.py: unquoted, as MS MARCO's and BEIR's); a table as
sentence-transformers users hold it, read with `datasets` (magclip/data/tables.py: a `save_to_disk`
folder, a DatasetDict at `split`, `.parquet`, `.csv`, `.gz` compressed or not); a folder (every such
file in it, sorted); webdataset-style tar shards whose `KEY.json` members are records (brace patterns
such as `pairs-{000000..000003}.tar` expand); or several of these joined by '::'. Anything else is
refused in one line naming the file and the formats read.

Columns (`record_columns`), by the layouts of magclip/data/layouts.py: DPR's record (`question`,
`positive_ctxs`, `hard_negative_ctxs`) and tevatron's (`query`, `positive_passages`,
`negative_passages`), each passage as BEIR's title + " " + text; a record that names its query (`query`,
or `anchor` as sentence-transformers' datasets do) and its positive (`positive` or `positives`: a string
or a list, one drawn per epoch) is read by name; hard negatives, all optional and taken together in the
record's key order, are `negatives` (a list), `negative` and `negative_1` .. `negative_n`
(sentence-transformers' triplet and n-tuple columns); other keys (ids, metadata) are ignored. A JSON
record (JSON lines, a JSON array, a tar's KEY.json) is read by its names only, never by its key order:
one that fits no layout refuses the file in one line listing the layouts read. A table's row (parquet,
csv, save_to_disk) that names neither is read by sentence-transformers' dataset convention, where the
table's column order defines the roles: first column the anchor (query), second the positive, the rest
negatives (`label`, `labels`, `score`, `scores` and `dataset_name` are not texts and are left out), e.g.
{query, answer} or {question, answer}. Refused, naming the file and the record: a role named twice
(`query` and `anchor`, `positive` and `positives`), a name its position contradicts (`negative` where
the order puts the positive), an id-like column where the order would read it as text. Which keys gave
the query, positive and negatives is logged per file and kept (`PairsRead.columns`; a training run's
results.json holds it as `train_columns`).

A record without a query or a positive, a line that is not a JSON object, or a TSV line of another width,
is skipped, counted by reason and reported; it never stops the run. A file from which no usable record
remains is refused in one line naming the file and the keys found.

`PairBatches` yields this rank's micro-batches of one epoch: a seeded permutation of all records
(the same on every rank), cut into global batches of batch_size x world_size; rank r takes the r-th
slice, so ranks never share a record within an epoch. With `no_duplicates` (the default, as
sentence-transformers' NoDuplicatesBatchSampler) a record whose query, positive or negative text is
already in the global batch waits for a later one: in SQuAD several questions share a paragraph, and
with in-batch negatives one question's positive would be scored as the other's negative (a false
negative), as would a mined negative that is another question's positive. When an epoch runs out
of records that fit, waiting records fill the batch unchecked; both counts are kept
(`PairBatches.duplicates`). Each record contributes its query and a group
of `group_size` documents: one positive, then group_size - 1 negatives (drawn without replacement
when it has enough, with replacement when it has fewer; a record with none gets positives of other
records as random negatives; `PairBatches.negative_shortfall` counts those records). Batches are tokenized with the
model's `tokenize(texts, side)` and flattened into `query_*` / `passage_*` tensors. `passage_tokens`
changes the documents' training truncation: an int cuts every document there; a (min, max) range
draws each document's length uniformly from it (from the record's own generator, so it does not
depend on the batch or the rank) -- length-varied training, to test whether a norm-length bias is
learned away.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import random
import re
import tarfile
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from magclip.data.layouts import (
    NEGATIVE_KEY,
    NOT_TEXT_KEYS,
    PAIRS_BY_ORDER,
    PAIRS_DPR,
    PAIRS_NAMED,
    PAIRS_TEVATRON,
    POSITIVE_KEYS,
    QUERY_KEYS,
    no_layout,
    passage_text,
)
from magclip.data.tables import (
    is_json_array,
    is_json_lines,
    is_pair_file,
    is_saved_dataset,
    refuse_format,
    table_rows,
)
from magclip.data.tsv_pairs import tsv_rows

log = logging.getLogger("magclip.data")


@dataclass
class PairRecord:
    query: str
    positives: list[str]
    negatives: list[str] = field(default_factory=list)


ID_LIKE = re.compile(r"id|.*_(id|ids|idx)")               # sentence-transformers warns of these as text
BY_ORDER = "by column order"                              # sentence-transformers' convention


@dataclass(frozen=True)
class Columns:
    """Which keys of a record give its query, positive(s) and hard negatives; the rest are ignored."""

    query: str
    positive: str
    negatives: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()
    by_order: bool = False
    layout: str = PAIRS_NAMED.name
    passages: bool = False  # the values are passages {title, text} (DPR, tevatron), not strings

    def describe(self) -> str:
        """e.g. "query<-anchor, positive<-positive, negatives<-negative" (+ " (by column order)" or the layout)."""
        text = f"query<-{self.query}, positive<-{self.positive}"
        text += f", negatives<-{'+'.join(self.negatives)}" if self.negatives else ""
        return text + (f" ({BY_ORDER})" if self.by_order else f" ({self.layout})" if self.passages else "")


class AmbiguousColumns(ValueError):
    """A record whose columns say two things: one role named twice, or a name that its position contradicts."""


def passage_columns(row: dict[str, Any]) -> Columns | None:
    """DPR's record (question, positive_ctxs; hard_negative_ctxs as the negatives, as DPR trains by default:
    hard negatives 1, other negatives 0) or tevatron's (query, positive_passages, negative_passages), by name."""
    for layout, query, positive, negatives in ((PAIRS_DPR, "question", "positive_ctxs", "hard_negative_ctxs"),
                                               (PAIRS_TEVATRON, "query", "positive_passages", "negative_passages")):
        if query in row and positive in row:
            used = (negatives,) if negatives in row else ()
            return Columns(query, positive, used, tuple(k for k in row if k not in (query, positive, *used)),
                           layout=layout.name, passages=True)
    return None


def record_columns(row: dict[str, Any], by_order: bool = True) -> Columns | None:
    """The columns of one record (see the module docstring): DPR's and tevatron's by name; by name where it
    names both a query (query or anchor) and a positive (positive or positives); else, for a table
    (`by_order`), by sentence-transformers' column order. None when no layout fits or fewer than two text
    columns remain; AmbiguousColumns where the names contradict each other or the order."""
    passages = passage_columns(row)
    if passages is not None:
        return passages
    for names in (QUERY_KEYS, POSITIVE_KEYS):
        both = [k for k in names if k in row]
        if len(both) > 1:
            raise AmbiguousColumns(f"both {both[0]!r} and {both[1]!r}: which one is meant is not known; keep one")
    query = next((k for k in QUERY_KEYS if k in row), None)
    positive = next((k for k in POSITIVE_KEYS if k in row), None)
    if query and positive:
        negatives = tuple(k for k in row if NEGATIVE_KEY.fullmatch(k))
        return Columns(query, positive, negatives, tuple(k for k in row if k not in (query, positive, *negatives)))
    if not by_order:
        return None
    inputs = [k for k in row if k not in NOT_TEXT_KEYS]
    for position, key in enumerate(inputs):
        role = "query" if position == 0 else "positive" if position == 1 else "negatives"
        if ID_LIKE.fullmatch(key):
            raise AmbiguousColumns(f"no query and positive named, and the id-like column {key!r}, which the column "
                                   f"order convention of sentence-transformers would read as text (the {role}); "
                                   "name the columns query/anchor, positive, negative, or drop it")
        named = "query" if key in QUERY_KEYS else "positive" if key in POSITIVE_KEYS else \
            "negatives" if NEGATIVE_KEY.fullmatch(key) else role
        if named != role:
            raise AmbiguousColumns(f"column {key!r} in position {position + 1}, where sentence-transformers' column "
                                   f"order convention reads the {role}; name the columns or reorder them")
    if len(inputs) < 2:
        return None
    return Columns(inputs[0], inputs[1], tuple(inputs[2:]), tuple(k for k in row if k in NOT_TEXT_KEYS), True,
                   PAIRS_BY_ORDER.name)


def _texts(value: Any, passages: bool = False) -> list[str]:
    """The non-blank strings of a column's value (a string or a list; passages as BEIR's title + " " + text)."""
    values = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    if passages:
        values = [passage_text(v) for v in values if isinstance(v, dict)]
    return [v for v in values if isinstance(v, str) and v.strip()]


def _expand(source: str) -> list[Path]:
    import braceexpand

    paths: list[Path] = []
    for part in source.split("::"):
        part = part.strip()
        if not part:
            continue
        for item in braceexpand.braceexpand(part):
            p = Path(item)
            if p.is_dir() and is_saved_dataset(p):
                paths.append(p)
            elif p.is_dir():
                paths += sorted(x for x in p.iterdir() if x.is_file() and is_pair_file(x)) + \
                    sorted(x for x in p.iterdir() if x.is_dir() and is_saved_dataset(x))
            elif p.is_file() and is_pair_file(p):
                paths.append(p)
            elif p.is_file():
                raise refuse_format(p)
            else:
                raise FileNotFoundError(f"pair source {item!r} does not exist")
    if not paths:
        raise FileNotFoundError(f"no pair files found in {source!r} (read: .jsonl, .parquet, .csv, .tsv, .json, "
                                ".tar, datasets save_to_disk folders)")
    return paths


def is_json_source(path: Path) -> bool:
    """Records that are JSON objects (JSON lines, a JSON array, tar shards of KEY.json): read by name only."""
    return path.is_file() and (path.name.endswith(".tar") or is_json_lines(path) or is_json_array(path))


def _rows(path: Path, split: str = "train") -> Iterator[Any]:
    if path.is_file() and path.name.endswith((".tsv", ".tsv.gz")):
        yield from tsv_rows(path)
        return
    if path.is_file() and is_json_array(path):
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            try:
                yield from json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not a JSON array ({e})") from None
        return
    if path.is_dir() or not (path.name.endswith(".tar") or is_json_lines(path)):
        yield from table_rows(path, split)
        return
    if path.name.endswith(".tar"):
        with tarfile.open(path) as tar:
            for member in tar:
                if member.isfile() and member.name.endswith(".json"):
                    data = tar.extractfile(member).read()
                    try:
                        yield json.loads(data)
                    except (json.JSONDecodeError, UnicodeDecodeError):
                        yield None
        return
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                yield None


def parse_columns(row: Any, by_order: bool = True) -> tuple[PairRecord | None, str | None, Columns | None]:
    """(record, None, its columns) or (None, skip reason, columns when known); AmbiguousColumns propagates.
    `by_order`: a table's record may be read by sentence-transformers' column order (never a JSON record);
    a record that fits no layout is skipped as "no_layout" (the file reader refuses it)."""
    if not isinstance(row, dict):
        return None, "bad_row", None
    columns = record_columns(row, by_order)
    if columns is None:
        return None, "too_few_columns" if by_order else "no_layout", None
    query = row.get(columns.query)
    if not isinstance(query, str) or not query.strip():
        return None, "empty_query", columns
    positives = _texts(row.get(columns.positive), columns.passages)
    if not positives:
        return None, "no_positive", columns
    negatives = list(dict.fromkeys(n for key in columns.negatives
                                   for n in _texts(row[key], columns.passages)))  # once each, in order
    return PairRecord(query, positives, negatives), None, columns


def parse_record(row: Any) -> tuple[PairRecord | None, str | None]:
    """(record, None) or (None, skip reason)."""
    record, reason, _ = parse_columns(row)
    return record, reason


@dataclass
class PairsRead:
    """What `read_pairs_with_columns` read: the records, skip counts by reason, and per file the columns used."""

    records: list[PairRecord]
    skipped: Counter
    columns: list[dict[str, Any]]   # per file: {"file", "records", "columns": {description: records}, "ignored"}


def read_pairs_with_columns(source: str | Path, max_records: int | None = None, split: str = "train") -> PairsRead:
    """All usable records of `source` (see module docstring), the skip counts, and which columns each file's
    records were read from (logged per file). A file with no usable record, or with a role named twice, is
    refused in one line (ValueError) naming the file and the keys found. `split`: the split of a DatasetDict."""
    out = PairsRead([], Counter(), [])
    for path in _expand(str(source)):
        full = _read_file(path, out, max_records, split)
        if not full:
            break
    if out.skipped:
        log.warning("%s: skipped %d records %s", source, sum(out.skipped.values()), dict(out.skipped))
    return out


def _read_file(path: Path, out: PairsRead, max_records: int | None, split: str = "train") -> bool:
    """Add `path`'s records to `out`; False once `max_records` is reached."""
    used: Counter = Counter()
    ignored: dict[str, None] = {}
    keys: dict[str, None] = {}
    skipped: Counter = Counter()
    more = True
    by_order = not is_json_source(path)
    for number, row in enumerate(_rows(path, split), start=1):
        keys.update(dict.fromkeys(row if isinstance(row, dict) else ()))
        try:
            record, reason, columns = parse_columns(row, by_order)
        except AmbiguousColumns as exn:
            raise ValueError(f"{path}: record {number} has {exn}") from None
        if reason == "no_layout":
            raise no_layout(path, "pairs", f"record {number} (keys: {', '.join(list(row)[:12]) or 'none'}; a JSON "
                                           "record is read by its names, never by key order)")
        if record is None:
            skipped[reason] += 1
            continue
        used[columns.describe()] += 1
        ignored.update(dict.fromkeys(columns.ignored))
        out.records.append(record)
        if max_records is not None and len(out.records) >= max_records:
            more = False
            break
    if not used:
        raise ValueError(f"{path}: no usable pair record ({sum(skipped.values())} read, skipped {dict(skipped)}); "
                         f"keys found: {', '.join(list(keys)[:12]) or 'none'}; a record needs query or anchor, and "
                         "positive or positives (negative, negative_1.., negatives optional), DPR's question and "
                         "positive_ctxs, tevatron's query and positive_passages, or (a table only) text columns in "
                         "sentence-transformers' order (anchor, positive, negatives...) under none of these names")
    out.skipped.update(skipped)
    out.columns.append({"file": str(path), "records": sum(used.values()), "columns": dict(used),
                        "ignored": list(ignored)})
    log.info("%s: %d records, columns %s%s", path, sum(used.values()),
             "; ".join(f"{d} ({n})" for d, n in used.items()),
             f"; ignored keys: {', '.join(ignored)}" if ignored else "")
    return more


def read_pairs(source: str | Path, max_records: int | None = None,
               split: str = "train") -> tuple[list[PairRecord], Counter]:
    """All usable records of `source` (see module docstring) and the skip counts by reason."""
    read = read_pairs_with_columns(source, max_records, split)
    return read.records, read.skipped


def records_from_dicts(rows: list[dict[str, Any]]) -> tuple[list[PairRecord], Counter]:
    records, skipped = [], Counter()
    for row in rows:
        record, reason = parse_record(row)
        if record is None:
            skipped[reason] += 1
        else:
            records.append(record)
    return records, skipped


def write_pairs_shards(rows: list[dict[str, Any]], out_dir: str | Path, shard_size: int = 1000,
                       prefix: str = "pairs") -> list[Path]:
    """Write records as tar shards of KEY.json members (the shard layout `read_pairs` reads)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(0, max(len(rows), 1), shard_size):
        path = out / f"{prefix}-{s // shard_size:06d}.tar"
        tmp = path.with_name(path.name + ".tmp")
        with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
            for i, row in enumerate(rows[s:s + shard_size], start=s):
                data = json.dumps(row, ensure_ascii=False).encode("utf-8")
                info = tarfile.TarInfo(f"{i:09d}.json")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        tmp.replace(path)
        paths.append(path)
    return paths


class PairBatches:
    """This rank's micro-batches of one epoch (iterate once per epoch; see module docstring)."""

    def __init__(self, records: list[PairRecord], tokenize: Callable[..., dict[str, torch.Tensor]],
                 batch_size: int, group_size: int = 1, *, epoch: int = 0, seed: int = 0, rank: int = 0,
                 world_size: int = 1, skipped: Counter | None = None,
                 passage_tokens: int | tuple[int, int] | None = None, no_duplicates: bool = True):
        if batch_size < 1 or group_size < 1:
            raise ValueError("batch_size and group_size must be >= 1")
        if isinstance(passage_tokens, tuple) and not 1 <= passage_tokens[0] <= passage_tokens[1]:
            raise ValueError(f"passage_tokens range {passage_tokens} must satisfy 1 <= min <= max")
        self.passage_tokens = passage_tokens
        self.records = records
        self.tokenize = tokenize
        self.batch_size = batch_size
        self.group_size = group_size
        self.epoch, self.seed, self.rank, self.world_size = epoch, seed, rank, world_size
        self.num_batches = len(records) // (batch_size * world_size)
        self.no_duplicates = no_duplicates
        self._text_keys: list[frozenset[int]] | None = None
        self._global_batches: list[list[int]] | None = None  # this epoch's, composed once
        self.duplicates = {"deferred": 0, "filled_unchecked": 0}  # set when the epoch is composed
        # read-time skips, reported once (rank 0, first batch of epoch 0) so the engine's counts include them
        self._skipped_once = dict(skipped or {}) if rank == 0 else {}
        need = group_size - 1
        self.negative_shortfall = {
            "fewer_than_needed": sum(1 for r in records if 0 < len(r.negatives) < need),
            "none_random_fill": sum(1 for r in records if need > 0 and not r.negatives)}

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for t, global_idx in enumerate(self.global_batches()):
            idx = global_idx[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
            yield self.collate(idx, first=(t == 0))

    def global_batches(self) -> list[list[int]]:
        """This epoch's global batches (record indices), the same on every rank; composed on first use."""
        if self._global_batches is None:
            g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
            order = torch.randperm(len(self.records), generator=g).tolist()
            size = self.batch_size * self.world_size
            self._global_batches = (self._without_duplicates(order, size) if self.no_duplicates
                                    else [order[t * size:(t + 1) * size] for t in range(self.num_batches)])
        return self._global_batches

    def _without_duplicates(self, order: list[int], size: int, scan_limit: int = 64) -> list[list[int]]:
        """Greedy, in permutation order: a record joins the batch being built unless one of its texts is
        already there; then it waits (ahead of later records) for the next batch. A batch that finds no
        more fitting records within `scan_limit` x its size candidates, or at the end of the epoch, is
        filled with waiting records anyway, unchecked (counted)."""
        if self._text_keys is None:
            self._text_keys = [frozenset(hash(t) for t in (r.query, *r.positives, *r.negatives)) for r in self.records]
        keys, queue, waiting = self._text_keys, deque(order), deque()
        deferred = unchecked = 0
        batches = []
        for _ in range(self.num_batches):
            batch, seen, retry, waiting = [], set(), waiting, deque()
            scanned = 0
            while len(batch) < size and (retry or queue) and scanned < scan_limit * size:
                i = retry.popleft() if retry else queue.popleft()
                scanned += 1
                if seen.isdisjoint(keys[i]):
                    batch.append(i)
                    seen.update(keys[i])
                else:
                    waiting.append(i)
                    deferred += 1
            waiting = retry + waiting
            while len(batch) < size:  # nothing else fitted in time: fill without the check
                batch.append(waiting.popleft() if waiting else queue.popleft())
                unchecked += 1
            batches.append(batch)
        self.duplicates = {"deferred": deferred, "filled_unchecked": unchecked}
        return batches

    def collate(self, idx: list[int], first: bool = False) -> dict[str, Any]:
        queries, docs, lengths = [], [], []
        for i in idx:
            # one generator per (seed, epoch, record): a record's draws do not depend on the batch it
            # lands in, so 1 process x batch 2B sees the same documents as 2 processes x batch B
            rng = random.Random((self.seed * 1_000_003 + self.epoch) * 10_000_019 + i)
            r = self.records[i]
            queries.append(r.query)
            docs.append(rng.choice(r.positives))
            need = self.group_size - 1
            if need == 0:
                pass
            elif len(r.negatives) >= need:
                docs += rng.sample(r.negatives, need)
            elif r.negatives:
                docs += [rng.choice(r.negatives) for _ in range(need)]
            else:
                for _ in range(need):
                    other = self.records[rng.randrange(len(self.records))]
                    docs.append(rng.choice(other.positives))
            if isinstance(self.passage_tokens, tuple):  # sampled truncation, one length per document
                lengths += [rng.randint(*self.passage_tokens) for _ in range(self.group_size)]
        batch: dict[str, Any] = {}
        passage_max = lengths if isinstance(self.passage_tokens, tuple) else self.passage_tokens
        for side, texts, max_length in (("query", queries, None), ("passage", docs, passage_max)):
            tokens = self.tokenize(texts, side, max_length=max_length) if max_length else self.tokenize(texts, side)
            for k, v in tokens.items():
                batch[f"{side}_{k}"] = v
        batch["keys"] = [str(i) for i in idx]
        batch["skipped"] = dict(self._skipped_once) if first and self.epoch == 0 else {}
        return batch


def split_batch(batch: dict[str, Any], side: str) -> dict[str, torch.Tensor]:
    """The tokenized tensors of one side, with the side prefix removed from the keys."""
    prefix = f"{side}_"
    return {k[len(prefix):]: v for k, v in batch.items() if k.startswith(prefix) and isinstance(v, torch.Tensor)}
