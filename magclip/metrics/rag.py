"""The retrieval side of retrieval-augmented QA: answer recall@k and gold-passage accuracy, plus a
hook that feeds the retrieved passages to a causal LM and scores its answers by exact match.

Data (`load_qa`): a folder with `qa.jsonl` (`id`, `question`, `answers`: list of strings; optional
`passage_id`) over a BEIR `corpus.jsonl` (`_id`, `title`, `text`). The gold passage comes from
`qrels/<split>.tsv` (rows with score >= 1); without that file, from each row's `passage_id` (the
entry records `gold_source`); with neither, a FileNotFoundError naming the qrels file.
Distractor corpora (`load_distractors`) are other BEIR folders whose documents join the pool with
ids prefixed `<folder name>:` so they can never collide with the main corpus (a collision that
remains is an error).

Answer normalization (`normalize_answer`) is SQuAD v1.1's, written out here: lowercase; delete
every ASCII punctuation character (Python's `string.punctuation`; other symbols such as curly
quotes or en dashes are kept, as in SQuAD); replace the whole words a / an / the with a space;
collapse runs of whitespace to one space and strip. `exact_match` is SQuAD's EM: 1 when the
normalized prediction equals the normalized form of any gold answer.

Finding an answer in a passage (`answer_match`), two rules:

- "token" (default): both strings get `normalize_for_match`, which is SQuAD's normalization except
  that every character that is not a letter, digit or space (any punctuation or symbol, ASCII or
  not, and "_") becomes a space instead of being deleted; then the answer must occur on whole-token
  boundaries (`" " + answer + " "` a substring of `" " + passage + " "`). "4" does not match
  "1234", "Manning" matches "Manning's", "six" matches "Six-time".
- "substring": both strings get SQuAD's `normalize_answer` and the answer may occur anywhere, the
  literal reading of "the normalized answer occurs in the passage". It also matches "24" in "1924".

Why "token" is the default, measured on xquad_en with each question's own gold passage (an upper
bound on answer recall): SQuAD normalization + whole tokens finds the answer in 98.5 % of them
(deleting the apostrophe of "Manning's" leaves "mannings"); "substring" in 100 %, but it matches
1.9 other passages per question against 1.2 for "token"; "token" finds 99.9 % (the one miss is an
answer cut off in the data). `answer_in_gold_passage` reports this bound for every dataset.

Metrics (`rag_metrics`; every value a mean over questions, 0-1 scale):

| name                   | per question                                                            |
|------------------------|-------------------------------------------------------------------------|
| answer_recall@k        | 1 if a gold answer occurs (under `answer_match`, see above) in the     |
|                        | *text* (not the title) of one of the top-k passages                     |
| gold_passage_acc@1     | 1 if the top-ranked passage is a gold passage                           |
| gold_passage_recall@k  | 1 if a gold passage is among the top k                                  |
| answer_in_gold_passage | 1 if a gold answer occurs in a gold passage: the bound on the above    |

Questions whose answers all normalize to the empty string (or have no text) are left out and
counted, never scored 0 silently. The gold-passage metrics are averaged over the questions that have a gold
passage in the corpus (`gold_questions`); the others are counted in `warnings`.

With distractors, two more entries show what they did: `distractor_top1` (share of questions whose
top passage is a distractor) and `answer_only_in_distractors@k` (share whose top k contain the
answer string only in distractor passages). The answer-string criterion can credit a distractor that
happens to contain the string (a number, a common word), so answer recall with distractors is *not*
bounded by the recall without them; gold-passage accuracy is. Main-corpus and distractor documents
are encoded separately, so adding distractors never changes a main-corpus vector.

Generator hook (`generate_answers`): loads any Hugging Face causal LM and its tokenizer from a
*local* folder (`local_files_only=True`; nothing is downloaded), builds one prompt per question from
its top `k_ctx` passages (`PROMPT_TEMPLATE` / `PASSAGE_TEMPLATE`, below), decodes greedily for
`max_new_tokens` tokens and keeps the first line of the continuation, stripped. Prompts that do not
fit the model's context (minus `max_new_tokens`) have their passages cut, each to an equal share of
the remaining tokens; the question and the "Answer:" cue are always kept. Plain completion prompt:
no chat template is applied. The repository's tests run this hook only with a tiny randomly
initialized GPT-2 (no real LLM can be loaded there), which checks that it runs end to end and that
EM is computed; the EM such a model gets is meaningless.
"""

from __future__ import annotations

import logging
import re
import string
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from magclip.data.beir import doc_text, read_corpus, read_jsonl, read_qrels
from magclip.metrics.ir import search
from magclip.similarity import Scorer

log = logging.getLogger("magclip.rag")

DEFAULT_KS = (1, 5, 20)
PUNCTUATION = frozenset(string.punctuation)
ANSWER_MATCHES = ("token", "substring")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NOT_WORD = re.compile(r"[^\w\s]|_")

PASSAGE_TEMPLATE = "Passage {i}: {text}"
PROMPT_TEMPLATE = ("Answer the question using the passages. Reply with a short answer only.\n\n"
                   "{passages}\n\nQuestion: {question}\nAnswer:")


# ---------------------------------------------------------------------------- normalization
def normalize_answer(text: str) -> str:
    """SQuAD v1.1 normalization: lowercase, drop ASCII punctuation, drop a/an/the, collapse whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    """SQuAD EM: 1.0 when the normalized prediction equals any normalized gold answer."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(a) for a in answers))


def normalize_for_match(text: str) -> str:
    """SQuAD's normalization, but any character other than a letter, digit or space becomes a space."""
    text = _NOT_WORD.sub(" ", text.lower())
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def match_normalizer(answer_match: str) -> Callable[[str], str]:
    """The normalization both passage and answer get under an `answer_match` rule."""
    if answer_match not in ANSWER_MATCHES:
        raise ValueError(f"unknown answer_match {answer_match!r}; use {' or '.join(ANSWER_MATCHES)}")
    return normalize_for_match if answer_match == "token" else normalize_answer


def contains_answer(normalized_passage: str, normalized_answers: Sequence[str], answer_match: str = "token") -> bool:
    """A normalized answer occurs in the normalized passage: on whole-token boundaries ("token") or
    anywhere ("substring"). Both arguments already normalized by `match_normalizer(answer_match)`;
    an empty answer never occurs."""
    if answer_match == "substring":
        return any(a and a in normalized_passage for a in normalized_answers)
    if answer_match != "token":
        match_normalizer(answer_match)  # raises
    padded = f" {normalized_passage} "
    return any(a and f" {a} " in padded for a in normalized_answers)


# ---------------------------------------------------------------------------- data
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


# ---------------------------------------------------------------------------- metrics
def rag_metrics(ranked: Sequence[Sequence[str]], answers: Sequence[Sequence[str]], gold: Sequence[Sequence[str]],
                normalized_texts: Mapping[str, str], ks: Sequence[int] = DEFAULT_KS,
                distractor_ids: set[str] | frozenset[str] = frozenset(), answer_match: str = "token") -> dict[str, Any]:
    """Means over questions of answer_recall@k, gold_passage_acc@1, gold_passage_recall@k (see module doc).

    ranked[i]: passage ids for question i, best first (at least max(ks) of them when the pool allows);
    answers[i]: its gold answer strings; gold[i]: its gold passage ids (empty: left out of gold_*);
    normalized_texts: passage id -> match_normalizer(answer_match)(passage text), for every ranked
    and gold passage.
    """
    norm_fn = match_normalizer(answer_match)
    if not (len(ranked) == len(answers) == len(gold)):
        raise ValueError(f"ranked, answers and gold differ in length: {len(ranked)}, {len(answers)}, {len(gold)}")
    if not ranked:
        raise ValueError("no questions to score")
    ks = sorted({int(k) for k in ks})
    if ks[0] < 1:
        raise ValueError(f"k must be >= 1, got {ks[0]}")
    n = len(ranked)
    hit_rank: list[int | None] = []       # 1-based rank of the first answer-bearing passage
    main_hit_rank: list[int | None] = []  # same, main-corpus passages only
    gold_rank: list[int | None] = []
    in_gold: list[bool] = []
    for ids, ans, gd in zip(ranked, answers, gold):
        norm = [norm_fn(a) for a in ans]
        in_gold.append(any(contains_answer(normalized_texts[d], norm, answer_match) for d in gd))
        first = first_main = None
        for r, did in enumerate(ids, start=1):
            if contains_answer(normalized_texts[did], norm, answer_match):
                first = first or r
                if did not in distractor_ids:
                    first_main = r
                    break
        hit_rank.append(first)
        main_hit_rank.append(first_main)
        gset = set(gd)
        gold_rank.append(next((r for r, did in enumerate(ids, start=1) if did in gset), None) if gset else None)
    out: dict[str, Any] = {}
    for k in ks:
        out[f"answer_recall@{k}"] = sum(r is not None and r <= k for r in hit_rank) / n
    judged = [r for r, gd in zip(gold_rank, gold) if gd]
    out["gold_passage_acc@1"] = sum(r == 1 for r in judged) / len(judged) if judged else None
    for k in ks:
        out[f"gold_passage_recall@{k}"] = (sum(r is not None and r <= k for r in judged) / len(judged)
                                           if judged else None)
    out["answer_in_gold_passage"] = (sum(hit for hit, gd in zip(in_gold, gold) if gd) / len(judged)
                                     if judged else None)
    if distractor_ids:
        out["distractor_top1"] = sum(bool(ids) and ids[0] in distractor_ids for ids in ranked) / n
        for k in ks:
            out[f"answer_only_in_distractors@{k}"] = sum(
                h is not None and h <= k and (m is None or m > k) for h, m in zip(hit_rank, main_hit_rank)) / n
    out["questions"] = n
    out["gold_questions"] = len(judged)
    out["answer_match"] = answer_match
    return out


def evaluate_rag(encode: Callable[[list[str], str], Tensor], data: QAData, scorers: Sequence[Scorer | str], *,
                 distractors: Mapping[str, dict[str, str]] | None = None, ks: Sequence[int] = DEFAULT_KS,
                 backend: str = "auto", keep_ranked: int = 0, answer_match: str = "token") -> dict[str, Any]:
    """Encode once, rank the pool (corpus + distractors) under every scorer, score each ranking.

    Returns {"by_mode": {label: metrics}, "ranked": {label: [[passage id] per question]} (top
    `keep_ranked`, when > 0), "qids", "passages", "distractor_passages", timings}. Passages are encoded
    as title + " " + text (`doc_text`, as BEIR); answers are matched against the text alone.
    """
    scorers = [Scorer.build(s) for s in scorers]
    distractors = dict(distractors or {})
    clash = set(distractors) & set(data.corpus)
    if clash:
        raise ValueError(f"distractor ids collide with corpus ids, e.g. {sorted(clash)[:3]}")
    main_ids, extra_ids = list(data.corpus), list(distractors)
    pool_ids = main_ids + extra_ids
    docs = {**data.corpus, **distractors}
    norm_fn = match_normalizer(answer_match)
    normalized = {d: norm_fn(docs[d].get("text", "")) for d in pool_ids}
    qids = list(data.questions)
    t0 = time.perf_counter()
    doc_vecs = encode([doc_text(data.corpus[d]) for d in main_ids], "passage")
    if extra_ids:  # separately: the main vectors never depend on the distractors
        doc_vecs = torch.cat([doc_vecs, encode([doc_text(distractors[d]) for d in extra_ids], "passage")])
    t1 = time.perf_counter()
    query_vecs = encode([data.questions[q] for q in qids], "query")
    t2 = time.perf_counter()
    depth = max(max(ks), keep_ranked)
    by_mode, ranked_by_mode = {}, {}
    for scorer in scorers:
        _, idx = search(query_vecs, doc_vecs, scorer, depth, backend=backend)
        ranked = [[pool_ids[j] for j in row if j >= 0] for row in idx.tolist()]
        m = rag_metrics(ranked, [data.answers[q] for q in qids], [data.gold[q] for q in qids], normalized, ks,
                        frozenset(extra_ids), answer_match)
        m["scorer"] = scorer.to_dict()
        label = scorer.label
        by_mode[label] = m
        if keep_ranked:
            ranked_by_mode[label] = [r[:keep_ranked] for r in ranked]
    t3 = time.perf_counter()
    return {"by_mode": by_mode, "ranked": ranked_by_mode, "qids": qids, "passages": len(pool_ids),
            "distractor_passages": len(extra_ids), "doc_norm_mean": float(doc_vecs.norm(dim=-1).mean()),
            "query_norm_mean": float(query_vecs.norm(dim=-1).mean()), "encode_docs_s": round(t1 - t0, 2),
            "encode_queries_s": round(t2 - t1, 2), "search_s": round(t3 - t2, 3)}


# ---------------------------------------------------------------------------- generator hook
def build_prompt(question: str, passages: Sequence[str]) -> str:
    """PROMPT_TEMPLATE filled with the passages (numbered from 1, best first) and the question."""
    block = "\n".join(PASSAGE_TEMPLATE.format(i=i, text=" ".join(p.split())) for i, p in enumerate(passages, 1))
    return PROMPT_TEMPLATE.format(passages=block, question=" ".join(question.split()))


def context_limit(model, tokenizer) -> int | None:
    """The model's context length in tokens, when it says (max_position_embeddings / n_positions)."""
    cfg = model.config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < 10**7 else None


def fit_prompt(tokenizer, question: str, passages: Sequence[str], limit: int | None) -> tuple[str, int]:
    """(prompt, passages cut): the passages are cut, each to an equal token share, until the prompt fits `limit`."""
    def length(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=True)["input_ids"])

    prompt = build_prompt(question, passages)
    if limit is None or not passages or length(prompt) <= limit:
        return prompt, 0
    tokens = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in passages]
    spare = limit - length(build_prompt(question, [""] * len(passages)))
    share = max(spare // len(passages), 0)
    while True:
        cut = [tokenizer.decode(t[:share], skip_special_tokens=True) if len(t) > share else p
               for t, p in zip(tokens, passages)]
        prompt = build_prompt(question, cut)
        if share == 0 or length(prompt) <= limit:
            return prompt, sum(len(t) > share for t in tokens)
        share = int(share * 0.9)


@torch.no_grad()
def generate_answers(generator_path: str | Path, questions: Sequence[str], retrieved_passages: Sequence[Sequence[str]],
                     k_ctx: int = 3, max_new_tokens: int = 16, *, batch_size: int = 8, device: str | None = None,
                     max_prompt_tokens: int | None = None) -> list[str]:
    """One answer per question from a local Hugging Face causal LM given its top `k_ctx` passages.

    Greedy decoding, left-padded batches, the first line of the continuation (stripped). See the
    module docstring for the prompt and for how over-long prompts are cut.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(generator_path)
    if not path.is_dir():
        raise FileNotFoundError(f"generator {generator_path}: not a local folder (a causal LM saved with "
                                "save_pretrained; nothing is downloaded)")
    if len(questions) != len(retrieved_passages):
        raise ValueError(f"{len(questions)} questions but {len(retrieved_passages)} passage lists")
    if k_ctx < 1 or max_new_tokens < 1:
        raise ValueError(f"k_ctx and max_new_tokens must be >= 1, got {k_ctx} and {max_new_tokens}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True).to(device).eval()
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"generator {generator_path}: its tokenizer has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    tokenizer.truncation_side = "left"  # last resort: keep the question and the "Answer:" cue
    limit = max_prompt_tokens
    if limit is None:
        ctx = context_limit(model, tokenizer)
        limit = None if ctx is None else ctx - max_new_tokens
    if limit is not None and limit < 1:
        raise ValueError(f"generator context too short for max_new_tokens={max_new_tokens}")
    prompts, cut = [], 0
    for q, ps in zip(questions, retrieved_passages):
        prompt, n = fit_prompt(tokenizer, q, list(ps)[:k_ctx], limit)
        prompts.append(prompt)
        cut += n
    if cut:
        log.info("generator: %d passages cut to fit %d prompt tokens", cut, limit)
    eos = tokenizer.eos_token_id
    answers: list[str] = []
    for start in range(0, len(prompts), batch_size):
        enc = tokenizer(prompts[start:start + batch_size], return_tensors="pt", padding=True,
                        truncation=limit is not None, max_length=limit)
        enc = {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=eos)
        continuation = out[:, enc["input_ids"].shape[1]:]
        for text in tokenizer.batch_decode(continuation, skip_special_tokens=True):
            answers.append(text.strip().split("\n")[0].strip())
    return answers


def generator_exact_match(predictions: Sequence[str], answers: Sequence[Sequence[str]]) -> float:
    """Mean SQuAD EM of the predictions."""
    if len(predictions) != len(answers) or not predictions:
        raise ValueError(f"need as many predictions as answer lists (> 0), got {len(predictions)} and {len(answers)}")
    return sum(exact_match(p, a) for p, a in zip(predictions, answers)) / len(predictions)

