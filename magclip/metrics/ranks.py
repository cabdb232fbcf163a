"""Per-query ranks beside a results file: what paired statistics (magclip.experiments.stats) need.

A retrieval evaluation reports means over queries (R@k, mean rank); to compare two runs query by
query the report needs each query's rank of its first relevant item (R@k of one query = rank < k).
`RetrievalMetrics` is the metrics dict that carries them (`.ranks`, `.item_digest`), and
`save_per_query_ranks` writes every such dict inside a results record to `<stem>.ranks.npz` beside
the results file (results.json -> results.ranks.npz): one compressed array per evaluation and
direction, keyed `<where the metrics sit in the record>/<direction>` (`metrics/image_to_text`,
`eval_sets.ood_seen/text_to_image`), uint16 up to 65,535 items, with a digest of the evaluated
items so that only runs on the same items are paired. numpy only: a report reads it without torch.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from magclip.io import atomic_write_bytes

DIRECTIONS = ("image_to_text", "text_to_image")   # the metric prefixes of a CLIP retrieval evaluation
RANKS_SUFFIX = ".ranks.npz"
ITEMS_KEY = "items"


class RetrievalMetrics(dict):
    """Aggregate metrics (a plain dict: it serialises and logs as one) + the per-query ranks behind them.

    `ranks`: direction ("image_to_text", ...) -> int array of 0-based ranks of each query's first
    relevant item, in query order. `item_digest`: a digest of the evaluated items (`items_digest`), or
    None; two runs' ranks are paired only when their digests (and lengths) agree. Attributes stay
    out of the JSON, so results.json keeps its shape; `save_per_query_ranks` writes them.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.ranks: dict[str, np.ndarray] = {}
        self.item_digest: str | None = None


def items_digest(keys: Sequence[Hashable]) -> str:
    """A short hash of the evaluated items in order: ranks of two runs pair up only on equal digests."""
    return hashlib.sha1("\n".join(map(str, keys)).encode("utf-8")).hexdigest()[:16]


def ranks_path(results_path: str | Path) -> Path:
    """Where the per-query ranks of a results file live: `results.json` -> `results.ranks.npz`."""
    path = Path(results_path)
    return path.with_name(path.stem + RANKS_SUFFIX)


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
    if isinstance(record, RetrievalMetrics) and record.ranks:
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


def save_per_query_ranks(record: Mapping[str, Any], results_path: str | Path) -> Path | None:
    """Write the ranks of every `RetrievalMetrics` in a results record beside its results file
    (`ranks_path`); with none, remove a file left by an earlier run in the same folder, so ranks
    never pair with results they do not belong to. Returns the path written, or None."""
    path = ranks_path(results_path)
    found = find_rank_metrics(record)
    if not found:
        path.unlink(missing_ok=True)
        return None
    save_ranks(path, {where: {**m.ranks, **({ITEMS_KEY: m.item_digest} if m.item_digest else {})}
                      for where, m in found.items()})
    return path
