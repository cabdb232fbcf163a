"""What zero-shot evaluation scores: a CLIP model with a frozen Scorer per direction, loaded from a
magclip checkpoint (its own Scorers, from magclip.json) or from plain open_clip weights (`--mode`).

A checkpoint can be given as a step folder, its weights file, a run folder or a checkpoints folder
(both follow `latest`). A step folder holds open_clip_model.safetensors + open_clip_config.json (open_clip's
hub layout) and magclip.json; folders written before that layout hold model.pt instead, and still load.
Weights load through open_clip (safetensors, or torch.load with weights_only): nothing in a checkpoint
folder runs code.

The same step folder opened by open_clip's naming (`local-dir:STEP`, or a model name with STEP's own weights
file as pretrained) is scored with the scorers its magclip.json records, as with the checkpoint itself, unless
a mode is given; plain open_clip weights (no magclip.json beside them) score as cosine, open_clip's way.
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
from magclip.models.clip import (
    CHECKPOINT_META,
    OPEN_CLIP_CONFIG,
    WEIGHTS_FILE,
    RawCLIP,
    create_clip,
    loaded_weights,
    local_dir_weights,
    weights_file,
)
from magclip.similarity import Scorer, ScorerSpec, evaluation_scorers, frozen, resolve_specs

log = logging.getLogger("magclip.evaluation")
LOCAL_DIR = "local-dir:"  # open_clip's model-name schema for a folder in its hub layout
NO_RECORD = "cosine: open_clip's default (no magclip.json records the weights' scorers)"  # `scorers_from` without


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


def requested_scorers(mode: str | None, gamma_q: float | None, gamma_d: float | None) -> dict[str, Scorer] | None:
    """The `--mode` override, or None for "the model's own scorers": exponents without a mode are refused
    rather than dropped (they would not be what scored)."""
    if mode is None:
        if gamma_q is not None or gamma_d is not None:
            raise ValueError("gamma_q/gamma_d go with mode fixed or learnable (without a mode the model's own "
                             "scorers are used)")
        return None
    return scorers_for_mode(mode, gamma_q, gamma_d)


def load_checkpoint(path: str | Path, *, mode: str | None = None, gamma_q: float | None = None,
                    gamma_d: float | None = None, device: str | torch.device = "cpu") -> EvalModel:
    """A magclip checkpoint (step folder, its weights file, or a run folder) with its own Scorers;
    `mode` (with gamma_q/gamma_d for fixed/learnable) overrides both directions."""
    step_dir = resolve_checkpoint(path)
    meta = read_checkpoint_meta(step_dir)
    meta_path = step_dir / CHECKPOINT_META
    scorers = requested_scorers(mode, gamma_q, gamma_d)
    if scorers is None:
        scorers = scorers_from_meta(meta["scorers"], where=str(meta_path))
    weights = Path(path) if Path(path).is_file() else weights_file(step_dir)
    if weights is None:
        raise FileNotFoundError(f"checkpoint weights not found: {step_dir / WEIGHTS_FILE}")
    try:
        bundle = create_clip(meta["model"], str(weights), device=device, **logit_bias_kwargs(meta))
    except (UnsafeFileError, DamagedFileError):
        raise
    except ValueError as exn:
        trained = ((meta.get("config") or {}).get("model") or {}).get("name")
        also = f"; its run config says model {trained!r}" if trained and trained != meta["model"] else ""
        raise ValueError(f"{exn} (model {meta['model']!r} is named in {meta_path}{also})") from None
    bundle.model.eval()
    return EvalModel(bundle.model, bundle.preprocess_val, bundle.tokenizer, bundle.model_name, scorers,
                     {**recorded(step_dir, meta), "pretrained": str(weights),
                      "scorers_from": f"--mode {mode}" if mode is not None else str(meta_path)})


def logit_bias_kwargs(meta: Mapping[str, Any]) -> dict[str, Any]:
    """A sigmoid-loss checkpoint holds open_clip's logit_bias too (it does not change a ranking): the model
    is built with one so that the weights fit."""
    return {"init_logit_bias": meta["logit_bias"]} if meta.get("logit_bias") is not None else {}


def recorded(step_dir: Path, meta: Mapping[str, Any]) -> dict[str, Any]:
    """What a magclip.json records about its weights, for the results (`EvalModel.source`)."""
    return {"checkpoint": str(step_dir), "logit_scale": meta.get("logit_scale"), "logit_bias": meta.get("logit_bias"),
            "loss_type": meta.get("loss_type", "clip")}


# ----------------------------------------------------------------------------- plain open_clip names


def local_dir(model: str) -> Path | None:
    """The folder of open_clip's `local-dir:FOLDER` model name (its hub layout), None for any other name."""
    return Path(model[len(LOCAL_DIR):]) if model.startswith(LOCAL_DIR) else None


def check_local_dir(folder: Path) -> None:
    """A `local-dir:` folder open_clip can build *trained* weights from: open_clip builds a random model
    from a folder that holds a config but no weights, with only a log warning -- a silent wrong number."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{LOCAL_DIR}{folder}: no such folder")
    magclip_step = (folder / CHECKPOINT_META).is_file()
    if not (folder / OPEN_CLIP_CONFIG).is_file():
        what = (f"a magclip step folder written before open_clip's hub layout: evaluate it with --checkpoint {folder}"
                if magclip_step else "open_clip's hub layout holds it beside the weights")
        raise FileNotFoundError(f"{LOCAL_DIR}{folder}: no {OPEN_CLIP_CONFIG} there ({what})")
    if local_dir_weights(folder) is None:
        raise FileNotFoundError(f"{LOCAL_DIR}{folder}: no weights there (*.safetensors, *.bin or *.pth beside "
                                f"{OPEN_CLIP_CONFIG}); open_clip would build an untrained model")


def magclip_record(model: str, pretrained: str | None) -> tuple[Path, dict[str, Any], str] | None:
    """The magclip.json that describes the weights open_clip will load, its content, and how they were named
    (`local-dir:FOLDER` or `--pretrained FILE`): a magclip step folder opened through open_clip's naming.

    `--pretrained FILE` counts only when FILE is its folder's own weights file (open_clip_model.safetensors,
    or a legacy model.pt): magclip.json describes that file, not anything copied beside it."""
    folder = local_dir(model)
    if folder is not None:
        named = model
    elif pretrained is not None and looks_like_path(pretrained) and Path(pretrained).is_file():
        folder, named = Path(pretrained).parent, f"--pretrained {pretrained}"
        own = weights_file(folder)
        if own is None or not own.samefile(pretrained):
            return None
    else:
        return None
    if not (folder / CHECKPOINT_META).is_file():
        return None
    return folder / CHECKPOINT_META, read_checkpoint_meta(folder), named


def trained_as_hint(pretrained: str | None) -> str:
    """What the folder of a weights file says it was trained as, for a model that does not fit it: the
    magclip run's model (evaluate with --checkpoint) or open_clip's config beside it (`local-dir:`)."""
    if pretrained is None or not looks_like_path(pretrained):
        return ""
    folder = Path(pretrained).parent
    try:
        trained = json.loads((folder / CHECKPOINT_META).read_text()).get("model")
    except (OSError, json.JSONDecodeError, AttributeError):
        trained = None
    if isinstance(trained, str):
        return f"{folder / CHECKPOINT_META} says it was trained as model {trained!r}: evaluate it with --checkpoint {folder}"
    if (folder / OPEN_CLIP_CONFIG).is_file():
        return f"{folder / OPEN_CLIP_CONFIG} is beside it: --model {LOCAL_DIR}{folder} builds the model it was saved as"
    return ""


def load_open_clip(model: str, pretrained: str | None, *, mode: str | None = None, gamma_q: float | None = None,
                   gamma_d: float | None = None, device: str | torch.device = "cpu") -> EvalModel:
    """A model by open_clip's naming: a name + pretrained tag or local file (random init with None), or
    `local-dir:FOLDER`. `mode` None scores with the weights' own scorers where magclip.json describes them
    (a magclip step folder: `magclip_record`), else as cosine, open_clip's way; a `mode` overrides both.

    Why: plain open_clip opens a magclip checkpoint as `local-dir:STEP`; scoring a qnorm run's weights as
    cosine there would report numbers the run never had. `source["scorers_from"]` says which rule applied."""
    folder = local_dir(model)
    if folder is not None:
        if pretrained is not None:  # open_clip would ignore it, with only a log warning
            raise ValueError(f"pretrained {pretrained!r} goes with a model name: {model} loads the weights in its "
                             "folder")
        check_local_dir(folder)
    elif pretrained is not None and looks_like_path(pretrained) and not Path(pretrained).is_file():
        raise FileNotFoundError(f"pretrained weights not found: {pretrained}")  # open_clip would try a download
    record = magclip_record(model, pretrained)
    scorers = requested_scorers(mode, gamma_q, gamma_d)
    if scorers is not None:
        scorers_from = f"--mode {mode}"
    elif record is not None:
        meta_path, meta, named = record
        scorers, scorers_from = scorers_from_meta(meta["scorers"], where=str(meta_path)), f"{CHECKPOINT_META} ({named})"
    else:
        scorers, scorers_from = scorers_for_mode("cosine"), NO_RECORD
    bias = logit_bias_kwargs(record[1]) if record is not None and folder is None else {}  # local-dir: in its config
    try:
        bundle = create_clip(model, pretrained, device=device, **bias)
    except (UnsafeFileError, DamagedFileError):
        raise
    except ValueError as exn:
        hint = trained_as_hint(pretrained)
        if not hint:
            raise
        raise ValueError(f"{exn} ({hint})") from None
    bundle.model.eval()
    source = recorded(record[0].parent, record[1]) if record is not None else {"checkpoint": None}
    return EvalModel(bundle.model, bundle.preprocess_val, bundle.tokenizer, bundle.model_name, scorers,
                     {**source, "pretrained": loaded_weights(model, pretrained), "scorers_from": scorers_from})
