"""The meta-device start of `train.sharding: fsdp`: towers loaded from weights files are built on the meta
device (magclip.models.build), sharded with FSDP2, then materialised and filled shard by shard, so that no
process ever holds the full fp32 model, as torchtitan starts its models.

Which parts start on meta (the rule, also in the README): a tower that loads its weights from a file or
folder (an open_clip `.pt`/`.safetensors` checkpoint, a Hugging Face or sentence-transformers folder with one
safetensors file, a sharded set with its index, or a torch file) whose every parameter and persistent buffer
is there under the model's names and shapes. Everything else is built eagerly as under `ddp`: towers from
scratch (a random initialisation on the meta device cannot equal the eager one bit for bit; they are the
small ones), the modules after a sentence-transformers Pooling, a file that the loader converts, the loss
parameters. A tower may mix both: its eager parts are sharded as they are, its meta parts read from files.

A LoRA run (`model.lora`) starts on the meta device too: peft wraps the meta-built towers (models/lora.py), the
weights sources follow peft's renaming (`x.weight` -> `x.base_layer.weight`), the frozen base takes its dtype
there (bf16 where training runs in bf16), and the adapters' initial values, drawn whole and alike on every rank
as peft draws them, are read like a file's rows. Only once the towers are sharded and filled does the check
that every adapted module takes part in a forward run, on the sharded model, on every rank (`start_sharded`).

Each rank reads only what it owns: FSDP2 shards dim 0 of every parameter in `torch.chunk` pieces (the last
ones shorter or empty); a rank's rows are taken from the DTensor's own placement (`local_rows`), and read as
that slice of the file (safetensors `get_slice`, a memory-mapped torch file). Replicated tensors (buffers, the
0-d scalars FSDP ignores) are read whole: they are small. The weights equal an eager load's bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
from accelerate import Accelerator
from torch import nn

from magclip.config import TrainConfig
from magclip.models import build
from magclip.models.lora import probe_after_start
from magclip.training.levers import resolve_precision
from magclip.training.sharding import Sharding, local, make_sharding

log = logging.getLogger("magclip.training.meta_start")


def towers_built_for(cfg: TrainConfig):
    """The context the towers are built in: on the meta device under `train.sharding: fsdp`, else eagerly. A LoRA
    run too: peft wraps the towers on the meta device (models/lora.py), and the check that every adapted module
    takes part in a forward runs once they are sharded and filled (`start_sharded`)."""
    return build.on_meta() if cfg.sharding == "fsdp" else nullcontext()


def start_sharded(module: nn.Module, accelerator: Accelerator, cfg: TrainConfig) -> Sharding | None:
    """Where towers were built on the meta device: shard and fill them now, before anything runs the model (a
    pretrained logit scale, a temperature from the first batch's norms), then run the LoRA probes peft's wrapping
    deferred; the Engine takes the returned sharding (`Engine(..., sharding=)`). None otherwise: the Engine
    shards, as before."""
    if not build.loaded_on_meta(module):
        return None
    sharding = make_sharding(cfg.sharding, accelerator, resolve_precision(cfg.precision, accelerator.device)[0])
    sharding.shard(module)
    probe_after_start(module, as_forward_of(module.towers()))
    return sharding


def as_forward_of(towers: nn.Module) -> Callable[[Callable[[], object]], object]:
    """`run(fn)`: `fn()` as a forward of the sharded towers (FSDP gathers their outer weights around it, as around
    `forward`: a tower's own forward called alone would make it a second FSDP root); on one process, `fn()`."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    def run(fn: Callable[[], object]) -> object:
        towers._magclip_probe_forward = fn
        try:
            register_fsdp_forward_method(towers, "_magclip_probe_forward")
            return towers._magclip_probe_forward()
        finally:
            del towers._magclip_probe_forward

    return run


def local_rows(t: torch.Tensor) -> tuple[int, int] | None:
    """The rows [start, stop) of dim 0 that this rank holds of a sharded parameter (a DTensor sharded on dim 0),
    from its placement and mesh; None for a tensor held whole (a plain tensor, a replicated DTensor)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(t, DTensor):
        return None
    dims = {p.dim for p in t.placements if isinstance(p, Shard)}
    if not dims:
        return None
    if dims != {0}:
        raise ValueError(f"a parameter sharded on dim {sorted(dims)}: the meta-device start reads dim-0 shards only")
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return offset[0], offset[0] + shape[0]


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()


@torch.no_grad()
def materialise(module: nn.Module, device: torch.device) -> dict[str, int]:
    """Allocate a module whose parts were built on the meta device (after fully_shard: each rank its shards) and
    fill it: every tensor of a part with a weights source from its file (this rank's rows), every other tensor
    (eager parts, computed buffers, loss parameters) as it was. Returns what was read, for the log and tests."""
    plan: dict[str, tuple[build.WeightsSource, str]] = {}
    for prefix, source in build.weights_on_meta(module):
        plan.update({(f"{prefix}.{key}" if prefix else key): (source, key) for key in source.keys})
    kept = {name: local(t).detach().clone() for name, t in _named_tensors(module) if name not in plan}
    lost = [name for name, t in kept.items() if t.is_meta]
    if lost:
        raise ValueError(f"{lost[0]} (and {len(lost) - 1} more) is on the meta device and in no weights file")
    module.to_empty(device=device)
    read = {"tensors": 0, "bytes": 0}
    for name, t in _named_tensors(module):
        target = local(t)
        if name in kept:
            target.copy_(kept[name])
            continue
        source, key = plan[name]
        rows = local_rows(t)
        if rows is not None and rows[0] == rows[1]:
            continue   # more ranks than rows: this rank holds none
        part = source.read(key, rows)
        if tuple(part.shape) != tuple(target.shape):
            raise ValueError(f"{key}: rows {rows} of the weights have shape {list(part.shape)}, this rank's shard "
                             f"{list(target.shape)}")
        target.copy_(part)
        read["tensors"] += 1
        read["bytes"] += part.numel() * part.element_size()
    build.forget_sources(module)
    return read


@contextmanager
def no_weights_attached(module: nn.Module) -> Iterator[None]:
    """`module` without its weights sources for a while (a deep copy of the structure must not carry them)."""
    parts = [(m, getattr(m, build.WEIGHTS_ATTR)) for m in module.modules() if hasattr(m, build.WEIGHTS_ATTR)]
    for m, _ in parts:
        delattr(m, build.WEIGHTS_ATTR)
    try:
        yield
    finally:
        for m, source in parts:
            setattr(m, build.WEIGHTS_ATTR, source)
