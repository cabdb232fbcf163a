"""Empirical Fisher information of the contrastive log-likelihood per scoring mode: a predictor.

Before training, which similarity (e.g. qnorm or dnorm) will train better? The heuristic studied
here: the one whose Fisher information, at the starting point, is better conditioned.

What exactly is computed
------------------------
Data: a held-out batch of N matching pairs (query_i, doc_i), each doc the positive of its query
and a candidate (in-batch negative) for every other query. Parameters: a block theta of P
parameters (default: the final projection of each tower, `select_block`), flattened and
concatenated in `named_parameters` order; everything else is frozen. The model runs in eval mode
(BatchNorm uses running statistics, no dropout) and by default in float64.

For a mode m (Scorer s_m, s(q, d) = <q/|q|^gq, d/|d|^gd>) and a fixed logit scale t_m:

    l_i(theta) = log p(doc_i | query_i)
               = t_m s_m(q_i, d_i) - log sum_j exp(t_m s_m(q_i, d_j)),   j over the N batch docs

one term per *anchor row*. CLIP (`clip_fisher`): both directions by default, rows 1..N are
image->text (query = image) and rows N+1..2N text->image (query = text), each with mode m, as the
symmetric CLIPLoss scores them. Text (`text_fisher`): query->document rows; with
`doc_to_query=True` also document->query rows scored with the same s_m (RetrievalLoss's d2q term).

    g_r = d l_r / d theta            (one per row r; exact per-row gradients by autograd:
                                      a vmapped backward, `is_grads_batched`, or a loop)
    G   = [g_1; ...; g_R]            (R x P)
    F   = G^T G / R                  (P x P, the empirical Fisher)

Spectrum: when P > R the non-zero eigenvalues of F are those of the R x R Gram matrix
K = G G^T / R (same non-zero spectrum, since G^T G and G G^T share it), so K is decomposed
("gram" form); otherwise F itself ("direct" form). Both in float64 (`torch.linalg.eigvalsh`).
rank(F) <= min(R, P), so F always has a null space when P > R: the condition number is taken
over the NON-NULL spectrum,

    non-null = { lambda : lambda > rtol * lambda_max },   kappa = lambda_max / min(non-null)

with rtol = 1000 * R * eps by default, eps the machine epsilon of the gradients' dtype (R = 256
rows: 5.7e-11 in float64, 3.1e-2 in float32). Why: a relative rounding error e in the per-row
gradients perturbs the Gram entries by about e * lambda_max and its eigenvalues by up to about
R * e * lambda_max, so an exact null eigenvalue shows up below R * eps * lambda_max; the cut sits
1000x above. float32 gradients therefore resolve only the top of the spectrum; use float64 (the
default). Also reported: the number of non-null eigenvalues, the trace, the entropy effective
rank exp(-sum p log p) with p = lambda / sum(lambda) over the non-null part, and kappa at fixed
rtol values (1e-4 ... 1e-10), so a reader sees how much the cut matters.

kappa over each mode's own non-null spectrum compares modes over subspaces of different size when
their numbers of non-null eigenvalues differ, so `recommend` also reports the common-size
condition number kappa_common = lambda_1 / lambda_k with the same k for every mode (k = the
smallest n_nonnull among the modes compared) and whether it picks the same mode (`agree`), the
mode picked at each fixed rtol (`mode_at_rtol`), and `stable`: the pick is the same under all of
them. An unstable pick depends on where the spectrum is cut and should not be trusted.

Logit scale: fixed per mode, not learned. "default" (the default) is what training starts with:
cosine at the cosine scale (CLIP 1/0.07, text 20), every mode with a raw side at 1
(`magclip.temperature`); "matched" gives each mode the cosine scale's effective temperature on
this batch (`temperature.scale_matching_cosine`); a number or a {mode: scale} dict sets it.

Recommendation: among the candidate modes (default qnorm and dnorm) the one with the smaller
kappa, with every mode's kappa, n_nonnull, lambda_max/lambda_min and the ratio behind it.

Invariances (tests pin them down): F, hence kappa, is unchanged when every gradient is multiplied
by a constant c (F -> c^2 F). For a linear tower whose side is normalized (gamma = 1), multiplying
that tower's INPUT data by a > 0 leaves F exactly unchanged (the direction of the feature is
unchanged and d(x/|x|)/dW scales as 1/a while the input scales as a). For a raw side (gamma = 0)
it does not: the scores scale by a like a temperature; scaling the logit scale by 1/a at the same
time restores F exactly. kappa is NOT invariant to the logit scale in general.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from magclip.similarity import Scorer
from magclip.temperature import CLIP_INIT_SCALE, TEXT_COSINE_SCALE, default_logit_scale, scale_matching_cosine

DEFAULT_MODES = ("cosine", "dot", "qnorm", "dnorm")
CANDIDATES = ("qnorm", "dnorm")
EXTRA_RTOLS = (1e-4, 1e-6, 1e-8, 1e-10)

# A direction: (anchor feature key, candidate feature key, score with the transposed Scorer)
Direction = tuple[str, str, bool]
CLIP_DIRECTIONS: dict[str, Direction] = {"i2t": ("image", "text", False), "t2i": ("text", "image", False)}
TEXT_DIRECTIONS: dict[str, Direction] = {"q2d": ("query", "passage", False), "d2q": ("passage", "query", True)}


# ============================================================================ the likelihood


def contrastive_loglik(queries: Tensor, docs: Tensor, scorer: Scorer | str, logit_scale: float,
                       targets: Tensor | None = None) -> Tensor:
    """log p(target_i | query_i) under softmax_j(scale * s(q_i, d_j)); targets default to i."""
    scorer = Scorer.build(scorer)
    logits = logit_scale * scorer(queries, docs)  # the Scorer itself; float64 stays float64
    if targets is None:
        targets = torch.arange(queries.shape[0], device=queries.device)
    return -F.cross_entropy(logits, targets, reduction="none")


def per_example_grads(logliks: Tensor, params: Sequence[Tensor], chunk_size: int = 32) -> Tensor:
    """[R, P] matrix of d logliks[r] / d params (flattened, concatenated), in the params' dtype.

    Rows are computed `chunk_size` at a time with a vmapped backward (`is_grads_batched`); with
    chunk_size 1, or when the vmapped backward is not supported by some op, one backward per row.
    The graph is kept (retain_graph) so the caller can reuse the same forward for several modes.
    """
    params = list(params)
    r = logliks.shape[0]
    sizes = [p.numel() for p in params]
    out = torch.zeros(r, sum(sizes), dtype=params[0].dtype, device=logliks.device)

    def flat(grads, rows):
        cols = [torch.zeros(rows, n, dtype=out.dtype, device=out.device) if g is None else g.reshape(rows, n)
                for g, n in zip(grads, sizes)]
        return torch.cat(cols, dim=1)

    start = 0
    batched = chunk_size > 1
    while start < r:
        stop = min(r, start + (chunk_size if batched else 1))
        if batched:
            eye = torch.zeros(stop - start, r, dtype=logliks.dtype, device=logliks.device)
            eye[torch.arange(stop - start), torch.arange(start, stop)] = 1
            try:
                grads = torch.autograd.grad(logliks, params, grad_outputs=eye, is_grads_batched=True,
                                            retain_graph=True, allow_unused=True)
            except (RuntimeError, NotImplementedError):
                batched = False
                continue
            out[start:stop] = flat(grads, stop - start)
        else:
            grads = torch.autograd.grad(logliks[start], params, retain_graph=True, allow_unused=True)
            out[start] = flat(grads, 1)[0]
        start = stop
    return out


def empirical_fisher(grads: Tensor) -> Tensor:
    """F = G^T G / R (P x P): only for small P; use `fisher_spectrum` for the eigenvalues."""
    g = grads.double()
    return g.T @ g / g.shape[0]


# ============================================================================ the spectrum


@dataclass
class Spectrum:
    eigenvalues: list[float]        # all min(R, P) eigenvalues of F's non-trivial part, descending
    form: str                       # "gram" (R x R, P > R) or "direct" (P x P)
    n_rows: int
    n_params: int
    rtol: float
    lambda_max: float
    lambda_min: float               # smallest non-null eigenvalue
    kappa: float                    # lambda_max / lambda_min over the non-null spectrum
    n_nonnull: int
    trace: float
    effective_rank: float
    kappa_at_rtol: dict[str, float] = field(default_factory=dict)

    def to_dict(self, with_eigenvalues: bool = True) -> dict[str, Any]:
        d = asdict(self)
        if not with_eigenvalues:
            d.pop("eigenvalues")
        return d


def default_rtol(dtype: torch.dtype, rows: int) -> float:
    """1000 * rows * eps of the gradients' dtype: the non-null cut (see the module docstring)."""
    return 1000.0 * max(1, rows) * torch.finfo(dtype).eps


def fisher_eigenvalues(grads: Tensor, form: str = "auto") -> tuple[Tensor, str]:
    """Eigenvalues (descending, float64, negatives from rounding clipped to 0) of F = G^T G / R,
    from the R x R Gram matrix G G^T / R when P > R (form "gram"), else from F ("direct")."""
    r, p = grads.shape
    if form == "auto":
        form = "gram" if p > r else "direct"
    g = grads.double()
    if form == "gram":
        mat = g @ g.T / r
    elif form == "direct":
        mat = g.T @ g / r
    else:
        raise ValueError(f"form must be auto, gram or direct, got {form!r}")
    ev = torch.linalg.eigvalsh((mat + mat.T) / 2).flip(0).clamp_min(0.0)
    return ev[:min(r, p)], form


def spectrum_stats(ev: Tensor, rtol: float) -> dict[str, float]:
    """lambda_max, lambda_min and kappa over eigenvalues > rtol * lambda_max; n_nonnull, trace, effective rank."""
    ev = ev.double()
    lam_max = float(ev.max()) if ev.numel() else 0.0
    if lam_max <= 0:
        return {"lambda_max": 0.0, "lambda_min": 0.0, "kappa": float("nan"), "n_nonnull": 0, "trace": 0.0,
                "effective_rank": 0.0}
    nonnull = ev[ev > rtol * lam_max]
    p = nonnull / nonnull.sum()
    return {"lambda_max": lam_max, "lambda_min": float(nonnull.min()), "kappa": float(lam_max / nonnull.min()),
            "n_nonnull": int(nonnull.numel()), "trace": float(ev.sum()),
            "effective_rank": float(torch.exp(-(p * p.log()).sum()))}


def fisher_spectrum(grads: Tensor, rtol: float | None = None, form: str = "auto") -> Spectrum:
    """Spectrum and condition number of the empirical Fisher of per-row gradients G [R, P]."""
    if grads.ndim != 2 or grads.shape[0] < 1:
        raise ValueError(f"expected per-row gradients [R, P], got {tuple(grads.shape)}")
    rtol = default_rtol(grads.dtype, grads.shape[0]) if rtol is None else float(rtol)
    ev, used = fisher_eigenvalues(grads, form)
    stats = spectrum_stats(ev, rtol)
    extra = {f"{t:g}": spectrum_stats(ev, t)["kappa"] for t in EXTRA_RTOLS}
    return Spectrum(eigenvalues=ev.tolist(), form=used, n_rows=int(grads.shape[0]), n_params=int(grads.shape[1]),
                    rtol=rtol, kappa_at_rtol=extra, **stats)


# ============================================================================ parameter blocks


def _last_linear(module: nn.Module, prefix: str, skip: str = "pooler") -> list[str]:
    names = [n for n, m in module.named_modules() if isinstance(m, nn.Linear) and skip not in n]
    if not names:
        return []
    return [f"{prefix}{names[-1]}.{p}" for p, _ in module.get_submodule(names[-1]).named_parameters()]


def projection_names(model: nn.Module) -> list[str]:
    """Parameter names of the final projection of each tower.

    RawCLIP / open_clip: image tower `visual.proj` (ViT), `visual.attnpool.c_proj` (ModifiedResNet),
    `visual.head.proj` (timm), else the last Linear of `visual`; text tower `text_projection`
    (built-in text transformer) or `text.proj` (HF text tower). BiEncoder: per tower, the last
    nn.Linear of its head after pooling where it has one (a sentence-transformers Dense module, e.g.
    `query_head.0.linear`: the projection that makes the embedding), else the last nn.Linear of the
    tower outside the (unused) pooler, e.g. `encoder.layer.5.output.dense` of MiniLM (there is no
    projection head; this is the last linear map before the final LayerNorm and pooling).
    """
    full = dict(model.named_parameters())
    names: list[str] = []
    clip = getattr(model, "clip", None)
    if clip is not None and hasattr(clip, "visual"):
        base = "clip."
        visual = clip.visual
        if isinstance(getattr(visual, "proj", None), nn.Parameter):
            names.append(base + "visual.proj")
        elif isinstance(getattr(visual, "proj", None), nn.Linear):
            names += [base + "visual.proj." + n for n, _ in visual.proj.named_parameters()]
        elif hasattr(visual, "attnpool") and hasattr(visual.attnpool, "c_proj"):
            names += [base + "visual.attnpool.c_proj." + n for n, _ in visual.attnpool.c_proj.named_parameters()]
        elif hasattr(visual, "head") and isinstance(getattr(visual.head, "proj", None), nn.Module):
            names += [base + "visual.head.proj." + n for n, _ in visual.head.proj.named_parameters()]
        else:
            names += _last_linear(visual, base + "visual.")
        tp = getattr(clip, "text_projection", None)
        if isinstance(tp, nn.Parameter):
            names.append(base + "text_projection")
        elif isinstance(tp, nn.Linear):
            names += [base + "text_projection." + n for n, _ in tp.named_parameters()]
        elif hasattr(clip, "text") and isinstance(getattr(clip.text, "proj", None), nn.Module):
            names += [base + "text.proj." + n for n, _ in clip.text.proj.named_parameters()]
        elif hasattr(clip, "text"):
            names += _last_linear(clip.text, base + "text.")
    elif hasattr(model, "query_model"):
        for tower in ("query", "passage"):
            if getattr(model, f"{tower}_model", None) is not None:
                head = getattr(model, f"{tower}_head", None)
                names += (head is not None and _last_linear(head, f"{tower}_head.")) \
                    or _last_linear(getattr(model, f"{tower}_model"), f"{tower}_model.")
    else:
        names += _last_linear(model, "")
    names = [n for n in names if n in full]
    if not names:
        raise ValueError(f"no final projection found in {type(model).__name__}; pass block= a regex of parameter names")
    return names


def select_block(model: nn.Module, block: str | Sequence[str] = "projection") -> list[str]:
    """Names of the parameters that form the block: "projection" (`projection_names`), "all"
    (every parameter), or regular expression(s) searched in parameter names."""
    names = [n for n, _ in model.named_parameters()]
    if block == "projection":
        return projection_names(model)
    if block == "all":
        return names
    patterns = [block] if isinstance(block, str) else list(block)
    chosen = [n for n in names if any(re.search(p, n) for p in patterns)]
    if not chosen:
        raise ValueError(f"block {patterns} matches no parameter; e.g. {names[:5]} ... {names[-3:]}")
    return chosen


# ============================================================================ modes


def resolve_logit_scale(spec: str | float | Mapping[str, float], mode: str, scorer: Scorer, anchors: Tensor,
                        candidates: Tensor, cosine_scale: float) -> float:
    """The fixed scale of one mode (see the module docstring: "default", "matched", a number or a dict)."""
    if isinstance(spec, Mapping):
        return float(spec[mode])
    if isinstance(spec, (int, float)):
        return float(spec)
    if spec == "default":
        return default_logit_scale(mode, cosine_scale).init
    if spec == "matched":
        return float(scale_matching_cosine(scorer, anchors.detach().float(), candidates.detach().float(), cosine_scale))
    raise ValueError(f"logit_scale must be 'default', 'matched', a number or a {{mode: scale}} dict, got {spec!r}")


def fisher_by_mode(features: Mapping[str, Tensor], params: Sequence[Tensor], directions: Sequence[Direction],
                   modes: Sequence[str] = DEFAULT_MODES, *, logit_scale: str | float | Mapping[str, float] = "default",
                   cosine_scale: float = CLIP_INIT_SCALE, rtol: float | None = None, chunk_size: int = 32,
                   candidates: Sequence[str] = CANDIDATES, keep_grads: bool = False) -> dict[str, Any]:
    """The Fisher spectrum of every mode on one forward pass (features carry the graph to params).

    `directions`: (anchor key, candidate key, transposed) per block of rows; the scale of "matched"
    comes from the first direction. Returns {"modes": {mode: {...}}, "recommendation": {...}}
    (and "grads" per mode with keep_grads).
    """
    results: dict[str, Any] = {}
    grads_out: dict[str, Tensor] = {}
    for mode in modes:
        scorer = Scorer.build(mode)
        a0, c0, t0 = directions[0]
        scale = resolve_logit_scale(logit_scale, scorer.mode, scorer.transposed() if t0 else scorer,
                                    features[a0], features[c0], cosine_scale)
        rows, acc = [], []
        for anchor, cand, transposed in directions:
            s = scorer.transposed() if transposed else scorer
            ll = contrastive_loglik(features[anchor], features[cand], s, scale)
            rows.append(ll)
            with torch.no_grad():
                acc.append(float((s(features[anchor], features[cand]).argmax(1) ==
                                  torch.arange(ll.shape[0], device=ll.device)).double().mean()))
        logliks = torch.cat(rows)
        grads = per_example_grads(logliks, params, chunk_size=chunk_size)
        spec = fisher_spectrum(grads, rtol)
        results[scorer.mode] = {"logit_scale": scale, "mean_loglik": float(logliks.detach().mean()),
                                "in_batch_acc": acc, "mean_grad_norm": float(grads.norm(dim=1).mean()),
                                **spec.to_dict()}
        if keep_grads:
            grads_out[scorer.mode] = grads.detach()
        del grads
    out: dict[str, Any] = {"modes": results, "recommendation": recommend(results, candidates)}
    if keep_grads:
        out["grads"] = grads_out
    return out


def recommend(results: Mapping[str, Mapping[str, Any]], candidates: Sequence[str] = CANDIDATES) -> dict[str, Any]:
    """The candidate with the smallest kappa, the numbers behind it, and the best over all modes."""
    cands = [m for m in candidates if m in results and np.isfinite(results[m]["kappa"])]
    rec: dict[str, Any] = {"rule": "smallest condition number kappa = lambda_max / lambda_min(non-null)",
                           "candidates": list(candidates),
                           "kappa": {m: results[m]["kappa"] for m in results},
                           "n_nonnull": {m: results[m]["n_nonnull"] for m in results},
                           "effective_rank": {m: results[m]["effective_rank"] for m in results}}
    if cands:
        best = min(cands, key=lambda m: results[m]["kappa"])
        others = [results[m]["kappa"] for m in cands if m != best]
        rec["mode"] = best
        rec["kappa_ratio"] = (min(others) / results[best]["kappa"]) if others else None
        k = min(results[m]["n_nonnull"] for m in cands)
        common = {m: results[m]["eigenvalues"][0] / results[m]["eigenvalues"][k - 1] for m in cands}
        rec["kappa_common"] = {"k": k, **common}
        rec["mode_by_kappa_common"] = min(cands, key=lambda m: common[m])
        rec["agree"] = rec["mode_by_kappa_common"] == best
        at = {}
        for t in results[cands[0]].get("kappa_at_rtol", {}):
            vals = {m: results[m]["kappa_at_rtol"][t] for m in cands}
            if all(np.isfinite(v) for v in vals.values()):
                at[t] = min(cands, key=lambda m: vals[m])
        rec["mode_at_rtol"] = at
        rec["stable"] = bool(rec["agree"] and all(m == best for m in at.values()))
    else:
        rec["mode"] = None
    finite = [m for m in results if np.isfinite(results[m]["kappa"])]
    rec["best_overall"] = min(finite, key=lambda m: results[m]["kappa"]) if finite else None
    return rec


# ============================================================================ models


def use_batch_statistics_(model: nn.Module) -> nn.Module:
    """Put only the BatchNorm layers of `model` in training mode, in place: they normalize with the
    batch's own statistics (right for a randomly initialised model, whose running statistics are
    still the (0, 1) defaults)."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.train()
    return model


class _Frozen:
    """A float64 (or other dtype) eval-mode copy of a model with only the block trainable.

    batchnorm="batch" puts the BatchNorm layers (only them) in training mode, so they normalize
    with the batch's own statistics: right for a randomly initialised model, whose running
    statistics are still the (0, 1) defaults and would give features unlike those training starts
    from. The block sits after every BatchNorm here, so this changes the features, not which
    parameters the gradients are taken for."""

    def __init__(self, model: nn.Module, block: str | Sequence[str], dtype: torch.dtype, device,
                 batchnorm: str = "eval"):
        if batchnorm not in ("eval", "batch"):
            raise ValueError(f"batchnorm must be 'eval' or 'batch', got {batchnorm!r}")
        self.model = copy.deepcopy(model).to(device=device, dtype=dtype).eval()
        self.batchnorm = batchnorm
        if batchnorm == "batch":
            use_batch_statistics_(self.model)
        self.names = select_block(self.model, block)
        named = dict(self.model.named_parameters())
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.params = [named[n] for n in self.names]
        for p in self.params:
            p.requires_grad_(True)

    def info(self) -> dict[str, Any]:
        return {"parameters": self.names, "n_params": int(sum(p.numel() for p in self.params)),
                "dtype": str(next(self.model.parameters()).dtype).replace("torch.", ""), "batchnorm": self.batchnorm}


def clip_fisher(clip: nn.Module, images: Tensor, texts: Tensor, *, modes: Sequence[str] = DEFAULT_MODES,
                directions: Sequence[str] = ("i2t", "t2i"), block: str | Sequence[str] = "projection",
                logit_scale: str | float | Mapping[str, float] = "default", cosine_scale: float = CLIP_INIT_SCALE,
                dtype: torch.dtype = torch.float64, rtol: float | None = None, chunk_size: int = 32,
                candidates: Sequence[str] = CANDIDATES, batchnorm: str = "eval",
                device: str | torch.device = "cpu") -> dict[str, Any]:
    """Fisher per mode for a RawCLIP model on a batch of preprocessed images and tokenized texts
    (row i of each is a matching pair; give unique captions). The model itself is not modified.
    batchnorm: "eval" (running statistics; a trained model) or "batch" (see `_Frozen`)."""
    frozen = _Frozen(clip, block, dtype, device, batchnorm)
    img, txt = frozen.model(images.to(device=device, dtype=dtype), texts.to(device))
    feats = {"image": img.to(dtype), "text": txt.to(dtype)}
    dirs = [CLIP_DIRECTIONS[d] for d in directions]
    out = fisher_by_mode(feats, frozen.params, dirs, modes, logit_scale=logit_scale, cosine_scale=cosine_scale,
                         rtol=rtol, chunk_size=chunk_size, candidates=candidates)
    out["setup"] = {"kind": "clip", "pairs": int(images.shape[0]), "directions": list(directions),
                    "rows": int(images.shape[0]) * len(dirs), "logit_scale_rule": _scale_rule(logit_scale),
                    "block": frozen.info(), "image_norm_mean": float(img.detach().norm(dim=-1).mean()),
                    "text_norm_mean": float(txt.detach().norm(dim=-1).mean())}
    return out


def text_fisher(model: nn.Module, queries: Sequence[str], docs: Sequence[str], *,
                modes: Sequence[str] = DEFAULT_MODES, doc_to_query: bool = False,
                block: str | Sequence[str] = "projection", logit_scale: str | float | Mapping[str, float] = "default",
                cosine_scale: float = TEXT_COSINE_SCALE, dtype: torch.dtype = torch.float64, rtol: float | None = None,
                chunk_size: int = 1, candidates: Sequence[str] = CANDIDATES,
                device: str | torch.device = "cpu") -> dict[str, Any]:
    """Fisher per mode for a BiEncoder on N (query, positive document) texts, docs[i] relevant to
    queries[i] (distinct documents). Rows: query->document (+ document->query with doc_to_query).
    One backward per row by default (chunk_size=1): a vmapped backward through a transformer layer
    holds chunk_size copies of its activations."""
    if len(queries) != len(docs):
        raise ValueError(f"{len(queries)} queries but {len(docs)} documents")
    frozen = _Frozen(model, block, dtype, device)
    enc = frozen.model
    q = enc.encode_tokens(enc.tokenize(list(queries), "query"), "query")
    d = enc.encode_tokens(enc.tokenize(list(docs), "passage"), "passage")
    feats = {"query": q.to(dtype), "passage": d.to(dtype)}
    dirs = [TEXT_DIRECTIONS["q2d"]] + ([TEXT_DIRECTIONS["d2q"]] if doc_to_query else [])
    out = fisher_by_mode(feats, frozen.params, dirs, modes, logit_scale=logit_scale, cosine_scale=cosine_scale,
                         rtol=rtol, chunk_size=chunk_size, candidates=candidates)
    out["setup"] = {"kind": "text", "pairs": len(queries), "directions": ["q2d"] + (["d2q"] if doc_to_query else []),
                    "rows": len(queries) * len(dirs), "logit_scale_rule": _scale_rule(logit_scale),
                    "block": frozen.info(), "query_norm_mean": float(q.detach().norm(dim=-1).mean()),
                    "doc_norm_mean": float(d.detach().norm(dim=-1).mean())}
    return out


def _scale_rule(spec) -> Any:
    return spec if isinstance(spec, (str, int, float)) else dict(spec)


# ============================================================================ held-out batches


def beir_pairs(data, n: int, seed: int = 0, min_score: int = 1) -> tuple[list[str], list[str], list[str], list[str]]:
    """Up to n (query, relevant document) text pairs from a BeirData, queries in a seeded random
    order, each query's first relevant document (qrels order) that no earlier pair uses.
    Returns (query texts, document texts, query ids, document ids)."""
    from magclip.data.beir import doc_text
    rng = np.random.default_rng(seed)
    qids = list(data.queries)
    order = rng.permutation(len(qids))
    out_q, out_d, out_qid, out_did, used = [], [], [], [], set()
    for i in order:
        qid = qids[i]
        for did, s in data.qrels.get(qid, {}).items():
            if s >= min_score and did in data.corpus and did not in used:
                out_q.append(data.queries[qid])
                out_d.append(doc_text(data.corpus[did]))
                out_qid.append(qid)
                out_did.append(did)
                used.add(did)
                break
        if len(out_q) >= n:
            break
    return out_q, out_d, out_qid, out_did


def clip_pairs(urls: str, preprocess: Callable, tokenizer: Callable, n: int) -> tuple[Tensor, Tensor, list[str]]:
    """The first n samples of the shards (in order) with pairwise distinct captions: (images, tokens, captions).

    Duplicate captions are skipped: two identical texts are identical candidates, and the
    likelihood of either would be capped at 1/2 by construction."""
    from magclip.data.shards import build_clip_loader
    loader = build_clip_loader(urls, preprocess=preprocess, tokenizer=tokenizer, batch_size=64, num_samples=None,
                               shuffle=False, workers=0, rank=0, world_size=1, drop_last=False)
    images, texts, caps, seen = [], [], [], set()
    for batch in loader:
        for img, tok, cap in zip(batch["images"], batch["texts"], batch["captions"]):
            if cap in seen:
                continue
            seen.add(cap)
            images.append(img)
            texts.append(tok)
            caps.append(cap)
            if len(caps) >= n:
                return torch.stack(images), torch.stack(texts), caps
    if not caps:
        raise ValueError(f"no samples in {urls}")
    return torch.stack(images), torch.stack(texts), caps


__all__ = [
    "CANDIDATES",
    "DEFAULT_MODES",
    "Spectrum",
    "beir_pairs",
    "clip_fisher",
    "clip_pairs",
    "contrastive_loglik",
    "default_rtol",
    "empirical_fisher",
    "fisher_by_mode",
    "fisher_eigenvalues",
    "fisher_spectrum",
    "per_example_grads",
    "projection_names",
    "recommend",
    "resolve_logit_scale",
    "select_block",
    "spectrum_stats",
    "text_fisher",
]
