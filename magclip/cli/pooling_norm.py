"""Where the norm's length prior comes from: ‖mean pooled‖ against n tokens for each model, beside token
states shuffled across texts, the closed-form independent-directions curve and CLS pooling, on the same
texts (magclip/experiments/pooling_norm.py).

    python tools/keep_grid_records.py --grid configs/compare/text_squad_long.yaml --restore docs/data/text_squad_long
    python eval/pooling_norm.py --data ../shared/data/text/scifact \
        --model zero_shot=minilm \
        --model cosine=runs/compare/text_squad_long/models/loss=cosine,seed=0 \
        --model dot=runs/compare/text_squad_long/models/loss=dot,seed=0 \
        --out docs/results_text_pooling_norm.json --report docs/results_text_pooling_norm.md \
        --figure docs/text_pooling_norm.png
"""

from __future__ import annotations

import argparse
import logging

from magclip.cli import as_command, check_paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="a BEIR folder whose documents give the texts")
    parser.add_argument("--model", action="append", required=True, metavar="NAME=PATH", help="a model (repeat)")
    parser.add_argument("--per-form", type=int, default=400, help="documents drawn; each as title, first sentence, whole")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--passage-max-length", type=int, default=160)
    parser.add_argument("--out", help="the JSON (statistics, binned curves, per-text norms)")
    parser.add_argument("--report", help="the Markdown table")
    parser.add_argument("--figure", help="the PNG figure")
    args = parser.parse_args(argv)
    check_paths(args, "data")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from magclip.experiments.length_mix import ModelSpec
    from magclip.experiments.pooling_norm import (
        markdown_table,
        measure_model,
        plot_pooling_norm,
        sample_texts,
    )
    from magclip.io import atomic_write_json, atomic_write_text
    from magclip.models.text import BiEncoder

    forms = sample_texts(args.data, args.per_form, args.seed)
    texts = [t for form in forms.values() for t in form if t.strip()]
    result = {"data": args.data, "per_form": args.per_form, "seed": args.seed, "forms": {k: len(v) for k, v in forms.items()},
              "passage_max_length": args.passage_max_length, "models": {}}
    for spec in map(ModelSpec.parse, args.model):
        logging.getLogger("magclip.pooling_norm").info("token states of %s", spec.name)
        model = BiEncoder.from_pretrained(spec.path, passage_max_length=args.passage_max_length)
        result["models"][spec.name] = measure_model(model, texts, args.seed)
    report = markdown_table(result)
    print(report)
    if args.out:
        atomic_write_json(args.out, result)
    if args.report:
        atomic_write_text(args.report, report)
    if args.figure:
        plot_pooling_norm(result, args.figure)


console = as_command(main)

if __name__ == "__main__":
    console()
