"""Text retrieval evaluation with the model's own Scorer(s): BEIR folders (pytrec_eval metrics and the
length diagnostics), STS files (Spearman both ways) and QA sets (RAG retrieval), for eval/beir.py,
eval/sts.py, eval/rag.py and a text training run's validation alike."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from magclip.config import TextEvalConfig
from magclip.data.beir import BeirData, load_beir
from magclip.data.qa import QAData, load_qa
from magclip.diagnostics.length import flat_length_metrics, length_report
from magclip.evaluation.rag import evaluate_rag
from magclip.metrics.ir import DEFAULT_METRICS, evaluate_retrieval
from magclip.metrics.sts import STSData, evaluate_sts, read_sts
from magclip.models.text import BiEncoder
from magclip.similarity import Scorer, frozen, resolve_specs


def text_scorers(model: BiEncoder, modes: Sequence[str] | None = None, gamma_q: float | None = None,
                 gamma_d: float | None = None) -> list[Scorer]:
    """The Scorers to evaluate `model` with: the given modes (`resolve_specs`' evaluation rule: 'fixed' and
    'learnable' need both exponents), or the model's own (magclip_text.json: a learnable one at its trained point)."""
    if modes:
        return [frozen(spec) for spec in resolve_specs(modes, gamma_q, gamma_d, evaluation=True, where="--mode")]
    return [frozen(model.default_scorer)]


def _encoder_fn(model: BiEncoder, batch_size: int, device, progress: bool = False):
    def encode(texts: list[str], side: str) -> torch.Tensor:
        return model.encode(texts, side, batch_size=batch_size, device=device, progress=progress)
    return encode


def same_sides(model: BiEncoder) -> bool:
    s = model.settings
    return s.shared and s.query_prefix == s.passage_prefix and s.query_max_length == s.passage_max_length


class SideCache:
    """encode(texts, side) that encodes each side once: every scorer searches the same vectors."""

    def __init__(self, model: BiEncoder, batch_size: int, device=None, progress: bool = False):
        self.encode = _encoder_fn(model, batch_size, device, progress)
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
                       progress: bool = False) -> dict[str, Any]:
    """Metrics of the first scorer (+ "modes": {mode: metrics} when several); documents encoded once.

    `identical_ids`: which same-id documents leave the rankings (magclip.data.beir.identical_id_exclusions;
    "self": only a document that is the query); every entry records the rule, how many queries share an
    id with a document (`identical_id_queries`), how many were left out (`excluded_identical`) and how many
    of those the top k held (`removed_identical`).
    With `length_bins` > 0 each mode's entry also holds "length": the `length_report` of its ranking
    (norm-length correlation, within-bin Cohen's d, nDCG@10 by document-length bin); `lengths` =
    (query, document) token counts when already known.
    """
    scorers = [Scorer.build(s) for s in ([scorers] if isinstance(scorers, (str, Scorer)) else scorers)]
    corpus_texts = dict(zip(data.corpus, data.doc_texts()))
    if length_bins and lengths is None:
        lengths = beir_token_lengths(model, data)
    encode = SideCache(model, batch_size, device, progress)
    exclude = data.identical_ids(identical_ids)
    identical = {"identical_ids": identical_ids, "identical_id_queries": len(data.identical_ids("drop")),
                 "excluded_identical": len(exclude)}
    by_mode = {}
    for scorer in scorers:
        kept: list = []
        m = evaluate_retrieval(encode, data.queries, corpus_texts, data.qrels, scorer, metrics=metrics,
                               exclude=exclude, backend=backend, keep=kept)
        m.update(identical)
        if length_bins:
            m["length"], _ = length_report(kept[0], data.qrels, lengths[0], lengths[1], scorer, n_bins=length_bins,
                                           max_length=model.settings.passage_max_length)
        by_mode[scorer.label] = m
    entry = dict(next(iter(by_mode.values())))
    if len(by_mode) > 1:
        entry["modes"] = by_mode
    return entry


def evaluate_beir_folders(model: BiEncoder, folders: Sequence[str | Path], scorers: Sequence[Scorer | str],
                          *, split: str = "test", batch_size: int = 64, device=None, backend: str = "auto",
                          max_queries: int | None = None, max_docs: int | None = None,
                          metrics: Sequence[str] = DEFAULT_METRICS, identical_ids: str = "self",
                          length_bins: int = 0, progress: bool = False) -> dict[str, dict[str, Any]]:
    """{folder name: `evaluate_beir_data` of its split, + split, subset, wall_s and counted input warnings}."""
    results: dict[str, dict[str, Any]] = {}
    for folder in folders:
        data = load_beir(folder, split)
        if max_queries or max_docs:
            data = data.subset(max_queries, max_docs)
        t0 = time.perf_counter()
        entry = evaluate_beir_data(model, data, scorers, batch_size=batch_size, device=device, backend=backend,
                                   metrics=metrics, identical_ids=identical_ids,
                                   length_bins=length_bins, progress=progress)
        for m in [entry, *(entry.get("modes") or {}).values()]:
            m.update({"split": split, "subset": bool(max_queries or max_docs)})
        entry["wall_s"] = round(time.perf_counter() - t0, 2)
        entry["warnings"] = dict(data.warnings)  # counted input problems (unknown docs, empty queries, ...)
        results[data.name] = entry
    return results


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
        base = _encoder_fn(model, batch_size, device, progress)

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
        entry = dict(next(iter(by_mode.values())))
        if len(by_mode) > 1:
            entry["modes"] = by_mode
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


@dataclass
class TextEvalSets:
    """The evaluation data of a text training run, loaded once (`eval.beir`, `eval.sts`, `eval.rag`)."""

    beir: dict[str, BeirData] = field(default_factory=dict)
    sts: dict[str, STSData] = field(default_factory=dict)
    rag: dict[str, QAData] = field(default_factory=dict)
    lengths: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)  # BEIR token counts

    def __bool__(self) -> bool:
        return bool(self.beir or self.sts or self.rag)

    @classmethod
    def load(cls, cfg: TextEvalConfig, model: BiEncoder) -> "TextEvalSets":
        beir = {}
        for name, folder in cfg.beir.items():
            data = load_beir(folder, cfg.split)
            beir[name] = data.subset(cfg.max_queries, cfg.max_docs) if (cfg.max_queries or cfg.max_docs) else data
        lengths = {name: beir_token_lengths(model, data) for name, data in beir.items()} if cfg.length_bins else {}
        return cls(beir, {name: read_sts(sts_path(p, cfg.split)[1], name) for name, p in cfg.sts.items()},
                   {name: load_qa(folder, cfg.split) for name, folder in cfg.rag.items()}, lengths)


def evaluate_text_sets(model: BiEncoder, scorer: Scorer, sets: TextEvalSets, cfg: TextEvalConfig,
                       device=None) -> dict[str, float]:
    """Every set scored with `scorer`, flattened to {"<set>/<metric>": value} for metrics.jsonl."""
    out: dict[str, float] = {}
    for name, data in sets.beir.items():
        r = evaluate_beir_data(model, data, scorer, batch_size=cfg.batch_size, device=device, backend=cfg.backend,
                               identical_ids=cfg.identical_ids, length_bins=cfg.length_bins,
                               lengths=sets.lengths.get(name))
        if "length" in r:
            r.update(flat_length_metrics(r.pop("length")))
        out.update({f"{name}/{k}": v for k, v in r.items() if isinstance(v, (int, float))})
    encode = _encoder_fn(model, cfg.batch_size, device)
    for name, data in sets.sts.items():
        r = evaluate_sts(encode, data, scorer, same_sides=same_sides(model))
        out.update({f"{name}/{k}": v for k, v in r.items() if isinstance(v, (int, float))})
    for name, data in sets.rag.items():
        r = next(iter(evaluate_rag(encode, data, [scorer], backend=cfg.backend)["by_mode"].values()))
        out.update({f"{name}/{k}": v for k, v in r.items() if isinstance(v, (int, float))})
    return out
