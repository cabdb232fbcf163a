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
from collections.abc import Callable
from contextlib import nullcontext

from accelerate import Accelerator
from torch import nn

from magclip.config import TrainConfig
from magclip.models import build
from magclip.models.lora import probe_after_start
from magclip.training.levers import resolve_precision
from magclip.training.shard_fill import local_rows  # noqa: F401  (the start's reading, kept importable here)
from magclip.training.sharding import Sharding, make_sharding

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
