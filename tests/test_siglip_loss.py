"""SigLIPLoss: cosine equals open_clip's SigLipLoss (loss and gradients), every fixed mode equals the
learnable one at its corner, scores stay float32 under bf16 autocast, and 2 gloo processes equal one
process on the global batch (loss, gradients of the towers, the scale and the bias)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from open_clip.loss import SigLipLoss

from magclip.losses import SigLIPLoss
from magclip.similarity import FIXED_MODES, Scorer
from magclip.temperature import LogitBias
from test_distributed_loss import Towers as ClipTowers
from test_distributed_loss import assert_ranks_equal_one_process, join_group, rank_results, spawn_ranks

MODES = ("cosine", "dot", "qnorm", "dnorm", "learnable")
CASES = [dict(mode=m, local_loss=ll) for m in MODES for ll in (False, True)]


def features(n: int = 12, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    norms = torch.linspace(0.5, 3.0, n).unsqueeze(1)  # varied norms: the modes differ
    return torch.randn(n, 16, generator=g) * norms, torch.randn(n, 16, generator=g) * norms.flip(0)


def test_cosine_equals_open_clip_siglip_loss_and_gradients():
    img, txt = features()
    results = {}
    for name in ("ours", "open_clip"):
        i, t = img.clone().requires_grad_(), txt.clone().requires_grad_()
        scale, bias = torch.tensor(10.0, requires_grad=True), torch.tensor(-10.0, requires_grad=True)
        if name == "ours":
            loss = SigLIPLoss("cosine")(i, t, scale, bias)["loss"]
        else:
            loss = SigLipLoss()(F.normalize(i, dim=-1), F.normalize(t, dim=-1), scale, bias)
        loss.backward()
        results[name] = (loss.detach(), i.grad, t.grad, scale.grad, bias.grad)
    for ours, ref in zip(results["ours"], results["open_clip"]):
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode", list(FIXED_MODES))
def test_each_fixed_mode_is_the_learnable_one_at_its_corner(mode):
    img, txt = features(seed=1)
    scale, bias = torch.tensor(3.0), torch.tensor(-2.0)
    fixed = SigLIPLoss(mode)(img, txt, scale, bias)["loss"]
    corner = SigLIPLoss(Scorer("learnable", *FIXED_MODES[mode]))(img, txt, scale, bias)["loss"]
    torch.testing.assert_close(fixed, corner, rtol=1e-6, atol=1e-6)


def test_scores_are_float32_under_bf16_autocast():
    img, txt = features()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = SigLIPLoss("qnorm")(img.bfloat16(), txt.bfloat16(), torch.tensor(1.0), torch.tensor(-10.0))
    assert out["loss"].dtype == torch.float32 and torch.isfinite(out["loss"])


def test_a_bias_is_required():
    img, txt = features()
    with pytest.raises(ValueError, match="needs a logit bias"):
        SigLIPLoss()(img, txt, torch.tensor(10.0))


class Towers(ClipTowers):
    """The 2-process test's towers (tests/test_distributed_loss.py) with the sigmoid loss and its bias."""

    def make_loss(self, case: dict) -> SigLIPLoss:
        self.bias = LogitBias(-4.0)
        scorer = Scorer("learnable", 0.3, 0.7) if case["mode"] == "learnable" else case["mode"]
        return SigLIPLoss(scorer, local_loss=case["local_loss"])

    def forward(self, x_img, x_txt):
        return self.loss(self.image(x_img), self.text(x_txt), self.scale(), self.bias())


def _worker(rank: int, port: int, out_dir: str) -> None:
    join_group(rank, port)
    torch.save(rank_results(rank, CASES, Towers), os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    return spawn_ranks(_worker, tmp_path_factory.mktemp("dist_siglip"))


@pytest.mark.parametrize("index", range(len(CASES)), ids=[str(c) for c in CASES])
def test_two_ranks_equal_one_process_on_the_global_batch(two_rank_results, index):
    expected = assert_ranks_equal_one_process(two_rank_results, index, CASES[index], Towers)
    assert {"scale.log_scale", "bias.bias"} <= expected.keys()  # the scale and the bias are exact too
