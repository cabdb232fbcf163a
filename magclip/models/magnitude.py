"""A learned magnitude after pooling: the direction of the pooled vector, a norm from a small head.

Mean pooling averages n token states; where their directions spread, the mean's norm falls with n
(∝ n^-1/2 for independent directions), so under mean pooling a document's norm is a length prior by
construction. `LearnedMagnitude` keeps the pooled vector's direction and replaces its norm by
softplus(w·h + b), h the pooled vector: the norm then carries whatever the loss rewards (length, if it
pays; something else, if that pays more). It starts with w = 0 and softplus(b) = `init_norm`: every
text the same norm, so dot scores rank as cosine at step 0 and any norm signal is learned.

It is a sentence-transformers module (`sentence_transformers.base.modules.Module`): saved after Pooling
as `2_LearnedMagnitude/` (config.json + model.safetensors); sentence-transformers loads it as a custom
module where magclip is importable: `SentenceTransformer(path, trust_remote_code=True)` (modules.json names
`magclip.models.magnitude.LearnedMagnitude`, code outside sentence-transformers, which it runs only when told).
`MAGNITUDE_HEADS` maps the config's `model.magnitude` names to their classes (models/text.py appends one).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from sentence_transformers.base.modules.module import Module
from torch import Tensor, nn

POOLED = "sentence_embedding"   # sentence-transformers' features key of the pooled vector


def inverse_softplus(y: float) -> float:
    """The x with softplus(x) = y (y > 0)."""
    if y <= 0:
        raise ValueError(f"a norm must be > 0, got {y}")
    return y + math.log(-math.expm1(-y))


class LearnedMagnitude(Module):
    """features[sentence_embedding] ← unit(h) · softplus(w·h + b) (see the module docstring)."""

    config_keys: ClassVar[list[str]] = ["dimension", "init_norm"]

    def __init__(self, dimension: int, init_norm: float = 1.0):
        super().__init__()
        self.dimension = int(dimension)
        self.init_norm = float(init_norm)
        self.norm_head = nn.Linear(self.dimension, 1)
        nn.init.zeros_(self.norm_head.weight)
        nn.init.constant_(self.norm_head.bias, inverse_softplus(self.init_norm))

    def magnitude(self, pooled: Tensor) -> Tensor:
        """The learned norm [B] of each pooled vector (computed in float32: a bf16 softplus is coarse)."""
        return nn.functional.softplus(self.norm_head(pooled.float())).squeeze(-1)

    def forward(self, features: dict[str, Any], **kwargs) -> dict[str, Any]:
        pooled = features[POOLED]
        unit = nn.functional.normalize(pooled.float(), dim=-1)
        features[POOLED] = (unit * self.magnitude(pooled)[:, None]).to(pooled.dtype)
        return features

    def get_embedding_dimension(self) -> int:
        return self.dimension

    def save(self, output_path: str, *args, safe_serialization: bool = True, **kwargs) -> None:
        self.save_config(output_path)
        self.save_torch_weights(output_path, safe_serialization=safe_serialization)

    @classmethod
    def load(cls, model_name_or_path: str, subfolder: str = "", token: bool | str | None = None,
             cache_folder: str | None = None, revision: str | None = None, local_files_only: bool = False,
             **kwargs) -> LearnedMagnitude:
        hub = {"subfolder": subfolder, "token": token, "cache_folder": cache_folder, "revision": revision,
               "local_files_only": local_files_only}
        model = cls(**cls.load_config(model_name_or_path=model_name_or_path, **hub))
        return cls.load_torch_weights(model_name_or_path=model_name_or_path, model=model, **hub)


# model.magnitude (config) -> the head appended after pooling
MAGNITUDE_HEADS: dict[str, type[Module]] = {"learned": LearnedMagnitude}
# the modules.json type of each, so a saved folder's head is recognised as magclip's own (models/text.py)
MAGNITUDE_TYPES: dict[str, type[Module]] = {f"{c.__module__}.{c.__name__}": c for c in MAGNITUDE_HEADS.values()}


def magnitude_head(name: str, dimension: int) -> Module:
    """The head `model.magnitude` names, for `dimension`-wide pooled vectors."""
    if name not in MAGNITUDE_HEADS:
        raise ValueError(f"unknown magnitude head {name!r}; allowed: {', '.join(MAGNITUDE_HEADS)}")
    return MAGNITUDE_HEADS[name](dimension)

