"""The body of eval/diagnose.py: magnitude diagnostics, length confounds and the Fisher predictor for
a text bi-encoder or a CLIP model, written to OUT/diagnostics.json with PNG plots. `args` are the
command's options (`magclip.cli.diagnose.build_parser`); the statistics themselves live in
magclip.diagnostics (`magnitude`, `length`, `fisher`), the floor below this one."""

from __future__ import annotations

import copy
import datetime as dt
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import magclip
from magclip.diagnostics import fisher as fim
from magclip.diagnostics import magnitude as mag
from magclip.diagnostics.length import length_report, plot_norm_vs_length
from magclip.diagnostics.plots import pyplot, save_figure
from magclip.diagnostics.specificity import DETAIL_BINS
from magclip.diagnostics.specificity import PREFIX as SPECIFICITY
from magclip.io import atomic_write_json

log = logging.getLogger("magclip.diagnose")
SPECTRUM_FLOOR = 1e-18  # plotted eigenvalue ratios below this are drawn at it


def run_diagnostics(args) -> dict[str, Any]:
    """Every diagnostic `args` asks for; writes OUT/diagnostics.json and the plots, returns the record."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.text_model:
        res = run_text(args, out)
    elif args.checkpoint or args.model:
        res = run_clip(args, out)
    else:
        res = {"kind": "metrics"}
    res.setdefault("plots", [])
    if res.get("fisher"):
        res["plots"].append(str(plot_fisher_spectra(res["fisher"], out / "fisher_spectrum.png")))
    if args.metrics:
        p = mag.plot_training_curves(args.metrics, out / "training.png", title=str(args.metrics))
        res["metrics"] = args.metrics
        if p:
            res["plots"].append(str(p))
    res["magclip_version"] = magclip.__version__
    res["date"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    atomic_write_json(out / "diagnostics.json", res)
    return res


def _scale_specs(values: list[str]) -> list[Any]:
    out: list[Any] = []
    for v in values:
        out.append(v if v in ("default", "matched") else float(v))
    return out


def _set_batchnorm(model: nn.Module, mode: str) -> nn.Module:
    """A copy whose BatchNorm layers use batch statistics ("batch"), or the model itself ("eval")."""
    if mode != "batch":
        return model
    return fim.use_batch_statistics_(copy.deepcopy(model).eval())


def run_text(args, out: Path) -> dict[str, Any]:
    from magclip.data.beir import load_beir
    from magclip.evaluation.text import SideCache, beir_token_lengths, retrieve, text_scorers
    from magclip.models.text import BiEncoder

    if not args.beir:
        raise ValueError("--text-model needs --beir FOLDER")
    model = BiEncoder.from_pretrained(args.text_model)
    data = load_beir(args.beir, args.split)
    if args.max_queries or args.max_docs:
        data = data.subset(args.max_queries, args.max_docs)
    scorer = text_scorers(model, [args.mode] if args.mode else None, args.gamma_q, args.gamma_d)[0]
    res: dict[str, Any] = {"kind": "text", "model": args.text_model, "data": args.beir, "split": args.split,
                           "max_queries": args.max_queries, "max_docs": args.max_docs}
    if not args.skip_magnitude:
        title = f"{args.text_model} on {data.name} ({scorer.mode})"
        encode = SideCache(model, args.batch_size, args.device)
        found = retrieve(encode, data.queries, dict(zip(data.corpus, data.doc_texts())), scorer, 100)
        relevance = mag.relevance_from_ids(found.query_ids, found.doc_ids, data.qrels)
        summary, samples = mag.magnitude_report(found.query_vecs, found.doc_vecs, relevance, scorer, k=args.k,
                                                n_boot=args.n_boot, seed=args.seed)
        summary["data"] = {"name": data.name, "split": data.split, "queries": len(found.query_ids),
                           "docs": len(found.doc_ids), "relevant_pairs": int(sum(len(r) for r in relevance))}
        res["magnitude"] = summary
        _magnitude_plots(summary, samples, out, title, res)
        if args.length_bins:
            q_len, d_len = beir_token_lengths(model, data)
            res["length"], length_samples = length_report(found, data.qrels, q_len, d_len, scorer,
                                                          n_bins=args.length_bins, k=args.k,
                                                          max_length=model.settings.passage_max_length,
                                                          relevance_samples=samples["doc_side"])
            res["plots"].append(str(plot_norm_vs_length(length_samples, out / "norm_vs_length.png", title)))
    if not args.skip_fisher:
        q, d, qids, _dids = fim.beir_pairs(data, args.fisher_pairs or 48, seed=args.seed)
        res["fisher"] = {}
        for spec in _scale_specs(args.logit_scale):
            log.info("fisher: %d pairs, logit scale %s", len(q), spec)
            r = fim.text_fisher(model, q, d, modes=args.fisher_modes, doc_to_query=args.doc_to_query,
                                block=_block(args.block), logit_scale=spec, dtype=getattr(torch, args.fisher_dtype),
                                rtol=args.rtol, candidates=args.candidates, device=args.device)
            r["setup"]["query_ids"] = qids
            res["fisher"][str(spec)] = r
    return res


def run_clip(args, out: Path) -> dict[str, Any]:
    from magclip.data.eval_sets import resolve_eval_set
    from magclip.data.shards import build_clip_loader
    from magclip.evaluation.checkpoint import load_checkpoint, load_open_clip
    from magclip.evaluation.clip import encode_loader, first_samples

    random_init = False
    if args.checkpoint:
        model = load_checkpoint(args.checkpoint, mode=args.mode, gamma_q=args.gamma_q, gamma_d=args.gamma_d,
                                device=args.device)
        metrics = args.metrics
        if metrics is None:
            for parent in Path(model.source["checkpoint"]).parents[:3]:
                if (parent / "metrics.jsonl").is_file():
                    metrics = str(parent / "metrics.jsonl")
                    break
        args.metrics = metrics
    else:
        model = load_open_clip(args.model, args.pretrained, mode=args.mode, gamma_q=args.gamma_q,
                               gamma_d=args.gamma_d, device=args.device)
        random_init = model.source["pretrained"] is None  # local-dir: and hf-hub: names bring their own weights
    matching = args.matching or "caption"
    if args.synthetic:
        from magclip.data.synthetic import ensure_synthetic
        urls = ensure_synthetic().val_urls
    elif args.data:
        eval_set = resolve_eval_set("data", args.data, matching=args.matching, caption_key=args.caption_key,
                                    where="--data")
        if eval_set.urls is None:
            raise ValueError(f"--data {args.data}: {eval_set.layout.replace('_', ' ')} sets are not read by the CLIP "
                             "diagnostics; give shards or a CLIP_benchmark folder")
        urls, matching = eval_set.urls, eval_set.matching
    else:
        raise ValueError("CLIP needs --data SHARDS or --synthetic")
    bn = args.batchnorm if args.batchnorm != "auto" else ("batch" if random_init else "eval")
    res: dict[str, Any] = {"kind": "clip", "model": model.model_name, "checkpoint": model.source.get("checkpoint"),
                           "pretrained": model.source.get("pretrained"), "random_init": random_init, "data": urls,
                           "scorers": {d: s.to_dict() for d, s in model.scorers.items()}, "batchnorm": bn,
                           "matching": matching}
    if not args.skip_magnitude:
        clip = _set_batchnorm(model.clip, bn)
        loader = build_clip_loader(urls, preprocess=model.preprocess, tokenizer=model.tokenizer,
                                   batch_size=max(args.batch_size, 128), num_samples=None, shuffle=False, workers=0,
                                   rank=0, world_size=1, drop_last=False, caption_key=args.caption_key or "txt",
                                   all_captions=True)
        enc = first_samples(encode_loader(clip, _take(loader, args.max_samples), args.device), args.max_samples)
        summary, samples = mag.clip_magnitude_report(enc["image_features"], enc["text_features"], enc["captions"],
                                                     model.scorers, k=args.k, n_boot=args.n_boot, seed=args.seed,
                                                     caption_counts=enc["caption_counts"], matching=matching)
        res["magnitude"] = summary
        _magnitude_plots(summary, samples, out, f"{model.model_name} ({res['scorers']['i2t']['mode']})", res)
        specificity = _specificity(enc, model.scorers)
        if specificity:
            res["specificity"] = specificity
    if not args.skip_fisher:
        images, texts, caps = fim.clip_pairs(urls, model.preprocess, model.tokenizer, args.fisher_pairs or 128)
        res["fisher"] = {}
        for spec in _scale_specs(args.logit_scale):
            log.info("fisher: %d pairs, logit scale %s", len(caps), spec)
            res["fisher"][str(spec)] = fim.clip_fisher(
                model.clip, images, texts, modes=args.fisher_modes, directions=args.directions,
                block=_block(args.block), logit_scale=spec, dtype=getattr(torch, args.fisher_dtype), rtol=args.rtol,
                candidates=args.candidates, batchnorm=bn, device=args.device)
    return res


def _specificity(enc: dict[str, Any], scorers) -> dict[str, Any]:
    """The caption-specificity numbers (empty without caption_detail in KEY.json, or with several captions per
    image)."""
    from magclip.evaluation.clip import retrieval_from_features, with_specificity

    metrics = retrieval_from_features(enc["image_features"], enc["text_features"], enc["captions"], scorers,
                                      caption_counts=enc["caption_counts"])
    with_specificity(metrics, enc, scorers)
    return {key[len(SPECIFICITY):]: value for key, value in metrics.items() if key.startswith(SPECIFICITY)}


def _take(loader, n: int):
    seen = 0
    for batch in loader:
        yield batch
        seen += len(batch["keys"])
        if seen >= n:
            return


def _block(values: list[str]):
    return values[0] if len(values) == 1 and values[0] in ("projection", "all") else values


def _magnitude_plots(summary, samples, out: Path, title: str, res: dict) -> None:
    res.setdefault("plots", [])
    res["plots"].append(str(mag.plot_norm_histograms(samples, summary, out / "norm_hist.png", title)))
    res["plots"].append(str(mag.plot_norm_vs_rank(samples, summary, out / "norm_vs_rank.png", title)))


def plot_fisher_spectra(fisher: dict[str, Any], path: Path) -> Path | None:
    """Normalized eigenvalues (lambda / lambda_max) per mode, one panel per logit-scale rule."""
    if not fisher:
        return None
    plt = pyplot()

    fig, axes = plt.subplots(1, len(fisher), figsize=(5.5 * len(fisher), 3.8), squeeze=False)
    for ax, (rule, r) in zip(axes[0], fisher.items()):
        for mode, m in r["modes"].items():
            ev = np.asarray(m["eigenvalues"])
            if ev.size and ev[0] > 0:
                ax.semilogy(np.arange(1, ev.size + 1), np.maximum(ev / ev[0], SPECTRUM_FLOOR),
                            label=f"{mode}: κ={m['kappa']:.3g} ({m['n_nonnull']} non-null)")
            ax.axhline(m["rtol"], color="grey", lw=0.5, ls=":")
        ax.set_ylim(SPECTRUM_FLOOR / 2, 2)
        ax.set_xlabel("eigenvalue index")
        ax.set_ylabel(f"λ / λmax (floored at {SPECTRUM_FLOOR:g})")
        ax.set_title(f"logit scale: {rule}; recommends {r['recommendation']['mode']}", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path)


def format_summary(res: dict[str, Any]) -> str:
    lines = [f"{res['kind']} model {res.get('model')}  data {res.get('data')}"]
    m = res.get("magnitude")
    if m:
        for side, stats in m["norms"].items():
            lines.append(f"  {side:9s} norm  mean {stats['mean']:.3f}  std {stats['std']:.3f}  cv {stats['cv']:.3f}  "
                         f"(n={stats['n']})")
        for key in ("doc_side", "query_side"):
            s = m[key]
            d = s["doc_topk"]
            lines.append(f"  Cohen's d, {s['candidates']} norms, relevant vs top-{s['k']} non-relevant "
                         f"({s['scorer']['mode']}): {d['d']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}] "
                         f"(n={d['n_a']}/{d['n_b']})")
            c = s.get("doc_corpus")
            if c and "ci_low" in c:
                lines.append(f"  Cohen's d, {s['candidates']} norms, relevant to any query vs the rest of the corpus: "
                             f"{c['d']:+.3f} [{c['ci_low']:+.3f}, {c['ci_high']:+.3f}]")
    sp = res.get("specificity")
    if sp:
        lines.append(f"  caption specificity ({sp['samples_with_detail']} samples with caption_detail): "
                     f"Spearman(text norm, detail) {sp['rho_text_norm_detail']:+.3f} "
                     f"[{sp['rho_text_norm_detail_ci_low']:+.3f}, {sp['rho_text_norm_detail_ci_high']:+.3f}], "
                     f"Spearman(image norm, objects) {sp['rho_image_norm_objects']:+.3f}, Cohen's d of text norms "
                     f"detailed vs vague {sp['d_text_norm_detailed_vs_vague']:+.3f}")
        for direction in ("image_to_text", "text_to_image"):
            if f"{direction}_match_norm_gap" not in sp:
                continue
            bins = " / ".join(f"{100 * sp[f'{direction}_R@1_{name}']:.1f}" for name, _, _ in DETAIL_BINS)
            lines.append(f"  {direction}: R@1 vague / partial / detailed {bins}; log norm of the match - its "
                         f"top competitors {sp[f'{direction}_match_norm_gap']:+.3f} (match longer for "
                         f"{100 * sp[f'{direction}_match_longer_share']:.0f}% of queries)")
    ln = res.get("length")
    if ln:
        rho, w, st = ln["norm_length"], ln["within_bin_d"], ln["stratified"]
        lines.append(f"  Spearman(norm, tokens): documents {rho['documents']['spearman']:+.3f}, "
                     f"queries {rho['queries']['spearman']:+.3f}")
        lines.append(f"  Cohen's d of document norms: plain {w['d_plain']:+.3f}, within {ln['n_bins']} length bins "
                     f"{w['d_within']:+.3f}")
        bins = " / ".join(f"{100 * b['ndcg@10']:.1f}" for b in st["bins"])
        lines.append(f"  nDCG@10 by document length (short -> long): {bins}  (slope {100 * st['ndcg@10_slope']:+.2f} "
                     f"per bin); top-10 median length / corpus {ln['retrieved_length']['ratio_to_corpus']:.2f}")
    for rule, r in (res.get("fisher") or {}).items():
        rec = r["recommendation"]
        kap = "  ".join(f"{mode} {v['kappa']:.3g} (scale {v['logit_scale']:.3g}, {v['n_nonnull']} nn)"
                        for mode, v in r["modes"].items())
        lines.append(f"  Fisher κ [{rule} scale, {r['setup']['rows']} rows, {r['setup']['block']['n_params']} params]: "
                     f"{kap}")
        ratio = rec.get("kappa_ratio")
        lines.append(f"    -> recommends {rec['mode']} (κ ratio {ratio:.3g}; common-k check "
                     f"{'agrees' if rec.get('agree') else 'DISAGREES'}; picks per rtol "
                     f"{rec.get('mode_at_rtol')}: {'STABLE' if rec.get('stable') else 'UNSTABLE'}; "
                     f"best overall {rec['best_overall']})" if ratio else f"    -> recommends {rec['mode']}")
    return "\n".join(lines)
