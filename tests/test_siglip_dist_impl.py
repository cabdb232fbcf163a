"""SigLIPLoss(dist_impl=...): the neighbour exchanges ('bidir', 'shift', 'reduce') equal the gather
('gather'), one process on the global batch and, in cosine, open_clip's SigLipLoss with the same
dist_impl -- loss, accuracy and every gradient (both feature tensors, scale, bias, learnable γ) -- on
2 and 4 real gloo processes, with odd per-rank batches, in every scoring mode.

One spawn per world size runs every case; the ranks save what they computed and the tests compare.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from magclip.config import SIGLIP_DIST_IMPLS, ConfigError, LossConfig, experiment_differences, validate
from magclip.distributed import exchanged_blocks, mean_over_ranks
from magclip.losses import SigLIPLoss, _BlockwiseTop1
from magclip.similarity import Scorer

WORLDS = (2, 4)
PER_RANK = (3, 4)  # an odd per-rank batch, and an even one
DIM = 8
MODES = ("cosine", "dot", "qnorm", "dnorm", "learnable")
EXCHANGES = tuple(i for i in SIGLIP_DIST_IMPLS if i != "gather")
LOSS_PARAMS = ("scale", "bias", "gamma_q", "gamma_d")  # gradients that DDP averages over ranks
FEATURES = ("image", "text")  # gradients that reach each rank's own features
TOL = {"rtol": 1e-5, "atol": 1e-6}


def global_features(world: int, per_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch; varied norms, so the scoring modes differ."""
    g = torch.Generator().manual_seed(world * 100 + per_rank)
    n = world * per_rank
    norms = torch.linspace(0.4, 3.0, n)[torch.randperm(n, generator=g)].unsqueeze(1)
    return torch.randn(n, DIM, generator=g) * norms, torch.randn(n, DIM, generator=g) * norms.flip(0)


def make_loss(mode: str, dist_impl: str, local_loss: bool = True, gather_with_grad: bool = True) -> SigLIPLoss:
    scorer = Scorer("learnable", 0.3, 0.7) if mode == "learnable" else mode
    return SigLIPLoss(scorer, local_loss=local_loss, gather_with_grad=gather_with_grad, dist_impl=dist_impl)


def step(loss_fn, img: torch.Tensor, txt: torch.Tensor) -> dict[str, torch.Tensor]:
    """Loss, accuracy and every gradient of one forward + backward on these features."""
    img, txt = img.clone().requires_grad_(), txt.clone().requires_grad_()
    scale, bias = torch.tensor(2.5, requires_grad=True), torch.tensor(-1.5, requires_grad=True)
    out = loss_fn(img, txt, scale, bias)
    out["loss"].backward()
    got = {"loss": out["loss"].detach(), "acc": out.get("acc_i2t", torch.tensor(float("nan"))),
           "image": img.grad, "text": txt.grad, "scale": scale.grad, "bias": bias.grad}
    scorer = getattr(loss_fn, "scorer", None)
    if scorer is not None and scorer.learnable:
        got.update(gamma_q=scorer.gamma_q_param.grad, gamma_d=scorer.gamma_d_param.grad)
    return got


def open_clip_loss_module():
    """open_clip's own loss.py, loaded alone (it imports only torch): every spawned rank would otherwise
    spend ~10 s importing the open_clip package for one class."""
    folder = importlib.util.find_spec("open_clip").submodule_search_locations[0]
    spec = importlib.util.spec_from_file_location("open_clip_loss_alone", Path(folder) / "loss.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def open_clip_cosine(rank: int, world: int, dist_impl: str):
    ref = open_clip_loss_module().SigLipLoss(rank=rank, world_size=world, dist_impl=dist_impl)
    return lambda i, t, s, b: {"loss": ref(F.normalize(i, dim=-1), F.normalize(t, dim=-1), s, b)}


def rank_results(rank: int, world: int) -> dict:
    """Every case on this rank: its own values, and the loss and loss-parameter gradients averaged over
    ranks (as the logged mean and DDP would)."""
    results = {}
    for b in PER_RANK:
        img, txt = (x[rank * b:(rank + 1) * b] for x in global_features(world, b))
        for mode in MODES:
            for impl in SIGLIP_DIST_IMPLS:
                for local_loss in (True, False):
                    got = step(make_loss(mode, impl, local_loss), img, txt)
                    got["mean"] = {k: mean_over_ranks(got[k]) for k in ("loss", *LOSS_PARAMS) if k in got}
                    results[("ours", b, mode, impl, local_loss)] = got
        for impl in SIGLIP_DIST_IMPLS:
            results[("open_clip", b, impl)] = step(open_clip_cosine(rank, world, impl), img, txt)
        results[("detached", b)] = step(make_loss("cosine", "gather", gather_with_grad=False), img, txt)
    for impl in EXCHANGES:  # each rank sends its own rank number
        results[("blocks", impl)] = [(source, int(block[0, 0])) for source, block in
                                     exchanged_blocks(torch.full((2, 3), float(rank)), impl)]
    return results


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    assert dist.get_world_size() == world and dist.get_rank() == rank
    torch.save(rank_results(rank, world), os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, out_dir) -> list[dict]:
    mp.start_processes(_worker, args=(world, _free_port(), str(out_dir)), nprocs=world, join=True,
                       start_method="spawn")
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(world)]


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def ranks(request, tmp_path_factory) -> list[dict]:
    return spawn(request.param, tmp_path_factory.mktemp(f"siglip_world{request.param}"))


def ours(ranks: list[dict]) -> list[tuple]:
    return [k for k in ranks[0] if k[0] == "ours"]


def assert_same(a: dict, b: dict, keys, ctx: str) -> None:
    for k in keys:
        if k in a or k in b:
            torch.testing.assert_close(a[k], b[k], **TOL, msg=f"{ctx}: {k}")


# ----------------------------------------------------------------------------------- across processes


def test_every_exchange_equals_the_gather(ranks):
    """Per rank: the same loss, accuracy and feature gradients; with local_loss (open_clip's form) the
    same scale, bias and γ_image gradients too; every loss-parameter gradient averaged over ranks."""
    for key in ours(ranks):
        _, b, mode, impl, local_loss = key
        if impl == "gather":
            continue
        for r, res in enumerate(ranks):
            got, want = res[key], res[("ours", b, mode, "gather", local_loss)]
            ctx = f"rank {r} of {len(ranks)}, b={b} {mode} {impl} local_loss={local_loss}"
            assert_same(got, want, ("loss", "acc", *FEATURES), ctx)
            # texts are prepared before they travel: γ_text's gradient returns to their own rank
            assert_same(got, want, ("scale", "bias", "gamma_q") if local_loss else (), ctx)
            assert_same(got["mean"], want["mean"], ("loss", *LOSS_PARAMS), ctx + " (mean over ranks)")


def test_every_form_equals_one_process_on_the_global_batch(ranks):
    """The mean of the ranks' losses and loss-parameter gradients is the global-batch one; each rank's
    feature gradient is W x the global-batch gradient of its slice (DDP divides the W back out)."""
    world = len(ranks)
    for key in ours(ranks):
        _, b, mode, impl, local_loss = key
        one = step(make_loss(mode, impl, local_loss), *global_features(world, b))  # no process group here
        assert set(ranks[0][key]["mean"]) == {"loss", *(k for k in LOSS_PARAMS if k in one)}
        for r, res in enumerate(ranks):
            ctx = f"rank {r} of {world}, b={b} {mode} {impl} local_loss={local_loss}"
            assert_same(res[key]["mean"], one, ("loss", *LOSS_PARAMS), ctx)
            if not local_loss:
                assert_same(res[key], one, ("loss",), ctx)  # every rank reports the global-batch loss
            rows = slice(r * b, (r + 1) * b)
            for k in FEATURES:
                torch.testing.assert_close(res[key][k], world * one[k][rows], **TOL, msg=f"{ctx}: {k}")


def test_cosine_equals_open_clip_siglip_loss_in_each_dist_impl(ranks):
    """open_clip's own SigLipLoss, rank by rank, with the same dist_impl (and against our gather)."""
    for b in PER_RANK:
        for impl in SIGLIP_DIST_IMPLS:
            for r, res in enumerate(ranks):
                ref = res[("open_clip", b, impl)]
                for form in (impl, "gather"):
                    ctx = f"rank {r} of {len(ranks)}, b={b}, ours {form} vs open_clip {impl}"
                    assert_same(res[("ours", b, "cosine", form, True)], ref,
                                ("loss", *FEATURES, "scale", "bias"), ctx)


def test_each_block_comes_from_the_rank_it_names(ranks):
    """Every rank's block arrives once, labelled with its sender (the label decides which block holds the
    matching pairs, and how the accuracy breaks ties)."""
    world = len(ranks)
    for impl in EXCHANGES:
        for r, res in enumerate(ranks):
            blocks = res[("blocks", impl)]
            assert all(source == sent for source, sent in blocks), (impl, r, blocks)
            assert sorted(source for source, _ in blocks) == list(range(world)), (impl, r, blocks)


def test_gather_without_grad_keeps_the_local_texts_graph(ranks):
    """gather_with_grad=False: this rank's texts still get this rank's gradient (they are only ever
    documents, so a fully detached gather would leave the text tower without any)."""
    world = len(ranks)
    for b in PER_RANK:
        img, txt = global_features(world, b)
        for r, res in enumerate(ranks):
            rows = slice(r * b, (r + 1) * b)
            t = txt.clone()
            t_local = t[rows].clone().requires_grad_()
            t = torch.cat([t[:r * b], t_local, t[(r + 1) * b:]])
            logits = 2.5 * (F.normalize(img[rows], dim=-1) @ F.normalize(t, dim=-1).T) - 1.5
            labels = -torch.ones_like(logits)
            labels[torch.arange(b), torch.arange(b) + r * b] = 1.0
            (-F.logsigmoid(labels * logits).sum() / b).backward()
            torch.testing.assert_close(res[("detached", b)]["text"], t_local.grad, **TOL)


# ----------------------------------------------------------------------------------- one process


def test_names_and_the_exchange_gradient_are_checked():
    with pytest.raises(ValueError, match="dist_impl='ring'"):
        SigLIPLoss(dist_impl="ring")
    with pytest.raises(ValueError, match="gather_with_grad=False needs dist_impl='gather'"):
        SigLIPLoss(dist_impl="bidir", gather_with_grad=False)
    assert SigLIPLoss().dist_impl == "bidir"  # open_clip's default


@pytest.mark.parametrize("impl", EXCHANGES)
def test_one_process_exchange_is_the_plain_loss(impl):
    img, txt = global_features(1, 7)
    for mode in MODES:
        got, want = step(make_loss(mode, impl), img, txt), step(make_loss(mode, "gather"), img, txt)
        assert_same(got, want, ("loss", "acc", *FEATURES, *LOSS_PARAMS), f"{impl} {mode}")


def test_blockwise_top1_counts_ties_as_argmax_over_the_gathered_row():
    """Rank 1 of 3: a tie in an earlier rank's block beats the match, a tie in a later one does not."""
    me, b = 1, 4
    blocks = {s: torch.zeros(b, b) for s in range(3)}
    blocks[me] += torch.eye(b) * 5.0
    blocks[0][0, 2] = 5.0     # row 0: tie before the match -> argmax picks rank 0's column: miss
    blocks[2][1, 0] = 5.0     # row 1: tie after the match -> the match comes first: hit
    blocks[2][2, 3] = 6.0     # row 2: larger later -> miss
    blocks[me][3, 0] = 5.0    # row 3: tie inside the matching block, before the diagonal -> miss
    gathered = torch.cat([blocks[s] for s in range(3)], dim=1)
    want = (gathered.argmax(dim=1) == torch.arange(b) + me * b).float().mean()
    for order in ((1, 0, 2), (1, 2, 0), (0, 1, 2), (2, 1, 0)):  # bidir, shift, reduce orders
        top1 = _BlockwiseTop1(me)
        for s in order:
            top1.add(s, blocks[s])
        assert top1.rate() == want == 0.25, order


def test_config_key_is_validated_and_may_change_on_resume():
    assert LossConfig().dist_impl == "bidir"
    for impl in SIGLIP_DIST_IMPLS:
        validate_loss(LossConfig(type="siglip", dist_impl=impl))
    with pytest.raises(ConfigError, match="loss.dist_impl='ring'"):
        validate_loss(LossConfig(type="siglip", dist_impl="ring"))
    with pytest.raises(ConfigError, match="needs loss.dist_impl=gather"):
        validate_loss(LossConfig(type="siglip", gather_with_grad=False))
    validate_loss(LossConfig(type="siglip", gather_with_grad=False, dist_impl="gather"))
    with pytest.raises(ConfigError, match="loss.dist_impl is a key of loss.type=siglip"):
        validate_loss(LossConfig(dist_impl="gather"))  # the CLIP loss gathers
    refused, allowed = experiment_differences({"loss": {"dist_impl": "gather"}}, {"loss": {"dist_impl": "bidir"}})
    assert not refused and allowed == {"loss.dist_impl": ("gather", "bidir")}


def test_the_training_task_builds_the_configured_form():
    from magclip.training.clip import build_loss

    assert build_loss(LossConfig(type="siglip", dist_impl="shift")).dist_impl == "shift"
    assert build_loss(LossConfig(type="siglip")).dist_impl == "bidir"


def validate_loss(loss: LossConfig) -> None:
    from magclip.config import RunConfig

    validate(RunConfig(loss=loss))
