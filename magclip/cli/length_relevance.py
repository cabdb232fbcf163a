"""Length × relevance: short records drawn at p_non among the non-relevant and p_rel among the relevant
documents, p_non ∈ {0.25, 0.5, 0.75} × p_rel ∈ {0, p_non/2, p_non}, scored per query for every model and
mode, with the prediction at p_non = 0.55, p_rel = 0.2 (magclip/experiments/length_relevance.py).

    python tools/keep_grid_records.py --grid configs/compare/text_squad_long.yaml --restore docs/data/text_squad_long
    python tools/keep_grid_records.py --grid configs/compare/text_squad_pooling.yaml --restore docs/data/text_squad_pooling
    python eval/length_relevance.py --data ../shared/data/text/{scifact,cranfield,med,xquad_en} \
        --cache .cache/length_mix/tables \
        --model cosine=runs/compare/text_squad_long/models/loss=cosine,seed=0 \
        --model dot=runs/compare/text_squad_long/models/loss=dot,seed=0 \
        --model learned=runs/compare/text_squad_pooling/models/pooling=learned,seed=0 \
        --model sqrt_len=runs/compare/text_squad_pooling/models/pooling=mean_sqrt_len,seed=0 \
        --sqrt-len dot --resamples 2000 \
        --out docs/results_text_length_relevance.json --records docs/data/text_length_relevance/per_query.json \
        --report docs/results_text_length_relevance.md --figure docs/text_length_relevance.png \
        --figure-predictions docs/text_length_relevance_predictions.png

The form tables are the length-mixing control's (`--cache` is shared with eval/length_mix.py: each model
encodes each corpus once). `--sqrt-len NAME` adds the model NAME under sum/√n pooling (NAME@sqrt_len), computed
exactly from its mean-pooled tables; every model besides zero_shot, cosine and dot gets the contrasts
"NAME dot − cosine (cosine-trained)", "NAME as cosine − cosine (cosine-trained)" and "NAME dot − dot
(mean-pooled, dot-trained)". The report ends with what every model's document norm carries
(magclip/experiments/norm_signal.py: its correlation with length, Cohen's d of relevant vs other documents,
and that d at equal length).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from magclip.cli import as_command, check_paths

BASE_MODELS = ("zero_shot", "cosine", "dot")


NORMS_HEADING = ("\n#### What the document norm carries (every full record and its short form: the texts the "
                 "surface ranks; relevant: judged by some test query; 95 % bootstrap intervals over documents)\n\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", nargs="+", required=True, help="BEIR folders")
    parser.add_argument("--model", action="append", default=[], required=True, metavar="NAME=PATH")
    parser.add_argument("--sqrt-len", action="append", default=[], metavar="NAME",
                        help="also score model NAME under sum/sqrt(n) pooling (exact, from its tables)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="choice seeds (%(default)s)")
    parser.add_argument("--cache", default=".cache/length_mix/tables", help="form tables and scores, per model NAME")
    parser.add_argument("--query-max-length", type=int, default=64)
    parser.add_argument("--passage-max-length", type=int, default=160)
    parser.add_argument("--cached-only", action="store_true", help="encode nothing; use the cached tables only")
    parser.add_argument("--resamples", type=int, default=10_000)
    parser.add_argument("--out")
    parser.add_argument("--records")
    parser.add_argument("--report")
    parser.add_argument("--figure")
    parser.add_argument("--figure-predictions", help="each model's dot − cosine at p_non = 0.55, p_rel = 0.2, per set")
    args = parser.parse_args(argv)
    check_paths(args, "data")
    if len(args.seeds) < 2:
        raise ValueError("--seeds: at least 2 choice seeds (the interval over choices needs them)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from magclip.experiments.length_mix import ModelSpec, encode_all
    from magclip.experiments.length_relevance import (
        CONTRASTS,
        markdown_report,
        plot_predictions,
        plot_surface,
        run_surface,
        sqrt_len_tables,
    )
    from magclip.experiments.norm_signal import markdown_table as norm_table
    from magclip.experiments.norm_signal import signals_by_set
    from magclip.io import atomic_write_json, atomic_write_text

    models = [ModelSpec.parse(m) for m in args.model]
    tables = encode_all(models, args.data, args.cache, query_max_length=args.query_max_length,
                        passage_max_length=args.passage_max_length, cached_only=args.cached_only)
    for name in args.sqrt_len:
        if name not in tables:
            raise ValueError(f"--sqrt-len {name}: not one of the --model names ({', '.join(tables)})")
        tables[f"{name}@sqrt_len"] = {s: sqrt_len_tables(t, args.query_max_length) for s, t in tables[name].items()}
    contrasts = dict(CONTRASTS)
    labels = {"dot_minus_cosine": "dot (dot-trained) − cosine (cosine-trained)",
              "directions": "dot-trained as cosine − cosine-trained (control)",
              "norm_adds": "dot-trained: dot − its own cosine",
              "zero_shot_dot_minus_cosine": "zero-shot: dot − cosine"}
    if "zero_shot" in tables:
        contrasts["zero_shot_dot_minus_cosine"] = (("zero_shot", "dot"), ("zero_shot", "cosine"))
    for name in tables:
        if name not in BASE_MODELS:
            contrasts[f"{name}:dot_minus_cosine"] = ((name, "dot"), ("cosine", "cosine"))
            contrasts[f"{name}:directions"] = ((name, "cosine"), ("cosine", "cosine"))
            labels[f"{name}:dot_minus_cosine"] = f"{name}, dot − cosine (cosine-trained)"
            labels[f"{name}:directions"] = f"{name} as cosine − cosine-trained (control)"
            if "dot" in tables:
                contrasts[f"{name}:minus_mean_dot"] = ((name, "dot"), ("dot", "dot"))
                labels[f"{name}:minus_mean_dot"] = f"{name}, dot − dot (mean-pooled, dot-trained)"
    analysis, records = run_surface(args.data, tables, seeds=args.seeds, contrasts=contrasts, cache=args.cache,
                                    n_resamples=args.resamples)
    analysis["models"] = {m.name: m.path for m in models}
    analysis["sqrt_len"] = list(args.sqrt_len)
    analysis["labels"] = labels
    analysis["norms"] = signals_by_set(args.data, tables)
    analysis["norms_full_records"] = signals_by_set(args.data, tables, forms="full")
    report = markdown_report(analysis, labels) + NORMS_HEADING + norm_table(analysis["norms"])
    print(report)
    if args.out:
        atomic_write_json(args.out, analysis)
    if args.records:
        Path(args.records).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.records, json.dumps(records, separators=(",", ":")) + "\n")
    if args.report:
        atomic_write_text(args.report, report)
    costs = ["dot_minus_cosine", *[f"{n}:dot_minus_cosine" for n in tables if n not in BASE_MODELS]]
    if args.figure:
        plot_surface(analysis, args.figure, [costs[0], "directions", *costs[1:]], labels)
    if args.figure_predictions:
        plot_predictions(analysis, args.figure_predictions, [*costs, "directions"], labels)


console = as_command(main)

if __name__ == "__main__":
    console()
