"""CLIP training: an open_clip model, per-direction Scorers and a logit scale, run by the engine.

`train_clip(cfg)` is the whole main job: resolve the data (the embedded synthetic default when
`data.train` is empty), build model + loss, train, evaluate retrieval on the validation shards
with the run's own Scorers, and write `results.json` beside the checkpoints.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from magclip.config import LossConfig, RunConfig, to_dict
from magclip.data.captions import CaptionKey
from magclip.data.decoded_cache import DecodedCache, cache_wanted, default_budget_mb
from magclip.data.decoded_cache import fill as fill_decoded_cache
from magclip.data.eval_sets import TRAINING_HINT, EvalSet, resolve_retrieval_set
from magclip.data.shard_reader import DEFAULT_MAX_IMAGE_PIXELS
from magclip.data.shards import build_clip_loader, count_samples
from magclip.data.synthetic import ensure_synthetic
from magclip.evaluation.checkpoint import pretrained_weights
from magclip.evaluation.clip import evaluate_retrieval
from magclip.io import atomic_write_json
from magclip.losses import CLIPLoss, SigLIPLoss
from magclip.metrics.relevance import MATCHING
from magclip.models.clip import CHECKPOINT_META, RawCLIP, create_clip, save_open_clip_folder, uint8_transform
from magclip.models.lora import (
    ADAPTER_DIR,
    adapt_clip,
    is_peft,
    lora_on,
    merged_model,
    save_adapter,
    trained_under,
)
from magclip.similarity import Scorer, evaluation_scorers, resolve_specs
from magclip.temperature import (
    SIGLIP_INIT_BIAS,
    LogitBias,
    LogitScale,
    cosine_scale_for,
    match_cosine_temperature,
    starts_from_norms,
)
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
from magclip.training.threads import choose_loader_workers, choose_streams, use_threads

log = logging.getLogger("magclip.clip")


class CLIPTrainModule(TrainModule):
    """open_clip model + logit scale (+ the sigmoid loss's bias) + CLIPLoss or SigLIPLoss; forward
    encodes, `compute_loss` scores."""

    feature_names = ("image", "text")

    def __init__(self, clip: RawCLIP, loss: CLIPLoss | SigLIPLoss, logit_scale: LogitScale,
                 logit_bias: LogitBias | None = None):
        super().__init__(loss, logit_scale, logit_bias)
        self.clip = clip

    def towers(self) -> RawCLIP:
        return self.clip

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.logit_scale.log_scale.device
        images = batch["images"].to(device, non_blocking=True)
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return self.clip(images, batch["texts"].to(device, non_blocking=True))

    def log_state(self) -> dict[str, float]:
        state = super().log_state()
        for direction, s in self.loss.scorer_state().items():
            state[f"gamma_q_{direction}"] = s["gamma_q"]
            state[f"gamma_d_{direction}"] = s["gamma_d"]
        return state


def checkpoint_meta(m: CLIPTrainModule, cfg: RunConfig) -> dict[str, Any]:
    """magclip.json of a step folder: the trained Scorers, temperature and the run's config beside the weights."""
    bias = m.logit_bias.value if m.logit_bias is not None else None
    return {"model": cfg.model.name, "loss_type": cfg.loss.type, "scorers": m.loss.scorer_state(),
            "logit_scale": m.logit_scale.value, "logit_bias": bias, "config": to_dict(cfg)}


def build_loss(cfg: LossConfig) -> CLIPLoss | SigLIPLoss:
    """Scorers per direction from the config (`resolve_specs`' training rule: one exponent pair for the
    free modes); learnable directions may share one exponent pair. `loss.type=siglip`: the sigmoid loss
    with its one Scorer (the image as query)."""
    if cfg.type == "siglip":
        spec = resolve_specs([cfg.mode], cfg.gamma_q, cfg.gamma_d, where="loss")[0]
        return SigLIPLoss(Scorer.from_spec(spec), local_loss=cfg.local_loss, gather_with_grad=cfg.gather_with_grad,
                          dist_impl=cfg.dist_impl)
    directions = {d: m for d, m in (("i2t", cfg.i2t), ("t2i", cfg.t2i)) if m is not None}
    specs = dict(zip(directions, resolve_specs(list(directions.values()), cfg.gamma_q, cfg.gamma_d, where="loss")))
    shared = next((Scorer.from_spec(s) for s in specs.values() if s.mode == "learnable"), None) \
        if cfg.share_learnable else None

    def scorer(direction: str) -> Scorer | None:
        if direction not in specs:
            return None
        spec = specs[direction]
        return shared if (shared is not None and spec.mode == "learnable") else Scorer.from_spec(spec)

    return CLIPLoss(scorer("i2t"), scorer("t2i"), cfg.i2t_weight, cfg.t2i_weight,
                    local_loss=cfg.local_loss, gather_with_grad=cfg.gather_with_grad)


def trained_modes(cfg: LossConfig) -> list[str]:
    """The scoring modes the loss trains: the sigmoid loss's one, or every kept direction's."""
    return [cfg.mode] if cfg.type == "siglip" else [m for m in (cfg.i2t, cfg.t2i) if m is not None]


def build_logit_scale(cfg: LossConfig) -> LogitScale:
    """The trained modes' defaults (magclip.temperature), each overridable by the config."""
    return LogitScale.for_mode(trained_modes(cfg), cfg.logit_scale_init, cfg.logit_scale_learnable,
                               cfg.logit_scale_max, cosine_scale=cosine_scale_for(cfg.type))


def scale_from_norms(cfg: RunConfig) -> bool:
    """loss.logit_scale_from_norms, or where unset the measured default (`starts_from_norms`), which gives
    way to a scale the run already has: loss.logit_scale_init, or a pretrained model's own scale."""
    loss = cfg.loss
    if loss.logit_scale_from_norms is None and (loss.logit_scale_init is not None or cfg.model.pretrained):
        return False
    return starts_from_norms(loss.type, trained_modes(loss), loss.logit_scale_from_norms)


def build_logit_bias(cfg: LossConfig) -> LogitBias | None:
    """The sigmoid loss's bias (magclip.temperature: the same start in every mode); the CLIP loss has none."""
    if cfg.type != "siglip":
        return None
    return LogitBias(SIGLIP_INIT_BIAS if cfg.logit_bias_init is None else cfg.logit_bias_init, cfg.logit_bias_learnable)


def resolve_data(cfg: RunConfig) -> tuple[str, str | None]:
    if cfg.data.train is not None:
        return cfg.data.train, cfg.data.val
    s = cfg.data.synthetic
    log.info("no data.train given: training on the embedded synthetic scenes (%d train / %d val)",
             s.num_train, s.num_val)
    synth = ensure_synthetic(s.root, num_train=s.num_train, num_val=s.num_val, image_size=s.image_size)
    return synth.train_urls, synth.val_urls


def train_clip(cfg: RunConfig) -> dict[str, Any]:
    """Train a CLIP model as configured; returns (and writes) the run's results. A signal of
    train.save_on_signal or train.time_limit ends it early with TrainingStopped (training/preemption.py)."""
    t0 = time.perf_counter()
    with stoppable(cfg) as stop:
        return _train_clip(cfg, t0, stop)


def decoded_training_cache(cfg: RunConfig, train_urls: str, steps_per_epoch: int) -> tuple[DecodedCache | None, str]:
    """The decoded-sample cache by data.cache's rule (data/decoded_cache.py), and a line saying what was chosen.
    The passes over the data are known when an epoch is one pass (data.num_samples unset)."""
    passes = None
    if cfg.data.num_samples is None:
        steps = steps_per_epoch * cfg.train.epochs
        steps = min(steps, cfg.train.max_steps) if cfg.train.max_steps is not None else steps
        passes = steps / max(1, steps_per_epoch)
    wanted, why = cache_wanted(cfg.data.cache, passes, cfg.data.resampled)
    if not wanted:
        return None, f"off ({why})"
    budget = cfg.data.cache_max_mb if cfg.data.cache_max_mb is not None else default_budget_mb()
    cache = fill_decoded_cache(train_urls, max_pixels=DEFAULT_MAX_IMAGE_PIXELS, caption_key=CaptionKey(cfg.data.caption_key),
                               budget_mb=budget)
    if cache is None:
        return None, f"off (the decoded set passes data.cache_max_mb={budget})"
    return cache, f"on ({why}; {cache.samples} samples, {cache.nbytes / 2**20:.0f} MiB, filled in {cache.seconds:.1f} s)"


def _train_clip(cfg: RunConfig, t0: float, stop: StopGuard) -> dict[str, Any]:
    accelerator = make_accelerator(cfg.train, cfg.run_dir)
    run_dir = prepare_run_dir(cfg, accelerator)
    torch.manual_seed(cfg.train.seed)
    with accelerator.main_process_first():
        train_urls, val_urls = resolve_data(cfg)
    logit_bias = build_logit_bias(cfg.loss)
    # a sigmoid-loss model carries open_clip's own logit_bias (frozen, like its logit_scale; the trained
    # one is `logit_bias` below, written into it at every checkpoint), so plain open_clip loads the bias
    with towers_built_for(cfg.train):  # on the meta device under fsdp (meta_start.py)
        bundle = create_clip(cfg.model.name, pretrained_weights(cfg.model.pretrained), lock_text=cfg.model.lock_text,
                             lock_image=cfg.model.lock_image, grad_checkpointing=cfg.model.grad_checkpointing,
                             device=accelerator.device,
                             **({"init_logit_bias": logit_bias.value} if logit_bias is not None else {}))
    base_dtype = None  # model.lora: adapters through peft (models/lora.py), the base frozen in this dtype
    frozen_base = None  # ... and its identity: a LoRA checkpoint holds what trains, the base is read again on resuming
    if lora_on(cfg.model.lora):
        base_dtype = adapt_clip(bundle.model, cfg.model.lora, bundle.preprocess_val, bundle.tokenizer,
                                resolve_precision(cfg.train.precision, accelerator.device)[0], cfg.train.sharding)
        frozen_base = base_identity(pretrained_weights(cfg.model.pretrained), base_dtype, seed=cfg.train.seed)
    module = CLIPTrainModule(bundle.model, build_loss(cfg.loss), build_logit_scale(cfg.loss), logit_bias)
    if lora_on(cfg.model.lora):
        module.compile_blocker = "model.lora (compiling adapted towers is untested)"
    sharding = start_sharded(module, accelerator, cfg.train)   # a meta-device start: sharded and filled here
    module = module.to(accelerator.device)
    if cfg.model.pretrained and cfg.train.resume is None:
        keep_pretrained_temperature(module, cfg)
    num_samples = cfg.data.num_samples or count_samples(train_urls)

    # images cross the worker boundary (and are pinned, and copied to the device) as uint8; RawCLIP normalises
    train_transform = uint8_transform(bundle.preprocess_train) or bundle.preprocess_train

    decoded = None  # the decoded-sample cache, filled below once the run's length is known
    workers = 0  # the loader workers: data.workers's rule decides once the cache is (the count of batches is not theirs)
    streams = choose_streams(cfg.data.streams, cfg.data.workers)  # what the batches are: not the workers' choice

    def make_loader(epoch: int):
        return build_clip_loader(train_urls, preprocess=train_transform, tokenizer=bundle.tokenizer,
                                 batch_size=cfg.train.batch_size, num_samples=num_samples, weights=cfg.data.train_weights,
                                 resampled=cfg.data.resampled, shuffle=True, shuffle_buffer=cfg.data.shuffle_buffer,
                                 workers=workers, streams=streams, seed=cfg.train.seed, epoch=epoch,
                                 rank=accelerator.process_index, world_size=accelerator.num_processes,
                                 caption_key=cfg.data.caption_key, decoded_cache=decoded)

    steps_per_epoch = make_loader(0).num_batches // cfg.train.accum_freq
    decoded, cache_note = decoded_training_cache(cfg, train_urls, steps_per_epoch)
    workers, workers_note = choose_loader_workers(cfg.data.workers, accelerator.device.type, decoded is not None)
    use_threads(cfg.train.threads, workers)
    if scale_from_norms(cfg) and cfg.train.resume is None:
        _match_cosine_temperature(module, make_loader(0), cosine_scale_for(cfg.loss.type))

    def eval_loader(name: str, path: str) -> tuple[EvalSet, Any]:
        """The set (its layout recognised) and a re-iterable source of its batches, every caption kept."""
        es = resolve_retrieval_set(name, path, hint=TRAINING_HINT, matching=cfg.eval.matching,
                                   caption_key=cfg.data.caption_key,
                                   where=f"data.{name}" if name == "val" else f"data.eval_sets.{name}")
        if es.captioned is not None:
            return es, _Reiterable(lambda: es.captioned.iter_batches(bundle.preprocess_val, bundle.tokenizer, 256,
                                                                    Counter(), workers=workers))
        return es, build_clip_loader(es.urls, preprocess=bundle.preprocess_val, tokenizer=bundle.tokenizer,
                                     batch_size=256, num_samples=None, shuffle=False, workers=workers,
                                     rank=0, world_size=1, drop_last=False, caption_key=es.caption_key,
                                     all_captions=True)

    val_set, val_loader = eval_loader("val", val_urls) if val_urls else (None, None)
    extra = {name: eval_loader(name, path) for name, path in cfg.data.eval_sets.items()}
    if val_loader is None:
        log.warning("no validation shards (data.val): the run ends without a retrieval evaluation")

    share = evaluation_share(cfg.train.sharding, accelerator)  # under fsdp every rank encodes its share
    precision = evaluation_precision(cfg.eval.precision, share, accelerator, base_dtype)
    eval_precision = evaluation_autocast(precision, accelerator.device)[1]
    log.info("evaluation precision: %s", eval_precision)

    def evaluate(m: CLIPTrainModule, step: int) -> dict[str, float]:
        if val_loader is None:
            return {}
        with evaluation_autocast(precision, accelerator.device)[0]:   # whatever the training autocast
            return evaluate_retrieval(m.clip, evaluation_scorers(m.loss.scorers), val_loader, accelerator.device,
                                      matching=val_set.matching, tokenizer=bundle.tokenizer, share=share)

    def evaluate_sets(m: CLIPTrainModule) -> dict[str, Any]:
        out = {}
        for name, (es, loader) in extra.items():
            with evaluation_autocast(precision, accelerator.device)[0]:
                out[name] = evaluate_retrieval(m.clip.eval(), evaluation_scorers(m.loss.scorers), loader,
                                               accelerator.device, matching=es.matching, tokenizer=bundle.tokenizer,
                                               share=share)
        return out

    def save_model(m: CLIPTrainModule, step_dir: Path) -> None:
        bias = m.logit_bias.value if m.logit_bias is not None else None
        clip = m.clip.clip
        if is_peft(clip):  # a LoRA run: peft's adapter folder, and the merged model as the open_clip folder
            save_adapter(clip, step_dir / ADAPTER_DIR)
            clip = merged_model(clip)
        save_open_clip_folder(clip, step_dir, bundle.model_name, logit_scale=m.logit_scale.value, logit_bias=bias)
        atomic_write_json(step_dir / CHECKPOINT_META, checkpoint_meta(m, cfg))

    def save_trained(m: CLIPTrainModule, trained: dict[str, torch.Tensor], step_dir: Path) -> None:
        """LoRA under fsdp: peft's adapter folder from the gathered adapters; no merged model (offline: --merge)."""
        save_adapter(m.clip.clip, step_dir / ADAPTER_DIR, trained_under(trained, "clip.clip."))
        atomic_write_json(step_dir / CHECKPOINT_META, checkpoint_meta(m, cfg))

    write_run_config(cfg, run_dir, accelerator)
    fsdp_lora = frozen_base is not None and cfg.train.sharding == "fsdp"
    engine = Engine(cfg.train, accelerator, module, run_dir, make_loader, steps_per_epoch, save_model, evaluate,
                    run_config=to_dict(cfg), started=t0, stop=stop, sharding=sharding, frozen_base=frozen_base,
                    save_trained=save_trained if fsdp_lora else None)
    engine.levers["decoded_cache"] = cache_note
    engine.levers["loader_workers"] = f"{workers} ({workers_note})"
    log.info("decoded-sample cache: %s; loader workers: %d (%s); sample streams: %d (data.streams=%s; the batches "
             "are theirs, wherever they are read)", cache_note, workers, workers_note, streams, cfg.data.streams)
    try:
        state = engine.fit()
        metrics = engine.run_evaluation()
        eval_sets = (engine.evaluate_model(evaluate_sets) if extra else None) or {}  # every process
        accelerator.wait_for_everyone()
        skipped = engine.reduce_counts(state.skipped_samples)
    finally:
        engine.close()
    final = engine.unwrapped
    results = {
        "model": cfg.model.name, "run_dir": str(run_dir), "checkpoint": str(latest_checkpoint(engine)),
        "train_data": train_urls, "train_samples_per_epoch": num_samples, "val_data": val_urls,
        **_matching_record(val_set, {name: es for name, (es, _) in extra.items()}),
        "caption_key": cfg.data.caption_key, "eval_precision": eval_precision,
        "loss_type": cfg.loss.type, "scorers": final.loss.scorer_state(), "logit_scale": final.logit_scale.value,
        "logit_bias": final.logit_bias.value if final.logit_bias is not None else None,
        **loop_record(engine, state, skipped), "metrics": metrics, "eval_sets": eval_sets,
    }
    return write_results(results, run_dir, accelerator)


class _Reiterable:
    """A source of batches that a periodic validation can read again: a fresh iterator each time."""

    def __init__(self, make: Callable[[], Iterable[dict[str, Any]]]):
        self.make = make

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.make())


def _matching_record(val: EvalSet | None, extra: dict[str, EvalSet]) -> dict[str, Any]:
    """How each evaluated set was read and scored: `matching` (the rule of data.val, or of the sets when there is no
    val), `matching_rule` (its words) and `eval_data` (per set: layout, rule, split, caption key)."""
    sets = {**({"val": val} if val is not None else {}), **extra}
    if not sets:
        return {"matching": None, "matching_rule": None, "eval_data": {}}
    first = next(iter(sets.values())).matching
    return {"matching": first, "matching_rule": MATCHING[first],
            "eval_data": {name: es.describe() for name, es in sets.items()}}


def keep_pretrained_temperature(module: CLIPTrainModule, cfg: RunConfig) -> None:
    """Fine-tuning starts where the checkpoint's training ended, as open_clip_train does: the logit scale
    (and a sigmoid-loss bias) loaded into the open_clip model become the run's starting point, unless
    the config sets them (loss.logit_scale_init, loss.logit_scale_from_norms, loss.logit_bias_init)."""
    clip = module.clip.clip
    taken = []
    if cfg.loss.logit_scale_init is None and not scale_from_norms(cfg):
        scale = float(clip.logit_scale.detach().exp())
        max_scale = module.logit_scale.max_scale
        module.logit_scale.set_(min(scale, max_scale) if max_scale is not None else scale)
        taken.append(f"logit scale {module.logit_scale.value:.4g}")
    if module.logit_bias is not None and cfg.loss.logit_bias_init is None and getattr(clip, "logit_bias", None) is not None:
        module.logit_bias.set_(float(clip.logit_bias.detach()))
        taken.append(f"logit bias {module.logit_bias.value:.4g}")
    log.info("model.pretrained %s: %s taken from it%s", cfg.model.pretrained, " and ".join(taken) or "weights only",
             "" if taken else " (the config sets the temperature)")


@torch.no_grad()
def _match_cosine_temperature(module: CLIPTrainModule, loader, cosine_scale: float) -> None:
    """The first direction starts at cosine's effective temperature on one batch."""
    img, txt = module(next(iter(loader)))
    direction, scorer = next(iter(module.loss.scorers.items()))
    q, d = (img, txt) if direction == "i2t" else (txt, img)
    match_cosine_temperature(module.logit_scale, scorer, q, d, cosine_scale)


def format_results_table(results: dict[str, Any]) -> str:
    """A Markdown table of retrieval R@1/5/10 per evaluation set and direction, with chance R@1."""
    sets = {"val": results.get("metrics") or {}, **(results.get("eval_sets") or {})}
    rows = ["| data | direction | R@1 | R@5 | R@10 | median rank | chance R@1 | pairs |", "|---|---|---|---|---|---|---|---|"]
    for data, m in sets.items():
        for name, label in (("image_to_text", "image→text"), ("text_to_image", "text→image")):
            if f"{name}_R@1" in m:
                chance = m.get(f"{name}_chance_R@1", m["chance_R@1"])
                rows.append(f"| {data} | {label} | {100 * m[f'{name}_R@1']:.2f} | {100 * m[f'{name}_R@5']:.2f} | "
                            f"{100 * m[f'{name}_R@10']:.2f} | {m[f'{name}_median_rank']:.0f} | "
                            f"{100 * chance:.2f} | {_pairs(m)} |")
    if len(rows) == 2:  # no evaluation set
        return ("No retrieval evaluation: the run has no validation shards (data.val) or evaluation sets "
                "(data.eval_sets).")
    rule = results.get("matching_rule") or MATCHING["caption"]
    rows.append(f"\nRecall in %; relevance: {rule}.")
    long = [f"{data}: {m['long_captions']} captions longer than the context of {m['context_length']} tokens "
            f"(longest {m['longest_caption_tokens']}), truncated" for data, m in sets.items() if m.get("long_captions")]
    if long:
        rows.append("WARNING " + "; ".join(long))
    return "\n".join(rows)


def _pairs(m: dict[str, Any]) -> str:
    """Images, and the captions where they are more."""
    n, captions = m["num_samples"], m.get("num_captions", m["num_samples"])
    return str(n) if captions == n else f"{n} images / {captions} captions"
