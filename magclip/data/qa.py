"""QA sets for the RAG check over a BEIR corpus.

Data (`load_qa`): a folder with `qa.jsonl` (`id`, `question`, `answers`: list of strings; optional
`passage_id`) over a BEIR `corpus.jsonl` (`_id`, `title`, `text`). The gold passage comes from
`qrels/<split>.tsv` (rows with score >= 1); without that file, from each row's `passage_id` (the
entry records `gold_source`); with neither, a FileNotFoundError naming the qrels file.
Distractor corpora (`load_distractors`) are other BEIR folders whose documents join the pool with
ids prefixed `<folder name>:` so they can never collide with the main corpus (a collision that
remains is an error).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from magclip.data.beir import read_corpus, read_qrels
from magclip.data.retrieval_folder import read_jsonl
from magclip.metrics.rag import normalize_answer, normalize_for_match

log = logging.getLogger("magclip.rag")


@dataclass
class QAData:
    name: str
    corpus: dict[str, dict[str, str]]   # passage id -> {"title", "text"}
    questions: dict[str, str]            # question id -> question text
    answers: dict[str, list[str]]        # question id -> gold answer strings
    gold: dict[str, list[str]]           # question id -> gold passage ids in the corpus (may be empty)
    gold_source: str = "qrels"
    warnings: dict[str, int] = field(default_factory=dict)


def _count(warnings: dict[str, int], key: str, ids: list[str], message: str, where: Any) -> None:
    if ids:
        warnings[key] = warnings.get(key, 0) + len(ids)
        log.warning("%s: %d %s, e.g. %s", where, len(ids), message, ids[:3])


def load_qa(folder: str | Path, split: str = "test") -> QAData:
    """Questions, answers and gold passages from `qa.jsonl` + `corpus.jsonl` (+ `qrels/<split>.tsv`).

    Errors (naming the file and id): a missing qa.jsonl or corpus.jsonl, an empty corpus, a row
    without `id`, a repeated id, no usable question, gold passages none of which is in the corpus,
    and no gold passages at all (no qrels file and no `passage_id`). Counted warnings (in
    `QAData.warnings`, logged): questions without text or without a usable answer (left out),
    qrels rows naming unknown questions (ignored) or unknown passages, and questions without a gold
    passage in the corpus (kept for answer recall, left out of the gold-passage metrics).
    """
    folder = Path(folder)
    qa_file, corpus_file = folder / "qa.jsonl", folder / "corpus.jsonl"
    qrels_file = folder / "qrels" / f"{split}.tsv"
    for needed in (qa_file, corpus_file):
        if not needed.is_file():
            raise FileNotFoundError(f"{folder} is not a QA folder: {needed} is missing")
    corpus = read_corpus(folder)  # raises on an empty corpus
    warnings: dict[str, int] = {}
    questions: dict[str, str] = {}
    answers: dict[str, list[str]] = {}
    passage_ids: dict[str, str] = {}
    no_text, no_answer = [], []
    for number, row in enumerate(read_jsonl(qa_file), start=1):
        if "id" not in row:
            raise ValueError(f"{qa_file}: record {number} has no 'id'")
        qid = str(row["id"])
        if qid in questions or qid in no_text or qid in no_answer:
            raise ValueError(f"{qa_file}: question id {qid!r} occurs more than once")
        text = str(row.get("question") or "").strip()
        gold_answers = row.get("answers") or []
        if isinstance(gold_answers, str):
            gold_answers = [gold_answers]
        gold_answers = [str(a) for a in gold_answers if a is not None]
        if not text:
            no_text.append(qid)
            continue
        if not any(normalize_answer(a) and normalize_for_match(a) for a in gold_answers):
            no_answer.append(qid)
            continue
        questions[qid], answers[qid] = text, gold_answers
        if row.get("passage_id") is not None:
            passage_ids[qid] = str(row["passage_id"])
    _count(warnings, "questions_without_text", no_text, "questions have no text and are left out", qa_file)
    _count(warnings, "questions_without_answer", no_answer,
           "questions have no answer that survives normalization and are left out", qa_file)
    if not questions:
        raise ValueError(f"{qa_file}: no question with text and an answer")

    if qrels_file.is_file():
        qrels = read_qrels(qrels_file)
        gold_source = str(Path("qrels") / f"{split}.tsv")
        _count(warnings, "qrels_unknown_questions", [q for q in qrels if q not in questions and q not in no_text
                                                     and q not in no_answer],
               "judged question ids are not in qa.jsonl (ignored)", qrels_file)
        raw_gold = {q: [d for d, s in qrels.get(q, {}).items() if s >= 1] for q in questions}
        disagree = [q for q in questions if q in passage_ids and raw_gold[q] and passage_ids[q] not in raw_gold[q]]
        _count(warnings, "gold_disagrees_with_passage_id", disagree,
               "questions have a passage_id that qrels does not judge relevant (qrels wins)", qrels_file)
    elif passage_ids:
        gold_source = "qa.jsonl passage_id"
        log.info("%s: %s is absent; gold passages come from qa.jsonl's passage_id", folder, qrels_file)
        raw_gold = {q: [passage_ids[q]] if q in passage_ids else [] for q in questions}
    else:
        raise FileNotFoundError(f"{folder}: no gold passages: {qrels_file} is missing and qa.jsonl has no passage_id")
    unknown = [d for q in questions for d in raw_gold[q] if d not in corpus]
    if unknown and len(unknown) == sum(len(v) for v in raw_gold.values()):
        raise ValueError(f"{folder}: none of the gold passages ({gold_source}) is in {corpus_file}, "
                         f"e.g. {unknown[0]!r}; wrong corpus?")
    _count(warnings, "gold_unknown_passages", unknown, f"gold passages ({gold_source}) are not in corpus.jsonl",
           folder)
    gold = {q: [d for d in raw_gold[q] if d in corpus] for q in questions}
    _count(warnings, "questions_without_gold", [q for q in questions if not gold[q]],
           "questions have no gold passage in the corpus (left out of gold_passage_*, kept for answer recall)",
           folder)
    return QAData(folder.name, corpus, questions, answers, gold, gold_source, warnings)


def load_distractors(folders: Sequence[str | Path], taken: set[str] | Sequence[str] = ()) -> tuple[
        dict[str, dict[str, str]], dict[str, int]]:
    """Documents of each folder's corpus.jsonl with ids `<name>:<id>`; ({id: doc}, {name: count}).

    A repeated folder name gets `#2`, `#3`...; an id that still collides with `taken` or another
    distractor is an error. An empty or missing corpus.jsonl is an error naming the file.
    """
    taken = set(taken)
    docs: dict[str, dict[str, str]] = {}
    counts: dict[str, int] = {}
    for folder in folders:
        folder = Path(folder)
        if not (folder / "corpus.jsonl").is_file():
            raise FileNotFoundError(f"distractor folder {folder}: {folder / 'corpus.jsonl'} is missing")
        name, n = folder.name, 1
        while name in counts:
            n += 1
            name = f"{folder.name}#{n}"
        corpus = read_corpus(folder)
        for did, doc in corpus.items():
            new = f"{name}:{did}"
            if new in taken or new in docs:
                raise ValueError(f"distractor id {new!r} (from {folder}) collides with an id already in the pool")
            docs[new] = doc
        counts[name] = len(corpus)
    return docs, counts
