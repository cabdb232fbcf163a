"""CLIP training: an open_clip model, per-direction Scorers and a logit scale, run by the engine.

`train_clip(cfg)` is the whole main job: resolve the data (the embedded synthetic default when
`data.train` is empty), build model + loss, train, evaluate retrieval on the validation shards
with the run's own Scorers, and write `results.json` beside the checkpoints.
"""

from __future__ import annotations

import datetime as dt
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from magclip.config import LossConfig, RunConfig, dump_config, to_dict
from magclip.data.shards import build_clip_loader, count_samples
from magclip.data.synthetic import ensure_synthetic
from magclip.engine import Engine, TrainModule, make_accelerator
from magclip.io import atomic_write_json
from magclip.losses import CLIPLoss
from magclip.metrics.retrieval import ids_from_labels, retrieval_metrics
from magclip.models.clip import RawCLIP, create_clip, save_checkpoint_for_open_clip
from magclip.similarity import Scorer
from magclip.temperature import LogitScale, scale_matching_cosine

log = logging.getLogger("magclip.clip")

CHECKPOINT_META = "magclip.json"


class CLIPTrainModule(TrainModule):
    """open_clip model + logit scale + CLIPLoss; forward encodes, `compute_loss` scores."""

    feature_names = ("image", "text")

    def __init__(self, clip: RawCLIP, loss: CLIPLoss, logit_scale: LogitScale):
        super().__init__(loss, logit_scale)
        self.clip = clip

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.logit_scale.log_scale.device
        return self.clip(batch["images"].to(device, non_blocking=True), batch["texts"].to(device, non_blocking=True))

    def log_state(self) -> dict[str, float]:
        state = super().log_state()
        for direction, s in self.loss.scorer_state().items():
            state[f"gamma_q_{direction}"] = s["gamma_q"]
            state[f"gamma_d_{direction}"] = s["gamma_d"]
        return state


def build_loss(cfg: LossConfig) -> CLIPLoss:
    """Scorers per direction from the config; learnable directions may share one exponent pair."""
    shared = Scorer("learnable", cfg.gamma_q, cfg.gamma_d) if cfg.share_learnable else None

    def scorer(mode: str | None) -> Scorer | None:
        if mode is None:
            return None
        if mode == "learnable":
            return shared or Scorer("learnable", cfg.gamma_q, cfg.gamma_d)
        if mode == "fixed":
            return Scorer("fixed", cfg.gamma_q, cfg.gamma_d)
        return Scorer(mode)

    return CLIPLoss(scorer(cfg.i2t), scorer(cfg.t2i), cfg.i2t_weight, cfg.t2i_weight,
                    local_loss=cfg.local_loss, gather_with_grad=cfg.gather_with_grad)


def build_logit_scale(cfg: LossConfig) -> LogitScale:
    """Cosine's CLIP defaults only when every trained direction is cosine (see magclip.temperature)."""
    modes = {m for m in (cfg.i2t, cfg.t2i) if m is not None}
    kind = "cosine" if modes == {"cosine"} else "raw"
    return LogitScale.for_mode(kind, cfg.logit_scale_init, cfg.logit_scale_learnable, cfg.logit_scale_max)


def eval_scorers(loss: CLIPLoss) -> dict[str, Scorer]:
    """A Scorer for both directions: an untrained direction uses the trained one's score, transposed."""
    scorers = dict(loss.scorers.items())
    if "i2t" not in scorers:
        scorers["i2t"] = scorers["t2i"].transposed()
    if "t2i" not in scorers:
        scorers["t2i"] = scorers["i2t"].transposed()
    return scorers


@torch.no_grad()
def encode_loader(clip: RawCLIP, loader, device: torch.device | str) -> dict[str, Any]:
    """Raw features of every sample in `loader`, with keys and captions, in loader order."""
    images, texts, keys, captions = [], [], [], []
    skipped: dict[str, int] = {}
    for batch in loader:
        img, txt = clip(batch["images"].to(device), batch["texts"].to(device))
        images.append(img.float().cpu())
        texts.append(txt.float().cpu())
        keys += list(batch["keys"])
        captions += list(batch["captions"])
        for reason, n in batch.get("skipped", {}).items():
            skipped[reason] = skipped.get(reason, 0) + n
    if not images:
        raise ValueError("the evaluation data yielded no sample")
    return {"image_features": torch.cat(images), "text_features": torch.cat(texts), "keys": keys,
            "captions": captions, "skipped": skipped}


def evaluate_retrieval(clip: RawCLIP, scorers: dict[str, Scorer], loader, device) -> dict[str, float]:
    """Image<->text retrieval with caption-identity matching: a hit is any item carrying the same caption.

    Identical captions (frequent in the synthetic data and in emoji with two art styles) would
    otherwise count a correct retrieval as a miss.
    """
    enc = encode_loader(clip, loader, device)
    ids = ids_from_labels(enc["captions"])
    metrics = retrieval_metrics(enc["image_features"], enc["text_features"], i2t=scorers["i2t"], t2i=scorers["t2i"],
                                image_ids=ids, text_ids=ids)
    metrics["chance_R@1"] = chance_recall_at_1(ids)
    metrics["num_samples"] = len(enc["keys"])
    metrics["num_unique_captions"] = int(ids.unique().numel())
    metrics["image_norm_mean"] = float(enc["image_features"].norm(dim=-1).mean())
    metrics["text_norm_mean"] = float(enc["text_features"].norm(dim=-1).mean())
    metrics["skipped_total"] = sum(enc["skipped"].values())
    return metrics


def chance_recall_at_1(ids: torch.Tensor) -> float:
    """Expected R@1 of a random ranking: the mean share of relevant items per query."""
    _, inverse, counts = ids.unique(return_inverse=True, return_counts=True)
    return float((counts[inverse].float() / ids.numel()).mean())


def prepare_run_dir(cfg: RunConfig, is_main: bool) -> Path:
    """Refuse to overwrite a run unless asked; a resume keeps it."""
    run_dir = cfg.run_dir
    if cfg.train.resume is None and run_dir.exists() and any(run_dir.iterdir()):
        if not cfg.overwrite:
            finished = (run_dir / "results.json").exists()
            raise FileExistsError(f"run directory {run_dir} already holds a {'finished' if finished else 'started'} run; "
                                  "pass overwrite=true to replace it, train.resume=latest to continue it, or another name=")
        if is_main:
            shutil.rmtree(run_dir)
    return run_dir


def resolve_data(cfg: RunConfig) -> tuple[str, str | None]:
    if cfg.data.train is not None:
        return cfg.data.train, cfg.data.val
    s = cfg.data.synthetic
    synth = ensure_synthetic(s.root, num_train=s.num_train, num_val=s.num_val, image_size=s.image_size)
    return synth.train_urls, synth.val_urls


def train_clip(cfg: RunConfig) -> dict[str, Any]:
    """Train a CLIP model as configured; returns (and writes) the run's results."""
    t0 = time.perf_counter()
    accelerator = make_accelerator(cfg.train, cfg.run_dir)
    run_dir = prepare_run_dir(cfg, accelerator.is_main_process)
    accelerator.wait_for_everyone()
    torch.manual_seed(cfg.train.seed)
    with accelerator.main_process_first():
        train_urls, val_urls = resolve_data(cfg)
    bundle = create_clip(cfg.model.name, cfg.model.pretrained, lock_text=cfg.model.lock_text,
                         lock_image=cfg.model.lock_image, grad_checkpointing=cfg.model.grad_checkpointing,
                         device=accelerator.device)
    module = CLIPTrainModule(bundle.model, build_loss(cfg.loss), build_logit_scale(cfg.loss)).to(accelerator.device)
    num_samples = cfg.data.num_samples or count_samples(train_urls)

    def make_loader(epoch: int):
        return build_clip_loader(train_urls, preprocess=bundle.preprocess_train, tokenizer=bundle.tokenizer,
                                 batch_size=cfg.train.batch_size, num_samples=num_samples, weights=cfg.data.train_weights,
                                 resampled=cfg.data.resampled, shuffle=True, shuffle_buffer=cfg.data.shuffle_buffer,
                                 workers=cfg.data.workers, seed=cfg.train.seed, epoch=epoch,
                                 rank=accelerator.process_index, world_size=accelerator.num_processes)

    steps_per_epoch = make_loader(0).num_batches // cfg.train.accum_freq
    if cfg.loss.logit_scale_from_norms and cfg.train.resume is None:
        _match_cosine_temperature(module, make_loader(0))

    def eval_loader(urls: str):
        return build_clip_loader(urls, preprocess=bundle.preprocess_val, tokenizer=bundle.tokenizer,
                                 batch_size=256, num_samples=None, shuffle=False, workers=cfg.data.workers,
                                 rank=0, world_size=1, drop_last=False)

    val_loader = eval_loader(val_urls) if val_urls else None
    extra_loaders = {name: eval_loader(urls) for name, urls in cfg.data.eval_sets.items()}
    if val_loader is None:
        log.warning("no validation shards (data.val): the run ends without a retrieval evaluation")

    def evaluate(m: CLIPTrainModule, step: int) -> dict[str, float]:
        return evaluate_retrieval(m.clip, eval_scorers(m.loss), val_loader, accelerator.device) if val_loader else {}

    def save_model(m: CLIPTrainModule, path: Path) -> None:
        save_checkpoint_for_open_clip(m.clip, path, logit_scale=m.logit_scale.value)
        atomic_write_json(path.parent / CHECKPOINT_META, {
            "model": cfg.model.name, "scorers": m.loss.scorer_state(), "logit_scale": m.logit_scale.value,
            "config": to_dict(cfg)})

    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, run_dir / "config.yaml")
    engine = Engine(cfg.train, accelerator, module, run_dir, make_loader, steps_per_epoch, save_model, evaluate)
    try:
        state = engine.fit()
        metrics = engine.run_evaluation()
        eval_sets = {}
        if accelerator.is_main_process:
            final = engine.unwrapped
            for name, loader in extra_loaders.items():
                with torch.no_grad(), accelerator.autocast():
                    eval_sets[name] = evaluate_retrieval(final.clip.eval(), eval_scorers(final.loss), loader,
                                                         accelerator.device)
        accelerator.wait_for_everyone()
        skipped = engine.reduce_counts(state.skipped_samples)
    finally:
        engine.close()
    final = engine.unwrapped
    results = {
        "model": cfg.model.name, "run_dir": str(run_dir), "checkpoint": str(engine.ckpt_dir / _latest_name(engine)),
        "train_data": train_urls, "val_data": val_urls, "matching": "caption identity",
        "scorers": final.loss.scorer_state(), "logit_scale": final.logit_scale.value,
        "steps": state.step, "epochs_completed": state.epoch, "samples_seen_per_rank": state.samples_seen,
        "world_size": accelerator.num_processes, "skipped_samples": dict(skipped),
        "train_loss_recent": engine.recent_loss(),
        "wall_time_s": round(time.perf_counter() - t0, 2), "metrics": metrics, "eval_sets": eval_sets,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if accelerator.is_main_process:
        atomic_write_json(run_dir / "results.json", results)
    accelerator.wait_for_everyone()
    return results


def _latest_name(engine: Engine) -> str:
    pointer = engine.ckpt_dir / "latest"
    return pointer.read_text().strip() if pointer.exists() else ""


@torch.no_grad()
def _match_cosine_temperature(module: CLIPTrainModule, loader) -> None:
    """Set the scale so the first direction starts at cosine's effective temperature (one batch)."""
    batch = next(iter(loader))
    img, txt = module(batch)
    direction, scorer = next(iter(module.loss.scorers.items()))
    q, d = (img, txt) if direction == "i2t" else (txt, img)
    scale = scale_matching_cosine(scorer, q, d)
    if module.logit_scale.max_scale is not None:
        scale = min(scale, module.logit_scale.max_scale)
    module.logit_scale.set_(scale)
    log.info("logit scale set from initial norms: %.4f", scale)


def format_results_table(results: dict[str, Any]) -> str:
    """A Markdown table of retrieval R@1/5/10 per evaluation set and direction, with chance R@1."""
    sets = {"val": results.get("metrics") or {}, **(results.get("eval_sets") or {})}
    rows = ["| data | direction | R@1 | R@5 | R@10 | median rank | chance R@1 | pairs |", "|---|---|---|---|---|---|---|---|"]
    for data, m in sets.items():
        for name, label in (("image_to_text", "image→text"), ("text_to_image", "text→image")):
            if f"{name}_R@1" in m:
                rows.append(f"| {data} | {label} | {100 * m[f'{name}_R@1']:.2f} | {100 * m[f'{name}_R@5']:.2f} | "
                            f"{100 * m[f'{name}_R@10']:.2f} | {m[f'{name}_median_rank']:.0f} | "
                            f"{100 * m['chance_R@1']:.2f} | {m['num_samples']} |")
    rows.append("\nRecall in %; a hit is any item carrying the matching caption (identical captions count as one).")
    return "\n".join(rows)
