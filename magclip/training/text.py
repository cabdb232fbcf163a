"""Text retrieval training: bi-encoder fine-tuning through the shared engine.

`train_text(cfg)` is the whole job: read pairs (JSONL/shards, or a BEIR folder's train qrels
converted on the fly), build the bi-encoder + RetrievalLoss + logit scale, train with the engine,
evaluate on the configured BEIR folders / STS files / QA sets with the run's own Scorer
(`magclip.evaluation.text`), and write `results.json`. Each checkpoint holds `model/`, a folder that
`BiEncoder.from_pretrained` and `sentence_transformers.SentenceTransformer` both load
(magclip_text.json inside records the mode and exponents).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from magclip.config import (
    ConfigError,
    TextDataConfig,
    TextLossConfig,
    TextModelConfig,
    TextRunConfig,
    to_dict,
)
from magclip.data.beir import beir_to_pairs
from magclip.data.pairs import PairBatches, read_pairs_with_columns, records_from_dicts, split_batch
from magclip.distributed import Share, gather_objects
from magclip.losses import RetrievalLoss
from magclip.metrics.ranks import RetrievalMetrics, read_metrics_with_outcomes, write_results_with_outcomes
from magclip.models.lora import ADAPTER_DIR, adapt_text, lora_on, merged_encoder, save_text_adapters
from magclip.models.text import BiEncoder, resolve_model_path
from magclip.similarity import make_scorer
from magclip.temperature import LogitScale, match_cosine_temperature
from magclip.training.accelerator import make_accelerator
from magclip.training.engine import Engine, TrainModule
from magclip.training.frozen_base import base_identity
from magclip.training.levers import evaluation_autocast, resolve_precision
from magclip.training.meta_start import start_sharded, towers_built_for
from magclip.training.preemption import StopGuard
from magclip.training.run import (
    latest_checkpoint,
    loop_record,
    prepare_run_dir,
    stoppable,
    write_results,
    write_run_config,
)
from magclip.training.sharding import evaluation_precision, evaluation_share
from magclip.training.start_cache import cached_start, start_key, store_start
from magclip.training.text_eval import TextEvalSets, evaluate_text_sets
from magclip.training.threads import use_threads

log = logging.getLogger("magclip.text")
START_KEY = "zero_shot"   # results.json's evaluation of the model before training (eval.at_start)
MODEL_DIR = "model"       # a step folder's sentence-transformers folder
EVALS_DIR = "evals"       # evals/step_N.json: the evaluations after step N (train.val_at, val_every, the last)


# ---------------------------------------------------------------------------- model + loss
def build_logit_scale(cfg: TextLossConfig) -> LogitScale:
    """The mode's defaults (magclip.temperature; cosine starts at `cosine_scale`), each overridable."""
    return LogitScale.for_mode(cfg.mode, cfg.logit_scale_init, cfg.logit_scale_learnable, cfg.logit_scale_max,
                               cosine_scale=cfg.cosine_scale)


def load_encoder(cfg: TextModelConfig, **hf_kwargs) -> BiEncoder:
    enc = BiEncoder.from_pretrained(cfg.name, pooling=cfg.pooling, query_prefix=cfg.query_prefix,
                                    passage_prefix=cfg.passage_prefix, query_max_length=cfg.query_max_length,
                                    passage_max_length=cfg.passage_max_length, shared=cfg.shared, **hf_kwargs)
    if cfg.magnitude is not None:   # a learned norm after pooling (models/magnitude.py)
        from magclip.models.magnitude import magnitude_head

        enc.add_head(lambda width: magnitude_head(cfg.magnitude, width))
    if not cfg.length_groups:
        enc.length_group_cost = None
    if cfg.grad_checkpointing:
        for tower in {id(enc.query_model): enc.query_model, id(enc.tower("passage")): enc.tower("passage")}.values():
            if not hasattr(tower, "gradient_checkpointing_enable"):   # a StaticEmbedding table has no layers
                raise ConfigError(f"model.grad_checkpointing: {cfg.name} has a {type(tower).__name__} tower, "
                                  "which has no layers to checkpoint; set model.grad_checkpointing=false")
            tower.gradient_checkpointing_enable()
    return enc


class TextTrainModule(TrainModule):
    """Bi-encoder + logit scale + RetrievalLoss; forward encodes a batch, `compute_loss` scores it."""

    feature_names = ("query", "passage")
    compile_blocker = "text batches change shape every step (a compile would recompile)"

    def __init__(self, encoder: BiEncoder, loss: RetrievalLoss, logit_scale: LogitScale):
        super().__init__(loss, logit_scale)
        self.encoder = encoder

    def towers(self) -> BiEncoder:
        return self.encoder

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encoder(split_batch(batch, "query"), split_batch(batch, "passage"))

    def log_state(self) -> dict[str, float]:
        s = self.loss.scorer
        return {**super().log_state(), "gamma_q": s.gamma_q, "gamma_d": s.gamma_d}





def save_text_model(m: TextTrainModule, cfg: TextRunConfig, step_dir: Path, tower_weights=None) -> Path:
    """A step folder's `model/`: the sentence-transformers folder with the trained scorer and scale (`tower_weights`:
    BiEncoder.save_pretrained's, for an offline consolidation or merge, which writes the towers itself)."""
    encoder = m.encoder
    if lora_on(cfg.model.lora) and tower_weights is None:  # a LoRA run: peft's adapter folder(s), and the merged model
        save_text_adapters(encoder, step_dir / ADAPTER_DIR)
        encoder = merged_encoder(encoder)
    return encoder.save_pretrained(step_dir / MODEL_DIR, scorer=m.loss.scorer.to_dict(),
                                     logit_scale=m.logit_scale.value, extra={"config": to_dict(cfg)},
                                     tower_weights=tower_weights)


def build_loss(cfg: TextRunConfig) -> RetrievalLoss:
    scorer = make_scorer(cfg.loss.mode, cfg.loss.gamma_q, cfg.loss.gamma_d)
    return RetrievalLoss(scorer, cfg.data.group_size, cfg.loss.doc_to_query, cfg.loss.q2d_weight, cfg.loss.d2q_weight,
                         local_loss=cfg.loss.local_loss, gather_with_grad=cfg.loss.gather_with_grad)


# ---------------------------------------------------------------------------- training
def load_records(cfg: TextDataConfig):
    """(records, read-time skips, the columns each file's records came from: results.json's train_columns)."""
    if cfg.train is not None:
        read = read_pairs_with_columns(cfg.train, cfg.max_records, cfg.train_split)
        return read.records, read.skipped, read.columns
    rows = beir_to_pairs(cfg.beir, cfg.beir_split, random_negatives=cfg.random_negatives)
    if cfg.max_records is not None:
        rows = rows[:cfg.max_records]
    records, skipped = records_from_dicts(rows)
    return records, skipped, [{"file": f"{cfg.beir} ({cfg.beir_split} qrels)", "records": len(records),
                               "columns": {"query<-query, positive<-positive, negatives<-negatives": len(records)},
                               "ignored": []}]


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


def check_enough_records(count: int, cfg: TextRunConfig, world_size: int) -> None:
    """One optimizer step takes train.accum_freq global batches of train.batch_size x world_size records: with
    fewer the first epoch would end before a step (a bare StopIteration in the loop), so say it at the start."""
    need = cfg.train.batch_size * world_size * cfg.train.accum_freq
    if count < need:
        raise ConfigError(f"{cfg.data.train or cfg.data.beir}: {count} usable training records, fewer than one step "
                          f"takes ({need} = train.batch_size {cfg.train.batch_size} x {world_size} processes x "
                          f"train.accum_freq {cfg.train.accum_freq}); lower train.batch_size or add records")


def train_text(cfg: TextRunConfig) -> dict[str, Any]:
    """Fine-tune a bi-encoder as configured; returns (and writes) the run's results. A signal of
    train.save_on_signal or train.time_limit ends it early with TrainingStopped (training/preemption.py)."""
    t0 = time.perf_counter()
    with stoppable(cfg) as stop:
        return _train_text(cfg, t0, stop)


def _train_text(cfg: TextRunConfig, t0: float, stop: StopGuard) -> dict[str, Any]:
    use_threads(cfg.train.threads, loader_workers=0)  # the text loader runs in the training process
    accelerator = make_accelerator(cfg.train, cfg.run_dir)
    torch.manual_seed(cfg.train.seed)
    records, read_skips, train_columns = load_records(cfg.data)
    with towers_built_for(cfg.train):   # on the meta device under fsdp (meta_start.py)
        encoder = load_encoder(cfg.model)
    base_dtype = None  # model.lora: adapters through peft (models/lora.py), the base frozen in this dtype
    frozen_base = None  # ... and its identity: a LoRA checkpoint holds what trains, the base is read again on resuming
    if lora_on(cfg.model.lora):
        base_dtype = adapt_text(encoder, cfg.model.lora, resolve_precision(cfg.train.precision, accelerator.device)[0])
        frozen_base = base_identity(resolve_model_path(cfg.model.name), base_dtype)
    passage_tokens = training_passage_tokens(cfg.data, encoder)  # config errors before the run folder is touched
    check_enough_records(len(records), cfg, accelerator.num_processes)
    run_dir = prepare_run_dir(cfg, accelerator)
    module = TextTrainModule(encoder, build_loss(cfg), build_logit_scale(cfg.loss))
    sharding = start_sharded(module, accelerator, cfg.train)   # a meta-device start: sharded and filled here
    module = module.to(accelerator.device)

    def make_loader(epoch: int) -> PairBatches:
        return PairBatches(records, encoder.tokenize, cfg.train.batch_size, cfg.data.group_size, epoch=epoch,
                           seed=cfg.train.seed, rank=accelerator.process_index, world_size=accelerator.num_processes,
                           skipped=read_skips, passage_tokens=passage_tokens, no_duplicates=cfg.data.no_duplicates)

    first = make_loader(0)
    steps_per_epoch = first.num_batches // cfg.train.accum_freq
    first.global_batches()  # epoch 0 composed here (once): its duplicate counts go to the log and results.json
    if cfg.data.no_duplicates:
        log.info("global batches without a text twice (epoch 0): %s", first.duplicates)
    if any(first.negative_shortfall.values()) and cfg.data.group_size > 1:
        log.warning("records short of %d hard negatives: %s (sampled with replacement / random positives)",
                    cfg.data.group_size - 1, first.negative_shortfall)
    if cfg.loss.logit_scale_from_norms and cfg.train.resume is None:
        with torch.no_grad():
            q, d = module(next(iter(first)))
            match_cosine_temperature(module.logit_scale, module.loss.scorer, q, d, cfg.loss.cosine_scale)

    eval_sets = TextEvalSets.load(cfg.eval, encoder) if accelerator.is_main_process else TextEvalSets()

    share = evaluation_share(cfg.train.sharding, accelerator)  # under fsdp every rank encodes its share
    precision = evaluation_precision(cfg.eval.precision, share, accelerator, base_dtype)
    eval_precision = evaluation_autocast(precision, accelerator.device)[1]
    if eval_sets:
        log.info("evaluation precision: %s", eval_precision)

    def evaluate_with(m: TextTrainModule, step: int, share: Share) -> dict[str, float]:
        with evaluation_autocast(precision, accelerator.device)[0]:   # the same before and after training
            metrics = evaluate_text_sets(m.encoder, m.loss.scorer, eval_sets, cfg.eval, accelerator.device, share)
        if step > 0 and accelerator.is_main_process:
            write_step_evaluation(run_dir, step, metrics)
        return metrics

    def evaluate(m: TextTrainModule, step: int) -> dict[str, float]:
        return evaluate_with(m, step, share)

    def save_model(m: TextTrainModule, step_dir: Path) -> None:
        save_text_model(m, cfg, step_dir)

    def save_trained(m: TextTrainModule, trained: dict[str, torch.Tensor], step_dir: Path) -> None:
        """LoRA under fsdp: peft's adapter folder(s) from the gathered adapters; no merged model (offline: --merge)."""
        save_text_adapters(m.encoder, step_dir / ADAPTER_DIR, trained)

    write_run_config(cfg, run_dir, accelerator)

    # after a meta-device start the towers are sharded already: the start is evaluated sharded, every rank encoding
    # its share as in training's evaluations (never gathered); otherwise every process holds the whole model yet
    sharded_start = sharding is not None and share.sharded

    def evaluate_start() -> RetrievalMetrics:
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad():
                return evaluate_with(module, 0, share if sharded_start else Share())
        finally:
            module.train(was_training)

    zero_shot, start_source = ({}, None)
    if cfg.eval.at_start and sharded_start:
        zero_shot, start_source = start_evaluation(cfg, run_dir, evaluate_start, accelerator)
    elif cfg.eval.at_start and accelerator.is_main_process:
        zero_shot, start_source = start_evaluation(cfg, run_dir, evaluate_start)
    accelerator.wait_for_everyone()
    fsdp_lora = frozen_base is not None and cfg.train.sharding == "fsdp"
    engine = Engine(cfg.train, accelerator, module, run_dir, make_loader, steps_per_epoch, save_model,
                    evaluate if (cfg.eval.beir or cfg.eval.sts or cfg.eval.rag) else None,  # alike on every rank
                    run_config=to_dict(cfg), started=t0, stop=stop, sharding=sharding, frozen_base=frozen_base,
                    save_trained=save_trained if fsdp_lora else None)
    try:
        state = engine.fit()
        metrics = engine.run_evaluation()
        skipped = engine.reduce_counts(state.skipped_samples)
    finally:
        engine.close()
    final = engine.unwrapped
    ckpt = latest_checkpoint(engine)
    results = {
        "model": cfg.model.name, "run_dir": str(run_dir), "checkpoint": str(ckpt),
        # None where the last checkpoint holds the shards alone (train.save_full_model=never: magclip-consolidate)
        "final_model": str(ckpt / MODEL_DIR) if (ckpt / MODEL_DIR).is_dir() else None,
        # a LoRA run's peft folder(s); under fsdp the merged model is written offline (magclip-consolidate --merge)
        "adapter": str(ckpt / ADAPTER_DIR) if (ckpt / ADAPTER_DIR).is_dir() else None,
        "eval_precision": eval_precision,
        "train_data": cfg.data.train or f"{cfg.data.beir} ({cfg.data.beir_split} qrels)", "records": len(records),
        "train_columns": train_columns,
        "group_size": cfg.data.group_size, "negative_shortfall": first.negative_shortfall,
        "no_duplicates": cfg.data.no_duplicates, "batch_duplicates_epoch0": first.duplicates,
        "train_passage_tokens": list(passage_tokens) if isinstance(passage_tokens, tuple)
        else passage_tokens or encoder.settings.passage_max_length,
        "scorer": final.loss.scorer.to_dict(), "logit_scale": final.logit_scale.value,
        "doc_to_query": cfg.loss.doc_to_query, **loop_record(engine, state, skipped),
        START_KEY: zero_shot, f"{START_KEY}_source": start_source, "metrics": metrics,
        "eval_read_report": eval_sets.read_reports(),
    }
    return write_results(results, run_dir, accelerator)


def step_evaluation_path(run_dir: Path, step: int) -> Path:
    """evals/step_N.json: one evaluation of the run after step N, its per-query outcomes beside it."""
    return run_dir / EVALS_DIR / f"step_{step:08d}.json"


def write_step_evaluation(run_dir: Path, step: int, metrics: RetrievalMetrics) -> Path:
    """Keep an evaluation after `step` (a `train.val_at` step, a `val_every` one, the last) under the same keys
    as results.json (`metrics.<set>/<metric>`), so that a budget curve pairs it, query by query, with the
    final evaluation and with other runs' evaluations at the same step. A resumed run that repeats the
    step writes it again (the same model: a resume continues exactly)."""
    path = step_evaluation_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_results_with_outcomes(path, {"step": step, "metrics": metrics})
    return path


def start_evaluation(cfg: TextRunConfig, run_dir: Path, evaluate: Callable[[], RetrievalMetrics],
                     accelerator: Accelerator | None = None) -> tuple[dict[str, Any], str]:
    """The evaluation of the model training starts from (`eval.at_start`), and where it came from: computed
    on a fresh run (or copied from `eval.start_cache`, where an identical start was evaluated before) and
    kept in the run folder (`zero_shot.json`, its per-query outcomes beside it), read back on a resumed
    one, so that results.json reports it, query by query, however often the run was interrupted.
    With `accelerator` (a sharded evaluation) every process calls this: the main process decides whether the
    start is evaluated, every rank then takes part in it, and the main process gets the metrics."""
    path = run_dir / f"{START_KEY}.json"
    main = accelerator is None or accelerator.is_main_process
    cache = _start_cache(cfg) if cfg.train.resume is None and main else None
    copied = cache is not None and cached_start(cache[0], cache[1], path)
    fresh = cfg.train.resume is None and not copied
    if accelerator is not None:   # the main process's decision on every rank (a file check could differ by host)
        fresh = gather_objects(fresh)[0]
    if fresh:
        zero_shot = evaluate()
        if main:
            write_results_with_outcomes(path, {START_KEY: zero_shot})
            if cache is not None:
                store_start(*cache, path)
        return zero_shot, "evaluated"
    if not main:
        return {}, None
    if copied:
        return read_metrics_with_outcomes(path, START_KEY), f"copied from {cache[0] / cache[1]}"
    if path.is_file():
        log.info("eval.at_start: the start's evaluation read back from %s (a resumed run)", path)
        return read_metrics_with_outcomes(path, START_KEY), f"read back from {path}"
    log.warning("eval.at_start: %s is missing (a run started before it was kept there): results.json has no "
                "%s; a fresh run (overwrite=true) evaluates the start again", path, START_KEY)
    return {}, "missing"


def _start_cache(cfg: TextRunConfig) -> tuple[Path, str, dict[str, Any]] | None:
    """(cache folder, key, the key's inputs) where `eval.start_cache` is set and the model is a local folder."""
    if not cfg.eval.start_cache:
        return None
    folder = Path(resolve_model_path(cfg.model.name))
    if not folder.is_dir():
        log.info("eval.start_cache: %s is not a local folder; its start is evaluated, not cached", cfg.model.name)
        return None
    key, inputs = start_key(cfg, folder)
    return Path(cfg.eval.start_cache), key, inputs


def format_train_table(results: dict[str, Any]) -> str:
    rows = ["| metric | zero-shot | fine-tuned |", "|---|---|---|"]
    zs, ft = results.get(START_KEY) or {}, results.get("metrics") or {}
    keys = [k for k in ft if k.split("/")[-1] in ("ndcg@10", "mrr@10", "recall@100", "map@100", "spearman")]
    for k in keys:
        z = f"{100 * zs[k]:.2f}" if k in zs else "-"
        rows.append(f"| {k} | {z} | {100 * ft[k]:.2f} |")
    return "\n".join(rows)


__all__ = ["TextTrainModule", "format_train_table", "step_evaluation_path", "train_text", "write_step_evaluation"]
