"""The one similarity used by every loss, evaluator, index and diagnostic in magclip.

    s(q, d) = < q / ||q||^gamma_q , d / ||d||^gamma_d >

Each side is scaled on its own (`prepare_queries`, `prepare_docs`) so that the score is a plain
inner product of prepared vectors: any index (torch top-k, faiss IndexFlatIP) run on prepared
vectors ranks exactly as training scored. The fixed modes are the corners of the learnable one.

| mode      | gamma_q | gamma_d |
|-----------|---------|---------|
| cosine    | 1       | 1       |
| dot       | 0       | 0       |
| qnorm     | 1       | 0       |   keeps the document magnitude
| dnorm     | 0       | 1       |   keeps the query magnitude
| fixed     | given   | given   |   any point of [0,1]^2, not trained
| learnable | init    | init    |   trained, projected back into [0,1] after each step

Learnable exponents are stored directly (not through a sigmoid) and projected onto [0, 1] by
`project_()` after every optimizer step (projected gradient descent), so a learnable scorer can
sit exactly at a corner and equal the fixed mode there; a sigmoid never reaches 0 or 1.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from magclip.modes import (
    DIRECTIONS,
    FIXED_MODES,
    LEARNABLE_INIT,
    MODES,
    ScorerSpec,
    check_mode,
    initial_exponents,
    resolve_specs,
)

__all__ = ["DIRECTIONS", "FIXED_MODES", "LEARNABLE_INIT", "MODES", "NORM_EPS", "Scorer", "ScorerSpec", "check_mode",
           "evaluation_scorers", "frozen", "make_scorer", "resolve_specs"]

# Norms are clamped here before being raised to a power; small enough that features of norm 1e-4
# keep their direction, large enough that 1 / eps stays finite in float32.
NORM_EPS = 1e-12


class Scorer(nn.Module):
    """Scores queries against documents with per-side norm exponents (see module docstring).

    Scores are computed in float32 with autocast disabled, so bf16/fp16 training cannot round
    away the magnitude that the raw modes keep.
    """

    def __init__(self, mode: str = "cosine", gamma_q: float | None = None, gamma_d: float | None = None):
        super().__init__()
        self.mode = check_mode(mode)
        gq, gd = initial_exponents(self.mode, gamma_q, gamma_d)
        if self.mode == "learnable":
            self.gamma_q_param = nn.Parameter(torch.tensor(gq, dtype=torch.float32))
            self.gamma_d_param = nn.Parameter(torch.tensor(gd, dtype=torch.float32))
        else:
            self.register_buffer("gamma_q_param", torch.tensor(gq, dtype=torch.float32), persistent=False)
            self.register_buffer("gamma_d_param", torch.tensor(gd, dtype=torch.float32), persistent=False)

    @classmethod
    def from_spec(cls, spec: ScorerSpec) -> "Scorer":
        return cls(spec.mode, spec.gamma_q, spec.gamma_d)

    @classmethod
    def build(cls, spec: "str | Scorer | ScorerSpec | Mapping[str, Any]") -> "Scorer":
        """A Scorer from a mode name, a ScorerSpec, a record (`{"mode": ..., "gamma_q": ..., "gamma_d": ...}`)
        or itself."""
        if isinstance(spec, Scorer):
            return spec
        if isinstance(spec, str):
            return cls(spec)
        if isinstance(spec, ScorerSpec):
            return cls.from_spec(spec)
        if isinstance(spec, Mapping):
            return cls.from_spec(ScorerSpec.from_record(spec))
        raise TypeError(f"cannot build a Scorer from {type(spec).__name__}: {spec!r}")

    @property
    def spec(self) -> ScorerSpec:
        """The mode and the current exponents, as plain data."""
        return ScorerSpec(self.mode, self.gamma_q, self.gamma_d)

    @property
    def learnable(self) -> bool:
        return self.mode == "learnable"

    @property
    def gamma_q(self) -> float:
        return float(self.gamma_q_param.detach().clamp(0.0, 1.0))

    @property
    def gamma_d(self) -> float:
        return float(self.gamma_d_param.detach().clamp(0.0, 1.0))

    def prepare_queries(self, x: torch.Tensor) -> torch.Tensor:
        """Query vectors scaled by ||q||^-gamma_q, in float32."""
        return _scale_by_norm(x, self.gamma_q_param)

    def prepare_docs(self, x: torch.Tensor) -> torch.Tensor:
        """Document vectors scaled by ||d||^-gamma_d, in float32."""
        return _scale_by_norm(x, self.gamma_d_param)

    def forward(self, queries: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
        """[Nq, Nd] scores: inner products of prepared queries and prepared documents."""
        with torch.autocast(device_type=queries.device.type, enabled=False):
            return self.prepare_queries(queries) @ self.prepare_docs(docs).T

    @torch.no_grad()
    def project_(self) -> None:
        """Clip learnable exponents back into [0, 1]; call after every optimizer step."""
        if self.learnable:
            self.gamma_q_param.clamp_(0.0, 1.0)
            self.gamma_d_param.clamp_(0.0, 1.0)

    def transposed(self) -> "Scorer":
        """The same score with the roles swapped: s'(d, q) = s(q, d). qnorm <-> dnorm; exponents frozen.

        Used to score the direction a run did not train (e.g. text->image after an image->text-only
        run) with the similarity it did train, each modality keeping its own exponent.
        """
        swapped = {"qnorm": "dnorm", "dnorm": "qnorm", "cosine": "cosine", "dot": "dot"}
        if self.mode in swapped:
            return Scorer(swapped[self.mode])
        return Scorer("fixed", self.gamma_d, self.gamma_q)

    def to_dict(self) -> dict[str, Any]:
        """Mode and current exponents: what a results file or checkpoint records."""
        return self.spec.to_dict()

    @property
    def label(self) -> str:
        """Short name for tables and result keys (ScorerSpec.label)."""
        return self.spec.label

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, gamma_q={self.gamma_q:.4f}, gamma_d={self.gamma_d:.4f}"


def make_scorer(mode: str, gamma_q: float | None = None, gamma_d: float | None = None) -> Scorer:
    """The trained Scorer of one mode (`resolve_specs`' training rule: the exponents configure 'fixed' and
    'learnable'; given to a corner mode they are an error)."""
    return Scorer.from_spec(resolve_specs([mode], gamma_q, gamma_d)[0])


def frozen(scorer: "Scorer | ScorerSpec | str | Mapping[str, Any]") -> Scorer:
    """A copy for evaluation: the same mode and exponents (a learnable one keeps its label and its
    trained point), trained no further."""
    return Scorer.from_spec(Scorer.build(scorer).spec).requires_grad_(False)


def evaluation_scorers(trained: Mapping[str, "Scorer | ScorerSpec | Mapping[str, Any]"]) -> dict[str, Scorer]:
    """Frozen Scorers for both CLIP directions from the trained ones ("i2t" and/or "t2i"): a
    direction the run did not train scores with the trained one's similarity, transposed."""
    unknown = set(trained) - set(DIRECTIONS)
    if unknown or not trained:
        raise ValueError(f"scorers must hold 'i2t' and/or 't2i', got {sorted(trained)}")
    out = {d: frozen(s) for d, s in trained.items()}
    for direction, other in (("i2t", "t2i"), ("t2i", "i2t")):
        if direction not in out:
            out[direction] = out[other].transposed().requires_grad_(False)
    return {d: out[d] for d in DIRECTIONS}


def _scale_by_norm(x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """x / ||x||^gamma in float32; exact x / ||x|| at gamma=1 and exact x at gamma=0."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        x = x.to(torch.promote_types(x.dtype, torch.float32))  # float32 at least; float64 stays
        norm = x.norm(dim=-1, keepdim=True).clamp_min(NORM_EPS)
        return x / norm.pow(_clip_unit(gamma).to(x.device))


def _clip_unit(gamma: torch.Tensor) -> torch.Tensor:
    """gamma clipped into [0, 1] in value, with an identity gradient.

    torch.clamp has zero gradient *at* its bounds, which would freeze a learnable exponent sitting
    exactly at a corner (e.g. initialised at cosine); `project_()` keeps the parameter in range.
    """
    return gamma + (gamma.clamp(0.0, 1.0) - gamma).detach()
