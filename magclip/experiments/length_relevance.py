"""Length × relevance: the length-mixing control with short records drawn at two shares, p_non among the
non-relevant documents and p_rel among the relevant ones (magclip.data.length_mix.replaced_ids_by_relevance).

The length-mixing control (magclip.experiments.length_mix) drew its short records among relevant and
non-relevant documents alike, and its prediction for a corpus with half of its records title-only missed a
real one by more than twice: there, one relevant document in five was title-only (p_rel ≈ 0.2) against
p_non ≈ 0.55 of the rest. Short non-relevant records with the large norms of mean pooling then fill the top.

Grid (`cells`): p_non ∈ {0.25, 0.5, 0.75} × p_rel ∈ {0, p_non/2, p_non}, plus the corpus itself, each
(but the corpus) drawn by every choice seed. Scoring reuses the control's machinery: each model's form
tables (encoded once, `encode_all`), every variant assembled from them (`assemble`) and ranked with the
search of every BEIR evaluation (`VariantScorer.rank`, pytrec_eval nDCG@10 per query, test qrels).

Contrasts, per cell, over [choices, queries] (`paired`: t interval over the choice seeds, bootstrap over
queries with one draw for every seed): dot (dot-trained) − cosine (cosine-trained), the paper's; the
dot-as-cosine control (dot-trained scored with cosine − cosine-trained: what the directions learned);
what the norm adds (dot-trained: dot − its own cosine); and any added model's dot − cosine (cosine-trained).

Prediction (`predict`) at (p_non, p_rel) = (0.55, 0.2): bilinear interpolation on the grid in the
coordinates (p_non, r = p_rel / p_non), on which the cells form a rectangle (r ∈ {0, ½, 1}): the four
corner cells around the target, weighted, applied to each (choice, query) difference, so the interval is
the same paired one over choices and queries. It does not include the interpolation's own error; a plane
fitted by least squares to every cell's mean (`plane_fit`) is given beside it as a check.

Post-hoc sum/√n (`sqrt_len_tables`): a table's vectors times sqrt(n), n the tokens the encoder saw
(untruncated count capped at the max length): exactly what the same weights give under mean_sqrt_len
pooling, so the trained models can be scored with that pooling without training or encoding again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from magclip.data.length_mix import relevant_ids, replaced_ids_by_relevance
from magclip.experiments.length_mix import FormTables, VariantScorer, paired

log = logging.getLogger("magclip.experiments.length_relevance")

P_NON = (0.25, 0.5, 0.75)
RATIOS = (0.0, 0.5, 1.0)          # p_rel = ratio × p_non
TARGET = (0.55, 0.2)              # the corpus of issue 63: p_non ≈ 0.55, p_rel ≈ 0.2
MODES = ("cosine", "dot")
# name -> ((model, mode), (model, mode)); a contrast whose models were not scored is left out
CONTRASTS: dict[str, tuple[tuple[str, str], tuple[str, str]]] = {
    "dot_minus_cosine": (("dot", "dot"), ("cosine", "cosine")),
    "directions": (("dot", "cosine"), ("cosine", "cosine")),       # the dot-as-cosine control
    "norm_adds": (("dot", "dot"), ("dot", "cosine")),
}


def cell_label(p_non: float, p_rel: float) -> str:
    return f"{p_non:g},{p_rel:g}"


def cells(p_non: Sequence[float] = P_NON, ratios: Sequence[float] = RATIOS) -> list[tuple[float, float]]:
    """(p_non, p_rel) of the grid, the unmixed corpus (0, 0) first."""
    return [(0.0, 0.0)] + [(p, round(r * p, 6)) for p in p_non for r in ratios]


def sqrt_len_tables(t: FormTables, query_max_length: int) -> FormTables:
    """The tables as the same weights give them under sum/√n pooling (see the module docstring)."""
    def scaled(vecs: torch.Tensor, tokens: np.ndarray, cap: int) -> torch.Tensor:
        return vecs * torch.from_numpy(np.sqrt(np.minimum(tokens, cap))).float()[:, None]

    queries = {s: {**q, "vecs": scaled(q["vecs"], np.asarray(q["tokens"]), query_max_length)} for s, q in t.queries.items()}
    return replace(t, full=scaled(t.full, t.full_tokens, t.max_length), short=scaled(t.short, t.short_tokens, t.max_length),
                   queries=queries)


def score_set(scorer: VariantScorer, model: str, grid: Sequence[tuple[float, float]], seeds: Sequence[int],
              cache: str | Path | None = None) -> dict[str, Any]:
    """{mode: {cell: [choices][queries] nDCG@10}} of one model on one set (the corpus: one choice), kept in
    `<cache>/<model>/<set>.relevance.json` and reused when the grid, seeds and queries match."""
    from magclip.io import atomic_write_json

    qids = sorted(scorer.data.qrels)
    key = {"cells": [cell_label(*c) for c in grid], "seeds": list(seeds), "split": scorer.split, "query_ids": qids}
    path = Path(cache) / model / f"{scorer.data.name}.relevance.json" if cache else None
    if path is not None and path.is_file():
        kept = json.loads(path.read_text())
        if kept.get("key") == key:
            return kept["ndcg"]
    relevant = relevant_ids(scorer.data.qrels)
    out: dict[str, Any] = {m: {} for m in MODES}
    for p_non, p_rel in grid:
        choices = [[]] if p_non == p_rel == 0 else [
            replaced_ids_by_relevance(scorer.doc_ids, relevant, p_non, p_rel, s) for s in seeds]
        for mode in MODES:
            rows = []
            for replaced in choices:
                found, _, _ = scorer.rank(model, mode, replaced)
                rows.append([found.ndcg[q] for q in qids])
            out[mode][cell_label(p_non, p_rel)] = rows
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {"key": key, "ndcg": out})
    return out


def relevant_share(scorer: VariantScorer) -> dict[str, float]:
    """How many documents the test qrels judge relevant (the classes p_rel and p_non are shares of)."""
    relevant = relevant_ids(scorer.data.qrels) & set(scorer.doc_ids)
    return {"relevant": len(relevant), "non_relevant": len(scorer.doc_ids) - len(relevant)}


def overall_share(p_non: float, p_rel: float, counts: Mapping[str, int]) -> float:
    """The share of all records that are short at (p_non, p_rel)."""
    total = counts["relevant"] + counts["non_relevant"]
    return (p_non * counts["non_relevant"] + p_rel * counts["relevant"]) / total


def corners(target: tuple[float, float], p_non: Sequence[float] = P_NON,
            ratios: Sequence[float] = RATIOS) -> dict[str, float]:
    """{cell: weight} of the bilinear interpolation at `target` in (p_non, p_rel / p_non) (module docstring)."""
    x, r = target[0], target[1] / target[0]
    xs, rs = sorted(p_non), sorted(ratios)
    if not (xs[0] <= x <= xs[-1] and rs[0] <= r <= rs[-1]):
        raise ValueError(f"the target {target} lies outside the grid: interpolation only")

    def bracket(v: float, grid: list[float]) -> tuple[float, float, float]:
        k = max(i for i in range(len(grid) - 1) if grid[i] <= v) if v < grid[-1] else len(grid) - 2
        lo, hi = grid[k], grid[k + 1]
        return lo, hi, (v - lo) / (hi - lo)

    x0, x1, tx = bracket(x, xs)
    r0, r1, tr = bracket(r, rs)
    weights: dict[str, float] = {}
    for xv, wx in ((x0, 1 - tx), (x1, tx)):
        for rv, wr in ((r0, 1 - tr), (r1, tr)):
            if wx * wr > 0:
                label = cell_label(xv, round(rv * xv, 6))
                weights[label] = weights.get(label, 0.0) + wx * wr
    return weights


def contrast_rows(ndcg: Mapping[str, Mapping[str, Mapping[str, Any]]], row: tuple[str, str], base: tuple[str, str],
                  cell: str) -> np.ndarray:
    """[choices, queries] differences row − base at one cell."""
    return np.asarray(ndcg[row[0]][row[1]][cell], dtype=float) - np.asarray(ndcg[base[0]][base[1]][cell], dtype=float)


def plane_fit(means: Mapping[str, float]) -> tuple[np.ndarray, float]:
    """Least-squares plane a + b p_non + c p_rel over the cells' mean differences, and its value at TARGET."""
    pts = [(*map(float, c.split(",")), v) for c, v in means.items()]
    a = np.array([[1.0, x, y] for x, y, _ in pts])
    coef, *_ = np.linalg.lstsq(a, np.array([v for *_, v in pts]), rcond=None)
    return coef, float(coef @ [1.0, *TARGET])


def analyse(ndcg: Mapping[str, Any], grid: Sequence[tuple[float, float]], contrasts: Mapping[str, Any],
            n_resamples: int = 10_000) -> dict[str, Any]:
    """Per contrast: every cell's paired difference, the prediction at TARGET and the plane check."""
    weights = corners(TARGET)
    out: dict[str, Any] = {}
    for name, (row, base) in contrasts.items():
        if row[1] not in ndcg.get(row[0], {}) or base[1] not in ndcg.get(base[0], {}):
            continue
        per_cell = {cell_label(*c): paired(contrast_rows(ndcg, row, base, cell_label(*c)), n_resamples) for c in grid}
        mixed = sum(w * contrast_rows(ndcg, row, base, c) for c, w in weights.items())
        coef, plane = plane_fit({c: v["diff"] for c, v in per_cell.items()})
        out[name] = {"cells": per_cell, "prediction": {"target": list(TARGET), "corners": weights,
                                                       **paired(mixed, n_resamples)},
                     "plane": {"coef": coef.tolist(), "at_target": plane}}
    return out


def run_surface(folders: Sequence[str | Path], tables: Mapping[str, Mapping[str, FormTables]], *,
                seeds: Sequence[int], contrasts: Mapping[str, Any] = CONTRASTS, cache: str | Path | None = None,
                n_resamples: int = 10_000) -> tuple[dict[str, Any], dict[str, Any]]:
    """(analysis, per-query records) of every set (see the module docstring)."""
    grid = cells()
    analysis: dict[str, Any] = {"cells": [cell_label(*c) for c in grid], "seeds": list(seeds), "target": list(TARGET),
                                "sets": {}}
    records: dict[str, Any] = {"cells": analysis["cells"], "seeds": list(seeds), "sets": {}}
    for folder in folders:
        name = Path(folder).name
        have = {m: tables[m][name] for m in tables if name in tables[m]}
        if not have:
            continue
        scorer = VariantScorer(folder, "test", have)
        counts = relevant_share(scorer)
        if not counts["relevant"] or not counts["non_relevant"]:
            why = (f"{counts['relevant']} relevant and {counts['non_relevant']} other documents: with one class "
                   "empty, p_non and p_rel cannot both act (no length × relevance surface)")
            log.warning("%s: left out: %s", name, why)
            analysis.setdefault("left_out", {})[name] = why
            continue
        ndcg = {}
        for model in have:
            log.info("length x relevance: %s on %s", model, name)
            ndcg[model] = score_set(scorer, model, grid, seeds, cache)
        analysis["sets"][name] = {"queries": len(scorer.data.qrels), "docs": len(scorer.doc_ids), **counts,
                                  "target_overall_share": overall_share(*TARGET, counts),
                                  "means": {m: {mode: {c: float(np.mean(v)) for c, v in by.items()}
                                                for mode, by in modes.items()} for m, modes in ndcg.items()},
                                  "contrasts": analyse(ndcg, grid, contrasts, n_resamples)}
        records["sets"][name] = {"query_ids": sorted(scorer.data.qrels),
                                 "ndcg@10": {m: {mode: {c: np.round(v, 5).tolist() for c, v in by.items()}
                                                 for mode, by in modes.items()} for m, modes in ndcg.items()}}
    return analysis, records


# ---------------------------------------------------------------------------------------------- report
def _cell(c: Mapping[str, Any]) -> str:
    from magclip.experiments.report import interval, signed

    seeds = f"; seeds {interval(c['seed_low'], c['seed_high'], 100, 1)}" if c.get("seed_low") is not None else ""
    return f"{signed(c['diff'], 100, 1)} {interval(c['item_low'], c['item_high'], 100, 1)}{seeds}"


def markdown_report(analysis: Mapping[str, Any], labels: Mapping[str, str] | None = None) -> str:
    """The surface (one table per contrast: a row per set and p_non, a column per p_rel / p_non) and the
    predictions at TARGET."""
    labels = dict(labels or {})
    lines: list[str] = []
    contrasts = list(dict.fromkeys(c for s in analysis["sets"].values() for c in s["contrasts"]))
    for contrast in contrasts:
        lines += [(f"#### {labels.get(contrast, contrast)} (nDCG@10 ×100; 95 % interval over queries; over the "
                   f"{len(analysis['seeds'])} choice seeds)"), "",
                  "| set | p_non | p_rel = 0 | p_rel = p_non/2 | p_rel = p_non |", "|---|---|---|---|---|"]
        for name, entry in analysis["sets"].items():
            c = entry["contrasts"].get(contrast)
            if c is None:
                continue
            lines.append(f"| {name} | 0 (the corpus) | {_cell(c['cells']['0,0'])} | | |")
            for p in P_NON:
                lines.append(f"| {name} | {p:g} | " + " | ".join(_cell(c["cells"][cell_label(p, round(r * p, 6))])
                                                                  for r in RATIOS) + " |")
        lines.append("")
    from magclip.experiments.report import signed

    lines += [f"Left out: {name}: {why}." for name, why in analysis.get("left_out", {}).items()]
    lines += [""] if analysis.get("left_out") else []
    lines += [(f"#### Predictions at p_non = {TARGET[0]}, p_rel = {TARGET[1]} (bilinear in p_non and p_rel/p_non; "
               "beside it a least-squares plane over every cell)"), "",
              "| set | share of all records short | contrast | prediction ×100 [queries; seeds] | plane |",
              "|---|---|---|---|---|"]
    for name, entry in analysis["sets"].items():
        for contrast, c in entry["contrasts"].items():
            lines.append(f"| {name} | {entry['target_overall_share']:.2f} | {labels.get(contrast, contrast)} | "
                         f"{_cell(c['prediction'])} | {signed(c['plane']['at_target'], 100, 1)} |")
    return "\n".join(lines) + "\n"


def plot_surface(analysis: Mapping[str, Any], path: str | Path, contrasts: Sequence[str] = ("dot_minus_cosine", "directions"),
                 labels: Mapping[str, str] | None = None) -> Path:
    """One column per set, one row per contrast: the difference against p_rel / p_non, a line per p_non
    (band: 95 % query interval), and the prediction at TARGET (star, bar: its interval)."""
    import matplotlib.pyplot as plt

    from magclip.diagnostics.plots import save_figure

    labels = dict(labels or {})
    sets = list(analysis["sets"])
    fig, axes = plt.subplots(len(contrasts), len(sets), figsize=(3.3 * len(sets), 2.8 * len(contrasts)), squeeze=False)
    for j, name in enumerate(sets):
        for i, contrast in enumerate(contrasts):
            ax = axes[i][j]
            c = analysis["sets"][name]["contrasts"].get(contrast)
            if c is None:
                ax.set_visible(False)
                continue
            for k, p in enumerate(P_NON):
                pts = [c["cells"][cell_label(p, round(r * p, 6))] for r in RATIOS]
                ax.plot(RATIOS, [100 * x["diff"] for x in pts], marker="o", ms=3, color=f"C{k}", label=f"p_non = {p:g}")
                ax.fill_between(RATIOS, [100 * x["item_low"] for x in pts], [100 * x["item_high"] for x in pts],
                                color=f"C{k}", alpha=0.12)
            pred = c["prediction"]
            r = TARGET[1] / TARGET[0]
            ax.errorbar([r], [100 * pred["diff"]], yerr=[[100 * (pred["diff"] - pred["item_low"])],
                                                        [100 * (pred["item_high"] - pred["diff"])]],
                        marker="*", ms=9, color="k", capsize=3, label=f"({TARGET[0]}, {TARGET[1]})")
            ax.axhline(0, color="k", lw=0.6)
            ax.set_title(f"{name}: {labels.get(contrast, contrast)}", fontsize=8)
            ax.set_xlabel("p_rel / p_non")
            ax.set_ylabel("Δ nDCG@10 ×100")
    axes[0][-1].legend(fontsize=6.5, loc="best")
    fig.tight_layout()
    return save_figure(fig, path)


def plot_predictions(analysis: Mapping[str, Any], path: str | Path, contrasts: Sequence[str],
                     labels: Mapping[str, str] | None = None) -> Path:
    """One group per set, one marker per contrast: its prediction at TARGET (filled, bar: 95 % query
    interval) beside the corpus as it is (hollow): how each pooling's cost under mixing compares."""
    import matplotlib.pyplot as plt

    from magclip.diagnostics.plots import save_figure

    labels = dict(labels or {})
    sets = list(analysis["sets"])
    fig, ax = plt.subplots(figsize=(1.9 * len(sets) + 2.5, 3.4))
    width = 0.8 / max(len(contrasts), 1)
    for k, contrast in enumerate(contrasts):
        for j, name in enumerate(sets):
            c = analysis["sets"][name]["contrasts"].get(contrast)
            if c is None:
                continue
            x = j - 0.4 + width * (k + 0.5)
            pred, unmixed = c["prediction"], c["cells"][cell_label(0, 0)]
            ax.errorbar([x], [100 * pred["diff"]], yerr=[[100 * (pred["diff"] - pred["item_low"])],
                                                        [100 * (pred["item_high"] - pred["diff"])]],
                        fmt="o", color=f"C{k}", capsize=2, label=labels.get(contrast, contrast) if j == 0 else None)
            ax.plot([x], [100 * unmixed["diff"]], marker="o", mfc="none", color=f"C{k}", ls="none")
    ax.axhline(0, color="k", lw=0.6)
    ax.set_xticks(range(len(sets)), sets)
    ax.set_ylabel(f"Δ nDCG@10 ×100 at p_non = {TARGET[0]}, p_rel = {TARGET[1]}\n(hollow: the corpus as it is)",
                  fontsize=8)
    ax.legend(fontsize=6.5, loc="best")
    fig.tight_layout()
    return save_figure(fig, path)
