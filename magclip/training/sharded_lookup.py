"""A frozen token embedding under `train.sharding=fsdp`, sharded by rows and looked up where its rows are: never
gathered whole.

Why: as an FSDP unit a token embedding is all-gathered whole for every lookup, although a batch reads a few hundred
of its rows: for a 0.6 B Qwen3 that is its 0.3 GiB bf16 table plus the all-gather's buffers, about 0.6 GiB on every
rank at each forward, the largest single transient of a LoRA run (benchmarks/bench_phase_memory.py). Where the
table does not train (a LoRA run's base), each rank keeps its rows as FSDP would (a DTensor sharded on dim 0 in
`torch.chunk` pieces, so the meta-device start fills and the checkpoints read it like any shard), and a lookup
exchanges ids and rows instead of the table, as Megatron's vocabulary-parallel embedding does, but across ranks
that hold different batches:

1. every rank's token ids are gathered (a few KB; their shapes first, texts differ in length);
2. each rank writes the rows it holds for every rank's ids, zeros elsewhere;
3. one all-reduce sums them (each id's row comes from exactly one rank: the sum is that row, bit for bit), and
   each rank keeps its own batch's part.

Every rank must run the same lookups, as every FSDP forward already is a collective (sharded evaluations pad to the
busiest rank's forwards). A trainable table stays an FSDP unit (its gradient is FSDP's reduce-scatter).
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from magclip.training.shard_fill import local_rows


def can_look_up_sharded(table: nn.Module) -> bool:
    """A plain frozen `nn.Embedding` without `max_norm` (which renormalises the table's rows in place)."""
    return type(table) is nn.Embedding and not table.weight.requires_grad and table.max_norm is None


def shard_rows(table: nn.Embedding, mesh) -> None:
    """`table.weight` becomes this rank's rows (a DTensor sharded on dim 0, on the meta device where it was) and its
    forward the sharded lookup; every rank calls this."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    weight = table.weight
    if weight.is_meta:
        rows = torch.arange(weight.shape[0]).chunk(mesh.size())
        mine = rows[mesh.get_local_rank()].numel() if mesh.get_local_rank() < len(rows) else 0
        local = torch.empty((mine, *weight.shape[1:]), dtype=weight.dtype, device="meta")
        sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=weight.shape,
                                     stride=weight.stride())
    else:
        sharded = distribute_tensor(weight.detach(), mesh, [Shard(0)])
    table.weight = nn.Parameter(sharded, requires_grad=False)
    table.forward = types.MethodType(_lookup, table)


def _lookup(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """The rows of `ids` (this rank's batch) from the ranks that hold them (see the module docstring)."""
    weight = self.weight.to_local()
    start, stop = local_rows(self.weight) or (0, weight.shape[0])
    world, rank = dist.get_world_size(), dist.get_rank()
    count = torch.tensor([ids.numel()], device=ids.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count)
    sizes = [int(c) for c in counts]
    flat = torch.zeros(max(sizes), dtype=torch.int64, device=ids.device)
    flat[:ids.numel()] = ids.reshape(-1)
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    every = torch.cat([g[:n] for g, n in zip(gathered, sizes)])
    local = every - start
    here = (local >= 0) & (local < stop - start)
    rows = torch.zeros(every.numel(), weight.shape[1], dtype=weight.dtype, device=weight.device)
    if bool(here.any()):
        rows[here] = F.embedding(local[here], weight)
    summed = rows.float() if rows.dtype == torch.bfloat16 and dist.get_backend() == "gloo" else rows
    dist.all_reduce(summed)   # one rank holds each row: the sum is it, exactly
    offset = sum(sizes[:rank])
    return summed[offset:offset + ids.numel()].to(weight.dtype).reshape(*ids.shape, weight.shape[1])
