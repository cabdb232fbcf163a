"""The repeated blocks of a model, found from its structure: one rule for what FSDP shards as a unit
(training/sharding.py) and where LoRA's default adapters go (models/lora.py). Models are data: no model name is
looked at."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def repeated_blocks(model: nn.Module, prefix: str = "",
                    accept: Callable[[type], bool] | None = None) -> list[tuple[str, nn.Module]]:
    """(name, block) of the model's repeated blocks: the children of a ModuleList or Sequential that are all of one
    class (one `accept` takes, when given), composite (they hold sub-modules) and hold parameters (open_clip's
    residual blocks, a ResNet stage's bottlenecks, a BERT's or a decoder's layers). Not searched inside blocks."""
    blocks: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        full = f"{prefix}{name}"
        kids = list(child.named_children()) if isinstance(child, (nn.ModuleList, nn.Sequential)) else []
        if kids and len({type(k) for _, k in kids}) == 1 and (accept is None or accept(type(kids[0][1]))) and all(
                any(True for _ in k.children()) and any(True for _ in k.parameters()) for _, k in kids):
            blocks.extend((f"{full}.{n}", k) for n, k in kids)
        else:
            blocks.extend(repeated_blocks(child, f"{full}.", accept))
    return blocks
