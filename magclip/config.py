"""Run configuration: dataclasses, YAML files, dotted CLI overrides and validation.

A config is plain data. `load_config(path, ["train.epochs=2", "loss.i2t=qnorm"])` reads the YAML,
applies the overrides, and checks every key and type before any work starts; an unknown key or a
bad value raises a ConfigError that names it and lists what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import re
import signal
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from magclip.io import atomic_write_text
from magclip.modes import LOSS_TYPES, MODES, TEXT_COSINE_SCALE, check_mode, resolve_specs

PRECISIONS = ("fp32", "bf16", "fp16", "auto")  # auto: bf16 where the device computes it natively, else fp32
EVAL_PRECISIONS = ("fp32", "bf16", "auto")     # encoding precision of evaluations (the commands' --precision)
SIGLIP_DIST_IMPLS = ("bidir", "shift", "reduce", "gather")  # open_clip's SigLipLoss(dist_impl=...) names
OPTIMIZER_IMPLS = ("auto", "fused", "foreach", "for_loop")  # train.optimizer_impl (magclip.training.levers)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
IDENTICAL_ID_RULES = ("self", "keep", "drop")  # eval.identical_ids (magclip.data.beir.identical_id_exclusions)
SHARDINGS = ("ddp", "fsdp")  # train.sharding (magclip.training.sharding)
SAVE_FULL_MODEL = ("every", "last", "never")  # train.save_full_model: which fsdp checkpoints hold the model files
RESUME_WORDS = ("latest", "auto")  # train.resume: the newest checkpoint (required / if there is one)
# train.report_to: tensorboard is magclip's own writer, the others accelerate's trackers (training/trackers.py)
TRACKERS = ("tensorboard", "wandb", "mlflow", "comet_ml", "aim", "clearml", "dvclive", "swanlab", "trackio")

# Keys a resume may change: where the run is, when it stops, how often it logs, validates and
# checkpoints, and how the host runs it (threads, loader workers, the speed levers but precision).
# Every other key changes the experiment (`experiment_differences`): a resume whose config differs
# from its checkpoint's in one is refused, and a grid's finished cell is stale. Some of these still
# change what is trained, and a resume says so when they differ (RESUME_CAVEATS): the number of steps
# (the cosine schedule is recomputed for the new total from the resumed step on) and the speed levers (float
# rounding). The loader workers do not: the batches are data.streams's, wherever they are read.
RESUMABLE_KEYS = (
    "name", "output_dir", "overwrite", "train.resume", "train.epochs", "train.max_steps", "train.log_every",
    "train.val_every", "train.val_at", "train.checkpoint_every", "train.threads", "train.collective_timeout_s",
    "train.max_nonfinite_steps", "data.workers", "eval.batch_size", "train.optimizer_impl", "train.channels_last",
    "train.compile", "train.compile_mode", "train.report_to", "train.save_on_signal", "train.time_limit",
    "loss.logit_scale_from_norms", "eval.start_cache", "loss.dist_impl", "train.sharding", "train.save_full_model",
    "data.cache", "data.cache_max_mb", "model.length_groups",
)
RUN_LENGTH_KEYS = ("train.epochs", "train.max_steps")  # resumable, but a finished run's length is its experiment
RESUME_CAVEATS = {
    "train.epochs": "the learning-rate schedule is recomputed for the new number of steps",
    "train.max_steps": "the learning-rate schedule is recomputed for the new number of steps",
    "data.workers": "the same batches where the workers divide data.streams, else fewer workers are used",
    **{f"train.{k}": "a speed lever: the run continues the same experiment, rounded differently from an unbroken run"
       for k in ("optimizer_impl", "channels_last", "compile", "compile_mode")},
    "loss.logit_scale_from_norms": "a starting point only: the resumed run keeps its checkpoint's scale",
    "loss.dist_impl": "a memory lever: the same loss and gradients, summed in another order",
    "train.sharding": "a memory lever: the same training, its gradient reductions summed in another order",
    "model.length_groups": "a speed lever: the same batches, their forwards cut differently (other dropout draws, other rounding)",
}
# where a sample's captions are (magclip.data.captions) and which retrieved item is a hit (magclip.metrics.relevance)
CAPTION_KEY = re.compile(r"^(txt|json:[^.\s]+(\.[^.\s]+)*)$")
CAPTION_KEY_HELP = ("use 'txt' (KEY.txt, one caption a line) or 'json:FIELD' (a KEY.json field holding a caption or a "
                    "list of captions; 'json:a.b' inside nested objects)")
MATCHINGS = ("caption", "image")
POOLINGS = ("mean", "cls", "last", "mean_sqrt_len")  # how a text encoder turns token states into one vector (models/text.py)
MAGNITUDES = ("learned",)  # a head that sets the pooled vector's norm (models/magnitude.py)


class ConfigError(ValueError):
    """A config key or value that cannot be used; the message names it."""


@dataclass
class LoRAConfig:
    """`model.lora`: low-rank adapters through peft (magclip/models/lora.py), peft's LoraConfig names: r (0 = off),
    alpha (peft's lora_alpha: the update is scaled by alpha / r), dropout (lora_dropout) and target_modules."""

    r: int = 0                        # rank of the adapters; 0: no LoRA, every parameter of the towers trains
    alpha: float = 8.0                # peft's default lora_alpha
    dropout: float = 0.0              # on the adapters' input (peft's lora_dropout)
    target_modules: Any = None        # peft's: a list of module-name suffixes, or one regex string (full match); null:
                                      # every nn.Linear and nn.MultiheadAttention inside the towers' repeated blocks


@dataclass
class ModelConfig:
    name: str = "tiny-resnet"          # open_clip name, magclip/models/configs/<name>.json, or a JSON path
    pretrained: str | None = None     # local checkpoint path or open_clip pretrained tag
    lock_text: bool = False           # LiT-style: freeze the text tower
    lock_image: bool = False
    grad_checkpointing: bool = False
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # LoRA through peft (models/lora.py); r=0: off


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
    eval_sets: dict[str, str] = field(default_factory=dict)  # more named sets scored at the end (shards, CLIP_benchmark
                                      # folders: their test split, Karpathy split files over their folder's images)
    train_weights: str | None = None  # per-source weights, '::'-separated
    num_samples: int | None = None    # samples per epoch (global); None = one pass over train
    resampled: bool = False
    shuffle_buffer: int = 5000        # samples per loader worker, encoded (~23 KB each at 224-px JPEG): open_clip_train's
                                      # 5,000; measured against 1,000 in benchmarks/README.md (learning quality)
    workers: int | str = "auto"       # loader worker processes; auto: in the training process where the step runs on
                                      # the CPU from the decoded-sample cache on few cores, else 2 (training/threads.py)
    streams: int | str = "auto"       # sample streams per rank, each with its own shards and shuffle buffer, batches
                                      # taken in turn (data/shards.py); auto: 2, or the workers where more. The same
                                      # batches for any data.workers that divides it: 0, 1 or 2 at auto
    cache: bool | str = "auto"        # keep decoded training samples in memory for the epochs after the first
                                      # (data/decoded_cache.py): auto = when the run reads the shards more than once
                                      # and they fit cache_max_mb; true; false. The same batches either way
    cache_max_mb: int | None = None   # None: a tenth of the machine's memory / local processes, at most 4 GiB
    caption_key: str = "txt"          # where captions are: txt (KEY.txt, one caption a line) or json:FIELD (a KEY.json
                                      # field: a caption or a list); training draws one per sample and epoch
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)


@dataclass
class LossConfig:
    type: str = "clip"                # clip: softmax per direction (CLIPLoss); siglip: pairwise sigmoid (SigLIPLoss)
    mode: str = "cosine"              # siglip: the one scoring mode, the image as query (clip: loss.i2t / loss.t2i)
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
    logit_scale_from_norms: bool | None = None  # start at cosine's effective temperature on batch 1; None:
                                                # the measured default (siglip with a raw side: yes; see temperature.py)
    logit_bias_init: float | None = None      # siglip: None = -10 (open_clip's SigLIP init, every mode)
    logit_bias_learnable: bool = True
    dist_impl: str = "bidir"                  # siglip across ranks: bidir/shift/reduce exchange features with the
                                              # neighbours (open_clip's), gather gathers them all (SigLIPLoss)


# keys of one loss type only, with the value they must keep under the other (a set one is an error)
CLIP_ONLY_KEYS = {"i2t": "cosine", "t2i": "cosine", "i2t_weight": 1.0, "t2i_weight": 1.0, "share_learnable": False}
SIGLIP_ONLY_KEYS = {"mode": "cosine", "logit_bias_init": None, "logit_bias_learnable": True, "dist_impl": "bidir"}


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
    precision: str = "auto"           # auto: bf16 where the device computes it natively (a GPU with bf16, a CPU
                                      # with AVX512-BF16 or AMX), fp32 elsewhere (magclip.training.levers);
                                      # fp32 / bf16 / fp16 as asked. Evaluations keep eval.precision
    optimizer_impl: str = "auto"      # AdamW kernel: auto (fused where torch has it) / fused / foreach / for_loop
    channels_last: bool = True        # conv towers in channels_last memory (ignored, with a log line, without convs)
    compile: bool | str = "auto"      # torch.compile the towers; auto: runs of >= 1000 steps with batches of one shape,
                                      # unsharded, without LoRA (training/levers.py compile_choice); true; false
    compile_mode: str = "default"
    accum_freq: int = 1               # micro-batches per step; negatives span all of them (feature cache)
    sharding: str = "ddp"             # ddp: a full replica per process; fsdp: parameters, gradients and optimizer state
                                      # sharded across processes (FSDP2, magclip.training.sharding)
    save_full_model: str = "every"    # fsdp: which checkpoints also hold the consolidated model folder (open_clip's,
                                      # sentence-transformers'), gathered on the main process: every / last / never
                                      # (the DCP shards alone; magclip-consolidate writes it offline). Keep every while
                                      # the whole model fits the main process; last or never when it does not. ddp:
                                      # every checkpoint writes it (the replica is whole, nothing is gathered). fsdp +
                                      # model.lora: every checkpoint holds the adapters, never a merged model
                                      # (magclip-consolidate STEP --merge writes it offline)
    grad_clip: float | None = 1.0
    seed: int = 0
    log_every: int = 10
    val_every: int | None = None      # steps; None = only at the end
    val_at: list[int] = field(default_factory=list)  # more validation steps (a budget curve: [160, 500, 1000]);
                                      # a text run keeps each one's per-query outcomes in evals/step_N.json
    checkpoint_every: int | None = None  # steps; None = only at the end
    resume: str | None = None         # 'latest', 'auto' (latest if there is one, else a fresh start) or a step folder
    max_nonfinite_steps: int = 10     # consecutive skipped non-finite steps before the run stops
    collective_timeout_s: float = 1800.0  # a collective (gradient all-reduce, barrier) waiting longer on a lost rank fails
    threads: int | None = None        # intra-op threads per process; None: OMP_NUM_THREADS, else the cores
                                      # this process may use minus its loader workers (training/threads.py)
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])  # trackers beside metrics.jsonl
                                      # (TRACKERS; "wandb,mlflow" or a list; none / [] = metrics.jsonl only)
    save_on_signal: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])  # save the step reached,
                                      # exit 75 (training/preemption.py); none / [] = the signals' default action
    time_limit: str | float | None = None  # "3h50m", "90m", "1:30:00", seconds: save and exit 75 before it (from the
                                      # process's start; SLURM_JOB_END_TIME is used too where it is set)


@dataclass
class ClipTrainConfig(TrainConfig):
    """The CLIP trainer's defaults are the main job (tiny ResNet on the embedded scenes, ~230 steps)."""

    epochs: int = 5
    lr: float = 2e-3
    warmup_steps: int = 20


@dataclass
class RunFolder:
    """Where a run writes: `output_dir/name` (the first keys of every run schema)."""

    name: str = "run"
    output_dir: str = "runs"
    overwrite: bool = False

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name


@dataclass
class ClipEvalConfig:
    precision: str = "fp32"           # encoding precision of the run's validation and eval_sets, whatever
                                      # train.precision is, so R@1 compares across machines: fp32 / bf16 / auto
    matching: str | None = None       # retrieval relevance of data.val and data.eval_sets: caption (identity), image
                                      # (CLIP_benchmark's: a caption is relevant to its own image only), or null: each
                                      # set's layout's (image for CLIP_benchmark folders and Karpathy files, else caption)


@dataclass
class RunConfig(RunFolder):
    """A CLIP run (train/clip.py). The defaults are the main job: no config file is needed."""

    name: str = "default"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: ClipTrainConfig = field(default_factory=ClipTrainConfig)
    eval: ClipEvalConfig = field(default_factory=ClipEvalConfig)


# ---------------------------------------------------------------------------- text retrieval runs
@dataclass
class TextModelConfig:
    name: str = "minilm"                   # 'minilm', a local folder, 'pkg:module/sub' or a hub name
    pooling: str | None = None             # mean / cls / last / mean_sqrt_len (sum/sqrt(n)); None: the folder's own
    magnitude: str | None = None           # "learned": the pooled direction, its norm softplus(w·h+b) (models/magnitude.py)
    query_prefix: str | None = None        # None: the folder's own prompts ('' for plain HF)
    passage_prefix: str | None = None
    query_max_length: int | None = 64
    passage_max_length: int | None = 256
    shared: bool = True                    # one tower for both sides; false copies it into two
    grad_checkpointing: bool = False
    length_groups: bool = True             # run a batch's texts in groups of similar length: the same vectors, less
                                           # padding (models/length_groups.py); off under fsdp
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # LoRA through peft (models/lora.py); r=0: off


@dataclass
class TextDataConfig:
    train: str | None = None               # pairs: .jsonl[.gz], .parquet/.csv/.tsv/.json, a datasets save_to_disk
                                           # folder, a folder of these, tar shards (brace patterns, '::')
    train_split: str = "train"             # the split of a DatasetDict folder in data.train
    beir: str | None = None                # or a BEIR folder whose `beir_split` qrels become pairs
    beir_split: str = "train"
    random_negatives: int = 0              # BEIR conversion: random corpus negatives per query
    max_records: int | None = None         # use only the first N records (quick runs)
    group_size: int = 1                    # documents per query: 1 positive + group_size-1 hard negatives
    passage_max_tokens: int | None = None  # training truncation of documents; None: model.passage_max_length
    passage_min_tokens: int | None = None  # set: each document cut at a length drawn from [min, max] (length-varied)
    no_duplicates: bool = True             # no text twice in a global batch (no false in-batch negatives)


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
    identical_ids: str = "self"             # same-id documents left out of a ranking: self (only the query itself), drop, keep
    precision: str = "fp32"                 # encoding precision of every evaluation of the run, before and after
                                            # training alike, whatever train.precision is: fp32 / bf16 / auto
    start_cache: str | None = None          # a folder that shares eval.at_start's evaluation among runs of the same
                                            # start, sets and scorer (the seeds of a grid): training/start_cache.py


@dataclass
class TextRunConfig(RunFolder):
    name: str = "text"
    model: TextModelConfig = field(default_factory=TextModelConfig)
    data: TextDataConfig = field(default_factory=TextDataConfig)
    loss: TextLossConfig = field(default_factory=TextLossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)  # configs/text set text-sized values
    eval: TextEvalConfig = field(default_factory=TextEvalConfig)



def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                schema: type = RunConfig) -> Any:
    """Read a YAML config (or the defaults), apply `key.sub=value` overrides, validate."""
    raw = read_yaml_mapping(path, "config file") if path is not None else {}
    for item in overrides or []:
        _apply_override(raw, item)
    cfg = from_dict(schema, raw)
    validate(cfg)
    return cfg


def read_yaml_mapping(path: str | Path, what: str) -> dict[str, Any]:
    """A YAML file whose top level is a mapping (empty: {}); a missing file, bad YAML or another top level is a
    ConfigError naming the file (and where the YAML breaks)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exn:
        raise ConfigError(f"{path}: not valid YAML{_yaml_where(exn)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(raw).__name__}")
    return raw


def load_text_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TextRunConfig:
    """`load_config` with the text run schema (train/text.py)."""
    return load_config(path, overrides, schema=TextRunConfig)


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
    if not value.strip():  # e.g. data.train=$UNSET: never fall back to a default silently
        raise ConfigError(f"override {key.strip()!r} has an empty value (an unset shell variable?); "
                          f"write {key.strip()}=null to unset it")
    try:
        node[parts[-1]] = yaml.safe_load(value)
    except yaml.YAMLError as exn:
        raise ConfigError(f"override {key.strip()!r}: value {value!r} is not valid YAML{_yaml_where(exn)}") from None


def _yaml_where(exn: yaml.YAMLError) -> str:
    """' at line L, column C: problem' from a YAML error (lines and columns from 1)."""
    mark = getattr(exn, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(exn, "problem", None) or str(exn).splitlines()[0]
    return f"{where}: {problem}"


def from_dict(schema: type, raw: dict[str, Any], where: str = "") -> Any:
    """Build the dataclass `schema` from a nested dict, naming any unknown, missing or badly typed key.
    The one schema machinery of magclip's YAML files: run configs, and the grid files of
    magclip.experiments.grid (a field typed `Any` takes any YAML value, checked by its owner)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where.rstrip('.') or 'config'} must be a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(schema)}
    hints = typing.get_type_hints(schema)
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"unknown config key {where + unknown[0]!r}; allowed in "
                          f"{where.rstrip('.') or 'the top level'}: {', '.join(fields)}")
    missing = [name for name, f in fields.items() if name not in raw and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"config key {where + missing[0]!r} is required")
    values = {}
    for name, value in raw.items():
        values[name] = _coerce(hints[name], value, f"{where}{name}")
    return schema(**values)


def _coerce(kind: Any, value: Any, key: str) -> Any:
    if kind is Any:
        return value
    if dataclasses.is_dataclass(kind):
        return from_dict(kind, value, key + ".")
    if typing.get_origin(kind) is dict:
        any_values = typing.get_args(kind)[1:] == (Any,)
        if not isinstance(value, dict) or not all(isinstance(k, str) and (any_values or isinstance(v, str))
                                                  for k, v in value.items()):
            what = "names" if any_values else "names to strings"
            raise ConfigError(f"config key {key!r} must be a mapping of {what}, got {value!r}")
        return dict(value)
    if typing.get_origin(kind) is list:  # a YAML list or one comma-separated string; null = []
        return _coerce_list(typing.get_args(kind)[0], value, key)
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
            return _finite(float(value), key)
        if option is str and isinstance(value, str):
            return value
        if option is float and isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
            try:
                number = float(value)
            except ValueError:
                pass
            else:
                return _finite(number, key)
    names = " or ".join("null" if o is type(None) else o.__name__ for o in options)
    raise ConfigError(f"config key {key!r} must be {names}, got {value!r}")


def _coerce_list(item: type, value: Any, key: str) -> list[Any]:
    """list[str] or list[int]: a YAML list, or one comma-separated string ("wandb,mlflow", "160,500"); null = []."""
    items = [] if value is None else value.split(",") if isinstance(value, str) else value
    if item is int and isinstance(items, int) and not isinstance(items, bool):  # train.val_at=160
        items = [items]
    if item is int:
        try:
            if not isinstance(items, list) or any(isinstance(v, (bool, float)) for v in items):
                raise ValueError
            return [int(v) for v in items if not isinstance(v, str) or v.strip()]
        except (TypeError, ValueError):
            raise ConfigError(f"config key {key!r} must be a list of integers or a comma-separated string, "
                              f"got {value!r}") from None
    if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
        raise ConfigError(f"config key {key!r} must be a list of strings or a comma-separated string, got {value!r}")
    return [v.strip() for v in items if v.strip()]


def _finite(value: float, key: str) -> float:
    if not math.isfinite(value):
        raise ConfigError(f"config key {key!r} must be a finite number, got {value}")
    return value


def validate(cfg: Any) -> None:
    """Value checks that types alone cannot express: the run schemas share the training and scorer
    checks; each adds its own."""
    if isinstance(cfg, RunConfig):
        _check_clip_loss(cfg.loss)
        _check_eval_precision(cfg.eval.precision)
        _check_captions(cfg)
        _check_data_loading(cfg.data)
    elif isinstance(cfg, TextRunConfig):
        _check_text(cfg)
    else:
        return
    _check_train(cfg.train)
    _check_lora(cfg)


def _check_data_loading(data: DataConfig) -> None:
    if data.workers != "auto" and (isinstance(data.workers, bool) or not isinstance(data.workers, int) or data.workers < 0):
        raise ConfigError(f"data.workers={data.workers!r}; allowed: auto or a number >= 0")
    if data.streams != "auto" and (isinstance(data.streams, bool) or not isinstance(data.streams, int) or data.streams < 1):
        raise ConfigError(f"data.streams={data.streams!r}; allowed: auto or a number >= 1")
    if data.cache != "auto" and not isinstance(data.cache, bool):
        raise ConfigError(f"data.cache={data.cache!r}; allowed: auto, true, false")
    if data.cache_max_mb is not None and data.cache_max_mb < 0:
        raise ConfigError(f"data.cache_max_mb={data.cache_max_mb} must be >= 0")


def _check_captions(cfg: RunConfig) -> None:
    if not CAPTION_KEY.match(cfg.data.caption_key):
        raise ConfigError(f"data.caption_key={cfg.data.caption_key!r}: {CAPTION_KEY_HELP}")
    if cfg.eval.matching is not None and cfg.eval.matching not in MATCHINGS:
        raise ConfigError(f"eval.matching={cfg.eval.matching!r}; allowed: {', '.join(MATCHINGS)}")


def _check_clip_loss(loss: LossConfig) -> None:
    """The CLIP run's loss: the type, then its own keys (a key of the other type is an error naming it)."""
    if loss.type not in LOSS_TYPES:
        raise ConfigError(f"loss.type={loss.type!r}; allowed: {', '.join(LOSS_TYPES)}")
    foreign = CLIP_ONLY_KEYS if loss.type == "siglip" else SIGLIP_ONLY_KEYS
    for key, unset in foreign.items():
        if getattr(loss, key) != unset:
            other = "clip" if loss.type == "siglip" else "siglip"
            hint = ("the sigmoid loss has one score matrix: set its mode with loss.mode (the image is the query)"
                    if loss.type == "siglip" else "the CLIP loss sets a mode per direction: loss.i2t / loss.t2i")
            raise ConfigError(f"loss.{key} is a key of loss.type={other}, not of loss.type={loss.type}; {hint}")
    if loss.type == "siglip":
        _check_mode("loss.mode", loss.mode)
        _check_exponents(loss, [loss.mode])
        _check_siglip_dist_impl(loss)
        return
    for direction in ("i2t", "t2i"):
        _check_mode(f"loss.{direction}", getattr(loss, direction), allow_none=True)
    if loss.i2t is None and loss.t2i is None:
        raise ConfigError("loss.i2t and loss.t2i are both null: keep at least one direction")
    _check_exponents(loss, [m for m in (loss.i2t, loss.t2i) if m is not None])


def _check_siglip_dist_impl(loss: LossConfig) -> None:
    """An exchange always carries the gradient (open_clip's); only the gather has a detached form."""
    if loss.dist_impl not in SIGLIP_DIST_IMPLS:
        raise ConfigError(f"loss.dist_impl={loss.dist_impl!r}; allowed: {', '.join(SIGLIP_DIST_IMPLS)}")
    if not loss.gather_with_grad and loss.dist_impl != "gather":
        raise ConfigError(f"loss.gather_with_grad=false needs loss.dist_impl=gather (got {loss.dist_impl!r}): "
                          "the neighbour exchange always carries the gradient")


def _check_mode(key: str, mode: str | None, allow_none: bool = False) -> None:
    if mode is None and allow_none:
        return
    try:
        check_mode(mode)
    except ValueError:
        raise ConfigError(f"{key}={mode!r} is not a scoring mode; allowed: {', '.join(MODES)}"
                          + (" or null" if allow_none else "")) from None


def _check_exponents(loss: Any, modes: list[str]) -> None:
    """gamma_q/gamma_d configure the modes with free exponents (`modes.resolve_specs`, the training rule)."""
    try:
        resolve_specs(modes, loss.gamma_q, loss.gamma_d, where="loss")
    except ValueError as exn:
        raise ConfigError(str(exn)) from None


def _check_train(train: TrainConfig) -> None:
    if train.precision not in PRECISIONS:
        raise ConfigError(f"train.precision={train.precision!r}; allowed: {', '.join(PRECISIONS)}")
    if train.sharding not in SHARDINGS:
        raise ConfigError(f"train.sharding={train.sharding!r}; allowed: {', '.join(SHARDINGS)}")
    if train.save_full_model not in SAVE_FULL_MODEL:
        raise ConfigError(f"train.save_full_model={train.save_full_model!r}; allowed: {', '.join(SAVE_FULL_MODEL)} "
                          "(which fsdp checkpoints also hold the consolidated model files)")
    if train.sharding == "fsdp":
        if train.precision == "fp16":
            raise ConfigError("train.sharding=fsdp with train.precision=fp16: fp16 needs a loss scaler that sharded "
                              "gradients do not have here; use bf16 (or fp32)")
        if train.compile is True:
            raise ConfigError("train.sharding=fsdp with train.compile=true: compiling sharded towers is not supported "
                              "yet; use train.compile=false")
    if train.optimizer_impl not in OPTIMIZER_IMPLS:
        raise ConfigError(f"train.optimizer_impl={train.optimizer_impl!r}; allowed: {', '.join(OPTIMIZER_IMPLS)}")
    if train.compile != "auto" and not isinstance(train.compile, bool):
        raise ConfigError(f"train.compile={train.compile!r}; allowed: auto, true, false")
    if train.compile_mode not in COMPILE_MODES:
        raise ConfigError(f"train.compile_mode={train.compile_mode!r}; allowed: {', '.join(COMPILE_MODES)}")
    try:
        signal_numbers(train.save_on_signal)
        parse_duration(train.time_limit)
    except ValueError as exn:
        raise ConfigError(str(exn)) from None
    unknown = [n for n in train.report_to if n not in (*TRACKERS, "none")]
    if unknown or ("none" in train.report_to and len(train.report_to) > 1):
        what = f"unknown tracker {unknown[0]!r}" if unknown else "'none' goes alone"
        raise ConfigError(f"train.report_to={','.join(train.report_to)!r}: {what}; allowed: "
                          f"{', '.join(TRACKERS)} (a list or comma-separated), or none")
    if any(step < 1 for step in train.val_at):
        raise ConfigError(f"train.val_at must list steps >= 1, got {train.val_at}")
    if train.threads is not None and train.threads < 1:
        raise ConfigError(f"train.threads must be >= 1 or null (automatic), got {train.threads}")
    positive = {"train.batch_size": train.batch_size, "train.epochs": train.epochs,
                "train.accum_freq": train.accum_freq, "train.log_every": train.log_every}
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    ranges = {"train.lr": (train.lr, 0, None), "train.loss_lr": (train.loss_lr, 0, None),
              "train.eps": (train.eps, 0, None), "train.grad_clip": (train.grad_clip, 0, None),
              "train.beta1": (train.beta1, None, 1), "train.beta2": (train.beta2, None, 1),
              "train.collective_timeout_s": (train.collective_timeout_s, 0, None)}
    for key, (value, above, below) in ranges.items():
        if value is not None and ((above is not None and value <= above) or (below is not None and value >= below)):
            bound = f"> {above}" if below is None else f"in [0, {below})"
            raise ConfigError(f"{key} must be {bound}, got {value}")
    for key, value in {"train.weight_decay": train.weight_decay, "train.beta1": train.beta1,
                       "train.beta2": train.beta2, "train.warmup_steps": train.warmup_steps}.items():
        if value < 0:
            raise ConfigError(f"{key} must be >= 0, got {value}")
    if train.resume not in (None, *RESUME_WORDS) and not Path(train.resume).exists():
        raise ConfigError(f"train.resume={train.resume!r}: no such checkpoint (use 'latest', 'auto' or a path)")


def _check_lora(cfg: RunConfig | TextRunConfig) -> None:
    """model.lora's values, and the combinations a LoRA run cannot train (magclip/models/lora.py checks the rest,
    against the towers, at the start)."""
    lora = cfg.model.lora
    if lora.r < 0:
        raise ConfigError(f"model.lora.r must be >= 0 (0: no LoRA), got {lora.r}")
    if not lora.alpha > 0:
        raise ConfigError(f"model.lora.alpha must be > 0, got {lora.alpha}")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"model.lora.dropout must be in [0, 1), got {lora.dropout}")
    targets = lora.target_modules
    if not (targets is None or (isinstance(targets, str) and targets.strip())
            or (isinstance(targets, list) and targets and all(isinstance(t, str) and t.strip() for t in targets))):
        raise ConfigError(f"model.lora.target_modules={targets!r}: give a list of module-name suffixes "
                          "([c_fc, c_proj]), one regex string (peft's full match), or null (the default)")
    if lora.r == 0:
        return
    locked = [k for k in ("lock_text", "lock_image") if getattr(cfg.model, k, False)]
    if locked:
        raise ConfigError(f"model.lora.r={lora.r} with model.{locked[0]}=true: LoRA freezes every weight of the "
                          "towers already; to leave a tower without adapters, name modules of the other one in "
                          "model.lora.target_modules")


def signal_numbers(names: list[str]) -> list[signal.Signals]:
    """`train.save_on_signal` as signals ("SIGTERM", "TERM", "usr1"; "none" alone: no signal); ValueError
    naming one a process cannot catch."""
    if [n.strip().lower() for n in names] == ["none"]:
        return []
    out = []
    for name in names:
        key = name.strip().upper()
        key = key if key.startswith("SIG") else f"SIG{key}"
        if key in ("SIGKILL", "SIGSTOP") or key not in signal.Signals.__members__:
            raise ValueError(f"train.save_on_signal: {name!r} is not a signal a process can catch "
                             "(e.g. SIGTERM, SIGUSR1, SIGINT; none turns it off)")
        out.append(signal.Signals[key])
    return out


_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?$")


def parse_duration(text: str | float | None) -> float | None:
    """`train.time_limit` in seconds: "3h50m", "90m", "45s", "1:30:00" (h:m:s), "5400"; None: no limit."""
    if text is None:
        return None
    value = str(text).strip().lower()
    match = _DURATION.match(value)
    try:
        if ":" in value and len(value.split(":")) <= 3:
            seconds = sum(float(p) * 60 ** i for i, p in enumerate(reversed(value.split(":"))))
        elif match is None or not value:
            seconds = float(value)
        else:
            h, m, s = (float(x) if x else 0.0 for x in match.groups())
            seconds = h * 3600 + m * 60 + s
    except ValueError:
        seconds = math.nan
    if not seconds > 0:
        raise ValueError(f"train.time_limit={text!r}: write a positive duration such as 3h50m, 90m, 45s, 1:30:00 "
                         "or seconds")
    return seconds


def _check_eval_precision(precision: str) -> None:
    if precision not in EVAL_PRECISIONS:
        raise ConfigError(f"eval.precision={precision!r}; allowed: {', '.join(EVAL_PRECISIONS)}")


def _check_text(cfg: TextRunConfig) -> None:
    _check_mode("loss.mode", cfg.loss.mode)
    _check_exponents(cfg.loss, [cfg.loss.mode])
    if cfg.model.pooling is not None and cfg.model.pooling not in POOLINGS:
        raise ConfigError(f"model.pooling={cfg.model.pooling!r}; allowed: {', '.join(POOLINGS)} or null")
    if cfg.model.magnitude is not None and cfg.model.magnitude not in MAGNITUDES:
        raise ConfigError(f"model.magnitude={cfg.model.magnitude!r}; allowed: {', '.join(MAGNITUDES)} or null")
    if (cfg.data.train is None) == (cfg.data.beir is None):
        raise ConfigError("set exactly one of data.train (pairs) and data.beir (a BEIR folder)")
    if cfg.eval.identical_ids not in IDENTICAL_ID_RULES:
        raise ConfigError(f"eval.identical_ids={cfg.eval.identical_ids!r}; allowed: {', '.join(IDENTICAL_ID_RULES)}")
    _check_eval_precision(cfg.eval.precision)
    if cfg.eval.backend not in ("auto", "torch", "faiss"):
        raise ConfigError(f"eval.backend={cfg.eval.backend!r}; allowed: auto, torch, faiss")
    for key, value in {"data.group_size": cfg.data.group_size, "eval.batch_size": cfg.eval.batch_size}.items():
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train.lr": 0.002, ...}: a nested config dict keyed by dotted names (an empty section is one key)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def experiment_differences(saved: dict[str, Any], current: dict[str, Any], *,
                           finished: bool = False) -> tuple[dict, dict]:
    """({key: (saved, current)} of experiment keys that differ, the same for the keys that may change)
    between a config a run was trained with and the one that would run now. The one decision of "what
    changes an experiment": a resume is refused on the first dict (training.checkpoints), and a grid
    cell is stale on it (experiments.grid). A resume may lengthen or shorten a run, but the length of a
    `finished` run is part of what it measured: there RUN_LENGTH_KEYS change the experiment too. Keys
    only one side has (a config written by another version of magclip) are not compared."""
    old, new = flatten(saved), flatten(current)
    refused, allowed = {}, {}
    for key in sorted(set(old) & set(new)):
        if old[key] != new[key]:
            may_change = key in RESUMABLE_KEYS and not (finished and key in RUN_LENGTH_KEYS)
            (allowed if may_change else refused)[key] = (old[key], new[key])
    return refused, allowed


def dump_config(cfg: Any, path: str | Path) -> None:
    atomic_write_text(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))
