"""LogitScale: per-mode defaults, clipping like open_clip, and the norm-matched initial scale."""

import math

import pytest
import torch

from magclip import LogitScale, Scorer, default_logit_scale
from magclip.temperature import scale_matching_cosine


def test_cosine_default_is_clip_and_raw_modes_start_at_one():
    assert default_logit_scale("cosine").init == pytest.approx(1 / 0.07)
    for mode in ("dot", "qnorm", "dnorm", "learnable"):
        assert default_logit_scale(mode).init == 1.0 and default_logit_scale(mode).learnable


def test_project_clips_to_max_like_open_clip():
    scale = LogitScale(init=50.0, max_scale=100.0)
    with torch.no_grad():
        scale.log_scale.fill_(math.log(500.0))
    scale.project_()
    assert scale.value == pytest.approx(100.0)


def test_frozen_scale_gets_no_gradient():
    scale = LogitScale.for_mode("qnorm", learnable=False)
    assert not scale.log_scale.requires_grad


def test_bad_init_is_named():
    with pytest.raises(ValueError, match="exceeds its max"):
        LogitScale(init=200.0, max_scale=100.0)
    with pytest.raises(ValueError, match="must be > 0"):
        LogitScale(init=0.0)


@pytest.mark.parametrize("mode", ["dot", "qnorm", "dnorm"])
def test_norm_matched_scale_equalises_the_mean_logit_magnitude(mode):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(64, 16, generator=g) * 3.0
    d = torch.randn(64, 16, generator=g) * 0.5
    scorer = Scorer(mode)
    scale = scale_matching_cosine(scorer, q, d)
    prepared = scorer.prepare_queries(q).norm(dim=-1).mean() * scorer.prepare_docs(d).norm(dim=-1).mean()
    assert scale * float(prepared) == pytest.approx(1 / 0.07, rel=1e-5)
    assert scale_matching_cosine(Scorer("cosine"), q, d) == pytest.approx(1 / 0.07, rel=1e-5)


def test_every_default_comes_from_one_rule():
    from magclip.temperature import TEXT_COSINE_SCALE, default_logit_scale

    assert default_logit_scale(["cosine", "cosine"]).init == pytest.approx(1 / 0.07)
    assert default_logit_scale(["cosine", "qnorm"]).init == 1.0  # any raw side: the magnitude is a temperature
    assert default_logit_scale("cosine", TEXT_COSINE_SCALE).init == 20.0
    assert default_logit_scale("dot", TEXT_COSINE_SCALE).init == 1.0


def test_match_cosine_temperature_stays_within_the_cap():
    from magclip.temperature import match_cosine_temperature

    tiny = torch.full((4, 8), 1e-3)
    scale = LogitScale.for_mode("dot")
    assert match_cosine_temperature(scale, Scorer("dot"), tiny, tiny) == scale.max_scale == pytest.approx(scale.value)


def test_matching_cosine_is_exactly_cosines_scale_for_unit_vectors():
    """A recipe may set loss.logit_scale_from_norms for every mode: cosine then starts at its own scale
    exactly (20 for text), not at a float rounding of it."""
    q, d = torch.randn(8, 16) * 3, torch.randn(8, 16) * 5
    assert scale_matching_cosine(Scorer("cosine"), q, d, 20.0) == 20.0
    assert scale_matching_cosine(Scorer("learnable", 1.0, 1.0), q, d, 20.0) == 20.0
    assert scale_matching_cosine(Scorer("dot"), q, d, 20.0) != 20.0


def test_the_sigmoid_loss_starts_a_raw_side_at_cosines_effective_temperature_by_default():
    """The measured default (magclip/temperature.py): siglip with a raw side matches cosine's effective
    temperature on the first batch; siglip cosine and the softmax loss do not; a configured value wins."""
    from magclip.temperature import starts_from_norms

    assert starts_from_norms("siglip", "dot") and starts_from_norms("siglip", ["learnable"])
    assert not starts_from_norms("siglip", "cosine") and not starts_from_norms("clip", ["qnorm", "qnorm"])
    assert not starts_from_norms("siglip", "dot", configured=False) and starts_from_norms("clip", "dot", configured=True)
