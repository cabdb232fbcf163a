"""How a model is built: eagerly (every tensor allocated and its weights loaded, the default), or on the meta
device with each weights-loaded part remembering where its weights are, to be read later tensor by tensor,
or slice by slice, by whoever owns them (`train.sharding: fsdp`, magclip.training.meta_start).

Why: a model whose full fp32 weights do not fit one process cannot be built whole and then sharded. Under
`on_meta()` the loaders of magclip.models (`create_clip` with a weights file, `_load_encoder` for a Hugging
Face folder) build the model's structure on the meta device (no bytes) and attach a `WeightsSource` to the
module (`WEIGHTS_ATTR`): a reader of the file or folder that opens one tensor, or a range of its rows, at a
time (safetensors `get_slice`; a torch file memory-mapped). The weights read later equal those of the eager
load bit for bit, because a part takes the meta path only when its file holds every parameter and persistent
buffer under the model's own names and shapes; a file that needs open_clip's or transformers' conversions
(renamed keys, resized position embeddings, a missing logit bias or pooler that the eager loader initialises
at random) builds that part eagerly, as before, and says so.

A LoRA run wraps the meta-built model with peft (models/lora.py): `WeightsSource.renamed` follows peft's names,
and the adapters' initial values, drawn whole on every rank alike, are read from `HeldTensors`.

Randomly initialised parts (a tower from scratch, the modules after a sentence-transformers Pooling) are
built eagerly: a random initialisation on the meta device cannot equal the eager one bit for bit, and they
are the small parts. Non-persistent buffers (position ids, rotary frequencies, attention masks) are computed
at construction as usual: they are in no weights file.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

log = logging.getLogger("magclip.models.build")

WEIGHTS_ATTR = "_magclip_weights"   # a module built on meta: its WeightsSource (state_dict key -> file key)
SAFETENSORS_INDEX = "model.safetensors.index.json"
HF_WEIGHT_FILES = ("model.safetensors", SAFETENSORS_INDEX, "pytorch_model.bin")  # transformers' order

_building: list[bool] = []   # a stack: on_meta() contexts in force


@contextmanager
def on_meta() -> Iterator[None]:
    """Within it, models loaded from weights files by magclip.models are built on the meta device with a
    `WeightsSource` attached (see the module docstring); outside it, everything is eager."""
    _building.append(True)
    try:
        yield
    finally:
        _building.pop()


def building_on_meta() -> bool:
    return bool(_building)


# ============================================================================ reading weights tensor by tensor


@dataclass
class WeightsSource:
    """A weights file or a folder's (sharded) set, read one tensor, or a range of rows, at a time.

    `keys` maps a state_dict key of the module it is attached to onto (file, key in that file)."""

    keys: dict[str, tuple[Path, str]] = field(default_factory=dict)
    _torch_files: dict[Path, dict[str, torch.Tensor]] = field(default_factory=dict, repr=False)

    def __deepcopy__(self, memo: dict) -> WeightsSource:
        return self   # a module copied on meta (a passage tower) reads the same files

    def read(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor of state_dict `key`, or its rows [start, stop) (dim 0), as stored (dtype of the file)."""
        file, name = self.keys[key]
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as f:
                if rows is None:
                    return f.get_tensor(name)
                return f.get_slice(name)[rows[0]:rows[1]]
        tensor = self._torch_state(file)[name]
        return (tensor if rows is None else tensor[rows[0]:rows[1]]).clone()

    def _torch_state(self, file: Path) -> dict[str, torch.Tensor]:
        """A torch file's state dict, memory-mapped (its pages are read as tensors are touched, never unpickling
        code), in open_clip's reading: a {"state_dict": ...} wrapper and DDP's "module." prefix removed."""
        if file not in self._torch_files:
            state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
            self._torch_files[file] = _open_clip_state(state)
        return self._torch_files[file]

    def close(self) -> None:
        self._torch_files.clear()

    def renamed(self, names: dict[str, str]) -> WeightsSource:
        """The same files under new state_dict keys (`names`: new key -> the key it had), for a module whose
        parameters were renamed (peft's `...base_layer.weight` for a wrapped Linear's `...weight`)."""
        return WeightsSource({new: self.keys[old] for new, old in names.items()}, self._torch_files)


@dataclass
class HeldTensors:
    """Full tensors held in memory (small ones: LoRA's adapters), read like a WeightsSource: the same values on
    every rank, each rank keeping its rows."""

    tensors: dict[str, torch.Tensor]

    @property
    def keys(self) -> dict[str, torch.Tensor]:
        return self.tensors

    def __deepcopy__(self, memo: dict) -> HeldTensors:
        return self

    def read(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        tensor = self.tensors[key]
        return tensor if rows is None else tensor[rows[0]:rows[1]]

    def close(self) -> None:
        self.tensors.clear()


def file_tensors(file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of one weights file, read from its header (safetensors) or memory-mapped (torch)."""
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    state = _open_clip_state(torch.load(file, map_location="cpu", mmap=True, weights_only=True))
    return {k: tuple(v.shape) for k, v in state.items() if torch.is_tensor(v)}


def folder_tensors(folder: Path) -> dict[str, tuple[Path, tuple[int, ...]]] | None:
    """A Hugging Face folder's tensors (one safetensors file, a sharded set with its index, or a torch file, in
    transformers' order): name -> (file, shape); None where it holds none of these."""
    for name in HF_WEIGHT_FILES:
        path = folder / name
        if not path.is_file():
            continue
        if name == SAFETENSORS_INDEX:
            weight_map = json.loads(path.read_text())["weight_map"]
            found: dict[str, tuple[Path, tuple[int, ...]]] = {}
            for shard in sorted(set(weight_map.values())):
                found.update({k: (folder / shard, s) for k, s in file_tensors(folder / shard).items()})
            return found
        return {k: (path, s) for k, s in file_tensors(path).items()}
    return None


def _open_clip_state(state: Any) -> dict[str, torch.Tensor]:
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    if state and next(iter(state)).startswith("module"):
        state = {k[7:]: v for k, v in state.items()}
    return state


def match_keys(module: nn.Module, tensors: dict[str, tuple[Path, tuple[int, ...]]],
               prefixes: tuple[str, ...] = ("",)) -> tuple[WeightsSource | None, str]:
    """A WeightsSource for `module` when `tensors` hold every entry of its state dict under its own name (or
    the name with one of `prefixes`, as transformers finds a base model inside a task model's file) with its
    shape; else None and what does not fit (the part is then built eagerly, by the loader's own rules)."""
    keys: dict[str, tuple[Path, str]] = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        hit = next((p + key for p in prefixes if p + key in tensors), None)
        if hit is None:
            return None, f"{key} is not in the weights"
        file, shape = tensors[hit]
        if tuple(shape) != tuple(tensor.shape):
            return None, f"{hit} has shape {list(shape)} in the weights, {list(tensor.shape)} in the model"
        keys[key] = (file, hit)
    return WeightsSource(keys), ""


# ============================================================================ building on the meta device


@contextmanager
def parameters_on_meta() -> Iterator[dict[tuple[int, str], torch.Tensor]]:
    """Parameters are created on the meta device (accelerate's `init_empty_weights`, buffers kept); the buffers
    registered meanwhile are recorded (module id, name) -> tensor, so that a builder that moves the whole model
    to the meta device (open_clip's `device`) can have its computed buffers back (`restore_buffers`)."""
    from accelerate import init_empty_weights

    recorded: dict[tuple[int, str], torch.Tensor] = {}
    register = nn.Module.register_buffer

    def recording(module: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        register(module, name, tensor, persistent=persistent)
        if tensor is not None:
            recorded[(id(module), name)] = tensor

    nn.Module.register_buffer = recording
    try:
        with init_empty_weights(include_buffers=False):
            yield recorded
    finally:
        nn.Module.register_buffer = register


def restore_buffers(model: nn.Module, recorded: dict[tuple[int, str], torch.Tensor]) -> None:
    """Buffers moved to the meta device after construction get their constructed values back."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta and (id(module), name) in recorded:
                module._buffers[name] = recorded[(id(module), name)]


def attach(module: nn.Module, source: WeightsSource) -> nn.Module:
    setattr(module, WEIGHTS_ATTR, source)
    return module


def hf_model_on_meta(path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module | None:
    """transformers' `AutoModel` of a local folder built from its config on the meta device, its weights
    source attached; None (build it eagerly) where the folder's weights are not all there under the model's
    names (a task model's prefix, `base_model_prefix`, is allowed, as transformers allows it)."""
    from transformers import AutoConfig, AutoModel

    folder = Path(path)
    tensors = folder_tensors(folder) if folder.is_dir() else None
    if tensors is None:
        return None
    config = AutoConfig.from_pretrained(str(folder))
    with parameters_on_meta():
        model = AutoModel.from_config(config, dtype=dtype)
    model.eval()   # as from_pretrained returns it
    prefix = getattr(model, "base_model_prefix", "")
    source, why = match_keys(model, tensors, ("", f"{prefix}.") if prefix else ("",))
    if source is None:
        log.info("%s is loaded whole, not shard by shard: %s (transformers converts or initialises it)", folder, why)
        return None
    model.name_or_path = model.config._name_or_path = str(folder)
    return attach(model, source)


def open_clip_on_meta(name: str, weights: Path, **kwargs: Any) -> tuple[nn.Module, Any, Any] | None:
    """open_clip's `create_model_and_transforms(name)` built on the meta device (no weights loaded, no Hugging
    Face text tower's own weights either: the checkpoint holds them), `weights` attached; None (build it
    eagerly) where the file does not hold the model's state dict as it is (open_clip would convert or resize)."""
    import open_clip

    tensors = {k: (weights, s) for k, s in file_tensors(weights).items()}
    with parameters_on_meta() as recorded:
        clip, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(
            name, pretrained=None, load_weights=False, pretrained_text=False, device="meta", **kwargs)
    restore_buffers(clip, recorded)
    source, why = match_keys(clip, tensors)
    if source is None:
        log.info("%s is loaded whole, not shard by shard: %s (open_clip converts it)", weights, why)
        return None
    return attach(clip, source), preprocess_train, preprocess_val


def weights_on_meta(model: nn.Module) -> list[tuple[str, WeightsSource | HeldTensors]]:
    """The parts of `model` built on the meta device: (their module name, their weights source)."""
    return [(name, getattr(m, WEIGHTS_ATTR)) for name, m in model.named_modules() if hasattr(m, WEIGHTS_ATTR)]


def loaded_on_meta(model: nn.Module) -> bool:
    return bool(weights_on_meta(model))


def forget_sources(model: nn.Module) -> None:
    """Drop the weights sources (their files' handles and maps) once the weights are in."""
    for module in model.modules():
        if hasattr(module, WEIGHTS_ATTR):
            getattr(module, WEIGHTS_ATTR).close()
            delattr(module, WEIGHTS_ATTR)
