"""Length groups (magclip/models/length_groups.py): the plan is the cheapest split, and a grouped batch gives the
vectors and gradients of the padded batch (a BERT and a right-padded decoder), while left padding runs whole."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from magclip.models.length_groups import encode_in_length_groups, plan_groups, right_padded_lengths
from magclip.models.text import BiEncoder
from builders import WORDS, make_tiny_bert, make_tiny_decoder


def _cost(lengths: list[int], groups: list[list[int]], group_cost: int) -> int:
    return sum(len(g) * max(lengths[i] for i in g) + group_cost for g in groups)


@pytest.mark.parametrize("seed", range(20))
def test_the_plan_is_the_cheapest_split_of_the_sorted_rows(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.randint(1, 60) for _ in range(rng.randint(1, 8))]
    cost = rng.choice([0, 8, 40, 500])
    groups = plan_groups(lengths, cost)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    best = min(_cost(lengths, [order[a:b] for a, b in zip((0, *cuts), (*cuts, len(order)))], cost)
               for k in range(len(order)) for cuts in itertools.combinations(range(1, len(order)), k))
    assert _cost(lengths, groups, cost) == best


def test_right_padding_is_recognised_and_left_padding_is_not() -> None:
    right = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert right_padded_lengths(right).tolist() == [3, 1]
    assert right_padded_lengths(torch.tensor([[1, 1, 1], [0, 1, 1]])) is None
    assert right_padded_lengths(torch.tensor([[1, 0, 1]])) is None


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 2, 3, 8, 20, 40]))) for _ in range(n)]


def _vectors_and_grads(model: BiEncoder, batch: dict, cost: int | None) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    model.length_group_cost = cost
    out = model.encode_tokens(batch, "passage")
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["bert", "decoder"])
def test_grouped_vectors_and_gradients_equal_the_padded_batch(tmp_path, kind: str) -> None:
    folder = (make_tiny_bert if kind == "bert" else make_tiny_decoder)(tmp_path / kind)
    model = BiEncoder.from_pretrained(folder, pooling="mean" if kind == "bert" else "last")
    model.eval()  # no dropout: the two runs must see the same network
    batch = model.tokenize(_texts(12), "passage")
    lengths = batch["attention_mask"].sum(1).tolist()
    assert len(plan_groups(lengths, 4)) > 2, "the texts must vary enough in length to make several groups"
    whole, whole_grads = _vectors_and_grads(model, batch, None)
    grouped, grouped_grads = _vectors_and_grads(model, batch, 4)
    torch.testing.assert_close(grouped, whole, rtol=1e-5, atol=1e-5)
    assert grouped_grads.keys() == whole_grads.keys()
    for name in whole_grads:
        torch.testing.assert_close(grouped_grads[name], whole_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_a_left_padded_batch_runs_whole(tmp_path) -> None:
    calls: list[tuple[int, ...]] = []

    def encode(part: dict) -> torch.Tensor:
        calls.append(tuple(part["input_ids"].shape))
        return part["input_ids"].float().sum(1, keepdim=True)

    mask = torch.tensor([[0, 0, 1], [1, 1, 1], [0, 1, 1]])
    out = encode_in_length_groups(encode, {"input_ids": mask * 5, "attention_mask": mask}, group_cost=0)
    assert calls == [(3, 3)] and out.squeeze(1).tolist() == [5.0, 15.0, 10.0]


def test_rows_come_back_in_input_order_from_several_groups() -> None:
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]])
    ids = torch.arange(4).unsqueeze(1).expand(4, 4) * mask
    widths: list[int] = []

    def encode(part: dict) -> torch.Tensor:
        widths.append(part["input_ids"].shape[1])
        return part["input_ids"][:, :1].float()

    out = encode_in_length_groups(encode, {"input_ids": ids, "attention_mask": mask}, group_cost=0)
    assert out.squeeze(1).tolist() == [0.0, 1.0, 2.0, 3.0]
    assert sorted(widths) == [1, 3, 4]


def test_a_tower_sharded_with_fsdp_runs_whole(tmp_path) -> None:
    """Every rank must run the same forwards (each gathers the weights): under FSDP2 no groups, whatever the lengths
    (inside a forward the parameters are the gathered plain tensors, so the check cannot read them)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        model = BiEncoder.from_pretrained(make_tiny_bert(tmp_path / "bert"))
        for layer in model.query_model.encoder.layer:
            fully_shard(layer)
        fully_shard(model)
        calls = []
        model.query_model.register_forward_hook(lambda *_: calls.append(1))
        batch = model.tokenize(_texts(12), "passage")
        assert len(plan_groups(batch["attention_mask"].sum(1).tolist(), 4)) > 2
        model.length_group_cost = 4
        model(batch, batch)  # the root's forward: FSDP gathers the weights there
        assert calls == [1, 1]
    finally:
        dist.destroy_process_group()
