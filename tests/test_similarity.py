"""Scorer: the fixed modes are the corners of the learnable one; per-query ranking properties."""

import pytest
import torch
import torch.nn.functional as F

from magclip import Scorer
from magclip.similarity import FIXED_MODES


def _features(n: int, dim: int = 16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # norms spread over two orders of magnitude, so magnitude matters for the raw modes
    return torch.randn(n, dim, generator=g, dtype=torch.float64).float() * torch.logspace(-1, 1, n).unsqueeze(1)


def _reference(mode: str, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    gq, gd = FIXED_MODES[mode]
    q = F.normalize(q, dim=-1) if gq else q
    d = F.normalize(d, dim=-1) if gd else d
    return q @ d.T


@pytest.mark.parametrize("mode", list(FIXED_MODES))
def test_fixed_modes_match_their_definition(mode):
    q, d = _features(7, seed=1), _features(11, seed=2)
    torch.testing.assert_close(Scorer(mode)(q, d), _reference(mode, q, d), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", list(FIXED_MODES))
def test_learnable_at_corner_equals_fixed_mode(mode):
    q, d = _features(7, seed=3), _features(9, seed=4)
    learnable = Scorer("learnable", *FIXED_MODES[mode])
    assert torch.equal(learnable(q, d), Scorer(mode)(q, d))


def test_gradients_reach_both_exponents():
    q, d = _features(5, seed=5), _features(6, seed=6)
    scorer = Scorer("learnable", 0.3, 0.8)
    scorer(q, d).logsumexp(dim=1).sum().backward()
    for p in (scorer.gamma_q_param, scorer.gamma_d_param):
        assert p.grad is not None and torch.isfinite(p.grad) and p.grad.abs() > 0


@pytest.mark.parametrize("corner", [(1.0, 1.0), (0.0, 0.0)])
def test_gradients_flow_at_the_corners(corner):
    scorer = Scorer("learnable", *corner)
    scorer(_features(4, seed=7), _features(4, seed=8)).sum().backward()
    assert scorer.gamma_q_param.grad.abs() > 0 and scorer.gamma_d_param.grad.abs() > 0


def test_project_clips_into_unit_interval():
    scorer = Scorer("learnable", 0.5, 0.5)
    with torch.no_grad():
        scorer.gamma_q_param.fill_(1.7)
        scorer.gamma_d_param.fill_(-0.2)
    scorer.project_()
    assert (scorer.gamma_q, scorer.gamma_d) == (1.0, 0.0)


def test_single_query_ranking_qnorm_like_dot_dnorm_like_cosine():
    docs = _features(200, seed=9)
    for i, query in enumerate(_features(10, seed=10)):
        q = query.unsqueeze(0)
        assert torch.equal(Scorer("qnorm")(q, docs).argsort(descending=True), Scorer("dot")(q, docs).argsort(descending=True)), i
        assert torch.equal(Scorer("dnorm")(q, docs).argsort(descending=True), Scorer("cosine")(q, docs).argsort(descending=True)), i
    # and the raw document side really changes the ranking (the property is not vacuous)
    q = _features(1, seed=11)
    assert not torch.equal(Scorer("qnorm")(q, docs).argsort(), Scorer("cosine")(q, docs).argsort())


def test_scores_are_float32_under_bf16_autocast():
    q, d = _features(4).bfloat16(), _features(5).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        s = Scorer("qnorm")(q, d)
    assert s.dtype == torch.float32


def test_state_dict_keeps_learned_gammas():
    a = Scorer("learnable", 0.2, 0.9)
    b = Scorer("learnable")
    b.load_state_dict(a.state_dict())
    assert (b.gamma_q, b.gamma_d) == pytest.approx((0.2, 0.9))
    assert Scorer("cosine").state_dict() == {}


@pytest.mark.parametrize("args, match", [
    (("cosin",), "unknown scoring mode 'cosin'; allowed: cosine, dot"),
    (("qnorm", 0.5), "mode 'qnorm' fixes gamma_q=1.0"),
    (("learnable", 1.5), r"gamma_q must lie in \[0, 1\]"),
    (("fixed", 0.5), "mode 'fixed' needs both"),
])
def test_bad_arguments_are_named(args, match):
    with pytest.raises(ValueError, match=match):
        Scorer(*args)


def test_build_from_spec():
    assert Scorer.build("dnorm").mode == "dnorm"
    s = Scorer.build({"mode": "fixed", "gamma_q": 0.25, "gamma_d": 0.75})
    assert (s.gamma_q, s.gamma_d) == (0.25, 0.75)
    shared = Scorer("learnable")
    assert Scorer.build(shared) is shared
    with pytest.raises(ValueError, match="unknown scorer key"):
        Scorer.build({"mode": "dot", "gama_q": 1})


@pytest.mark.parametrize("scorer", [Scorer("qnorm"), Scorer("dnorm"), Scorer("cosine"), Scorer("learnable", 0.2, 0.9)])
def test_transposed_scores_the_other_way_round(scorer):
    q, d = _features(5, seed=12), _features(6, seed=13)
    torch.testing.assert_close(scorer.transposed()(d, q), scorer(q, d).T.detach())


def test_float64_features_stay_float64():
    q, d = _features(3).double(), _features(4).double()
    assert Scorer("qnorm")(q, d).dtype == torch.float64


def test_label_names_the_mode_and_free_exponents():
    assert Scorer("qnorm").label == "qnorm"
    assert Scorer("fixed", 0.25, 0.75).label == "fixed(0.25,0.75)"
    assert Scorer("learnable", 1.0, 1.0).label == "learnable(1,1)"


def test_one_factory_and_frozen_copies_keep_mode_exponents_and_label():
    from magclip.similarity import evaluation_scorers, frozen, make_scorer, resolve_specs

    with pytest.raises(ValueError, match="no mode has free exponents"):
        make_scorer("qnorm", 0.3, 0.3)
    qnorm, learnable = resolve_specs(["qnorm", "learnable"], 0.3, 0.3)  # one pair for the free modes
    assert (qnorm.gamma_q, qnorm.gamma_d, learnable.gamma_q, learnable.gamma_d) == (1.0, 0.0, 0.3, 0.3)
    trained = make_scorer("learnable", 0.5, 0.5)
    with torch.no_grad():
        trained.gamma_q_param.fill_(0.25)
    copy = frozen(trained)
    assert (copy.mode, copy.gamma_q, copy.gamma_d, copy.label) == ("learnable", 0.25, 0.5, trained.label)
    assert not any(p.requires_grad for p in copy.parameters())
    both = evaluation_scorers({"t2i": trained})  # the untrained direction: the trained score, transposed
    q, d = torch.randn(3, 4), torch.randn(5, 4)
    torch.testing.assert_close(both["i2t"](d, q), trained(q, d).T.detach())
    assert frozen(trained.to_dict()).label == copy.label  # from a checkpoint record: the same label
