"""Length-mixing variants of a BEIR folder: a share p of the documents replaced by a short form of itself.

Real corpora mix records of very different lengths (title-only entries beside abstracts, snippets beside
full pages); the BEIR sets shipped here do not. A variant makes that mix on purpose, with queries and
judgements unchanged, so a scoring mode's nDCG@10 against p says how much of what it does is a length
prior. Nothing here knows a model: lengths are in whitespace words and characters (the scoring side,
magclip.experiments.length_mix, adds token counts).

The short form of a document (`short_form`):
- its title, where the set has titles of its own records (`has_own_titles`: at least 90 % of the
  documents carry a non-empty title and at least 90 % of those titles are distinct): the record becomes
  title-only (`text` empty). A document of such a set without a title falls back to the next rule.
- else its first sentence (`first_sentence`), the title field kept as it is: in a set whose titles are
  shared by many records (XQuAD's passages carry their Wikipedia article's name, 5 passages per title)
  a title is not a short form of one record, and making several documents identical would change the
  task rather than the lengths.
A short form can equal the whole record (a one-sentence text); such a document is still "replaced"
(the choice does not look at it) and counted as `short_is_whole`.

The choice (`replaced_ids`): one permutation of the corpus (in its file order) drawn from the seed with
numpy's default_rng; share p replaces the first round(p·N) documents of it, relevant and non-relevant
alike. One seed's choices are nested: what p = 0.25 replaces, p = 0.5 replaces too, so the curve against
p is paired within a seed. p = 0 is the corpus itself: one folder, no seed.
Length and relevance (`replaced_ids_by_relevance`): real corpora's short records are less often relevant
(pivoted length normalisation's finding), so a second choice draws the share p_non among the documents no
query judges relevant and p_rel among the judged relevant ones, each class by its own seeded permutation.

`write_variants` writes one BEIR folder per (p, seed): `corpus.jsonl` (the same ids in the same order),
`queries.jsonl` and `qrels/*.tsv` copied byte for byte, and `replaced.jsonl` (one line per replaced
document: id, rule, words and characters of the full and the short record as `doc_text` joins them, and
whether the short form is the whole), plus `length_mix.json` at the top (the rule, the shares, the seeds
and per variant the counts).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from magclip.data.beir import check_beir_folder, doc_text, read_corpus
from magclip.io import atomic_write_json, atomic_write_jsonl

SHARES = (0.0, 0.25, 0.5, 0.75)
SEEDS = (0, 1, 2)
OWN_TITLE_SHARE = 0.9        # the share of documents with a title, and of distinct titles among them
MIN_SENTENCE_WORDS = 4       # a sentence end closes at least this many words ("e.g." or "Dr." cannot end one)
TITLE, FIRST_SENTENCE = "title", "first_sentence"
MANIFEST = "length_mix.json"
REPLACED = "replaced.jsonl"

# a sentence ends at '.', '!' or '?' (closing quotes or brackets may follow) before whitespace or the text's end
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?=\s|$)")


def first_sentence(text: str, min_words: int = MIN_SENTENCE_WORDS) -> str:
    """The text up to its first sentence end that closes at least `min_words` words; the whole
    (stripped) text when no such end exists."""
    text = text.strip()
    for match in _SENTENCE_END.finditer(text):
        head = text[:match.end()]
        if len(head.split()) >= min_words:
            return head
    return text


def has_own_titles(corpus: Mapping[str, Mapping[str, str]], share: float = OWN_TITLE_SHARE) -> bool:
    """Whether the set's titles name their own records (see the module docstring)."""
    titles = [d.get("title", "").strip() for d in corpus.values()]
    present = [t for t in titles if t]
    return bool(corpus) and len(present) >= share * len(titles) and len(set(present)) >= share * len(present)


def short_form(doc: Mapping[str, str], use_title: bool) -> tuple[dict[str, str], str]:
    """(the short record, the rule that made it: "title" or "first_sentence")."""
    title = doc.get("title", "") or ""
    if use_title and title.strip():
        return {"title": title, "text": ""}, TITLE
    return {"title": title, "text": first_sentence(doc.get("text", "") or "")}, FIRST_SENTENCE


def short_forms(corpus: Mapping[str, Mapping[str, str]]) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """Every document's short record and its rule (the set's title rule decided once, `has_own_titles`)."""
    use_title = has_own_titles(corpus)
    made = {i: short_form(d, use_title) for i, d in corpus.items()}
    return {i: m[0] for i, m in made.items()}, {i: m[1] for i, m in made.items()}


def replaced_ids(doc_ids: Sequence[str], share: float, seed: int) -> list[str]:
    """The first round(share·N) documents of the seed's permutation (nested over shares; see the module docstring)."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"a share of documents must lie in [0, 1], got {share}")
    order = np.random.default_rng(seed).permutation(len(doc_ids))
    return [doc_ids[i] for i in order[:int(round(share * len(doc_ids)))]]


def relevant_ids(qrels: Mapping[str, Mapping[str, int]]) -> set[str]:
    """The documents some query judges relevant (a grade > 0)."""
    return {d for judged in qrels.values() for d, grade in judged.items() if grade > 0}


def replaced_ids_by_relevance(doc_ids: Sequence[str], relevant: set[str], p_non: float, p_rel: float,
                              seed: int) -> list[str]:
    """Length and relevance not independent: a share `p_non` of the non-relevant documents and `p_rel` of the
    relevant ones (`relevant_ids`) replaced, each class drawn by its own permutation (numpy default_rng of
    [seed, 0] for the non-relevant, [seed, 1] for the relevant, both in corpus order): nested over each share
    within a seed, and a class's choice does not depend on the other's share."""
    rel = [d for d in doc_ids if d in relevant]
    non = [d for d in doc_ids if d not in relevant]
    out = []
    for ids, share, stream in ((non, p_non, 0), (rel, p_rel, 1)):
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"a share of documents must lie in [0, 1], got {share}")
        order = np.random.default_rng([seed, stream]).permutation(len(ids))
        out += [ids[i] for i in order[:round(share * len(ids))]]
    return out


def variant_corpus(corpus: Mapping[str, Mapping[str, str]], shorts: Mapping[str, Mapping[str, str]],
                   replaced: Sequence[str]) -> dict[str, dict[str, str]]:
    """The corpus with the `replaced` documents in their short form (ids and order kept)."""
    chosen = set(replaced)
    return {i: dict(shorts[i] if i in chosen else d) for i, d in corpus.items()}


def variant_name(share: float, seed: int | None) -> str:
    """The folder of one variant: "p=0" for the corpus itself, else "p=0.25,seed=1"."""
    return "p=0" if share == 0 else f"p={share:g},seed={seed}"


def replacement_record(doc_id: str, full: Mapping[str, str], short: Mapping[str, str], rule: str) -> dict[str, Any]:
    a, b = doc_text(full), doc_text(short)
    return {"_id": doc_id, "rule": rule, "full_words": len(a.split()), "short_words": len(b.split()),
            "full_chars": len(a), "short_chars": len(b), "short_is_whole": a == b}


def write_variant(folder: Path, out: Path, corpus: Mapping[str, Mapping[str, str]],
                  shorts: Mapping[str, Mapping[str, str]], rules: Mapping[str, str],
                  replaced: Sequence[str]) -> dict[str, Any]:
    """One BEIR folder at `out` (see the module docstring); returns its counts."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_jsonl(out / "corpus.jsonl", ({"_id": i, **d} for i, d in variant_corpus(corpus, shorts, replaced).items()))
    shutil.copy2(folder / "queries.jsonl", out / "queries.jsonl")
    (out / "qrels").mkdir(exist_ok=True)
    for qrels in sorted((folder / "qrels").glob("*.tsv")):
        shutil.copy2(qrels, out / "qrels" / qrels.name)
    records = [replacement_record(i, corpus[i], shorts[i], rules[i]) for i in replaced]
    atomic_write_jsonl(out / REPLACED, records)
    return {"replaced": len(records), "short_is_whole": sum(r["short_is_whole"] for r in records),
            "by_rule": {rule: sum(r["rule"] == rule for r in records) for rule in (TITLE, FIRST_SENTENCE)}}


def write_variants(folder: str | Path, out: str | Path, shares: Sequence[float] = SHARES,
                   seeds: Sequence[int] = SEEDS) -> dict[str, Any]:
    """Every variant of one BEIR folder under `out/<set name>/`; returns (and writes) the manifest."""
    folder = Path(folder)
    check_beir_folder(folder, next(iter(sorted(p.stem for p in (folder / "qrels").glob("*.tsv"))), "test"))
    if not seeds:
        raise ValueError("at least one seed of the choice is needed")
    corpus = read_corpus(folder)
    shorts, rules = short_forms(corpus)
    ids = list(corpus)
    dest = Path(out) / folder.name
    whole = [i for i in ids if doc_text(shorts[i]) == doc_text(corpus[i])]
    manifest: dict[str, Any] = {
        "source": str(folder), "documents": len(ids), "own_titles": has_own_titles(corpus),
        "rule": {"title_share": OWN_TITLE_SHARE, "min_sentence_words": MIN_SENTENCE_WORDS,
                 "choice": "numpy default_rng(seed).permutation, first round(p*N), nested over p"},
        "short_forms": {"by_rule": {r: sum(v == r for v in rules.values()) for r in (TITLE, FIRST_SENTENCE)},
                        "short_is_whole": len(whole), "short_is_whole_ids": whole[:20]},
        "shares": [float(s) for s in shares], "seeds": [int(s) for s in seeds], "variants": {}}
    for share in shares:
        for seed in ([None] if share == 0 else seeds):
            name = variant_name(share, seed)
            chosen = replaced_ids(ids, share, seed) if share else []
            counts = write_variant(folder, dest / name, corpus, shorts, rules, chosen)
            manifest["variants"][name] = {"share": float(share), "seed": seed, **counts}
    atomic_write_json(dest / MANIFEST, manifest)
    return manifest


def read_manifest(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no length-mix manifest (write the variants with tools/length_mix.py --make)")
    return json.loads(path.read_text())


__all__ = ["FIRST_SENTENCE", "SHARES", "SEEDS", "TITLE", "first_sentence", "has_own_titles", "read_manifest",
           "relevant_ids", "replaced_ids", "replaced_ids_by_relevance", "short_form", "short_forms", "variant_corpus",
           "variant_name", "write_variants"]
