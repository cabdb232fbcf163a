"""Text retrieval: bi-encoder fine-tuning through the shared engine, and BEIR / STS evaluation.

`train_text(cfg)` is the whole job: read pairs (JSONL/shards, or a BEIR folder's train qrels
converted on the fly), build the bi-encoder + RetrievalLoss + logit scale, train with the engine,
evaluate on the configured BEIR folders / STS files with the run's own Scorer, and write
`results.json`. Each checkpoint holds `model/`, a folder that `BiEncoder.from_pretrained` and
`sentence_transformers.SentenceTransformer` both load (magclip_text.json inside records the mode
and exponents).

`evaluate_beir_folders` / `evaluate_sts_files` are what eval/beir.py and eval/sts.py call;
`mine_hard_negatives` (and `magclip.data.beir.beir_to_pairs`) make training pairs from a BEIR split.
"""

from __future__ import annotations

import datetime as dt
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from magclip.config import ConfigError, TrainConfig, dump_config, load_config, to_dict
from magclip.data.beir import BeirData, beir_to_pairs, doc_text, load_beir
from magclip.data.pairs import PairBatches, read_pairs, records_from_dicts, split_batch
from magclip.diagnostics.length import flat_length_metrics, length_report
from magclip.engine import Engine, TrainModule, make_accelerator
from magclip.io import atomic_write_json, atomic_write_jsonl
from magclip.metrics.ir import DEFAULT_METRICS, evaluate_retrieval, search_run
from magclip.metrics.rag import evaluate_rag, load_qa
from magclip.metrics.sts import STSData, evaluate_sts, read_sts
from magclip.models.text import POOLINGS, BiEncoder
from magclip.retrieval_loss import RetrievalLoss
from magclip.similarity import MODES, Scorer
from magclip.temperature import LogitScale, scale_matching_cosine

log = logging.getLogger("magclip.text")

TEXT_COSINE_SCALE = 20.0  # sentence-transformers' MultipleNegativesRankingLoss scale (temperature 0.05)


# ---------------------------------------------------------------------------- config
@dataclass
class TextModelConfig:
    name: str = "minilm"                   # 'minilm', a local folder, 'pkg:module/sub' or a hub name
    pooling: str | None = None             # mean / cls / last; None: the folder's own (mean for plain HF)
    query_prefix: str | None = None        # None: the folder's own prompts ('' for plain HF)
    passage_prefix: str | None = None
    query_max_length: int | None = 64
    passage_max_length: int | None = 256
    shared: bool = True                    # one tower for both sides; false copies it into two
    grad_checkpointing: bool = False


@dataclass
class TextDataConfig:
    train: str | None = None               # pairs: .jsonl[.gz], folder, tar shards (brace patterns, '::')
    beir: str | None = None                # or a BEIR folder whose `beir_split` qrels become pairs
    beir_split: str = "train"
    random_negatives: int = 0              # BEIR conversion: random corpus negatives per query
    max_records: int | None = None         # use only the first N records (quick runs)
    group_size: int = 1                    # documents per query: 1 positive + group_size-1 hard negatives
    passage_max_tokens: int | None = None  # training truncation of documents; None: model.passage_max_length
    passage_min_tokens: int | None = None  # set: each document cut at a length drawn from [min, max] (length-varied)


@dataclass
class TextLossConfig:
    mode: str = "cosine"
    gamma_q: float | None = None           # 'learnable': initial exponents; 'fixed': the exponents
    gamma_d: float | None = None
    doc_to_query: bool = False             # add the positive-document -> query term
    q2d_weight: float = 1.0
    d2q_weight: float = 1.0
    local_loss: bool = True
    gather_with_grad: bool = True
    logit_scale_init: float | None = None  # None: 20 for cosine, 1 for modes with a raw side
    logit_scale_learnable: bool | None = None
    logit_scale_max: float | None = None
    logit_scale_from_norms: bool = False   # start at cosine's effective temperature (cosine_scale) on batch 1
    cosine_scale: float = TEXT_COSINE_SCALE


@dataclass
class TextEvalConfig:
    beir: dict[str, str] = field(default_factory=dict)   # name -> BEIR folder
    sts: dict[str, str] = field(default_factory=dict)    # name -> STS TSV
    split: str = "test"
    max_queries: int | None = None          # evaluate on a subset (quick runs; not comparable to full numbers)
    max_docs: int | None = None
    batch_size: int = 64
    backend: str = "auto"                   # search: auto / torch / faiss
    at_start: bool = False                  # also evaluate the model before training (zero-shot)
    rag: dict[str, str] = field(default_factory=dict)    # name -> QA folder (qa.jsonl + corpus): answer recall@k
    length_bins: int = 4                    # BEIR length diagnostics (norm-length rho, within-bin d, nDCG by length); 0: off
    keep_identical_ids: bool = False        # BEIR drops a hit whose id equals the query id; true keeps it


@dataclass
class TextRunConfig:
    name: str = "text"
    output_dir: str = "runs"
    overwrite: bool = False
    model: TextModelConfig = field(default_factory=TextModelConfig)
    data: TextDataConfig = field(default_factory=TextDataConfig)
    loss: TextLossConfig = field(default_factory=TextLossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)  # the engine's; configs/text set text-sized values
    eval: TextEvalConfig = field(default_factory=TextEvalConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name


def load_text_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TextRunConfig:
    cfg = load_config(path, overrides, schema=TextRunConfig)
    validate_text_config(cfg)
    return cfg


def validate_text_config(cfg: TextRunConfig) -> None:
    if cfg.loss.mode not in MODES:
        raise ConfigError(f"loss.mode={cfg.loss.mode!r} is not a scoring mode; allowed: {', '.join(MODES)}")
    if cfg.model.pooling is not None and cfg.model.pooling not in POOLINGS:
        raise ConfigError(f"model.pooling={cfg.model.pooling!r}; allowed: {', '.join(POOLINGS)} or null")
    if (cfg.data.train is None) == (cfg.data.beir is None):
        raise ConfigError("set exactly one of data.train (pairs) and data.beir (a BEIR folder)")
    if cfg.eval.backend not in ("auto", "torch", "faiss"):
        raise ConfigError(f"eval.backend={cfg.eval.backend!r}; allowed: auto, torch, faiss")
    checks = {"data.group_size": cfg.data.group_size, "train.batch_size": cfg.train.batch_size,
              "train.epochs": cfg.train.epochs, "train.accum_freq": cfg.train.accum_freq,
              "train.log_every": cfg.train.log_every, "eval.batch_size": cfg.eval.batch_size}
    for key, value in checks.items():
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    if cfg.train.lr <= 0:
        raise ConfigError(f"train.lr must be > 0, got {cfg.train.lr}")
    if cfg.train.precision not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"train.precision={cfg.train.precision!r}; allowed: fp32, bf16, fp16")
    if cfg.train.resume not in (None, "latest") and not Path(cfg.train.resume).exists():
        raise ConfigError(f"train.resume={cfg.train.resume!r}: no such checkpoint (use 'latest' or a path)")
    try:
        build_scorer(cfg.loss)
    except ValueError as e:
        raise ConfigError(f"loss: {e}") from None


# ---------------------------------------------------------------------------- model + loss
def build_scorer(cfg: TextLossConfig) -> Scorer:
    return Scorer(cfg.mode, cfg.gamma_q, cfg.gamma_d)


def build_logit_scale(cfg: TextLossConfig) -> LogitScale:
    """20 (learnable, max 100) for cosine, like sentence-transformers' MNRL; the raw modes' defaults otherwise."""
    if cfg.mode == "cosine":
        init = TEXT_COSINE_SCALE if cfg.logit_scale_init is None else cfg.logit_scale_init
        return LogitScale.for_mode("cosine", init, cfg.logit_scale_learnable, cfg.logit_scale_max)
    return LogitScale.for_mode(cfg.mode, cfg.logit_scale_init, cfg.logit_scale_learnable, cfg.logit_scale_max)


def load_encoder(cfg: TextModelConfig) -> BiEncoder:
    enc = BiEncoder.from_pretrained(cfg.name, pooling=cfg.pooling, query_prefix=cfg.query_prefix,
                                    passage_prefix=cfg.passage_prefix, query_max_length=cfg.query_max_length,
                                    passage_max_length=cfg.passage_max_length, shared=cfg.shared)
    if cfg.grad_checkpointing:
        for tower in {id(enc.query_model): enc.query_model, id(enc.tower("passage")): enc.tower("passage")}.values():
            tower.gradient_checkpointing_enable()
    return enc


class TextTrainModule(TrainModule):
    """Bi-encoder + logit scale + RetrievalLoss; forward encodes a batch, `compute_loss` scores it."""

    feature_names = ("query", "passage")

    def __init__(self, encoder: BiEncoder, loss: RetrievalLoss, logit_scale: LogitScale):
        super().__init__(loss, logit_scale)
        self.encoder = encoder

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encoder(split_batch(batch, "query"), split_batch(batch, "passage"))

    def log_state(self) -> dict[str, float]:
        s = self.loss.scorer
        return {**super().log_state(), "gamma_q": s.gamma_q, "gamma_d": s.gamma_d}


# ---------------------------------------------------------------------------- evaluation
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
                       metrics: Sequence[str] = DEFAULT_METRICS, ignore_identical_ids: bool = True,
                       length_bins: int = 0, lengths: tuple[list[int], list[int]] | None = None,
                       progress: bool = False) -> dict[str, Any]:
    """Metrics of the first scorer (+ "modes": {mode: metrics} when several); documents encoded once.

    With `length_bins` > 0 each mode's entry also holds "length": the `length_report` of its ranking
    (norm-length correlation, within-bin Cohen's d, nDCG@10 by document-length bin); `lengths` =
    (query, document) token counts when already known.
    """
    scorers = [Scorer.build(s) for s in ([scorers] if isinstance(scorers, (str, Scorer)) else scorers)]
    corpus_texts = dict(zip(data.corpus, data.doc_texts()))
    if length_bins and lengths is None:
        lengths = beir_token_lengths(model, data)
    encode = SideCache(model, batch_size, device, progress)
    by_mode = {}
    for scorer in scorers:
        kept: list = []
        m = evaluate_retrieval(encode, data.queries, corpus_texts, data.qrels, scorer, metrics=metrics,
                               ignore_identical_ids=ignore_identical_ids, backend=backend, keep=kept)
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
                          metrics: Sequence[str] = DEFAULT_METRICS, ignore_identical_ids: bool = True,
                          length_bins: int = 0, progress: bool = False) -> dict[str, dict[str, Any]]:
    """{folder name: `evaluate_beir_data` of its split, + split, subset, wall_s and counted input warnings}."""
    results: dict[str, dict[str, Any]] = {}
    for folder in folders:
        data = load_beir(folder, split)
        if max_queries or max_docs:
            data = data.subset(max_queries, max_docs)
        t0 = time.perf_counter()
        entry = evaluate_beir_data(model, data, scorers, batch_size=batch_size, device=device, backend=backend,
                                   metrics=metrics, ignore_identical_ids=ignore_identical_ids,
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


def mine_hard_negatives(model: BiEncoder, folder: str | Path, split: str = "train", scorer: Scorer | str = "cosine",
                        *, negatives: int = 4, skip_top: int = 0, depth: int = 100, min_score: int = 1,
                        batch_size: int = 64, device=None, backend: str = "auto", out: str | Path | None = None,
                        progress: bool = False) -> list[dict[str, Any]]:
    """Pairs from a BEIR split with hard negatives retrieved by `model` under `scorer`.

    For each query: its judged documents with relevance >= `min_score` are the positives; the
    negatives are the best-ranked documents that are not judged for it at all (any grade) and not the
    query itself, after skipping the first `skip_top` of them (near-duplicates of positives that are
    merely unjudged are the usual false negatives). Written as JSONL to `out` when given.
    """
    data = load_beir(folder, split)
    rows = beir_to_pairs(folder, split, min_score=min_score)
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


# ---------------------------------------------------------------------------- training
def prepare_run_dir(cfg: TextRunConfig, is_main: bool) -> Path:
    run_dir = cfg.run_dir
    if cfg.train.resume is None and run_dir.exists() and any(run_dir.iterdir()):
        if not cfg.overwrite:
            raise FileExistsError(f"run directory {run_dir} already holds a run; pass overwrite=true to replace it, "
                                  "train.resume=latest to continue it, or another name=")
        if is_main:
            shutil.rmtree(run_dir)
    return run_dir


def load_records(cfg: TextDataConfig):
    if cfg.train is not None:
        return read_pairs(cfg.train, cfg.max_records)
    rows = beir_to_pairs(cfg.beir, cfg.beir_split, random_negatives=cfg.random_negatives)
    if cfg.max_records is not None:
        rows = rows[:cfg.max_records]
    return records_from_dicts(rows)


def training_passage_tokens(cfg: TextDataConfig, encoder: BiEncoder) -> int | tuple[int, int] | None:
    """The documents' training truncation: None (the model's max length), a fixed length, or a (min, max) range."""
    limit = encoder.max_positions("passage")
    top = cfg.passage_max_tokens or encoder.settings.passage_max_length
    if top > limit:
        raise ConfigError(f"data.passage_max_tokens={top} exceeds the model's {limit} positions")
    if cfg.passage_min_tokens is None:
        return cfg.passage_max_tokens
    if not 1 <= cfg.passage_min_tokens <= top:
        raise ConfigError(f"data.passage_min_tokens={cfg.passage_min_tokens} must be in [1, {top}]")
    return (cfg.passage_min_tokens, top)


def train_text(cfg: TextRunConfig) -> dict[str, Any]:
    """Fine-tune a bi-encoder as configured; returns (and writes) the run's results."""

    t0 = time.perf_counter()
    accelerator = make_accelerator(cfg.train, cfg.run_dir)
    torch.manual_seed(cfg.train.seed)
    records, read_skips = load_records(cfg.data)
    encoder = load_encoder(cfg.model)
    passage_tokens = training_passage_tokens(cfg.data, encoder)  # config errors before the run folder is touched
    run_dir = prepare_run_dir(cfg, accelerator.is_main_process)
    accelerator.wait_for_everyone()
    loss = RetrievalLoss(build_scorer(cfg.loss), cfg.data.group_size, cfg.loss.doc_to_query, cfg.loss.q2d_weight,
                         cfg.loss.d2q_weight, local_loss=cfg.loss.local_loss, gather_with_grad=cfg.loss.gather_with_grad)
    module = TextTrainModule(encoder, loss, build_logit_scale(cfg.loss)).to(accelerator.device)

    def make_loader(epoch: int) -> PairBatches:
        return PairBatches(records, encoder.tokenize, cfg.train.batch_size, cfg.data.group_size, epoch=epoch,
                           seed=cfg.train.seed, rank=accelerator.process_index, world_size=accelerator.num_processes,
                           skipped=read_skips, passage_tokens=passage_tokens)

    first = make_loader(0)
    steps_per_epoch = first.num_batches // cfg.train.accum_freq
    if any(first.negative_shortfall.values()) and cfg.data.group_size > 1:
        log.warning("records short of %d hard negatives: %s (sampled with replacement / random positives)",
                    cfg.data.group_size - 1, first.negative_shortfall)
    if cfg.loss.logit_scale_from_norms and cfg.train.resume is None:
        _match_cosine_temperature(module, first, cfg.loss.cosine_scale)

    beir_sets: dict[str, BeirData] = {}
    if accelerator.is_main_process:
        for name, folder in cfg.eval.beir.items():
            data = load_beir(folder, cfg.eval.split)
            if cfg.eval.max_queries or cfg.eval.max_docs:
                data = data.subset(cfg.eval.max_queries, cfg.eval.max_docs)
            beir_sets[name] = data
    sts_sets = {name: read_sts(sts_path(p, cfg.eval.split)[1], name) for name, p in cfg.eval.sts.items()}
    rag_sets = {name: load_qa(folder, cfg.eval.split) for name, folder in cfg.eval.rag.items()} \
        if accelerator.is_main_process else {}
    lengths = {name: beir_token_lengths(encoder, data) for name, data in beir_sets.items()} \
        if cfg.eval.length_bins else {}

    def evaluate(m: TextTrainModule, step: int) -> dict[str, float]:
        out: dict[str, float] = {}
        scorer = m.loss.scorer
        for name, data in beir_sets.items():
            r = evaluate_beir_data(m.encoder, data, scorer, batch_size=cfg.eval.batch_size, device=accelerator.device,
                                   backend=cfg.eval.backend, ignore_identical_ids=not cfg.eval.keep_identical_ids,
                                   length_bins=cfg.eval.length_bins, lengths=lengths.get(name))
            if "length" in r:
                r.update(flat_length_metrics(r.pop("length")))
            out.update({f"{name}/{k}": v for k, v in r.items() if isinstance(v, (int, float))})
        enc = _encoder_fn(m.encoder, cfg.eval.batch_size, accelerator.device)
        for name, data in sts_sets.items():
            r = evaluate_sts(enc, data, scorer, same_sides=same_sides(m.encoder))
            out.update({f"{name}/{k}": v for k, v in r.items() if isinstance(v, (int, float))})
        for name, data in rag_sets.items():
            r = next(iter(evaluate_rag(enc, data, [scorer], backend=cfg.eval.backend)["by_mode"].values()))
            out.update({f"{name}/{k}": v for k, v in r.items() if isinstance(v, (int, float))})
        return out

    def save_model(m: TextTrainModule, path: Path) -> None:
        m.encoder.save_pretrained(path.parent / "model", scorer=m.loss.scorer.to_dict(),
                                  logit_scale=m.logit_scale.value, extra={"config": to_dict(cfg)})

    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, run_dir / "config.yaml")
    zero_shot: dict[str, float] = {}
    if cfg.eval.at_start and accelerator.is_main_process and cfg.train.resume is None:
        module.eval()
        with torch.no_grad():
            zero_shot = evaluate(module, 0)
    accelerator.wait_for_everyone()
    engine = Engine(cfg.train, accelerator, module, run_dir, make_loader, steps_per_epoch, save_model,
                    evaluate if (beir_sets or sts_sets or rag_sets) else None)
    try:
        state = engine.fit()
        metrics = engine.run_evaluation()
        skipped = engine.reduce_counts(state.skipped_samples)
    finally:
        engine.close()
    final = engine.unwrapped
    ckpt = engine.ckpt_dir / (engine.ckpt_dir / "latest").read_text().strip() if (engine.ckpt_dir / "latest").exists() \
        else engine.ckpt_dir
    results = {
        "model": cfg.model.name, "run_dir": str(run_dir), "checkpoint": str(ckpt), "final_model": str(ckpt / "model"),
        "train_data": cfg.data.train or f"{cfg.data.beir} ({cfg.data.beir_split} qrels)", "records": len(records),
        "group_size": cfg.data.group_size, "negative_shortfall": first.negative_shortfall,
        "train_passage_tokens": list(passage_tokens) if isinstance(passage_tokens, tuple)
        else passage_tokens or encoder.settings.passage_max_length,
        "scorer": final.loss.scorer.to_dict(), "logit_scale": final.logit_scale.value,
        "doc_to_query": cfg.loss.doc_to_query, "steps": state.step, "epochs_completed": state.epoch,
        "samples_seen_per_rank": state.samples_seen, "world_size": accelerator.num_processes,
        "skipped_samples": dict(skipped), "train_loss_recent": engine.recent_loss(),
        "wall_time_s": round(time.perf_counter() - t0, 2),
        "zero_shot": zero_shot, "metrics": metrics,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if accelerator.is_main_process:
        atomic_write_json(run_dir / "results.json", results)
    accelerator.wait_for_everyone()
    return results


@torch.no_grad()
def _match_cosine_temperature(module: TextTrainModule, loader: PairBatches, cosine_scale: float) -> None:
    batch = next(iter(loader))
    q, d = module(batch)
    scale = scale_matching_cosine(module.loss.scorer, q, d, cosine_scale)
    if module.logit_scale.max_scale is not None:
        scale = min(scale, module.logit_scale.max_scale)
    module.logit_scale.set_(scale)
    log.info("logit scale set from initial norms: %.4f (cosine-equivalent %.1f)", scale, cosine_scale)


def format_train_table(results: dict[str, Any]) -> str:
    rows = ["| metric | zero-shot | fine-tuned |", "|---|---|---|"]
    zs, ft = results.get("zero_shot") or {}, results.get("metrics") or {}
    keys = [k for k in ft if k.split("/")[-1] in ("ndcg@10", "mrr@10", "recall@100", "map@100", "spearman")]
    for k in keys:
        z = f"{100 * zs[k]:.2f}" if k in zs else "-"
        rows.append(f"| {k} | {z} | {100 * ft[k]:.2f} |")
    return "\n".join(rows)


__all__ = ["TextRunConfig", "TextTrainModule", "train_text", "load_text_config", "evaluate_beir_folders",
           "evaluate_sts_files", "format_beir_table", "format_sts_table"]
