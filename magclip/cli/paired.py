"""Two evaluated models, query by query: ROW − BASE with a bootstrap CI and a permutation p.

    python eval/paired.py runs/full/scifact_zero_shot.json runs/full/scifact_cosine_s0.json \
        --base-prefix scifact.modes.cosine. --row-prefix scifact.     # a checkpoint against its start
    python eval/paired.py results/beir_a.json results/beir_b.json --out results/b_minus_a.json
    python eval/paired.py runs/text/results.json runs/text/results.json --base-prefix zero_shot. \
        --row-prefix metrics.                                          # a training run against its start

Each side is an evaluation output with its per-query file beside it (`<stem>.queries.npz`: nDCG,
recall, MRR, MAP per query; answer recall per question). Keys pair by name, or with the base's
--base-prefix replaced by --row-prefix; keys evaluated on other queries are listed, not paired.
One run per side measures the evaluation set's noise only: a decided difference is about these two
models on these queries; a claim about settings needs seeds (eval/compare.py). Values in the table
×100; --out writes the raw records (a list, and `by_key`: the same by the row's key, for a results page).
"""

from __future__ import annotations

import argparse

from magclip.cli import as_command, check_paths
from magclip.experiments import stats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", help="evaluation output (results JSON or its .queries.npz) subtracted")
    parser.add_argument("row", help="evaluation output compared with it")
    parser.add_argument("--base-prefix", default="", help="only the base's keys under this prefix")
    parser.add_argument("--row-prefix", default="", help="replaces --base-prefix to name the row's key")
    parser.add_argument("--resamples", type=int, default=stats.N_RESAMPLES, help="bootstrap and permutation draws")
    parser.add_argument("--out", help="JSON file for the paired records")
    args = parser.parse_args(argv)
    check_paths(args, "base", "row")

    from magclip.experiments.paired import as_records, compare_outputs, markdown_table
    from magclip.io import atomic_write_json

    found, skipped = compare_outputs(args.base, args.row, args.base_prefix, args.row_prefix, args.resamples)
    print(markdown_table(found))
    for line in skipped:
        print(f"not paired: {line}")
    if args.out:
        atomic_write_json(args.out, {"base": args.base, "row": args.row, "base_prefix": args.base_prefix,
                                     "row_prefix": args.row_prefix, "paired": as_records(found),
                                     "by_key": {r["row_key"]: r for r in as_records(found)},
                                     "not_paired": skipped})
        print(f"paired records: {args.out}")


console = as_command(main)

if __name__ == "__main__":
    console()
