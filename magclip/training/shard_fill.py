"""Filling a module whose parts were built on the meta device, once FSDP2 has sharded it: each rank allocates its
shards and reads only the rows it owns from the weights files (magclip.models.build's sources). Used by the sharding
(training/sharding.py) and the meta-device start (training/meta_start.py), below both: neither imports the other's
internals (the start makes a sharding; the sharding fills what the start built).

FSDP2 shards dim 0 of every parameter in `torch.chunk` pieces (the last ones shorter or empty); a rank's rows are
taken from the DTensor's own placement (`local_rows`), and read as that slice of the file (safetensors `get_slice`, a
memory-mapped torch file). Replicated tensors (buffers, the 0-d scalars FSDP ignores) are read whole: they are small.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from magclip.models import build

log = logging.getLogger("magclip.training.shard_fill")


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor: a DTensor's local shard, else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


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
