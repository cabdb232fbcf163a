"""Fine-tune a text bi-encoder (query -> document retrieval) with a magnitude-aware similarity.

    python train/text.py --config configs/text/scifact.yaml                      # MiniLM on SciFact train, cosine
    python train/text.py --config configs/text/scifact.yaml loss.mode=qnorm train.max_steps=50 name=qnorm_50
    python train/text.py --config configs/text/scifact.yaml loss.mode=dot data.group_size=2 data.random_negatives=4
    python train/text.py --config configs/text/scifact.yaml data.beir=null data.train=pairs.jsonl
    python train/text.py --config configs/text/scifact.yaml train.resume=latest
    torchrun --nproc_per_node 2 train/text.py --config configs/text/scifact.yaml   # 2 processes on CPU (gloo)
    accelerate launch --config_file configs/accelerate/multi_gpu.yaml train/text.py --config configs/text/scifact.yaml \\
        loss.mode=qnorm

Training pairs from a BEIR split (JSONL of {query, positive: [..], negatives: [..]}):

    python train/text.py --make-pairs runs/scifact_train.jsonl --beir ../shared/data/text/scifact
    python train/text.py --make-pairs runs/scifact_train_rand4.jsonl --beir ../shared/data/text/scifact --random-negatives 4
    python train/text.py --make-pairs runs/scifact_train_hn4.jsonl --beir ../shared/data/text/scifact \
        --mine-with minilm --mode cosine --negatives 4 --skip-top 3      # hard negatives retrieved by MiniLM
    python train/text.py --make-pairs runs/squad_train_hn.jsonl --beir ../shared/data/text/squad_train \
        --sample 20000 --mine-with minilm --negatives 3 --skip-top 2     # 20,000 random SQuAD questions
    python train/text.py --make-pairs runs/squad_train_hn_all.jsonl --beir ../shared/data/text/squad_train \
        --negatives-from docs/data/squad_train_hn_all.ids.jsonl.gz      # the committed mining, replayed (~1 min)
    python train/text.py --config configs/text/scifact.yaml data.beir=null data.train=runs/scifact_train_hn4.jsonl \
        data.group_size=3

Mined negatives are the best-ranked documents not judged for the query (any grade), after skipping
the first --skip-top of them (unjudged near-duplicates of positives are the usual false negatives).

Training data: `data.train` (JSONL or tar shards of {query, positive, negatives}) or `data.beir`
(a BEIR folder; its `data.beir_split` qrels become pairs). Negatives: every document of the global
batch (all ranks) plus `data.group_size - 1` hard negatives per query. Each checkpoint holds
`model/`, loadable by `SentenceTransformer(path)` and by eval/beir.py / eval/sts.py (which then
score with the run's mode). Overrides are dotted `key=value` pairs; unknown keys are errors.
"""

import argparse
import logging
from pathlib import Path

from magclip.cli import UsageError, as_command, check_inputs
from magclip.config import load_text_config


def make_pairs(args) -> None:
    if not args.beir:
        raise UsageError("--make-pairs needs --beir FOLDER")
    if args.negatives_from:
        from magclip.evaluation.mining import pairs_from_negative_ids

        rows = pairs_from_negative_ids(args.beir, args.negatives_from, args.split, min_score=args.min_score,
                                       out=args.make_pairs)
    elif args.mine_with:
        import torch

        from magclip.evaluation.mining import mine_hard_negatives
        from magclip.models.text import BiEncoder

        rows = mine_hard_negatives(BiEncoder.from_pretrained(args.mine_with), args.beir, args.split, args.mode,
                                   negatives=args.negatives, skip_top=args.skip_top, depth=args.depth,
                                   min_score=args.min_score, out=args.make_pairs, progress=True,
                                   device="cuda" if torch.cuda.is_available() else "cpu", sample=args.sample,
                                   seed=args.sample_seed)
        if args.save_ids:
            from magclip.evaluation.mining import write_negative_ids

            write_negative_ids(rows, args.save_ids)
    else:
        from magclip.data.beir import beir_to_pairs

        rows = beir_to_pairs(args.beir, args.split, args.make_pairs, min_score=args.min_score,
                             random_negatives=args.random_negatives, sample=args.sample, seed=args.sample_seed)
    print(f"{len(rows)} pair records -> {args.make_pairs}")


def main(argv: list[str] | None = None, default_config: str | Path | None = None) -> None:
    """`default_config`: the YAML used without --config (a checkout's launcher passes configs/text/scifact.yaml)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=default_config, help="experiment YAML (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.max_steps=20")
    pairs = parser.add_argument_group("making pairs instead of training (--make-pairs OUT.jsonl)")
    pairs.add_argument("--make-pairs", metavar="OUT", help="write pairs from --beir's --split qrels and exit")
    pairs.add_argument("--beir", help="BEIR folder")
    pairs.add_argument("--split", default="train")
    pairs.add_argument("--min-score", type=int, default=1, help="lowest relevance that counts as positive")
    pairs.add_argument("--random-negatives", type=int, default=0, help="random unjudged documents per query")
    pairs.add_argument("--mine-with", metavar="MODEL", help="retrieve hard negatives with this model (e.g. minilm)")
    pairs.add_argument("--mode", default="cosine", help="scoring mode for mining (default: %(default)s)")
    pairs.add_argument("--negatives", type=int, default=4, help="mined negatives per query")
    pairs.add_argument("--skip-top", type=int, default=0, help="unjudged top results skipped before mining")
    pairs.add_argument("--save-ids", metavar="IDS.jsonl.gz", help="also write the mined negatives' ids alone "
                       "(small enough to commit; --negatives-from rebuilds the pairs from them)")
    pairs.add_argument("--negatives-from", metavar="IDS.jsonl.gz", help="the negatives a --save-ids file chose, "
                       "instead of mining again")
    pairs.add_argument("--depth", type=int, default=100, help="search depth for mining")
    pairs.add_argument("--sample", type=int, help="that many queries drawn at random, not all (a split's order "
                                                   "follows its source: its head is a few topics)")
    pairs.add_argument("--sample-seed", type=int, default=0, help="seed of --sample and of --random-negatives")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.make_pairs:
        make_pairs(args)
        return
    cfg = load_text_config(args.config, args.overrides)
    check_inputs(cfg)  # bad input is reported before torch is imported
    from magclip.training.preemption import StopGuard

    # listening before torch loads: a stop signal during the imports ends the command with exit 75 too
    with StopGuard(cfg.train.save_on_signal, cfg.train.time_limit):
        _train_text(cfg)


def _train_text(cfg) -> None:
    from magclip.distributed import rank
    from magclip.training.text import format_train_table, train_text

    results = train_text(cfg)
    if rank() == 0:
        print(format_train_table(results))
        print(f"model folder: {results['final_model']}")
        print(f"run directory: {results['run_dir']}")


console = as_command(main)  # the installed command and the launcher: expected errors in one line

if __name__ == "__main__":
    console()
