"""Where a run's parameters live across processes (`train.sharding`), beside the loop as torchtitan keeps it.

- `ddp` (the default): every process holds the whole model, its gradients and AdamW's two moments
  (16 bytes a parameter in fp32), and accelerate's DistributedDataParallel averages the gradients.
- `fsdp`: PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`) shards the parameters, gradients and
  optimizer state of the towers across the processes: about 16/N bytes a parameter. Each repeated block of
  a tower (open_clip's residual blocks, a ResNet stage's bottlenecks, a BERT's or a decoder's layers:
  `shard_units`) is its own unit, gathered just before its forward and freed after, then the tower itself. A
  token embedding table (and an output head) is a unit of its own too (`own_units`), gathered around its lookup
  alone; a frozen one (a LoRA run's base) is never gathered: each rank keeps its rows and looks up the ids that fall
  there (training/sharded_lookup.py).
  With `train.precision` bf16 the gathered parameters and the compute are bf16 while the shards (the master
  weights) and the gradient reduction stay fp32 (`MixedPrecisionPolicy`).

The small loss parameters (logit scale, the sigmoid loss's bias, learnable γ) are not sharded: they stay
replicated and identical on every rank, their gradients averaged over the ranks after each backward, as
DDP averages them. accelerate (1.16) given an FSDP plugin on a CPU silently falls back to DDP, so the
sharding is applied here, one code path on CPUs (gloo) and GPUs (NCCL); accelerate still provides the
process group, the device and autocast.

Checkpoints under `fsdp` (magclip.training.checkpoints): every rank writes its shard of the model and the
optimizer with torch.distributed.checkpoint (DCP) into the step folder's `sharded/`, inside the same
temporary folder that is renamed into place, so a kill leaves the previous checkpoint whole. The main
process also writes the consolidated model (the open_clip or sentence-transformers folder that plain tools
open), gathered from the shards. DCP reshards on load: a checkpoint written by N processes continues on M.
`train.save_full_model` says which checkpoints also hold that consolidated model: `every` (the default),
`last` (the run's final checkpoint) or `never` (the DCP shards alone; `magclip-consolidate` writes the model
folder from them offline, on one process, tensor by tensor: magclip.training.consolidate). A LoRA run's shards hold
only what trains (`save_sharded(trainable_only=True)`), its adapters are gathered alone (`gathered_trainable`) for
peft's adapter folder, and no merged model is ever gathered (`magclip-consolidate --merge`: training/merge.py).

Evaluation during and after training runs on every rank with the sharded model (`eval_share`): each rank
encodes its share of the batches, the embeddings are gathered on the main process, which computes the
metrics (magclip.distributed.Share, magclip.evaluation.sharded). The full weights are never gathered for it;
with train.precision bf16 it computes with the bf16 parameters FSDP gathers (`evaluation_precision`). On one
process fsdp evaluates the module itself, like ddp.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn

from magclip import distributed
from magclip.distributed import Share
from magclip.models.blocks import repeated_blocks
from magclip.training import shard_fill
from magclip.training.shard_fill import local
from magclip.training.sharded_lookup import can_look_up_sharded, shard_rows

log = logging.getLogger("magclip.training.sharding")

SHARDED_DIR = "sharded"  # a step folder's DCP checkpoint (model + optimizer), under fsdp


def shard_units(tower: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a tower, each a FSDP unit: the children of a ModuleList or Sequential that are
    all of one class, composite (they hold sub-modules) and hold parameters, of a class FSDP2 can wrap (not
    sentence-transformers' Dense: its `__slots__` layout refuses FSDP2's subclass; its parameters stay in the
    tower's unit). Blocks are not searched inside blocks. Models are data: no model name is looked at."""
    return [block for _, block in repeated_blocks(tower, accept=_fsdp_can_wrap)]


def own_units(tower: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """The parts outside the repeated blocks that become FSDP units of their own, so that each is gathered only around
    its own forward and freed after (in the tower's root unit it would stay gathered for the tower's whole forward):
    every token embedding table (`nn.Embedding`, `nn.EmbeddingBag`: a decoder's vocabulary is its largest tensor, 0.5 GiB
    of a 0.6 B Qwen3) and an output head (an `nn.Linear` whose weight has an embedding table's shape, as a language
    model's head has), where its weight is not the embedding's own (tied: it stays in the root)."""
    inside = {id(m) for unit in units for m in unit.modules()}
    tables = [m for m in tower.modules() if type(m) in (nn.Embedding, nn.EmbeddingBag) and id(m) not in inside
              and m.weight.numel() > 0]
    shapes = {tuple(t.weight.shape) for t in tables}
    tied = {id(t.weight) for t in tables}
    heads = [m for m in tower.modules() if type(m) is nn.Linear and id(m) not in inside
             and tuple(m.weight.shape) in shapes and id(m.weight) not in tied]
    return tables + heads


def _fsdp_can_wrap(cls: type) -> bool:
    """Whether fully_shard can give a module of `cls` its FSDP subclass (the assignment of `__class__` that it
    makes last, after the parameters are already sharded: a failure there would leave a half-sharded module)."""
    from torch.distributed.fsdp import FSDPModule

    probe = cls.__new__(cls)
    try:
        object.__setattr__(probe, "__class__", type(f"FSDP{cls.__name__}", (FSDPModule, cls), {}))
    except TypeError:
        return False
    return True


class Sharding:
    """`train.sharding: ddp`: accelerate's DistributedDataParallel over a full replica per process."""

    name = "ddp"

    def __init__(self, accelerator: Accelerator):
        self.acc = accelerator

    @property
    def sharded(self) -> bool:
        return False

    def shard(self, module: nn.Module) -> nn.Module:
        return module

    def prepare(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, Any]:
        return self.acc.prepare(module, optimizer)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return self.acc.unwrap_model(model)

    def no_sync(self, model: nn.Module):
        """Skip the gradient all-reduce of a micro-batch that is not the step's last."""
        return self.acc.no_sync(model)

    def sync_buffers(self, module: nn.Module) -> None:
        """Rank 0's buffers on every rank (before a forward, before a checkpoint): DDP broadcasts them itself at
        each forward."""

    def after_backward(self, module: nn.Module) -> None:
        """DDP averaged every gradient already."""

    def grad_norm(self, params: list[nn.Parameter], max_norm: float | None) -> torch.Tensor:
        """The total gradient norm (0-d tensor), the gradients clipped to `max_norm` when given."""
        if max_norm:
            return self.acc.clip_grad_norm_(params, max_norm).detach()
        return torch.linalg.vector_norm(torch.stack([p.grad.detach().float().norm() for p in params]))

    def eval_share(self) -> Share:
        """Which ranks encode an evaluation: the main process alone, with the whole model (`eval_module`)."""
        return Share()

    def eval_module(self, module: nn.Module) -> nn.Module | None:
        """The module the main process evaluates (every process calls this; None on the others); give it back
        to `release` after."""
        return module if self.acc.is_main_process else None

    def release(self, full: nn.Module | None) -> None:
        """The end of an `eval_module`: nothing to free for a replica."""

    @contextmanager
    def full_module(self, module: nn.Module) -> Iterator[nn.Module | None]:
        """The module with its full weights on the main process (for writing the model files); None elsewhere."""
        yield module if self.acc.is_main_process else None

    def gathered_trainable(self, module: nn.Module) -> dict[str, torch.Tensor] | None:
        """The trainable parameters, whole, on the main process (None elsewhere; every process calls this): a LoRA
        run's adapters and loss parameters, what its checkpoint's adapter folder is written from."""
        if not self.acc.is_main_process:
            return None
        return {name: p.detach() for name, p in module.named_parameters() if p.requires_grad}

    def weights_record(self, module: nn.Module) -> dict[str, Any]:
        """results.json: a digest of every rank's final parameters (equal: the replicas stayed in step)."""
        with distributed.naming_lost_ranks("the comparison of the final weights"):
            digests = distributed.gather_objects(distributed.parameters_digest(module))
        if len(set(digests)) > 1:
            log.warning("the ranks end with different weights (sha256 by rank: %s)", digests)
        return {"weights_sha256_by_rank": digests}

    def memory_record(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes this process holds of parameters, gradients and optimizer state (what sharding divides)."""
        return {"parameter_bytes": _bytes(local(p) for p in module.parameters()),
                "gradient_bytes": _bytes(local(p.grad) for p in module.parameters() if p.grad is not None),
                "optimizer_state_bytes": _bytes(local(v) for s in _inner(optimizer).state.values() for v in s.values()
                                                if torch.is_tensor(v))}


class FSDPSharding(Sharding):
    """`train.sharding: fsdp`: FSDP2 over the towers' repeated blocks and roots; loss parameters replicated."""

    name = "fsdp"

    def __init__(self, accelerator: Accelerator, precision: str):
        super().__init__(accelerator)
        self.precision = precision
        self._template: nn.Module | None = None   # the unsharded module's structure on the meta device
        self._replicated: list[nn.Parameter] = []

    @property
    def sharded(self) -> bool:
        return self.acc.num_processes > 1

    def shard(self, module: nn.Module) -> nn.Module:
        """fully_shard every tower's blocks, then the tower; keep a meta-device template of the whole module
        (for the consolidated model files and evaluation) and the loss parameters replicated. Towers built on
        the meta device (magclip.training.meta_start) are then materialised and filled shard by shard. A second
        call (the Engine's, after a meta-device start) only makes the replicated tensors rank 0's again."""
        if self._template is not None:
            self._broadcast_from_rank0(module)
            return module
        with shard_fill.no_weights_attached(module):
            self._template = _meta_copy(module)
        self._replicated = list(module.loss_parameters())
        if not self.sharded:
            log.info("train.sharding=fsdp on one process: nothing to shard; checkpoints in the sharded format")
            self._fill_from_weights(module)
            return module
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self._broadcast_from_rank0(module)
        towers = module.towers()
        # BatchNorm keeps fp32 running statistics and cannot take bf16 weights beside them: a tower with BatchNorm
        # gathers fp32 parameters (autocast still computes its convolutions in bf16)
        batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in towers.modules())
        bf16 = self.precision == "bf16" and not batchnorm
        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
                  else MixedPrecisionPolicy())
        units = shard_units(towers)
        # a 0-d parameter (open_clip's own logit_scale, kept frozen beside the towers) cannot be sharded: replicated
        scalars = {p for p in towers.parameters() if p.ndim == 0}
        self._replicated += [p for p in scalars if p.requires_grad]
        for unit in units:
            fully_shard(unit, mp_policy=policy, ignored_params=scalars & set(unit.parameters()) or None)
        tables = own_units(towers, units)   # token embeddings (and an output head): gathered around their own forward
        looked_up = [t for t in tables if can_look_up_sharded(t)]   # frozen tables: never gathered (sharded_lookup.py)
        if looked_up:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(self.acc.device.type, (self.acc.num_processes,))
            for table in looked_up:
                shard_rows(table, mesh)
        for table in tables:
            if table not in looked_up:
                fully_shard(table, mp_policy=policy, reshard_after_forward=True)
        scalars |= {t.weight for t in looked_up}   # the root unit leaves them alone: they are sharded by rows already
        # the root unit (embeddings, projections, the stem) is freed after the forward too, not kept gathered until the
        # backward as FSDP2 keeps a root by default: one more all-gather a step for that memory
        fully_shard(towers, mp_policy=policy, ignored_params=scalars or None, reshard_after_forward=True)
        log.info("train.sharding=fsdp: %d blocks, %d embedding tables or heads (%d frozen, looked up where their rows "
                 "are) and the towers sharded over %d processes (parameters in use: %s, gradient reduction fp32); loss "
                 "parameters replicated: %d tensors", len(units), len(tables), len(looked_up), self.acc.num_processes,
                 "bf16" if bf16 else "fp32 (BatchNorm in the towers)" if self.precision == "bf16" else "fp32",
                 len(self._replicated))
        self._fill_from_weights(module)
        return module

    def _fill_from_weights(self, module: nn.Module) -> None:
        """The meta-device start's second half: allocate this rank's shards and read them from the weights."""
        from magclip.models.build import loaded_on_meta

        if loaded_on_meta(module):
            read = shard_fill.materialise(module, self.acc.device)
            log.info("meta-device start: this process read %d tensors (%.1f MB) of the weights files, its shards",
                     read["tensors"], read["bytes"] / 2**20)

    @staticmethod
    @torch.no_grad()
    def _broadcast_from_rank0(module: nn.Module) -> None:
        """Every rank starts from rank 0's parameters and buffers, as DDP makes its replicas at construction:
        fully_shard keeps each rank's own slice of what it holds, and a start that differs by rank (a scale set
        from each rank's first batch, an unseeded initialisation) would otherwise be stitched together. Tensors
        still on the meta device (read from files later, the same on every rank) and shards are left alone."""
        from torch.distributed.tensor import DTensor

        for t in [*module.parameters(), *module.buffers()]:
            if not t.is_meta and not isinstance(t, DTensor):
                dist.broadcast(t.data, 0)

    def prepare(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, Any]:
        return module, optimizer  # accelerate would wrap it in DDP again

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def no_sync(self, model: nn.Module):
        return nullcontext()  # every micro-batch reduce-scatters its gradients: the sum is the same

    def sync_buffers(self, module: nn.Module) -> None:
        """Rank 0's buffers (BatchNorm statistics) on every rank, as DDP broadcasts them at each forward; before a
        checkpoint too, so the shards hold rank 0's whichever rank writes them."""
        if not self.sharded:
            return
        for buffer in module.buffers():
            dist.broadcast(buffer, 0)

    def after_backward(self, module: nn.Module) -> None:
        """Average the replicated loss parameters' gradients over the ranks (the towers' were reduce-scattered)."""
        if not self.sharded:
            return
        world = self.acc.num_processes
        for p in self._replicated:
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world

    def grad_norm(self, params: list[nn.Parameter], max_norm: float | None) -> torch.Tensor:
        """The norm over every rank's shards (DTensor gradients) and the replicated gradients, clipped alike."""
        from torch.distributed.tensor import DTensor

        sharded = [p for p in params if isinstance(p.grad, DTensor)]
        plain = [p for p in params if not isinstance(p.grad, DTensor)]
        squares = torch.zeros((), device=self.acc.device)
        for group in (sharded, plain):
            if group:
                norm = torch.nn.utils.get_total_norm([p.grad for p in group], 2.0)
                squares = squares + (norm.full_tensor() if isinstance(norm, DTensor) else norm).float() ** 2
        total = squares.sqrt()
        if max_norm:
            for group in (sharded, plain):
                if group:
                    torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
        return total.detach()

    def eval_share(self) -> Share:
        """Every rank encodes its share with the sharded model (one process: the module itself, like ddp)."""
        return evaluation_share(self.name, self.acc)

    def eval_module(self, module: nn.Module) -> nn.Module | None:
        return self._consolidated(module, to_device=True)

    @contextmanager
    def full_module(self, module: nn.Module) -> Iterator[nn.Module | None]:
        full = self._consolidated(module, to_device=False)
        try:
            yield full
        finally:
            self.release(full)

    def release(self, full: nn.Module | None) -> None:
        """Free a consolidated copy's tensors (the template goes back to the meta device); the live module stays."""
        if full is not None and full is self._template and self.sharded:
            full.to("meta")

    def _consolidated(self, module: nn.Module, *, to_device: bool) -> nn.Module | None:
        """The whole module with its full weights on the main process (gathered from every rank's shards: every
        process calls this), None elsewhere. Built in the meta template, so nothing is copied twice."""
        if not self.sharded:
            return module if self.acc.is_main_process else None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        with distributed.naming_lost_ranks("the gathering of the full model from the shards"):
            full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.acc.is_main_process:
            return None
        assert self._template is not None
        self._template.load_state_dict({k: v.detach().cpu() for k, v in full.items()}, assign=True)
        for name, buffer in module.named_buffers():  # non-persistent buffers (an attention mask) are in no state dict
            if name not in full:
                owner, _, leaf = name.rpartition(".")
                self._template.get_submodule(owner)._buffers[leaf] = buffer.detach().cpu().clone()
        self._template.train(module.training)
        return self._template.to(self.acc.device) if to_device else self._template

    def gathered_trainable(self, module: nn.Module) -> dict[str, torch.Tensor] | None:
        """The trainable parameters gathered whole on the main process, one collective a tensor (the adapters: a few
        MB; the frozen base is never gathered); None elsewhere."""
        out: dict[str, torch.Tensor] = {}
        with distributed.naming_lost_ranks("the gathering of the trained parameters"):
            for name, p in module.named_parameters():
                if p.requires_grad:
                    full = p.full_tensor() if hasattr(p, "full_tensor") else p
                    if self.acc.is_main_process:
                        out[name] = full.detach().cpu()
        return out if self.acc.is_main_process else None

    def weights_record(self, module: nn.Module) -> dict[str, Any]:
        """results.json: a digest of the consolidated final weights (the shards differ by design), and every rank's
        digest of the replicated loss parameters (equal: they stayed in step)."""
        digest = self._streamed_digest(module)
        with distributed.naming_lost_ranks("the comparison of the replicated loss parameters"):
            replicated = distributed.gather_objects(distributed.tensors_digest(self._replicated))

        if len(set(replicated)) > 1:
            log.warning("the ranks end with different loss parameters (sha256 by rank: %s)", replicated)
        digests = distributed.gather_objects(digest)
        return {"weights_sha256": digests[0], "replicated_sha256_by_rank": replicated}

    def _streamed_digest(self, module: nn.Module) -> str | None:
        """`distributed.parameters_digest` of the consolidated weights on the main process (None elsewhere), no tensor
        ever gathered whole: a parameter sharded by rows is hashed shard after shard in rank order (its bytes are
        their concatenation), each rank sending its rows to the main process in pieces of `DIGEST_PIECE_BYTES`."""
        main = self.acc.is_main_process
        digest = hashlib.sha256() if main else None
        with distributed.naming_lost_ranks("the digest of the final weights"):
            for name, p in sorted(module.named_parameters(), key=lambda item: item[0]):
                if digest is not None:
                    digest.update(name.encode())
                if shard_fill.local_rows(p) is None:   # whole on every rank (or gathered: a replicated DTensor)
                    full = p.full_tensor() if hasattr(p, "full_tensor") else p
                    if digest is not None:
                        digest.update(_bytes_of(full))
                    continue
                for source, piece in _pieces_in_rank_order(p, self.acc.process_index, self.acc.num_processes):
                    if digest is not None and piece is not None:
                        digest.update(_bytes_of(piece))
        return digest.hexdigest() if digest is not None else None


DIGEST_PIECE_BYTES = 16 * 2**20


def _bytes_of(t: torch.Tensor) -> bytes:
    return t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def _pieces_in_rank_order(p: torch.Tensor, rank: int, world: int) -> Iterator[tuple[int, torch.Tensor | None]]:
    """The rows of a parameter sharded on dim 0, rank after rank, in pieces: on the main process each piece (its own,
    or received), elsewhere None after sending its own. Every rank walks the same sequence (point-to-point pairs)."""
    rows = [len(c) for c in torch.arange(p.shape[0]).chunk(world)] + [0] * world
    row_bytes = max(1, math.prod(p.shape[1:]) * p.element_size())
    step = max(1, DIGEST_PIECE_BYTES // row_bytes)
    mine = shard_fill.local(p).detach().contiguous()
    for source in range(world):
        for start in range(0, rows[source], step):
            count = min(step, rows[source] - start)
            if source == 0 and rank == 0:
                yield source, mine[start:start + count]
            elif rank == 0:
                piece = torch.empty((count, *p.shape[1:]), dtype=mine.dtype, device=mine.device)
                dist.recv(piece, source)
                yield source, piece
            elif rank == source:
                dist.send(mine[start:start + count].contiguous(), 0)
                yield source, None


def evaluation_share(sharding: str, accelerator: Accelerator) -> Share:
    """Which ranks encode a run's evaluations (`Sharding.eval_share`, known before the engine is built): every rank
    under fsdp on several processes, else the main process alone."""
    if sharding == "fsdp" and accelerator.num_processes > 1:
        return Share(accelerator.process_index, accelerator.num_processes)
    return Share()


def evaluation_precision(asked: str, share: Share, accelerator: Accelerator,
                         base_dtype: torch.dtype | None = None) -> str:
    """The precision an evaluation encodes in: `asked` (eval.precision), but bf16 where the weights it meets are bf16
    (fp32 inputs would not meet them outside autocast, and an fp32 evaluation would need a second, fp32 copy of the
    model): a sharded evaluation of a bf16 run, whose gathered parameters FSDP holds in bf16, or a LoRA run whose
    frozen base is held in bf16 (`base_dtype`). Said once in the log and recorded as the run's eval_precision."""
    bf16 = (share.sharded and accelerator.mixed_precision == "bf16") or base_dtype == torch.bfloat16
    if bf16 and asked != "bf16":
        log.info("eval.precision=%s: the evaluated weights are bf16 (%s), so evaluations encode in bf16", asked,
                 "the frozen LoRA base" if base_dtype == torch.bfloat16 else "FSDP's gathered parameters")
    return "bf16" if bf16 else asked


def make_sharding(name: str, accelerator: Accelerator, precision: str) -> Sharding:
    return FSDPSharding(accelerator, precision) if name == "fsdp" else Sharding(accelerator)


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    return int(sum(t.numel() * t.element_size() for t in tensors))


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)


def _meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy of `module` whose parameters and buffers are on the meta device: its structure and names
    without a byte of weights (the memo hands every tensor's copy over, so no storage is copied)."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


# ============================================================================ checkpoints


def save_sharded(folder: Any, module: nn.Module, optimizer: Any, trainable_only: bool = False) -> None:
    """Every rank writes its shard of the model and optimizer state (DCP) into `folder`; a collective. With
    `trainable_only` (a LoRA run) the frozen parameters are left out: they are the base's files, read again on resuming."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optim_state = get_state_dict(module, _inner(optimizer),
                                              options=StateDictOptions(ignore_frozen_params=trainable_only))
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder))


def trainable_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """A replica's state dict without its frozen parameters (a LoRA checkpoint's `state.pt`): what trains, and the
    buffers (BatchNorm statistics move in training; the rest are small)."""
    frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
    return {k: v for k, v in module.state_dict().items() if k not in frozen}


def _load_partial(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """A trainable-only state into a replica: every key it holds must be the module's, and every trainable parameter
    must be in it (the frozen ones come from the base's files)."""
    missing, unexpected = module.load_state_dict(state, strict=False)
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    lacking = sorted(set(missing) & trainable)
    if unexpected or lacking:
        raise ValueError(f"the checkpoint's trained state does not fit this model: {len(unexpected)} unknown keys "
                         f"{unexpected[:3]}, {len(lacking)} trained parameters missing {lacking[:3]}")


def load_training_weights(step: Any, state: dict[str, Any], module: nn.Module, optimizer: Any,
                          sharding: Sharding) -> str:
    """The model and optimizer state of a checkpoint into `module`/`optimizer`, whatever wrote it: DCP shards
    (resharded to this world size, into sharded or whole parameters), or a replica's full state (`state.pt`:
    loaded whole, or sharded onto FSDP parameters). Returns what was done, for the log."""
    from pathlib import Path

    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
        set_state_dict,
    )

    folder = Path(step) / SHARDED_DIR
    inner = _inner(optimizer)
    partial = bool(state["loop"].get("trainable_only"))   # a LoRA checkpoint: the base is read from its files
    if (folder / ".metadata").is_file():
        import torch.distributed.checkpoint as dcp

        options = StateDictOptions(ignore_frozen_params=partial, strict=not partial)
        model_state, optim_state = get_state_dict(module, inner, options=options)
        target = {"model": model_state, "optim": optim_state}
        dcp.load(target, checkpoint_id=str(folder))   # a key the checkpoint lacks fails here
        set_state_dict(module, inner, model_state_dict=target["model"], optim_state_dict=target["optim"],
                       options=options)
        written_by = state["loop"].get("world_size")
        return (f"sharded {'trained state' if partial else 'checkpoint'} (written by {written_by or '?'} processes) "
                f"resharded onto {sharding.acc.num_processes}")
    if state.get("module") is None:
        raise ValueError(f"checkpoint {step} holds neither {SHARDED_DIR}/ (a sharded run's) nor a full module state")
    if not sharding.sharded:
        if partial:
            _load_partial(module, state["module"])
        else:
            module.load_state_dict(state["module"])
        optimizer.load_state_dict(state["optimizer"])
        return "trained state (the base read from its files)" if partial else "full state"
    full = StateDictOptions(full_state_dict=True, strict=not partial)
    set_model_state_dict(module, state["module"], options=full)
    set_optimizer_state_dict(module, inner, _by_name(state["optimizer"], module, inner), options=full)
    return f"a replica's full state sharded onto {sharding.acc.num_processes} processes"


def _by_name(optim_state: dict[str, Any], module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """torch's optimizer state (parameters numbered in the order of the param groups) keyed by parameter name,
    the form FSDP's set_optimizer_state_dict takes: the groups are built in the same order under both shardings."""
    name_of = {id(p): name for name, p in module.named_parameters()}
    order = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
    if sum(len(g["params"]) for g in optim_state["param_groups"]) != len(order):
        raise ValueError("the checkpoint's optimizer holds another number of parameters than this model trains")
    return {"state": {order[i]: s for i, s in optim_state["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in optim_state["param_groups"]]}
