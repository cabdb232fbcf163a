"""Per-query outcomes beside a results file: what paired statistics (magclip.experiments.stats) need.

A retrieval evaluation reports means over queries (R@k, mean rank); to compare two runs query by
query the report needs each query's rank of its first relevant item (R@k of one query = rank < k).
`RetrievalMetrics` is the metrics dict that carries them (`.ranks`, `.item_digest`), and
`save_per_query_outcomes` writes every such dict inside a results record to `<stem>.ranks.npz` beside
the results file (results.json -> results.ranks.npz): one compressed array per evaluation and
direction, keyed `<where the metrics sit in the record>/<direction>` (`metrics/image_to_text`,
`eval_sets.ood_seen/text_to_image`), uint16 up to 65,535 items, with a digest of the evaluated
items so that only runs on the same items are paired. numpy only: a report reads it without torch.

Text evaluations report means of per-query numbers that are not ranks (BEIR's nDCG@10 per query from
pytrec_eval, RAG's answer hit per question) and correlations over pairs (STS): those ride in
`RetrievalMetrics.values` ({key: float array, one value per query or pair}, each with its items'
digest in `value_digests`) and go to `<stem>.queries.npz` (results.json -> results.queries.npz), one
array per number, keyed by the number's dotted path in the record (`metrics.scifact/ndcg@10`,
`scifact.modes.qnorm.ndcg@10`): the path a grid column names. STS keeps the per-pair model scores
(`pred_ab`, `pred_ba`) and the gold scores beside its correlations, so a correlation can be
bootstrapped over pairs. The digest of the array at key K is stored at `K#items`.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from magclip.io import atomic_write_bytes, atomic_write_json

DIRECTIONS = ("image_to_text", "text_to_image")   # the metric prefixes of a CLIP retrieval evaluation
RANKS_SUFFIX = ".ranks.npz"
QUERIES_SUFFIX = ".queries.npz"
ITEMS_KEY = "items"
DIGEST_MARK = "#items"


class RetrievalMetrics(dict):
    """Aggregate metrics (a plain dict: it serialises and logs as one) + the per-query ranks behind them.

    `ranks`: direction ("image_to_text", ...) -> int array of 0-based ranks of each query's first
    relevant item, in query order. `item_digest`: a digest of the evaluated items (`items_digest`), or
    None; two runs' ranks are paired only when their digests (and lengths) agree. Attributes stay
    out of the JSON, so results.json keeps its shape; `save_per_query_outcomes` writes them.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.ranks: dict[str, np.ndarray] = {}
        self.item_digest: str | None = None
        self.values: dict[str, np.ndarray] = {}
        self.value_digests: dict[str, str] = {}

    def add_values(self, key: str, values: Sequence[float] | np.ndarray, items: Sequence[Hashable]) -> None:
        """Keep one number per item (query, question, pair) behind `key`, with the digest of `items`."""
        if len(values) != len(items):
            raise ValueError(f"{key}: {len(values)} values for {len(items)} items")
        self.values[key] = np.asarray(values, dtype=np.float64)
        self.value_digests[key] = items_digest(items)

    def with_outcomes(self, other: "RetrievalMetrics", prefix: str = "") -> "RetrievalMetrics":
        """Take `other`'s per-query values (keys prefixed with `prefix`) into self; returns self."""
        for key, values in other.values.items():
            self.values[prefix + key] = values
            self.value_digests[prefix + key] = other.value_digests[key]
        return self

    def copy(self) -> "RetrievalMetrics":
        out = RetrievalMetrics(self)
        out.ranks, out.item_digest = dict(self.ranks), self.item_digest
        return out.with_outcomes(self)


def items_digest(keys: Sequence[Hashable]) -> str:
    """A short hash of the evaluated items in order: ranks of two runs pair up only on equal digests."""
    return hashlib.sha1("\n".join(map(str, keys)).encode("utf-8")).hexdigest()[:16]


def ranks_path(results_path: str | Path) -> Path:
    """Where the per-query ranks of a results file live: `results.json` -> `results.ranks.npz`."""
    path = Path(results_path)
    return path.with_name(path.stem + RANKS_SUFFIX)


def queries_path(results_path: str | Path) -> Path:
    """Where the per-query values of a results file live: `results.json` -> `results.queries.npz`."""
    path = Path(results_path)
    return path.with_name(path.stem + QUERIES_SUFFIX)


def compact(ranks: np.ndarray) -> np.ndarray:
    """The smallest integer type that holds the ranks (uint16 up to 65,535 items, else int32)."""
    ranks = np.asarray(ranks)
    if ranks.size and ranks.min() < 0:
        raise ValueError("ranks must be >= 0")
    return ranks.astype(np.uint16 if ranks.size == 0 or ranks.max() < 2 ** 16 else np.int32)


def find_rank_metrics(record: Any, prefix: str = "") -> dict[str, RetrievalMetrics]:
    """Every `RetrievalMetrics` with ranks inside a results record, by its dotted path (`metrics`,
    `eval_sets.ood_seen`, ...)."""
    found: dict[str, RetrievalMetrics] = {}
    if isinstance(record, RetrievalMetrics) and (record.ranks or record.values):
        found[prefix] = record
    if isinstance(record, Mapping):
        for key, value in record.items():
            found.update(find_rank_metrics(value, f"{prefix}.{key}" if prefix else str(key)))
    return found


def save_ranks(path: str | Path, ranks: Mapping[str, Mapping[str, Any]]) -> None:
    """Write {where: {direction: ranks, "items": digest}} as one compressed .npz, atomically; keys
    `where/direction` (`metrics/image_to_text`, `eval_sets.ood_seen/items`)."""
    arrays = {}
    for where, by_direction in ranks.items():
        for name, value in by_direction.items():
            if "/" in where or "/" in name:
                raise ValueError(f"a ranks key may not contain '/': {where!r}/{name!r}")
            arrays[f"{where}/{name}"] = np.asarray(value) if name == ITEMS_KEY else compact(value)
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    atomic_write_bytes(path, buf.getvalue())


def load_ranks(path: str | Path) -> dict[str, dict[str, Any]]:
    """{where: {direction: int64 ranks, "items": digest or None}} of a file `save_ranks` wrote."""
    out: dict[str, dict[str, Any]] = {}
    with np.load(path, allow_pickle=False) as data:
        for key in data.files:
            where, _, name = key.rpartition("/")
            value = data[key]
            entry = out.setdefault(where, {ITEMS_KEY: None})
            entry[name] = str(value) if name == ITEMS_KEY else value.astype(np.int64)
    return out


def load_query_values(path: str | Path) -> dict[str, Any]:
    """{dotted path: float64 values, dotted path + DIGEST_MARK: digest} of a file `save_per_query_outcomes` wrote."""
    with np.load(path, allow_pickle=False) as data:
        return {key: str(data[key]) if key.endswith(DIGEST_MARK) else data[key].astype(np.float64)
                for key in data.files}


def save_per_query_outcomes(record: Mapping[str, Any], results_path: str | Path) -> list[Path]:
    """Write the outcomes of every `RetrievalMetrics` in a results record beside its results file: the
    ranks to `ranks_path`, the values to `queries_path`. A kind the record has none of has its file
    removed (one left by an earlier run in the same folder), so outcomes never pair with results they
    do not belong to. Returns the paths written."""
    found = find_rank_metrics(record)
    ranks = {where: {**m.ranks, **({ITEMS_KEY: m.item_digest} if m.item_digest else {})}
             for where, m in found.items() if m.ranks}
    values: dict[str, np.ndarray] = {}
    for where, m in found.items():
        for key, array in m.values.items():
            values[f"{where}.{key}"] = array.astype(np.float64)  # float64: their mean is the reported mean
            values[f"{where}.{key}{DIGEST_MARK}"] = np.asarray(m.value_digests[key])
    written = []
    for path, content, save in ((ranks_path(results_path), ranks, save_ranks),
                                (queries_path(results_path), values, _save_values)):
        if content:
            save(path, content)
            written.append(path)
        else:
            path.unlink(missing_ok=True)
    return written


def _save_values(path: Path, values: Mapping[str, np.ndarray]) -> None:
    buf = io.BytesIO()
    np.savez_compressed(buf, **values)
    atomic_write_bytes(path, buf.getvalue())


def write_results_with_outcomes(path: str | Path, record: Mapping[str, Any]) -> None:
    """An evaluation command's results JSON, its per-query outcomes written beside it first."""
    save_per_query_outcomes(record, path)
    atomic_write_json(path, record)


def read_metrics_with_outcomes(path: str | Path, where: str) -> RetrievalMetrics:
    """The inverse of `write_results_with_outcomes` for the metrics at `where` in the record (a
    top-level key): the numbers from the JSON, the per-query ranks and values from the files beside it."""
    path = Path(path)
    out = RetrievalMetrics(json.loads(path.read_text())[where])
    if ranks_path(path).is_file():
        by_direction = load_ranks(ranks_path(path)).get(where, {})
        out.item_digest = by_direction.pop(ITEMS_KEY, None)
        out.ranks = by_direction
    if queries_path(path).is_file():
        values, prefix = load_query_values(queries_path(path)), f"{where}."
        for key, array in values.items():
            if key.startswith(prefix) and not key.endswith(DIGEST_MARK):
                out.values[key[len(prefix):]] = array
                out.value_digests[key[len(prefix):]] = values[key + DIGEST_MARK]
    return out
