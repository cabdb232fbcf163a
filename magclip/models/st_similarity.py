"""The scoring mode a sentence-transformers folder asks for (`similarity_fn_name` in
config_sentence_transformers.json), as magclip scores a model evaluated without --mode.

sentence-transformers scores with cosine (its default), dot, euclidean or manhattan (the negative
distances). magclip's modes express two of them, and a third where the model normalizes:

| similarity_fn_name | the model ends in Normalize | scored without --mode as |
|---|---|---|
| cosine (or none)   | either                      | cosine |
| dot                | no                          | dot |
| dot                | yes                         | cosine (equal on unit vectors) |
| euclidean          | yes                         | cosine: -‖q-d‖ = -sqrt(2 - 2 cos) ranks every query's documents as cosine does |
| euclidean          | no                          | refused without --mode |
| manhattan, other   | either                      | refused without --mode |

A refusal is one line naming the file and the value (`similarity_refusal`); the folder still loads
(training names its own loss.mode, and --mode scores it any way asked).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("magclip.text")

GAMMAS = {"cosine": (1.0, 1.0), "dot": (0.0, 0.0)}


def _scorer(mode: str) -> dict[str, Any]:
    return {"mode": mode, "gamma_q": GAMMAS[mode][0], "gamma_d": GAMMAS[mode][1]}


def folder_scorer(similarity: str | None, normalize: bool, config_file: Path) -> tuple[dict[str, Any], str | None]:
    """(the scorer for a folder's similarity, None) or (cosine as a placeholder, the one-line refusal that an
    evaluation without --mode raises)."""
    sim = similarity or "cosine"
    if sim == "cosine" or (normalize and sim == "dot"):
        return _scorer("cosine"), None
    if sim == "dot":
        return _scorer("dot"), None
    if sim == "euclidean" and normalize:
        log.info("%s: similarity_fn_name='euclidean' on normalized vectors, scored as cosine (the same ranking)",
                 config_file)
        return _scorer("cosine"), None
    why = ("on vectors the model does not normalize, a distance" if sim == "euclidean"
           else "a distance" if sim == "manhattan" else "a similarity sentence-transformers does not define")
    return _scorer("cosine"), (
        f"{config_file}: similarity_fn_name={sim!r} is {why} that no magclip mode expresses; pass --mode "
        "(cosine, dot, qnorm, dnorm, fixed) to say how to score this model")
