"""A padded batch run through a text tower as groups of similar length: the same vectors, less padding.

A batch padded to its longest text spends much of its compute on padding when lengths vary: at batch 32
and 256 tokens, 59 % of squad_train's padded paragraph tokens are real (and 39 % of the attention's
work). Each text's output depends only on its own tokens -- the attention mask hides the padding, and
with right padding a text's positions do not depend on the others' -- so sorting the batch by length,
cutting it into groups and trimming each group to its own longest text changes no vector beyond
rounding, while the batch, and with it the in-batch negatives, stays exactly the same.

Groups are chosen by dynamic programming over the sorted lengths to minimise the padded tokens plus a
fixed cost per forward (`group_cost`, in tokens: what a forward's fixed overhead is worth). Left-padded
batches (decoders padded on the left) run whole: a decoder's position ids follow the batch's padding
there, so trimming would change outputs. Sharded towers (FSDP) run whole too: every rank must run the
same forwards, and each group would gather the weights again.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

GROUP_COST_TOKENS = 128  # a forward's fixed cost in tokens: measured on MiniLM-L6 on CPU (benchmarks/README.md)


def right_padded_lengths(mask: Tensor) -> Tensor | None:
    """Each row's token count when `mask` is right-padded (ones, then zeros); None when it is not."""
    lengths = mask.sum(dim=1)
    positions = torch.arange(mask.shape[1], device=mask.device)
    if not torch.equal(mask.bool(), positions.unsqueeze(0) < lengths.unsqueeze(1)):
        return None
    return lengths


def plan_groups(lengths: list[int], group_cost: int = GROUP_COST_TOKENS) -> list[list[int]]:
    """Row indices of each group, shortest texts first: the split of the length-sorted rows into runs that
    minimises sum(rows x longest) + group_cost per run (exact, O(n^2) for a batch of n)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: cheapest plan of the j shortest rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = lengths[order[j - 1]]
        for i in range(j):
            cost = best[i] + (j - i) * longest + group_cost
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def encode_in_length_groups(encode: Callable[[dict[str, Tensor]], Tensor], inputs: dict[str, Tensor],
                            group_cost: int = GROUP_COST_TOKENS) -> Tensor:
    """`encode(inputs)` computed group by group (see module docstring); rows come back in input order."""
    mask = inputs["attention_mask"]
    lengths = right_padded_lengths(mask)
    if lengths is None:
        return encode(inputs)
    groups = plan_groups(lengths.tolist(), group_cost)
    if len(groups) == 1 and int(lengths.max()) == mask.shape[1]:
        return encode(inputs)
    parts, rows = [], []
    for group in groups:
        index = torch.tensor(group, device=mask.device)
        width = max(1, int(lengths[index].max()))
        parts.append(encode({k: v.index_select(0, index)[:, :width] for k, v in inputs.items()}))
        rows.extend(group)
    inverse = torch.empty(len(rows), dtype=torch.long, device=parts[0].device)
    inverse[torch.tensor(rows, device=parts[0].device)] = torch.arange(len(rows), device=parts[0].device)
    return torch.cat(parts).index_select(0, inverse)
