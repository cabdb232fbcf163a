"""Where the norm's length prior comes from (issue 63, item 2): ‖mean pooled‖ against n for each model,
beside the shuffled-token baseline, the closed-form arithmetic curve and CLS pooling, on the same texts
(magclip/diagnostics/pooling_norm.py says what each number is).

The texts (`sample_texts`): `per_form` documents of a BEIR set, drawn with numpy's default_rng(seed), each
in three forms, so that n spans a title to a cut abstract: the title (where there is one), the first
sentence of the text (magclip.data.length_mix.first_sentence) and the whole record (`doc_text`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from magclip.data.beir import doc_text, read_corpus
from magclip.data.length_mix import first_sentence
from magclip.diagnostics.pooling_norm import (
    arithmetic_curve,
    binned_curve,
    explained,
    pooled_norms,
    shuffled_mean_norms,
    token_states,
)

log = logging.getLogger("magclip.experiments.pooling_norm")
N_EDGES = (1, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 10_000)


def sample_texts(folder: str | Path, per_form: int = 400, seed: int = 0) -> dict[str, list[str]]:
    """{form: texts} for `per_form` documents drawn from the set (see the module docstring)."""
    corpus = read_corpus(folder)
    ids = list(corpus)
    chosen = [ids[i] for i in np.random.default_rng(seed).permutation(len(ids))[:per_form]]
    docs = [corpus[i] for i in chosen]
    return {"title": [d["title"] for d in docs if (d.get("title") or "").strip()],
            "first_sentence": [first_sentence(d.get("text", "") or "") for d in docs],
            "full": [doc_text(d) for d in docs]}


def measure_model(model, texts: Sequence[str], seed: int = 0, n_boot: int = 2000) -> dict[str, Any]:
    """One model's norms of every text and the statistics of `explained` for mean, CLS and sum/√n pooling."""
    states = token_states(model, texts, "passage")
    norms = pooled_norms(states)
    shuffled = shuffled_mean_norms(states, seed)
    curve = arithmetic_curve(states, norms["n"])
    n = norms["n"]
    out: dict[str, Any] = {"texts": len(texts), "n_median": float(np.median(n)), "n_min": float(n.min()),
                           "n_max": float(n.max()), "pooled": {}}
    for pooling in ("mean", "cls", "sqrt_len"):
        out["pooled"][pooling] = explained(norms[pooling], shuffled, curve, n, n_boot, seed)
    out["binned"] = {k: binned_curve(n, v, N_EDGES) for k, v in
                     {"mean": norms["mean"], "shuffled": shuffled, "arithmetic": curve, "cls": norms["cls"],
                      "sqrt_len": norms["sqrt_len"]}.items()}
    out["per_text"] = {"n": n.tolist(), "mean": norms["mean"].round(5).tolist(), "cls": norms["cls"].round(5).tolist(),
                       "shuffled": shuffled.round(5).tolist(), "arithmetic": curve.round(5).tolist()}
    return out


def plot_pooling_norm(result: Mapping[str, Any], path: str | Path) -> Path:
    """One panel per model: ‖mean‖, the shuffled baseline, the arithmetic curve and ‖CLS‖ (each relative to
    its own median) against n, log-log."""
    from magclip.diagnostics.plots import panels, save_figure

    models = list(result["models"])
    fig, axes = panels(len(models), cols=len(models))
    styles = {"mean": ("C3", "o", "mean pooling (its own tokens)"), "shuffled": ("C0", "s", "tokens shuffled across texts"),
              "arithmetic": ("k", "", "sqrt(‖μ‖² + tr Σ / n)"), "cls": ("C2", "^", "CLS token")}
    for ax, name in zip(axes, models):
        per = result["models"][name]["per_text"]
        n = np.asarray(per["n"])
        for key, (color, marker, label) in styles.items():
            v = np.asarray(per[key])
            v = v / np.median(v)
            if key == "arithmetic":
                order = np.argsort(n)
                ax.plot(n[order], v[order], color=color, lw=1.2, label=label)
            else:
                ax.scatter(n, v, s=4, alpha=0.35, color=color, marker=marker, label=label)
        rho = result["models"][name]["pooled"]["mean"]["rho"]["value"]
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{name}: ρ(‖mean‖, n) = {rho:+.2f}", fontsize=9)
        ax.set_xlabel("tokens n")
        ax.set_ylabel("norm / its median")
    axes[-1].legend(fontsize=6.5, loc="best", markerscale=3)
    fig.tight_layout()
    return save_figure(fig, path)


def markdown_table(result: Mapping[str, Any]) -> str:
    """The section's table: per model and pooling, ρ(norm, n), slopes and what is left after the arithmetic."""
    def cell(s: Mapping[str, float], digits: int = 2) -> str:
        return f"{s['value']:+.{digits}f} [{s['low']:+.{digits}f}, {s['high']:+.{digits}f}]"

    lines = [("| model | pooling | ρ(norm, n) | ρ, tokens shuffled | slope d log‖·‖ / d log n | slope, shuffled "
              "| shuffled / real slope | ρ(norm / arithmetic, n) |"), "|---|---|---|---|---|---|---|---|"]
    for name, m in result["models"].items():
        for pooling, s in m["pooled"].items():
            lines.append(f"| {name} | {pooling} | {cell(s['rho'])} | {cell(s['rho_shuffled'])} | {cell(s['slope'])} | "
                         f"{cell(s['slope_shuffled'])} | {cell(s['slope_share'])} | {cell(s['rho_after_arithmetic'])} |")
    return "\n".join(lines) + "\n"
