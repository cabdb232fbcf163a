"""What a model's document norm carries: length, relevance, or relevance at equal length.

Under dot a document's norm multiplies every score it gets, so whatever the norm tracks becomes a prior
on the ranking. Mean pooling ties it to length by construction (diagnostics/pooling_norm.py); a pooling
that frees the norm (sum/√n, a learned magnitude) lets the loss put something else there. This asks what,
per model and BEIR set, on the texts the length × relevance surface ranks (the form tables: every full
record and its short form, `forms="both"`; `"full"`: the records only, where most are cut at the max
length and length hardly varies), with "relevant" meaning judged relevant by some test query (the
surface's classes):

- `rho_length`: Spearman ρ(‖d‖, tokens the encoder saw), a percentile bootstrap over documents (a
  document's forms drawn together, here and below);
- `d_relevant`: Cohen's d of the norms of relevant vs the other documents (diagnostics.magnitude
  `bootstrap_cohens_d`, each class resampled on its own): > 0, relevant documents get larger norms;
- `length_r2`: the share of log‖d‖'s variance a least-squares line on log n explains (experiments.length_mix
  `residual_log_norm`: fitted over the corpus, no judgement used);
- `d_residual`: Cohen's d of that line's residuals, relevant vs other: relevance at equal length, so a d
  that is only length falls to 0 here (quantile bins of length would leave the length inside each bin);
- `norm_cv`: how much the norm varies at all (sd / mean over documents; 0: dot ranks as cosine);
- `lengths`: the median tokens of each class, so a d can be read against how length and relevance
  go together in the corpus itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from magclip.diagnostics.length import length_correlation
from magclip.diagnostics.magnitude import bootstrap_cohens_d
from magclip.experiments.length_mix import FormTables, residual_log_norm


def _interval(values: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    valid = values[np.isfinite(values)]
    if not valid.size:
        return float("nan"), float("nan")
    lo, hi = np.quantile(valid, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def _d(boot: dict[str, Any]) -> dict[str, float]:
    return {"value": boot["d"], "low": boot["ci_low"], "high": boot["ci_high"]}


FORMS = ("both", "full")   # the texts the surface ranks (full records and their short forms); full records only


def _texts(tables: FormTables, forms: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(norms, tokens seen, document index) of every text of `forms`: the full records, and with "both" each
    short form that differs from its record too."""
    if forms not in FORMS:
        raise ValueError(f"forms must be one of {FORMS}, got {forms!r}")
    n = len(tables.doc_ids)
    norms, tokens, doc = [tables.full.double().norm(dim=1).numpy()], [tables.full_tokens], [np.arange(n)]
    if forms == "both":
        differ = np.flatnonzero((tables.short != tables.full).any(dim=1).numpy())
        norms.append(tables.short[differ].double().norm(dim=1).numpy())
        tokens.append(tables.short_tokens[differ])
        doc.append(differ)
    seen = np.minimum(np.concatenate(tokens), tables.max_length).astype(float)
    return np.concatenate(norms), seen, np.concatenate(doc)


def norm_signal(tables: FormTables, relevant: set[str], *, forms: str = "both", n_boot: int = 1000,
                seed: int = 0) -> dict[str, Any]:
    """The measures of the module docstring for one model's tables of one set; intervals resample documents
    (a document's forms together)."""
    norms, seen, doc = _texts(tables, forms)
    doc_relevant = np.array([d in relevant for d in tables.doc_ids], dtype=bool)
    is_rel = doc_relevant[doc]
    rel, non = np.flatnonzero(is_rel), np.flatnonzero(~is_rel)
    rng = np.random.default_rng(seed)
    n = len(tables.doc_ids)
    short_row = np.full(n, -1)
    short_row[doc[n:]] = np.arange(n, doc.size)     # rows 0..n-1 are the records, then the short forms
    rho_reps = np.empty(n_boot)
    for b in range(n_boot):
        drawn = rng.integers(0, n, n)
        rows = np.concatenate([drawn, short_row[drawn][short_row[drawn] >= 0]])
        rho_reps[b] = length_correlation(norms[rows], seen[rows])["spearman"]
    residual, fit = residual_log_norm(norms, seen, tables.max_length)
    clusters = {"clusters_a": doc[rel], "clusters_b": doc[non]} if rel.size and non.size else {}
    plain = bootstrap_cohens_d(norms[rel], norms[non], n_boot=n_boot, seed=seed, **clusters)
    at_equal_length = bootstrap_cohens_d(residual[rel], residual[non], n_boot=n_boot, seed=seed, **clusters)
    return {"forms": forms, "docs": len(tables.doc_ids), "texts": int(norms.size),
            "relevant": int(doc_relevant.sum()),
            "norm_median": float(np.median(norms)), "norm_cv": float(norms.std() / norms.mean()),
            "rho_length": {"value": length_correlation(norms, seen)["spearman"],
                           **dict(zip(("low", "high"), _interval(rho_reps)))},
            "length_r2": fit["r2"], "length_slope": fit["slope"],
            "d_relevant": _d(plain), "d_residual": _d(at_equal_length),
            "lengths": {"relevant_median": float(np.median(seen[rel])) if rel.size else float("nan"),
                        "other_median": float(np.median(seen[non])) if non.size else float("nan")}}


def signals_by_set(folders: Sequence[str | Path], tables: Mapping[str, Mapping[str, FormTables]],
                   forms: str = "both") -> dict[str, dict[str, Any]]:
    """{set: {model: norm_signal}} for every BEIR folder and every model with tables of it (relevant: judged
    by some test query, as on the surface)."""
    from magclip.data.beir import load_beir
    from magclip.data.length_mix import relevant_ids

    out: dict[str, dict[str, Any]] = {}
    for folder in folders:
        name = Path(folder).name
        relevant = relevant_ids(load_beir(folder, "test").qrels)
        out[name] = {model: norm_signal(by_set[name], relevant, forms=forms) for model, by_set in tables.items()
                     if name in by_set}
    return out


def _tokens(median: float) -> str:
    return f"{median:.0f}" if np.isfinite(median) else "—"


def markdown_table(signals: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    """{set: {model: norm_signal}} as one table (95 % bootstrap intervals)."""
    from magclip.experiments.report import interval, signed

    def cell(x: Mapping[str, float]) -> str:
        if not np.isfinite(x["value"]):
            return "—"
        return f"{signed(x['value'], 1, 2)} {interval(x['low'], x['high'], 1, 2)}"

    header = ("| set | model | sd / mean of ‖d‖ | ρ(‖d‖, tokens) | R² of log‖d‖ on log n | d: relevant − other | "
              "d at equal length (log-log residual) | median tokens, relevant / other |")
    lines = [header, "|---|---|---|---|---|---|---|---|"]
    for set_name, by_model in signals.items():
        for model, s in by_model.items():
            lines.append(f"| {set_name} | {model} | {s['norm_cv']:.3f} | {cell(s['rho_length'])} | {s['length_r2']:.2f} | "
                         f"{cell(s['d_relevant'])} | {cell(s['d_residual'])} | {_tokens(s['lengths']['relevant_median'])} / "
                         f"{_tokens(s['lengths']['other_median'])} |")
    return "\n".join(lines) + "\n"
