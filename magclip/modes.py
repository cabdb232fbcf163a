"""The names and numbers of the scoring settings, free of torch.

A config is checked against these before torch, open_clip or a model is imported, so a typo in
`loss.i2t=qnrom` is reported in a fraction of a second. `magclip.similarity` (the Scorer) and
`magclip.temperature` (the logit scale) build on them; import them from there in model code.
"""

from __future__ import annotations

FIXED_MODES: dict[str, tuple[float, float]] = {
    "cosine": (1.0, 1.0),
    "dot": (0.0, 0.0),
    "qnorm": (1.0, 0.0),
    "dnorm": (0.0, 1.0),
}
MODES: tuple[str, ...] = (*FIXED_MODES, "fixed", "learnable")
DIRECTIONS = ("i2t", "t2i")  # CLIP: image->text (the image is the query), text->image
LEARNABLE_INIT = (0.5, 0.5)

# Temperature constants (the rules that pick among them live in magclip.temperature).
CLIP_INIT_SCALE = 1 / 0.07        # open_clip's init for cosine
CLIP_MAX_SCALE = 100.0
TEXT_COSINE_SCALE = 20.0          # sentence-transformers' MultipleNegativesRankingLoss (temperature 0.05)
RAW_INIT_SCALE = 1.0              # any mode with a raw side


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
