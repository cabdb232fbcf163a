"""Text evaluation of a sharded model (`train.sharding=fsdp`): every rank encodes, one rank scores.

A sharded model's forward gathers each block's weights from every rank (collectives), so no rank can encode
alone. The leading rank runs the evaluation as one process would (BEIR, STS, RAG: magclip.evaluation.text and
.rag, unchanged) with an `encode(texts, side)` that first sends the texts to the other ranks; every rank then
encodes its share of the same length-sorted batches (`BiEncoder.encode(share=...)`) and the leading rank gets
the rows back in order. The other ranks serve such requests until the leading rank's evaluation ends. The
embeddings and the metrics live on the leading rank only; the full weights are never gathered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from magclip.distributed import Share
from magclip.evaluation.text import encoder_fn
from magclip.models.text import BiEncoder

Encode = Callable[[list[str], str], torch.Tensor]


def as_fsdp_forward(model: BiEncoder) -> None:
    """Make `model.encode` a forward of a FSDP-sharded model, so that FSDP gathers the tower's outer weights
    (embeddings, final norm: what no block holds) around it as around `forward` (once; nothing unsharded)."""
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    if isinstance(model, FSDPModule) and not getattr(model, "_encode_is_fsdp_forward", False):
        register_fsdp_forward_method(model, "encode")
        model._encode_is_fsdp_forward = True


@contextmanager
def shared_text_encoding(model: BiEncoder, batch_size: int, device, share: Share) -> Iterator[Encode | None]:
    """The `encode(texts, side)` an evaluation calls: the model's own on one process; sharded, the leading rank's
    (sending each request to the others) and None on the other ranks, which have served every request of the
    leading rank's evaluation by the time they get it (they skip the evaluation)."""
    if not share.sharded:
        yield encoder_fn(model, batch_size, device)
        return
    as_fsdp_forward(model)
    if not share.leads:
        while (request := share.broadcast()) is not None:
            texts, side = request
            model.encode(texts, side, batch_size=batch_size, share=share)
        yield None
        return

    def encode(texts: list[str], side: str) -> torch.Tensor:
        share.broadcast((list(texts), side))
        return model.encode(texts, side, batch_size=batch_size, share=share)

    try:
        yield encode
    finally:
        share.broadcast(None)  # the evaluation's end (or its failure): the other ranks stop serving
