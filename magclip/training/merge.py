"""A LoRA step folder merged offline into the plain model folder, tensor by tensor, on one process.

Under `train.sharding=fsdp` a LoRA run's checkpoints hold its adapters (peft's `adapter/` folder), their optimizer
state and the small trained tensors (logit scale, γ, buffers), never the frozen base nor a merged model: merging in
the training process would gather the whole base on the main process. `merge_lora(step)` writes the model the run
would have written under ddp (open_clip's files, or the sentence-transformers `model/` folder) afterwards:

- the structure comes from the step folder's config.yaml, built on the meta device with the training's own builders
  (models/build.py: each tower remembers its weights files), so the base is read from the files it was trained on,
  one tensor at a time; `base.json` must match those files (training/frozen_base.py) or the merge is refused;
- each tensor: the base's, held in the training's dtype (`base.json` dtype: a bf16-trained base is rounded to bf16 as
  training saw it), then fp32, plus `(B @ A) * scaling` where the adapter folder holds a LoRA for that Linear
  (peft's own merge: `W += transpose(B @ A, fan_in_fan_out) * scaling`), streamed into the safetensors file
  (magclip.training.consolidate.stream_safetensors). At most a few tensors of the largest size are held at once.

The result equals peft's in-process `merge_and_unload` of an fp32 copy (models/lora.py `merged_model`, what a ddp
LoRA run writes at each checkpoint), tensor for tensor (tests/training/test_merge.py).

    magclip-consolidate RUN/checkpoints/step_00000500 --merge                 # into the step folder
    magclip-consolidate RUN/checkpoints/step_00000500 --merge --out merged/   # elsewhere
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from magclip.config import RunConfig, TextRunConfig, from_dict
from magclip.io import atomic_write_json, safe_torch_load
from magclip.models import build
from magclip.training.checkpoints import STATE_FILE, saved_config
from magclip.training.consolidate import Consolidated, Entry, ShardedCheckpoint, stream_safetensors
from magclip.training.frozen_base import base_identity, check_base, read_base
from magclip.training.sharding import SHARDED_DIR

log = logging.getLogger("magclip.training.merge")

PEFT_PREFIX = "base_model.model."   # a PeftModel's names (and its adapter files' keys) start so


class TrainedState:
    """The trained tensors of a LoRA step folder (loss parameters, buffers), whichever sharding wrote it: the DCP
    shards under fsdp (`sharded/`, without the frozen base), `state.pt`'s module state under ddp."""

    def __init__(self, step: Path):
        self.step = step
        self._sharded = ShardedCheckpoint(step) if (step / SHARDED_DIR / ".metadata").is_file() else None
        self._state: dict[str, torch.Tensor] = {}
        if self._sharded is None:
            state = safe_torch_load(step / STATE_FILE)
            if not isinstance(state, dict) or not isinstance(state.get("module"), dict):
                raise ValueError(f"{step / STATE_FILE} holds no module state: not a magclip LoRA checkpoint")
            self._state = state["module"]

    def names(self) -> set[str]:
        return set(self._sharded.tensors) if self._sharded is not None else set(self._state)

    def get(self, name: str) -> torch.Tensor | None:
        if self._sharded is not None:
            return self._sharded.load(name) if name in self._sharded.tensors else None
        return self._state.get(name)

    def load_into(self, module: nn.Module, prefix: str) -> None:
        """Every parameter and buffer of `module` (small: the loss's) from `prefix + name`."""
        with torch.no_grad():
            for name, t in [*module.named_parameters(), *module.named_buffers()]:
                found = self.get(prefix + name)
                if found is not None:
                    t.copy_(found)


class Adapter:
    """peft's adapter folder: its LoRA pairs (A, B) by the adapted module's name within the base model, and peft's
    scaling. Only Linear adapters merge here (peft's merge of a MultiheadAttention or a convolution adapter is
    refused: such runs are ddp's, which write the merged model themselves)."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        config_file, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
        if not config_file.is_file() or not weights.is_file():
            raise FileNotFoundError(f"{folder} is not peft's adapter folder (adapter_config.json + "
                                    "adapter_model.safetensors)")
        config = json.loads(config_file.read_text())
        for key in ("use_dora", "rank_pattern", "alpha_pattern", "lora_bias"):
            if config.get(key):
                raise ValueError(f"{config_file}: {key}={config[key]!r}; the offline merge knows plain LoRA only")
        r, alpha = config["r"], config["lora_alpha"]
        self.scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        self.fan_in_fan_out = bool(config.get("fan_in_fan_out"))
        self.pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        with safe_open(str(weights), framework="pt") as f:
            keys = list(f.keys())
            for key in keys:
                if key.endswith(".lora_A.weight"):
                    module = key[:-len(".lora_A.weight")]
                    self.pairs[_plain(module)] = (f.get_tensor(key), f.get_tensor(module + ".lora_B.weight"))
        unmergeable = [m for m, (a, b) in self.pairs.items() if a.ndim != 2 or b.ndim != 2]
        if unmergeable or any(not k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys):
            raise ValueError(f"{weights}: adapters other than Linear ones ({(unmergeable or keys)[0]}): the offline "
                             "merge knows Linear adapters only")
        self.used: set[str] = set()

    def delta(self, module: str) -> torch.Tensor | None:
        """(B @ A) * scaling for the adapted Linear `module` (None where it has no adapter), as peft computes it."""
        if module not in self.pairs:
            return None
        a, b = self.pairs[module]
        self.used.add(module)
        out = b.float() @ a.float()
        return (out.T if self.fan_in_fan_out else out) * self.scaling


def _plain(name: str) -> str:
    return name.removeprefix(PEFT_PREFIX)


class MergedTensors:
    """The merged tensors of one plain model (a tower, the open_clip model) built on the meta device with its weights
    sources: each its base tensor in the training's dtype, then fp32, plus its adapter's delta."""

    def __init__(self, model: nn.Module, adapter: Adapter, base_dtype: torch.dtype, trained: TrainedState,
                 trained_prefix: str):
        self.model, self.adapter, self.base_dtype = model, adapter, base_dtype
        self.trained, self.trained_prefix = trained, trained_prefix
        self.sources: dict[str, tuple[Any, str]] = {}
        for prefix, source in build.weights_on_meta(model):
            self.sources.update({(f"{prefix}.{key}" if prefix else key): (source, key) for key in source.keys})
        batchnorm = {id(p) for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                     for p in m.parameters()}
        self.held = {name for name, p in model.named_parameters() if id(p) not in batchnorm}   # cast by _hold_base
        self.state = model.state_dict(keep_vars=True)
        names = trained.names()
        self.trained_names = {n for n in self.state if trained_prefix + PEFT_PREFIX + n in names}

    def entries(self) -> list[Entry]:
        return [Entry(name, tuple(t.shape), torch.float32 if t.is_floating_point() else t.dtype)
                for name, t in self.state.items()]

    def tensor(self, name: str) -> torch.Tensor:
        if name in self.trained_names:   # a buffer training moved (BatchNorm statistics)
            t = self.trained.get(self.trained_prefix + PEFT_PREFIX + name)
        elif name in self.sources:
            source, key = self.sources[name]
            t = source.read(key)
        else:
            t = self.state[name].detach()
            if t.is_meta:
                raise ValueError(f"{name}: in no weights file of the base and not trained: cannot merge it")
        if not t.is_floating_point():
            return t
        if name in self.held and name not in self.trained_names:
            t = t.to(self.base_dtype)
        t = t.float()
        delta = self.adapter.delta(name[:-len(".weight")]) if name.endswith(".weight") else None
        return t if delta is None else t + delta

    def check_all_used(self, folder: Path) -> None:
        unused = sorted(set(self.adapter.pairs) - self.adapter.used)
        if unused:
            raise ValueError(f"{folder}: adapters for modules this model does not have ({unused[0]}, "
                             f"{len(unused)} in all): the adapter folder belongs to another model")


def merge_lora(step: str | Path, out: str | Path | None = None) -> Consolidated:
    """The merged model files of a LoRA step folder, written into `out` (default: the step folder itself; a folder
    already holding model files is refused): see the module docstring."""
    step = Path(step)
    found = saved_config(step)
    if found is None:
        raise FileNotFoundError(f"{step} records no config.yaml (nor does its run folder): the model cannot be rebuilt "
                                "to merge its adapters")
    raw, source = found
    if not ((raw.get("model") or {}).get("lora") or {}).get("r"):
        raise ValueError(f"--merge: {step} is not a LoRA run's checkpoint (model.lora.r is 0): leave out --merge")
    saved = read_base(step)
    base = saved or {}
    dtype = getattr(torch, base.get("dtype") or "float32")
    if saved is not None and saved.get("fingerprint") is None:
        raise ValueError(f"{step}: the frozen base was not read from weights files ({saved.get('path')!r}): the offline "
                         "merge reads the base from its files; train with model.pretrained (or a model folder)")
    check_base(saved, base_identity(saved.get("path") if saved else None, dtype), step, doing="--merge")
    trained = TrainedState(step)
    names = trained.names()
    if any(name.startswith("clip.clip.") for name in names):
        return _merge_clip(step, from_dict(RunConfig, raw, str(source)), trained, dtype, Path(out or step))
    if any(name.startswith("encoder.") for name in names):
        return _merge_text(step, from_dict(TextRunConfig, raw, str(source)), trained, dtype, Path(out or step))
    raise ValueError(f"{step}: its trained state holds neither a CLIP model's (clip.clip.*) nor a text encoder's "
                     "(encoder.*) adapters")


def _merge_clip(step: Path, cfg: RunConfig, trained: TrainedState, dtype: torch.dtype, out: Path) -> Consolidated:
    from magclip.evaluation.checkpoint import pretrained_weights
    from magclip.models.clip import CHECKPOINT_META, WEIGHTS_FILE, create_clip, save_open_clip_config
    from magclip.models.lora import ADAPTER_DIR
    from magclip.training.clip import (
        CLIPTrainModule,
        build_logit_bias,
        build_logit_scale,
        build_loss,
        checkpoint_meta,
    )

    weights = out / WEIGHTS_FILE
    if weights.exists():
        raise FileExistsError(f"{weights} exists already (pass --out to write the merged model elsewhere)")
    bias = build_logit_bias(cfg.loss)
    with build.on_meta():   # the structure on the meta device, each tensor read from the base's file later
        bundle = create_clip(cfg.model.name, pretrained_weights(cfg.model.pretrained), device="cpu",
                             **({"init_logit_bias": bias.value} if bias is not None else {}))
    module = CLIPTrainModule(bundle.model, build_loss(cfg.loss), build_logit_scale(cfg.loss), bias)
    for part in ("loss", "logit_scale", "logit_bias"):
        if getattr(module, part) is not None:
            trained.load_into(getattr(module, part), f"{part}.")
    clip = bundle.model.clip
    merged = MergedTensors(clip, Adapter(step / ADAPTER_DIR), dtype, trained, "clip.clip.")
    # what save_checkpoint_for_open_clip writes: open_clip's state dict, its logit scale (and bias) the trained ones
    overrides = {"logit_scale": math.log(module.logit_scale.value)}
    if bias is not None:
        overrides["logit_bias"] = module.logit_bias.value
    entries = merged.entries()

    def tensor_of(e: Entry) -> torch.Tensor:
        if e.name in overrides:
            return torch.full(e.shape, overrides[e.name], dtype=e.dtype)
        return merged.tensor(e.name)

    out.mkdir(parents=True, exist_ok=True)
    largest = stream_safetensors(weights, entries, tensor_of)
    merged.check_all_used(step / ADAPTER_DIR)
    save_open_clip_config(clip, out, bundle.model_name, module.logit_bias.value if bias is not None else None)
    atomic_write_json(out / CHECKPOINT_META, checkpoint_meta(module, cfg))
    total = sum(e.nbytes for e in entries)
    log.info("merged %s onto its base into %s: %d tensors, %.1f MB", step / ADAPTER_DIR, weights, len(entries),
             total / 2**20)
    return Consolidated(out, weights, len(entries), total, largest)


def _merge_text(step: Path, cfg: TextRunConfig, trained: TrainedState, dtype: torch.dtype, out: Path) -> Consolidated:
    from magclip.models.lora import ADAPTER_DIR
    from magclip.training.text import (
        MODEL_DIR,
        TextTrainModule,
        build_logit_scale,
        build_loss,
        load_encoder,
        save_text_model,
    )

    if (out / MODEL_DIR).exists():
        raise FileExistsError(f"{out / MODEL_DIR} exists already (pass --out to write the merged model elsewhere)")
    with build.on_meta():   # towers on the meta device with their weights sources; tokenizers and heads read
        encoder = load_encoder(cfg.model)
    module = TextTrainModule(encoder, build_loss(cfg), build_logit_scale(cfg.loss))
    trained.load_into(module.loss, "loss.")
    trained.load_into(module.logit_scale, "logit_scale.")
    with torch.no_grad():   # the heads after Pooling were frozen in the base's dtype (models/lora.py adapt_text)
        for head in (encoder.query_head, encoder.passage_head):
            for p in [] if head is None else head.parameters():
                p.data = p.data.to(dtype).float()
    two = encoder.passage_model is not None
    sides = {id(encoder.query_model): "query", **({id(encoder.passage_model): "passage"} if two else {})}
    written: list[tuple[Path, int, int, int]] = []

    def tower_weights(tower: nn.Module, folder: Path) -> None:
        side = sides[id(tower)]
        adapter_dir = step / ADAPTER_DIR / side if two else step / ADAPTER_DIR
        merged = MergedTensors(tower, Adapter(adapter_dir), dtype, trained, f"encoder.{side}_model.")
        folder.mkdir(parents=True, exist_ok=True)
        tower.config.save_pretrained(str(folder))
        entries = merged.entries()
        largest = stream_safetensors(folder / "model.safetensors", entries, lambda e: merged.tensor(e.name),
                                     {"format": "pt"})   # transformers reads only files that say so
        merged.check_all_used(adapter_dir)
        written.append((folder / "model.safetensors", len(entries), sum(e.nbytes for e in entries), largest))

    folder = save_text_model(module, cfg, out, tower_weights)
    log.info("merged %s onto its base into %s: %s", step / ADAPTER_DIR, folder,
             "; ".join(f"{w}: {n} tensors, {b / 2**20:.1f} MB" for w, n, b, _ in written))
    return Consolidated(folder, written[0][0], sum(w[1] for w in written), sum(w[2] for w in written),
                        max(w[3] for w in written))

