"""The contrastive losses, each scoring with a `Scorer`: CLIPLoss (image<->text softmax, per direction),
SigLIPLoss (image-text pairwise sigmoid) and RetrievalLoss (query -> documents with in-batch and hard
negatives).

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
from magclip.config import SIGLIP_DIST_IMPLS
from magclip.similarity import Scorer


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
        return gather_pairs(image_features, text_features, self.gather_with_grad, self.local_loss)

    def scorer_state(self) -> dict[str, dict]:
        """Mode, exponents and weight per direction, for logs, results and checkpoints."""
        return {d: {**s.to_dict(), "weight": self.weights[d]} for d, s in self.scorers.items()}

    def project_(self) -> None:
        """Project learnable exponents into [0, 1]; call after each optimizer step."""
        for scorer in self.scorers.values():
            scorer.project_()


def gather_pairs(image_features: torch.Tensor, text_features: torch.Tensor, with_grad: bool,
                 local_loss: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's *raw* image and text features, in rank order (the Scorer is applied after this)."""
    if distributed.world_size() == 1:
        return image_features, text_features
    if with_grad:
        return distributed.all_gather_with_grad(image_features), distributed.all_gather_with_grad(text_features)
    keep_local = not local_loss  # open_clip: local queries already carry the local graph
    return (distributed.all_gather_no_grad(image_features, keep_local),
            distributed.all_gather_no_grad(text_features, keep_local))


class SigLIPLoss(nn.Module):
    """SigLIP's pairwise sigmoid loss (open_clip's `SigLipLoss`), scoring with any Scorer.

    Inputs: raw image and text features [B, D] of this rank, the logit scale (exponentiated) and the
    logit bias (scalar tensors). Output: a dict with `loss` and `acc_i2t` (in-batch top-1 of the
    image rows).

        s(image, text) = < image / ||image||^γ_image , text / ||text||^γ_text >   (the image is the query)
        logits = scale * s + bias,  labels = +1 for a matching pair, -1 for every other pair
        loss = - sum_pairs log sigmoid(labels * logits) / number of image rows

    The sigmoid loss has no directions: one score matrix, one binary decision per pair. The only
    asymmetry it can have is which side keeps its magnitude: the Scorer's corners with the image as
    query are cosine (both normalized), dot (both raw), qnorm (image normalized, text raw: the text
    keeps its magnitude), dnorm (text normalized, image raw), fixed/learnable (any point between).

    Distributed, `dist_impl` (open_clip's names and default):
    - 'bidir' / 'shift' / 'reduce': this rank's images against each rank's texts, one [b, b] block at
      a time, the texts passed round the ring both ways / one way / broadcast by all-reduce
      (`distributed.exchanged_blocks`); no rank gathers every feature, and no rank builds more than
      this rank's rows of the matrix. Texts are prepared (`prepare_docs`) before they travel, as
      open_clip normalizes before its exchange: exact, since the preparation is per row, and a
      received block is then held once, prepared, rather than raw and prepared (a third less
      memory per block, benchmarks/README.md). A learnable γ_text gets its gradient back through the
      exchange, on the rank that prepared the texts: per rank it differs from the gather's, its mean
      over ranks (what DDP applies) is the same. Always with gradient (open_clip's exchange has no
      detached form).
      `local_loss=True` is open_clip's SigLipLoss: each rank returns its rows' loss / b, and DDP's
      averaging makes the global-batch gradient. `local_loss=False` reports the global-batch loss
      (and accuracy) on every rank, as the gather's global matrix does, by one scalar all-reduce; its
      gradient is still the local form's (the same after DDP's average).
    - 'gather': raw features gathered with autograd, scored after the gather; `local_loss=True` (this
      rank's images against every rank's texts, / b) or `local_loss=False` (the whole global matrix on
      every rank, / B). `gather_with_grad=False` gathers other ranks' features detached (the local
      slice keeps its graph).
    Every form gives every rank the exact gradient of the global-batch loss once DDP averages
    gradients (tested on 2 and 4 processes against each other and open_clip's SigLipLoss).

    When to use: the other contrastive family, to ask whether the magnitude question changes when
    the loss is pairwise rather than a softmax over the batch.
    """

    def __init__(self, scorer: str | Scorer | Mapping = "cosine", local_loss: bool = True,
                 gather_with_grad: bool = True, dist_impl: str = "bidir"):
        super().__init__()
        if dist_impl not in SIGLIP_DIST_IMPLS:
            raise ValueError(f"dist_impl={dist_impl!r}; allowed: {', '.join(SIGLIP_DIST_IMPLS)}")
        if not gather_with_grad and dist_impl != "gather":
            raise ValueError(f"gather_with_grad=False needs dist_impl='gather', got {dist_impl!r}: "
                             "the neighbour exchange always carries the gradient")
        self.scorers = nn.ModuleDict({"i2t": Scorer.build(scorer)})
        self.local_loss = local_loss
        self.gather_with_grad = gather_with_grad
        self.dist_impl = dist_impl

    @property
    def scorer(self) -> Scorer:
        return self.scorers["i2t"]

    def forward(self, image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
                logit_bias: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        if logit_bias is None:
            raise ValueError("the sigmoid loss needs a logit bias")
        if self.dist_impl == "gather":
            return self._gathered(image_features, text_features, logit_scale, logit_bias)
        return self._exchanged(image_features, text_features, logit_scale, logit_bias)

    def _gathered(self, image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
                  logit_bias: torch.Tensor) -> dict[str, torch.Tensor]:
        """The whole [b or B, B] matrix at once. Texts are documents only: their local slice keeps its graph
        even when the others arrive detached (or the text tower would get no gradient at all)."""
        images = image_features if self.local_loss else _gather_siglip(image_features, self.gather_with_grad)
        all_texts = _gather_siglip(text_features, self.gather_with_grad)
        offset = distributed.rank() * image_features.shape[0] if self.local_loss else 0
        logits = CLIPLoss.logits(self.scorer, images, all_texts, logit_scale, logit_bias)
        targets = torch.arange(images.shape[0], device=logits.device) + offset
        labels = -torch.ones_like(logits)
        labels[torch.arange(images.shape[0], device=logits.device), targets] = 1.0
        loss = -F.logsigmoid(labels * logits).sum() / images.shape[0]
        acc = (logits.detach().argmax(dim=1) == targets).float().mean()
        return {"loss": loss, "acc_i2t": acc}

    def _exchanged(self, image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
                   logit_bias: torch.Tensor) -> dict[str, torch.Tensor]:
        """This rank's rows, one [b, b] block per rank's texts, each scored as it arrives."""
        me, n = distributed.rank(), image_features.shape[0]
        top1 = _BlockwiseTop1(me)
        loss = image_features.new_zeros((), dtype=torch.float32)
        with torch.autocast(device_type=image_features.device.type, enabled=False):
            queries = self.scorer.prepare_queries(image_features)
            docs = self.scorer.prepare_docs(text_features)  # before the exchange: see the class docstring
            scale, bias = logit_scale.float(), logit_bias.float()
            for source, block in distributed.exchanged_blocks(docs, self.dist_impl):
                logits = scale * (queries @ block.T) + bias
                loss = loss + _block_loss(logits, matching=source == me) / n
                top1.add(source, logits.detach())
        acc = top1.rate()
        if self.local_loss or distributed.world_size() == 1:
            return {"loss": loss, "acc_i2t": acc}
        # the global-batch value (ranks hold equal batches: the mean of the ranks' values), local gradient
        return {"loss": distributed.mean_over_ranks(loss) + (loss - loss.detach()),
                "acc_i2t": distributed.mean_over_ranks(acc)}

    def scorer_state(self) -> dict[str, dict]:
        """The one scorer (image = query), recorded as the i2t direction: evaluation scores text->image
        with it transposed (`similarity.evaluation_scorers`)."""
        return {"i2t": {**self.scorer.to_dict(), "weight": 1.0}}

    def project_(self) -> None:
        self.scorer.project_()


def _gather_siglip(x: torch.Tensor, with_grad: bool) -> torch.Tensor:
    """Every rank's raw `x`; without grad the local slice still carries its own."""
    if with_grad:
        return distributed.all_gather_with_grad(x)
    return distributed.all_gather_no_grad(x, keep_local_grad=True)


def _block_loss(logits: torch.Tensor, matching: bool) -> torch.Tensor:
    """-sum log sigmoid(labels * logits) of one block: labels -1, +1 on the diagonal of the block of matching
    pairs (open_clip's `get_ground_truth`); a block of other ranks' texts holds negatives only."""
    if not matching:
        return -F.logsigmoid(-logits).sum()
    labels = 2 * torch.eye(logits.shape[0], device=logits.device, dtype=logits.dtype) - 1
    return -F.logsigmoid(labels * logits).sum()


class _BlockwiseTop1:
    """In-batch top-1 of the image rows from blocks arriving in any order, exactly as argmax over the
    gathered row counts it: the first maximum wins, so a tie in an earlier rank's block beats the match."""

    def __init__(self, me: int):
        self.me = me
        self.hits: torch.Tensor | None = None      # the matching block's argmax is its diagonal
        self.matching: torch.Tensor | None = None  # the matching pairs' logits
        self.before: torch.Tensor | None = None    # row maxima over lower ranks' blocks
        self.after: torch.Tensor | None = None     # row maxima over higher ranks' blocks

    def add(self, source: int, logits: torch.Tensor) -> None:
        if source == self.me:
            rows = torch.arange(logits.shape[0], device=logits.device)
            self.hits, self.matching = logits.argmax(dim=1) == rows, logits.diagonal()
        elif source < self.me:
            self.before = _running_max(self.before, logits)
        else:
            self.after = _running_max(self.after, logits)

    def rate(self) -> torch.Tensor:
        hits = self.hits
        if self.before is not None:
            hits = hits & (self.matching > self.before)
        if self.after is not None:
            hits = hits & (self.matching >= self.after)
        return hits.float().mean()


def _running_max(held: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor:
    best = logits.max(dim=1).values
    return best if held is None else torch.maximum(held, best)


class RetrievalLoss(nn.Module):
    """contrastive query -> document loss with in-batch and hard negatives, any Scorer.
    Inputs
        queries: raw query embeddings [B, D] of this rank.
        docs:    raw document embeddings [B * G, D] of this rank, in groups of G = `group_size`:
                 docs[i*G] is query i's positive, docs[i*G+1 : (i+1)*G] its hard negatives.
        logit_scale: scalar tensor (already exponentiated).
    Output
        dict with `loss` and, per present term, `loss_q2d` / `acc_q2d` (and `loss_d2q` / `acc_d2q`).

    query -> document (always): each query is scored against every document of the global batch:
    its own positive and hard negatives, and every other query's positive and hard negatives on all
    ranks. logits = scale * S(q, all_docs); the target is the position of the query's positive in
    the gathered document list, (rank * B + i) * G.

    document -> query (`doc_to_query=True`): each positive document is scored against every query of
    the global batch, s(q_j, d_i) with the *same* Scorer (the query keeps its query-side exponent), and
    the target is its own query. Hard negatives are not anchors here.

    loss = (w_q2d * L_q2d + w_d2q * L_d2q) / (w_q2d + w_d2q), the d2q term only when enabled.

    Distributed: raw features are gathered with autograd (`magclip.distributed.all_gather_with_grad`),
    the Scorer is applied after the gather (so learnable exponents see every rank's norms). With
    `local_loss=True` (default) this rank's queries (and positives, for d2q) are the anchors and the
    targets are offset by rank; with `local_loss=False` every rank computes the full global loss. As in
    CLIPLoss, both give every rank the exact gradient of the global-batch loss once DDP averages
    gradients. Logits and the softmax are computed in float32 with autocast disabled.

    When to use: bi-encoder fine-tuning (sentence-transformers' MultipleNegativesRankingLoss /
    tevatron's contrastive loss) with a chosen similarity. With cosine, doc_to_query=True and
    group_size=1 it is sentence-transformers' MultipleNegativesSymmetricRankingLoss at scale 20 except
    that the d2q term here includes every query of the batch on all ranks.
    """

    def __init__(self, scorer: "str | Scorer | Mapping" = "cosine", group_size: int = 1, doc_to_query: bool = False,
                 q2d_weight: float = 1.0, d2q_weight: float = 1.0, local_loss: bool = True,
                 gather_with_grad: bool = True):
        super().__init__()
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1 (1 positive + group_size-1 hard negatives), got {group_size}")
        if q2d_weight < 0 or d2q_weight < 0:
            raise ValueError("loss weights must be >= 0")
        if q2d_weight + (d2q_weight if doc_to_query else 0.0) <= 0:
            raise ValueError("the active loss terms have zero total weight")
        self.scorer = Scorer.build(scorer)
        self.group_size = int(group_size)
        self.doc_to_query = bool(doc_to_query)
        self.q2d_weight = float(q2d_weight)
        self.d2q_weight = float(d2q_weight)
        self.local_loss = bool(local_loss)
        self.gather_with_grad = bool(gather_with_grad)

    def forward(self, queries: torch.Tensor, docs: torch.Tensor, logit_scale: torch.Tensor) -> dict[str, torch.Tensor]:
        b, g = queries.shape[0], self.group_size
        if docs.shape[0] != b * g:
            raise ValueError(f"expected {b} x group_size {g} = {b * g} documents, got {docs.shape[0]}")
        all_q, all_d = self._gather(queries), self._gather(docs)
        offset = distributed.rank() * b if self.local_loss else 0
        anchors_q = queries if self.local_loss else all_q
        n_anchor = anchors_q.shape[0]
        device = queries.device

        out: dict[str, torch.Tensor] = {}
        with torch.autocast(device_type=device.type, enabled=False):
            scale = logit_scale.float()
            logits = scale * self.scorer(anchors_q, all_d)                        # [n_anchor, W*B*G]
            targets = (torch.arange(n_anchor, device=device) + offset) * g
            loss = F.cross_entropy(logits, targets)
            out["loss_q2d"] = loss
            out["acc_q2d"] = (logits.detach().argmax(dim=1) == targets).float().mean()
            total = self.q2d_weight * loss
            weight = self.q2d_weight
            if self.doc_to_query:
                positives = docs[::g] if self.local_loss else all_d[::g]            # [n_anchor, D]
                logits_d = (scale * self.scorer(all_q, positives)).T                # s(q_j, d_i) -> [n_anchor, W*B]
                targets_d = torch.arange(n_anchor, device=device) + offset
                loss_d = F.cross_entropy(logits_d, targets_d)
                out["loss_d2q"] = loss_d
                out["acc_d2q"] = (logits_d.detach().argmax(dim=1) == targets_d).float().mean()
                total = total + self.d2q_weight * loss_d
                weight += self.d2q_weight
        out["loss"] = total / weight
        return out

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        if distributed.world_size() == 1:
            return x
        if self.gather_with_grad:
            return distributed.all_gather_with_grad(x)
        # the local slice keeps its graph: documents reach the loss only through the gathered list
        return distributed.all_gather_no_grad(x, keep_local_grad=True)

    def scorer_state(self) -> dict[str, float | str]:
        return self.scorer.to_dict()

    def project_(self) -> None:
        self.scorer.project_()
