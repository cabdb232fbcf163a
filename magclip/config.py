"""Run configuration: dataclasses, YAML files, dotted CLI overrides and validation.

A config is plain data. `load_config(path, ["train.epochs=2", "loss.i2t=qnorm"])` reads the YAML,
applies the overrides, and checks every key and type before any work starts; an unknown key or a
bad value raises a ConfigError that names it and lists what is allowed.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from magclip.io import atomic_write_text
from magclip.similarity import MODES

PRECISIONS = ("fp32", "bf16", "fp16")


class ConfigError(ValueError):
    """A config key or value that cannot be used; the message names it."""


@dataclass
class ModelConfig:
    name: str = "tiny-resnet"          # open_clip name, configs/models/<name>.json, or a JSON path
    pretrained: str | None = None     # local checkpoint path or open_clip pretrained tag
    lock_text: bool = False           # LiT-style: freeze the text tower
    lock_image: bool = False
    grad_checkpointing: bool = False


@dataclass
class SyntheticConfig:
    num_train: int = 6000
    num_val: int = 500
    image_size: int = 32
    root: str | None = None           # default: $MAGCLIP_CACHE or ~/.cache/magclip


@dataclass
class DataConfig:
    train: str | None = None          # shard URLs (brace patterns, sources joined by '::'); None = synthetic
    val: str | None = None            # validation shards: periodic validation and the final table
    eval_sets: dict[str, str] = field(default_factory=dict)  # more named shard sets scored at the end
    train_weights: str | None = None  # per-source weights, '::'-separated
    num_samples: int | None = None    # samples per epoch (global); None = one pass over train
    resampled: bool = False
    shuffle_buffer: int = 1000
    workers: int = 2
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)


@dataclass
class LossConfig:
    i2t: str | None = "cosine"        # scoring mode image->text (image = query); None drops the direction
    t2i: str | None = "cosine"        # scoring mode text->image (text = query)
    i2t_weight: float = 1.0
    t2i_weight: float = 1.0
    gamma_q: float | None = None      # initial exponents for 'learnable' ('fixed': the exponents)
    gamma_d: float | None = None
    share_learnable: bool = False     # both learnable directions share one (gamma_q, gamma_d) pair
    local_loss: bool = False
    gather_with_grad: bool = True
    logit_scale_init: float | None = None     # None: the mode's default (magclip.temperature)
    logit_scale_learnable: bool | None = None
    logit_scale_max: float | None = None
    logit_scale_from_norms: bool = False      # start every mode at cosine's effective temperature


@dataclass
class TrainConfig:
    epochs: int = 1
    max_steps: int | None = None      # stop early after this many optimizer steps
    batch_size: int = 128             # per process
    lr: float = 1e-3
    loss_lr: float | None = None      # learning rate of the logit scale and exponents; None = lr
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-6
    warmup_steps: int = 50
    precision: str = "fp32"
    accum_freq: int = 1               # micro-batches per step; negatives span all of them (feature cache)
    grad_clip: float | None = 1.0
    seed: int = 0
    log_every: int = 10
    val_every: int | None = None      # steps; None = only at the end
    checkpoint_every: int | None = None  # steps; None = only at the end
    resume: str | None = None         # 'latest' or a checkpoint directory
    max_nonfinite_steps: int = 10     # consecutive skipped non-finite steps before the run stops


@dataclass
class RunConfig:
    name: str = "default"
    output_dir: str = "runs"
    overwrite: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                schema: type = RunConfig) -> Any:
    """Read a YAML config (or the defaults), apply `key.sub=value` overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        raw = yaml.safe_load(path.read_text()) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping, got {type(raw).__name__}")
    for item in overrides or []:
        _apply_override(raw, item)
    cfg = from_dict(schema, raw)
    validate(cfg)
    return cfg


def _apply_override(raw: dict[str, Any], item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.sub=value")
    key, value = item.split("=", 1)
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {part!r} is not a section")
    node[parts[-1]] = yaml.safe_load(value) if value.strip() else None


def from_dict(schema: type, raw: dict[str, Any], where: str = "") -> Any:
    """Build the dataclass `schema` from a nested dict, naming any unknown key or bad type."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where or 'config'} must be a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(schema)}
    hints = typing.get_type_hints(schema)
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"unknown config key {where + unknown[0]!r}; allowed in "
                          f"{where.rstrip('.') or 'the top level'}: {', '.join(fields)}")
    values = {}
    for name, value in raw.items():
        values[name] = _coerce(hints[name], value, f"{where}{name}")
    return schema(**values)


def _coerce(kind: Any, value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(kind):
        return from_dict(kind, value, key + ".")
    if typing.get_origin(kind) is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise ConfigError(f"config key {key!r} must be a mapping of names to strings, got {value!r}")
        return dict(value)
    options = typing.get_args(kind) if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union else (kind,)
    if value is None:
        if type(None) in options:
            return None
        raise ConfigError(f"config key {key!r} may not be empty")
    for option in options:
        if option is bool and isinstance(value, bool):
            return value
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if option is str and isinstance(value, str):
            return value
        if option is float and isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
    names = " or ".join("null" if o is type(None) else o.__name__ for o in options)
    raise ConfigError(f"config key {key!r} must be {names}, got {value!r}")


def validate(cfg: Any) -> None:
    """Value checks that types alone cannot express (RunConfig only; other schemas check themselves)."""
    if not isinstance(cfg, RunConfig):
        return
    for direction in ("i2t", "t2i"):
        mode = getattr(cfg.loss, direction)
        if mode is not None and mode not in MODES:
            raise ConfigError(f"loss.{direction}={mode!r} is not a scoring mode; allowed: {', '.join(MODES)} or null")
    if cfg.loss.i2t is None and cfg.loss.t2i is None:
        raise ConfigError("loss.i2t and loss.t2i are both null: keep at least one direction")
    if cfg.train.precision not in PRECISIONS:
        raise ConfigError(f"train.precision={cfg.train.precision!r}; allowed: {', '.join(PRECISIONS)}")
    positive = {"train.batch_size": cfg.train.batch_size, "train.epochs": cfg.train.epochs,
                "train.accum_freq": cfg.train.accum_freq, "train.log_every": cfg.train.log_every}
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    if cfg.train.lr <= 0:
        raise ConfigError(f"train.lr must be > 0, got {cfg.train.lr}")
    if cfg.train.resume not in (None, "latest") and not Path(cfg.train.resume).exists():
        raise ConfigError(f"train.resume={cfg.train.resume!r}: no such checkpoint (use 'latest' or a path)")


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_config(cfg: Any, path: str | Path) -> None:
    atomic_write_text(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))
