"""A real 2-process gloo run: gathered CLIPLoss equals one process on the global batch.

Each rank holds half of a global batch of inputs. Features come from small linear towers with the
same weights on every rank; after backward the parameter gradients are averaged over ranks, as
DDP does, and compared with one process computing the loss on the whole batch.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from open_clip.loss import ClipLoss

from magclip import CLIPLoss, LogitScale, Scorer

WORLD = 2
PER_RANK = 6
DIM_IN, DIM = 10, 8

CASES = [
    *[dict(i2t=m, t2i=m, local_loss=ll) for m in ("cosine", "dot", "qnorm", "dnorm", "learnable") for ll in (False, True)],
    *[dict(i2t="qnorm", t2i=None, local_loss=ll) for ll in (False, True)],
    *[dict(i2t="qnorm", t2i="dnorm", i2t_weight=2.0, local_loss=ll) for ll in (False, True)],
]
# gather_with_grad=False is open_clip's cheaper approximation (gradient through the local slice
# only); it is checked against open_clip's ClipLoss below, not against the exact global gradient.


class Towers(torch.nn.Module):
    """Two linear towers, a logit scale and the loss (with its learnable exponents, if any)."""

    def __init__(self, case: dict):
        super().__init__()
        torch.manual_seed(0)
        self.image = torch.nn.Linear(DIM_IN, DIM)
        self.text = torch.nn.Linear(DIM_IN, DIM)
        self.scale = LogitScale(init=3.0)
        self.loss = self.make_loss(case)

    def make_loss(self, case: dict) -> torch.nn.Module:
        kw = dict(case)
        if kw["i2t"] == "learnable":  # one shared learnable pair for both directions
            kw["i2t"] = kw["t2i"] = Scorer("learnable", 0.3, 0.7)
        return CLIPLoss(**kw)

    def forward(self, x_img, x_txt):
        return self.loss(self.image(x_img), self.text(x_txt), self.scale())


def _global_inputs():
    g = torch.Generator().manual_seed(1)
    scales = torch.linspace(0.3, 4.0, WORLD * PER_RANK).unsqueeze(1)  # varied norms, so modes differ
    return torch.randn(WORLD * PER_RANK, DIM_IN, generator=g) * scales, torch.randn(WORLD * PER_RANK, DIM_IN, generator=g)


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def join_group(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    assert dist.get_world_size() == WORLD


def rank_results(rank: int, cases: list[dict], towers: type) -> list[dict]:
    """Per case: this rank's loss on its half of the global batch, the loss averaged over ranks, and the
    parameter gradients averaged over ranks (as DDP does)."""
    x_img, x_txt = _global_inputs()
    local = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    results = []
    for case in cases:
        model = towers(case)
        out = model(x_img[local], x_txt[local])
        out["loss"].backward()
        grads = _grads(model)
        for g in grads.values():  # DDP's gradient averaging
            dist.all_reduce(g)
            g /= WORLD
        loss = out["loss"].detach().clone()
        mean_loss = loss.clone()
        dist.all_reduce(mean_loss)
        results.append(dict(loss=loss, mean_loss=mean_loss / WORLD, grads=grads))
    return results


def _worker(rank: int, port: int, out_dir: str) -> None:
    join_group(rank, port)
    x_img, x_txt = _global_inputs()
    local = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    results = rank_results(rank, CASES, Towers)
    results.append(_open_clip_parity(rank, x_img[local], x_txt[local]))
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _open_clip_parity(rank: int, x_img, x_txt) -> dict:
    """Per rank: our cosine loss and feature gradients vs open_clip's ClipLoss, both gathered."""
    out = {}
    for local_loss in (False, True):
        for gather_with_grad in (False, True):
            feats = {}
            for name in ("ours", "open_clip"):
                img, txt = (x_img * 1.5).requires_grad_(), (x_txt * 0.5).requires_grad_()
                scale = torch.tensor(1 / 0.07)
                if name == "ours":
                    loss = CLIPLoss(local_loss=local_loss, gather_with_grad=gather_with_grad)(img, txt, scale)["loss"]
                else:
                    ref = ClipLoss(local_loss=local_loss, gather_with_grad=gather_with_grad, rank=rank, world_size=WORLD)
                    loss = ref(F.normalize(img, dim=-1), F.normalize(txt, dim=-1), scale)
                loss.backward()
                feats[name] = (loss.detach(), img.grad, txt.grad)
            out[(local_loss, gather_with_grad)] = feats
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(worker, out_dir) -> list:
    """Run `worker(rank, port, out_dir)` on WORLD gloo processes; each rank's saved results."""
    mp.start_processes(worker, args=(_free_port(), str(out_dir)), nprocs=WORLD, join=True, start_method="spawn")
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


def assert_ranks_equal_one_process(two_rank_results: list, index: int, case: dict, towers: type) -> dict:
    """Case `index`: every rank's averaged loss and gradients equal one process on the global batch."""
    model = towers(case)
    out = model(*_global_inputs())
    out["loss"].backward()
    expected = _grads(model)
    for rank, results in enumerate(two_rank_results):
        got = results[index]
        torch.testing.assert_close(got["mean_loss"], out["loss"].detach(), rtol=1e-6, atol=1e-6)
        if not case["local_loss"]:  # every rank computes the full global loss
            torch.testing.assert_close(got["loss"], out["loss"].detach(), rtol=1e-6, atol=1e-6)
        assert got["grads"].keys() == expected.keys(), rank
        for name, g in expected.items():
            torch.testing.assert_close(got["grads"][name], g, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
    return expected


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    return spawn_ranks(_worker, tmp_path_factory.mktemp("dist"))


@pytest.mark.parametrize("index", range(len(CASES)), ids=[str(c) for c in CASES])
def test_two_ranks_equal_one_process_on_the_global_batch(two_rank_results, index):
    assert_ranks_equal_one_process(two_rank_results, index, CASES[index], Towers)


def test_two_ranks_match_open_clip_clip_loss(two_rank_results):
    for rank, results in enumerate(two_rank_results):
        for (local_loss, gwg), feats in results[-1].items():
            ours, ref = feats["ours"], feats["open_clip"]
            ctx = f"rank {rank} local_loss={local_loss} gather_with_grad={gwg}"
            torch.testing.assert_close(ours[0], ref[0], rtol=1e-6, atol=0, msg=ctx)
            for a, b in zip(ours[1:], ref[1:]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=ctx)
