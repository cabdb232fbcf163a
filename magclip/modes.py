"""The names and numbers of the scoring settings, free of torch.

A config is checked against these before torch, open_clip or a model is imported, so a typo in
`loss.i2t=qnrom` is reported in a fraction of a second. `magclip.similarity` (the Scorer) and
`magclip.temperature` (the logit scale) build on them; import them from there in model code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

FIXED_MODES: dict[str, tuple[float, float]] = {
    "cosine": (1.0, 1.0),
    "dot": (0.0, 0.0),
    "qnorm": (1.0, 0.0),
    "dnorm": (0.0, 1.0),
}
FREE_MODES = ("fixed", "learnable")  # the modes whose exponents are given (fixed) or trained (learnable)
MODES: tuple[str, ...] = (*FIXED_MODES, *FREE_MODES)
DIRECTIONS = ("i2t", "t2i")  # CLIP: image->text (the image is the query), text->image
LEARNABLE_INIT = (0.5, 0.5)

# Temperature constants (the rules that pick among them live in magclip.temperature).
CLIP_INIT_SCALE = 1 / 0.07        # open_clip's init for cosine
CLIP_MAX_SCALE = 100.0
TEXT_COSINE_SCALE = 20.0          # sentence-transformers' MultipleNegativesRankingLoss (temperature 0.05)
RAW_INIT_SCALE = 1.0              # any mode with a raw side
SIGLIP_INIT_SCALE = 10.0          # open_clip's SigLIP init (log scale log 10) for cosine
SIGLIP_INIT_BIAS = -10.0          # open_clip's SigLIP bias init: every pair starts as a confident negative
LOSS_TYPES = ("clip", "siglip")   # softmax per direction (CLIPLoss) / pairwise sigmoid (SigLIPLoss)


def check_mode(mode: str) -> str:
    """The mode name, or a ValueError that lists the allowed ones."""
    if mode not in MODES:
        raise ValueError(f"unknown scoring mode {mode!r}; allowed: {', '.join(MODES)}")
    return mode


def initial_exponents(mode: str, gamma_q: float | None, gamma_d: float | None) -> tuple[float, float]:
    """(gamma_q, gamma_d) a Scorer of `mode` starts at, or a ValueError naming the exponent that cannot be used.

    The fixed modes keep their corner; 'fixed' needs both exponents; 'learnable' starts at LEARNABLE_INIT
    unless given one; every exponent lies in [0, 1].
    """
    check_mode(mode)
    if mode in FIXED_MODES:
        fixed = FIXED_MODES[mode]
        for name, given, expected in (("gamma_q", gamma_q, fixed[0]), ("gamma_d", gamma_d, fixed[1])):
            if given is not None and float(given) != expected:
                raise ValueError(
                    f"mode {mode!r} fixes {name}={expected}, got {name}={given}; "
                    "use mode 'fixed' or 'learnable' for other exponents"
                )
        return fixed
    if mode == "fixed" and (gamma_q is None or gamma_d is None):
        raise ValueError("mode 'fixed' needs both gamma_q and gamma_d")
    gq = LEARNABLE_INIT[0] if gamma_q is None else float(gamma_q)
    gd = LEARNABLE_INIT[1] if gamma_d is None else float(gamma_d)
    for name, value in (("gamma_q", gq), ("gamma_d", gd)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must lie in [0, 1], got {value}")
    return gq, gd


@dataclass(frozen=True)
class ScorerSpec:
    """A similarity as plain data: the mode and its exponents. What a config, a command line or a
    checkpoint's record resolves to, before torch; `magclip.similarity.Scorer.from_spec` builds it.

    Two rules, one for each use, both in `resolve_specs`:
    - training: one exponent pair configures the free modes of a run (fixed: the exponents,
      learnable: its start, LEARNABLE_INIT when not given); corner modes keep their corner;
    - evaluation: nothing is trained, so a free mode needs both exponents (a learnable scorer is
      evaluated at a trained point, never at a default start).
    In both, exponents given where no mode can use them are an error."""

    mode: str
    gamma_q: float
    gamma_d: float

    @classmethod
    def from_record(cls, record: Mapping[str, Any], where: str = "scorer") -> "ScorerSpec":
        """A results or checkpoint record {"mode", "gamma_q", "gamma_d"}: the exponents it holds are the
        trained ones (a corner mode may omit them)."""
        unknown = set(record) - {"mode", "gamma_q", "gamma_d"}
        if unknown:
            raise ValueError(f"{where}: unknown scorer key(s) {sorted(unknown)}; allowed: mode, gamma_q, gamma_d")
        mode = record.get("mode", "cosine")
        try:
            check_mode(mode)
            gq, gd = initial_exponents(mode, record.get("gamma_q"), record.get("gamma_d"))
        except ValueError as exn:
            raise ValueError(f"{where}: {exn}") from None
        return cls(mode, gq, gd)

    @property
    def label(self) -> str:
        """Short name for tables and result keys: the mode, with the exponents when they are free."""
        if self.mode in FREE_MODES:
            return f"{self.mode}({self.gamma_q:.3g},{self.gamma_d:.3g})"
        return self.mode

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "gamma_q": self.gamma_q, "gamma_d": self.gamma_d}


def resolve_specs(modes: Sequence[str], gamma_q: float | None = None, gamma_d: float | None = None, *,
                  evaluation: bool = False, where: str = "mode") -> list[ScorerSpec]:
    """The one place that turns modes + one optional exponent pair into similarities (see ScorerSpec).

    `where` names the setting in errors (a config key such as "loss", or a flag such as "--mode")."""
    given = [name for name, value in (("gamma_q", gamma_q), ("gamma_d", gamma_d)) if value is not None]
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"{where}: unknown scoring mode {mode!r}; allowed: {', '.join(MODES)}")
    free = [m for m in modes if m in FREE_MODES]
    if given and not free:
        raise ValueError(f"{where}: {given[0]} is set but no mode has free exponents ({', '.join(modes)}); "
                         f"it applies to modes {' and '.join(repr(m) for m in FREE_MODES)}")
    if evaluation and free and len(given) < 2:
        raise ValueError(f"{where}: mode {free[0]!r} needs both gamma_q and gamma_d for evaluation (nothing is "
                         "trained there: give the point to score at, e.g. the trained exponents)")
    specs = []
    for mode in modes:
        try:
            gq, gd = initial_exponents(mode, gamma_q, gamma_d) if mode in FREE_MODES else FIXED_MODES[mode]
        except ValueError as exn:
            raise ValueError(f"{where}: {exn}") from None
        specs.append(ScorerSpec(mode, gq, gd))
    return specs
