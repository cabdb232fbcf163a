"""What zero-shot evaluation scores: a CLIP model with a frozen Scorer per direction, loaded from a
magclip checkpoint (its own Scorers, from magclip.json) or from plain open_clip weights (`--mode`).

A checkpoint can be given as a step folder, its weights file, a run folder or a checkpoints folder
(both follow `latest`). A step folder holds open_clip_model.safetensors + open_clip_config.json (open_clip's
hub layout) and magclip.json; folders written before that layout hold model.pt instead, and still load.
Weights load through open_clip (safetensors, or torch.load with weights_only): nothing in a checkpoint
folder runs code.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from magclip.io import DamagedFileError, UnsafeFileError, looks_like_path
from magclip.models.clip import CHECKPOINT_META, WEIGHTS_FILE, RawCLIP, create_clip, weights_file
from magclip.similarity import Scorer, ScorerSpec, evaluation_scorers, frozen, resolve_specs

log = logging.getLogger("magclip.evaluation")


@dataclass
class EvalModel:
    """What is evaluated: a raw-feature open_clip model, its transforms, and a Scorer per direction."""

    clip: RawCLIP
    preprocess: Callable
    tokenizer: Callable
    model_name: str
    scorers: dict[str, Scorer]  # "i2t" and "t2i"
    source: dict[str, Any] = field(default_factory=dict)  # checkpoint / pretrained / logit_scale


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint step folder (weights + magclip.json) for a step folder, its weights file, a run
    folder (follows checkpoints/latest) or a checkpoints folder (follows latest)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint not found: {p}")
    if p.is_file() and p.name == "latest":  # the pointer itself: its folder follows it below
        p = p.parent
    elif p.is_file():
        return p.parent
    if weights_file(p):
        return p
    for pointer in (p / "checkpoints" / "latest", p / "latest"):
        if pointer.is_file():
            target = pointer.parent / pointer.read_text().strip()
            aside = target.with_name(f".{target.name}.old")  # a replacement killed mid-way (io.publish_dir)
            if not target.exists() and weights_file(aside):
                log.warning("%s is missing; reading %s, left aside by an interrupted checkpoint write "
                            "(a resumed run puts it back)", target, aside)
                return aside
            if not weights_file(target):
                raise FileNotFoundError(f"{pointer} points at {target}, which has no {WEIGHTS_FILE}")
            return target
    raise FileNotFoundError(
        f"no checkpoint in {p}: expected a step folder with {WEIGHTS_FILE}, a run folder with "
        "checkpoints/latest, or a weights file")


def pretrained_weights(value: str | None) -> str | None:
    """`model.pretrained` as open_clip takes it: a local checkpoint in any form a user has at hand -- a
    step folder, `checkpoints/latest`, a checkpoints or run folder (their latest step), a weights file
    (safetensors, a bare state_dict, open_clip_train's {'state_dict': {'module.…'}}) -- becomes its
    weights file; an open_clip pretrained tag or hub name passes through."""
    if value is None or not looks_like_path(value):
        return value
    p = Path(value).expanduser()
    if p.is_file() and p.name != "latest":
        return str(p)
    step = resolve_checkpoint(p)
    weights = weights_file(step)
    if weights is None:
        raise FileNotFoundError(f"model.pretrained: {step} holds no {WEIGHTS_FILE}")
    return str(weights)


def read_checkpoint_meta(step_dir: Path) -> dict[str, Any]:
    meta_path = step_dir / CHECKPOINT_META
    if not meta_path.is_file():
        raise FileNotFoundError(
            f"{meta_path} not found: a magclip checkpoint records its model name and scorers there. "
            "For a plain open_clip checkpoint use --model NAME --pretrained PATH --mode MODE")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exn:
        raise ValueError(f"{meta_path} is not valid JSON: {exn}") from exn
    for key in ("model", "scorers"):
        if key not in meta:
            raise ValueError(f"{meta_path} has no {key!r} entry (keys: {sorted(meta)})")
    return meta


def scorers_from_meta(scorers: Mapping[str, Mapping[str, Any]], where: str = "checkpoint") -> dict[str, Scorer]:
    """Frozen Scorers for both directions from a checkpoint's `scorers` record: each direction its
    recorded mode and exponents (a learnable one at its trained point), an untrained direction the
    trained one transposed (`similarity.evaluation_scorers`)."""
    try:
        specs = {direction: ScorerSpec.from_record({k: rec[k] for k in ("mode", "gamma_q", "gamma_d") if k in rec},
                                                   where=f"bad scorer for {direction}")
                 for direction, rec in scorers.items()}
        return evaluation_scorers(specs)
    except (ValueError, TypeError) as exn:
        raise ValueError(f"{where}: {exn}") from exn


def scorers_for_mode(mode: str, gamma_q: float | None = None, gamma_d: float | None = None) -> dict[str, Scorer]:
    """The same Scorer for both directions (the `--mode` override), by `resolve_specs`' evaluation rule."""
    scorer = frozen(resolve_specs([mode], gamma_q, gamma_d, evaluation=True, where="--mode")[0])
    return {"i2t": scorer, "t2i": scorer}


def load_checkpoint(path: str | Path, *, mode: str | None = None, gamma_q: float | None = None,
                    gamma_d: float | None = None, device: str | torch.device = "cpu") -> EvalModel:
    """A magclip checkpoint (step folder, its weights file, or a run folder) with its own Scorers;
    `mode` (with gamma_q/gamma_d for fixed/learnable) overrides both directions."""
    step_dir = resolve_checkpoint(path)
    meta = read_checkpoint_meta(step_dir)
    meta_path = step_dir / CHECKPOINT_META
    scorers = (scorers_for_mode(mode, gamma_q, gamma_d) if mode is not None
               else scorers_from_meta(meta["scorers"], where=str(meta_path)))
    weights = Path(path) if Path(path).is_file() else weights_file(step_dir)
    if weights is None:
        raise FileNotFoundError(f"checkpoint weights not found: {step_dir / WEIGHTS_FILE}")
    try:
        # a sigmoid-loss checkpoint holds open_clip's logit_bias too (it does not change a ranking)
        bias = {"init_logit_bias": meta["logit_bias"]} if meta.get("logit_bias") is not None else {}
        bundle = create_clip(meta["model"], str(weights), device=device, **bias)
    except (UnsafeFileError, DamagedFileError):
        raise
    except ValueError as exn:
        trained = ((meta.get("config") or {}).get("model") or {}).get("name")
        also = f"; its run config says model {trained!r}" if trained and trained != meta["model"] else ""
        raise ValueError(f"{exn} (model {meta['model']!r} is named in {meta_path}{also})") from None
    bundle.model.eval()
    return EvalModel(bundle.model, bundle.preprocess_val, bundle.tokenizer, bundle.model_name, scorers,
                     {"checkpoint": str(step_dir), "pretrained": str(weights), "logit_scale": meta.get("logit_scale"),
                      "logit_bias": meta.get("logit_bias"), "loss_type": meta.get("loss_type", "clip"),
                      "scorers_from": "--mode" if mode is not None else str(meta_path)})


def load_open_clip(model: str, pretrained: str | None, *, mode: str = "cosine", gamma_q: float | None = None,
                   gamma_d: float | None = None, device: str | torch.device = "cpu") -> EvalModel:
    """A plain open_clip model (name + pretrained tag or local file, or random init with None)."""
    looks_like_file = pretrained is not None and looks_like_path(pretrained)
    if looks_like_file and not Path(pretrained).is_file():  # a tag has neither; open_clip would try to download
        raise FileNotFoundError(f"pretrained weights not found: {pretrained}")
    scorers = scorers_for_mode(mode, gamma_q, gamma_d)
    try:
        bundle = create_clip(model, pretrained, device=device)
    except (UnsafeFileError, DamagedFileError):
        raise
    except ValueError as exn:
        meta_path = Path(pretrained).parent / CHECKPOINT_META if looks_like_file else None
        if meta_path is None or not meta_path.is_file():
            raise
        try:
            trained = json.loads(meta_path.read_text()).get("model")
        except (json.JSONDecodeError, AttributeError):
            trained = None
        if not isinstance(trained, str):
            raise
        raise ValueError(f"{exn} ({meta_path} says it was trained as model {trained!r}: evaluate it with "
                         f"--checkpoint {meta_path.parent})") from None
    bundle.model.eval()
    return EvalModel(bundle.model, bundle.preprocess_val, bundle.tokenizer, bundle.model_name, scorers,
                     {"checkpoint": None, "pretrained": pretrained, "scorers_from": "--mode"})
