"""Pure metrics of the retrieval side of retrieval-augmented QA: answer recall@k and gold-passage
accuracy of a ranking, and SQuAD's exact match of generated answers. Data loading is
`magclip.data.qa`; retrieval and the generator hook are `magclip.evaluation.rag`.

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
"""

from __future__ import annotations

import re
import string
from typing import Any, Callable, Mapping, Sequence

DEFAULT_KS = (1, 5, 20)
PUNCTUATION = frozenset(string.punctuation)
ANSWER_MATCHES = ("token", "substring")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NOT_WORD = re.compile(r"[^\w\s]|_")


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


# ---------------------------------------------------------------------------- metrics
def rag_metrics(ranked: Sequence[Sequence[str]], answers: Sequence[Sequence[str]], gold: Sequence[Sequence[str]],
                normalized_texts: Mapping[str, str], ks: Sequence[int] = DEFAULT_KS,
                distractor_ids: set[str] | frozenset[str] = frozenset(), answer_match: str = "token",
                per_question: bool = False) -> dict[str, Any]:
    """Means over questions of answer_recall@k, gold_passage_acc@1, gold_passage_recall@k (see module doc).
    With `per_question`, also "per_question": `per_question_hits`.

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
    if per_question:
        out["per_question"] = per_question_hits(hit_rank, gold_rank, gold, ks)
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


def per_question_hits(hit_rank: Sequence[int | None], gold_rank: Sequence[int | None], gold: Sequence[Sequence[str]],
                      ks: Sequence[int]) -> dict[str, tuple[list[int], list[float]]]:
    """metric -> (question indices, 0/1 per question) behind each mean of `rag_metrics`: answer recall
    over every question, the gold-passage metrics over the questions with a gold passage."""
    every = list(range(len(hit_rank)))
    judged = [i for i in every if gold[i]]
    out = {f"answer_recall@{k}": (every, [float(r is not None and r <= k) for r in hit_rank]) for k in ks}
    if judged:
        out["gold_passage_acc@1"] = (judged, [float(gold_rank[i] == 1) for i in judged])
        for k in ks:
            out[f"gold_passage_recall@{k}"] = (judged, [float(gold_rank[i] is not None and gold_rank[i] <= k)
                                                         for i in judged])
    return out


def generator_exact_match(predictions: Sequence[str], answers: Sequence[Sequence[str]]) -> float:
    """Mean SQuAD EM of the predictions."""
    if len(predictions) != len(answers) or not predictions:
        raise ValueError(f"need as many predictions as answer lists (> 0), got {len(predictions)} and {len(answers)}")
    return sum(exact_match(p, a) for p, a in zip(predictions, answers)) / len(predictions)

