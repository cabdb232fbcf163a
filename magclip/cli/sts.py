"""Evaluate a text bi-encoder on STS: Spearman (and Pearson) between model scores and gold scores.

    python eval/sts.py --model minilm --data ../shared/data/text/stsb --out results/stsb_minilm.json
    python eval/sts.py --model minilm --data ../shared/data/text/stsb --mode cosine dot qnorm dnorm \
        --out results/stsb_modes.json
    python eval/sts.py --model runs/text_qnorm/checkpoints/step_00000100/model --data ../shared/data/text/stsb/dev.tsv \
        --out results/stsb_dev_qnorm.json

--data takes STS folders (their `<split>.tsv` is read; the entry is named after the folder) or TSV
files (named after the file). Each pair is scored s(a, b) with a on the query side and b on the
passage side, and s(b, a); the JSON reports `spearman_ab`, `spearman_ba`, and `spearman` (= the
correlation of the mean score (s(a,b) + s(b,a)) / 2), with the same three for Pearson; 0-1 scale.
For symmetric modes (cosine, dot) with a shared tower the three coincide. Beside the JSON,
`<out stem>.queries.npz` keeps the per-pair scores (`<name>.pred_ab`, `.pred_ba`) and the gold scores
(`.gold`), from which the compare report bootstraps Spearman over pairs. Other options as in
eval/beir.py.
"""

import argparse
import logging
from dataclasses import asdict

from magclip.cli import as_command, check_paths
from magclip.cli.text_args import device_of, load_model_and_scorers, model_arguments, parse_args
from magclip.metrics.ranks import write_results_with_outcomes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(parser)
    parser.add_argument("--data", nargs="+", required=True, help="STS folder(s) or TSV file(s)")
    args = parse_args(parser, argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_paths(args, "data")  # before the model loads

    from magclip.evaluation.text import evaluate_sts_files, format_sts_table

    model, scorers = load_model_and_scorers(args)
    results = evaluate_sts_files(model, args.data, scorers, split=args.split, batch_size=args.batch_size,
                                 device=device_of(args), progress=args.progress)
    for entry in results.values():
        entry["model"] = args.model
        entry["settings"] = asdict(model.settings)
    write_results_with_outcomes(args.out, results)  # per-query outcomes beside it: <stem>.queries.npz / .ranks.npz
    print(format_sts_table(results))
    print(f"results: {args.out}")


console = as_command(main)  # the installed command and the launcher: expected errors in one line

if __name__ == "__main__":
    console()
