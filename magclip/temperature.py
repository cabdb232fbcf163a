"""The logit scale (inverse temperature) that multiplies every score before the softmax.

Stored as a log-scale, like open_clip's `logit_scale`, and clipped after every optimizer step
(open_clip clamps to [0, ln 100] in its train loop); `forward()` returns the scale itself.

Every temperature default of magclip is decided here (`default_logit_scale`), so that the CLIP
and text trainers and the Fisher diagnostic start each mode alike:

| trained modes                  | init              | learnable | max  | why |
|--------------------------------|-------------------|-----------|------|-----|
| all cosine                     | the task's cosine | yes       | 100  | CLIP: 1 / 0.07 (open_clip); text: 20 |
|                                | scale             |           |      | (sentence-transformers' MNRL); scores in [-1, 1] |
| any with a raw side (dot,      | 1.0               | yes       | 100  | a raw side's magnitude already acts as a |
| qnorm, dnorm, fixed, learnable)|                   |           |      | temperature; CLIP's 14.3 on top of norms of |
|                                |                   |           |      | several units saturates the softmax at step 0 |

A fixed scale of 1 under-trains the raw modes when norms stay small, so the scale stays learnable
by default.

The sigmoid loss (SigLIP) has a learnable logit bias as well (`LogitBias`): cosine starts at open_clip's
SigLIP point (scale 10, bias -10); a mode with a raw side starts at cosine's *effective* temperature
(`starts_from_norms`: the scale is set on the first batch so that scale x E||image||^(1-g) x
E||text||^(1-g) = 10) with the same bias -10. Measured (configs/compare/siglip_synthetic.yaml, 2
seeds): started at scale 1 instead, dot, qnorm and dnorm lost to siglip cosine by 2-13 R@1 points;
started matched, each was above its scale-1 run in all 12 (mode, metric) cells and level with or
above cosine on image->text (R@10 +4.4 and +5.7, decided, for qnorm and dot) -- at scale 1 their
initial norms (several units) made the logits several times sharper than cosine's. The bias is a
prior in logit units: at the start a pair's score is about 0 whatever the mode (random features), so
-10 makes every pair a confident negative (sigmoid(-10) = 4.5e-5) in every mode alike; it ended
between -10.34 and -9.94 in every measured run (the synthetic and emoji grids, every mode), so it
needs no per-mode value.

`match_cosine_temperature` gives every mode the same *effective* starting temperature (a run's
`logit_scale_from_norms`): the scale is set so that scale * E[||q||^(1-gq)] * E[||d||^(1-gd)] equals
the cosine scale.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from magclip.modes import (  # noqa: F401
    CLIP_INIT_SCALE,
    CLIP_MAX_SCALE,
    RAW_INIT_SCALE,
    SIGLIP_INIT_BIAS,
    SIGLIP_INIT_SCALE,
    TEXT_COSINE_SCALE,
)
from magclip.similarity import Scorer

log = logging.getLogger("magclip.temperature")



@dataclass(frozen=True)
class ScaleDefaults:
    init: float
    learnable: bool
    max: float | None


def cosine_scale_for(loss_type: str) -> float:
    """The scale cosine starts at with this CLIP loss type (clip: 1/0.07; siglip: 10); the raw modes'
    defaults and `match_cosine_temperature` are relative to it."""
    return SIGLIP_INIT_SCALE if loss_type == "siglip" else CLIP_INIT_SCALE


def starts_from_norms(loss_type: str, modes: str | Iterable[str], configured: bool | None = None) -> bool:
    """Whether the run's scale is set from the first batch's norms (`match_cosine_temperature`):
    `configured` when the config says so, else the measured default -- yes for the sigmoid loss with a
    raw side (see the module docstring), no otherwise (the softmax loss keeps scale 1 for raw modes)."""
    if configured is not None:
        return configured
    modes = {modes} if isinstance(modes, str) else set(modes)
    return loss_type == "siglip" and modes != {"cosine"}


def default_logit_scale(modes: str | Iterable[str], cosine_scale: float = CLIP_INIT_SCALE) -> ScaleDefaults:
    """The defaults for a run that trains `modes` (one mode or every direction's): cosine's scale
    (`cosine_scale`: CLIP's 1/0.07, or the text path's 20) only when every mode is cosine."""
    modes = {modes} if isinstance(modes, str) else set(modes)
    init = cosine_scale if modes == {"cosine"} else RAW_INIT_SCALE
    return ScaleDefaults(init=float(init), learnable=True, max=CLIP_MAX_SCALE)


class LogitScale(nn.Module):
    """exp(log_scale), learnable or not, clipped to [min, max] by `project_()` after each step."""

    def __init__(self, init: float, learnable: bool = True, max_scale: float | None = CLIP_MAX_SCALE,
                 min_scale: float = 1e-4):
        super().__init__()
        if init <= 0:
            raise ValueError(f"logit scale init must be > 0, got {init}")
        if max_scale is not None and init > max_scale:
            raise ValueError(f"logit scale init {init} exceeds its max {max_scale}")
        self.max_scale = max_scale
        self.min_scale = min_scale
        self.log_scale = nn.Parameter(torch.tensor(math.log(init), dtype=torch.float32),
                                      requires_grad=learnable)

    @classmethod
    def for_mode(cls, modes: str | Iterable[str], init: float | None = None, learnable: bool | None = None,
                 max_scale: float | None = None, cosine_scale: float = CLIP_INIT_SCALE) -> "LogitScale":
        """A LogitScale with the defaults of `modes` (see `default_logit_scale`), each overridable."""
        d = default_logit_scale(modes, cosine_scale)
        return cls(init=d.init if init is None else init,
                   learnable=d.learnable if learnable is None else learnable,
                   max_scale=d.max if max_scale is None else max_scale)

    def forward(self) -> torch.Tensor:
        return self.log_scale.exp()

    @property
    def value(self) -> float:
        return float(self.log_scale.detach().exp())

    @torch.no_grad()
    def project_(self) -> None:
        """Clip into [min, max]; call after every optimizer step (open_clip does the same)."""
        hi = math.log(self.max_scale) if self.max_scale is not None else None
        self.log_scale.clamp_(min=math.log(self.min_scale), max=hi)

    @torch.no_grad()
    def set_(self, scale: float) -> None:
        self.log_scale.fill_(math.log(scale))

    def extra_repr(self) -> str:
        return f"scale={self.value:.4f}, learnable={self.log_scale.requires_grad}, max={self.max_scale}"


class LogitBias(nn.Module):
    """The sigmoid loss's learnable logit bias (open_clip's `logit_bias`): a scalar added to every logit."""

    def __init__(self, init: float = SIGLIP_INIT_BIAS, learnable: bool = True):
        super().__init__()
        self.bias = nn.Parameter(torch.tensor(float(init), dtype=torch.float32), requires_grad=learnable)

    def forward(self) -> torch.Tensor:
        return self.bias

    @property
    def value(self) -> float:
        return float(self.bias.detach())

    @torch.no_grad()
    def set_(self, bias: float) -> None:
        self.bias.fill_(bias)

    def extra_repr(self) -> str:
        return f"bias={self.value:.4f}, learnable={self.bias.requires_grad}"


def scale_matching_cosine(scorer: Scorer, queries: torch.Tensor, docs: torch.Tensor,
                          cosine_scale: float = CLIP_INIT_SCALE) -> float:
    """The scale at which `scorer` starts at the same effective temperature as cosine at `cosine_scale`.

    A prepared vector has norm ||x||^(1 - gamma); the typical score magnitude is the product of
    the mean prepared norms, so dividing the cosine scale by it equalises the starting logits.
    """
    if (scorer.gamma_q, scorer.gamma_d) == (1.0, 1.0):  # unit vectors: cosine's own scale, not a rounding of it
        return float(cosine_scale)
    with torch.no_grad():
        q = scorer.prepare_queries(queries).norm(dim=-1).mean()
        d = scorer.prepare_docs(docs).norm(dim=-1).mean()
    return float(cosine_scale / (q * d).clamp_min(1e-12))


@torch.no_grad()
def match_cosine_temperature(logit_scale: LogitScale, scorer: Scorer, queries: torch.Tensor, docs: torch.Tensor,
                             cosine_scale: float = CLIP_INIT_SCALE) -> float:
    """Set `logit_scale` (within its max) so that `scorer` starts at cosine's effective temperature on
    these features (a first batch); returns the scale."""
    scale = scale_matching_cosine(scorer, queries, docs, cosine_scale)
    if logit_scale.max_scale is not None:
        scale = min(scale, logit_scale.max_scale)
    logit_scale.set_(scale)
    log.info("logit scale set from initial norms: %.4f (cosine-equivalent %.4g)", scale, cosine_scale)
    return scale
