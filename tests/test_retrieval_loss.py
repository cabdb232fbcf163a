"""RetrievalLoss against a hand-built cross-entropy: in-batch + hard negatives, targets, d2q, float32."""

import pytest
import torch
import torch.nn.functional as F

from magclip.losses import RetrievalLoss
from magclip.similarity import Scorer


def features(b: int, g: int, dim: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, dim, generator=gen) * torch.linspace(0.3, 4.0, b).unsqueeze(1)).requires_grad_()
    d = (torch.randn(b * g, dim, generator=gen) * torch.linspace(2.0, 0.5, b * g).unsqueeze(1)).requires_grad_()
    return q, d


def prepared(x: torch.Tensor, gamma: float) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).pow(gamma)


GAMMAS = {"cosine": (1.0, 1.0), "dot": (0.0, 0.0), "qnorm": (1.0, 0.0), "dnorm": (0.0, 1.0)}


def reference(q, d, g, mode, scale, doc_to_query, w_q2d=1.0, w_d2q=1.0):
    gq, gd = GAMMAS[mode]
    s = scale * prepared(q, gq) @ prepared(d, gd).T                       # [B, B*G]
    b = q.shape[0]
    loss = F.cross_entropy(s, torch.arange(b) * g)
    if not doc_to_query:
        return loss
    s_d = (scale * prepared(q, gq) @ prepared(d[::g], gd).T).T            # positive docs x queries
    loss_d = F.cross_entropy(s_d, torch.arange(b))
    return (w_q2d * loss + w_d2q * loss_d) / (w_q2d + w_d2q)


@pytest.mark.parametrize("mode", list(GAMMAS))
@pytest.mark.parametrize("g", [1, 3])
@pytest.mark.parametrize("doc_to_query", [False, True])
def test_equals_hand_built_cross_entropy_and_gradients(mode, g, doc_to_query):
    q, d = features(6, g, seed=g)
    scale = torch.tensor(2.5, requires_grad=True)
    out = RetrievalLoss(mode, group_size=g, doc_to_query=doc_to_query, d2q_weight=0.5)(q, d, scale)
    out["loss"].backward()
    ours = [q.grad.clone(), d.grad.clone(), scale.grad.clone()]

    q2, d2 = features(6, g, seed=g)
    scale2 = torch.tensor(2.5, requires_grad=True)
    ref = reference(q2, d2, g, mode, scale2, doc_to_query, 1.0, 0.5)
    ref.backward()
    assert torch.allclose(out["loss"], ref, rtol=1e-6, atol=1e-6)
    for a, b in zip(ours, [q2.grad, d2.grad, scale2.grad]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert ("loss_d2q" in out) == doc_to_query


def test_group_targets_point_at_each_querys_positive():
    b, g, dim = 4, 3, 16
    q = torch.eye(dim)[:b] * 5
    d = torch.randn(b * g, dim) * 0.01
    d[torch.arange(b) * g] = torch.eye(dim)[:b] * 5        # positive i (first of group i) = query i
    d[torch.arange(b) * g + 1] = -torch.eye(dim)[:b]        # hard negatives point away
    out = RetrievalLoss("dot", group_size=g)(q, d, torch.tensor(1.0))
    assert out["acc_q2d"] == 1.0 and out["loss_q2d"] < 1e-6
    # the same documents read with the positive in second place: every query now picks a non-target
    shifted = d.view(b, g, dim).roll(1, dims=1).reshape(b * g, dim)
    assert RetrievalLoss("dot", group_size=g)(q, shifted, torch.tensor(1.0))["acc_q2d"] == 0.0


def test_hard_negatives_of_other_queries_are_negatives_too():
    b, g = 3, 2
    q, d = features(b, g)
    loss = RetrievalLoss("cosine", group_size=g)
    logits_cols = b * g
    scores = Scorer("cosine")(q, d)
    assert scores.shape == (b, logits_cols)
    # removing every other document changes the loss: they are all in the softmax
    assert not torch.isclose(loss(q, d, torch.tensor(10.0))["loss"],
                             RetrievalLoss("cosine")(q, d[::g], torch.tensor(10.0))["loss"])


def test_local_and_global_forms_agree_in_one_process():
    q, d = features(5, 2)
    a = RetrievalLoss("qnorm", group_size=2, doc_to_query=True, local_loss=True)(q, d, torch.tensor(3.0))
    b = RetrievalLoss("qnorm", group_size=2, doc_to_query=True, local_loss=False)(q, d, torch.tensor(3.0))
    assert torch.allclose(a["loss"], b["loss"])


def test_float32_under_bf16_autocast():
    q, d = features(4, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = RetrievalLoss("dot", group_size=2, doc_to_query=True)(q.bfloat16(), d.bfloat16(), torch.tensor(1.0))
    assert out["loss"].dtype == torch.float32
    ref = RetrievalLoss("dot", group_size=2, doc_to_query=True)(q.bfloat16().float(), d.bfloat16().float(),
                                                                 torch.tensor(1.0))
    assert torch.allclose(out["loss"], ref["loss"], atol=1e-6)


def test_learnable_exponents_receive_gradient_and_shape_errors():
    q, d = features(4, 1)
    loss = RetrievalLoss(Scorer("learnable", 0.5, 0.5))
    loss(q, d, torch.tensor(1.0))["loss"].backward()
    assert loss.scorer.gamma_q_param.grad is not None and loss.scorer.gamma_d_param.grad is not None
    with pytest.raises(ValueError, match="documents"):
        RetrievalLoss("cosine", group_size=2)(q, d, torch.tensor(1.0))
    with pytest.raises(ValueError, match="group_size"):
        RetrievalLoss("cosine", group_size=0)
