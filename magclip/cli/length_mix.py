"""The length-mixing control: a share p of each BEIR set's documents replaced by a short form of itself
(title, else first sentence; magclip/data/length_mix.py), queries and judgements unchanged, scored per
query for every model and mode (magclip/experiments/length_mix.py).

    # the variant folders (BEIR layout, one per p and seed, with replaced.jsonl and length_mix.json)
    python eval/length_mix.py --data ../shared/data/text/{scifact,cranfield,med,xquad_en} \
        --variants .cache/length_mix/variants
    # score the zero-shot MiniLM and the 1,500-step cosine- and dot-trained models on every variant
    python tools/keep_grid_records.py --grid configs/compare/text_squad_long.yaml --restore docs/data/text_squad_long
    python eval/length_mix.py --data ../shared/data/text/{scifact,cranfield,med,xquad_en} \
        --variants .cache/length_mix/variants --cache .cache/length_mix/tables \
        --model zero_shot=minilm \
        --model cosine=runs/compare/text_squad_long/models/loss=cosine,seed=0 \
        --model dot=runs/compare/text_squad_long/models/loss=dot,seed=0 \
        --alpha-set scifact --predict-on scifact \
        --out docs/results_text_length_mix.json --records docs/data/text_length_mix/per_query.json \
        --report docs/results_text_length_mix.md --figure docs/text_length_mix.png

Each model encodes each corpus's full and short forms once (`--cache`, reused by a later invocation);
every variant is assembled from the two tables, which is exact because a document's short form does not
depend on p or the seed. --query-max-length/--passage-max-length (default 64 / 160, the trained models'
own) apply to every model, so the zero-shot model differs from the trained ones by its weights only.
Scoring uses each set's test qrels; α of the residual-norm score is chosen on --alpha-set's train split.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from magclip.cli import as_command, check_paths

DEFAULT_SHARES = (0.0, 0.25, 0.5, 0.75)
DEFAULT_SEEDS = (0, 1, 2, 3, 4)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", nargs="+", required=True, help="BEIR folders")
    parser.add_argument("--variants", help="write the variant folders under this folder (<set>/p=..,seed=..)")
    parser.add_argument("--shares", nargs="+", type=float, default=list(DEFAULT_SHARES), help="shares p (%(default)s)")
    parser.add_argument("--seeds", nargs="+", type=int, default=list(DEFAULT_SEEDS), help="choice seeds (%(default)s)")
    parser.add_argument("--model", action="append", default=[], metavar="NAME=PATH",
                        help="a model to score (repeat); NAME zero_shot, cosine and dot name the page's contrasts")
    parser.add_argument("--cache", default=".cache/length_mix/tables", help="the encoded full/short tables and each model's scores per set, "
                        "kept under the model's NAME (clear it when a NAME points to another model)")
    parser.add_argument("--query-max-length", type=int, default=64)
    parser.add_argument("--passage-max-length", type=int, default=160)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--cached-only", action="store_true",
                        help="encode nothing: each model is scored on the sets it has cached tables for")
    parser.add_argument("--alpha-set", help="the --data folder name whose train split chooses α (default: the first "
                                            "with qrels/train.tsv)")
    parser.add_argument("--predict-on", help="the set whose p = 0.5 point is the prediction (default: --alpha-set)")
    parser.add_argument("--resamples", type=int, default=10_000, help="bootstrap and permutation draws")
    parser.add_argument("--out", help="the analysis JSON (curves, intervals, residual norm, prediction)")
    parser.add_argument("--records", help="the per-query nDCG@10 of every model, mode and variant (JSON)")
    parser.add_argument("--report", help="the Markdown tables")
    parser.add_argument("--figure", help="the PNG figure")
    args = parser.parse_args(argv)
    check_paths(args, "data")
    if 0 not in args.shares:
        raise ValueError("--shares must include 0 (every change is measured from the unmixed corpus)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    if args.variants:
        from magclip.data.length_mix import write_variants

        for folder in args.data:
            m = write_variants(folder, args.variants, args.shares, args.seeds)
            print(f"{Path(folder).name}: {len(m['variants'])} variants in {Path(args.variants) / Path(folder).name} "
                  f"(short forms by rule {m['short_forms']['by_rule']}, {m['short_forms']['short_is_whole']} equal "
                  "to the whole record)")
    if args.model:
        score(args)


def score(args) -> None:
    from magclip.experiments.length_mix import (
        ModelSpec,
        encode_all,
        markdown_report,
        plot_curves,
        prediction,
        run_length_mix,
    )
    from magclip.io import atomic_write_json, atomic_write_text

    names = {Path(f).name: f for f in args.data}
    alpha_set = args.alpha_set or next((n for n, f in names.items() if (Path(f) / "qrels" / "train.tsv").is_file()), None)
    if alpha_set not in names:
        raise ValueError(f"--alpha-set {alpha_set!r}: not one of the --data folders ({', '.join(names)}), or no "
                         "folder has qrels/train.tsv")
    models = [ModelSpec.parse(m) for m in args.model]
    tables = encode_all(models, args.data, args.cache, query_max_length=args.query_max_length,
                        passage_max_length=args.passage_max_length, batch_size=args.batch_size,
                        cached_only=args.cached_only)
    analysis, records = run_length_mix(args.data, tables, shares=args.shares, seeds=args.seeds,
                                       alpha_set=names[alpha_set], n_resamples=args.resamples,
                                       score_cache=args.cache)
    predict_on = args.predict_on or alpha_set
    if 0.5 in args.shares and "dot_minus_cosine" in analysis["sets"].get(predict_on, {}).get("contrasts", {}):
        analysis["prediction"] = prediction(analysis, predict_on, 0.5)
    analysis["models"] = {m.name: m.path for m in models}
    analysis["max_lengths"] = {"query": args.query_max_length, "passage": args.passage_max_length}
    report = markdown_report(analysis)
    print(report)
    if args.out:
        atomic_write_json(args.out, analysis)
    if args.records:
        Path(args.records).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.records, json.dumps(records, separators=(",", ":")) + "\n")  # compact: ~2 MB
    if args.report:
        atomic_write_text(args.report, report)
    if args.figure:
        plot_curves(analysis, args.figure)
    print(f"results: {args.out or '(no --out)'}")


console = as_command(main)

if __name__ == "__main__":
    console()
