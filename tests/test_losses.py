"""CLIPLoss: parity with open_clip's ClipLoss, mode corners, asymmetric directions, extreme norms."""

import math

import pytest
import torch
import torch.nn.functional as F
from open_clip.loss import ClipLoss

from magclip import CLIPLoss, Scorer
from magclip.similarity import FIXED_MODES


def _raw_features(n: int = 12, dim: int = 8, seed: int = 0, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    img = torch.randn(n, dim, generator=g) * torch.linspace(0.2, 5.0, n).unsqueeze(1) * scale
    txt = torch.randn(n, dim, generator=g) * torch.linspace(3.0, 0.5, n).unsqueeze(1) * scale
    return img.requires_grad_(), txt.requires_grad_()


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs() / b.abs().clamp_min(1e-12)).max())


@pytest.mark.parametrize("local_loss", [False, True])
def test_cosine_symmetric_equals_open_clip_loss_and_gradients(local_loss):
    img, txt = _raw_features(seed=1)
    scale = torch.tensor(1 / 0.07, requires_grad=True)
    ours = CLIPLoss(local_loss=local_loss)(img, txt, scale)
    ours["loss"].backward()
    ours_grads = [img.grad.clone(), txt.grad.clone(), scale.grad.clone()]

    img2, txt2 = _raw_features(seed=1)
    scale2 = torch.tensor(1 / 0.07, requires_grad=True)
    ref = ClipLoss(local_loss=local_loss)(F.normalize(img2, dim=-1), F.normalize(txt2, dim=-1), scale2)
    ref.backward()
    assert _max_rel(ours["loss"].detach(), ref.detach()) <= 1e-6
    for a, b in zip(ours_grads, [img2.grad, txt2.grad, scale2.grad]):
        assert _max_rel(a, b) <= 1e-5 or float((a - b).abs().max()) <= 1e-7


@pytest.mark.parametrize("mode", list(FIXED_MODES))
def test_learnable_corner_equals_fixed_mode_in_the_loss(mode):
    img, txt = _raw_features(seed=2)
    scale = torch.tensor(2.0)
    fixed = CLIPLoss(mode, mode)(img, txt, scale)["loss"]
    shared = Scorer("learnable", *FIXED_MODES[mode])
    learnable = CLIPLoss(shared, shared)(img, txt, scale)["loss"]
    assert torch.equal(fixed, learnable)
    learnable.backward()
    assert shared.gamma_q_param.grad.abs() > 0 and shared.gamma_d_param.grad.abs() > 0


def test_directions_use_their_own_query_side():
    img, txt = _raw_features(seed=3)
    scale = torch.tensor(1.0)
    out = CLIPLoss("qnorm", "dnorm")(img, txt, scale)
    targets = torch.arange(img.shape[0])
    i2t = F.cross_entropy(F.normalize(img, dim=-1) @ txt.T, targets)  # image is the query, texts stay raw
    t2i = F.cross_entropy(txt @ F.normalize(img, dim=-1).T, targets)  # text is the query, image docs normalized
    torch.testing.assert_close(out["loss_i2t"], i2t)
    torch.testing.assert_close(out["loss_t2i"], t2i)
    torch.testing.assert_close(out["loss"], (i2t + t2i) / 2)


def test_absent_and_zero_weight_directions():
    img, txt = _raw_features(seed=4)
    scale = torch.tensor(1.0)
    one_way = CLIPLoss("qnorm", None)(img, txt, scale)
    assert "loss_t2i" not in one_way and torch.equal(one_way["loss"], one_way["loss_i2t"])
    weighted = CLIPLoss("qnorm", "qnorm", i2t_weight=1.0, t2i_weight=0.0)(img, txt, scale)
    torch.testing.assert_close(weighted["loss"], one_way["loss"])
    assert not weighted["loss_t2i"].requires_grad  # reported, not trained
    w = CLIPLoss("cosine", "dot", i2t_weight=3.0, t2i_weight=1.0)(img, txt, scale)
    torch.testing.assert_close(w["loss"], (3 * w["loss_i2t"] + w["loss_t2i"]) / 4)


def test_bad_directions_are_rejected():
    with pytest.raises(ValueError, match="at least one direction"):
        CLIPLoss(None, None)
    with pytest.raises(ValueError, match="positive sum"):
        CLIPLoss("cosine", "cosine", i2t_weight=0.0, t2i_weight=0.0)
    with pytest.raises(ValueError, match="unknown scoring mode 'qnrom'"):
        CLIPLoss("qnrom")


@pytest.mark.parametrize("mode", [*FIXED_MODES, "learnable"])
@pytest.mark.parametrize("norm", [1e3, 1e-4])
def test_extreme_norms_under_bf16_autocast_stay_finite(mode, norm):
    img, txt = _raw_features(seed=5)
    img = (F.normalize(img.detach(), dim=-1) * norm).bfloat16().requires_grad_()
    txt = (F.normalize(txt.detach(), dim=-1) * norm).bfloat16().requires_grad_()
    scale = torch.tensor(math.log(1 / 0.07), requires_grad=True)
    loss_fn = CLIPLoss(mode, mode)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = loss_fn(img, txt, scale.exp())
    assert out["loss"].dtype == torch.float32
    out["loss"].backward()
    grads = [img.grad, txt.grad, scale.grad] + [p.grad for p in loss_fn.parameters()]
    assert torch.isfinite(out["loss"]) and all(torch.isfinite(g).all() for g in grads)
