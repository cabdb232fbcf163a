"""BEIR folders: corpus.jsonl (`_id`, `title`, `text`), queries.jsonl (`_id`, `text`), qrels/<split>.tsv.

The same reading serves the field's other retrieval folders (magclip/data/retrieval_folder.py: BEIR's
gzipped hub copies, MTEB's parquet layout, MS MARCO's collection.tsv + queries.tsv + TREC qrels) and qrels
in TREC's four columns (magclip/data/qrels.py), each recognised by its signature.

`load_beir(folder, split)` returns the corpus, the queries that have judgements in that split and
the qrels, the way BEIR's `GenericDataLoader` does: qrels rows with score 0 are kept (they are
judged non-relevant, which nDCG and MAP treat as such), and queries without any judgement in the
split are dropped. `doc_text` joins title and text with one space, as BEIR's sentence-transformers
wrapper and MTEB do ((title + " " + text).strip()).

Bad input never turns into a silent zero. Clear errors (naming the file, and the id or line where
there is one): a missing file (the split's qrels: the error lists the splits that exist), an empty
corpus.jsonl, a qrels file without judgements, a malformed qrels line, judged query ids missing
from queries.jsonl, qrels none of whose documents are in the corpus. Counted warnings (logged, and
kept in `BeirData.warnings`): judged queries with no text are dropped, with their judgements
(`queries_without_text`); qrels lines naming a document that is not in the corpus are kept, as
BEIR keeps them, so they count against recall (`qrels_unknown_docs`), and queries left without
any known relevant document are counted (`queries_without_known_relevant`: they score 0).

Read as BEIR reads them, and reported (`BeirData.read_report`, logged; every BEIR entry of eval/beir.py
and of a text training run carries it): a corpus line whose `_id` repeats replaces the earlier document
(BEIR's GenericDataLoader fills a dict line by line: the last line wins, and the id keeps its first
place), so the report counts the repeated ids, how many of them changed the text, and which of them
the split judges (there a judged document may not be the one the judgement was made on); a repeated
query id likewise (the last text wins); queries without a judgement in the split are left out of the
evaluation, counted with their first ids. A qrels row that repeats a (query, document) pair replaces the
earlier score (BEIR fills `qrels[query][doc]` row by row: the last row wins), counted with how many changed
the score (`repeated_qrels`, `repeated_qrels_changed`); a query whose judgements are all 0 (none relevant)
stays in the evaluation and scores 0 in every mean, as in BEIR and pytrec_eval (no relevant document: nDCG,
recall and MRR are 0), counted with its first ids (`queries_all_zero`), so a mean pulled down by such
queries says so.

`beir_to_pairs` turns a split's qrels (normally `train`) into training pairs: one record per query
with every relevant document (score >= `min_score`) as `positive` and optionally `random_negatives`
documents drawn from the rest of the corpus as `negatives`.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from magclip.config import IDENTICAL_ID_RULES
from magclip.data.qrels import read_qrels_file
from magclip.data.retrieval_folder import check_folder, corpus_files, queries_files, read_qrels_files, rows
from magclip.io import atomic_write_jsonl

log = logging.getLogger("magclip.data.beir")


@dataclass
class BeirData:
    name: str
    corpus: dict[str, dict[str, str]]    # doc id -> {"title", "text"}
    queries: dict[str, str]               # query id -> text (only queries judged in the split)
    qrels: dict[str, dict[str, int]]      # query id -> {doc id: relevance}
    split: str
    warnings: dict[str, int] = field(default_factory=dict)  # counted problems in the input (see module doc)
    read_report: dict[str, Any] = field(default_factory=dict)  # what BEIR's reading did (see module doc)

    def doc_ids(self) -> list[str]:
        return list(self.corpus)

    def doc_texts(self, ids: list[str] | None = None) -> list[str]:
        return [doc_text(self.corpus[i]) for i in (ids if ids is not None else self.corpus)]

    def identical_ids(self, rule: str = "self") -> dict[str, str]:
        """{query id: document id} to leave out of that query's ranking (see `identical_id_exclusions`)."""
        return identical_id_exclusions(self.queries, self.corpus, rule)

    def subset(self, max_queries: int | None = None, max_docs: int | None = None, seed: int = 0) -> BeirData:
        """A smaller problem for quick checks: the first `max_queries` queries, every document they
        judge, then other documents (in corpus order) up to `max_docs`. Not comparable to full-corpus numbers."""
        qids = list(self.queries)[:max_queries] if max_queries else list(self.queries)
        qrels = {q: self.qrels[q] for q in qids}
        keep = {d for q in qids for d in qrels[q] if d in self.corpus}
        if max_docs is not None:
            for d in self.corpus:
                if len(keep) >= max_docs:
                    break
                keep.add(d)
        else:
            keep = set(self.corpus)
        corpus = {d: v for d, v in self.corpus.items() if d in keep}
        return BeirData(self.name, corpus, {q: self.queries[q] for q in qids}, qrels, self.split, dict(self.warnings),
                        dict(self.read_report))


def identical_id_exclusions(queries: dict[str, str], corpus: dict[str, dict[str, str]],
                            rule: str = "self") -> dict[str, str]:
    """Which document each query's ranking leaves out because it shares the query's id.

    BEIR's `ignore_identical_ids` drops every such document; it was added for ArguAna and Quora, whose
    queries are themselves in the corpus. In collections numbered 1, 2, 3 ... on both sides (Cranfield,
    MED, CISI, CACM, NPL) it removes a real, often relevant, document from every ranking, so here:
    "self" (the default) drops a document only where it *is* the query (same id and the same text, as
    the document's text or its title + text, whitespace and case aside); "drop" is BEIR's rule (every
    same-id document); "keep" drops none."""
    if rule not in IDENTICAL_ID_RULES:
        raise ValueError(f"identical-id rule {rule!r}; allowed: {', '.join(IDENTICAL_ID_RULES)}")
    if rule == "keep":
        return {}
    same_id = [q for q in queries if q in corpus]
    if rule == "drop":
        return {q: q for q in same_id}
    return {q: q for q in same_id if _plain(queries[q]) in (_plain(corpus[q].get("text", "")), _plain(doc_text(corpus[q])))}


def _plain(text: str) -> str:
    return " ".join(text.split()).casefold()


def doc_text(doc: dict[str, str]) -> str:
    return (doc.get("title", "") + " " + doc.get("text", "")).strip()


def read_corpus_lines(folder: str | Path) -> tuple[dict[str, dict[str, str]], dict[str, bool]]:
    """The corpus as BEIR's GenericDataLoader reads it (a repeated `_id`: the last line wins, at the id's first
    place), in any folder layout of magclip/data/retrieval_folder.py, and the repeated ids, each with whether a
    later line changed its title or text."""
    files = corpus_files(Path(folder))
    if not files:
        check_folder(folder, "test")  # refuses, naming what was looked for
    corpus: dict[str, dict[str, str]] = {}
    repeated: dict[str, bool] = {}
    for row in rows(files, "corpus"):
        doc_id, doc = str(row["_id"]), {"title": row.get("title") or "", "text": row.get("text") or ""}
        if doc_id in corpus:
            repeated[doc_id] = repeated.get(doc_id, False) or corpus[doc_id] != doc
        corpus[doc_id] = doc
    if not corpus:
        raise ValueError(f"{files[0]}: empty corpus (no documents)")
    return corpus, repeated


def read_corpus(folder: str | Path) -> dict[str, dict[str, str]]:
    """The corpus as BEIR reads it; repeated ids are logged (`load_beir` reports them in full)."""
    corpus, repeated = read_corpus_lines(folder)
    if repeated:
        log.warning("%s: %d document ids repeat in the corpus (the last line of each is kept, as BEIR does), "
                    "e.g. %s", folder, len(repeated), list(repeated)[:5])
    return corpus


def read_query_lines(folder: str | Path, split: str | None = None) -> tuple[dict[str, str], list[str]]:
    """The queries as BEIR reads them (a repeated `_id`: the last text wins) and the repeated ids."""
    queries: dict[str, str] = {}
    repeated: dict[str, None] = {}
    for row in rows(queries_files(Path(folder), split), "queries"):
        query_id = str(row["_id"])
        if query_id in queries:
            repeated[query_id] = None
        queries[query_id] = row.get("text") or ""
    return queries, list(repeated)


def read_queries(folder: str | Path, split: str | None = None) -> dict[str, str]:
    return read_query_lines(folder, split)[0]


def read_qrels(path: str | Path) -> dict[str, dict[str, int]]:
    """A qrels file in BEIR's layout (with or without its header) or TREC's (MS MARCO's qrels), by signature."""
    return read_qrels_lines(path)[0]


def read_qrels_lines(path: str | Path) -> tuple[dict[str, dict[str, int]], dict[tuple[str, str], bool]]:
    """The qrels as BEIR reads them (a repeated (query, document) row: the last score wins) and the repeated
    pairs, each with whether a later row changed its score (magclip/data/qrels.py recognises the layout)."""
    read = read_qrels_file(path)
    return read.qrels, read.repeated


def check_beir_folder(folder: str | Path, split: str = "test") -> Path:
    """The split's (first) qrels file, or an error naming what the folder lacks (checked before a model loads)."""
    return check_folder(folder, split)[2][0]


def load_beir(folder: str | Path, split: str = "test") -> BeirData:
    """A retrieval folder in any of the field's layouts (BEIR, its gzipped hub copy, MTEB's parquet, MS MARCO)."""
    folder = Path(folder)
    qrels_files = check_folder(folder, split)[2]
    qrels_file = qrels_files[0]
    corpus, repeated_docs = read_corpus_lines(folder)
    all_queries, repeated_queries = read_query_lines(folder, split)
    judged = read_qrels_files(qrels_files)
    qrels, repeated_qrels = judged.qrels, judged.repeated
    if not qrels:
        raise ValueError(f"{qrels_file}: no judgements")
    missing = [q for q in qrels if q not in all_queries]
    if missing:
        raise ValueError(f"{qrels_file}: {len(missing)} judged query ids are not in queries.jsonl, e.g. {missing[:3]}")
    warnings: dict[str, int] = {}
    empty = [q for q in qrels if not all_queries[q].strip()]
    if empty:
        warnings["queries_without_text"] = len(empty)
        log.warning("%s: %d judged queries have no text in queries.jsonl and are left out, e.g. %s",
                    folder, len(empty), empty[:3])
        dropped = set(empty)
        qrels = {q: docs for q, docs in qrels.items() if q not in dropped}
        if not qrels:
            raise ValueError(f"{folder / 'queries.jsonl'}: none of the {len(empty)} queries judged in {qrels_file} "
                             f"has text, e.g. {empty[:3]}")
    unknown = [(q, d) for q, docs in qrels.items() for d in docs if d not in corpus]
    if unknown:
        if len(unknown) == sum(len(docs) for docs in qrels.values()):
            raise ValueError(f"{qrels_file}: none of the judged documents is in {folder / 'corpus.jsonl'}, "
                             f"e.g. {unknown[0][1]!r} (query {unknown[0][0]!r}); wrong corpus?")
        orphans = [q for q, docs in qrels.items() if not any(s >= 1 and d in corpus for d, s in docs.items())
                   and any(s >= 1 for s in docs.values())]
        warnings["qrels_unknown_docs"] = len(unknown)
        warnings["queries_without_known_relevant"] = len(orphans)
        log.warning("%s: %d judgements name documents that are not in corpus.jsonl (kept, as BEIR does: they count "
                    "against recall), e.g. %s; %d queries have no relevant document in the corpus and score 0",
                    qrels_file, len(unknown), [d for _, d in unknown[:3]], len(orphans))
    queries = {q: all_queries[q] for q in all_queries if q in qrels}
    report = read_report(folder, split, qrels, repeated_docs, repeated_queries,
                         [q for q in all_queries if q not in qrels])
    report.update(qrels_report(qrels_file, qrels, repeated_qrels))
    return BeirData(folder.name, corpus, queries, qrels, split, warnings, report)


def read_report(folder: Path, split: str, qrels: dict[str, dict[str, int]], repeated_docs: dict[str, bool],
                repeated_queries: list[str], unjudged: list[str], show: int = 10) -> dict[str, Any]:
    """What reading the folder as BEIR reads it did to what is evaluated (see the module docstring), logged:
    repeated document ids (how many changed the text; the judged ones by id), repeated query ids, and the
    queries without a judgement in the split (left out; the first `show` ids)."""
    judged = {d for docs in qrels.values() for d in docs}
    judged_repeats = [d for d in repeated_docs if d in judged]
    report = {"duplicate_doc_ids": len(repeated_docs),
              "duplicate_doc_ids_changed": sum(repeated_docs.values()),
              "duplicate_doc_ids_judged": len(judged_repeats),
              "duplicate_doc_ids_judged_first": judged_repeats[:show],
              "duplicate_query_ids": len(repeated_queries),
              "duplicate_query_ids_first": repeated_queries[:show],
              "unjudged_queries": len(unjudged), "unjudged_query_ids_first": unjudged[:show]}
    if repeated_docs:
        log.warning("%s: %d document ids repeat in corpus.jsonl (%d with another title or text); the last line "
                    "of each is kept, as BEIR does; %d of them are judged in %s: %s", folder / "corpus.jsonl",
                    len(repeated_docs), report["duplicate_doc_ids_changed"], len(judged_repeats), split,
                    judged_repeats[:show] or "none")
    if repeated_queries:
        log.warning("%s: %d query ids repeat in queries.jsonl (the last text is kept, as BEIR does), e.g. %s",
                    folder / "queries.jsonl", len(repeated_queries), repeated_queries[:show])
    if unjudged:
        log.info("%s: %d queries have no judgement in %s and are left out (as BEIR does), e.g. %s",
                 folder / "queries.jsonl", len(unjudged), split, unjudged[:show])
    return report


def qrels_report(qrels_file: Path, qrels: dict[str, dict[str, int]], repeated: dict[tuple[str, str], bool],
                 show: int = 10) -> dict[str, Any]:
    """Repeated (query, document) rows (the last score kept, as BEIR does) and the evaluated queries whose
    judgements are all 0 (no relevant document: they score 0 in every mean, as in BEIR), logged."""
    all_zero = [q for q, docs in qrels.items() if not any(s > 0 for s in docs.values())]
    report = {"repeated_qrels": len(repeated), "repeated_qrels_changed": sum(repeated.values()),
              "repeated_qrels_first": [f"{q}\t{d}" for q, d in list(repeated)[:show]],
              "queries_all_zero": len(all_zero), "queries_all_zero_ids_first": all_zero[:show]}
    if repeated:
        log.warning("%s: %d (query, document) pairs are judged on more than one row (%d with another score); the "
                    "last row of each is kept, as BEIR does, e.g. %s", qrels_file, len(repeated),
                    report["repeated_qrels_changed"], report["repeated_qrels_first"])
    if all_zero:
        log.warning("%s: %d of %d queries have only judgements of 0 (no relevant document); they stay in the "
                    "evaluation and score 0 in every mean, as in BEIR, e.g. %s", qrels_file, len(all_zero),
                    len(qrels), all_zero[:show])
    return report


def beir_to_pairs(folder: str | Path, split: str = "train", out: str | Path | None = None, *, min_score: int = 1,
                  random_negatives: int = 0, seed: int = 0, sample: int | None = None) -> list[dict[str, Any]]:
    """Training records {query, positive: [..], negatives: [..], query_id, positive_ids} from a split's qrels.

    Queries whose judged documents are all below `min_score` (or missing from the corpus) are left out
    and counted in the printed summary. `sample`: keep that many records drawn at random (`seed`; in
    the split's order), not the first ones: a split's order follows its source (SQuAD: article by
    article), so its head is a few topics. Written as JSONL to `out` when given.
    """
    data = load_beir(folder, split)
    rng = random.Random(seed)
    all_ids = list(data.corpus)
    records, dropped = [], 0
    for qid, text in data.queries.items():
        pos_ids = [d for d, s in data.qrels[qid].items() if s >= min_score and d in data.corpus]
        if not pos_ids or not text.strip():
            dropped += 1
            continue
        judged = set(data.qrels[qid])
        negs: list[str] = []
        while len(negs) < random_negatives and len(judged) + len(negs) < len(all_ids):
            d = rng.choice(all_ids)
            if d not in judged and d not in negs:
                negs.append(d)
        records.append({"query": text, "positive": [doc_text(data.corpus[d]) for d in pos_ids],
                        "negatives": [doc_text(data.corpus[d]) for d in negs],
                        "query_id": qid, "positive_ids": pos_ids, "negative_ids": negs})
    usable = len(records)
    if sample is not None and sample < usable:
        keep = sorted(random.Random(f"sample-{seed}").sample(range(usable), sample))
        records = [records[i] for i in keep]
    if out is not None:
        atomic_write_jsonl(out, records)
    print(f"{data.name}/{split}: {len(records)} pair records"
          + (f" drawn at random from {usable}" if len(records) < usable else "")
          + f" ({dropped} queries without a usable positive left out)" + (f" -> {out}" if out is not None else ""))
    return records
