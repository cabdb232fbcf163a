"""Text retrieval evaluation with the model's own Scorer(s): BEIR folders (encode, search, pytrec_eval
metrics and the length diagnostics) and STS files (Spearman both ways), for eval/beir.py, eval/sts.py
and a text training run's validation alike (magclip.training.text_eval; RAG: magclip.evaluation.rag)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from magclip.data.beir import BeirData, load_beir
from magclip.data.sts import STSData, read_sts
from magclip.diagnostics.length import length_report
from magclip.evaluation import modes_entry
from magclip.evaluation.index import export_index
from magclip.metrics.ir import (
    DEFAULT_METRICS,
    Qrels,
    Retrieval,
    backend_name,
    evaluate_run,
    parse_metric,
    search_run,
)
from magclip.metrics.ranks import RetrievalMetrics
from magclip.metrics.sts import sts_from_scores, sts_pair_scores
from magclip.models.text import BiEncoder
from magclip.similarity import Scorer, frozen, resolve_specs


def text_scorers(model: BiEncoder, modes: Sequence[str] | None = None, gamma_q: float | None = None,
                 gamma_d: float | None = None) -> list[Scorer]:
    """The Scorers to evaluate `model` with: the given modes (`resolve_specs`' evaluation rule: 'fixed' and
    'learnable' need both exponents), or the model's own (magclip_text.json: a learnable one at its trained point)."""
    if modes:
        return [frozen(spec) for spec in resolve_specs(modes, gamma_q, gamma_d, evaluation=True, where="--mode")]
    if model.similarity_refusal:   # a folder whose similarity_fn_name no mode expresses
        raise ValueError(model.similarity_refusal)
    return [frozen(model.default_scorer)]


def retrieve(encode: Callable[[list[str], str], torch.Tensor], queries: Mapping[str, str],
             corpus_texts: Mapping[str, str], scorer: Scorer | str, k: int, *, exclude: Mapping[str, str] | None = None,
             backend: str = "auto") -> Retrieval:
    """Encode documents (side "passage") and queries (side "query") with `encode(texts, side)`, search the
    top k under `scorer` (leaving out what `exclude` names), and time each part."""
    qids, dids = list(queries), list(corpus_texts)
    t0 = time.perf_counter()
    doc_vecs = encode([corpus_texts[d] for d in dids], "passage")
    t1 = time.perf_counter()
    query_vecs = encode([queries[q] for q in qids], "query")
    t2 = time.perf_counter()
    run, removed = search_run(query_vecs, doc_vecs, qids, dids, scorer, k, exclude=exclude, backend=backend)
    t3 = time.perf_counter()
    timings = {"encode_docs_s": round(t1 - t0, 2), "encode_queries_s": round(t2 - t1, 2), "search_s": round(t3 - t2, 3)}
    return Retrieval(qids, dids, query_vecs, doc_vecs, run, removed, k, timings)


def retrieval_entry(r: Retrieval, qrels: Qrels, scorer: Scorer, metrics: Sequence[str] = DEFAULT_METRICS,
                    backend: str = "auto") -> RetrievalMetrics:
    """The metric means of a search (pytrec_eval, `evaluate_run`) plus `queries`, `docs`,
    `removed_identical` (documents `exclude` removed from the top k), mean norms, timings and the scorer;
    each metric's per-query values (judged queries, id order) ride along for paired statistics."""
    scored = evaluate_run(qrels, r.run, metrics, per_query=True)
    per_query = scored.pop("per_query")
    out = RetrievalMetrics(scored)
    for name, values in per_query.items():
        out.add_values(name, list(values.values()), list(values))
    out.update({"queries": len(r.query_ids), "docs": len(r.doc_ids), "removed_identical": r.removed_identical, "k": r.k,
                "scorer": scorer.to_dict(), "search_backend": backend_name(backend),
                "doc_norm_mean": float(r.doc_vecs.norm(dim=-1).mean()),
                "query_norm_mean": float(r.query_vecs.norm(dim=-1).mean()), **r.timings})
    return out


def encoder_fn(model: BiEncoder, batch_size: int, device, progress: bool = False):
    def encode(texts: list[str], side: str) -> torch.Tensor:
        return model.encode(texts, side, batch_size=batch_size, device=device, progress=progress)
    return encode


def same_sides(model: BiEncoder) -> bool:
    s = model.settings
    return s.shared and s.query_prefix == s.passage_prefix and s.query_max_length == s.passage_max_length


class SideCache:
    """encode(texts, side) that encodes each side once: every scorer searches the same vectors."""

    def __init__(self, model: BiEncoder, batch_size: int, device=None, progress: bool = False,
                 encode: Callable[[list[str], str], torch.Tensor] | None = None):
        self.encode = encode or encoder_fn(model, batch_size, device, progress)
        self.vectors: dict[str, torch.Tensor] = {}

    def __call__(self, texts: list[str], side: str) -> torch.Tensor:
        if side not in self.vectors:
            self.vectors[side] = self.encode(texts, side)
        return self.vectors[side]


def beir_token_lengths(model: BiEncoder, data: BeirData) -> tuple[list[int], list[int]]:
    """Untruncated token counts of the queries and documents, in the BeirData's order."""
    return (model.token_lengths([data.queries[q] for q in data.queries], "query"),
            model.token_lengths(data.doc_texts(list(data.corpus)), "passage"))


def evaluate_beir_data(model: BiEncoder, data: BeirData, scorers: Sequence[Scorer | str] | Scorer | str, *,
                       batch_size: int = 64, device=None, backend: str = "auto",
                       metrics: Sequence[str] = DEFAULT_METRICS, identical_ids: str = "self",
                       length_bins: int = 0, lengths: tuple[list[int], list[int]] | None = None,
                       progress: bool = False, export_to: str | Path | None = None,
                       encode: Callable[[list[str], str], torch.Tensor] | None = None) -> dict[str, Any]:
    """Metrics of the first scorer (+ "modes": {mode: metrics} when several); documents encoded once.
    `encode(texts, side)`: how texts are encoded (default: the model's own `encode`; a sharded model's is
    magclip.evaluation.sharded's).

    `identical_ids`: which same-id documents leave the rankings (magclip.data.beir.identical_id_exclusions;
    "self": only a document that is the query); every entry records the rule, how many queries share an
    id with a document (`identical_id_queries`), how many were left out (`excluded_identical`) and how many
    of those the top k held (`removed_identical`).
    `export_to`: a serving index of the prepared documents per scorer (`export_to/<scorer label>`,
    magclip.evaluation.index), recorded as the entry's "index".
    With `length_bins` > 0 each mode's entry also holds "length": the `length_report` of its ranking
    (norm-length correlation, within-bin Cohen's d, nDCG@10 by document-length bin); `lengths` =
    (query, document) token counts when already known.
    """
    scorers = [Scorer.build(s) for s in ([scorers] if isinstance(scorers, (str, Scorer)) else scorers)]
    corpus_texts = dict(zip(data.corpus, data.doc_texts()))
    if length_bins and lengths is None:
        lengths = beir_token_lengths(model, data)
    encode = SideCache(model, batch_size, device, progress, encode)
    exclude = data.identical_ids(identical_ids)
    identical = {"identical_ids": identical_ids, "identical_id_queries": len(data.identical_ids("drop")),
                 "excluded_identical": len(exclude)}
    by_mode = {}
    for scorer in scorers:
        found = retrieve(encode, data.queries, corpus_texts, scorer, max(parse_metric(x)[1] for x in metrics),
                         exclude=exclude, backend=backend)
        m = retrieval_entry(found, data.qrels, scorer, metrics, backend)
        m.update(identical)
        if export_to is not None:
            m["index"] = str(export_index(Path(export_to) / scorer.label, found.doc_vecs, found.doc_ids, scorer,
                                          queries="query", documents="passage"))
        if length_bins:
            m["length"], _ = length_report(found, data.qrels, lengths[0], lengths[1], scorer, n_bins=length_bins,
                                           max_length=model.settings.passage_max_length)
        by_mode[scorer.label] = m
    return modes_entry(by_mode)


def evaluate_beir_folders(model: BiEncoder, folders: Sequence[str | Path], scorers: Sequence[Scorer | str],
                          *, split: str = "test", batch_size: int = 64, device=None, backend: str = "auto",
                          max_queries: int | None = None, max_docs: int | None = None,
                          metrics: Sequence[str] = DEFAULT_METRICS, identical_ids: str = "self",
                          length_bins: int = 0, progress: bool = False,
                          export_index_to: str | Path | None = None) -> dict[str, dict[str, Any]]:
    """{folder name: `evaluate_beir_data` of its split, + split, subset, wall_s, counted input warnings and the
    read report (repeated document/query ids, the judged ones among them, queries without judgements)}."""
    results: dict[str, dict[str, Any]] = {}
    for folder in folders:
        data = load_beir(folder, split)
        if max_queries or max_docs:
            data = data.subset(max_queries, max_docs)
        t0 = time.perf_counter()
        entry = evaluate_beir_data(model, data, scorers, batch_size=batch_size, device=device, backend=backend,
                                   metrics=metrics, identical_ids=identical_ids,
                                   length_bins=length_bins, progress=progress,
                                   export_to=Path(export_index_to) / data.name if export_index_to else None)
        for m in [entry, *(entry.get("modes") or {}).values()]:
            m.update({"split": split, "subset": bool(max_queries or max_docs)})
        entry["wall_s"] = round(time.perf_counter() - t0, 2)
        entry["warnings"] = dict(data.warnings)  # counted input problems (unknown docs, empty queries, ...)
        entry["read_report"] = dict(data.read_report)  # repeated ids, queries left out (magclip.data.beir)
        results[data.name] = entry
    return results


def evaluate_sts(encode: Callable[[list[str], str], torch.Tensor], data: STSData, scorer: Scorer | str,
                 same_sides: bool = False) -> dict[str, Any]:
    """Encode each sentence on both sides (once if `same_sides`: query and passage encodings are
    identical, as for a shared tower with equal prefixes and max lengths) and correlate; the per-pair
    scores s(a,b), s(b,a) and the gold scores ride along (`pred_ab`, `pred_ba`, `gold`)."""
    scorer = Scorer.build(scorer)
    q1 = encode(data.sentence1, "query")
    q2 = encode(data.sentence2, "query")
    p1, p2 = (q1, q2) if same_sides else (encode(data.sentence1, "passage"), encode(data.sentence2, "passage"))
    ab, ba = sts_pair_scores(q1, p1, q2, p2, scorer)
    out = RetrievalMetrics(sts_from_scores(ab, ba, data.scores))
    pairs = [f"{a}\t{b}" for a, b in zip(data.sentence1, data.sentence2)]
    for key, values in (("pred_ab", ab), ("pred_ba", ba), ("gold", data.scores)):
        out.add_values(key, values, pairs)  # a correlation can be bootstrapped over pairs (magclip.experiments)
    out.update({"pairs": len(data.scores), "scorer": scorer.to_dict(),
                "norm_mean": float(torch.cat([q1, q2]).norm(dim=-1).mean())})
    return out


def sts_path(path: str | Path, split: str = "test") -> tuple[str, Path]:
    """(name, TSV file): a folder means <folder>/<split>.tsv, named after the folder."""
    p = Path(path)
    if p.is_dir():
        f = p / f"{split}.tsv"
        if not f.is_file():
            raise FileNotFoundError(f"{p} has no {split}.tsv")
        return p.name, f
    return p.stem, p


def evaluate_sts_files(model: BiEncoder, paths: Sequence[str | Path], scorers: Sequence[Scorer | str], *,
                       split: str = "test", batch_size: int = 64, device=None,
                       progress: bool = False) -> dict[str, dict[str, Any]]:
    """{dataset name: correlations of the first scorer (+ "modes" when several)}; sentences encoded once."""
    scorers = [Scorer.build(s) for s in scorers]
    results: dict[str, dict[str, Any]] = {}
    for path in paths:
        name, file = sts_path(path, split)
        data: STSData = read_sts(file, name)
        t0 = time.perf_counter()
        cache: dict[tuple[int, str], torch.Tensor] = {}
        base = encoder_fn(model, batch_size, device, progress)

        def encode(texts: list[str], side: str, _cache=cache, _base=base) -> torch.Tensor:
            key = (id(texts), side)
            if key not in _cache:
                _cache[key] = _base(texts, side)
            return _cache[key]

        by_mode = {}
        for scorer in scorers:
            m = evaluate_sts(encode, data, scorer, same_sides=same_sides(model))
            m["split"] = split if Path(path).is_dir() else file.name
            by_mode[scorer.label] = m
        entry = modes_entry(by_mode)
        entry["wall_s"] = round(time.perf_counter() - t0, 2)
        results[name] = entry
    return results


def format_beir_table(results: dict[str, dict[str, Any]]) -> str:
    rows = ["| data | mode | nDCG@10 | MRR@10 | R@100 | MAP@100 | queries | docs |", "|---|---|---|---|---|---|---|---|"]
    for name, entry in results.items():
        for label, m in (entry.get("modes") or {Scorer.build(entry["scorer"]).label: entry}).items():
            rows.append(f"| {name} | {label} | {100 * m['ndcg@10']:.2f} | {100 * m['mrr@10']:.2f} | "
                        f"{100 * m['recall@100']:.2f} | {100 * m['map@100']:.2f} | {m['queries']} | {m['docs']} |")
    return "\n".join(rows)


def format_sts_table(results: dict[str, dict[str, Any]]) -> str:
    rows = ["| data | mode | Spearman s(a,b) | Spearman s(b,a) | Spearman mean | Pearson mean | pairs |",
            "|---|---|---|---|---|---|---|"]
    for name, entry in results.items():
        for label, m in (entry.get("modes") or {Scorer.build(entry["scorer"]).label: entry}).items():
            rows.append(f"| {name} | {label} | {100 * m['spearman_ab']:.2f} | {100 * m['spearman_ba']:.2f} | "
                        f"{100 * m['spearman']:.2f} | {100 * m['pearson']:.2f} | {m['pairs']} |")
    return "\n".join(rows)


