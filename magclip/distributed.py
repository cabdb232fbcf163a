"""Rank/world helpers that work without a process group, and an all-gather that keeps autograd.

The contrastive loss needs every rank's features as negatives *with* gradient, so that the
features of rank r receive the gradient of the scores other ranks computed with them.
accelerate's `gather` detaches; the loss must use `all_gather_with_grad` instead.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def all_gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """Concatenate `x` from every rank along dim 0; gradients flow back to each rank's slice.

    The backward sums the gradients that every rank computed for a slice (reduce-scatter, or
    all-to-all + sum on gloo), so with the loss replicated on W ranks each local slice receives
    W x its true gradient, which DDP's gradient averaging divides back out. Every rank must pass
    the same shape.
    """
    if not is_distributed():
        return x
    import torch.distributed.nn.functional as dist_fn

    with warnings.catch_warnings():
        # torch marks torch.distributed.nn as deprecated in favour of functional collectives, whose
        # autograd backward needs reduce_scatter, which gloo (CPU) lacks; this one works on both.
        warnings.simplefilter("ignore")
        return torch.cat(dist_fn.all_gather(x), dim=0)


def all_gather_no_grad(x: torch.Tensor, keep_local_grad: bool = True) -> torch.Tensor:
    """Concatenate `x` from every rank without autograd, optionally keeping the local slice's graph.

    With `keep_local_grad`, the local slice is the input tensor itself (open_clip's
    `gather_with_grad=False` behaviour): gradients reach local features only.
    """
    if not is_distributed():
        return x
    parts = [torch.empty_like(x) for _ in range(world_size())]
    with torch.no_grad():
        dist.all_gather(parts, x.contiguous())
    if keep_local_grad:
        parts[rank()] = x
    return torch.cat(parts, dim=0)

