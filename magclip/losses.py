"""Contrastive losses that score with a `Scorer` per direction.

CLIPLoss
    Inputs: raw (unnormalized) image and text features [B, D] of this rank, the logit scale
    (a scalar tensor, already exponentiated) and an optional logit bias.
    Output: a dict with `loss` (the weighted mean over directions that carry weight) and, per
    present direction, `loss_i2t` / `loss_t2i` and `acc_i2t` / `acc_t2i` (in-batch top-1).
    image->text: query = image, documents = texts. text->image: query = text, documents = images.

    loss = sum_dir w_dir * CE(scale * S_dir, targets) / sum_dir w_dir

    Symmetric: both directions, same mode, equal weights (cosine/cosine = open_clip's ClipLoss).
    Asymmetric: one direction (the other `None`), or different modes per direction. A direction
    with weight 0 is still computed and reported, without gradient, so it can be monitored.

    Distributed: *raw* features are gathered with autograd, the Scorer is applied after the
    gather (its exponents see every rank's norms), then either the full global matrix
    (`local_loss=False`, every rank computes the same loss) or open_clip's local form (this rank's
    queries against all documents, targets offset by rank). Both give every rank the exact
    gradient of the global-batch loss once DDP averages it. `gather_with_grad=False` is open_clip's
    cheaper option: other ranks' features arrive detached, so gradients only flow through the
    local slice and no longer equal the single-process gradient.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from magclip import distributed
from magclip.similarity import Scorer

DIRECTIONS = ("i2t", "t2i")


class CLIPLoss(nn.Module):
    def __init__(
        self,
        i2t: "str | Scorer | Mapping | None" = "cosine",
        t2i: "str | Scorer | Mapping | None" = "cosine",
        i2t_weight: float = 1.0,
        t2i_weight: float = 1.0,
        local_loss: bool = False,
        gather_with_grad: bool = True,
    ):
        super().__init__()
        specs = {"i2t": (i2t, i2t_weight), "t2i": (t2i, t2i_weight)}
        self.scorers = nn.ModuleDict({d: Scorer.build(s) for d, (s, _) in specs.items() if s is not None})
        if not self.scorers:
            raise ValueError("CLIPLoss needs at least one direction (i2t or t2i); both were None")
        self.weights = {d: float(w) for d, (s, w) in specs.items() if s is not None}
        if any(w < 0 for w in self.weights.values()) or sum(self.weights.values()) <= 0:
            raise ValueError(f"direction weights must be >= 0 with a positive sum, got {self.weights}")
        self.local_loss = local_loss
        self.gather_with_grad = gather_with_grad

    def forward(
        self,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale: torch.Tensor,
        logit_bias: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        all_images, all_texts = self._gather(image_features, text_features)
        n_local = image_features.shape[0]
        offset = distributed.rank() * n_local if self.local_loss else 0
        n_queries = n_local if self.local_loss else all_images.shape[0]
        targets = torch.arange(n_queries, device=image_features.device) + offset

        queries = {"i2t": image_features if self.local_loss else all_images,
                   "t2i": text_features if self.local_loss else all_texts}
        docs = {"i2t": all_texts, "t2i": all_images}

        out: dict[str, torch.Tensor] = {}
        total = image_features.new_zeros((), dtype=torch.float32)
        for direction, scorer in self.scorers.items():
            weight = self.weights[direction]
            with torch.set_grad_enabled(torch.is_grad_enabled() and weight > 0):
                logits = self.logits(scorer, queries[direction], docs[direction], logit_scale, logit_bias)
                loss = F.cross_entropy(logits, targets)
            out[f"loss_{direction}"] = loss
            out[f"acc_{direction}"] = (logits.detach().argmax(dim=1) == targets).float().mean()
            if weight > 0:
                total = total + weight * loss
        out["loss"] = total / sum(self.weights.values())
        return out

    @staticmethod
    def logits(scorer: Scorer, queries: torch.Tensor, docs: torch.Tensor, logit_scale: torch.Tensor,
               logit_bias: torch.Tensor | None = None) -> torch.Tensor:
        """scale * S(q, d) (+ bias) in float32, whatever autocast is active."""
        with torch.autocast(device_type=queries.device.type, enabled=False):
            logits = logit_scale.float() * scorer(queries, docs)
            if logit_bias is not None:
                logits = logits + logit_bias.float()
        return logits

    def _gather(self, image_features: torch.Tensor, text_features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if distributed.world_size() == 1:
            return image_features, text_features
        if self.gather_with_grad:
            return distributed.all_gather_with_grad(image_features), distributed.all_gather_with_grad(text_features)
        keep_local = not self.local_loss  # open_clip: local queries already carry the local graph
        return (distributed.all_gather_no_grad(image_features, keep_local),
                distributed.all_gather_no_grad(text_features, keep_local))

    def scorer_state(self) -> dict[str, dict]:
        """Mode, exponents and weight per direction, for logs, results and checkpoints."""
        return {d: {**s.to_dict(), "weight": self.weights[d]} for d, s in self.scorers.items()}

    def project_(self) -> None:
        """Project learnable exponents into [0, 1]; call after each optimizer step."""
        for scorer in self.scorers.values():
            scorer.project_()
