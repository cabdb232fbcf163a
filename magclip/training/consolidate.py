"""A sharded step folder consolidated offline into the model files the run would have written, on one process.

Under `train.sharding=fsdp` with `train.save_full_model` last or never, a step folder holds the model and the
optimizer as DCP shards (`sharded/`, magclip.training.sharding) and no model files: writing them during training
gathers the full weights on the main process, which a model that only fits sharded cannot afford.
`consolidate(step)` writes them afterwards, on one process, with memory bounded by the largest tensor:

- the structure comes from the run's own config (the step folder's config.yaml), built on the meta device
  (shapes and names, no weights); only the small parameters outside the towers (logit scale, bias, γ) are loaded;
- each tower tensor is read from the shards alone (DCP's `FileSystemReader` and `dcp.load(..., no_dist=True)`
  of that one key: the slices every rank wrote are read and stitched) and streamed into the weights file.

safetensors has no streaming writer (its `save_file` holds every tensor's bytes at once), so `stream_safetensors`
writes its documented layout itself: an 8-byte little-endian header size, the JSON header (dtype, shape and byte
offsets of each tensor, padded with spaces to 8 bytes), then the tensors' bytes in the header's order. The file
is read back by safetensors' own reader in the tests, and opened by open_clip.

    magclip-consolidate RUN/checkpoints/step_00000500              # open_clip's files into the step folder
    python tools/consolidate.py RUN/checkpoints/step_00000500 --out exported/  # elsewhere

A step folder gets what `train.save_full_model=every` writes there. A CLIP run's: open_clip_model.safetensors,
open_clip_config.json and magclip.json (`open_clip.create_model_and_transforms(name, pretrained=FILE)` or
`"local-dir:" + folder` load it). A text run's: `model/`, the sentence-transformers folder (`SentenceTransformer`
and `BiEncoder.from_pretrained` load it), each tower's weights as the model.safetensors transformers writes.
"""

from __future__ import annotations

import json
import logging
import math
import struct
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from magclip.config import RunConfig, TextRunConfig, from_dict
from magclip.io import atomic_write_json, atomic_write_with
from magclip.training.checkpoints import saved_config
from magclip.training.sharding import SHARDED_DIR

log = logging.getLogger("magclip.training.consolidate")

MODEL_PREFIX = "model."  # the DCP checkpoint holds {"model": the TrainModule's state, "optim": ...}
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                      torch.bool: "BOOL"}


@dataclass
class Consolidated:
    """What `consolidate` wrote: the folder, the weights file, its tensors and bytes, the largest tensor held."""

    folder: Path
    weights: Path
    tensors: int
    bytes: int
    largest_tensor_bytes: int


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file to be: its name, shape and dtype, known before its bytes are read."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def stream_safetensors(path: str | Path, entries: Iterable[Entry], tensor_of: Callable[[Entry], torch.Tensor],
                       metadata: dict[str, str] | None = None) -> int:
    """Write a safetensors file of `entries`, asking `tensor_of` for one tensor at a time (held until written,
    then dropped); atomic. Returns the largest tensor's bytes (what was held at once)."""
    entries = list(entries)
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for e in entries:
        if e.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{e.name}: dtype {e.dtype} has no safetensors name")
        header[e.name] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors' own writer pads it

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for e in entries:
                t = tensor_of(e)
                if tuple(t.shape) != e.shape or t.dtype != e.dtype:
                    raise ValueError(f"{e.name}: read {tuple(t.shape)} {t.dtype}, expected {e.shape} {e.dtype}")
                f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
                del t

    atomic_write_with(path, write)
    return max((e.nbytes for e in entries), default=0)


class ShardedCheckpoint:
    """The model tensors of a step folder's DCP checkpoint, read one at a time on one process."""

    def __init__(self, step: str | Path):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.step = Path(step)
        self.folder = self.step / SHARDED_DIR
        if not (self.folder / ".metadata").is_file():
            raise FileNotFoundError(f"{self.step} holds no {SHARDED_DIR}/.metadata: not a sharded checkpoint (one of "
                                    "train.sharding=fsdp); a ddp checkpoint already holds the model files")
        self.reader = FileSystemReader(str(self.folder))
        entries = self.reader.read_metadata().state_dict_metadata
        self.tensors = {k[len(MODEL_PREFIX):]: (tuple(m.size), m.properties.dtype) for k, m in entries.items()
                        if k.startswith(MODEL_PREFIX) and isinstance(m, TensorStorageMetadata)}

    def entry(self, name: str, as_name: str | None = None) -> Entry:
        if name not in self.tensors:
            raise ValueError(f"{self.folder} holds no tensor {MODEL_PREFIX}{name}: not a checkpoint of this model")
        shape, dtype = self.tensors[name]
        return Entry(as_name or name, shape, dtype)

    def load(self, name: str) -> torch.Tensor:
        """The full tensor `name` of the module's state (every rank's slices stitched), and nothing else."""
        import torch.distributed.checkpoint as dcp

        shape, dtype = self.entry(name).shape, self.entry(name).dtype
        box = {MODEL_PREFIX + name: torch.empty(shape, dtype=dtype)}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: as intended
            dcp.load(box, storage_reader=self.reader, no_dist=True)
        return box[MODEL_PREFIX + name]

    def load_into(self, module: nn.Module, prefix: str = "") -> None:
        """Every parameter and buffer of `module` (small: the loss's) from the checkpoint's `prefix + name`."""
        with torch.no_grad():
            for name, t in [*module.named_parameters(), *module.named_buffers()]:
                if prefix + name in self.tensors:
                    t.copy_(self.load(prefix + name))


def consolidate(step: str | Path, out: str | Path | None = None) -> Consolidated:
    """The model files of a sharded step folder, written into `out` (default: the step folder itself, where
    train.save_full_model=every would have written them); a folder already holding them is refused. A LoRA run's
    step folder is merged instead (magclip.training.merge, `magclip-consolidate --merge`)."""
    checkpoint = ShardedCheckpoint(step)   # a folder without shards is refused first, as before
    step = checkpoint.step
    found = saved_config(step)
    if found is None:
        raise FileNotFoundError(f"{step} records no config.yaml (nor does its run folder): the model it "
                                "holds cannot be rebuilt to consolidate it")
    raw, source = found
    lora = (raw.get("model") or {}).get("lora") or {}
    if lora.get("r"):
        raise ValueError(f"{step} belongs to a LoRA run (model.lora.r={lora['r']}): its checkpoint holds the adapters, "
                         "not the model; `magclip-consolidate STEP --merge` merges them onto the base")
    if any(name.startswith("clip.clip.") for name in checkpoint.tensors):
        return _consolidate_clip(checkpoint, from_dict(RunConfig, raw, str(source)), Path(out or checkpoint.step))
    if any(name.startswith("encoder.") for name in checkpoint.tensors):
        return _consolidate_text(checkpoint, from_dict(TextRunConfig, raw, str(source)), Path(out or checkpoint.step))
    raise ValueError(f"{checkpoint.folder} holds neither a CLIP model (clip.clip.*) nor a text encoder (encoder.*)")


def _consolidate_clip(checkpoint: ShardedCheckpoint, cfg: RunConfig, out: Path) -> Consolidated:
    from magclip.models.clip import CHECKPOINT_META, WEIGHTS_FILE, create_clip, save_open_clip_config
    from magclip.training.clip import (
        CLIPTrainModule,
        build_logit_bias,
        build_logit_scale,
        build_loss,
        checkpoint_meta,
    )

    weights = out / WEIGHTS_FILE
    if weights.exists():
        raise FileExistsError(f"{weights} exists already: the step folder holds its model files (pass --out to write "
                              "them elsewhere)")
    bias = build_logit_bias(cfg.loss)
    with torch.device("meta"):   # the structure alone: no weights are made, none are loaded (HF towers included)
        bundle = create_clip(cfg.model.name, None, device="meta", pretrained_hf=False,
                             **({"init_logit_bias": bias.value} if bias is not None else {}))
    module = CLIPTrainModule(bundle.model, build_loss(cfg.loss), build_logit_scale(cfg.loss), bias)
    for part in ("loss", "logit_scale", "logit_bias"):  # small and replicated: loaded whole
        if getattr(module, part) is not None:
            checkpoint.load_into(getattr(module, part), f"{part}.")
    clip = bundle.model.clip
    # what save_checkpoint_for_open_clip writes: open_clip's state dict, its logit scale (and bias) the trained ones
    overrides = {"logit_scale": math.log(module.logit_scale.value)}
    if bias is not None:
        overrides["logit_bias"] = module.logit_bias.value
    entries = [checkpoint.entry(f"clip.clip.{name}", name) for name in clip.state_dict()]

    def tensor_of(e: Entry) -> torch.Tensor:
        if e.name in overrides:
            return torch.full(e.shape, overrides[e.name], dtype=e.dtype)
        return checkpoint.load(f"clip.clip.{e.name}")

    largest = stream_safetensors(weights, entries, tensor_of)
    save_open_clip_config(clip, out, bundle.model_name, module.logit_bias.value if bias is not None else None)
    atomic_write_json(out / CHECKPOINT_META, checkpoint_meta(module, cfg))
    total = sum(e.nbytes for e in entries)
    log.info("consolidated %s into %s: %d tensors, %.1f MB; at most %.1f MB held at once", checkpoint.folder, weights,
             len(entries), total / 2**20, largest / 2**20)
    return Consolidated(out, weights, len(entries), total, largest)


def _consolidate_text(checkpoint: ShardedCheckpoint, cfg: TextRunConfig, out: Path) -> Consolidated:
    from magclip.models.text import STRUCTURE_ONLY
    from magclip.training.text import (
        MODEL_DIR,
        TextTrainModule,
        build_logit_scale,
        build_loss,
        load_encoder,
        save_text_model,
    )

    if (out / MODEL_DIR).exists():
        raise FileExistsError(f"{out / MODEL_DIR} exists already: the step folder holds its model files (pass --out to "
                              "write them elsewhere)")
    encoder = load_encoder(cfg.model, **{STRUCTURE_ONLY: True})  # towers on the meta device; tokenizers, heads read
    module = TextTrainModule(encoder, build_loss(cfg), build_logit_scale(cfg.loss))
    towers = {id(encoder.query_model): "encoder.query_model."}
    if encoder.passage_model is not None:
        towers[id(encoder.passage_model)] = "encoder.passage_model."
    for name, part in module.named_children():   # the loss, the scale and the heads after pooling: small, loaded whole
        if name != "encoder":
            checkpoint.load_into(part, f"{name}.")
    for name in ("query_head", "passage_head"):
        if getattr(encoder, name, None) is not None:
            checkpoint.load_into(getattr(encoder, name), f"encoder.{name}.")
    written: list[tuple[Path, int, int, int]] = []

    def tower_weights(tower: nn.Module, folder: Path) -> None:
        """config.json as transformers writes it, and the tower's tensors streamed from the shards."""
        prefix = towers[id(tower)]
        folder.mkdir(parents=True, exist_ok=True)
        tower.config.save_pretrained(str(folder))
        entries = [checkpoint.entry(prefix + name, name) for name in tower.state_dict()]
        largest = stream_safetensors(folder / "model.safetensors", entries, lambda e: checkpoint.load(prefix + e.name),
                                     {"format": "pt"})  # transformers reads only files that say so
        written.append((folder / "model.safetensors", len(entries), sum(e.nbytes for e in entries), largest))

    folder = save_text_model(module, cfg, out, tower_weights)
    log.info("consolidated %s into %s: %s", checkpoint.folder, folder,
             "; ".join(f"{w}: {n} tensors, {b / 2**20:.1f} MB" for w, n, b, _ in written))
    return Consolidated(folder, written[0][0], sum(w[1] for w in written), sum(w[2] for w in written),
                        max(w[3] for w in written))
