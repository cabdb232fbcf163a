"""The field's file layouts that magclip reads: one list, each with its signature and its peer.

A layout is recognised by its signature (field names, column names or column count), never guessed:
no header inferred from a first row, no column read by its position unless the layout defines the
positions, no JSON record read by its key order, no CSV quoting in a TSV (a quote is a character).
Each layout names the tool whose reading defines it; the tests read the same files with that tool and
compare. A positional reading is said once at WARNING with its mapping and row count (`announce`); a
record or file that matches no layout is refused in one line that lists the layouts of its kind
(`no_layout`). The README's data section shows this list as a table (`layout_table`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("magclip.data")


@dataclass(frozen=True)
class Layout:
    """One layout of the field's files: what it is, how it is recognised and whose reading defines it."""

    name: str
    kind: str        # "qrels", "pairs", "corpus", "queries", "folder"
    signature: str   # what recognises it
    peer: str        # the tool whose reading defines it (and that the tests compare against)
    positional: bool = False  # read by column position (the layout defines the positions)


QRELS_BEIR = Layout("BEIR qrels", "qrels", "3 tab-separated columns, header `query-id corpus-id score`",
                    "BEIR GenericDataLoader")
QRELS_BEIR_NO_HEADER = Layout("BEIR qrels without header", "qrels",
                              "3 tab-separated columns: query-id, corpus-id, score", "BEIR GenericDataLoader",
                              positional=True)
QRELS_TREC = Layout("TREC qrels (MS MARCO qrels.*.tsv)", "qrels",
                    "4 columns split on tabs or spaces: query-id, iteration, doc-id, relevance",
                    "pytrec_eval parse_qrel / ir_datasets TrecQrels", positional=True)
QRELS_TABLE = Layout("MTEB qrels parquet", "qrels", "columns `query-id`, `corpus-id`, `score`", "MTEB / datasets")

CORPUS_BEIR = Layout("BEIR corpus", "corpus", "corpus.jsonl(.gz) records `_id`, `title`, `text`",
                     "BEIR GenericDataLoader")
CORPUS_MTEB = Layout("MTEB corpus parquet", "corpus", "corpus/*.parquet, columns `_id` (or `id`), `title`, `text`",
                     "MTEB / datasets")
CORPUS_MSMARCO = Layout("MS MARCO collection", "corpus", "collection.tsv, 2 tab-separated columns: pid, passage",
                        "ir_datasets msmarco-passage (TsvDocs)", positional=True)
QUERIES_BEIR = Layout("BEIR queries", "queries", "queries.jsonl(.gz) records `_id`, `text`", "BEIR GenericDataLoader")
QUERIES_MTEB = Layout("MTEB queries parquet", "queries", "queries/*.parquet, columns `_id` (or `id`), `text`",
                      "MTEB / datasets")
QUERIES_MSMARCO = Layout("MS MARCO queries", "queries", "queries(.SPLIT).tsv, 2 tab-separated columns: qid, query",
                         "ir_datasets msmarco-passage (TsvQueries)", positional=True)

PAIRS_NAMED = Layout("sentence-transformers named columns", "pairs",
                     "`query` or `anchor`, `positive` or `positives`; `negative`, `negative_1..n`, `negatives`",
                     "sentence-transformers")
PAIRS_DPR = Layout("DPR biencoder JSON (nq-train.json)", "pairs",
                   "`question`, `positive_ctxs` ({title, text}); `hard_negative_ctxs` as negatives",
                   "DPR JsonQADataset")
PAIRS_TEVATRON = Layout("tevatron train jsonl", "pairs",
                        "`query`, `positive_passages`, `negative_passages` ({docid, title, text})",
                        "tevatron TrainDataset")
PAIRS_BY_ORDER = Layout("sentence-transformers column order (tables only)", "pairs",
                        "a parquet / csv / save_to_disk table naming none of the above: anchor, positive, "
                        "negatives by column", "sentence-transformers data collator", positional=True)
PAIRS_TSV_HEADER = Layout("TSV with a named header", "pairs",
                          "unquoted TSV whose first line names query/anchor and positive (+ negatives)",
                          "sentence-transformers named columns")
PAIRS_MSMARCO_TRIPLES = Layout("MS MARCO triples (triples.train.small.tsv)", "pairs",
                               "unquoted TSV, no header, 3 columns: query, positive, negative",
                               "MS MARCO / ir_datasets msmarco-passage/train docpairs", positional=True)

FOLDER_BEIR = Layout("BEIR folder", "folder", "corpus.jsonl(.gz), queries.jsonl(.gz), qrels/SPLIT.tsv",
                     "BEIR GenericDataLoader")
FOLDER_MTEB = Layout("MTEB hub folder", "folder", "corpus/*.parquet, queries/*.parquet, qrels/ or data/SPLIT*.parquet",
                     "MTEB RetrievalDataLoader")
FOLDER_MSMARCO = Layout("MS MARCO folder", "folder", "collection.tsv, queries(.SPLIT).tsv, qrels.SPLIT.tsv (TREC)",
                        "ir_datasets msmarco-passage")

LAYOUTS: tuple[Layout, ...] = (
    QRELS_BEIR, QRELS_BEIR_NO_HEADER, QRELS_TREC, QRELS_TABLE,
    CORPUS_BEIR, CORPUS_MTEB, CORPUS_MSMARCO, QUERIES_BEIR, QUERIES_MTEB, QUERIES_MSMARCO,
    PAIRS_NAMED, PAIRS_DPR, PAIRS_TEVATRON, PAIRS_BY_ORDER, PAIRS_TSV_HEADER, PAIRS_MSMARCO_TRIPLES,
    FOLDER_BEIR, FOLDER_MTEB, FOLDER_MSMARCO,
)


# the named pair layout's names (sentence-transformers' columns)
QUERY_KEYS = ("query", "anchor")
POSITIVE_KEYS = ("positive", "positives")
NEGATIVE_KEY = re.compile(r"negatives?(_\d+)?")          # negatives, negative, negative_1 .. negative_n
# what sentence-transformers' data collator leaves out of the texts: label columns and the dataset's name
NOT_TEXT_KEYS = ("label", "labels", "score", "scores", "dataset_name")


def layouts_of(kind: str) -> tuple[Layout, ...]:
    return tuple(layout for layout in LAYOUTS if layout.kind == kind)


def names_of(kind: str) -> str:
    """The layouts of a kind, for a refusal: "A (peer); B (peer)"."""
    return "; ".join(f"{layout.name} [{layout.signature}]" for layout in layouts_of(kind))


def no_layout(path: str | Path, kind: str, what: str) -> ValueError:
    """The one-line refusal of a record or file that matches no layout of its kind."""
    return ValueError(f"{path}: {what} matches no {kind} layout read; read: {names_of(kind)}")


def announce(path: str | Path, layout: Layout, mapping: str, rows: int) -> None:
    """Say once, at WARNING, that a file was read by position, with the mapping and the row count."""
    log.warning("%s: read as %s, as %s reads it, by position: %s; %d rows", path, layout.name, layout.peer,
                mapping, rows)


def passage_text(ctx: dict) -> str:
    """A DPR or tevatron passage as one text, by the rule BEIR states for every corpus: title + " " + text."""
    title = ctx.get("title") or ""
    text = ctx.get("text") or ""
    return (f"{title} {text}").strip()


def layout_table() -> str:
    """The README's table of every layout read (markdown)."""
    rows = ["| kind | layout | signature | read as |", "|---|---|---|---|"]
    rows += [f"| {x.kind} | {x.name} | {x.signature}{' (by position)' if x.positional else ''} | {x.peer} |"
             for x in LAYOUTS]
    return "\n".join(rows)
