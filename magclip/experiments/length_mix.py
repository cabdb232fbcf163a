"""What a scoring mode does when a corpus mixes long and short records: the length-mixing control.

The variants (magclip.data.length_mix) replace a share p of a BEIR set's documents by a short form of
itself (title or first sentence), queries and judgements unchanged. A document's short form does not
depend on p or the seed, so every variant's document vectors are rows of two tables, the encoded full
and short forms: `encode_tables` encodes each corpus's two forms (and the queries) ONCE per model, and
`assemble` takes, for each variant, the short row of every replaced document and the full row of the
rest. This is exact (the encoder sees each record alone; only float rounding from batch padding can
differ, as between any two encodings) and saves all but one encoding per model and set; the variant
folders are still written for other models to be scored on.

Per model, per variant (p, seed) and per scoring mode, `score_variant` ranks with the same search as
every BEIR evaluation (magclip.metrics.ir.search_run, pytrec_eval) and keeps nDCG@10 per query; the
length diagnostics of magclip.diagnostics.length give rho(norm, length) and nDCG@10 by length quartile
of the relevant documents. `analyse` pairs: mode − cosine at each p (the dot-trained model with dot
against the cosine-trained model with cosine is the paper's comparison; the dot-trained model scored
with cosine separates what its directions learned from what its norm adds), and each row's change from
p = 0, with magclip.experiments.stats.compare (t interval over the choice seeds, bootstrap over queries
with the same draw in every seed, sign-flip p).

Residual norm (`residual_log_norm`, `residual_scores`): log‖d‖ fitted by least squares on log n (n =
the tokens the encoder saw: untruncated count capped at the passage max length, special tokens
included) over each searched corpus alone, no judgement used; the residual r = log‖d‖ − fit is the part
of the norm that length does not explain, and s(q, d) = cos(q, d) · exp(α r) keeps cosine's ranking at
α = 0. α is chosen on one named set and split (`choose_alpha`) and applied unchanged to the others.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from magclip.data.beir import doc_text, load_beir, read_corpus
from magclip.data.length_mix import short_forms

log = logging.getLogger("magclip.experiments.length_mix")

TABLES_FORMAT = 1


@dataclass
class FormTables:
    """One model's encodings of one BEIR set: every document's full and short form, and the judged queries."""

    doc_ids: list[str]
    full: torch.Tensor             # [N, D] raw vectors of the full records
    short: torch.Tensor            # [N, D] raw vectors of the short forms (the full row where they are equal)
    full_tokens: np.ndarray        # untruncated token counts
    short_tokens: np.ndarray
    max_length: int                # the passage max length the encoder cut at
    queries: dict[str, dict[str, Any]]   # split -> {"ids": [...], "vecs": Tensor, "tokens": array}

    def to_dict(self) -> dict[str, Any]:
        return {"format": TABLES_FORMAT, "doc_ids": self.doc_ids, "full": self.full, "short": self.short,
                "full_tokens": self.full_tokens.tolist(), "short_tokens": self.short_tokens.tolist(),
                "max_length": self.max_length,
                "queries": {s: {"ids": q["ids"], "vecs": q["vecs"], "tokens": np.asarray(q["tokens"]).tolist()}
                            for s, q in self.queries.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FormTables:
        if d.get("format") != TABLES_FORMAT:
            raise ValueError(f"form tables of format {d.get('format')!r}; this code reads {TABLES_FORMAT}: encode again")
        queries = {s: {"ids": list(q["ids"]), "vecs": q["vecs"], "tokens": np.asarray(q["tokens"])}
                   for s, q in d["queries"].items()}
        return cls(list(d["doc_ids"]), d["full"], d["short"], np.asarray(d["full_tokens"]),
                   np.asarray(d["short_tokens"]), int(d["max_length"]), queries)


def qrels_splits(folder: str | Path) -> list[str]:
    return sorted(p.stem for p in (Path(folder) / "qrels").glob("*.tsv"))


def encode_tables(model, folder: str | Path, batch_size: int = 64, device=None, progress: bool = False) -> FormTables:
    """Encode a BEIR set's full and short documents and every split's judged queries with `model` (a BiEncoder)."""
    corpus = read_corpus(folder)
    shorts, _ = short_forms(corpus)
    ids = list(corpus)
    full_texts = [doc_text(corpus[i]) for i in ids]
    short_texts = [doc_text(shorts[i]) for i in ids]
    differ = [k for k, (a, b) in enumerate(zip(full_texts, short_texts)) if a != b]
    full = model.encode(full_texts, "passage", batch_size=batch_size, device=device, progress=progress)
    short = full.clone()
    short[differ] = model.encode([short_texts[k] for k in differ], "passage", batch_size=batch_size, device=device,
                                 progress=progress)
    queries = {}
    for split in qrels_splits(folder):
        data = load_beir(folder, split)
        qids = list(data.queries)
        texts = [data.queries[q] for q in qids]
        queries[split] = {"ids": qids, "vecs": model.encode(texts, "query", batch_size=batch_size, device=device,
                                                           progress=progress),
                          "tokens": np.asarray(model.token_lengths(texts, "query"))}
    return FormTables(ids, full, short, np.asarray(model.token_lengths(full_texts, "passage")),
                      np.asarray(model.token_lengths(short_texts, "passage")),
                      int(model.settings.passage_max_length), queries)


def tables_path(cache: str | Path, model_name: str, set_name: str) -> Path:
    return Path(cache) / model_name / f"{set_name}.pt"


def cached_tables(cache: str | Path, model_name: str, folder: str | Path, load_model, **encode_kwargs) -> FormTables:
    """The tables from the cache, else encoded (`load_model()` builds the model only when needed) and cached."""
    from magclip.io import atomic_torch_save, safe_torch_load

    path = tables_path(cache, model_name, Path(folder).name)
    if path.is_file():
        return FormTables.from_dict(safe_torch_load(path))
    tables = encode_tables(load_model(), folder, **encode_kwargs)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_torch_save(tables.to_dict(), path)
    return tables


@dataclass
class ModelSpec:
    """One model to score: its name on the page and where it loads from (a BiEncoder folder or `minilm`)."""

    name: str
    path: str

    @classmethod
    def parse(cls, value: str) -> ModelSpec:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--model {value!r}: expected NAME=PATH (e.g. zero_shot=minilm)")
        return cls(name, path)


def encode_all(models: Sequence[ModelSpec], folders: Sequence[str | Path], cache: str | Path, *,
               query_max_length: int | None = None, passage_max_length: int | None = None, batch_size: int = 64,
               progress: bool = False, cached_only: bool = False) -> dict[str, dict[str, FormTables]]:
    """{model: {set: tables}}, each encoded once into `cache` (see `cached_tables`); the max lengths, when
    given, apply to every model (the trained models' own: 64 / 160), so only the weights differ.
    `cached_only`: a model is left out of the sets it has no cached tables for (logged), none is encoded."""
    from magclip.models.text import BiEncoder

    out: dict[str, dict[str, FormTables]] = {}
    for spec in models:
        loaded: list[Any] = []

        def load(spec=spec, loaded=loaded):
            if not loaded:
                log.info("loading %s from %s", spec.name, spec.path)
                loaded.append(BiEncoder.from_pretrained(spec.path, query_max_length=query_max_length,
                                                        passage_max_length=passage_max_length))
            return loaded[0]

        out[spec.name] = {}
        for folder in folders:
            if cached_only and not tables_path(cache, spec.name, Path(folder).name).is_file():
                log.warning("%s has no cached tables for %s: left out of that set (--cached-only)", spec.name,
                            Path(folder).name)
                continue
            log.info("tables of %s on %s", spec.name, Path(folder).name)
            out[spec.name][Path(folder).name] = cached_tables(cache, spec.name, folder, load, batch_size=batch_size,
                                                              progress=progress)
    return out


# ---------------------------------------------------------------------------------------------- variants
def assemble(tables: FormTables, replaced: Sequence[str]) -> tuple[torch.Tensor, np.ndarray]:
    """A variant's document vectors and untruncated token counts: the short row of every replaced document."""
    mask = np.zeros(len(tables.doc_ids), dtype=bool)
    index = {d: k for k, d in enumerate(tables.doc_ids)}
    mask[[index[d] for d in replaced]] = True
    vecs = torch.where(torch.from_numpy(mask)[:, None], tables.short, tables.full)
    return vecs, np.where(mask, tables.short_tokens, tables.full_tokens)


# ---------------------------------------------------------------------------------------------- residual norm
def residual_log_norm(norms: np.ndarray | torch.Tensor, tokens: np.ndarray, max_length: int) -> tuple[np.ndarray, dict[str, float]]:
    """log‖d‖ minus its least-squares fit on log n (n = tokens the encoder saw: capped at `max_length`),
    over one corpus, no judgement used; returns (residuals, {intercept, slope, r2})."""
    y = np.log(np.asarray(norms, dtype=np.float64))
    x = np.log(np.minimum(np.asarray(tokens, dtype=np.float64), max_length))
    if np.ptp(x) == 0:
        fitted = np.full_like(y, y.mean())
        slope, intercept = 0.0, float(y.mean())
    else:
        slope, intercept = np.polyfit(x, y, 1)
        fitted = intercept + slope * x
    resid = y - fitted
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((resid ** 2).sum()) / total if total > 0 else float("nan")
    return resid, {"intercept": float(intercept), "slope": float(slope), "r2": r2}


def residual_docs(doc_vecs: torch.Tensor, residual: np.ndarray, alpha: float) -> torch.Tensor:
    """Unit document vectors scaled by exp(α r): their inner product with a unit query is cos(q, d)·exp(α r)."""
    unit = torch.nn.functional.normalize(doc_vecs.float(), dim=-1)
    return unit * torch.from_numpy(np.exp(alpha * residual)).float()[:, None]


# ---------------------------------------------------------------------------------------------- scoring
@dataclass
class Searched:
    """One ranking of one query set: per-query nDCG@10 (query-id order) and the run itself."""

    ndcg: dict[str, float]
    run: dict[str, dict[str, float]]


def search_ndcg(query_vecs: torch.Tensor, doc_vecs: torch.Tensor, query_ids: Sequence[str], doc_ids: Sequence[str],
                qrels, scorer: str, exclude: Mapping[str, str] | None = None) -> Searched:
    """The top 10 under `scorer` (the same search as every BEIR evaluation) and pytrec_eval's nDCG@10 per query."""
    from magclip.metrics.ir import evaluate_run, search_run

    run, _ = search_run(query_vecs, doc_vecs, list(query_ids), list(doc_ids), scorer, 10, exclude=exclude)
    scored = evaluate_run(qrels, run, ("ndcg@10",), per_query=True)
    return Searched(scored["per_query"]["ndcg@10"], run)


def unit(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(x.float(), dim=-1)


MODES = ("cosine", "dot")
RESIDUAL = "residual"
QUARTILES = 4
# the α grid: by 0.1 within [-2, 2] (where a residual norm with a spread of ~0.1 moves rankings a little), by 0.5 beyond
ALPHAS = tuple(sorted({*np.round(np.arange(-8.0, 8.01, 0.5), 2).tolist(), *np.round(np.arange(-2.0, 2.01, 0.1), 2).tolist()}))


def share_label(share: float) -> str:
    return f"{share:g}"


@dataclass
class SetScores:
    """Everything measured on one set's variants: [choices, queries] nDCG@10 per (model, mode, share), the
    per-quartile nDCG@10 and rho(norm, length) per choice, and the residual fits."""

    name: str
    split: str
    query_ids: list[str]
    ndcg: dict[str, dict[str, dict[str, np.ndarray]]]                 # model -> mode -> share -> [S, Q]
    quartiles: dict[str, dict[str, dict[str, list[list[float]]]]]     # model -> mode -> share -> [S][bins]
    quartile_edges: dict[str, dict[str, list[list[float | None]]]]    # model -> share -> [S][upper edges]
    rho: dict[str, dict[str, list[float]]]                            # model -> share -> [S]
    fits: dict[str, dict[str, list[dict[str, float]]]]                # model -> share -> [S] residual fits


class VariantScorer:
    """Scores every variant of one BEIR set (`score`) from each model's form tables."""

    def __init__(self, folder: str | Path, split: str, tables: Mapping[str, FormTables]):
        from magclip.data.length_mix import short_forms

        self.data = load_beir(folder, split)
        self.corpus = read_corpus(folder)
        self.shorts, _ = short_forms(self.corpus)
        self.tables = tables
        self.doc_ids = list(self.corpus)
        for name, t in tables.items():
            if t.doc_ids != self.doc_ids or t.queries[split]["ids"] != list(self.data.queries):
                raise ValueError(f"the cached tables of {name} for {folder} hold other documents or queries than "
                                 "the folder: delete the cache entry and encode again")
        self.split = split

    def exclusions(self, replaced: Sequence[str]) -> dict[str, str]:
        from magclip.data.beir import identical_id_exclusions
        from magclip.data.length_mix import variant_corpus

        return identical_id_exclusions(self.data.queries, variant_corpus(self.corpus, self.shorts, replaced), "self")

    def rank(self, model: str, mode: str, replaced: Sequence[str], alpha: float = 0.0) -> tuple[Searched, np.ndarray, dict]:
        """One variant under one model and mode (`residual`: cosine × exp(α r)); also its token counts and fit."""
        t = self.tables[model]
        docs, tokens = assemble(t, replaced)
        queries = t.queries[self.split]
        fit: dict[str, float] = {}
        if mode == RESIDUAL:
            resid, fit = residual_log_norm(docs.norm(dim=-1).numpy(), tokens, t.max_length)
            docs, q, scorer = residual_docs(docs, resid, alpha), unit(queries["vecs"]), "dot"
        else:
            q, scorer = queries["vecs"], mode
        found = search_ndcg(q, docs, queries["ids"], self.doc_ids, self.data.qrels, scorer, self.exclusions(replaced))
        return found, tokens, fit

    def score_model(self, model: str, shares: Sequence[float], seeds: Sequence[int],
                    alpha: float | None = None) -> dict[str, Any]:
        """One model on every variant (JSON-able, so a later run can reuse it): per mode and share the
        [choices][queries] nDCG@10 (`residual` too when `alpha` is given), the per-quartile nDCG@10, the
        quartiles' upper edges, rho(norm, length) per choice and the residual fits."""
        from magclip.data.length_mix import replaced_ids
        from magclip.diagnostics.length import length_correlation, length_stratified_metrics

        qids = sorted(self.data.qrels)
        modes = [*MODES, *([RESIDUAL] if alpha is not None else [])]
        out: dict[str, Any] = {"query_ids": qids, "alpha": alpha, "ndcg": {m: {} for m in modes},
                               "quartiles": {m: {} for m in MODES}, "quartile_edges": {}, "rho": {}, "fits": {}}
        for share in shares:
            label = share_label(share)
            choices = [replaced_ids(self.doc_ids, share, s) for s in seeds] if share else [[]]
            for m in modes:
                rows, bins = [], []
                for replaced in choices:
                    found, tokens, fit = self.rank(model, m, replaced, alpha or 0.0)
                    rows.append([found.ndcg[q] for q in qids])
                    if m == RESIDUAL:
                        out["fits"].setdefault(label, []).append(fit)
                        continue
                    strat = length_stratified_metrics(self.data.qrels, found.run, dict(zip(self.doc_ids, tokens.tolist())),
                                                      QUARTILES)
                    bins.append([b["ndcg@10"] for b in strat["bins"]])
                    if m == MODES[0]:
                        docs, _ = assemble(self.tables[model], replaced)
                        out["rho"].setdefault(label, []).append(
                            length_correlation(docs.norm(dim=-1).numpy(), tokens)["spearman"])
                        out["quartile_edges"].setdefault(label, []).append([b["length_upto"] for b in strat["bins"]])
                out["ndcg"][m][label] = rows
                if bins:
                    out["quartiles"][m][label] = bins
        return out

    def score(self, shares: Sequence[float], seeds: Sequence[int], alphas: Mapping[str, float],
              cache: str | Path | None = None) -> SetScores:
        """Every model on every variant; with `cache`, each model's scores are kept as
        `<cache>/<model>/<set>.scores.json` and reused when shares, seeds and α match."""
        out = SetScores(self.data.name, self.split, sorted(self.data.qrels), {}, {}, {}, {}, {})
        for model in self.tables:
            got = self._cached_scores(cache, model, shares, seeds, alphas.get(model))
            out.ndcg[model] = {m: {p: np.asarray(v) for p, v in by_p.items()} for m, by_p in got["ndcg"].items()}
            out.quartiles[model], out.quartile_edges[model] = got["quartiles"], got["quartile_edges"]
            out.rho[model], out.fits[model] = got["rho"], got["fits"]
        return out

    def _cached_scores(self, cache: str | Path | None, model: str, shares: Sequence[float], seeds: Sequence[int],
                       alpha: float | None) -> dict[str, Any]:
        import json

        from magclip.io import atomic_write_json

        key = {"shares": [share_label(p) for p in shares], "seeds": list(seeds), "alpha": alpha, "split": self.split}
        path = Path(cache) / model / f"{self.data.name}.scores.json" if cache else None
        if path is not None and path.is_file():
            kept = json.loads(path.read_text())
            if kept.get("key") == key and kept["scores"]["query_ids"] == sorted(self.data.qrels):
                log.info("scores of %s on %s from %s", model, self.data.name, path)
                return kept["scores"]
        log.info("scoring %s on the variants of %s", model, self.data.name)
        scores = self.score_model(model, shares, seeds, alpha)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, {"key": key, "scores": scores})
        return scores


def choose_alpha(folder: str | Path, split: str, tables: FormTables, alphas: Sequence[float] = ALPHAS) -> tuple[float, dict[str, float]]:
    """The α of cos·exp(α r) with the best mean nDCG@10 on `split` of the unmixed corpus (ties: the smallest |α|),
    and the whole curve {α: nDCG@10}."""
    scorer = VariantScorer(folder, split, {"model": tables})
    curve = {}
    for a in alphas:
        found, _, _ = scorer.rank("model", RESIDUAL, [], a)
        curve[f"{a:g}"] = float(np.mean(list(found.ndcg.values())))
    best = max(alphas, key=lambda a: (round(curve[f"{a:g}"], 12), -abs(a)))
    return float(best), curve


# ---------------------------------------------------------------------------------------------- analysis
# (row, base) pairs of (model, mode); a contrast whose models were not scored is left out
CONTRASTS: dict[str, tuple[tuple[str, str], tuple[str, str]]] = {
    "dot_minus_cosine": (("dot", "dot"), ("cosine", "cosine")),          # the paper's comparison
    "norm_adds": (("dot", "dot"), ("dot", "cosine")),                   # the dot model's norm, its directions fixed
    "directions": (("dot", "cosine"), ("cosine", "cosine")),            # what dot training did to the directions
    "zero_shot_dot_minus_cosine": (("zero_shot", "dot"), ("zero_shot", "cosine")),
    "cosine_model_dot_minus_cosine": (("cosine", "dot"), ("cosine", "cosine")),
    "zero_shot_residual": (("zero_shot", RESIDUAL), ("zero_shot", "cosine")),
    "cosine_model_residual": (("cosine", RESIDUAL), ("cosine", "cosine")),
    "dot_model_residual": (("dot", RESIDUAL), ("dot", "cosine")),
}


def paired(diffs: np.ndarray, n_resamples: int = 10_000) -> dict[str, Any]:
    """Row − base over [choices, queries]: stats.compare (t interval over the choice seeds, bootstrap over
    queries with one draw for every seed, sign-flip p). With one choice (p = 0: the corpus itself, nothing
    was drawn) the query interval and p decide alone."""
    from magclip.experiments import stats

    d = np.atleast_2d(np.asarray(diffs, dtype=float))
    c = stats.compare(d.mean(axis=1), d, n_resamples=n_resamples).to_dict()
    if d.shape[0] == 1:
        lo, hi, p = c["item_low"], c["item_high"], c["p_items"]
        c["verdict"] = (stats.BETTER if lo > 0 else stats.WORSE) if (p < 1 - stats.CONFIDENCE and (lo > 0 or hi < 0)) \
            else stats.NO_DIFFERENCE
    return {k: c[k] for k in ("diff", "n_seeds", "n_items", "item_low", "item_high", "p_items", "seed_low",
                              "seed_high", "mde", "verdict")}


def choice_mean(rows: Sequence[Sequence[float]]) -> list[float | None]:
    """The mean over choices of per-bin values (a bin empty in every choice: None). Tied lengths can merge
    quantile bins (`quantile_edges`), so a choice may have fewer bins: its missing ones count as empty."""
    width = max(len(r) for r in rows)
    a = np.array([[np.nan if x is None else x for x in r] + [np.nan] * (width - len(r)) for r in rows], dtype=float)
    ok = np.isfinite(a)
    total, count = np.where(ok, a, 0.0).sum(axis=0), ok.sum(axis=0)
    return [float(t / c) if c else None for t, c in zip(total, count)]


def curve_point(values: np.ndarray) -> dict[str, Any]:
    """A row's nDCG@10 at one share: the mean over choices and queries, and each choice's mean."""
    return {"mean": float(values.mean()), "per_choice": [float(x) for x in values.mean(axis=1)],
            "queries": int(values.shape[1])}


def analyse_set(s: SetScores, contrasts: Mapping[str, tuple[tuple[str, str], tuple[str, str]]] = CONTRASTS,
                n_resamples: int = 10_000) -> dict[str, Any]:
    """Curves, contrasts at every share and their change from p = 0, rows' change from p = 0, length diagnostics."""
    shares = list(next(iter(next(iter(s.ndcg.values())).values())))
    out: dict[str, Any] = {"split": s.split, "queries": len(s.query_ids), "curves": {}, "change_from_0": {},
                           "contrasts": {}, "contrast_change_from_0": {}, "length": {}, "residual_fit": {}}
    for model, modes in s.ndcg.items():
        out["curves"][model] = {m: {p: curve_point(v) for p, v in by_p.items()} for m, by_p in modes.items()}
        out["change_from_0"][model] = {m: {p: paired(v - by_p["0"], n_resamples) for p, v in by_p.items() if p != "0"}
                                       for m, by_p in modes.items()}
        out["length"][model] = {
            "rho_docs": {p: float(np.mean(v)) for p, v in s.rho[model].items()},
            "quartile_upper_edges": {p: v[0] for p, v in s.quartile_edges[model].items()},
            "ndcg_by_quartile": {m: {p: choice_mean(v) for p, v in by_p.items()} for m, by_p in s.quartiles[model].items()}}
        if s.fits.get(model):
            out["residual_fit"][model] = {p: {k: float(np.mean([f[k] for f in fits])) for k in fits[0]}
                                          for p, fits in s.fits[model].items()}
    for name, ((rm, rmode), (bm, bmode)) in contrasts.items():
        if rmode not in s.ndcg.get(rm, {}) or bmode not in s.ndcg.get(bm, {}):
            continue
        d = {p: s.ndcg[rm][rmode][p] - s.ndcg[bm][bmode][p] for p in shares}
        out["contrasts"][name] = {p: paired(v, n_resamples) for p, v in d.items()}
        out["contrast_change_from_0"][name] = {p: paired(v - d["0"], n_resamples) for p, v in d.items() if p != "0"}
    return out


def prediction(analysis: Mapping[str, Any], set_name: str, share: float = 0.5,
               contrast: str = "dot_minus_cosine") -> dict[str, Any]:
    """What the curve predicts for a corpus with `share` of its records short (title-only beside abstracts):
    the contrast measured on `set_name` at that share, and its change from the unmixed corpus."""
    entry = analysis["sets"][set_name]
    label = share_label(share)
    return {"set": set_name, "share": share, "contrast": contrast, **entry["contrasts"][contrast][label],
            "change_from_0": entry["contrast_change_from_0"][contrast][label],
            "at_0": entry["contrasts"][contrast]["0"]}


def run_length_mix(folders: Sequence[str | Path], tables: Mapping[str, Mapping[str, FormTables]], *,
                   shares: Sequence[float], seeds: Sequence[int], alpha_set: str | Path, alpha_split: str = "train",
                   residual_models: Sequence[str] | None = None, alphas: Sequence[float] = ALPHAS,
                   n_resamples: int = 10_000, score_cache: str | Path | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(analysis, per-query records) over every set: α chosen per model on `alpha_set`'s `alpha_split`
    (unmixed), then every variant of every set scored on its test split (see the module docstring)."""
    alpha_name = Path(alpha_set).name
    residual_models = [m for m in (tables if residual_models is None else residual_models) if alpha_name in tables[m]]
    chosen, curves = {}, {}
    for model in residual_models:
        chosen[model], curves[model] = choose_alpha(alpha_set, alpha_split, tables[model][alpha_name], alphas)
        log.info("alpha of %s on %s/%s: %g", model, alpha_name, alpha_split, chosen[model])
    analysis: dict[str, Any] = {"shares": [share_label(p) for p in shares], "seeds": list(seeds), "sets": {},
                                "residual": {"alpha_set": alpha_name, "alpha_split": alpha_split, "alpha": chosen,
                                             "alpha_curve": curves, "alpha_grid": list(alphas)}}
    records: dict[str, Any] = {"shares": analysis["shares"], "seeds": list(seeds), "sets": {}}
    for folder in folders:
        name = Path(folder).name
        if not any(name in tables[m] for m in tables):
            log.warning("no model has tables for %s: left out", name)
            continue
        log.info("scoring the variants of %s", name)
        scorer = VariantScorer(folder, "test", {m: tables[m][name] for m in tables if name in tables[m]})
        scores = scorer.score(shares, seeds, chosen, cache=score_cache)
        analysis["sets"][name] = analyse_set(scores, n_resamples=n_resamples)
        analysis["sets"][name]["models"] = list(scorer.tables)
        analysis["sets"][name]["docs"] = len(scorer.doc_ids)
        analysis["sets"][name]["tokens"] = form_lengths(next(iter(scorer.tables.values())))
        records["sets"][name] = {"split": scores.split, "query_ids": scores.query_ids,
                                 "ndcg@10": {m: {mode: {p: np.round(v, 5).tolist() for p, v in by_p.items()}
                                                 for mode, by_p in modes.items()} for m, modes in scores.ndcg.items()}}
    return analysis, records


def form_lengths(t: FormTables) -> dict[str, Any]:
    """Median untruncated tokens of the full and the short forms, and how many short forms equal the whole."""
    return {"full_median": float(np.median(t.full_tokens)), "short_median": float(np.median(t.short_tokens)),
            "max_length": t.max_length, "over_max_full": float((t.full_tokens > t.max_length).mean()),
            "short_is_whole": int(torch.all(t.short == t.full, dim=1).sum())}


# ---------------------------------------------------------------------------------------------- figure and table
ROW_STYLES: dict[tuple[str, str], dict[str, Any]] = {
    ("zero_shot", "cosine"): {"color": "0.55", "ls": "-", "label": "zero-shot, cosine"},
    ("zero_shot", "dot"): {"color": "0.55", "ls": "--", "label": "zero-shot, dot"},
    ("cosine", "cosine"): {"color": "C0", "ls": "-", "label": "cosine-trained, cosine"},
    ("cosine", "dot"): {"color": "C0", "ls": "--", "label": "cosine-trained, dot"},
    ("dot", "dot"): {"color": "C3", "ls": "--", "label": "dot-trained, dot"},
    ("dot", "cosine"): {"color": "C3", "ls": "-", "label": "dot-trained as cosine (control)"},
    ("dot", RESIDUAL): {"color": "C2", "ls": ":", "label": "dot-trained, cos·exp(α r)"},
}
GAP_STYLES: dict[str, dict[str, Any]] = {
    "dot_minus_cosine": {"color": "C3", "label": "dot(dot-trained) − cosine(cosine-trained)"},
    "norm_adds": {"color": "C1", "label": "what the norm adds (dot − its own cosine)"},
    "directions": {"color": "C4", "label": "what the directions learned (dot-as-cosine − cosine)"},
}


def plot_curves(analysis: Mapping[str, Any], path: str | Path) -> Path:
    """One column per set: nDCG@10 of each model and mode against p (top; bars: range over the choice seeds)
    and the contrasts against p with their 95 % query interval (bottom)."""
    from magclip.diagnostics.plots import panels, save_figure

    sets = list(analysis["sets"])
    fig, axes = panels(2 * len(sets), cols=len(sets))
    shares = [float(p) for p in analysis["shares"]]
    for k, name in enumerate(sets):
        entry = analysis["sets"][name]
        top, bottom = axes[k], axes[len(sets) + k]
        for (model, mode), style in ROW_STYLES.items():
            points = entry["curves"].get(model, {}).get(mode)
            if not points:
                continue
            y = [100 * points[p]["mean"] for p in analysis["shares"]]
            lo = [100 * (points[p]["mean"] - min(points[p]["per_choice"])) for p in analysis["shares"]]
            hi = [100 * (max(points[p]["per_choice"]) - points[p]["mean"]) for p in analysis["shares"]]
            top.errorbar(shares, y, yerr=[lo, hi], marker="o", ms=3, capsize=2, **style)
        top.set_title(f"{name} ({entry['queries']} queries, {entry['docs']} docs)", fontsize=9)
        top.set_ylabel("nDCG@10 ×100")
        for contrast, style in GAP_STYLES.items():
            points = entry["contrasts"].get(contrast)
            if not points:
                continue
            y = np.array([100 * points[p]["diff"] for p in analysis["shares"]])
            bottom.plot(shares, y, marker="o", ms=3, color=style["color"], label=style["label"])
            bottom.fill_between(shares, [100 * points[p]["item_low"] for p in analysis["shares"]],
                                [100 * points[p]["item_high"] for p in analysis["shares"]], color=style["color"], alpha=0.15)
        bottom.axhline(0, color="k", lw=0.6)
        bottom.set_xlabel("share p of documents replaced by their short form")
        bottom.set_ylabel("difference ×100 (95 % CI, queries)")
    for row in (axes[:len(sets)], axes[len(sets):]):   # one legend per row with every line drawn in it
        found = {label: h for ax in row for h, label in zip(*ax.get_legend_handles_labels())}
        row[-1].legend(list(found.values()), list(found), fontsize=6.5, loc="best")
    fig.tight_layout()
    return save_figure(fig, path)


def _cell(c: Mapping[str, Any]) -> str:
    from magclip.experiments.report import interval, signed

    seeds = f"; seeds {interval(c['seed_low'], c['seed_high'], 100, 1)}" if c.get("seed_low") is not None else ""
    return f"{signed(c['diff'], 100, 1)} {interval(c['item_low'], c['item_high'], 100, 1)}{seeds}"


def markdown_report(analysis: Mapping[str, Any]) -> str:
    """The tables of the results page's section: nDCG@10 per row and share, the contrasts with their
    intervals, the residual norm against cosine, and the length diagnostics."""
    shares = analysis["shares"]
    head = "| set | model, mode | " + " | ".join(f"p = {p}" for p in shares) + " |"
    rule = "|---|---|" + "---|" * len(shares)
    lines = ["### nDCG@10 ×100 against the share p of short records (mean over choices)", "", head, rule]
    for name, entry in analysis["sets"].items():
        for (model, mode), style in ROW_STYLES.items():
            points = entry["curves"].get(model, {}).get(mode)
            if points:
                lines.append(f"| {name} | {style['label']} | "
                             + " | ".join(f"{100 * points[p]['mean']:.1f}" for p in shares) + " |")
    lines += ["", "### Differences ×100: 95 % interval over queries (the same draw for every choice); over the "
              f"{len(analysis['seeds'])} choice seeds where p > 0", "", "| set | difference | "
              + " | ".join(f"p = {p}" for p in shares) + " | change p = 0 → 0.75 |", "|---|---|" + "---|" * (len(shares) + 1)]
    for name, entry in analysis["sets"].items():
        for contrast, c in entry["contrasts"].items():
            last = entry["contrast_change_from_0"][contrast][shares[-1]]
            lines.append(f"| {name} | {contrast} | " + " | ".join(_cell(c[p]) for p in shares)
                         + f" | {_cell(last)} ({last['verdict']}) |")
    lines += ["", "### Length: ρ(norm, tokens) of the documents, and nDCG@10 ×100 by quartile of the relevant "
              "documents' length (short → long)", "", "| set | model | p | ρ(norm, tokens) | cosine by quartile "
              "| dot by quartile |", "|---|---|---|---|---|---|"]
    for name, entry in analysis["sets"].items():
        for model, length in entry["length"].items():
            for p in shares:
                q = length["ndcg_by_quartile"]
                lines.append(f"| {name} | {model} | {p} | {length['rho_docs'][p]:+.2f} | "
                             + " | ".join(" / ".join("–" if x is None else f"{100 * x:.1f}" for x in q[m][p]) for m in MODES) + " |")
    return "\n".join(lines) + "\n"
