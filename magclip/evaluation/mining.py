"""Training pairs with hard negatives mined from a BEIR split by a model under a Scorer (the
usual false negatives, unjudged near-duplicates of positives, can be skipped with `skip_top`)."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path
from typing import Any

from magclip.data.beir import beir_to_pairs, doc_text, load_beir
from magclip.io import atomic_write_jsonl, atomic_write_with
from magclip.metrics.ir import search_run
from magclip.models.text import BiEncoder
from magclip.similarity import Scorer

log = logging.getLogger("magclip.text")


def mine_hard_negatives(model: BiEncoder, folder: str | Path, split: str = "train", scorer: Scorer | str = "cosine",
                        *, negatives: int = 4, skip_top: int = 0, depth: int = 100, min_score: int = 1,
                        batch_size: int = 64, device=None, backend: str = "auto", out: str | Path | None = None,
                        progress: bool = False, sample: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """Pairs from a BEIR split with hard negatives retrieved by `model` under `scorer`.

    For each query: its judged documents with relevance >= `min_score` are the positives; the
    negatives are the best-ranked documents that are not judged for it at all (any grade) and not the
    query itself, after skipping the first `skip_top` of them (near-duplicates of positives that are
    merely unjudged are the usual false negatives). `sample`/`seed`: mine for that many queries drawn at
    random (`beir_to_pairs`), against the whole corpus. Written as JSONL to `out` when given.
    """
    data = load_beir(folder, split)
    rows = beir_to_pairs(folder, split, min_score=min_score, sample=sample, seed=seed)
    if not rows:
        return rows
    dids = list(data.corpus)
    doc_vecs = model.encode(data.doc_texts(dids), "passage", batch_size=batch_size, device=device, progress=progress)
    qids = [r["query_id"] for r in rows]
    q_vecs = model.encode([r["query"] for r in rows], "query", batch_size=batch_size, device=device, progress=progress)
    need = skip_top + negatives
    run, _ = search_run(q_vecs, doc_vecs, qids, dids, scorer, min(len(dids), depth + need), backend=backend)
    short = 0
    for r in rows:
        judged = set(data.qrels[r["query_id"]])
        ranked = [d for d in run[r["query_id"]] if d not in judged][skip_top:skip_top + negatives]
        short += len(ranked) < negatives
        r["negative_ids"] = ranked
        r["negatives"] = [doc_text(data.corpus[d]) for d in ranked]
    if short:
        log.warning("%d queries got fewer than %d mined negatives (depth %d)", short, negatives, depth)
    if out is not None:
        atomic_write_jsonl(out, rows)
    return rows


def write_negative_ids(rows: list[dict[str, Any]], path: str | Path) -> None:
    """The mined choice alone ({query_id, negative_ids} per line, gzipped): a few MB where the pairs with
    their texts are hundreds, so that a mining run of tens of minutes can be committed and replayed."""
    lines = "".join(json.dumps({"query_id": r["query_id"], "negative_ids": r["negative_ids"]}) + "\n" for r in rows)
    atomic_write_with(path, lambda tmp: Path(tmp).write_bytes(gzip.compress(lines.encode(), mtime=0)))


def pairs_from_negative_ids(folder: str | Path, ids_path: str | Path, split: str = "train", *, min_score: int = 1,
                            out: str | Path | None = None) -> list[dict[str, Any]]:
    """The pairs that `mine_hard_negatives` wrote, rebuilt from the BEIR folder and `write_negative_ids`'
    file (the texts come from the folder, so the same split gives the same pairs, record for record)."""
    data = load_beir(folder, split)
    by_query = {r["query_id"]: r for r in beir_to_pairs(folder, split, min_score=min_score)}
    rows = []
    with gzip.open(ids_path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            chosen = json.loads(line)
            row = by_query.get(chosen["query_id"])
            if row is None:
                raise ValueError(f"{ids_path}:{number}: query {chosen['query_id']!r} has no usable positive "
                                 f"in {folder} ({split}): the file was mined from another split or version")
            missing = [d for d in chosen["negative_ids"] if d not in data.corpus]
            if missing:
                raise ValueError(f"{ids_path}:{number}: documents {missing} are not in {folder}/corpus.jsonl")
            rows.append({**row, "negative_ids": chosen["negative_ids"],
                         "negatives": [doc_text(data.corpus[d]) for d in chosen["negative_ids"]]})
    if out is not None:
        atomic_write_jsonl(out, rows)
    return rows
